"""Calibrate the planner's CPU cost model against measured pi-run decode times, and report how close it gets.

    python benchmarks/plan_calibration.py                 # SmolLM2 (demo model) + a planted-sparsity model, 2 threads
    python benchmarks/plan_calibration.py --planted m.gguf --tokens 48 --rounds 3 --no-save --json

Measured: seconds per decoded token (median of rounds, after a warm-up) of runtime.load_model(path, threads=2) +
m.generate(ids, max_tokens=N, temperature=0.0), for
  - the demo model, SmolLM2-135M Q4_1 (dense SwiGLU),
  - a planted model (formats.synth: ReLU, known per-neuron frequencies, F32), dense and with exact ("oracle") masks,
    which read the gate rows of every neuron and the up/down rows of the active ones, as the cost model assumes.
Predicted: the cost model's CPU-only time of each run, from the bytes and operators it says the CPU touches
(costmodel.cpu_work), with the three CPU constants fitted by calibration.fit. Printed: measured vs predicted per
run, in-sample and leave-one-out (each run predicted by a fit to the others), and the uncalibrated prediction.
The fit is saved to the cache for this machine's CPU (pi-plan calibration shows it) unless --no-save.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planner import calibration  # noqa: E402
from planner.activations import Activations  # noqa: E402
from planner.costmodel import evaluate  # noqa: E402
from planner.hardware import CPU, Hardware, cpu_bandwidth, cpu_name, detect_cores  # noqa: E402
from planner.plan import Plan  # noqa: E402
from planner.problem import build_problem  # noqa: E402

PROMPT = "Once upon a time, in a small village by the sea, there lived"


def planted_model(path: Path) -> Path:
    """A ReLU model with planted activation frequencies, big enough that weights dominate a token (~0.5 GB)."""
    if path.exists():
        return path
    from formats.synth import SynthSpec, generate

    spec = SynthSpec(n_layer=8, n_embd=1024, n_ff=2816, n_head=16, n_head_kv=4, dtype="f32", sparsity=0.85,
                     skew=1.0, seed=0, calib_tokens=1024, name="planted-8x1024")
    t0 = time.perf_counter()
    generate(path, spec)
    print(f"generated {path} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return path


def measure(path: Path, mode: str, threads: int, tokens: int, rounds: int) -> tuple[float, int]:
    from runtime import load_model

    m = load_model(path, threads=threads, ffn_mode=mode)
    ids = m.tokenizer.encode(PROMPT)
    list(m.generate(ids, max_tokens=8, temperature=0.0, stop_ids=set()))  # warm-up
    per_token = []
    for _ in range(rounds):
        out = list(m.generate(ids, max_tokens=tokens, temperature=0.0, stop_ids=set()))
        per_token.append(m.stats.decode_s / len(out))
    return statistics.median(per_token), len(ids)


def features(path: Path, freq: list[np.ndarray] | None, ctx: int, threads: int) -> calibration.Sample:
    """Bytes and operators the cost model says a CPU-only token touches (freq None: dense, every neuron active)."""
    from formats.reader import open_gguf
    from planner.memory import account

    f = open_gguf(path)
    mb = account(f, ctx)
    if freq is None:
        freq = [np.ones(n) for n in mb.n_ff]
    act = Activations([np.asarray(x, dtype=np.float64) for x in freq], 1.0, "calibration")
    hw = Hardware(CPU("calibration", threads, 10.0, 1024.0), [])
    p = build_problem(f, hw, ctx_size=ctx, activations=act)
    return p, calibration.sample(p, Plan.on_cpu(mb.n_layer), "", 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--planted", type=Path, default=Path("/tmp/pinfer-planted-8x1024.gguf"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from formats.reader import open_gguf
    from formats.synth import target_frequencies
    from runtime import resolve_model_path

    smollm2 = resolve_model_path("smollm2")
    planted = planted_model(args.planted)
    planted_freq = list(target_frequencies(open_gguf(planted)))
    runs = [("smollm2 dense", smollm2, "dense", None), ("planted dense", planted, "dense", None),
            ("planted oracle", planted, "oracle", planted_freq)]
    samples, problems = [], []
    for label, path, mode, freq in runs:
        seconds, n_prompt = measure(path, mode, args.threads, args.tokens, args.rounds)
        ctx = 2 * (n_prompt + args.tokens // 2)  # the cost model reads the KV cache of half a context on average
        p, s = features(path, freq, ctx, args.threads)
        s.label, s.seconds = label, seconds
        samples.append(s)
        problems.append(p)
        print(f"measured {label}: {seconds * 1e3:.1f} ms/token ({s.cpu_bytes / 1e6:.0f} MB, {s.cpu_ops:.0f} ops per "
              f"token by the cost model)", file=sys.stderr, flush=True)

    key = f"{cpu_name()}|{detect_cores()}"
    bw = cpu_bandwidth(cpu_name(), detect_cores())
    cal = calibration.calibrate(key, bw, samples, save_it=not args.no_save)
    rows = []
    for i, s in enumerate(samples):
        others = [x for j, x in enumerate(samples) if j != i]
        loo = calibration.calibrate(key, bw, others, save_it=False) if len(others) >= 2 else None
        # uncalibrated: the default CPU constants with the measured streaming bandwidth
        default = CPU("default", args.threads, bw, 1024.0)
        p = problems[i]
        p.hw = Hardware(default, [])
        from planner.costmodel import costs

        p.costs = costs(p.model, p.hw)
        uncal = evaluate(p, Plan.on_cpu(p.model.n_layer)).time
        rows.append({"run": s.label, "measured_ms": s.seconds * 1e3, "predicted_ms": cal.predict(s) * 1e3,
                     "leave_one_out_ms": loo.predict(s) * 1e3 if loo else None, "uncalibrated_ms": uncal * 1e3,
                     "cpu_mb": s.cpu_bytes / 1e6, "ops": s.cpu_ops})
    out = {"cpu": key, "streaming_bw_gbs": bw, "fit": {"bw_gbs": cal.bw_gbs, "op_us": cal.op_us,
                                                       "token_us": cal.token_us}, "rows": rows,
           "saved": not args.no_save}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"CPU {key}: streaming read {bw:.1f} GB/s; fitted effective {cal.bw_gbs:.2f} GB/s, {cal.op_us:.1f} us/op, "
          f"{cal.token_us:.0f} us/token{'' if args.no_save else ' (saved)'}")
    print(f"{'run':16s} {'measured':>10s} {'fitted':>10s} {'err':>7s} {'leave-1-out':>12s} {'err':>7s} "
          f"{'uncalibrated':>13s}")
    for r in rows:
        err = r["predicted_ms"] / r["measured_ms"] - 1
        loo = r["leave_one_out_ms"]
        print(f"{r['run']:16s} {r['measured_ms']:8.1f}ms {r['predicted_ms']:8.1f}ms {err:+7.1%} "
              + (f"{loo:10.1f}ms {loo / r['measured_ms'] - 1:+7.1%} " if loo else f"{'-':>12s} {'':7s} ")
              + f"{r['uncalibrated_ms']:11.1f}ms")


if __name__ == "__main__":
    main()
