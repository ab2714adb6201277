"""Speed of the C++ kernels on weights as GGUF stores them (runtime/cpu/csrc), native and x86-64-v3 builds side by side.

    python benchmarks/kernels.py [--json] [--threads 2] [--rounds 5] [--mem-mb 512] [--only gemv,prefill,ffn,pred]
                                 [--crossover]

Sections (every measurement in interleaved paired rounds: each round times every variant once, in an order rotated
from round to round; ratios are per round, then the median; spreads are min-max over rounds):
- gemv: qmatmul T=1 at Llama-7B/13B shapes (4096x11008, 5120x13824, the 32000x4096 output head): GB/s of weight
  bytes per type and build, against a dense fp32 torch.mv of the same shape and a streaming-read probe (torch.sum over
  a buffer of --mem-mb). Each timed call cycles through copies of the matrix totalling --mem-mb, so the bytes come
  from DRAM, not the last-level cache.
- prefill: qmatmul T=512 on 4096x11008, GFLOP/s per type and build, against torch's fp32 mm on a dequantised copy.
- ffn: qffn_sparse, one token, SwiGLU (every selected neuron's three rows are read), 10/20/50% of 11008 neurons at
  random, against the dense FFN of the same type (qmatmul gate+up, SwiGLU, qmatmul down).
- pred: qpredict_active, F16 predictor r=1024 for a 4096 x 11008 layer, fc2 as stored vs transposed.
- --crossover: qmatmul's two regimes (streaming tiles vs dequantised tiles + sgemm) for T = 2..128, to place
  GEMM_MIN_T (runtime/cpu/csrc/kernels.h).

--clock cpu measures process CPU time instead of wall time (re-executing with OMP_WAIT_POLICY=PASSIVE so that idle
OpenMP threads sleep instead of spinning on the clock): on a machine shared with other jobs, wall time counts the
time slices other processes take, CPU time does not. Bandwidths are then bytes per CPU-second times --threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

_TREE = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_TREE), str(_TREE / "src")]  # the checkout, without an install

from qblocks import weights  # noqa: E402

from pinfer_llm.runtime.cpu import kernels as cpu_kernels  # noqa: E402

TYPES = {"F32": 0, "F16": 1, "BF16": 30, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return "unknown"


def copies_for(nbytes: int, mem_mb: int) -> int:
    return max(2, -(-mem_mb * 2**20 // nbytes))


CLOCK = time.perf_counter  # or CPU time divided by the thread count (--clock cpu)


def paired(fns: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each function, one sample per round, the order rotated each round. Each fn is called once
    untimed first (warm-up: page faults, thread pool, caches of the code)."""
    names = list(fns)
    for n in names:
        fns[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for n in order:
            t0 = CLOCK()
            fns[n]()
            times[n].append(CLOCK() - t0)
    return times


def ratio_stats(num: list[float], den: list[float]) -> dict:
    rs = [a / b for a, b in zip(num, den, strict=True)]
    return {"median": statistics.median(rs), "min": min(rs), "max": max(rs)}


def cycle(fn, args_list):
    """One timed sample = one call per copy; returns a closure and the number of calls it makes."""
    def run():
        for a in args_list:
            fn(*a)
    return run, len(args_list)


def bench_gemv(builds: dict, rounds: int, mem_mb: int, types: list[str], report: list, log) -> None:
    probe = torch.ones(mem_mb * 2**20 // 4)
    shapes = [(11008, 4096, "ffn 4096x11008"), (13824, 5120, "ffn 5120x13824"), (32000, 4096, "head 32000x4096")]
    for rows, cols, label in shapes:
        x = torch.randn(1, cols)
        base = [torch.randn(rows, cols) for _ in range(copies_for(rows * cols * 4, mem_mb))]
        xv = x[0]
        fns, calls = {}, {}
        fns["probe"], calls["probe"] = (lambda: probe.sum()), 1
        fns["fp32 mv"], calls["fp32 mv"] = cycle(torch.mv, [(w, xv) for w in base])
        nbytes = {"fp32 mv": rows * cols * 4, "probe": probe.numel() * 4}
        mats = {}
        for name in types:
            t = TYPES[name]
            ws = [weights(rows, cols, t, i) for i in range(copies_for(weights(1, cols, t, 0).shape[1] * rows, mem_mb))]
            mats[name] = ws
            for b, ops in builds.items():
                key = f"{name} {b}"
                fns[key], calls[key] = cycle(lambda w, ops=ops, t=t, x=x: ops.qmatmul(x, [w], [t]),
                                             [(w,) for w in ws])
                nbytes[key] = ws[0].numel()
        times = paired(fns, rounds)
        del base, mats
        per_call = {k: [s / calls[k] for s in v] for k, v in times.items()}
        gbs = {k: statistics.median([nbytes[k] / s / 1e9 for s in v]) for k, v in per_call.items()}
        for k in fns:
            if k in ("probe", "fp32 mv"):
                continue
            row = {"section": "gemv", "shape": label, "variant": k, "ms": 1e3 * statistics.median(per_call[k]),
                   "GB/s": gbs[k], "GB/s vs fp32 mv": gbs[k] / gbs["fp32 mv"], "GB/s vs probe": gbs[k] / gbs["probe"],
                   "speedup vs fp32 mv": ratio_stats(per_call["fp32 mv"], per_call[k])}
            report.append(row)
            log(f"gemv {label:16s} {k:22s} {row['ms']:7.2f} ms {gbs[k]:6.1f} GB/s  "
                f"({row['GB/s vs probe']:.2f} of probe {gbs['probe']:.1f}, fp32 mv {gbs['fp32 mv']:.1f} GB/s; "
                f"{row['speedup vs fp32 mv']['median']:.2f}x faster than fp32 mv)")


def bench_prefill(builds: dict, rounds: int, types: list[str], report: list, log, T: int = 512) -> None:
    rows, cols = 11008, 4096
    x = torch.randn(T, cols)
    flops = 2 * T * rows * cols
    for name in types:
        t = TYPES[name]
        w = weights(rows, cols, t, 0)
        ref = next(iter(builds.values())).qdequant(w, t)
        fns = {"fp32 mm": lambda ref=ref: torch.mm(x, ref.t())}
        for b, ops in builds.items():
            fns[f"{name} {b}"] = lambda ops=ops, w=w, t=t: ops.qmatmul(x, [w], [t])
        times = paired(fns, rounds)
        for k, v in times.items():
            if k == "fp32 mm":
                continue
            row = {"section": "prefill", "T": T, "variant": k, "ms": 1e3 * statistics.median(v),
                   "GFLOP/s": flops / statistics.median(v) / 1e9,
                   "fp32 mm GFLOP/s": flops / statistics.median(times["fp32 mm"]) / 1e9,
                   "vs fp32 mm": ratio_stats(times["fp32 mm"], v)}
            report.append(row)
            log(f"prefill T={T} {k:22s} {row['ms']:8.1f} ms {row['GFLOP/s']:6.1f} GFLOP/s (fp32 mm on a dequantised "
                f"copy {row['fp32 mm GFLOP/s']:.1f}; ratio {row['vs fp32 mm']['median']:.2f})")


def bench_crossover(builds: dict, rounds: int, types: list[str], report: list, log) -> None:
    rows, cols = 11008, 4096
    for name in types:
        t = TYPES[name]
        w = weights(rows, cols, t, 0)
        for T in (2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 128):
            x = torch.randn(T, cols)
            fns = {}
            for b, ops in builds.items():
                fns[f"{b} stream"] = lambda ops=ops, x=x, w=w, t=t: ops.qmatmul(x, [w], [t], 1 << 30)
                fns[f"{b} gemm"] = lambda ops=ops, x=x, w=w, t=t: ops.qmatmul(x, [w], [t], 1)
            times = paired(fns, rounds)
            for b in builds:
                r = ratio_stats(times[f"{b} gemm"], times[f"{b} stream"])
                report.append({"section": "crossover", "type": name, "T": T, "build": b,
                               "stream ms": 1e3 * statistics.median(times[f"{b} stream"]),
                               "gemm ms": 1e3 * statistics.median(times[f"{b} gemm"]), "gemm/stream": r})
                log(f"crossover {name:5s} T={T:3d} {b:10s} stream {1e3 * statistics.median(times[f'{b} stream']):7.2f}"
                    f" ms, gemm {1e3 * statistics.median(times[f'{b} gemm']):7.2f} ms, gemm/stream {r['median']:.2f}")


def bench_ffn(builds: dict, rounds: int, mem_mb: int, types: list[str], report: list, log) -> None:
    d, n_ff = 4096, 11008
    x = torch.randn(1, d)
    gen = torch.Generator().manual_seed(0)
    for name in types:
        t = TYPES[name]
        layer_bytes = 3 * weights(1, d, t, 0).shape[1] * n_ff
        layers = []
        for i in range(copies_for(layer_bytes, mem_mb)):
            # gate, up [n_ff, d]; down_t [n_ff, d] for the sparse kernel, down [d, n_ff] (as GGUF stores ffn_down)
            # for the dense one: the same bytes
            layers.append((weights(n_ff, d, t, 3 * i), weights(n_ff, d, t, 3 * i + 1), weights(n_ff, d, t, 3 * i + 2),
                           weights(d, n_ff, t, 3 * i + 2)))
        for frac in (0.1, 0.2, 0.5):
            k = int(frac * n_ff)
            idxs = [torch.randperm(n_ff, generator=gen)[:k] for _ in layers]
            fns, calls = {}, {}
            for b, ops in builds.items():
                def dense(g, u, _dt, dn, ops=ops, t=t):
                    a = ops.qmatmul(x, [g, u], [t, t])
                    h = torch.nn.functional.silu(a[:, :n_ff]) * a[:, n_ff:]
                    return ops.qmatmul(h, [dn], [t])

                def sparse(g, u, dt, _dn, idx, ops=ops, t=t):
                    return ops.qffn_sparse(x, g, t, u, t, dt, t, idx, None, 0, None, 0.0)

                fns[f"dense {b}"], calls[f"dense {b}"] = cycle(dense, layers)
                fns[f"sparse {b}"], calls[f"sparse {b}"] = cycle(sparse, [(*L, i) for L, i in zip(layers, idxs,
                                                                                                  strict=True)])
            times = paired(fns, rounds)
            for b in builds:
                dn_s = [s / calls[f"dense {b}"] for s in times[f"dense {b}"]]
                sp_s = [s / calls[f"sparse {b}"] for s in times[f"sparse {b}"]]
                r = ratio_stats(dn_s, sp_s)
                gbs = frac * layer_bytes / statistics.median(sp_s) / 1e9
                dense_gbs = layer_bytes / statistics.median(dn_s) / 1e9
                report.append({"section": "ffn", "type": name, "active": frac, "build": b,
                               "dense ms": 1e3 * statistics.median(dn_s), "sparse ms": 1e3 * statistics.median(sp_s),
                               "speedup": r, "sparse GB/s": gbs, "dense GB/s": dense_gbs})
                log(f"ffn {name:5s} {frac:4.0%} {b:10s} dense {1e3 * statistics.median(dn_s):7.2f} ms "
                    f"({dense_gbs:5.1f} GB/s), sparse {1e3 * statistics.median(sp_s):6.2f} ms ({gbs:5.1f} GB/s): "
                    f"{r['median']:.2f}x (rounds {r['min']:.2f}-{r['max']:.2f}; bytes bound {1 / frac:.0f}x)")
        del layers


def bench_pred(builds: dict, rounds: int, mem_mb: int, report: list, log) -> None:
    d, n_ff, r = 4096, 11008, 1024
    x = torch.randn(d)
    n = copies_for((d * r + r * n_ff) * 2, mem_mb)
    preds = []
    for i in range(n):
        fc1 = weights(r, d, 1, 2 * i)
        fc2 = weights(n_ff, r, 1, 2 * i + 1)
        fc2_t = fc2.view(torch.int16).t().contiguous().view(torch.uint8)
        preds.append((fc1, fc2, fc2_t))
    fns, calls = {}, {}
    for b, ops in builds.items():
        fns[f"stored {b}"], calls[f"stored {b}"] = cycle(
            lambda f1, f2, _f2t, ops=ops: ops.qpredict_active(x, f1, 1, f2, 1, 0.0, None, False), preds)
        fns[f"transposed {b}"], calls[f"transposed {b}"] = cycle(
            lambda f1, _f2, f2t, ops=ops: ops.qpredict_active(x, f1, 1, f2t, 1, 0.0, None, True), preds)
    times = paired(fns, rounds)
    for b in builds:
        st = [s / calls[f"stored {b}"] for s in times[f"stored {b}"]]
        tr = [s / calls[f"transposed {b}"] for s in times[f"transposed {b}"]]
        rs = ratio_stats(st, tr)
        report.append({"section": "pred", "build": b, "stored ms": 1e3 * statistics.median(st),
                       "transposed ms": 1e3 * statistics.median(tr), "transposed speedup": rs})
        log(f"pred r={r} F16 {b:10s} fc2 as stored {1e3 * statistics.median(st):6.2f} ms, transposed "
            f"{1e3 * statistics.median(tr):6.2f} ms: {rs['median']:.2f}x (rounds {rs['min']:.2f}-{rs['max']:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mem-mb", type=int, default=512, help="bytes each GEMV / FFN sample cycles through")
    ap.add_argument("--only", default="gemv,prefill,ffn,pred")
    ap.add_argument("--types", default="F16,Q4_0,Q8_0,Q4_1,BF16,F32")
    ap.add_argument("--builds", default="native,x86-64-v3")
    ap.add_argument("--crossover", action="store_true")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = ap.parse_args()
    if args.clock == "cpu":
        if os.environ.get("OMP_WAIT_POLICY") != "PASSIVE":  # libgomp reads it when it loads: start over with it set
            os.execve(sys.executable, [sys.executable, *sys.argv], dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
        global CLOCK
        CLOCK = lambda: time.process_time() / args.threads  # noqa: E731
    torch.set_num_threads(args.threads)
    builds = cpu_kernels.load_variants(args.builds.split(","))
    isa = {b: ops.isa() for b, ops in builds.items()}
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else (lambda s: print(s, flush=True))
    log(f"{cpu_model()}, {args.threads} threads, builds {isa}, {args.rounds} paired rounds, {args.clock} clock")
    types = args.types.split(",")
    only = args.only.split(",")
    report: list = []
    if "gemv" in only:
        bench_gemv(builds, args.rounds, args.mem_mb, types, report, log)
    if "prefill" in only:
        bench_prefill(builds, args.rounds, types, report, log)
    if "ffn" in only:
        bench_ffn(builds, args.rounds, args.mem_mb, [t for t in types if t in ("F32", "F16", "Q4_0", "Q8_0")], report,
                  log)
    if "pred" in only:
        bench_pred(builds, args.rounds, args.mem_mb, report, log)
    if args.crossover:
        bench_crossover(builds, args.rounds, [t for t in types if t in ("F16", "Q4_0", "Q8_0")], report, log)
    if args.json:
        print(json.dumps({"cpu": cpu_model(), "threads": args.threads, "rounds": args.rounds, "clock": args.clock,
                          "isa": isa, "results": report}, indent=1))


if __name__ == "__main__":
    main()
