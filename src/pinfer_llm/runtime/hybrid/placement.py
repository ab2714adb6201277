"""Where each part of a model runs when pi-run has a GPU: attention (with its KV cache), the predictor, the hottest
FFN neurons of every layer, the output head.

A placement comes, in this order, from
1. the plan pi-plan stored in the model (pinfer.plan.* and blk.N.gpu_bucket), if it was made for this model
   (fingerprint), for this GPU and for no more memory than the GPU has free;
2. PowerInfer's sidecar <model>.generated.gpuidx (FFN neurons only: its dense parts are placed as PowerInfer places
   them, greedily, see planner/baselines.py);
3. the planner, run now for the GPU found (a plan of a 70B takes seconds); the result is cached under
   $PINFER_CACHE_DIR/plans so the next run starts at once, and the model file is never rewritten.
`--placement layers|powerinfer|cpu|gpu` runs the planner's baselines instead, so that they can be measured with the
same engine; `-ngl N` (n_gpu_layers) is the layers baseline with exactly N layers on the GPU, as llama.cpp's flag.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.errors import PinferError
from pinfer_llm.formats.header import GGUFFile

PLACEMENTS = ("plan", "layers", "powerinfer", "cpu", "gpu")
GIB = 1 << 30


@dataclass
class Placement:
    name: str  # "plan" | "layers" | "powerinfer" | "cpu" | "gpu" | "gpuidx"
    attn: np.ndarray  # bool [n_layer]: attention and its KV cache on the GPU
    pred: np.ndarray  # bool [n_layer]: the predictor on the GPU
    buckets: list[np.ndarray]  # per layer: sorted int64 ids of the neurons on the GPU
    output: bool  # the output head on the GPU
    source: str  # where it came from, for the user
    predicted_tokens_per_s: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def n_layer(self) -> int:
        return len(self.attn)

    @property
    def gpu_neurons(self) -> int:
        return int(sum(len(b) for b in self.buckets))

    @property
    def on_gpu(self) -> bool:
        return bool(self.attn.any() or self.pred.any() or self.output or self.gpu_neurons)

    def summary(self) -> dict:
        return {"name": self.name, "source": self.source, "attention_on_gpu": int(self.attn.sum()),
                "predictors_on_gpu": int(self.pred.sum()), "gpu_neurons": self.gpu_neurons,
                "output_on_gpu": self.output, "predicted_tokens_per_s": self.predicted_tokens_per_s}

    @classmethod
    def from_plan(cls, plan, order: list[np.ndarray], name: str, source: str, tps: float | None = None) -> Placement:
        """From a planner.plan.Plan and the frequency order it was made with (the GPU neurons are the hottest)."""
        buckets = [np.sort(idx[:k]).astype(np.int64) for k, idx in zip(plan.n_gpu, order, strict=True)]
        return cls(name, plan.attn > 0, plan.pred > 0, buckets, bool(plan.output), source, tps)

    @classmethod
    def cpu(cls, n_layer: int, source: str = "no GPU") -> Placement:
        no = np.zeros(n_layer, dtype=bool)
        return cls("cpu", no, no.copy(), [np.zeros(0, np.int64) for _ in range(n_layer)], False, source)


@dataclass
class GPUInfo:
    """The GPU pi-run found: its name as the driver reports it, memory, and the planner's row for it."""

    name: str
    total_bytes: int
    free_bytes: int
    mem_bw_gbs: float | None = None  # from the device's clock and bus width, when it reports them
    table_name: str | None = None  # the planner's GPU table entry matched by name

    def planner_gpu(self, budget_bytes: int):
        """A planner.hardware.GPU for this card with the given budget: its table row, or one built from the
        device's own properties (PCIe 4.0 x16 assumed; fp16 throughput does not bound batch-1 decoding)."""
        from pinfer_llm.planner.hardware import GPU, lookup_gpu

        gib = budget_bytes / GIB
        if self.table_name:
            g = lookup_gpu(self.table_name)
            g.vram_gib = max(g.vram_gib, self.total_bytes / GIB)
            g.vram_budget_gib = min(gib, g.vram_gib)
            return g
        return GPU(name=self.name, vram_gib=self.total_bytes / GIB, mem_bw_gbs=self.mem_bw_gbs or 500.0, pcie_gen=4,
                   pcie_lanes=16, fp16_tflops=50.0, vram_budget_gib=min(gib, self.total_bytes / GIB))


def match_gpu_table(name: str, total_bytes: int) -> str | None:
    """The planner's table entry for a driver-reported name and memory ("NVIDIA GeForce RTX 4090", 24 GB ->
    rtx4090), or None. Names alone are ambiguous (A100 40 GB and 80 GB, or A10 inside "A100"): the row's memory must
    be within 20% of the card's."""
    from pinfer_llm.planner.hardware import gpu_table

    flat = "".join(ch for ch in name.lower().replace("nvidia", "").replace("geforce", "") if ch.isalnum())
    best = None
    for key, row in gpu_table().items():
        stem = "".join(ch for ch in key.split("-")[0] if ch.isalnum())  # "a100-40g" -> "a100"
        if stem in flat and abs(row["vram_gib"] * GIB - total_bytes) <= 0.2 * total_bytes:
            if best is None or len(stem) > len(best[1]):
                best = (key, stem)
    return best[0] if best else None


def budget_bytes(gpu: GPUInfo, vram_budget_gib: float | None) -> int:
    """What pi-run may use: --vram-budget (as PowerInfer's flag), else the free memory less a CUDA reserve."""
    if vram_budget_gib is not None:
        if vram_budget_gib <= 0:
            raise PinferError(f"--vram-budget must be positive, got {vram_budget_gib}")
        want = int(vram_budget_gib * GIB)
        if want > gpu.free_bytes:
            raise PinferError(f"--vram-budget {vram_budget_gib:g} GiB is more than the {gpu.free_bytes / GIB:.2f} GiB "
                              f"free on {gpu.name}; lower it")
        return want
    return max(gpu.free_bytes - GIB // 2, 0)


def plan_cache_path(fingerprint: str, gpu: str, budget: int, ctx: int, name: str) -> Path:
    from pinfer_llm.planner.machine import cache_dir

    safe = "".join(c if c.isalnum() else "_" for c in gpu)
    return cache_dir() / "plans" / f"{fingerprint}-{safe}-{budget >> 20}MiB-ctx{ctx}-{name}.json"


def _stored(f: GGUFFile, gpu: GPUInfo, budget: int, say, ctx: int, threads: int, kv_type: str = "f16"
            ) -> Placement | None:
    """The plan in the file, if it fits this model, this GPU and this budget at this context (else None, with the
    reason said)."""
    from pinfer_llm.planner.costmodel import evaluate
    from pinfer_llm.planner.planfile import read_plan

    if not any(k.startswith(C.PLAN_PREFIX) for k in f.metadata) and not f.has(C.tensor(C.GPU_IDX, 0)):
        return None
    try:
        stored = read_plan(f)
    except PinferError as e:
        say(f"ignoring the plan in the file: {e}")
        return None
    planned_for = list(stored.meta.get(C.PLAN_GPUS, []))
    made_budget = int(stored.meta.get(C.PLAN_VRAM_BUDGET, 0))
    if planned_for and gpu.table_name not in planned_for and gpu.name not in planned_for:
        say(f"the plan in the file was made for {', '.join(planned_for)}, not {gpu.name}: planning again")
        return None
    if made_budget > budget:
        say(f"the plan in the file needs {made_budget / GIB:.2f} GiB of VRAM, {budget / GIB:.2f} GiB are available: "
            f"planning again")
        return None
    p = stored.plan
    # pi-plan checked it for its own context and KV type: a longer context's KV cache (and attention scratch) may
    # no longer leave room for what it put on the GPU
    ev = evaluate(problem_for(f, gpu, budget, ctx, threads, say, kv_type), p)
    if not ev.fits:
        say(f"the plan in the file does not fit {budget / GIB:.2f} GiB with a context of {ctx} "
            f"({'; '.join(ev.problems)}): planning again")
        return None
    tps = stored.meta.get(C.PLAN_TOKENS_PER_S)
    return Placement("plan", p.attn > 0, p.pred > 0, [np.asarray(b, np.int64) for b in stored.buckets],
                     bool(p.output), f"the plan in {Path(f.path).name}", float(tps) if tps is not None else None)


def problem_for(f: GGUFFile, gpu: GPUInfo, budget: int, ctx: int, threads: int, say, kv_type: str = "f16"):
    """The planner's problem for this model on `gpu` with `budget` bytes, the CPU side on `threads` threads, the KV
    cache in `kv_type` (the host's; counted the same on the GPU, whose cache is f16, so f32 over-counts there)."""
    from pinfer_llm.planner.activations import Activations
    from pinfer_llm.planner.machine import resolve_hardware
    from pinfer_llm.planner.problem import build_problem

    hw = resolve_hardware([], cpu_cores=threads)  # the CPU side runs on pi-run's threads, not on every core
    hw.gpus = [gpu.planner_gpu(budget)]
    acts = None
    if not f.has(C.tensor(C.ACT_COUNTS, 0)):
        say("the model has no activation statistics (pi-profile makes them): every neuron is taken as always "
            "active, so the placement is a whole-layer offload")
        from pinfer_llm.planner.memory import account

        n_ff = account(f, ctx).n_ff
        acts = Activations([np.ones(n) for n in n_ff], 1.0, "none")
    return build_problem(f, hw, ctx_size=ctx, activations=acts, kv_type=kv_type)


def planned(f: GGUFFile, gpu: GPUInfo, budget: int, ctx: int, threads: int, name: str, say,
            kv_type: str = "f16", n_gpu_layers: int | None = None) -> Placement:
    """A placement made now by the planner (the ILP for "plan", else the named baseline; "layers" with
    n_gpu_layers: exactly that many), cached by model, GPU, budget and context."""
    from pinfer_llm.planner.baselines import all_baselines
    from pinfer_llm.planner.ilp import solve
    from pinfer_llm.planner.planfile import fingerprint

    fp = fingerprint(f)
    kv = "" if kv_type == "f16" else f"-kv{kv_type}"
    ngl = "" if n_gpu_layers is None else f"-ngl{n_gpu_layers}"
    cache = plan_cache_path(fp, gpu.table_name or gpu.name, budget, ctx, f"{name}{ngl}-t{threads}{kv}")
    p = problem_for(f, gpu, budget, ctx, threads, say, kv_type)
    if cache.exists():
        try:
            data = json.loads(cache.read_text())
            return Placement(name, np.array(data["attn"], bool), np.array(data["pred"], bool),
                             [np.array(b, np.int64) for b in data["buckets"]], bool(data["output"]),
                             f"{data['source']} (cached)", data.get("tps"))
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache entry: plan again
    if n_gpu_layers is not None:
        plan, tps, source = _ngl(p, n_gpu_layers, gpu)
    elif name == "plan":
        baselines = all_baselines(p)
        say(f"planning for {gpu.name} with {budget / GIB:.2f} GiB of VRAM")
        sol = solve(p, "time", "cbc", 30.0, 1e-3, baselines=baselines)
        plan, tps = sol.plan, sol.evaluation.tokens_per_s
        source = f"pi-plan for {gpu.table_name or gpu.name}, {budget / GIB:.2f} GiB"
    else:
        base = all_baselines(p)[name]
        if base.plan is None:
            raise PinferError(f"--placement {name} is not possible on {gpu.name} with {budget / GIB:.2f} GiB: "
                              f"{base.note}; a larger --vram-budget, or --placement plan, runs it")
        plan, tps = base.plan, (1 / base.time if base.time else None)
        source = f"the {name} baseline for {gpu.table_name or gpu.name}, {budget / GIB:.2f} GiB"
    out = Placement.from_plan(plan, p.order, name, source, tps)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"attn": out.attn.tolist(), "pred": out.pred.tolist(),
                                   "buckets": [b.tolist() for b in out.buckets], "output": out.output,
                                   "source": source, "tps": tps}))
        os.replace(tmp, cache)
    except OSError:
        pass  # a read-only cache only costs the next run a solve
    return out


def _ngl(p, n: int, gpu: GPUInfo):
    """llama.cpp's -ngl n: (plan, predicted tokens/s, source), or a one-line error saying what it needs."""
    from pinfer_llm.planner.baselines import ngl_bytes, ngl_plan
    from pinfer_llm.planner.costmodel import evaluate

    L = p.model.n_layer
    what = (f"all {L} layers and the output head" if n > L else f"the last {n} of {L} layers" if n else
            f"none of the {L} layers")
    plan = ngl_plan(p, n)
    if plan is None:
        size = lambda b: f"{b / GIB:.2f} GiB" if b >= GIB else f"{b / 2**20:.1f} MiB"  # noqa: E731
        raise PinferError(f"-ngl {n} puts {what} on {gpu.name}, {size(ngl_bytes(p, n))}, and the GPU budget leaves "
                          f"{size(sum(p.budgets))} for them; a smaller -ngl, or a larger --vram-budget")
    ev = evaluate(p, plan)
    return plan, (ev.tokens_per_s if ev.fits else None), f"-ngl {n}: {what} on {gpu.table_name or gpu.name}"


def _sidecar(f: GGUFFile, gpu: GPUInfo, budget: int, ctx: int, threads: int, say,
             kv_type: str = "f16") -> Placement | None:
    """PowerInfer's <model>.generated.gpuidx: its FFN placement, with the dense parts PowerInfer's way."""
    from pinfer_llm.formats.gpuidx import gpuidx_path, read_gpuidx
    from pinfer_llm.planner.baselines import powerinfer_plan
    from pinfer_llm.planner.costmodel import evaluate
    from pinfer_llm.planner.plan import Plan

    path = gpuidx_path(f.path)
    if not path.exists():
        return None
    n_layer = int(f.arch_get(C.BLOCK_COUNT))
    try:
        idx = read_gpuidx(path, n_layer=n_layer, n_ff=f.info(C.tensor(C.FFN_UP, 0)).shape[0])
    except PinferError as e:
        say(f"ignoring {path.name}: {e}")
        return None
    if idx.vram_capacity > budget:
        say(f"{path.name} was made for {idx.vram_capacity / GIB:.2f} GiB of VRAM, {budget / GIB:.2f} GiB are "
            f"available: planning again")
        return None
    p = problem_for(f, gpu, budget, ctx, threads, say, kv_type)
    dense = powerinfer_plan(p)
    zeros = np.zeros(n_layer, np.int64)
    n_gpu = np.array([len(b) for b in idx.gpu_bucket])
    plan = Plan("gpuidx", dense.attn if dense else zeros, dense.pred if dense else zeros, (n_gpu > 0).astype(np.int64),
                n_gpu, dense.output if dense else 0)
    ev = evaluate(p, plan)
    if not ev.fits:
        say(f"{path.name} does not fit {gpu.name} with its dense parts ({'; '.join(ev.problems)}): planning again")
        return None
    return Placement("gpuidx", plan.attn > 0, plan.pred > 0, [np.asarray(b, np.int64) for b in idx.gpu_bucket],
                     bool(plan.output), f"PowerInfer's {path.name}", ev.tokens_per_s)


def choose(f: GGUFFile, gpu: GPUInfo, *, placement: str = "plan", vram_budget_gib: float | None = None,
           ctx: int, threads: int, kv_type: str = "f16", n_gpu_layers: int | None = None,
           say=lambda msg: None) -> Placement:
    """The placement pi-run executes on `gpu` (see the module docstring for the order of sources). n_gpu_layers:
    llama.cpp's -ngl, the layers placement with exactly that many layers on the GPU."""
    check_placement(placement, n_gpu_layers)
    budget = budget_bytes(gpu, vram_budget_gib)
    if n_gpu_layers is not None:
        return planned(f, gpu, budget, ctx, threads, "layers", say, kv_type, n_gpu_layers)
    if placement == "cpu":
        return Placement.cpu(int(f.arch_get(C.BLOCK_COUNT)), "--placement cpu")
    if placement == "plan":
        got = _stored(f, gpu, budget, say, ctx, threads, kv_type) or _sidecar(f, gpu, budget, ctx, threads, say,
                                                                             kv_type)
        if got is not None:
            return got
    return planned(f, gpu, budget, ctx, threads, placement, say, kv_type)


def check_placement(placement: str, n_gpu_layers: int | None = None) -> None:
    """A one-line error for an unknown placement, a negative -ngl, or -ngl with a placement other than layers."""
    if placement not in PLACEMENTS:
        raise PinferError(f"unknown --placement '{placement}' (one of {', '.join(PLACEMENTS)})")
    if n_gpu_layers is None:
        return
    if n_gpu_layers < 0:
        raise PinferError(f"-ngl/--n-gpu-layers must be >= 0, got {n_gpu_layers}")
    if placement != "layers":
        raise PinferError(f"-ngl {n_gpu_layers} is the layers placement (llama.cpp's); --placement {placement} is "
                          f"another: pass one of them")
