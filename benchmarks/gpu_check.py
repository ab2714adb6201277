"""Check every GPU kernel against the CPU reference at real sizes, then measure them: `make gpu-check`.

Needs a CUDA GPU and CuPy; without them it prints one line saying what is missing and exits with status 2.
1. Correctness: CudaDevice against ReferenceDevice (float64) on random data at Llama-13B layer shapes (d = 5120,
   n_ff = 13824) and Llama-70B-style GQA attention; max error relative to the scale of the terms.
2. Speed (CUDA events, warm): the device's copy bandwidth (read + write of a 2 GiB buffer); the sparse FFN at 10%
   active rows, bytes touched / time against that bandwidth, over a sweep of the grid parameters; dense GEMV; the
   sparse FFN of a 70B layer. Each figure also against a copy kernel of the same bytes, timed the same way
   ("of same-size copy"): what any kernel of that size could reach, launch and DRAM ramp included.
   Each timed launch reads another of several copies of the layer, so the 60 MB L2 does not serve repeats.
All results go to one JSON file (default benchmarks/results/gpu_check.json) and a printed table. ~2-4 minutes.

Last run (H200, 75 s on a fresh machine): 78/78 checks passed (max error 4e-7 of the terms' scale); copy 4.25 TB/s;
10% sparse FFN, one token: F16 gate+up 19 us (35% of copy), down 9.6 us (35%); Q4_0 11% / 10%; dense GEMV F16 90%,
Q8_0 47%, Q4_0 31%; attention decode at 4096 positions 39%.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # the checkout, without an install

D, N_FF = 5120, 13824  # Llama-13B
COPIES = 4  # layer copies cycled through in timed loops (4 x 28 MB touched at 10% F16 >> L2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", default=str(ROOT / "benchmarks/results/gpu_check.json"))
    ap.add_argument("--quick", action="store_true", help="smaller shapes (a smoke run)")
    ap.add_argument("--checks-only", action="store_true",
                    help="correctness only, no timing (what benchmarks/gpu_sanitize.sh runs under compute-sanitizer)")
    args = ap.parse_args(argv)
    from pinfer_llm.runtime.gpu import CudaDevice, GPUUnavailable

    try:
        dev = CudaDevice()
    except GPUUnavailable as e:
        print(f"gpu_check: no GPU to check: {e}", file=sys.stderr)
        return 2
    import cupy as cp
    import torch

    from pinfer_llm.runtime.gpu import ReferenceDevice

    torch.set_num_threads(min(16, torch.get_num_threads()))
    t0 = time.time()
    res = {"device": dev.name, "gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "checks": [],
           "bench": []}
    d, n_ff = (1056, 2048) if args.quick else (D, N_FF)
    try:
        run_checks(dev, ReferenceDevice(), res["checks"], d, n_ff, args.quick)
    except Exception as e:  # report what ran, and the error, rather than nothing
        res["checks"].append({"kernel": "checks", "case": "aborted", "error": repr(e), "max_err": float("nan"),
                              "tol": 0.0, "pass": False})
        traceback.print_exc()
    print_checks(res["checks"])
    if args.checks_only:
        return _finish(res, args, t0)
    res["copy_gbps"] = copy_bandwidth(cp)
    print(f"\ndevice copy bandwidth (read + write): {res['copy_gbps']:.0f} GB/s")
    try:
        run_bench(dev, cp, res["bench"], res["copy_gbps"], d, n_ff)
    except Exception as e:
        res["bench_error"] = repr(e)
        traceback.print_exc()
    return _finish(res, args, t0)


def _finish(res: dict, args, t0: float) -> int:
    res["seconds"] = round(time.time() - t0, 1)
    res["all_pass"] = all(c["pass"] for c in res["checks"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"\n{'PASS' if res['all_pass'] else 'FAIL'}: {sum(c['pass'] for c in res['checks'])}/{len(res['checks'])} "
          f"checks; {res['seconds']} s; results in {args.out}")
    return 0 if res["all_pass"] else 1


# ---------------------------------------------------------------- correctness

def _err(got, want, scale) -> float:
    """max |got - want| / scale: scale is the magnitude of the summed terms (rounding is relative to it)."""
    return float(np.max(np.abs(np.asarray(got, np.float64) - want) / scale))


def run_checks(dev, ref, out: list, d: int, n_ff: int, quick: bool = False) -> None:
    from pinfer_llm.runtime.gpu import ACT_CODES
    from pinfer_llm.runtime.gpu import layout as L
    from pinfer_llm.runtime.gpu.cuda import PREFILL_T

    rng = np.random.default_rng(0)

    def record(kernel, case, err, tol=2e-5):
        out.append({"kernel": kernel, "case": case, "max_err": err, "tol": tol, "pass": bool(err <= tol)})

    def both(fn):
        return fn(dev, dev.to_numpy), fn(ref, ref.to_numpy)

    # dense GEMV and prefill matmul, every type
    for ty in L.TYPES:
        raw = L.random_rows(rng, ty, d, d)
        w_abs = np.abs(L.dequantize(raw, ty, d))
        mats = {D: D.upload_matrix(raw, ty, d) for D in (dev, ref)}
        for T in (1, 4, 40):
            x = rng.standard_normal((T, d)).astype(np.float32)
            g, w = both(lambda D, get, x=x, mats=mats: get(D.matmul(mats[D], D.asarray(x))))
            record("matmul", f"{L.NAMES[ty]} {d}x{d} T={T}", _err(g, w, np.abs(x) @ w_abs.T + 1e-30),
                   1e-4 if T >= 32 else 2e-5)
        idx = rng.integers(0, d, 77).astype(np.int32)
        g, w = both(lambda D, get, mats=mats, idx=idx: get(D.dequant_rows(mats[D], D.asarray(idx))))
        record("dequant_rows", f"{L.NAMES[ty]} 77 of {d}", _err(g, w, 1.0), 0.0)

    # sparse FFN, Llama-13B layer, all neurons on the GPU in a shuffled bucket, 10% predicted active
    for ty, acts in ((L.F16, ("relu", "silu", "drelu")), (L.Q4_0, ("relu", "silu")), (L.Q8_0, ("relu",)),
                     (L.BF16, ("relu",)), (L.Q4_1, ("relu",)), (L.F32, ("relu_up", "gelu_up"))):
        gate, up, down = (L.random_rows(rng, ty, n_ff, d, 0.05) for _ in range(3))
        bias = rng.standard_normal(n_ff).astype(np.float32) * 0.1
        bucket = rng.permutation(n_ff).astype(np.int32)
        gated = acts[0] in ("silu", "relu", "drelu")
        ffns = {D: D.upload_ffn(up, down, ty, d, bucket, act=acts[0], gate=gate if gated else None,
                                up_bias=None if gated else bias) for D in (dev, ref)}
        for act in acts:
            for T in (1, 5):
                x = rng.standard_normal((T, d)).astype(np.float32)
                scores = rng.random((T, n_ff)).astype(np.float32)
                cats = 0.02 if act == "silu" and T == 5 else None

                def ffn(D, get, act=act, x=x, scores=scores, cats=cats, ffns=ffns, T=T):
                    f = dataclasses.replace(ffns[D], act=ACT_CODES[act])
                    h = D.ffn_up(f, D.asarray(x), scores=D.asarray(scores), threshold=0.9, cats=cats)
                    return get(h), get(D.ffn_down(f, h, D.zeros((T, d))))

                (gh, gy), (wh, wy) = both(ffn)
                case = f"{L.NAMES[ty]} {act} k={n_ff} T={T}{' cats' if cats else ''}"
                record("ffn_up", case, _err(gh, wh, np.abs(wh).max() + 1e-30), 1e-4)
                record("ffn_down", case, _err(gy, wy, np.abs(wy).max() + 1e-30), 1e-4)
            # prefill: ffn() from PREFILL_T tokens on (GEMMs over dequantised tiles + the ffn_act kernel)
            T = PREFILL_T + 1
            x = rng.standard_normal((T, d)).astype(np.float32)
            scores = rng.random((T, n_ff)).astype(np.float32)
            cats = 0.02 if act == "silu" else None

            def ffn_prefill(D, get, act=act, x=x, scores=scores, cats=cats, ffns=ffns, T=T):
                f = dataclasses.replace(ffns[D], act=ACT_CODES[act])
                return get(D.ffn(f, D.asarray(x), scores=D.asarray(scores), threshold=0.9, cats=cats))

            g, w = both(ffn_prefill)
            record("ffn_prefill", f"{L.NAMES[ty]} {act} k={n_ff} T={T}{' cats' if cats else ''}",
                   _err(g, w, np.abs(w).max() + 1e-30), 1e-4)
    # predictor: r = 1024, with the ids of the CPU's active neurons
    fc1 = (rng.standard_normal((1000, d)) * 0.02).astype(np.float16)
    fc2 = (rng.standard_normal((n_ff, 1000)) * 0.05).astype(np.float16)
    skip = (rng.random(n_ff) < 0.3).astype(np.uint8)
    x = rng.standard_normal((1, d)).astype(np.float32)

    def pred(D, get):
        s, found = D.predict(D.upload_predictor(fc1, fc2), D.asarray(x), threshold=0.5, skip=D.asarray(skip), ids=True)
        found = get(found)
        return get(s), found[1:1 + int(found[0])]

    (gs, gi), (ws, wi) = both(pred)
    record("predict", f"r=1000 n_ff={n_ff}", _err(gs, ws, np.abs(ws).max()), 1e-4)
    r_q = 1024  # as stored: a Q4_0 predictor (PowerInfer's quantize), fc1 and fc2 in their encoding
    q1 = (L.random_rows(rng, L.Q4_0, r_q, d, 0.02), L.Q4_0, d)
    q2 = (L.random_rows(rng, L.Q4_0, n_ff, r_q, 0.05), L.Q4_0, r_q)
    gq, wq = both(lambda D, get: get(D.predict(D.upload_predictor(q1, q2), D.asarray(x))))
    record("predict as stored", f"Q4_0 r={r_q} n_ff={n_ff}", _err(gq, wq, np.abs(wq).max()), 1e-4)
    near = np.abs(ws[0] - 0.5) < 1e-4 * np.abs(ws).max()  # ids may differ only where a score is within rounding
    diff = np.setxor1d(gi, wi)
    record("select_active", f"n_ff={n_ff} ({len(wi)} selected)", float(np.sum(~near[diff])), 0.0)

    # norms
    x = (rng.standard_normal((4, d)) + 2).astype(np.float32)
    w, b = rng.standard_normal(d).astype(np.float32), rng.standard_normal(d).astype(np.float32)
    g, r = both(lambda D, get: get(D.rms_norm(D.asarray(x), D.asarray(w), 1e-5)))
    record("rms_norm", f"4x{d}", _err(g, r, np.abs(r).max()))
    g, r = both(lambda D, get: get(D.layer_norm(D.asarray(x), D.asarray(w), D.asarray(b), 1e-5)))
    record("layer_norm", f"4x{d}", _err(g, r, np.abs(r).max()))
    p = rng.standard_normal((4, d)).astype(np.float32)  # the host's share added in, the residual copied out

    def fused(D, get, layer):
        xx, cp = D.asarray(x), D.zeros((4, d))
        kw = dict(add=D.asarray(p), copy=cp)
        y = D.layer_norm(xx, D.asarray(w), D.asarray(b), 1e-5, **kw) if layer else D.rms_norm(xx, D.asarray(w), 1e-5,
                                                                                                **kw)
        return get(y), get(xx), get(cp)

    for layer in (False, True):
        (gy, gx, gc), (ry, rx, rc) = both(lambda D, get, layer=layer: fused(D, get, layer))
        record("layer_norm+add+copy" if layer else "rms_norm+add+copy", f"4x{d}",
               max(_err(gy, ry, np.abs(ry).max()), _err(gx, rx, np.abs(rx).max()), _err(gc, rc, np.abs(rc).max())))

    # attention: 13B MHA, 70B-style GQA, MQA; decode and a prefill chunk; both RoPE orders
    cases = ((40, 40, 128, False, 1, 0), (40, 40, 128, False, 1, 3000), (64, 8, 128, False, 1, 2047),
             (64, 8, 128, True, 7, 1500), (71, 1, 64, True, 1, 1000))
    ctx = 4096
    if quick:  # the same kinds of case at a size the CPU emulation runs in seconds
        cases, ctx = ((4, 4, 128, False, 1, 0), (8, 2, 64, True, 3, 300), (5, 1, 32, False, 1, 400)), 512
    for n_head, n_kv, hd, neox, T, pos in cases:
        q = rng.standard_normal((T, n_head, hd)).astype(np.float32)
        k, v = (rng.standard_normal((T, n_kv, hd)).astype(np.float32) for _ in range(2))
        ck, cv = (rng.standard_normal((n_kv, ctx, hd)).astype(np.float16) for _ in range(2))

        def att(D, get, q=q, k=k, v=v, ck=ck, cv=cv, neox=neox, pos=pos):
            kc, vc = D.asarray(ck), D.asarray(cv)
            return get(D.attention(D.asarray(q), D.asarray(k), D.asarray(v), kc, vc, pos, neox=neox,
                                   base=10000.0)), get(kc)

        (go, gk), (wo, wk) = both(att)
        case = f"{n_head}/{n_kv} heads hd={hd} {'neox' if neox else 'llama'} T={T} pos={pos}"
        record("attention", case, _err(go, wo, np.abs(wo).max()), 1e-4)
        record("rope+kv f16", case, _err(gk, wk, np.abs(wk).max()), 1e-3)  # may differ by one f16 rounding step


def print_checks(checks: list) -> None:
    print(f"{'kernel':<14} {'case':<46} {'max err':>10} {'tol':>8}  result")
    for c in checks:
        print(f"{c['kernel']:<14} {c['case']:<46} {c['max_err']:>10.2e} {c['tol']:>8.0e}  "
              f"{'ok' if c['pass'] else 'FAIL'}")


# ---------------------------------------------------------------- speed

def _time(cp, fn, reps: int) -> float:
    """GPU seconds per call of fn(i), i = 0..reps-1: the calls are captured in a CUDA graph and the graph is timed
    between events, so the host's launch overhead (~10 us per CuPy launch from Python, more than many of these
    kernels take) is not in the number; a decode loop would replay such graphs too. Warm calls first, on the same
    stream, so that the memory pool serves the capture's allocations."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for i in range(3):
            fn(i)
        stream.synchronize()
        stream.begin_capture()
        try:
            for i in range(reps):
                fn(i)
        finally:
            graph = stream.end_capture()
        graph.launch(stream)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(3):
            graph.launch(stream)
        stop.record(stream)
        stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / 1e3 / (3 * reps)


def copy_bandwidth(cp) -> float:
    """Read + write bytes per second of a device-to-device copy of 2 GiB (long enough that launch costs vanish;
    not in a graph, where CuPy's copy became a memcpy node that ran at 2.7 TB/s against 4.2 TB/s as a kernel)."""
    a = cp.ones(1 << 29, cp.float32)
    b = cp.empty_like(a)
    cp.copyto(b, a)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(10):
        cp.copyto(b, a)
    stop.record()
    stop.synchronize()
    return 2 * a.nbytes * 10 / (cp.cuda.get_elapsed_time(start, stop) / 1e3) / 1e9


# A copy kernel as the sparse kernels are timed (in a graph, cycling through buffers that together exceed L2): the
# fastest a kernel that must move N bytes can be at that size, launch and DRAM ramp included. The 2 GiB copy above is
# the asymptote; a 10% layer of a 13B model is only 14-28 MB, where fixed costs are a large share of any kernel.
_COPY_SRC = r"""
extern "C" __global__ void copy16(const uint4* __restrict__ a, uint4* __restrict__ b, long long n) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    b[i] = __ldcg(a + i);
}
"""
_copy_times: dict[int, float] = {}


def same_size_copy(cp, nbytes: int, sm_count: int) -> float:
    """GPU seconds of a copy kernel moving nbytes in all (nbytes / 2 read, nbytes / 2 written), timed like the
    kernels (_time), each call on another of COPIES buffer pairs."""
    half = max(16, nbytes // 2 // 16 * 16)
    if half not in _copy_times:
        fn = cp.RawKernel(_COPY_SRC, "copy16")
        n = half // 16
        bufs = [(cp.ones(half, cp.uint8), cp.empty(half, cp.uint8)) for _ in range(COPIES)]
        grid = (min(-(-n // 256), 8 * sm_count),)
        _copy_times[half] = _time(cp, lambda i: fn(grid, (256,), (bufs[i % COPIES][0], bufs[i % COPIES][1],
                                                                 np.int64(n))), 40)
        del bufs
    return _copy_times[half]


def _copies(dev, ffn):
    out = [ffn]
    for _ in range(COPIES - 1):
        mats = {n: None if getattr(ffn, n) is None else dataclasses.replace(getattr(ffn, n),
                                                                             data=getattr(ffn, n).data.copy())
                for n in ("gate", "up", "down")}
        out.append(dataclasses.replace(ffn, **mats))
    return out


def run_bench(dev, cp, out: list, copy_gbps: float, d: int, n_ff: int) -> None:
    from pinfer_llm.runtime.gpu import layout as L

    rng = np.random.default_rng(1)

    def record(kernel, case, t, nbytes, **params):
        gbps = nbytes / t / 1e9
        try:  # a failure here must not cost the kernel's own figure
            same = same_size_copy(cp, nbytes, dev.sm_count) / t
        except Exception as e:  # noqa: BLE001
            same, params["same_size_copy_error"] = float("nan"), repr(e)
        out.append({"kernel": kernel, "case": case, "us": round(t * 1e6, 2), "touched_mb": round(nbytes / 1e6, 2),
                    "gbps": round(gbps, 1), "of_copy": round(gbps / copy_gbps, 3),
                    "of_same_size_copy": round(same, 3), **params})
        extra = " ".join(f"{k}={v}" for k, v in params.items())
        print(f"{kernel:<12} {case:<34} {t * 1e6:9.1f} us {nbytes / 1e6:8.1f} MB {gbps:7.0f} GB/s "
              f"{gbps / copy_gbps:6.1%} {same:6.1%}  {extra}")

    print(f"\n{'kernel':<12} {'case':<34} {'time':>12} {'touched':>11} {'rate':>12} {'of copy':>7} "
          f"{'of same-size copy':>7}")
    n_sel = n_ff // 10
    for ty in (L.F16, L.Q4_0, L.Q8_0):
        rb = L.row_bytes(ty, d)
        gate, up, down = (L.random_rows(rng, ty, n_ff, d, 0.05) for _ in range(3))
        ffn = dev.upload_ffn(up, down, ty, d, np.arange(n_ff, dtype=np.int32), act="silu", gate=gate)
        layers = _copies(dev, ffn)
        for T in (1, 4):
            x = dev.asarray(rng.standard_normal((T, d)).astype(np.float32))
            h_out = dev.empty((T, n_ff))
            scores = []  # a different 10% per copy; each token selects the same rows (a decode batch's union)
            for _ in range(COPIES):
                s = np.zeros((T, n_ff), np.float32)
                s[:, rng.choice(n_ff, n_sel, replace=False)] = 1.0
                scores.append(dev.asarray(s))
            for g in (None, dev.sm_count, 2 * dev.sm_count, 8 * dev.sm_count):  # blocks of the gate/up kernel
                dev.up_blocks = g
                t = _time(cp, lambda i, x=x, scores=scores, layers=layers, h_out=h_out: dev.ffn_up(
                    layers[i % COPIES], x, scores=scores[i % COPIES], threshold=0.5, out=h_out), 40)
                record("sparse_up", f"{L.NAMES[ty]} silu 10% T={T}", t, 2 * n_sel * rb,
                       blocks=g or dev._up_blocks(n_ff))
            dev.up_blocks = None
            hs = []
            for _ in range(COPIES):
                h = np.zeros((T, n_ff), np.float32)
                h[:, rng.choice(n_ff, n_sel, replace=False)] = rng.standard_normal((T, n_sel))
                hs.append(dev.asarray(h))
            y = dev.zeros((T, d))
            units = -(-d // 1024)
            for sp in (None, -(-dev.sm_count // units), -(-4 * dev.sm_count // units)):
                dev.down_splits = sp
                t = _time(cp, lambda i, hs=hs, y=y, layers=layers: dev.ffn_down(layers[i % COPIES], hs[i % COPIES], y),
                          40)
                used = sp or dev._down_splits(n_ff, units)
                record("sparse_down", f"{L.NAMES[ty]} 10% T={T}", t, n_sel * rb, splits=used, blocks=units * used)
            dev.down_splits = None
        # ReLU: gate and up rows of every selected neuron (read together: sparse_up no longer skips dead gates' up)
        relu = [dataclasses.replace(f, act=1) for f in layers]
        x = dev.asarray(rng.standard_normal((1, d)).astype(np.float32))
        s = np.zeros((1, n_ff), np.float32)
        sel = rng.choice(n_ff, n_sel, replace=False)
        s[:, sel] = 1.0
        s = dev.asarray(s)
        h_out = dev.empty((1, n_ff))
        t = _time(cp, lambda i, relu=relu, x=x, s=s, h_out=h_out: dev.ffn_up(relu[i % COPIES], x, scores=s,
                                                                             threshold=0.5, out=h_out), 40)
        record("sparse_up", f"{L.NAMES[ty]} relu 10% T=1", t, 2 * n_sel * rb)
        # dense GEMV over the whole up matrix (an output head or projection: every row)
        for T in (1, 4):
            x = dev.asarray(rng.standard_normal((T, d)).astype(np.float32))
            y_out = dev.empty((T, n_ff))
            t = _time(cp, lambda i, x=x, layers=layers, y_out=y_out: dev.matmul(layers[i % COPIES].up, x, out=y_out),
                      20)
            record("gemv", f"{L.NAMES[ty]} {n_ff}x{d} T={T}", t, n_ff * rb)
        layers = relu = ffn = None
        cp.get_default_memory_pool().free_all_blocks()
    # the predictor, 13B-sized (r = 1024), one token: F16 with fc2 transposed (fc1, then the fc2 rows of the hidden
    # units ReLU keeps) against Q4_0 as stored (fc1, then all of fc2); bytes are what each reads
    r_p = 1024
    xh = rng.standard_normal((1, d)).astype(np.float32)
    x = dev.asarray(xh)
    f1 = (rng.standard_normal((r_p, d)) / np.sqrt(d)).astype(np.float16)
    f2 = (rng.standard_normal((n_ff, r_p)) / np.sqrt(r_p)).astype(np.float16)
    live = int((f1.astype(np.float32) @ xh[0] > 0).sum())
    preds = [dev.upload_predictor(f1, f2) for _ in range(COPIES)]
    t = _time(cp, lambda i: dev.predict(preds[i % COPIES], x), 20)
    record("predict", f"F16 transposed r={r_p} n_ff={n_ff}", t, r_p * d * 2 + live * n_ff * 2, live_hidden=live)
    q1 = (L.random_rows(rng, L.Q4_0, r_p, d, 0.02), L.Q4_0, d)
    q2 = (L.random_rows(rng, L.Q4_0, n_ff, r_p, 0.05), L.Q4_0, r_p)
    preds = [dev.upload_predictor(q1, q2) for _ in range(COPIES)]
    t = _time(cp, lambda i: dev.predict(preds[i % COPIES], x), 20)
    record("predict", f"Q4_0 as stored r={r_p} n_ff={n_ff}", t,
           L.row_bytes(L.Q4_0, d) * r_p + L.row_bytes(L.Q4_0, r_p) * n_ff)
    preds = None
    # attention, decode at 4096 positions, 13B MHA: K and V of 40 heads read once
    n_head, hd, ctx = 40, 128, 4096
    kc, vc = dev.kv_cache(n_head, ctx, hd)
    q, k, v = (dev.asarray(rng.standard_normal((1, n_head, hd)).astype(np.float32)) for _ in range(3))
    o = dev.empty((1, n_head, hd))
    t = _time(cp, lambda i: dev.attention(q, k, v, kc, vc, ctx - 1, out=o), 40)
    record("attention", f"decode 40 heads x {ctx} pos", t, 2 * n_head * ctx * hd * 2)
    kc = vc = None
    if d == D:
        try:
            bench_70b_layer(dev, cp, rng, record)
        except Exception as e:  # noqa: BLE001 - keep what ran
            out.append({"kernel": "70b layer", "error": repr(e)})
            traceback.print_exc()


def bench_70b_layer(dev, cp, rng, record) -> None:
    """The sparse FFN at 10% on a Llama-70B layer (8192 x 28672): 2.3x the bytes of a 13B layer, so fixed costs
    weigh less. One random matrix serves as gate, up and down (the values do not change the speed)."""
    from pinfer_llm.runtime.gpu import layout as L

    d, n_ff = 8192, 28672
    n_sel = n_ff // 10
    for ty in (L.F16, L.Q4_0):
        rb = L.row_bytes(ty, d)
        w = L.random_rows(rng, ty, n_ff, d, 0.05)
        layers = _copies(dev, dev.upload_ffn(w, w, ty, d, np.arange(n_ff, dtype=np.int32), act="silu", gate=w))
        del w
        x = dev.asarray(rng.standard_normal((1, d)).astype(np.float32))
        h_out = dev.empty((1, n_ff))
        scores, hs = [], []
        for _ in range(COPIES):
            s = np.zeros((1, n_ff), np.float32)
            s[:, rng.choice(n_ff, n_sel, replace=False)] = 1.0
            scores.append(dev.asarray(s))
            h = np.zeros((1, n_ff), np.float32)
            h[:, rng.choice(n_ff, n_sel, replace=False)] = rng.standard_normal((1, n_sel))
            hs.append(dev.asarray(h))
        t = _time(cp, lambda i, L_=layers, x=x, s=scores, h=h_out: dev.ffn_up(L_[i % COPIES], x, scores=s[i % COPIES],
                                                                            threshold=0.5, out=h), 40)
        record("sparse_up", f"{L.NAMES[ty]} silu 10% 70B layer T=1", t, 2 * n_sel * rb)
        y = dev.zeros((1, d))
        t = _time(cp, lambda i, L_=layers, hs=hs, y=y: dev.ffn_down(L_[i % COPIES], hs[i % COPIES], y), 40)
        record("sparse_down", f"{L.NAMES[ty]} 10% 70B layer T=1", t, n_sel * rb)
        layers = None
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    sys.exit(main())
