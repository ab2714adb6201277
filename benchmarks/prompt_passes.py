"""The CPU's share of a prompt against the size of the passes it is cut into (planner/memory.py GPU_CHUNK).

    python benchmarks/prompt_passes.py MODEL [--tokens 512] [--passes 32,64,128,512] [--rounds 3] [--threads 2]
                                             [--mode sparse] [--json]

A hybrid prompt runs in passes of GPU_CHUNK tokens so that the GPU's activations fit the workspace pi-plan reserves;
the CPU computes its neurons (and the attention of its layers) pass by pass. This times the CPU path's forward over
the same prompt cut into passes of each size, in rotated order each round, and reports the median time and the
median over rounds of (time in passes of the first size) / (time in passes of this size). The device's share is
not in it: that needs a GPU (benchmarks/gpu_e2e.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

_TREE = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_TREE), str(_TREE / "src")]  # the checkout, without an install

from pinfer_llm.runtime import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--passes", default="32,64,128,512")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mode", default="sparse", choices=["sparse", "dense"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sizes = [int(s) for s in args.passes.split(",")]
    m = load_model(args.model, ffn_mode=args.mode, ctx_size=max(args.tokens, 512), threads=args.threads)
    tr, n = m.transformer, args.tokens
    ids = torch.randint(3, min(m.cfg.vocab_size, 30000), (n,), generator=torch.Generator().manual_seed(0))

    def run(c: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            for s in range(0, n, c):
                tr.forward(ids[s:s + c], s)
        return time.perf_counter() - t0

    run(sizes[0])  # warm-up: page cache, kernels, thread pool
    times: dict[int, list[float]] = {c: [] for c in sizes}
    for r in range(args.rounds):
        for c in sizes[r % len(sizes):] + sizes[:r % len(sizes)]:
            times[c].append(run(c))
    rows = [{"pass_tokens": c, "median_s": round(statistics.median(v), 3), "rounds_s": [round(x, 3) for x in v],
             "speedup_over_first": round(statistics.median(a / b for a, b in zip(times[sizes[0]], v, strict=True)),
                                         3)} for c, v in times.items()]
    if args.json:
        print(json.dumps({"model": str(args.model), "tokens": n, "threads": args.threads, "mode": args.mode,
                          "rows": rows}))
        return
    print(f"{args.model.name}: a {n}-token prompt, {args.mode}, {args.threads} threads, {args.rounds} rounds")
    for r in rows:
        print(f"  passes of {r['pass_tokens']:4d}: {r['median_s']:7.2f} s  {r['speedup_over_first']:.2f}x "
              f"passes of {sizes[0]}")


if __name__ == "__main__":
    main()
