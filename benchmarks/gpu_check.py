"""`make gpu-check`: everything one short session on a GPU should settle, in one run of under 5 minutes.

    python benchmarks/gpu_check.py --deadline 285 --out benchmarks/gpu_runs/DATE-gpu-check.json

Needs a CUDA GPU and CuPy (and a CUDA torch for the end-to-end half); without them it prints one line saying what is
missing and exits with status 2. In order, each phase started only while the deadline leaves it room (what did not
fit is listed under "not_run"); the planted model for phase 4 is written in the background from the start:
1. Correctness: every kernel through CudaDevice's methods against ReferenceDevice (float64) on random data at
   Llama-13B layer shapes (d = 5120, n_ff = 13824), Llama-70B-style GQA and MQA attention, RoPE base 500000 with
   linear scaling 2; max error relative to the scale of the terms.
2. Speed (CUDA events around CUDA graphs, warm): the device's copy bandwidth (read + write of a 2 GiB buffer); the
   sparse FFN at 10% active rows, dense GEMV, the predictor, decode attention, one tiny kernel for the fixed latency;
   bytes touched / time against that bandwidth and against a copy kernel of the same bytes timed the same way. Each
   timed launch reads another of several copies of the layer, so L2 does not serve repeats. From these, the cost
   model's GPU constants (planner.calibration.fit_device): efficiency per weight type, latency per kernel.
3. The checks of phase 1 at smaller shapes under compute-sanitizer's racecheck, synccheck and memcheck
   (benchmarks/gpu_sanitize.sh), each with its share of the time left (one line saying so where
   compute-sanitizer is not installed).
4. End to end (benchmarks/gpu_e2e.py): a planted Llama2-13B-shaped F16 model with --vram-budget 12, the placements
   plan, layers, powerinfer and cpu in interleaved paired rounds, tokens and logits against the CPU sparse path step
   by step, and the cost model before and after the fit, printed as `pi-plan --hw` lines.
All results go to one JSON file with the commit it measured. `--device emulated` runs phases 1, 2 and 4 on the CPU
stand-ins (the kernels under tests/cuda_emu, the executor on ReferenceDevice) at tiny shapes, so that CI runs every
code path of this script (tests/test_gpu_check_harness.py); its figures mean nothing.

Last run (H200, 2026-11-30, older code, its JSON not kept): 78/78 checks passed (max error 4e-7 of the terms'
scale); copy 4.25 TB/s; 10% sparse FFN, one token: F16 gate+up 19 us (35% of copy), down 9.6 us (35%); Q4_0 11% /
10%; dense GEMV F16 90%, Q8_0 47%, Q4_0 31%; attention decode at 4096 positions 39%.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # the checkout, without an install

from benchmarks import gpu_e2e  # noqa: E402  (not benchmarks/ itself on the path: its kernels.py shadows a package)

COPIES = 4  # layer copies cycled through in timed loops (4 x 28 MB touched at 10% F16 >> L2)
SANITIZERS = ("racecheck", "synccheck", "memcheck")  # as benchmarks/gpu_sanitize.sh runs them
E2E_RESERVE_S = 150  # what phase 4 needs at the least on an H200 (loads, three rounds, the logits steps)
LLAMA3_ROPE = (500000.0, 2.0)


@dataclasses.dataclass
class Size:
    d: int
    n_ff: int
    pred_rank: int
    pred_rank_q: int
    attention: tuple  # (n_head, n_kv, head_dim, neox, T, pos, rope base, rope scale)
    ctx: int


_MHA, _GQA = (40, 40, 128, False), (64, 8, 128, False)
SIZES = {
    "full": Size(5120, 13824, 1000, 1024, ((*_MHA, 1, 0, 1e4, 1.0), (*_MHA, 1, 3000, 1e4, 1.0),
                                           (*_GQA, 1, 2047, 1e4, 1.0), (64, 8, 128, True, 7, 1500, 1e4, 1.0),
                                           (71, 1, 64, True, 1, 1000, 1e4, 1.0),
                                           (32, 8, 128, False, 1, 2500, *LLAMA3_ROPE)), 4096),
    # the same kinds of case at a size compute-sanitizer (10-100x slower) runs in seconds
    "quick": Size(1056, 2048, 1000, 1024, ((4, 4, 128, False, 1, 0, 1e4, 1.0), (8, 2, 64, True, 3, 300, 1e4, 1.0),
                                           (5, 1, 32, False, 1, 400, 1e4, 1.0),
                                           (4, 2, 64, False, 2, 350, *LLAMA3_ROPE)), 512),
    # the CPU emulation of the kernels: every code path, in seconds
    "tiny": Size(64, 128, 32, 32, ((2, 2, 32, False, 1, 0, 1e4, 1.0), (4, 2, 16, True, 3, 20, 1e4, 1.0),
                                    (2, 1, 32, False, 1, 30, *LLAMA3_ROPE)), 64),
}


def commit() -> str:
    """The commit measured (+ "-dirty" with uncommitted changes), from git or $PINFER_COMMIT."""
    if os.environ.get("PINFER_COMMIT"):
        return os.environ["PINFER_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("-dirty" if dirty else "")) if head else "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    today = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    ap.add_argument("-o", "--out", default=str(ROOT / f"benchmarks/gpu_runs/{today}-gpu-check.json"))
    ap.add_argument("--device", choices=("cuda", "emulated"), default="cuda",
                    help="emulated: the CPU stand-ins at tiny shapes (tests this script; figures mean nothing)")
    ap.add_argument("--size", choices=tuple(SIZES), help="kernel shapes (default: full, tiny when emulated)")
    ap.add_argument("--quick", action="store_true", help="--size quick")
    ap.add_argument("--checks-only", action="store_true",
                    help="phase 1 only (what each compute-sanitizer tool runs)")
    ap.add_argument("--deadline", type=float, default=285.0, help="seconds: start no phase or round after this")
    ap.add_argument("--no-sanitize", action="store_true")
    ap.add_argument("--no-e2e", action="store_true")
    gpu_e2e.add_args(ap)
    args = ap.parse_args(argv)
    size = SIZES[args.size or ("quick" if args.quick else "tiny" if args.device == "emulated" else "full")]
    deadline = gpu_e2e.Deadline(args.deadline)
    try:
        dev, ref, clock, info = devices(args.device)
    except RuntimeError as e:
        print(f"gpu_check: no GPU to check: {e}", file=sys.stderr)
        return 2
    if args.device == "emulated":
        args.gpu = "reference"
    args.shape = args.shape or ("tiny" if args.device == "emulated" else "llama2-13b")
    res = {"commit": commit(), "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "device": dev.name, "gpu": info["name"], "size": dataclasses.asdict(size), "deadline_s": args.deadline,
           "checks": [], "bench": [], "not_run": []}
    background = None
    if not (args.checks_only or args.no_e2e):
        background = ModelMaker(gpu_e2e.model_path(args.shape, args.type, args.model), args.shape, args.type)
        args.model = str(background.path)

    try:
        return run_phases(args, size, deadline, dev, ref, clock, info, res, background)
    finally:
        if background is not None:
            background.cancel()


def run_phases(args, size, deadline, dev, ref, clock, info, res, background) -> int:
    # 1. correctness
    try:
        run_checks(dev, ref, res["checks"], size)
    except Exception as e:  # report what ran, and the error, rather than nothing
        res["checks"].append({"kernel": "checks", "case": "aborted", "error": repr(e), "max_err": float("nan"),
                              "tol": 0.0, "pass": False})
        traceback.print_exc()
    print_checks(res["checks"])
    res["checks_pass"] = all(c["pass"] for c in res["checks"])
    if args.checks_only:
        return finish(res, args, deadline)

    # 2. speed, and the device constants it gives
    device_fit = None
    if deadline.allows(E2E_RESERVE_S * (not args.no_e2e) + 20):
        try:
            res["copy_gbps"] = clock.copy_bandwidth()
            print(f"\ndevice copy bandwidth (read + write): {res['copy_gbps']:.0f} GB/s")
            run_bench(dev, clock, res["bench"], res["copy_gbps"], size)
            device_fit = fit_device(res, info)
        except Exception as e:  # noqa: BLE001 - keep what ran
            res["bench_error"] = repr(e)
            traceback.print_exc()
    else:
        res["not_run"].append("kernel speed (deadline)")

    # 3. compute-sanitizer
    if args.no_sanitize or args.device == "emulated":
        res["sanitizer"] = {"not run": "--no-sanitize" if args.no_sanitize else "emulated device"}
    else:
        res["sanitizer"] = sanitize(args, deadline.left() - E2E_RESERVE_S * (not args.no_e2e), res["not_run"])

    # 4. end to end
    if args.no_e2e:
        res["e2e"] = {"not run": "--no-e2e"}
    elif not deadline.allows(60):
        res["not_run"].append("end to end (deadline)")
    else:
        try:
            res["e2e"] = gpu_e2e.run_e2e(args, deadline, device_fit=device_fit, model_ready=background.wait)
            res["not_run"] += res["e2e"].pop("not_run", [])
            report_e2e(res["e2e"])
        except Exception as e:  # noqa: BLE001 - keep the kernels' results
            res["e2e"] = {"error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
    return finish(res, args, deadline)


def finish(res: dict, args, deadline) -> int:
    res["seconds"] = round(time.perf_counter() - deadline.t0, 1)
    res["all_pass"] = bool(res["checks_pass"]) and not any(
        v.get("verdict") in ("errors",) or str(v.get("verdict", "")).startswith("failed")
        for v in res.get("sanitizer", {}).values() if isinstance(v, dict))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=_json_default))
    n = len(res["checks"])
    print(f"\n{'PASS' if res['all_pass'] else 'FAIL'}: {sum(c['pass'] for c in res['checks'])}/{n} checks; "
          f"{res['seconds']} s; not run: {', '.join(res['not_run']) or 'nothing'}; results in {out}")
    return 0 if res["all_pass"] else 1


def _json_default(o):
    if isinstance(o, (np.integer, np.floating)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def devices(kind: str):
    """(device under test, float64 reference, clock, {"name", "datasheet_gbs"}) or RuntimeError (why not)."""
    from pinfer_llm.runtime.gpu import CudaDevice, GPUUnavailable, ReferenceDevice

    if kind == "emulated":
        from tests.cuda_emu import fake_cupy

        dev = CudaDevice(cupy=fake_cupy)
        return dev, ReferenceDevice(), WallClock(dev), {"name": "emulated (tests/cuda_emu)", "datasheet_gbs": 1000.0}
    try:
        dev = CudaDevice()
    except GPUUnavailable as e:
        raise RuntimeError(str(e)) from None
    import cupy as cp
    import torch

    from pinfer_llm.runtime.hybrid.devices import _cuda_info

    torch.set_num_threads(min(16, torch.get_num_threads()))
    gi = _cuda_info(dev)
    table = gi.planner_gpu(gi.total_bytes)
    return dev, ReferenceDevice(), CudaClock(cp, dev), {"name": gi.name, "table_row": gi.table_name,
                                                         "datasheet_gbs": table.mem_bw_gbs}


class ModelMaker:
    """The planted model of phase 4, written by a child process from the start (CPU and disk work, while the GPU
    runs phases 1-3)."""

    def __init__(self, path: Path, shape: str, qtype: str):
        self.path, self.made, self.proc = path, None, None
        if path.exists():
            return
        code = (f"import json, sys; sys.path[:0] = {[str(ROOT / 'src')]!r}; "
                f"from pinfer_llm.synth.fast import generate_fast; "
                f"print(json.dumps(generate_fast({str(path)!r}, {shape!r}, {qtype!r})))")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)

    def cancel(self) -> None:
        """Stop a model that nothing waited for (phase 4 did not run) and remove what it wrote, finished or not:
        a model made in this run but never used is not kept as if a run had checked it."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.path.unlink(missing_ok=True)
        self.proc = None

    def wait(self) -> dict | None:
        if self.proc is None:
            return self.made
        out, err = self.proc.communicate()
        if self.proc.returncode:
            raise RuntimeError(f"making {self.path} failed: {err.strip().splitlines()[-1] if err.strip() else '?'}")
        self.made = json.loads(out.strip().splitlines()[-1])
        self.proc = None
        print(f"made {self.path} ({self.made['bytes'] / 1e9:.1f} GB) in {self.made['seconds']:.1f} s")
        return self.made


def sanitize(args, budget_s: float, not_run: list) -> dict:
    """Phase 1 at --size quick under each compute-sanitizer tool (benchmarks/gpu_sanitize.sh), each with a third of
    `budget_s`; a tool that does not finish in its share is recorded as timed out."""
    per_tool = int(budget_s // len(SANITIZERS))
    if per_tool < 15:
        not_run.append("compute-sanitizer (deadline)")
        return {"sanitizer": "not run", "why": "deadline"}
    out = Path(args.out).with_suffix(".sanitize.json")
    try:
        subprocess.run(["bash", str(ROOT / "benchmarks/gpu_sanitize.sh"), sys.executable, str(out), str(per_tool)],
                       timeout=budget_s + 30, check=False)
        return json.loads(out.read_text())
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        return {"sanitizer": "failed", "why": repr(e)}


def report_e2e(e2e: dict) -> None:
    print(f"\n{'placement':<11} {'tok/s':>7} {'host ms':>8} {'CPU GB/tok':>10} {'CPU GB/s':>8} {'before':>7} "
          f"{'after':>7}  tokens/logits vs the CPU path")
    cal = e2e.get("calibration", {})
    for name, r in e2e.get("runs", {}).items():
        if "error" in r or "decode_tokens_per_s" not in r:
            print(f"{name:<11} {r.get('error', 'not run')}")
            continue
        c = cal.get("runs", {}).get(name, {})
        vs = r.get("against_cpu_path")
        cmp = (f"tokens {'equal' if r.get('tokens_equal_cpu_path') else 'DIFFER'}; argmax "
               f"{vs['argmax_equal_steps']}/{vs['steps']} steps, max |dlogit| {max(vs['max_abs_logit_diff']):.2e}"
               if vs else "(the reference)" if name == gpu_e2e.CPU_PATH else "not compared")
        print(f"{name:<11} {r['decode_tokens_per_s']:7.2f} {r['host_ms_per_token']:8.2f} "
              f"{r.get('cpu_bytes_per_token', 0) / 1e9:10.3f} {r.get('cpu_gbs') or 0:8.1f} "
              f"{c.get('predicted_before', float('nan')):7.2f} {c.get('predicted_after', float('nan')):7.2f}  {cmp}")
    for k in ("plan_over_layers", "plan_over_powerinfer", "plan_over_cpu"):
        if k in e2e:
            print(f"{k} (paired, median of rounds): {e2e[k]}")
    if "hw_file" in cal:
        print("\nthe fitted constants, as a pi-plan --hw file:\n" + cal["hw_file"])
    elif "error" in cal:
        print(f"\ncost model fit: {cal['error']}")


def fit_device(res: dict, info: dict):
    """The cost model's GPU constants from phase 2's one-token records."""
    from pinfer_llm.planner.calibration import fit_device as fit

    recs = [{"kernel": b["fit"], "type": b["type"], "us": b["us"], "touched_bytes": b["touched_mb"] * 1e6}
            for b in res["bench"] if b.get("fit")]
    if not recs:
        return None
    d = fit(recs, info["datasheet_gbs"])
    res["device_fit"] = dataclasses.asdict(d) | {"datasheet_gbs": info["datasheet_gbs"]}
    print(f"\ncost model GPU constants: latency {d.gpu_launch_us} us per kernel; dense {d.dense}; sparse {d.sparse}")
    return d


# ---------------------------------------------------------------- correctness

def _err(got, want, scale) -> float:
    """max |got - want| / scale: scale is the magnitude of the summed terms (rounding is relative to it)."""
    return float(np.max(np.abs(np.asarray(got, np.float64) - want) / scale))


def run_checks(dev, ref, out: list, size: Size) -> None:
    from pinfer_llm.runtime.gpu import ACT_CODES
    from pinfer_llm.runtime.gpu import layout as L
    from pinfer_llm.runtime.gpu.cuda import PREFILL_T

    rng = np.random.default_rng(0)
    d, n_ff = size.d, size.n_ff

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
    r = size.pred_rank
    fc1 = (rng.standard_normal((r, d)) * 0.02).astype(np.float16)
    fc2 = (rng.standard_normal((n_ff, r)) * 0.05).astype(np.float16)
    skip = (rng.random(n_ff) < 0.3).astype(np.uint8)
    x = rng.standard_normal((1, d)).astype(np.float32)

    def pred(D, get):
        s, found = D.predict(D.upload_predictor(fc1, fc2), D.asarray(x), threshold=0.5, skip=D.asarray(skip), ids=True)
        found = get(found)
        return get(s), found[1:1 + int(found[0])]

    (gs, gi), (ws, wi) = both(pred)
    record("predict", f"r={r} n_ff={n_ff}", _err(gs, ws, np.abs(ws).max()), 1e-4)
    r_q = size.pred_rank_q  # as stored: a Q4_0 predictor (PowerInfer's quantize), fc1 and fc2 in their encoding
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

    # attention: 13B MHA, 70B-style GQA, MQA; decode and a prefill chunk; both RoPE orders; Llama-3's RoPE base
    # 500000 with linear scaling 2 (a base or scale the kernel drops shows here)
    cases, ctx = size.attention, size.ctx
    for n_head, n_kv, hd, neox, T, pos, base, rope_scale in cases:
        q = rng.standard_normal((T, n_head, hd)).astype(np.float32)
        k, v = (rng.standard_normal((T, n_kv, hd)).astype(np.float32) for _ in range(2))
        ck, cv = (rng.standard_normal((n_kv, ctx, hd)).astype(np.float16) for _ in range(2))

        def att(D, get, q=q, k=k, v=v, ck=ck, cv=cv, neox=neox, pos=pos, base=base, rope_scale=rope_scale):
            kc, vc = D.asarray(ck), D.asarray(cv)
            return get(D.attention(D.asarray(q), D.asarray(k), D.asarray(v), kc, vc, pos, neox=neox, base=base,
                                   rope_scale=rope_scale)), get(kc)

        (go, gk), (wo, wk) = both(att)
        case = f"{n_head}/{n_kv} heads hd={hd} {'neox' if neox else 'llama'} T={T} pos={pos}"
        if base != 10000.0 or rope_scale != 1.0:
            case += f" base={base:g} scale={rope_scale:g}"
        record("attention", case, _err(go, wo, np.abs(wo).max()), 1e-4)
        record("rope+kv f16", case, _err(gk, wk, np.abs(wk).max()), 1e-3)  # may differ by one f16 rounding step


def print_checks(checks: list) -> None:
    print(f"{'kernel':<14} {'case':<46} {'max err':>10} {'tol':>8}  result")
    for c in checks:
        print(f"{c['kernel']:<14} {c['case']:<46} {c['max_err']:>10.2e} {c['tol']:>8.0e}  "
              f"{'ok' if c['pass'] else 'FAIL'}")


# ---------------------------------------------------------------- speed

class CudaClock:
    """GPU seconds per call, from CUDA events around a CUDA graph of the calls."""

    def __init__(self, cp, dev):
        self.cp, self.dev = cp, dev
        self._copy_times: dict[int, float] = {}

    def time(self, fn, reps: int) -> float:
        """GPU seconds per call of fn(i), i = 0..reps-1: the calls are captured in a CUDA graph and the graph is
        timed between events, so the host's launch overhead (~10 us per CuPy launch from Python, more than many of
        these kernels take) is not in the number; a decode loop would replay such graphs too. Warm calls first, on
        the same stream, so that the memory pool serves the capture's allocations."""
        cp = self.cp
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

    def copy_bandwidth(self) -> float:
        """Read + write GB/s of a device-to-device copy of 2 GiB (long enough that launch costs vanish; not in a
        graph, where CuPy's copy became a memcpy node that ran at 2.7 TB/s against 4.2 TB/s as a kernel)."""
        cp = self.cp
        a = cp.ones(1 << 29, cp.float32)
        b = cp.empty_like(a)
        cp.copyto(b, a)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(10):
            cp.copyto(b, a)
        stop.record()
        stop.synchronize()
        gbps = 2 * a.nbytes * 10 / (cp.cuda.get_elapsed_time(start, stop) / 1e3) / 1e9
        del a, b
        self.free()
        return gbps

    def same_size_copy(self, nbytes: int) -> float:
        """GPU seconds of a copy kernel moving nbytes in all (nbytes / 2 read, nbytes / 2 written), timed like the
        kernels, each call on another of COPIES buffer pairs: the fastest a kernel that must move that many bytes
        can be, launch and DRAM ramp included (a 10% layer of a 13B is only 14-28 MB)."""
        cp = self.cp
        half = max(16, nbytes // 2 // 16 * 16)
        if half not in self._copy_times:
            fn = cp.RawKernel(_COPY_SRC, "copy16")
            n = half // 16
            bufs = [(cp.ones(half, cp.uint8), cp.empty(half, cp.uint8)) for _ in range(COPIES)]
            grid = (min(-(-n // 256), 8 * self.dev.sm_count),)
            self._copy_times[half] = self.time(lambda i: fn(grid, (256,), (bufs[i % COPIES][0], bufs[i % COPIES][1],
                                                                          np.int64(n))), 40)
            del bufs
        return self._copy_times[half]

    def free(self) -> None:
        self.cp.get_default_memory_pool().free_all_blocks()


class WallClock:
    """The stand-in's clock: host seconds per call (the emulated kernels run on the CPU as they are called)."""

    def __init__(self, dev):
        self.dev = dev

    def time(self, fn, reps: int) -> float:
        fn(0)
        t0 = time.perf_counter()
        for i in range(reps):
            fn(i)
        self.dev.synchronize()
        return (time.perf_counter() - t0) / reps

    def copy_bandwidth(self) -> float:
        a = np.ones(1 << 22, np.float32)
        b = np.empty_like(a)
        t0 = time.perf_counter()
        np.copyto(b, a)
        return 2 * a.nbytes / (time.perf_counter() - t0) / 1e9

    def same_size_copy(self, nbytes: int) -> float:
        a = np.ones(max(nbytes // 2, 16), np.uint8)
        t0 = time.perf_counter()
        a.copy()
        return time.perf_counter() - t0

    def free(self) -> None:
        pass


_COPY_SRC = r"""
extern "C" __global__ void copy16(const uint4* __restrict__ a, uint4* __restrict__ b, long long n) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    b[i] = __ldcg(a + i);
}
"""


def _copies(ffn):
    out = [ffn]
    for _ in range(COPIES - 1):
        mats = {n: None if getattr(ffn, n) is None else dataclasses.replace(getattr(ffn, n),
                                                                             data=getattr(ffn, n).data.copy())
                for n in ("gate", "up", "down")}
        out.append(dataclasses.replace(ffn, **mats))
    return out


def run_bench(dev, clock, out: list, copy_gbps: float, size: Size) -> None:
    """Phase 2. Records with "fit" set are the one-token figures planner.calibration.fit_device reads."""
    from pinfer_llm.runtime.gpu import layout as L

    rng = np.random.default_rng(1)
    d, n_ff = size.d, size.n_ff
    reps = 40 if isinstance(clock, CudaClock) else 1

    def record(kernel, case, t, nbytes, ty="", fit=None, **params):
        gbps = nbytes / t / 1e9
        try:  # a failure here must not cost the kernel's own figure
            same = clock.same_size_copy(nbytes) / t
        except Exception as e:  # noqa: BLE001
            same, params["same_size_copy_error"] = float("nan"), repr(e)
        out.append({"kernel": kernel, "case": case, "type": ty, "fit": fit, "us": round(t * 1e6, 2),
                    "touched_mb": round(nbytes / 1e6, 4), "gbps": round(gbps, 1), "of_copy": round(gbps / copy_gbps, 3),
                    "of_same_size_copy": round(same, 3), **params})
        extra = " ".join(f"{k}={v}" for k, v in params.items())
        print(f"{kernel:<12} {case:<34} {t * 1e6:9.1f} us {nbytes / 1e6:8.1f} MB {gbps:7.0f} GB/s "
              f"{gbps / copy_gbps:6.1%} {same:6.1%}  {extra}")

    print(f"\n{'kernel':<12} {'case':<34} {'time':>12} {'touched':>11} {'rate':>12} {'of copy':>7} "
          f"{'of same-size copy':>7}")
    # the fixed latency: a norm of one 256-wide row moves ~2 KB
    x = dev.asarray(rng.standard_normal((1, 256)).astype(np.float32))
    w = dev.asarray(np.ones(256, np.float32))
    y = dev.empty((1, 256))
    record("rms_norm", "1x256 (latency)", clock.time(lambda i: dev.rms_norm(x, w, 1e-5, out=y), reps), 3 * 1024,
           "f32", "latency")
    n_sel = n_ff // 10
    for ty in (L.F16, L.Q4_0, L.Q8_0):
        name = L.NAMES[ty].lower()
        rb = L.row_bytes(ty, d)
        gate, up, down = (L.random_rows(rng, ty, n_ff, d, 0.05) for _ in range(3))
        layers = _copies(dev.upload_ffn(up, down, ty, d, np.arange(n_ff, dtype=np.int32), act="silu", gate=gate))
        for T in (1, 4):
            x = dev.asarray(rng.standard_normal((T, d)).astype(np.float32))
            h_out = dev.empty((T, n_ff))
            scores, hs = [], []  # a different 10% per copy; each token selects the same rows (a decode batch's union)
            for _ in range(COPIES):
                s = np.zeros((T, n_ff), np.float32)
                s[:, rng.choice(n_ff, n_sel, replace=False)] = 1.0
                scores.append(dev.asarray(s))
            for g in (None, dev.sm_count, 2 * dev.sm_count, 8 * dev.sm_count):  # blocks of the gate/up kernel
                dev.up_blocks = g
                t = clock.time(lambda i, x=x, scores=scores, layers=layers, h_out=h_out: dev.ffn_up(
                    layers[i % COPIES], x, scores=scores[i % COPIES], threshold=0.5, out=h_out), reps)
                # the fit takes the default grid's figure, the one the runtime launches
                record("sparse_up", f"{L.NAMES[ty]} silu 10% T={T}", t, 2 * n_sel * rb, name,
                       "sparse_up" if T == 1 and g is None else None, blocks=g or dev._up_blocks(n_ff))
            dev.up_blocks = None
            for _ in range(COPIES):
                h = np.zeros((T, n_ff), np.float32)
                h[:, rng.choice(n_ff, n_sel, replace=False)] = rng.standard_normal((T, n_sel))
                hs.append(dev.asarray(h))
            y = dev.zeros((T, d))
            units = -(-d // 1024)
            for sp in (None, -(-dev.sm_count // units), -(-4 * dev.sm_count // units)):
                dev.down_splits = sp
                t = clock.time(lambda i, hs=hs, y=y, layers=layers: dev.ffn_down(layers[i % COPIES], hs[i % COPIES],
                                                                                  y), reps)
                used = sp or dev._down_splits(n_ff, units)
                record("sparse_down", f"{L.NAMES[ty]} 10% T={T}", t, n_sel * rb, name,
                       "sparse_down" if T == 1 and sp is None else None, splits=used, blocks=units * used)
            dev.down_splits = None
        # ReLU: gate and up rows of every selected neuron (read together: sparse_up no longer skips dead gates' up)
        relu = [dataclasses.replace(f, act=1) for f in layers]
        x = dev.asarray(rng.standard_normal((1, d)).astype(np.float32))
        s = np.zeros((1, n_ff), np.float32)
        sel = rng.choice(n_ff, n_sel, replace=False)
        s[:, sel] = 1.0
        s = dev.asarray(s)
        h_out = dev.empty((1, n_ff))
        t = clock.time(lambda i, relu=relu, x=x, s=s, h_out=h_out: dev.ffn_up(relu[i % COPIES], x, scores=s,
                                                                              threshold=0.5, out=h_out), reps)
        record("sparse_up", f"{L.NAMES[ty]} relu 10% T=1", t, 2 * n_sel * rb, name)
        # dense GEMV over the whole up matrix (an output head or projection: every row)
        for T in (1, 4):
            x = dev.asarray(rng.standard_normal((T, d)).astype(np.float32))
            y_out = dev.empty((T, n_ff))
            t = clock.time(lambda i, x=x, layers=layers, y_out=y_out: dev.matmul(layers[i % COPIES].up, x,
                                                                                out=y_out), reps // 2 or 1)
            record("gemv", f"{L.NAMES[ty]} {n_ff}x{d} T={T}", t, n_ff * rb, name, "gemv" if T == 1 else None)
        layers = relu = None
        clock.free()
    # the predictor, one token: F16 with fc2 transposed (fc1, then the fc2 rows of the hidden units ReLU keeps)
    # against Q4_0 as stored (fc1, then all of fc2); bytes are what each reads
    r_p = size.pred_rank_q
    xh = rng.standard_normal((1, d)).astype(np.float32)
    x = dev.asarray(xh)
    f1 = (rng.standard_normal((r_p, d)) / np.sqrt(d)).astype(np.float16)
    f2 = (rng.standard_normal((n_ff, r_p)) / np.sqrt(r_p)).astype(np.float16)
    live = int((f1.astype(np.float32) @ xh[0] > 0).sum())
    preds = [dev.upload_predictor(f1, f2) for _ in range(COPIES)]
    t = clock.time(lambda i: dev.predict(preds[i % COPIES], x), reps // 2 or 1)
    record("predict", f"F16 transposed r={r_p} n_ff={n_ff}", t, r_p * d * 2 + live * n_ff * 2, "f16",
           live_hidden=live)
    q1 = (L.random_rows(rng, L.Q4_0, r_p, d, 0.02), L.Q4_0, d)
    q2 = (L.random_rows(rng, L.Q4_0, n_ff, r_p, 0.05), L.Q4_0, r_p)
    preds = [dev.upload_predictor(q1, q2) for _ in range(COPIES)]
    t = clock.time(lambda i: dev.predict(preds[i % COPIES], x), reps // 2 or 1)
    record("predict", f"Q4_0 as stored r={r_p} n_ff={n_ff}", t,
           L.row_bytes(L.Q4_0, d) * r_p + L.row_bytes(L.Q4_0, r_p) * n_ff, "q4_0")
    preds = None
    # attention, decode at the context's last position, MHA: K and V of every head read once
    n_head, hd = (40, 128) if d >= 5120 else (4, 32)
    ctx = size.ctx
    kc, vc = dev.kv_cache(n_head, ctx, hd)
    q, k, v = (dev.asarray(rng.standard_normal((1, n_head, hd)).astype(np.float32)) for _ in range(3))
    o = dev.empty((1, n_head, hd))
    t = clock.time(lambda i: dev.attention(q, k, v, kc, vc, ctx - 1, out=o), reps)
    record("attention", f"decode {n_head} heads x {ctx} pos", t, 2 * n_head * ctx * hd * 2, "f16")
    kc = vc = None
    clock.free()


if __name__ == "__main__":
    sys.exit(main())
