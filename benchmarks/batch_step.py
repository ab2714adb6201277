"""What a batched decode step costs per row: Model.run_rows over T sequences' decode rows, T = 1, 2, 4, 8.

    python benchmarks/batch_step.py [--models smollm2,planted] [--rows 1,2,4,8] [--steps 60] [--rounds 3]
                                    [--threads 2] [--depth 40] [--src DIR] [--against DIR] [--json]

pi-serve decodes its slots together (continuous batching, runtime/generation/batch.py): one forward over every
sequence's last token per step, each in its own KV cache. How far that multiplies throughput is T x (step of 1 row)
/ (step of T rows), the batch's ceiling before the server's own costs (sampling, streaming, the clients). T caches
hold a --depth-token prompt (default 40; filled once, see `filled`); each round times --steps steps of T decode rows
after it (the first 10 are not counted), for every T in turn; reported: the median step time per T over rounds,
`T x one / T rows` per T, and with predictors the share of neurons whose rows a step of T rows read (the union of
the rows' own).
Models: SmolLM2-135M Q4_1 (dense: the rows share every weight read) and the planted ReLU model of
benchmarks/sparsity_demo.py with its predictors (--sparse: the FFN runs once over the union of the rows' neurons,
each row masked to its own, runtime/cpu/csrc/sparse_ffn.cpp; the union grows with T, as the share printed says).

--src DIR imports pinfer_llm from DIR (another checkout's src/, e.g. an older commit's). --against DIR compares two
trees side by side: the model loaded once per tree, in two worker processes, their steps alternated round by round
(the order flipping each round), and reported per row count: each tree's median step, this tree's time over the
other's (median of per-round ratios) and each tree's `T x one / T rows` (median of per-round ratios). Sequential
runs of one tree and then the other scatter with the machine by more than the changes measured here.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


_FILLED: dict = {}  # (model, depth) -> (the prompt's ids, caches holding it)


def filled(m, T: int, depth: int) -> tuple[list[int], list]:
    """At least T caches holding the same `depth`-token prompt, filled once per model and depth: a round's steps write
    the positions after the prompt, each before any step reads it, so the next round (of any T, on the first T caches)
    may write them again. Refilling the caches every round was most of the benchmark's time at --depth 1000."""
    ids, caches = _FILLED.get((id(m), depth), (None, []))
    if ids is None:
        text = "Once upon a time there was a fox and a dog who lived by the river. "
        ids = m.tokenizer.encode(text * (depth // 8 + 4))[:depth]
    while len(caches) < T:
        c = m.new_cache()
        for i in range(0, len(ids), 32):  # in chunks of 32 rows: below the kernels' GEMM crossover
            chunk = ids[i:i + 32]
            m.run_rows(chunk, list(range(i, i + len(chunk))), [c] * len(chunk), [])
        caches.append(c)
    _FILLED[(id(m), depth)] = (ids, caches)
    return ids, caches[:T]


def step_ms(m, T: int, steps: int, depth: int = 40) -> float:
    """Median ms of a decode step of T rows, T sequences after a `depth`-token prompt each."""
    ids, caches = filled(m, T, depth)
    times = []
    for s in range(steps):
        toks = [(ids[(s + 5 * i) % len(ids)] + i) % m.cfg.vocab_size for i in range(T)]
        t0 = time.perf_counter()
        m.run_rows(toks, [len(ids) + s] * T, caches, list(range(T)))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[10:]) * 1e3


def load(path: str, kw: dict, args):
    from pinfer_llm.runtime import load_model

    need = args.depth + args.steps + 16
    return load_model(path, threads=args.threads, ctx_size=need if need > 2048 else None, **kw)


def measure(name: str, path: str, kw: dict, args) -> dict:
    m = load(path, kw, args)
    if not m.batchable():
        raise SystemExit(f"{name}: this model's rows cannot be batched (row_invariant off or GPU layers)")
    rows = [int(t) for t in args.rows.split(",")]
    step_ms(m, max(rows), 12)  # warm-up
    per = {T: [] for T in rows}
    read = {T: [0, 0] for T in rows}  # (layer passes, neurons whose rows they read) of T-row steps, with predictors
    for r in range(args.rounds):
        for T in (rows if r % 2 == 0 else rows[::-1]):
            before = m.read_counts() or []
            per[T].append(step_ms(m, T, args.steps, args.depth))
            for (n0, r0), (n1, r1) in zip(before, m.read_counts() or [], strict=False):
                read[T][0] += n1 - n0
                read[T][1] += r1 - r0
    med = {T: statistics.median(v) for T, v in per.items()}
    one = med.get(1)
    share = None
    if kw.get("ffn_mode") == "sparse":
        s = m.sparsity()
        share = round(statistics.mean(s), 4) if s else None
    per_step = {str(T): round(r / (n * m.cfg.n_ff), 4) for T, (n, r) in read.items() if n} or None
    return {"model": name, "step_ms": {str(T): round(v, 3) for T, v in med.items()},
            "throughput_over_one": {str(T): round(T * one / v, 3) for T, v in med.items()} if one else None,
            "neurons_computed_share": share, "neurons_read_per_step": per_step, "rounds": args.rounds,
            "steps": args.steps}


def worker(args) -> None:
    """--worker: load one model from --src, then answer "T STEPS" lines on stdin with step_ms on stdout."""
    import sparsity_demo as sd

    label, path, kw = sd.bench_models(args.models, args.threads)[0]
    m = load(path, kw, args)
    if not m.batchable():
        raise SystemExit(f"{label}: this model's rows cannot be batched (row_invariant off or GPU layers)")
    step_ms(m, 4, 12)  # warm-up
    print(json.dumps({"ready": label}), flush=True)
    for line in sys.stdin:
        T, steps = map(int, line.split())
        print(json.dumps(step_ms(m, T, steps, args.depth)), flush=True)


def against(args) -> list[dict]:
    """Each model in two workers (--src and --against), steps alternated round by round."""
    rows = [int(t) for t in args.rows.split(",")]
    out = []
    for name in args.models.split(","):
        procs = []
        try:
            for src in (args.src, args.against):
                p = subprocess.Popen([sys.executable, __file__, "--worker", "--src", src, "--models", name,
                                      "--threads", str(args.threads), "--depth", str(args.depth)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
                procs.append(p)
                line = p.stdout.readline()
                if not line:
                    raise SystemExit(f"the worker for {src} ({name}) did not start")
                label = json.loads(line)["ready"]
            ms = {(i, T): [] for i in range(2) for T in rows}
            for r in range(args.rounds):
                for T in rows:
                    for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                        procs[i].stdin.write(f"{T} {args.steps}\n")
                        procs[i].stdin.flush()
                        ms[(i, T)].append(float(procs[i].stdout.readline()))
        finally:
            for p in procs:
                p.stdin.close()
                p.wait(60)
        med = statistics.median
        res = {"model": label, "rounds": args.rounds, "steps": args.steps, "rows": {}}
        for T in rows:
            a, b = ms[(0, T)], ms[(1, T)]
            res["rows"][str(T)] = {"step_ms": round(med(a), 3), "against_step_ms": round(med(b), 3),
                                   "over_against": round(med([x / y for x, y in zip(a, b, strict=True)]), 3)}
            if 1 in rows:
                for i, key in ((0, "throughput_over_one"), (1, "against_throughput_over_one")):
                    res["rows"][str(T)][key] = round(med([T * o / t for o, t in
                                                          zip(ms[(i, 1)], ms[(i, T)], strict=True)]), 3)
        out.append(res)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,planted", help="comma list of smollm2, planted")
    ap.add_argument("--rows", default="1,2,4,8", help="row counts T (include 1 for the ratios)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depth", type=int, default=40, help="each sequence's prompt before the timed steps (its cache "
                    "is that deep): attention's share grows with it")
    ap.add_argument("--src", default=str(ROOT / "src"), help="import pinfer_llm from this src/ directory")
    ap.add_argument("--against", metavar="DIR", help="another src/ directory, measured side by side (see above)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.against:
        res = against(args)
        if args.json:
            print(json.dumps({"threads": args.threads, "src": args.src, "against": args.against, "results": res},
                             indent=2))
            return
        for r in res:
            print(f"{r['model']}, {args.threads} threads, {args.depth} deep, {r['rounds']} paired rounds of "
                  f"{r['steps']} steps:")
            for T, v in r["rows"].items():
                tp = (f"; T x one / step {v['throughput_over_one']}x against {v['against_throughput_over_one']}x"
                      if "throughput_over_one" in v else "")
                print(f"  {T} rows: {v['step_ms']} ms against {v['against_step_ms']} ms = {v['over_against']}x{tp}")
        return
    sys.path.insert(0, args.src)
    sys.path.insert(1, str(ROOT / "benchmarks"))
    # pinfer_llm from --src, before sparsity_demo (which otherwise puts this checkout's src/ first on the path)
    pinfer_llm = importlib.import_module("pinfer_llm")
    import sparsity_demo as sd

    if not Path(pinfer_llm.__file__).resolve().is_relative_to(Path(args.src).resolve()):
        raise SystemExit(f"--src {args.src}: pinfer_llm was imported from {pinfer_llm.__file__}")
    if args.worker:
        worker(args)
        return

    out = [measure(label, path, kw, args) for label, path, kw in sd.bench_models(args.models, args.threads)]
    if args.json:
        print(json.dumps({"threads": args.threads, "src": args.src, "results": out}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"batched decode step, {args.threads} threads, median of {args.rounds} rounds")
    for col in ("model", "rows", "step", "T x one / step", "neurons computed per token", "read per step"):
        t.add_column(col)
    for r in out:
        for T, ms in r["step_ms"].items():
            ratio = r["throughput_over_one"][T] if r["throughput_over_one"] else "-"
            read = (r["neurons_read_per_step"] or {}).get(T)
            t.add_row(r["model"], T, f"{ms} ms", f"{ratio}x", "" if r["neurons_computed_share"] is None
                      else f"{r['neurons_computed_share']:.1%} (all steps)", "" if read is None else f"{read:.1%}")
    Console().print(t)


if __name__ == "__main__":
    main()
