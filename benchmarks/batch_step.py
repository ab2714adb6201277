"""What a batched decode step costs per row: Model.run_rows over T sequences' decode rows, T = 1, 2, 4, 8.

    python benchmarks/batch_step.py [--models smollm2,planted] [--rows 1,2,4,8] [--steps 60] [--rounds 3]
                                    [--threads 2] [--src DIR] [--json]

pi-serve decodes its slots together (continuous batching, runtime/generation/batch.py): one forward over every
sequence's last token per step, each in its own KV cache. How far that multiplies throughput is T x (step of 1 row)
/ (step of T rows), the batch's ceiling before the server's own costs (sampling, streaming, the clients). Each round
fills T caches with a 40-token prompt, then times --steps steps of T decode rows (the first 10 are not counted),
for every T in turn; reported: the median step time per T over rounds, and `T x one / T rows` per T. Models:
SmolLM2-135M Q4_1 (dense: the rows share every weight read) and the planted ReLU model of
benchmarks/sparsity_demo.py with its predictors (--sparse: the FFN runs once over the union of the rows' neurons,
each row masked to its own, runtime/cpu/csrc/sparse_ffn.cpp; the union grows with T, as the share printed says).

--src DIR imports pinfer_llm from DIR (another checkout's src/, e.g. an older commit's), to compare two trees.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def step_ms(m, T: int, steps: int) -> float:
    """Median ms of a decode step of T rows, T sequences after a 40-token prompt each."""
    ids = m.tokenizer.encode("Once upon a time there was a fox and a dog who lived by the river. " * 4)[:40]
    caches = [m.new_cache() for _ in range(T)]
    for c in caches:
        m.run_rows(ids, list(range(len(ids))), [c] * len(ids), [])
    times = []
    for s in range(steps):
        toks = [(ids[(s + 5 * i) % len(ids)] + i) % m.cfg.vocab_size for i in range(T)]
        t0 = time.perf_counter()
        m.run_rows(toks, [len(ids) + s] * T, caches, list(range(T)))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[10:]) * 1e3


def measure(name: str, path: str, kw: dict, args) -> dict:
    from pinfer_llm.runtime import load_model

    m = load_model(path, threads=args.threads, **kw)
    if not m.batchable():
        raise SystemExit(f"{name}: this model's rows cannot be batched (row_invariant off or GPU layers)")
    rows = [int(t) for t in args.rows.split(",")]
    step_ms(m, max(rows), 12)  # warm-up
    per = {T: [] for T in rows}
    for r in range(args.rounds):
        for T in (rows if r % 2 == 0 else rows[::-1]):
            per[T].append(step_ms(m, T, args.steps))
    med = {T: statistics.median(v) for T, v in per.items()}
    one = med.get(1)
    share = None
    if kw.get("ffn_mode") == "sparse":
        s = m.sparsity()
        share = round(statistics.mean(s), 4) if s else None
    return {"model": name, "step_ms": {str(T): round(v, 3) for T, v in med.items()},
            "throughput_over_one": {str(T): round(T * one / v, 3) for T, v in med.items()} if one else None,
            "neurons_computed_share": share, "rounds": args.rounds, "steps": args.steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,planted", help="comma list of smollm2, planted")
    ap.add_argument("--rows", default="1,2,4,8", help="row counts T (include 1 for the ratios)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--src", default=str(ROOT / "src"), help="import pinfer_llm from this src/ directory")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, args.src)
    sys.path.insert(1, str(ROOT / "benchmarks"))
    import sparsity_demo as sd

    out = [measure(label, path, kw, args) for label, path, kw in sd.bench_models(args.models, args.threads)]
    if args.json:
        print(json.dumps({"threads": args.threads, "src": args.src, "results": out}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"batched decode step, {args.threads} threads, median of {args.rounds} rounds")
    for col in ("model", "rows", "step", "T x one / step", "neurons computed"):
        t.add_column(col)
    for r in out:
        for T, ms in r["step_ms"].items():
            ratio = r["throughput_over_one"][T] if r["throughput_over_one"] else "-"
            t.add_row(r["model"], T, f"{ms} ms", f"{ratio}x", "" if r["neurons_computed_share"] is None
                      else f"{r['neurons_computed_share']:.1%} (all steps)")
    Console().print(t)


if __name__ == "__main__":
    main()
