"""What row-invariant numerics cost: a prompt's prefill, and decode, with Model.row_invariant on and off.

    python benchmarks/row_invariance.py [--models smollm2,planted] [--tokens 256] [--rounds 5] [--threads 2]
                                        [--src DIR] [--json]

Row-invariant numerics (the default, docs/serving.md) make a token's logits the same bits whether it is prefilled in
a chunk of any length, decoded alone or batched beside other requests' rows: prompts are prefilled in chunks below
the kernels' GEMM crossover, attention runs row by row, and a sparse FFN runs its batch-invariant kernel over the
union of a chunk's neurons (runtime/cpu/csrc/sparse_ffn.cpp). Off, a prompt takes the fp32 GEMM and SDPA in chunks of
512. This loads each model once and times, each round and in alternating order, one prefill of the same prompt with
the flag on and one with it off (generate with max_tokens=1 from an empty cache), then 64 greedy decode tokens each
way. Reported: median times and tok/s, and the median over rounds of (off time / on time): 1.0 means invariance is
free. Models: SmolLM2-135M Q4_1 (dense), and the planted ReLU model of benchmarks/sparsity_demo.py with its
predictors (--sparse, made into build/ on first use).

--src DIR imports pinfer_llm from DIR (another checkout's src/, e.g. an older commit's), to compare two trees' costs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def prompt_ids(m, n: int) -> list[int]:
    """n tokens of English (the tokenizer's own ids where it has them; a planted model's bytes otherwise)."""
    text = ("The quick brown fox jumps over the lazy dog while the river runs past the old mill and the children "
            "count the boats that drift toward the sea. ") * 40
    ids = m.tokenizer.encode(text)
    return ids[:n]


def timed(m, ids: list[int], on: bool, max_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode tok/s) of one greedy generation from an empty cache, row_invariant = on."""
    m.row_invariant = on
    m.cached_ids = []
    list(m.generate(ids, max_tokens=max_tokens, temperature=0.0, stop_ids=set(), reuse_prefix=False))
    st = m.stats
    # decode_s runs from the prompt's end to the last token: the first token's sampling, then max_tokens - 1 steps
    decode = (st.decode_tokens - 1) / st.decode_s if st.decode_tokens > 1 and st.decode_s > 0 else 0.0
    return st.prompt_s, decode


def measure(name: str, path: str, kw: dict, args) -> dict:
    from pinfer_llm.runtime import load_model

    m = load_model(path, threads=args.threads, **kw)
    ids = prompt_ids(m, args.tokens)
    short = ids[:16]
    timed(m, ids[:64], True, 8), timed(m, ids[:64], False, 8)  # warm-up: pages, kernels' buffers
    pre = {True: [], False: []}
    dec = {True: [], False: []}
    ratios, dratios = [], []
    for r in range(args.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        got = {on: timed(m, ids, on, 1)[0] for on in order}
        for on in order:
            pre[on].append(got[on])
        ratios.append(got[False] / got[True])
        d = {on: timed(m, short, on, 64)[1] for on in order}
        for on in order:
            dec[on].append(d[on])
        dratios.append(d[True] / d[False])
    share = None
    if kw.get("ffn_mode") == "sparse":
        s = m.sparsity()
        share = round(statistics.mean(s), 4) if s else None
    return {"model": name, "tokens": len(ids),
            "prefill_on_s": round(statistics.median(pre[True]), 4),
            "prefill_off_s": round(statistics.median(pre[False]), 4),
            "prefill_on_tps": round(len(ids) / statistics.median(pre[True]), 1),
            "prefill_off_tps": round(len(ids) / statistics.median(pre[False]), 1),
            "prefill_off_over_on": round(statistics.median(ratios), 3),
            "decode_on_tps": round(statistics.median(dec[True]), 1),
            "decode_off_tps": round(statistics.median(dec[False]), 1),
            "decode_on_over_off": round(statistics.median(dratios), 3),
            "neurons_computed_share": share, "rounds": args.rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,planted", help="comma list of smollm2, planted")
    ap.add_argument("--tokens", type=int, default=256, help="prompt tokens (default 256)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--src", default=str(ROOT / "src"), help="import pinfer_llm from this src/ directory")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, args.src)
    sys.path.insert(1, str(ROOT / "benchmarks"))
    # pinfer_llm from --src, before sparsity_demo (which otherwise puts this checkout's src/ first on the path)
    pinfer_llm = importlib.import_module("pinfer_llm")
    import sparsity_demo as sd

    if not Path(pinfer_llm.__file__).resolve().is_relative_to(Path(args.src).resolve()):
        raise SystemExit(f"--src {args.src}: pinfer_llm was imported from {pinfer_llm.__file__}")

    out = [measure(label, path, kw, args) for label, path, kw in sd.bench_models(args.models, args.threads)]
    if args.json:
        print(json.dumps({"threads": args.threads, "src": args.src, "results": out}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"row_invariant on vs off, {args.threads} threads, median of {args.rounds} paired rounds")
    for col in ("model", "prompt", "prefill on", "prefill off", "off/on", "decode on", "decode off", "on/off"):
        t.add_column(col)
    for r in out:
        t.add_row(r["model"], str(r["tokens"]), f"{r['prefill_on_tps']} tok/s", f"{r['prefill_off_tps']} tok/s",
                  f"{r['prefill_off_over_on']}x", f"{r['decode_on_tps']} tok/s", f"{r['decode_off_tps']} tok/s",
                  f"{r['decode_on_over_off']}x")
    Console().print(t)
    print("off/on: prefill time with invariance off over on (1.0: invariance is free); on/off: decode tok/s ratio")


if __name__ == "__main__":
    main()
