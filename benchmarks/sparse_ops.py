"""Sparse vs dense FFN on the CPU, side by side in one process.

    python benchmarks/sparse_ops.py                      # Llama-7B layer, fp32, 2 threads, 10/20/50% active
    python benchmarks/sparse_ops.py --dtype f32,bf16     # also half precision
    python benchmarks/sparse_ops.py --layouts            # packed layout vs the file's separate matrices
    python benchmarks/sparse_ops.py --prefill            # break-even union density per token count
    python benchmarks/sparse_ops.py --json

Cases: "sparse" = runtime.ffn.ops.ffn_sparse as pi-run uses it (the C++ kernel when it builds), "torch" = the same
call with torch's own kernels (use_kernels=False), "dense" = ffn_dense (MKL GEMVs).

Method: several copies of the layer are allocated so that together they exceed the L3 cache (300 MiB) eight times,
and each call uses the next copy round-robin and a fresh random sorted index set: between two uses of a copy at least
one dense call streams a whole other layer through the cache, so weights come from DRAM as in a real forward pass.
Dense and sparse calls are interleaved (one repetition = one call of each); warm-up repetitions are excluded.
The machine is shared: a repetition during which other processes used more than QUIET_TOLERANCE seconds of CPU
(/proc/stat busy time minus our own) is dropped and redone, unless --noisy. Reported: medians over kept repetitions;
"speed-up" = median(dense) / median(sparse); "paired" = median over repetitions of dense / sparse of the same
repetition; p10 = 10th percentile time. GB/s = weight bytes the call must read (all rows for dense, the selected rows
for sparse) / median time. The stream bound is the faster of torch.sum and torch.mv over 1 GiB of fp32 (quiet
repetitions only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial

import torch

_TREE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_TREE, os.path.join(_TREE, "src")]  # the checkout, without an install

from pinfer_llm.runtime.ffn import ops as S  # noqa: E402

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
L3_BYTES = 300 << 20
QUIET_TOLERANCE = 0.03  # s of CPU other processes may use during one repetition before it is dropped


def make_layers(d: int, n_ff: int, dtype: torch.dtype, min_bytes: int, act: str = "silu") -> list[S.FFNWeights]:
    # SiLU by default: no selected neuron's activation is exactly zero, so the sparse kernel never skips a down row
    # (with ReLU and random weights it would skip the neurons whose gate happens to be negative: an unfair win)
    es = torch.empty((), dtype=dtype).element_size()
    n = max(2, -(-min_bytes // (3 * d * n_ff * es)))
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(n):
        gate, up, down_t = (torch.randn(n_ff, d, generator=g).mul_(d ** -0.5).to(dtype) for _ in range(3))
        layers.append(S.pack_ffn(gate, up, down_t, down_transposed=True, act=act))
        del gate, up, down_t
    return layers


def random_idx(n_ff: int, k: int) -> torch.Tensor:
    return torch.randperm(n_ff)[:k].sort().values


class OthersCPU:
    """Measures the CPU time other processes used while a block ran (the machine is shared): /proc/stat's busy time
    minus this process's own user+system time."""

    HZ = os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _busy() -> float:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (sum(v) - v[3] - v[4]) / OthersCPU.HZ  # all but idle and iowait

    def __enter__(self):
        self.b0, t = self._busy(), os.times()
        self.s0 = t.user + t.system
        return self

    def __exit__(self, *exc):
        t = os.times()
        self.seconds = (self._busy() - self.b0) - (t.user + t.system - self.s0)
        return False


def stream_gbs(reps: int = 9, quiet_only: bool = True) -> float:
    """A practical DRAM read bound: the best of torch.sum and an MKL GEMV over 1 GiB of fp32 (far beyond L3)."""
    buf = torch.ones(256 << 20 >> 2)
    mat, vec = buf.view(-1, 4096), torch.ones(4096)
    best = 0.0
    for fn, args in ((buf.sum, ()), (torch.mv, (mat, vec))):
        fn(*args)
        ts: list[float] = []
        for _ in range(reps * 10):
            with OthersCPU() as others:
                t = timed(fn, *args)
            if not quiet_only or others.seconds <= QUIET_TOLERANCE:
                ts.append(t)
            if len(ts) == reps:
                break
        if ts:
            best = max(best, buf.nbytes / statistics.median(ts) / 1e9)
    return best or float("nan")


def timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def bench_decode(layers, fracs, reps, warmup, T=1, quiet_only=True, max_attempts=20) -> tuple[list[dict], dict]:
    """Interleaved dense / sparse@f calls, one repetition = one call of each. With quiet_only, a repetition during
    which other processes used more than QUIET_TOLERANCE s of CPU is dropped and redone (up to reps*max_attempts)."""
    w0 = layers[0]
    n_ff, d, es = w0.n_ff, w0.n_embd, w0.gate_up.element_size()
    x = torch.randn(T, d).to(w0.dtype)
    names = ["dense"] + [f"{c}@{f:g}" for f in fracs for c in ("sparse", "torch")]
    times: dict[str, list[float]] = {n: [] for n in names}
    i = attempts = dropped = 0
    while len(times["dense"]) < reps and attempts < reps * max_attempts + warmup:
        attempts += 1
        rep = {}
        with OthersCPU() as others:
            w = layers[i % len(layers)]
            i += 1
            rep["dense"] = timed(S.ffn_dense, w, x)
            for f in fracs:
                for case, kernels in (("sparse", True), ("torch", False)):
                    w = layers[i % len(layers)]
                    i += 1
                    idx = random_idx(n_ff, int(round(f * n_ff)))
                    rep[f"{case}@{f:g}"] = timed(partial(S.ffn_sparse, use_kernels=kernels), w, x, idx)
        if attempts <= warmup:
            continue
        if quiet_only and others.seconds > QUIET_TOLERANCE:
            dropped += 1
            continue
        for n in names:
            times[n].append(rep[n])
    if not times["dense"]:
        raise SystemExit("no quiet repetition: the machine never stopped running other work; rerun with --noisy")
    dense = statistics.median(times["dense"])
    rows = [dict(case="dense", active=1.0, ms=dense * 1e3, p10_ms=_p10(times["dense"]) * 1e3, speedup=1.0,
                 paired_speedup=1.0, gbs=3 * n_ff * d * es / dense / 1e9)]
    for f, case in ((f, c) for f in fracs for c in ("sparse", "torch")):
        ts = times[f"{case}@{f:g}"]
        m = statistics.median(ts)
        k = int(round(f * n_ff))
        paired = statistics.median(a / b for a, b in zip(times["dense"], ts, strict=True))
        rows.append(dict(case=case, active=f, ms=m * 1e3, p10_ms=_p10(ts) * 1e3, speedup=dense / m,
                         paired_speedup=paired, gbs=3 * k * d * es / m / 1e9, ideal_speedup=1 / f))
    return rows, dict(kept=len(times["dense"]), dropped_noisy=dropped)


def _p10(ts: list[float]) -> float:
    return sorted(ts)[len(ts) // 10]


def bench_layouts(d, n_ff, frac, reps, warmup, min_bytes, quiet_only=True) -> list[dict]:
    """The packed layout (interleaved gate/up, huge pages) against the file's layout (separate gate, up, down_t in
    ordinary memory), same kernels: two SDDMM calls instead of one."""
    import torch.nn.functional as F

    packed = make_layers(d, n_ff, torch.float32, min_bytes)
    g = torch.Generator().manual_seed(1)
    separate = [tuple(torch.randn(n_ff, d, generator=g) * d ** -0.5 for _ in range(3)) for _ in packed]
    k = int(round(frac * n_ff))
    x = torch.randn(1, d)
    threads = torch.get_num_threads()

    def sep_sparse(ws, idx):
        gate, up, down_t = ws
        crow = torch.arange(threads + 1) * k // threads
        pat = torch.sparse_csr_tensor(crow, idx, torch.zeros(k), size=(threads, n_ff), check_invariants=False)
        xm = x.expand(threads, -1).contiguous()
        a = torch.sparse.sampled_addmm(pat, xm, gate.t(), beta=0.0).values()
        b = torch.sparse.sampled_addmm(pat, xm, up.t(), beta=0.0).values()
        h = F.relu(a) * b
        return F.embedding_bag(idx, down_t, torch.zeros(1, dtype=torch.long), mode="sum", per_sample_weights=h)

    def sep_dense(ws):
        gate, up, down_t = ws
        return (F.relu(F.linear(x, gate)) * F.linear(x, up)) @ down_t

    cases = {"packed dense": [], "separate dense": [], "packed sparse": [], "separate sparse": []}
    for rep in range((reps + warmup) * 20):
        j = rep % len(packed)
        idx = random_idx(n_ff, k)
        with OthersCPU() as others:
            ts = {"packed dense": timed(S.ffn_dense, packed[j], x),
                  "separate dense": timed(sep_dense, separate[j - 1]),
                  "packed sparse": timed(S.ffn_sparse, packed[j - 1], x, idx),
                  "separate sparse": timed(sep_sparse, separate[j], idx)}
        if rep >= warmup and (not quiet_only or others.seconds <= QUIET_TOLERANCE):
            for name, t in ts.items():
                cases[name].append(t)
        if len(cases["packed dense"]) == reps:
            break
    return [dict(case=name, active=1.0 if "dense" in name else frac, reps=len(v),
                 ms=statistics.median(v) * 1e3 if v else float("nan")) for name, v in cases.items()]


def bench_prefill(layers, Ts, densities, reps, quiet_only=True, max_attempts=20) -> list[dict]:
    """Sparse speed-up over dense for T tokens at union density rho: the median over quiet repetitions of the ratio
    of a dense call and the sparse call right after it; the break-even density per T interpolates where it is 1."""
    w0 = layers[0]
    out = []
    i = 0
    for T in Ts:
        x = torch.randn(T, w0.n_embd).to(w0.dtype)
        ratios, dense_ts = {}, []
        for rho in densities:
            idx_k = int(round(rho * w0.n_ff))
            r: list[float] = []
            for _ in range(reps * max_attempts):
                idx = random_idx(w0.n_ff, idx_k)
                with OthersCPU() as others:
                    t0 = time.perf_counter()
                    td = timed(S.ffn_dense, layers[i % len(layers)], x)
                    ts = timed(S.ffn_sparse, layers[(i + 1) % len(layers)], x, idx)
                    wall = time.perf_counter() - t0
                i += 2
                if quiet_only and others.seconds > max(QUIET_TOLERANCE, 0.05 * wall * torch.get_num_threads()):
                    continue
                r.append(td / ts)
                dense_ts.append(td)
                if len(r) == reps:
                    break
            ratios[rho] = statistics.median(r) if r else float("nan")
        be = 0.0  # break-even: where the speed-up crosses 1, linear between grid points
        for a, b in zip(densities, densities[1:], strict=False):
            if ratios[a] >= 1 > ratios[b]:
                be = a + (b - a) * (ratios[a] - 1) / (ratios[a] - ratios[b])
                break
        else:
            be = densities[-1] if ratios[densities[-1]] >= 1 else 0.0
        out.append(dict(T=T, dense_ms=statistics.median(dense_ts) * 1e3 if dense_ts else float("nan"),
                        speedups={f"{r:g}": round(v, 3) for r, v in ratios.items()},
                        break_even_density=round(be, 3), rule_density=round(S.sparse_max_density(T), 3)))
    return out


def bench_paths(layers, Ts, densities, reps, quiet_only=True, max_attempts=20) -> list[dict]:
    """For few tokens, the three sparse paths against gathering the rows once and running GEMMs: the C++ kernel
    and torch's per-token SDDMM/axpy. Ratios are time / gather time (< 1: that path beats gathering); KERNEL_MAX_T
    and GATHER_MIN_T are set from them."""
    w0, out, i = layers[0], [], 0
    saved = S.GATHER_MIN_T, S.KERNEL_MAX_T
    paths = {"kernel": (10 ** 9, 10 ** 9), "sddmm": (10 ** 9, 0), "gather": (1, 0)}  # (GATHER_MIN_T, KERNEL_MAX_T)
    try:
        for T in Ts:
            x = torch.randn(T, w0.n_embd).to(w0.dtype)
            for rho in densities:
                r: dict[str, list[float]] = {"kernel": [], "sddmm": []}
                for _ in range(reps * max_attempts):
                    idx = random_idx(w0.n_ff, int(round(rho * w0.n_ff)))
                    ts = {}
                    with OthersCPU() as others:
                        for name, (S.GATHER_MIN_T, S.KERNEL_MAX_T) in paths.items():
                            ts[name] = timed(S.ffn_sparse, layers[i % len(layers)], x, idx)
                            i += 1
                    if not quiet_only or others.seconds <= QUIET_TOLERANCE:
                        for name in r:
                            r[name].append(ts[name] / ts["gather"])
                    if len(r["kernel"]) == reps:
                        break
                out.append(dict(T=T, density=rho, **{f"{n}_over_gather": round(statistics.median(v), 3) if v else None
                                                     for n, v in r.items()}))
    finally:
        S.GATHER_MIN_T, S.KERNEL_MAX_T = saved
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--n-ff", type=int, default=11008)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="f32", help="comma list of f32, bf16, f16")
    ap.add_argument("--fracs", default="0.1,0.2,0.5")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--min-bytes", type=int, default=8 * L3_BYTES, help="total weight bytes across layer copies")
    ap.add_argument("--layouts", action="store_true", help="also compare packed vs separate layouts (fp32)")
    ap.add_argument("--prefill", action="store_true", help="also measure the dense/sparse break-even per T (f32)")
    ap.add_argument("--skip-decode", action="store_true", help="only the --prefill / --layouts parts")
    ap.add_argument("--prefill-t", default="1,2,3,4,8,16,24,32,64,128", help="token counts for --prefill")
    ap.add_argument("--decode-t", type=int, default=1, help="tokens per call in the decode table")
    ap.add_argument("--noisy", action="store_true", help="keep repetitions during which other processes ran")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    fracs = [float(f) for f in args.fracs.split(",")]
    result = dict(shape=dict(d=args.d, n_ff=args.n_ff), threads=args.threads, reps=args.reps, warmup=args.warmup,
                  torch=torch.__version__, load_avg=os.getloadavg(), decode={},
                  stream_gbs=round(stream_gbs(quiet_only=not args.noisy), 2))
    for name in args.dtype.split(","):
        layers = make_layers(args.d, args.n_ff, DTYPES[name], args.min_bytes)
        if not args.skip_decode:
            rows, kept = bench_decode(layers, fracs, args.reps, args.warmup, args.decode_t, not args.noisy)
            result["decode"][name] = dict(layer_copies=len(layers), rows=rows, **kept)
        if args.prefill and name == "f32":
            result["prefill"] = bench_prefill(layers, [int(t) for t in args.prefill_t.split(",")],
                                              [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9],
                                              max(5, args.reps // 4), not args.noisy)
            result["paths"] = bench_paths(layers, [1, 2, 4, 8, 16, 24, 32], [0.1, 0.3], max(5, args.reps // 4),
                                          not args.noisy)
        del layers
    if args.layouts:
        result["layouts"] = bench_layouts(args.d, args.n_ff, fracs[0], args.reps, args.warmup, args.min_bytes,
                                           not args.noisy)
    result["load_avg_after"] = os.getloadavg()

    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"FFN d={args.d} n_ff={args.n_ff}, {args.threads} threads, {args.reps} reps (+{args.warmup} warm-up), "
          f"medians; stream read bound {result['stream_gbs']:.1f} GB/s; load avg {result['load_avg'][0]:.2f}")
    for name, r in result["decode"].items():
        print(f"\n{name}, T={args.decode_t}, {r['layer_copies']} layer copies, {r['kept']} repetitions kept, "
              f"{r['dropped_noisy']} dropped because other processes used the CPU")
        print(f"{S.cpu_kernels.status()}")
        print(f"{'case':>8} {'active':>7} {'median ms':>10} {'p10 ms':>8} {'speed-up':>9} {'paired':>7} "
              f"{'ideal':>6} {'GB/s':>6}")
        for row in r["rows"]:
            ideal = f"{row['ideal_speedup']:.1f}" if "ideal_speedup" in row else ""
            print(f"{row['case']:>8} {row['active']:>7.0%} {row['ms']:>10.2f} {row['p10_ms']:>8.2f} "
                  f"{row['speedup']:>8.2f}x {row['paired_speedup']:>6.2f}x {ideal:>6} {row['gbs']:>6.1f}")
    if "layouts" in result:
        print("\nlayouts (fp32, T=1)")
        for row in result["layouts"]:
            print(f"{row['case']:>16} {row['active']:>5.0%} {row['ms']:>8.2f} ms")
    if "paths" in result:
        print("\nfew tokens: time of the C++ kernel and of SDDMM/axpy over gather+GEMM time (> 1: gathering wins)")
        for row in result["paths"]:
            print(f"T={row['T']:>3} density {row['density']:.0%}: kernel {row['kernel_over_gather']}, "
                  f"sddmm {row['sddmm_over_gather']}")
    if "prefill" in result:
        print("\nprefill: sparse speed-up over dense by union density; break-even density vs the rule in sparse_ops")
        dens = list(result["prefill"][0]["speedups"])
        print(f"{'T':>4} {'dense ms':>9} " + " ".join(f"{d:>5}" for d in dens) + "  break-even  rule")
        for row in result["prefill"]:
            print(f"{row['T']:>4} {row['dense_ms']:>9.2f} " + " ".join(f"{v:>5.2f}" for v in row["speedups"].values())
                  + f"  {row['break_even_density']:>10.2f}  {row['rule_density']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
