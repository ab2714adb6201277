"""Cost of qmatmul's streaming tiles (block types, q8 activations) per call at T = 1..4 tokens, on SmolLM2-135M's
shapes: what continuous batching pays for decoding T sequences in one step instead of one.

    python benchmarks/qtiles.py [--threads 2] [--rounds 7] [--calls 200] [--types Q4_1,Q4_0,Q8_0] [--src DIR] [--json]

Shapes (rows x cols): qkv 1728x576, wo 576x576, gate+up 3072x576, down 576x1536 in each --types type, and the output
head 49152x576 in Q8_0. The weights of one shape are a few MB and stay in the last-level cache, as a decode step's do
on a machine with a large L3 (the whole model is ~100 MB), so this times the kernels' arithmetic, not DRAM. Each
sample is --calls calls in a row; rounds interleave the token counts; figures are medians over rounds of us per call,
and the ratio T=k / T=1 is the median of per-round ratios. gemm_min_t is forced huge so that every T takes the tiles.

--src DIR imports pinfer_llm from DIR (another checkout's src/, e.g. an older commit's, to compare builds: the
kernels are compiled from that tree's C++ sources).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from qblocks import weights

TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
SHAPES = [("qkv", 1728, 576), ("wo", 576, 576), ("gate+up", 3072, 576), ("down", 576, 1536)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--types", default="Q4_1,Q4_0,Q8_0")
    ap.add_argument("--tokens", default="1,2,3,4")
    ap.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, args.src)
    from pinfer_llm.runtime.cpu import kernels as cpu_kernels

    assert cpu_kernels.available(), cpu_kernels.status()
    torch.set_num_threads(args.threads)
    ops = torch.ops.pinfer
    Ts = [int(t) for t in args.tokens.split(",")]
    cases = [(f"{label} {rows}x{cols} {name}", rows, cols, TYPES[name])
             for name in args.types.split(",") for label, rows, cols in SHAPES]
    cases.append(("head 49152x576 Q8_0", 49152, 576, TYPES["Q8_0"]))
    report = []
    for label, rows, cols, t in cases:
        w = weights(rows, cols, t, rows + cols + t)
        x = torch.randn(max(Ts), cols)
        fns = {T: (lambda T=T, x=x, w=w, t=t: ops.qmatmul(x[:T], [w], [t], 1 << 30)) for T in Ts}
        for f in fns.values():
            for _ in range(10):
                f()
        us = {T: [] for T in Ts}
        for r in range(args.rounds):
            order = Ts[r % len(Ts):] + Ts[: r % len(Ts)]
            for T in order:
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    fns[T]()
                us[T].append((time.perf_counter() - t0) / args.calls * 1e6)
        row = {"case": label, "threads": args.threads,
               "us": {T: statistics.median(v) for T, v in us.items()},
               "vs T=1": {T: statistics.median([a / b for a, b in zip(us[T], us[Ts[0]], strict=True)])
                          for T in Ts[1:]}}
        report.append(row)
        if not args.json:
            print(f"{label:28s} " + "  ".join(f"T={T} {row['us'][T]:8.1f} us" for T in Ts)
                  + "   " + "  ".join(f"T={T}/T=1 {v:.2f}x" for T, v in row["vs T=1"].items()), flush=True)
    if args.json:
        print(json.dumps({"isa": cpu_kernels.status(), "rows": report}, indent=1))


if __name__ == "__main__":
    main()
