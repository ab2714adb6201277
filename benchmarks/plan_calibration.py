"""Calibrate the planner's CPU cost model against measured pi-run decode times, and report how close it gets.

    python benchmarks/plan_calibration.py                 # SmolLM2 (demo model) + a planted-sparsity model, 2 threads
    python benchmarks/plan_calibration.py --planted m.gguf --tokens 16 --rounds 3 --no-save --json

Measured: seconds per decoded token of runtime.load_model(path, threads=N) + m.generate(ids, max_tokens=...,
temperature=0.0), the fastest of a few rounds after a warm-up (other processes only ever add time), for
  - the demo model, SmolLM2-135M Q4_1 (dense SwiGLU), after a short and after a long prompt,
  - a planted model (synth: ReLU, known per-neuron frequencies, F32), dense, short and long prompt,
  - the planted model with exact ("oracle") masks: the runtime reads the gate row of every neuron and the up and
    down rows of the active ones.
Predicted: the cost model's CPU-only time of each run from the bytes and operators it says the CPU touches
(costmodel.cpu_work; for the oracle run, the runtime's own split of dense and sparse rows), with the three CPU
constants fitted by calibration.fit on the dense runs. Printed: measured vs fitted, leave-one-out (each dense run
predicted by a fit to the others), and the oracle run predicted out of sample. The fit is saved to the cache for
this machine's CPU (`pi-plan calibration` shows it) unless --no-save.

Threads: torch's OpenMP threads spin at barriers, so on a machine whose cores are busy with other work, 2 threads
can be 40x slower than 1. The benchmark prints the load average and warns when it exceeds the free cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

_TREE = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_TREE), str(_TREE / "src")]  # the checkout, without an install

from pinfer_llm.planner import calibration  # noqa: E402
from pinfer_llm.planner.activations import Activations  # noqa: E402
from pinfer_llm.planner.hardware import CPU, Hardware, cpu_name, detect_cores  # noqa: E402
from pinfer_llm.planner.machine import cpu_bandwidth, save_calibration, this_cpu_key  # noqa: E402
from pinfer_llm.planner.plan import Plan  # noqa: E402
from pinfer_llm.planner.problem import build_problem  # noqa: E402

PROMPT = "Once upon a time, in a small village by the sea, there lived"


def planted_model(path: Path) -> Path:
    """A ReLU model with planted activation frequencies, big enough that weights dominate a token (~0.5 GB)."""
    if path.exists():
        return path
    from pinfer_llm.synth import SynthSpec, generate

    spec = SynthSpec(n_layer=8, n_embd=1024, n_ff=2816, n_head=16, n_head_kv=4, dtype="f32", sparsity=0.85,
                     skew=1.0, seed=0, calib_tokens=1024, name="planted-8x1024")
    t0 = time.perf_counter()
    generate(path, spec)
    print(f"generated {path} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return path


def measure(path: Path, mode: str, threads: int, tokens: int, rounds: int, prompt: str) -> tuple[float, float, int]:
    """(fastest, median) seconds per decoded token, and the prompt's length in tokens."""
    from pinfer_llm.runtime import load_model

    m = load_model(path, threads=threads, ffn_mode=mode)
    ids = m.tokenizer.encode(prompt)[: m.ctx_size - tokens - 16]
    list(m.generate(ids, max_tokens=4, temperature=0.0, stop_ids=set()))  # warm-up
    per_token = []
    for _ in range(rounds):
        out = list(m.generate(ids, max_tokens=tokens, temperature=0.0, stop_ids=set()))
        per_token.append(m.stats.decode_s / len(out))
    return min(per_token), statistics.median(per_token), len(ids)


def features(path: Path, freq: list[np.ndarray] | None, ctx: int, threads: int) -> calibration.Sample:
    """Bytes and operators the cost model says a CPU-only token touches. freq None: dense, every row read. With
    freq (the oracle run): the gate row of every neuron, the up and down rows of the active ones, as the runtime's
    C++ kernel does (torch's fallback reads every up row too)."""
    from pinfer_llm.formats import constants as C
    from pinfer_llm.formats.reader import open_gguf
    from pinfer_llm.planner.memory import account

    f = open_gguf(path)
    mb = account(f, ctx)  # for the shapes only
    ones = [np.ones(n) for n in mb.n_ff]
    act = Activations(ones, 1.0, "calibration")
    hw = Hardware(CPU("calibration", threads, 10.0, 1024.0), [])
    p = build_problem(f, hw, ctx_size=ctx, activations=act)  # the runtime's cache is f16, as the planner counts
    s = calibration.sample(p, Plan.on_cpu(mb.n_layer), "", 0.0)
    if freq is not None:
        for b, fr in enumerate(freq):
            up_down = f.info(C.tensor(C.FFN_UP, b)).nbytes + f.info(C.tensor(C.FFN_DOWN_T, b)).nbytes
            s.cpu_bytes -= float(np.sum(1.0 - fr)) * up_down / mb.layers[b].n_ff
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--planted", type=Path, default=Path("/tmp/pinfer-planted-8x1024.gguf"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--long", type=int, default=768, help="tokens of the long prompt")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import os

    from pinfer_llm.formats.reader import open_gguf
    from pinfer_llm.runtime import resolve_model_path
    from pinfer_llm.synth import target_frequencies

    load_before = os.getloadavg()[0]
    smollm2 = resolve_model_path("smollm2")
    planted = planted_model(args.planted)
    planted_freq = list(target_frequencies(open_gguf(planted)))
    long_prompt = " ".join([PROMPT] * (args.long // 12 + 1))
    runs = [("smollm2 short", smollm2, "dense", None, PROMPT), ("smollm2 long", smollm2, "dense", None, long_prompt),
            ("planted short", planted, "dense", None, PROMPT), ("planted long", planted, "dense", None, long_prompt),
            ("planted oracle", planted, "oracle", planted_freq, PROMPT)]
    samples, medians = [], []
    for label, path, mode, freq, prompt in runs:
        fastest, median, n_prompt = measure(path, mode, args.threads, args.tokens, args.rounds, prompt)
        ctx = 2 * (n_prompt + args.tokens // 2)  # the cost model reads the KV cache of half a context on average
        s = features(path, freq, ctx, args.threads)
        s.label, s.seconds = label, fastest
        samples.append(s)
        medians.append(median)
        print(f"measured {label}: {fastest * 1e3:.1f} ms/token fastest, {median * 1e3:.1f} median "
              f"({s.cpu_bytes / 1e6:.0f} MB, {s.cpu_ops:.0f} ops per token by the cost model)", file=sys.stderr,
              flush=True)
    load_after = os.getloadavg()[0]

    key = this_cpu_key()
    bw = cpu_bandwidth(cpu_name(), detect_cores())
    dense = [s for s in samples if "oracle" not in s.label]
    cal = calibration.calibrate(key, bw, dense)
    if not args.no_save:
        save_calibration(cal)
    rows = []
    for s, med in zip(samples, medians, strict=True):
        others = [x for x in dense if x is not s]
        loo = calibration.calibrate(key, bw, others) if s in dense and len(others) >= 2 else None
        rows.append({"run": s.label, "measured_ms": s.seconds * 1e3, "median_ms": med * 1e3,
                     "predicted_ms": cal.predict(s) * 1e3, "leave_one_out_ms": loo.predict(s) * 1e3 if loo else None,
                     "in_fit": s in dense, "cpu_mb": s.cpu_bytes / 1e6, "ops": s.cpu_ops})
    out = {"cpu": key, "threads": args.threads, "streaming_bw_gbs": bw, "load_avg": [load_before, load_after],
           "fit": {"bw_gbs": cal.bw_gbs, "op_us": cal.op_us, "token_us": cal.token_us}, "rows": rows,
           "saved": not args.no_save}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"CPU {key}, {args.threads} threads: streaming read {bw:.1f} GB/s; fitted effective {cal.bw_gbs:.2f} GB/s, "
          f"{cal.op_us:.1f} us/op, {cal.token_us:.0f} us/token{'' if args.no_save else ' (saved)'}")
    print(f"load average {load_before:.1f} before, {load_after:.1f} after"
          + ("  WARNING: other work held the cores, timings are inflated"
             if load_before > max(detect_cores() - args.threads, 0) + 0.5 else ""))
    print(f"{'run':15s} {'measured':>9s} {'median':>9s} {'predicted':>10s} {'err':>7s} {'leave-1-out':>12s} "
          f"{'err':>7s}")
    for r in rows:
        err = r["predicted_ms"] / r["measured_ms"] - 1
        loo = r["leave_one_out_ms"]
        tag = "" if r["in_fit"] else "  (not in the fit)"
        print(f"{r['run']:15s} {r['measured_ms']:7.1f}ms {r['median_ms']:7.1f}ms {r['predicted_ms']:8.1f}ms "
              f"{err:+7.1%} " + (f"{loo:10.1f}ms {loo / r['measured_ms'] - 1:+7.1%}" if loo else f"{'-':>12s}")
              + tag)


if __name__ == "__main__":
    main()
