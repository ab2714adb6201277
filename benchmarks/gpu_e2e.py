"""End to end on a GPU: one planted ReLU model, every placement, the same engine, the same CPU threads.

    python benchmarks/gpu_e2e.py --shape llama2-13b --type f16 --vram-budget 12 --threads 8 --out results.json

`make gpu-check` runs this as its second half (benchmarks/gpu_check.py calls `run_e2e`).
1. Makes the model with synth.fast (a Llama2-13B-shaped PowerInfer file: F16, ~26 GB, predictors, activation
   statistics; written once, into /dev/shm when it has room).
2. Loads it once per placement (`plan`, `layers`, `powerinfer`, `cpu`: pi-run's engine, the hybrid executor) and
   once with no GPU at all (the CPU sparse path), all held at once (the weights are memory-mapped, shared).
3. Interleaved paired rounds: each round decodes the same greedy continuation under every placement, in an order
   that rotates from round to round, so a drift of the machine's speed falls on every placement alike; ratios such
   as plan/layers are medians of the per-round ratios. Per placement: decode tokens/s, the per-token split (CPU
   work, waiting for the GPU, copies: the host thread's time), the CPU's bytes per token (the cost model's
   accounting of what the placement leaves it) and the bandwidth that makes, VRAM used.
4. Tokens and logits against the CPU sparse path, step by step: the prompt, then a fixed sequence of distinct
   tokens fed one decode step at a time, so that the greedy next token changes from step to step (a planted
   model's free continuation repeats one token); per step the argmax of both and max |logit difference|.
5. The cost model before and after a fit (planner.calibration): before, with the machine file's constants; after,
   with the kernels' fitted constants (gpu_check's) and the two these runs pin down (the CPU's bandwidth from the
   CPU-only run, the host's time per split layer from the plan run); the other runs are out of sample. The fitted
   constants are printed as `pi-plan --hw` lines.
6. `timed`: a short extra decode per placement with the device's own compute and copy time per token (CUDA events,
   runtime/gpu/timing.py), apart from the figures above because the events cost host time.
A deadline (--deadline, seconds from the start) stops new work: what did not fit is recorded as not run.
Needs CuPy and a CUDA GPU (`--gpu reference` runs the same code on the CPU stand-in: tests/test_gpu_check_harness.py).
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
PLACEMENTS = ("plan", "layers", "powerinfer", "cpu")
CPU_PATH = "cpu path"  # the reference: no GPU at all


class Deadline:
    """Seconds left of a run's budget (None: no limit)."""

    def __init__(self, seconds: float | None, t0: float | None = None):
        self.t0 = time.perf_counter() if t0 is None else t0
        self.seconds = seconds

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - (time.perf_counter() - self.t0)

    def allows(self, need: float) -> bool:
        return self.left() >= need


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


def make_model(path: Path, shape: str, qtype: str, say=print) -> dict | None:
    """Write the planted model unless it is there already; what synth.fast reports, or None when it existed."""
    if path.exists():
        return None
    from pinfer_llm.synth.fast import generate_fast

    made = generate_fast(path, shape, qtype, say=say)
    say(f"made {path} ({made['bytes'] / 1e9:.1f} GB) in {made['seconds']:.1f} s")
    return made


def load(path: Path, gpu: str, placement: str, args) -> tuple[object, dict]:
    from pinfer_llm.runtime import load_model

    notes: list[str] = []
    t0 = time.perf_counter()
    m = load_model(path, threads=args.threads, ctx_size=args.ctx, ffn_mode="sparse", gpu=gpu,
                   placement=None if gpu == "none" else placement,
                   vram_budget=args.vram_budget if gpu != "none" else None, say=notes.append)
    return m, {"placement": placement, "gpu": gpu, "load_s": round(time.perf_counter() - t0, 2), "notes": notes,
               "plan": _as_plan(m) if gpu != "none" else None}


def _as_plan(m) -> dict:
    """The placement a run used, as the planner's Plan fields (GPU neurons are the hottest, as placements make them)."""
    p = m.placement
    return {"attn": p.attn.astype(int).tolist(), "pred": p.pred.astype(int).tolist(),
            "n_gpu": [len(b) for b in p.buckets], "output": int(p.output)}


def decode_round(m, ids: list[int], tokens: int) -> dict:
    out = list(m.generate(ids, max_tokens=tokens, temperature=0.0))
    rep = m.hybrid_report()
    return {"tokens": out, "decode_tokens_per_s": m.stats.decode_tps,
            "per_token": rep["per_token"] if rep else {"cpu_ms": round(1e3 / max(m.stats.decode_tps, 1e-9), 3),
                                                       "gpu_wait_ms": 0.0, "transfer_ms": 0.0}}


def timed_decode(m, ids: list[int], tokens: int) -> dict:
    from pinfer_llm.runtime.gpu.timing import Timeline

    m.split.timeline = m.transformer.dev.start_timeline()
    try:
        list(m.generate(ids, max_tokens=tokens, temperature=0.0))
        return m.hybrid_report()["per_token"] | {"decode_tokens_per_s": round(m.stats.decode_tps, 3)}
    finally:
        Timeline.uninstall(m.transformer.dev)
        m.split.timeline = None


def paired_rounds(models: dict, ids: list[int], tokens: int, rounds: int, deadline: Deadline) -> dict:
    """Every placement once per round, the order rotating; rounds stop when the next would pass the deadline."""
    names = list(models)
    per: dict[str, list[dict]] = {n: [] for n in names}
    took: list[float] = []
    for r in range(rounds):
        if took and not deadline.allows(max(took) * 1.2):
            break
        t0 = time.perf_counter()
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            per[n].append(decode_round(models[n], ids, tokens))
        took.append(time.perf_counter() - t0)
    return {"rounds_run": len(took), "rounds_asked": rounds, "order": "rotating", "per": per}


def summarise(per: list[dict]) -> dict:
    """Median decode speed over the rounds after the first (which warms caches and the GPU), per-token split too."""
    use = per[1:] or per
    keys = ("cpu_ms", "gpu_wait_ms", "transfer_ms")
    split = {k: round(statistics.median(r["per_token"][k] for r in use), 3) for k in keys}
    return {"decode_tokens_per_s": round(statistics.median(r["decode_tokens_per_s"] for r in use), 3),
            "decode_tokens_per_s_rounds": [round(r["decode_tokens_per_s"], 3) for r in per],
            "per_token": split, "host_ms_per_token": round(split["cpu_ms"] + split["transfer_ms"], 3),
            "tokens": per[0]["tokens"], "tokens_same_every_round": all(r["tokens"] == per[0]["tokens"] for r in per)}


def paired_ratio(per: dict, a: str, b: str) -> float | None:
    """Median over the rounds (after the first) of a's tokens/s over b's in the same round."""
    if a not in per or b not in per or not per[a] or not per[b]:
        return None
    pairs = list(zip(per[a], per[b], strict=False))
    pairs = pairs[1:] or pairs
    return round(statistics.median(x["decode_tokens_per_s"] / y["decode_tokens_per_s"] for x, y in pairs), 3)


def forced_ids(prompt_ids: list[int], vocab: int, steps: int, seed: int = 7) -> list[int]:
    """The prompt, then `steps` distinct tokens (none of the prompt's), each fed as one decode step."""
    import numpy as np

    rng = np.random.default_rng(seed)
    pool = np.setdiff1d(np.arange(3, vocab), prompt_ids)
    return list(prompt_ids) + [int(t) for t in rng.choice(pool, size=min(steps, len(pool)), replace=False)]


def step_logits(m, ids: list[int], n_prompt: int):
    """Logits after the prompt (one prefill) and after each later token (one decode step each): [steps + 1, vocab]."""
    import torch

    tr = m.transformer
    with torch.inference_mode():
        out = [tr.forward(torch.tensor(ids[:n_prompt]), 0)]
        for p in range(n_prompt, len(ids)):
            out.append(tr.forward(torch.tensor([ids[p]]), p))
    m.cached_ids = []  # the forward passes above bypassed generate's record of the cache
    return torch.cat([o.reshape(1, -1) for o in out]).float().numpy()


def compare_steps(ref, got) -> dict:
    """Per step: the argmax of both, and max |logit difference| (also relative to the reference's largest logit)."""
    import numpy as np

    diff = np.abs(got - ref).max(axis=1)
    scale = np.abs(ref).max(axis=1)
    a_ref, a_got = ref.argmax(axis=1), got.argmax(axis=1)
    return {"steps": len(ref), "argmax_equal": bool((a_ref == a_got).all()),
            "argmax_equal_steps": int((a_ref == a_got).sum()), "distinct_reference_argmax": int(len(set(a_ref))),
            "max_abs_logit_diff": [round(float(x), 5) for x in diff],
            "max_rel_logit_diff": round(float((diff / np.maximum(scale, 1e-30)).max()), 6),
            "reference_argmax": a_ref.tolist(), "argmax": a_got.tolist()}


def problem_for_run(path: Path, args):
    """The planner's problem for this model on this GPU and budget, as pi-run makes it (the machine file's defaults)."""
    from pinfer_llm.formats.reader import open_gguf
    from pinfer_llm.runtime.hybrid import devices
    from pinfer_llm.runtime.hybrid import placement as pl

    _, info, why = devices.acquire(args.gpu)
    if info is None:
        raise RuntimeError(f"no GPU: {why}")
    budget = pl.budget_bytes(info, args.vram_budget)
    return pl.problem_for(open_gguf(path), info, budget, args.ctx, args.threads, lambda msg: None), info, budget


def plans_of(problem, runs: dict) -> dict:
    """label -> planner.plan.Plan of each run that has a measured speed."""
    import numpy as np

    from pinfer_llm.planner.plan import Plan

    L = problem.model.n_layer
    out = {}
    for label, r in runs.items():
        if not r.get("decode_tokens_per_s"):
            continue
        d = r.get("plan") or {"attn": [0] * L, "pred": [0] * L, "n_gpu": [0] * L, "output": 0}
        n_gpu = np.array(d["n_gpu"])
        out[label] = Plan(label, d["attn"], d["pred"], (n_gpu > 0).astype(int), n_gpu, d["output"])
    return out


def cpu_traffic(problem, plans: dict, runs: dict) -> None:
    """Per run: the CPU's bytes per token (the cost model's accounting of what the placement leaves the CPU) and the
    bandwidth that makes over the measured CPU time per token."""
    from pinfer_llm.planner.costmodel import cpu_work

    for label, plan in plans.items():
        nbytes, _ = cpu_work(problem, plan)
        cpu_ms = runs[label]["per_token"]["cpu_ms"]
        runs[label]["cpu_bytes_per_token"] = int(nbytes)
        runs[label]["cpu_gbs"] = float(f"{nbytes / (cpu_ms * 1e-3) / 1e9:.4g}") if cpu_ms > 0 else None


def calibrate(problem, plans: dict, runs: dict, device_fit=None) -> dict:
    """Predictions before and after the fit (planner.calibration.calibrate_hybrid), and the --hw lines."""
    from pinfer_llm.planner.calibration import calibrate_hybrid
    from pinfer_llm.planner.costmodel import evaluate

    before = {k: round(evaluate(problem, p).tokens_per_s, 3) for k, p in plans.items()}
    timed = {k: (p, 1.0 / runs[k]["decode_tokens_per_s"]) for k, p in plans.items()}
    cpu_run = CPU_PATH if CPU_PATH in timed else "cpu"
    out: dict = {"predicted_before": before}
    # the host's time per split layer from the first run that has split layers (the plan may have none: where a
    # split costs the host more than it saves, whole layers go to the GPU)
    split_run = next((k for k in ("plan", "powerinfer", "layers") if k in timed
                      and evaluate(problem, timed[k][0]).split.any()), None)
    if cpu_run not in timed or split_run is None:
        return out | {"error": "needs the CPU-only run and a run with split layers"}
    try:
        fit = calibrate_hybrid(problem, timed, cpu_run=cpu_run, split_run=split_run, device=device_fit)
    except ValueError as e:
        return out | {"error": str(e)}
    err = fit.errors()
    out.update({
        "cpu_bw_gbs": round(fit.cpu_bw_gbs, 2), "host_split_layer_us": round(fit.host_split_layer_us, 1),
        "host_split_us_total": round(fit.host_split_layer_us + problem.hw.host_calls_per_split_layer
                                     * problem.hw.host_call_us, 1),
        "fitted_on": fit.fitted_on,
        "runs": {k: {"measured_tokens_per_s": round(fit.measured[k], 3),
                     "predicted_before": round(fit.before[k], 3), "error_before": round(fit.errors_before()[k], 4),
                     "predicted_after": round(fit.predicted[k], 3), "error_after": round(err[k], 4),
                     "out_of_sample": k not in fit.fitted_on} for k in timed},
        "hw_file": fit.hw_lines()})
    return out


def run_e2e(args, deadline: Deadline, say=print, device_fit=None, model_ready=None) -> dict:
    """Steps 2-5 of the module docstring on the model at args.model (made if absent). model_ready: a callable that
    waits for a model being made elsewhere (gpu_check starts it at once) and returns what synth.fast reported."""
    import torch

    res: dict = {"shape": args.shape, "type": args.type, "vram_budget_gib": args.vram_budget, "threads": args.threads,
                 "tokens": args.tokens, "ctx": args.ctx, "not_run": []}
    path = model_path(args.shape, args.type, args.model)
    res["model"] = str(path)
    res["made"] = model_ready() if model_ready else make_model(path, args.shape, args.type, say)
    placements = [p for p in args.placements.split(",") if p]
    models, runs = {}, {}
    load_s: list[float] = []
    for name, gpu in [(CPU_PATH, "none")] + [(p, args.gpu) for p in placements]:
        if load_s and not deadline.allows(max(load_s) * 1.5 + 30):
            res["not_run"].append(f"{name}: not loaded (deadline)")
            continue
        try:
            m, info = load(path, gpu, name if gpu != "none" else "cpu", args)
        except Exception as e:  # noqa: BLE001 - a placement that cannot run is a result too
            runs[name] = {"placement": name, "error": f"{type(e).__name__}: {e}"}
            say(f"{name}: {runs[name]['error']}")
            continue
        load_s.append(info["load_s"])
        models[name], runs[name] = m, info
        rep = m.hybrid_report()
        if rep:
            info |= {"vram_bytes": rep["vram_bytes"], "summary": rep["placement"]}
        say(f"loaded {name} in {info['load_s']:.1f} s")
    if CPU_PATH not in models:
        return res | {"runs": runs, "error": "the CPU path did not load"}
    ids = models[CPU_PATH].tokenizer.encode(PROMPT)
    rounds = paired_rounds(models, ids, args.tokens, args.rounds, deadline)
    res["rounds"] = {k: v for k, v in rounds.items() if k != "per"}
    if rounds["rounds_run"] < args.rounds:
        res["not_run"].append(f"rounds {rounds['rounds_run'] + 1}-{args.rounds} (deadline)")
    for name, per in rounds["per"].items():
        if per:
            runs[name] |= summarise(per)
            runs[name]["tokens_equal_cpu_path"] = runs[name]["tokens"] == runs[CPU_PATH].get("tokens")
    for a, b in (("plan", "layers"), ("plan", "powerinfer"), ("plan", "cpu")):
        r = paired_ratio(rounds["per"], a, b)
        if r is not None:
            res[f"{a}_over_{b}"] = r
    # step by step against the CPU path; the reference logits once
    forced = forced_ids(ids, models[CPU_PATH].cfg.vocab_size, args.steps)
    res["forced_tokens"] = forced[len(ids):]
    step_s = None
    ref = None
    for name, m in models.items():
        if name == CPU_PATH:
            continue
        if not deadline.allows(2 * step_s if step_s else 20):
            res["not_run"].append(f"{name}: logits step by step (deadline)")
            continue
        t0 = time.perf_counter()
        if ref is None:
            ref = step_logits(models[CPU_PATH], forced, len(ids))
        runs[name]["against_cpu_path"] = compare_steps(ref, step_logits(m, forced, len(ids)))
        step_s = time.perf_counter() - t0
    # the device's own compute and copy time per token: a short extra decode with CUDA events (not in the figures
    # above: the events cost host time)
    for name, m in models.items():
        if name == CPU_PATH or not args.timed_tokens:
            continue
        if not deadline.allows(10):
            res["not_run"].append(f"{name}: timed decode (deadline)")
            continue
        runs[name]["timed"] = timed_decode(m, ids, args.timed_tokens)
    try:
        problem, info, budget = problem_for_run(path, args)
        plans = plans_of(problem, runs)
        cpu_traffic(problem, plans, runs)
        res["gpu"] = info.name
        res["calibration"] = calibrate(problem, plans, runs, device_fit)
    except Exception as e:  # noqa: BLE001 - keep the measurements
        res["calibration"] = {"error": f"{type(e).__name__}: {e}"}
    for m in models.values():
        del m
    models.clear()
    gc.collect()
    if args.gpu == "cuda":
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    res["runs"] = runs
    return res


RUN1 = _TREE / "benchmarks/gpu_runs/2026-11-30-e2e-13b-run1.json"
RUN2 = _TREE / "benchmarks/gpu_runs/2026-11-30-e2e-13b-run2.json"


def replay(run1: Path = RUN1, run2: Path = RUN2, say=print) -> dict:
    """The cost model against the one H200 session's runs, without a GPU (`--replay`): its model rebuilt as a
    weightless skeleton (llama2-13b F16, synth.fast's planted frequencies; run 1's model fired as its CPU run
    measured per layer, a synth bug since fixed), its placements re-planned as the planner then did (today's byte
    accounting, so a few thousand neurons fewer; the old cost model: one 0.8 efficiency, no host term), and each
    predicted by today's cost model: the CPU's bandwidth fitted on run 1's CPU-only run, the GPU's constants the
    H200 defaults, the host's time per split layer the machine file's default (measured here, on today's code) and,
    beside it, the value run 2's plan run fits (the code then: ~5 synchronous copies and 14 launches per split
    layer)."""
    import tempfile
    from dataclasses import replace

    import numpy as np

    from pinfer_llm.planner.activations import Activations
    from pinfer_llm.planner.baselines import all_baselines
    from pinfer_llm.planner.calibration import calibrate_hybrid
    from pinfer_llm.planner.costmodel import evaluate
    from pinfer_llm.planner.hardware import CPU, Hardware, lookup_gpu
    from pinfer_llm.planner.ilp import solve
    from pinfer_llm.planner.problem import build_problem
    from pinfer_llm.planner.skeleton import make_skeleton
    from pinfer_llm.synth.fast import TOKENS
    from pinfer_llm.synth.generator import power_law_frequencies

    r1, r2 = json.loads(Path(run1).read_text()), json.loads(Path(run2).read_text())
    a = r1["args"]
    with tempfile.TemporaryDirectory() as d:
        skel = make_skeleton(r1["shape"], Path(d) / "skeleton.gguf", quant=r1["type"])
        L, n_ff = 40, 13824
        freq = power_law_frequencies(n_ff, 0.9, 1.0)  # synth.fast's defaults (the order does not matter here)
        gpu = lookup_gpu("h200")
        gpu.vram_budget_gib = a["vram_budget"]
        cpu = CPU("H200 host", a["threads"], 100.0, 128.0)
        now = Hardware(cpu, [gpu])
        then = Hardware(cpu, [gpu], gpu_dense_efficiency={}, gpu_sparse_efficiency={}, host_split_layer_us=0.0,
                        host_call_us=0.0)

        def problem(hw, freqs):
            return build_problem(skel, hw, ctx_size=a["ctx"], activations=Activations(freqs, TOKENS, "replay"))

        planted = [freq] * L
        p_then = problem(then, planted)
        base = all_baselines(p_then)
        plans = {"plan": solve(p_then, "time", "cbc", 60.0, 1e-3, baselines=base).plan,
                 "layers": base["layers"].plan, "powerinfer": base["powerinfer"].plan, "cpu": base["cpu"].plan}

        def scaled(target: float) -> np.ndarray:  # the planted curve scaled to a measured active fraction
            lo, hi = 0.0, 1e3
            for _ in range(80):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if np.minimum(1, freq * mid).mean() < target else (lo, mid)
            return np.minimum(1, freq * hi)

        cpu_run = next(r for r in r1["runs"] if r["gpu"] == "none")
        faulty = [scaled(f) for f in cpu_run["sparsity"]]
        measured = {1: {r["placement"]: r["decode_tokens_per_s"] for r in r1["runs"] if r["gpu"] != "none"},
                    2: {r["placement"]: r["decode_tokens_per_s"] for r in r2["runs"] if r.get("decode_tokens_per_s")}}
        recorded = {i: {r["placement"]: r.get("predicted_tokens_per_s") for r in rr["runs"] if r.get("gpu") != "none"}
                    for i, rr in ((1, r1), (2, r2))}
        p1 = problem(now, faulty)
        fit = calibrate_hybrid(p1, {"cpu": (plans["cpu"], 1 / cpu_run["decode_tokens_per_s"]),
                                    "plan": (plans["plan"], 1 / measured[1]["plan"])})
        bw = fit.cpu_bw_gbs
        at = replace(now, cpu=replace(cpu, mem_bw_gbs=bw, bw_efficiency=1.0))
        p2 = problem(at, planted)
        host2 = calibrate_hybrid(p2, {"cpu": (plans["cpu"], evaluate(p2, plans["cpu"]).time),
                                      "plan": (plans["plan"], 1 / measured[2]["plan"])}).host_split_layer_us
        rows = []
        for run, freqs in ((1, faulty), (2, planted)):
            for name, plan in plans.items():
                row = {"run": run, "placement": name, "measured": measured[run].get(name),
                       "before_recorded": recorded[run].get(name), "gpu_neurons": int(plan.n_gpu.sum())}
                for key, host in (("after_default_host", now.host_split_layer_us), ("after_host_fitted_run2", host2)):
                    hw = replace(at, host_split_layer_us=host)
                    p = problem(hw, freqs)
                    row[key] = round(evaluate(p, plan).tokens_per_s, 2)
                rows.append(row)
    out = {"cpu_bw_gbs_fitted_run1": round(bw, 1), "host_split_layer_us_default": now.host_split_layer_us,
           "host_split_us_default_total": now.host_split_us, "host_split_layer_us_fitted_run2": round(host2, 1),
           "host_split_layer_us_fitted_run1": round(fit.host_split_layer_us, 1), "rows": rows}
    calls = now.host_calls_per_split_layer * now.host_call_us
    say(f"CPU bandwidth fitted on run 1's CPU-only run: {bw:.1f} GB/s; host per split layer: default "
        f"{now.host_split_us:.0f} us ({now.host_split_layer_us:g} Python + {calls:g} CuPy calls), fitted on run 2's "
        f"plan {host2 + calls:.0f} us, on run 1's {fit.host_split_layer_us + calls:.0f} us")
    say(f"{'run':>3} {'placement':<11} {'measured':>9} {'before':>7} {'after':>7} {'after, host of run 2':>21}")
    for r in rows:
        m = f"{r['measured']:.2f}" if r["measured"] else "-"
        b = f"{r['before_recorded']:.1f}" if r["before_recorded"] else "-"
        say(f"{r['run']:>3} {r['placement']:<11} {m:>9} {b:>7} {r['after_default_host']:7.2f} "
            f"{r['after_host_fitted_run2']:21.2f}")
    return out


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--shape", help="synth.fast shape (tiny, 1b, llama2-7b, llama2-13b, ...; default llama2-13b, "
                                    "tiny on a stand-in device)")
    ap.add_argument("--type", default="f16")
    ap.add_argument("--model", help="use this file instead of making one")
    ap.add_argument("--vram-budget", type=float, default=12.0, help="GiB (a consumer card's)")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens per placement and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16, help="decode steps of the logits comparison")
    ap.add_argument("--timed-tokens", type=int, default=8,
                    help="then decode this many once more with --gpu-timing's CUDA events (0: not)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--gpu", default="cuda", help="cuda, or reference (the CPU stand-in: tests this script)")
    ap.add_argument("--placements", default=",".join(PLACEMENTS))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    ap.add_argument("--out", default="benchmarks/results/gpu_e2e.json")
    ap.add_argument("--deadline", type=float, default=None, help="start nothing new after this many seconds")
    ap.add_argument("--replay", action="store_true",
                    help="no GPU: today's cost model against the recorded H200 runs (benchmarks/gpu_runs/)")
    args = ap.parse_args(argv)
    args.shape = args.shape or ("tiny" if args.gpu == "reference" else "llama2-13b")
    if args.replay:
        print(json.dumps(replay(), indent=1))
        return 0
    res = run_e2e(args, Deadline(args.deadline))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
