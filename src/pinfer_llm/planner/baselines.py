"""The placements pi-plan compares its plan with, each evaluated by the same cost model (placement only: every plan
runs on the same sparse engine, so the numbers compare where things live, not which engine is faster).

- layers:     llama.cpp's -ngl: the most whole layers (attention, KV cache, predictor, all neurons) that fit,
              the last layers first as llama.cpp offloads them, the output head only when every layer is offloaded.
              ngl_plan(p, N) is `-ngl N` itself: exactly the last N layers, the output head too when N > n_layer.
- powerinfer: the open-source PowerInfer's semantics (its solver.py and loader): dense parts greedily in its order
              (attention of every layer, then predictors, then the output head), stopping at the first that does
              not fit, and FFN neurons only if all dense parts fit; then a global top-k of 256-neuron groups under
              its neuron capacity floor(V / (n_ff * type_size * 4.5)) * 4 (2 instead of 4.5 without a gate). Where
              that heuristic capacity would overflow the real budget, groups are dropped until it fits. One
              difference: we keep each layer's KV cache with its attention (our cost model runs attention where
              its cache is); PowerInfer offloads the KV cache last.
- cpu:        everything on the CPU.
- gpu:        everything on the GPU(s), only where it all fits.
Several GPUs: layers and gpu pack whole layers into the GPUs in order; powerinfer uses the first GPU, as PowerInfer
supports one.
"""
# ruff: noqa: E741 - l is a layer index, as in the formulation (sum over layers l)

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from pinfer_llm.planner.costmodel import Evaluation, evaluate
from pinfer_llm.planner.plan import CPU, Plan
from pinfer_llm.planner.problem import Problem

BASELINES = ("layers", "powerinfer", "cpu", "gpu")
POWERINFER_GROUP = 256


@dataclass
class Baseline:
    name: str
    plan: Plan | None  # None: not possible on this hardware (the model does not fit)
    evaluation: Evaluation | None
    note: str = ""

    @property
    def time(self) -> float | None:
        return self.evaluation.time if self.evaluation is not None and self.evaluation.fits else None


def all_baselines(p: Problem) -> dict[str, Baseline]:
    out = {}
    for name, make in (("layers", layers_plan), ("powerinfer", powerinfer_plan), ("cpu", cpu_plan),
                       ("gpu", gpu_plan)):
        plan = make(p)
        if plan is None:
            out[name] = Baseline(name, None, None, _no_fit_note(p))
            continue
        ev = evaluate(p, plan)
        note = plan.note if ev.fits else "; ".join(ev.problems)
        out[name] = Baseline(name, plan, ev, note)
    return out


def _no_fit_note(p: Problem) -> str:
    """Why the whole model is not placeable on the GPUs, in bytes (only the gpu baseline can fail)."""
    if not p.hw.gpus:
        return "no GPU"
    def size(n: int) -> str:
        return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

    need = sum(_layer_bytes(p, l) for l in range(p.model.n_layer)) + p.model.output
    return f"every layer and the output head need {size(need)}, the GPU budget leaves {size(sum(p.budgets))} for them"


def cpu_plan(p: Problem) -> Plan:
    return Plan.on_cpu(p.model.n_layer, "cpu")


def _layer_bytes(p: Problem, l: int) -> int:
    lb = p.model.layers[l]
    return lb.attn + lb.kv + lb.pred + lb.ffn


def _pack_layers(p: Problem, first: int) -> tuple[np.ndarray, bool] | None:
    """Layers first..L-1 whole onto the GPUs in order (first fit); None if they do not all fit. Also says whether the
    output head fits after them (on the last GPU used)."""
    L = p.model.n_layer
    free = list(p.budgets)
    dev = np.zeros(L, dtype=np.uint8)
    g = 0
    for l in range(first, L):
        need = _layer_bytes(p, l)
        while g < len(free) and free[g] < need:
            g += 1
        if g == len(free):
            return None
        free[g] -= need
        dev[l] = g + 1
    out_fits = bool(free) and free[min(g, len(free) - 1)] >= p.model.output
    return dev, out_fits


def _whole_layers(p: Problem, dev: np.ndarray, output: int, name: str, note: str = "") -> Plan:
    n_ff = np.array(p.model.n_ff)
    on = dev > 0
    pred = np.where([lb.has_predictor for lb in p.model.layers], dev, 0)
    return Plan(name, dev, pred, dev, np.where(on, n_ff, 0), output, note)


def layers_plan(p: Problem) -> Plan:
    L = p.model.n_layer
    for ngl in range(L + 1, -1, -1):
        packed = _pack_layers(p, max(L - ngl, 0))
        if packed is None:
            continue
        dev, out_fits = packed
        if ngl == L + 1 and not out_fits:
            continue
        output = int(dev[L - 1]) if ngl == L + 1 and L else CPU
        return _whole_layers(p, dev, output, "layers", f"-ngl {ngl}")
    return cpu_plan(p)


def ngl_plan(p: Problem, ngl: int) -> Plan | None:
    """llama.cpp's `-ngl ngl`: the last min(ngl, n_layer) layers whole on the GPUs, and the output head when ngl is
    more than n_layer (llama.cpp counts it as one more layer); None when they do not fit."""
    L = p.model.n_layer
    packed = _pack_layers(p, max(L - ngl, 0))
    if packed is None:
        return None
    dev, out_fits = packed
    if ngl > L and not out_fits:
        return None
    output = int(dev[L - 1]) if ngl > L and L else CPU
    return _whole_layers(p, dev, output, "layers", f"-ngl {ngl}")


def ngl_bytes(p: Problem, ngl: int) -> int:
    """What `-ngl ngl` puts on the GPUs, in bytes."""
    L = p.model.n_layer
    return sum(_layer_bytes(p, l) for l in range(max(L - ngl, 0), L)) + (p.model.output if ngl > L else 0)


def gpu_plan(p: Problem) -> Plan | None:
    if not p.hw.gpus:
        return None
    packed = _pack_layers(p, 0)
    if packed is None or not packed[1]:
        return None
    dev, _ = packed
    return _whole_layers(p, dev, int(dev[-1]), "gpu")


def powerinfer_plan(p: Problem) -> Plan:
    m = p.model
    L = m.n_layer
    plan = Plan.on_cpu(L, "powerinfer")
    if not p.hw.gpus:
        return plan
    left = p.budgets[0]
    complete = True
    # Its offload order: attention of every layer, then predictors, then the output head; the first miss ends it.
    parts = [("attn", l, m.layers[l].attn + m.layers[l].kv) for l in range(L)]
    parts += [("pred", l, m.layers[l].pred) for l in range(L) if m.layers[l].has_predictor]
    parts.append(("output", -1, m.output))
    for kind, l, nbytes in parts:
        if nbytes > left:
            complete = False
            break
        left -= nbytes
        if kind == "attn":
            plan.attn[l] = 1
        elif kind == "pred":
            plan.pred[l] = 1
        else:
            plan.output = 1
    if not complete:
        plan.note = "dense parts did not all fit: no FFN neurons offloaded"
        return plan

    # Its neuron capacity heuristic (llama.cpp:3112-3118 in PowerInfer) and a global top-k of 256-neuron groups.
    lb0 = m.layers[0]
    up_type = lb0.row_types.get("ffn_up", GGMLQuantizationType.F16)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(up_type)]
    slice_bytes = lb0.n_ff * size // block
    per_slice = slice_bytes * (4.5 if "ffn_gate" in lb0.row_types else 2)
    capacity = int(left // per_slice) * 4
    groups = []  # (mass, layer, index)
    for l in range(L):
        pre, n = p.prefix[l], m.layers[l].n_ff
        for i, start in enumerate(range(0, n, POWERINFER_GROUP)):
            stop = min(start + POWERINFER_GROUP, n)
            groups.append((pre[stop] - pre[start], l, i, stop - start))
    groups.sort(key=lambda t: (-t[0], t[1], t[2]))
    chosen, count = [], 0
    for g in groups:
        if count + g[3] > capacity:
            break
        chosen.append(g)
        count += g[3]
    # Its capacity is a heuristic: drop the coldest chosen groups until the real bytes fit.
    overshoot = 0
    while chosen and sum(m.layers[g[1]].neuron * g[3] for g in chosen) > left:
        overshoot += 1
        chosen.pop()
    n_gpu = np.zeros(L, dtype=np.int64)
    for _, l, _, size_ in chosen:
        n_gpu[l] += size_
    plan.n_gpu = n_gpu
    plan.ffn_gpu = np.where(n_gpu > 0, 1, 0).astype(np.uint8)
    plan.note = f"capacity {capacity:,} neurons"
    if overshoot:
        plan.note += f"; {overshoot} groups dropped, its heuristic overshot the budget"
    return plan
