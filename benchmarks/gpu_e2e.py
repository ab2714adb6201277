"""End to end on a GPU: one planted ReLU model, every placement, the same engine, the same CPU threads.

    python benchmarks/gpu_e2e.py --shape llama2-13b --type f16 --vram-budget 12 --threads 8 --out results.json

1. Makes the model with synth.fast (a Llama2-13B-shaped PowerInfer file: F16, ~26 GB, predictors, activation
   statistics; written once, into /dev/shm when it has room).
2. Decodes the same greedy continuation of the same prompt with pi-run's engine under --placement plan, layers,
   powerinfer and cpu (the hybrid executor, runtime/hybrid/executor.py), and once with no GPU at all (the CPU sparse
   path).
3. Reports per placement: decode tokens/s, the per-token split (CPU, waiting for the GPU, copies), VRAM used, the
   planner's predicted tokens/s, whether the tokens equal the CPU path's, and the ratios plan/layers and
   plan/powerinfer; then `timed`: a short extra decode with the device's own compute and copy time per token (CUDA
   events, runtime/gpu/timing.py), apart from the measured figure because the events cost host time.
4. Calibrates the cost model on this machine (planner.calibration.calibrate_hybrid): the CPU's effective bandwidth
   on these threads from the CPU-only run, a split layer's cost from the plan run; then every run's prediction with
   both, the runs not fitted on being out of sample, and the two constants as a `pi-plan --hw` file's lines.
Needs CuPy and a CUDA GPU (`--gpu reference` runs the same script on the CPU stand-in, for testing it).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

_TREE = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_TREE), str(_TREE / "src")]  # the checkout, without an install

PROMPT = "Once upon a time, in a land far away, there lived"


def model_path(shape: str, qtype: str, where: str | None) -> Path:
    if where:
        return Path(where)
    shm = Path("/dev/shm")
    from pinfer_llm.synth.fast import SHAPES

    L, d, n_ff, *_ = SHAPES[shape]
    need = L * 3 * d * n_ff * (2 if qtype == "f16" else 4 if qtype == "f32" else 1) * 1.15
    if shm.is_dir() and shutil.disk_usage(shm).free > need + (4 << 30):
        return shm / f"pinfer-{shape}-{qtype}.gguf"
    return Path("/tmp") / f"pinfer-{shape}-{qtype}.gguf"


def run(path: Path, gpu: str, placement: str, args) -> dict:
    import torch

    from pinfer_llm.runtime import load_model
    from pinfer_llm.runtime.gpu.timing import Timeline

    notes: list[str] = []
    t0 = time.perf_counter()
    m = load_model(path, threads=args.threads, ctx_size=args.ctx, ffn_mode="sparse", gpu=gpu, placement=placement,
                   vram_budget=args.vram_budget if gpu != "none" else None, say=notes.append)
    load_s = time.perf_counter() - t0
    ids = m.tokenizer.encode(PROMPT)
    steps = []
    tokens = None
    for _ in range(args.rounds):  # the first round warms caches and the GPU; the median of the rest is reported
        out = list(m.generate(ids, max_tokens=args.tokens, temperature=0.0))
        tokens = tokens or out
        if out != tokens:
            notes.append("tokens differ between rounds")
        steps.append((m.stats.decode_tps, m.hybrid_report()))
    tps = statistics.median(s[0] for s in steps[1:] or steps)
    rep = steps[-1][1]
    res = {"placement": placement, "gpu": gpu, "load_s": round(load_s, 2), "decode_tokens_per_s": round(tps, 3),
           "decode_tokens_per_s_rounds": [round(s[0], 3) for s in steps], "tokens": tokens, "notes": notes,
           "prompt_tokens_per_s": round(m.stats.prompt_tps, 2), "sparsity": m.sparsity(),
           "hybrid": rep, "predicted_tokens_per_s": rep["placement"]["predicted_tokens_per_s"] if rep else None}
    res["plan"] = _as_plan(m) if gpu != "none" else None
    if gpu != "none" and args.timed_tokens:  # once more with the device's own time (CUDA events), not in the figure
        m.split.timeline = m.transformer.dev.start_timeline()
        list(m.generate(ids, max_tokens=args.timed_tokens, temperature=0.0))
        res["timed"] = m.hybrid_report()["per_token"] | {"decode_tokens_per_s": round(m.stats.decode_tps, 3)}
        Timeline.uninstall(m.transformer.dev)
        m.split.timeline = None
    del m
    gc.collect()
    if gpu == "cuda":
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return res


def _as_plan(m) -> dict:
    """The placement a run used, as the planner's Plan fields (GPU neurons are the hottest, as placements make them)."""
    p = m.placement
    return {"attn": p.attn.astype(int).tolist(), "pred": p.pred.astype(int).tolist(),
            "n_gpu": [len(b) for b in p.buckets], "output": int(p.output)}


def calibrate(path: Path, results: dict, args) -> dict:
    """Fit the cost model's CPU bandwidth and split-layer cost to the measured runs (see the module docstring)."""
    import numpy as np

    from pinfer_llm.formats.errors import PinferError
    from pinfer_llm.formats.reader import open_gguf
    from pinfer_llm.planner.calibration import calibrate_hybrid
    from pinfer_llm.planner.plan import Plan
    from pinfer_llm.runtime.hybrid import devices
    from pinfer_llm.runtime.hybrid import placement as pl

    try:
        _, info, why = devices.acquire(args.gpu)
        if info is None:
            return {"error": f"no GPU: {why}"}
        budget = pl.budget_bytes(info, args.vram_budget)
        problem = pl.problem_for(open_gguf(path), info, budget, args.ctx, args.threads, lambda msg: None)
    except PinferError as e:
        return {"error": str(e)}
    L = problem.model.n_layer
    runs = {}
    for r in results["runs"]:
        if "error" in r or not r.get("decode_tokens_per_s"):
            continue
        label = "cpu" if r["gpu"] == "none" else r["placement"]
        if label in runs:
            continue  # the CPU-only run and --placement cpu are the same plan: the first one counts
        d = r.get("plan") or {"attn": [0] * L, "pred": [0] * L, "n_gpu": [0] * L, "output": 0}
        n_gpu = np.array(d["n_gpu"])
        plan = Plan(label, d["attn"], d["pred"], (n_gpu > 0).astype(int), n_gpu, d["output"])
        runs[label] = (plan, 1.0 / r["decode_tokens_per_s"])
    if "cpu" not in runs or "plan" not in runs:
        return {"error": "needs the CPU-only run and the plan run"}
    try:
        fit = calibrate_hybrid(problem, runs)
    except ValueError as e:
        return {"error": str(e)}
    err = fit.errors()
    return {"cpu_bw_gbs": round(fit.cpu_bw_gbs, 2), "sync_us": round(fit.sync_us, 1), "fitted_on": fit.fitted_on,
            "runs": {k: {"measured_tokens_per_s": round(fit.measured[k], 3),
                         "predicted_tokens_per_s": round(fit.predicted[k], 3), "error": round(err[k], 4),
                         "out_of_sample": k not in fit.fitted_on} for k in runs},
            "uncalibrated_error": {r["placement"]: round(r["predicted_tokens_per_s"] / r["decode_tokens_per_s"] - 1, 4)
                                   for r in results["runs"] if r.get("predicted_tokens_per_s")
                                   and r.get("decode_tokens_per_s")},
            "hw_file": f"[cpu]\nmem_bw_gbs = {fit.cpu_bw_gbs:.2f}\nbw_efficiency = 1.0\n[engine]\n"
                       f"sync_us = {fit.sync_us:.1f}\n"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama2-13b")
    ap.add_argument("--type", default="f16")
    ap.add_argument("--model", help="use this file instead of making one")
    ap.add_argument("--vram-budget", type=float, default=12.0, help="GiB (a consumer card's)")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--timed-tokens", type=int, default=12,
                    help="then decode this many once more with --gpu-timing's CUDA events (0: not)")
    ap.add_argument("--gpu", default="cuda", help="cuda, or reference (the CPU stand-in: tests this script)")
    ap.add_argument("--placements", default="plan,layers,powerinfer,cpu")
    ap.add_argument("--out", default="benchmarks/results/gpu_e2e.json")
    ap.add_argument("--deadline", type=float, default=None, help="start no placement after this many seconds")
    ap.add_argument("--cpu-last", action="store_true", help="run the CPU-only reference after the placements")
    ap.add_argument("--merge-into", help="add the results as key 'e2e' of this JSON file (make gpu-check's)")
    args = ap.parse_args()

    from pinfer_llm.synth.fast import generate_fast

    t0 = time.perf_counter()
    path = model_path(args.shape, args.type, args.model)
    made = None
    if not path.exists():
        made = generate_fast(path, args.shape, args.type, say=print)
        print(f"made {path} ({made['bytes'] / 1e9:.1f} GB) in {made['seconds']:.1f} s", flush=True)
    results = {"model": str(path), "shape": args.shape, "type": args.type, "made": made, "args": vars(args),
               "runs": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        results["seconds"] = round(time.perf_counter() - t0, 1)
        if args.merge_into:
            target = Path(args.merge_into)
            whole = json.loads(target.read_text()) if target.exists() else {}
            whole["e2e"] = results
            target.write_text(json.dumps(whole, indent=1))
        else:
            out.write_text(json.dumps(results, indent=1))

    cpu = None
    if not args.cpu_last:
        cpu = run(path, "none", "cpu", args)
        print(f"cpu only: {cpu['decode_tokens_per_s']:.2f} tok/s", flush=True)
        results["runs"].append(cpu)
        save()
    for placement in args.placements.split(","):
        if args.deadline and time.perf_counter() - t0 > args.deadline:
            results["runs"].append({"placement": placement, "error": "skipped: --deadline"})
            continue
        try:
            r = run(path, args.gpu, placement, args)
        except Exception as e:  # noqa: BLE001 - a placement that cannot run is a result too
            r = {"placement": placement, "error": f"{type(e).__name__}: {e}"}
        r["tokens_equal_cpu"] = None if cpu is None else r.get("tokens") == cpu["tokens"]
        results["runs"].append(r)
        print(f"{placement}: {r.get('decode_tokens_per_s')} tok/s, predicted {r.get('predicted_tokens_per_s')}, "
              f"tokens equal: {r['tokens_equal_cpu']}, {r.get('error', '')}", flush=True)
        save()
    if cpu is None and not (args.deadline and time.perf_counter() - t0 > args.deadline):
        cpu = run(path, "none", "cpu", args)
        results["runs"].insert(0, cpu)
        for r in results["runs"][1:]:
            r["tokens_equal_cpu"] = r.get("tokens") == cpu["tokens"]
        print(f"cpu only: {cpu['decode_tokens_per_s']:.2f} tok/s", flush=True)
    by = {r["placement"]: r.get("decode_tokens_per_s") for r in results["runs"] if r.get("gpu") != "none"}
    if by.get("plan") and by.get("layers"):
        results["plan_over_layers"] = round(by["plan"] / by["layers"], 3)
    if by.get("plan") and by.get("powerinfer"):
        results["plan_over_powerinfer"] = round(by["plan"] / by["powerinfer"], 3)
    results["calibration"] = calibrate(path, results, args)
    save()
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
