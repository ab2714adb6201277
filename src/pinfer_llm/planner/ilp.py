"""The placement ILP: minimum predicted time per token (or, for comparison, PowerInfer's maximum hot mass).

Per layer l, each dense part sits on exactly one device d (0 = CPU, g = GPU g):

    attn_on[l, d], pred_on[l, d], out_on[d]  binary, sum over d = 1

and the FFN is in exactly one mode: all on the CPU, all on GPU g, or split between GPU g and the CPU:

    cpu_ffn[l] + sum_g (full[l, g] + split_mode[l, g]) = 1                  binaries

GPU neurons are a prefix of the frequency-sorted order. In split mode n_split[l, g] of them carry m_split[l, g] of the
layer's activation mass, bounded by the prefix-mass curve P_l (concave, piecewise linear over groups of --group
neurons). Scaled by split_mode (a perspective formulation), so the LP relaxation of each layer is the convex hull of
its choices and CBC rarely branches:

    m_split <= P_l(b_k) * split_mode + s_k * (n_split - b_k * split_mode)   for every group boundary b_k, slope s_k
    n_split <= N_l * split_mode

A split layer's FFN takes max(GPU part, host + CPU part): the host thread queues the GPU's work before it computes
the CPU's neurons. The layer pays the sync cost and the host's time when it uses a GPU and the CPU
(split[l, g] >= every "uses GPU g" + "uses the CPU" - 1), and ffn_time[l] >= both of GPU part - host and CPU part,
so a split FFN costs host + max(GPU - host, CPU) = max(GPU, host + CPU), and one whole on a side pays the host in
series. Memory: sum of parts on GPU g within its budget, everything else within host RAM. The paper's C_l enters
as n_split >= C_l * (split_mode - attn_on - pred_on) (see costmodel.min_gpu_neurons).

Relaxing m_split below P_l(n_split) gains at most one neuron's worth per layer (a prefix with the same mass, or the
balance point, does as well with less VRAM, up to rounding to whole neurons), so `_polish` turns the LP's values
into exact whole-neuron prefixes and evaluates them with costmodel.evaluate: the reported time is always the cost
model's, never the ILP's. `exact=True` uses a binary per group instead (tests compare it with brute force).

CBC starts from the best of a Lagrangian heuristic, the feasible baselines and a coarse solve (see _start_plan), so
its root LP usually closes the gap at once, and the plan returned is never worse than any of them.
"""
# ruff: noqa: E741 - l is a layer index, as in the formulation (sum over layers l)

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pulp

from pinfer_llm.formats.errors import PinferError
from pinfer_llm.planner.baselines import Baseline, all_baselines
from pinfer_llm.planner.costmodel import Evaluation, evaluate, ffn_times
from pinfer_llm.planner.plan import CPU, Plan
from pinfer_llm.planner.problem import Problem
from pinfer_llm.planner.warmstart import heuristic_plan

OBJECTIVES = ("time", "hot-mass")
SOLVERS = ("cbc", "highs")
MIB = float(1 << 20)
US = 1e6  # the ILP counts time in microseconds and memory in MiB, keeping coefficients within a few decades


@dataclass
class Solution:
    plan: Plan
    evaluation: Evaluation
    objective: str
    solver: str
    status: str  # "optimal" (within the requested gap), or "time limit" with a feasible solution
    gap: float | None  # upper bound on the ILP's relative optimality gap for the plan returned; None: unknown
    ilp_value: float  # the ILP's objective: microseconds per token, or expected active GPU neurons per token
    build_s: float
    solve_s: float
    n_variables: int
    n_constraints: int
    notes: list[str] = field(default_factory=list)


def solve(p: Problem, objective: str = "time", solver: str = "cbc", time_limit: float = 30.0, gap: float = 1e-3,
          threads: int | None = None, fixed_dense: Plan | None = None, exact: bool = False,
          baselines: dict[str, Baseline] | None = None) -> Solution:
    """Build, solve and check the ILP; return the polished plan with its evaluation. `baselines` (all_baselines(p),
    which the caller usually has already) seed the solver's start."""
    if objective not in OBJECTIVES:
        raise PinferError(f"unknown --objective '{objective}' (one of {', '.join(OBJECTIVES)})")
    if objective == "hot-mass" and fixed_dense is None:
        raise ValueError("the hot-mass objective places dense parts as PowerInfer does: pass fixed_dense")
    if not p.hw.gpus:
        plan = Plan.on_cpu(p.model.n_layer, "ilp")
        return Solution(plan, evaluate(p, plan), objective, solver, "optimal", 0.0, 0.0, 0.0, 0.0, 0, 0,
                        ["no GPU: everything on the CPU"])
    t0 = time.perf_counter()
    start = None
    if objective == "time" and not exact:
        start = _start_plan(p, solver, time_limit, gap, threads, all_baselines(p) if baselines is None else baselines)
    prob, v = build_model(p, objective, fixed_dense, exact)
    start_value = None
    if start is not None:
        set_start(p, v, start)
        start_value = float(pulp.value(prob.objective))
    # One GPU: the root LP is tight, and with a good start CBC's own heuristics and cuts only cost time. Several GPUs:
    # the layer_on binaries leave the root LP ~1% loose and CBC needs its cuts to close it.
    engine = _solver(solver, time_limit, gap, threads, warm_start=start is not None, lean=p.n_gpus == 1)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with solver_files() as tmp:
        engine.tmpDir = tmp  # PuLP's .mps/.mst/.sol files
        try:
            with _quiet_stdout(solver == "highs"):
                prob.solve(engine)
        except pulp.PulpSolverError as exc:
            raise PinferError(f"solver {solver} failed: {exc}") from None
        solve_s = time.perf_counter() - t0
        status = _checked_status(prob)
        notes = []
        if status is None:  # stopped before it found a solution of its own
            if start is None:
                raise PinferError(f"{solver} found no solution within {time_limit:g} s (status "
                                  f"{pulp.LpStatus.get(prob.status, prob.status)}); raise --time-limit or a coarser "
                                  f"--group")
            status, incumbent = "time limit", None
            plan, ev, value = dataclasses.replace(start, name="ilp"), evaluate(p, start), start_value
            notes.append(f"{solver} found nothing better than its start within the time limit")
        else:
            incumbent = float(pulp.value(prob.objective))
            plan, value = _polish(p, v, objective), incumbent
            ev = evaluate(p, plan)
            if start is not None:  # the solver started from it: better only by the polish's last-neuron rounding
                start_ev = evaluate(p, start)
                if start_ev.time < ev.time:
                    plan, ev, value = dataclasses.replace(start, name=plan.name), start_ev, start_value
        # last: solving the relaxation overwrites the variables' values
        bound_gap = _gap(prob, solver, status, gap, incumbent, value,
                         relaxation=lambda: _relaxation_bound(prob, tmp, time_limit, threads))
    if status != "optimal":
        known = f"gap at most {bound_gap:.2%}" if bound_gap is not None else "gap unknown"
        notes.append(f"{solver} stopped at the {time_limit:g} s time limit ({known})")
    return Solution(plan, ev, objective, solver, status, bound_gap, value, build_s, solve_s,
                    len(prob.variables()), prob.numConstraints(), notes)


COARSE_STEPS = 3  # breakpoints per doubling of the neuron count in the coarse model that seeds a fine one


def _start_plan(p: Problem, solver: str, time_limit: float, gap: float, threads: int | None,
                baselines: dict[str, Baseline]) -> Plan | None:
    """A good integer solution for the solver to start from, or None.

    The Lagrangian heuristic (warmstart.py) is near-optimal when layers differ, but where many alike layers tie
    between "attention on the GPU" and "more neurons" it can land a few tenths of a percent off, and CBC then
    branches on LPs of tens of thousands of rows. A coarse ILP settles those choices in a fraction of a second: the
    same model with breakpoints spaced geometrically (every group at the hot end, where the prefix-mass curve bends
    most, then COARSE_STEPS per doubling), ~20x fewer rows. Its polished plan is a valid start for the fine model.
    """
    candidates = [heuristic_plan(p), _blocks_start(p)] + [b.plan for b in baselines.values() if b.time is not None]
    if p.n_gpus == 1 and p.bounds is None and max(len(p.breakpoints(l)) for l in range(p.model.n_layer)) > 64:
        coarse = dataclasses.replace(p, bounds=[_geometric(p.breakpoints(l)) for l in range(p.model.n_layer)])
        with contextlib.suppress(PinferError):
            # only a start: a short leash, the fine solve gets the user's time limit
            candidates.append(solve(coarse, "time", solver, min(time_limit / 3, 10.0), gap, threads,
                                    baselines=baselines).plan)
    best, best_time = None, math.inf
    for plan in candidates:
        if plan is None:
            continue
        plan = _respect_min_neurons(p, plan)
        ev = evaluate(p, plan)
        if ev.fits and ev.time < best_time:
            best, best_time = plan, ev.time
    return best


def _blocks_start(p: Problem) -> Plan | None:
    """Several GPUs: contiguous blocks of layers, one per GPU in proportion to its budget, each planned by the
    single-GPU heuristic; the head considered by the last block only. With the host's time in the split cost the
    LP relaxation of several GPUs is loose (fractional "uses the CPU" and "uses GPU g" share a split between them),
    so CBC may not improve on its start within the time limit: this one is far better than the baselines."""
    J = p.n_gpus
    if J < 2:
        return None
    L = p.model.n_layer
    edges = np.round(np.cumsum([0] + list(p.budgets)) / max(sum(p.budgets), 1) * L).astype(int)
    plan = Plan("blocks", *(np.zeros(L, dtype=np.int64) for _ in range(4)), CPU)
    c = p.costs
    for g in range(1, J + 1):
        ls = np.arange(edges[g - 1], edges[g])
        if len(ls) == 0:
            continue
        cols = [CPU, g]
        last = g == J
        sub_costs = dataclasses.replace(
            c, attn=c.attn[ls][:, cols], pred=c.pred[ls][:, cols], dense=c.dense[ls][:, cols],
            sparse=c.sparse[ls][:, cols], sync=c.sync[ls][:, cols], host=c.host[ls][:, cols],
            ffn_dispatch=c.ffn_dispatch[cols], output=c.output[cols] if last else np.full(2, c.output[CPU]))
        model = dataclasses.replace(p.model, layers=[p.model.layers[l] for l in ls], n_layer=len(ls),
                                    output=p.model.output if last else 0)
        sub = dataclasses.replace(
            p, model=model, hw=dataclasses.replace(p.hw, gpus=[p.hw.gpus[g - 1]]), costs=sub_costs,
            order=[p.order[l] for l in ls], prefix=[p.prefix[l] for l in ls], c_min=p.c_min[ls][:, cols],
            budgets=[p.budgets[g - 1]], bounds=None if p.bounds is None else [p.bounds[l] for l in ls])
        h = heuristic_plan(sub)
        if h is None:
            return None
        plan.attn[ls] = np.where(h.attn > 0, g, CPU)
        plan.pred[ls] = np.where(h.pred > 0, g, CPU)
        plan.ffn_gpu[ls] = np.where(h.n_gpu > 0, g, CPU)
        plan.n_gpu[ls] = h.n_gpu
        if last and h.output:
            plan.output = g
    return plan


def _geometric(bounds: np.ndarray) -> np.ndarray:
    """Every breakpoint among the first eight, then COARSE_STEPS per doubling, and the last."""
    idx = np.unique(np.concatenate([np.arange(min(8, len(bounds))),
                                    np.geomspace(8, len(bounds) - 1, num=max(2, int(COARSE_STEPS * np.log2(
                                        max(len(bounds) / 8, 2)))) + 1).astype(int), [len(bounds) - 1]]))
    return bounds[idx[idx < len(bounds)]]


def _respect_min_neurons(p: Problem, plan: Plan) -> Plan:
    """Drop GPU neurons that are fewer than the layer's C_l where nothing else of the layer is on a GPU (never
    slower, and the ILP's cut would reject the start otherwise)."""
    plan = dataclasses.replace(plan, n_gpu=plan.n_gpu.copy(), ffn_gpu=plan.ffn_gpu.copy())
    for l, lb in enumerate(p.model.layers):
        k, g = int(plan.n_gpu[l]), int(plan.ffn_gpu[l])
        dense_on_cpu = plan.attn[l] == CPU and (not lb.has_predictor or plan.pred[l] == CPU)
        if 0 < k < lb.n_ff and dense_on_cpu and k < p.c_min[l, g]:
            plan.n_gpu[l], plan.ffn_gpu[l] = 0, CPU
    return plan


# --- the model ----------------------------------------------------------------------------------------------------

@dataclass
class Vars:
    attn_on: dict
    pred_on: dict
    out_on: dict
    cpu_ffn: dict
    full: dict
    split_mode: dict
    n_split: dict
    m_split: dict
    ffn_time: dict
    split: dict
    layer_on: dict  # several GPUs only: the one GPU a layer's GPU parts share


def build_model(p: Problem, objective: str = "time", fixed_dense: Plan | None = None,
                exact: bool = False) -> tuple[pulp.LpProblem, Vars]:
    m, c = p.model, p.costs
    layers = range(m.n_layer)
    gpus = range(1, p.n_gpus + 1)
    devices = range(0, p.n_gpus + 1)
    pred_layers = [l for l in layers if m.layers[l].has_predictor]
    N = {l: m.layers[l].n_ff for l in layers}
    M = {l: float(p.prefix[l][-1]) for l in layers}
    lg = [(l, g) for l in layers for g in gpus]

    sense = pulp.LpMinimize if objective == "time" else pulp.LpMaximize
    prob = pulp.LpProblem("placement", sense)
    attn_on = prob.add_variable_dicts("attn_on", [(l, d) for l in layers for d in devices], cat="Binary")
    pred_on = prob.add_variable_dicts("pred_on", [(l, d) for l in pred_layers for d in devices], cat="Binary")
    out_on = prob.add_variable_dicts("out_on", devices, cat="Binary")
    cpu_ffn = prob.add_variable_dicts("cpu_ffn", layers, cat="Binary")
    full = prob.add_variable_dicts("full", lg, cat="Binary")
    split_mode = prob.add_variable_dicts("split_mode", lg, cat="Binary")
    n_split = {(l, g): prob.add_variable(f"n_split_{l}_{g}", 0, N[l]) for l, g in lg}
    m_split = {(l, g): prob.add_variable(f"m_split_{l}_{g}", 0, M[l]) for l, g in lg}
    ffn_time = prob.add_variable_dicts("ffn_time", layers, lowBound=0)
    split = prob.add_variable_dicts("split", lg, lowBound=0, upBound=1)  # integral at the optimum: max of binaries

    if fixed_dense is not None:  # PowerInfer places dense parts greedily before its solve
        for l in layers:
            for d in devices:
                _fix(attn_on[l, d], fixed_dense.attn[l] == d)
                if l in pred_layers:
                    _fix(pred_on[l, d], fixed_dense.pred[l] == d)
        for d in devices:
            _fix(out_on[d], fixed_dense.output == d)

    # Each part on exactly one device, each FFN in exactly one mode.
    for l in layers:
        prob += pulp.lpSum(attn_on[l, d] for d in devices) == 1, f"attn_placed_{l}"
        if l in pred_layers:
            prob += pulp.lpSum(pred_on[l, d] for d in devices) == 1, f"pred_placed_{l}"
        prob += cpu_ffn[l] + pulp.lpSum(full[l, g] + split_mode[l, g] for g in gpus) == 1, f"ffn_mode_{l}"
    prob += pulp.lpSum(out_on[d] for d in devices) == 1, "output_placed"

    # Several GPUs: a layer's GPU parts share one GPU (as llama.cpp splits layers), so a split costs one sync.
    layer_on = {}
    if p.n_gpus > 1:
        layer_on = prob.add_variable_dicts("layer_on", lg, cat="Binary")
        for l in layers:
            prob += pulp.lpSum(layer_on[l, g] for g in gpus) <= 1, f"one_gpu_{l}"
            for g in gpus:
                prob += attn_on[l, g] <= layer_on[l, g], f"attn_gpu_{l}_{g}"
                if l in pred_layers:
                    prob += pred_on[l, g] <= layer_on[l, g], f"pred_gpu_{l}_{g}"
                prob += full[l, g] + split_mode[l, g] <= layer_on[l, g], f"ffn_gpu_{l}_{g}"

    # Split mode: the GPU holds a prefix of the hottest neurons, at most all of them.
    for l, g in lg:
        prob += n_split[l, g] <= N[l] * split_mode[l, g], f"split_neurons_{l}_{g}"
    for l in layers:
        if exact:
            _prefix_groups(prob, l, gpus, n_split, m_split, split_mode, p.prefix[l], p.breakpoints(l))
        else:
            _prefix_rows(prob, l, [(m_split[l, g], n_split[l, g], split_mode[l, g]) for g in gpus], p.prefix[l],
                         p.breakpoints(l))

    # The paper's per-layer minimum (a valid cut here, see costmodel.min_gpu_neurons).
    if objective == "time":
        for l, g in lg:
            c_min = int(p.c_min[l, g])
            if c_min > 0:
                on_gpu = attn_on[l, g] + (pred_on[l, g] if l in pred_layers else 0)
                prob += n_split[l, g] >= c_min * (split_mode[l, g] - on_gpu), f"min_gpu_neurons_{l}_{g}"

    # A split FFN takes as long as the slower of its halves, and the CPU's half starts after the host thread has
    # done the layer's GPU work (launches, copies, Python): max(GPU, host + CPU) = host + max(GPU - host, CPU), the
    # host paid with the split below and taken off the GPU's side here.
    for l in layers:
        cpu_all = c.ffn_dispatch[CPU] + N[l] * c.dense[l, CPU] + M[l] * c.sparse[l, CPU]
        prob += ffn_time[l] >= US * pulp.lpSum(
            (c.ffn_dispatch[g] - c.host[l, g]) * split_mode[l, g] + c.dense[l, g] * n_split[l, g]
            + c.sparse[l, g] * m_split[l, g] for g in gpus), f"ffn_gpu_time_{l}"
        prob += ffn_time[l] >= US * pulp.lpSum(
            cpu_all * split_mode[l, g] - c.dense[l, CPU] * n_split[l, g] - c.sparse[l, CPU] * m_split[l, g]
            for g in gpus), f"ffn_cpu_time_{l}"

    # A layer that uses GPU g and the CPU is split: any part on g together with any part on the CPU.
    for l, g in lg:
        uses_gpu = {"attn": attn_on[l, g], "ffn": full[l, g] + split_mode[l, g]}
        uses_cpu = {"attn": attn_on[l, CPU], "ffn": cpu_ffn[l] + pulp.lpSum(split_mode[l, h] for h in gpus)}
        if l in pred_layers:
            uses_gpu["pred"] = pred_on[l, g]
            uses_cpu["pred"] = pred_on[l, CPU]
        for a, on_gpu in uses_gpu.items():
            for b, on_cpu in uses_cpu.items():
                if a != b or a == "ffn":
                    prob += split[l, g] >= on_gpu + on_cpu - 1, f"split_{l}_{g}_{a}_{b}"

    # Memory, in MiB.
    for g in gpus:
        prob += pulp.lpSum(
            (m.layers[l].attn + m.layers[l].kv) / MIB * attn_on[l, g]
            + m.layers[l].neuron / MIB * (n_split[l, g] + N[l] * full[l, g]) for l in layers) + pulp.lpSum(
            m.layers[l].pred / MIB * pred_on[l, g] for l in pred_layers) + m.output / MIB * out_on[g] \
            <= p.budgets[g - 1] / MIB, f"vram_{g}"
    prob += pulp.lpSum(
        (m.layers[l].attn + m.layers[l].kv) / MIB * attn_on[l, CPU]
        + m.layers[l].neuron / MIB * (N[l] * cpu_ffn[l] + pulp.lpSum(N[l] * split_mode[l, g] - n_split[l, g]
                                                                     for g in gpus)) for l in layers) + pulp.lpSum(
        m.layers[l].pred / MIB * pred_on[l, CPU] for l in pred_layers) + m.output / MIB * out_on[CPU] \
        <= p.host_budget / MIB, "host_ram"

    if objective == "time":
        prob += US * (
            pulp.lpSum(c.attn[l, d] * attn_on[l, d] for l in layers for d in devices)
            + pulp.lpSum(c.pred[l, d] * pred_on[l, d] for l in pred_layers for d in devices)
            + pulp.lpSum(c.output[d] * out_on[d] for d in devices)
            + pulp.lpSum((c.ffn_dispatch[CPU] + N[l] * c.dense[l, CPU] + M[l] * c.sparse[l, CPU]) * cpu_ffn[l]
                         for l in layers)
            + pulp.lpSum((c.ffn_dispatch[g] + N[l] * c.dense[l, g] + M[l] * c.sparse[l, g]) * full[l, g]
                         for l, g in lg)
            # a split layer's transfers and join, and the host thread's work for it (in series where the FFN is
            # whole on one side; where it is split, ffn_time gives the GPU's half that time back)
            + pulp.lpSum((c.sync[l, g] + c.host[l, g]) * split[l, g] for l, g in lg)
        ) + pulp.lpSum(ffn_time[l] for l in layers)
    else:
        prob += pulp.lpSum(m_split[l, g] + M[l] * full[l, g] for l, g in lg)
    return prob, Vars(attn_on, pred_on, out_on, cpu_ffn, full, split_mode, n_split, m_split, ffn_time, split,
                      layer_on)


def _prefix_rows(prob: pulp.LpProblem, l: int, per_gpu: list, prefix: np.ndarray, bounds: np.ndarray) -> None:
    """m <= P(b_k) z + s_k (n - b_k z) for each group k, summed over GPUs (only one can be in split mode).

    Written without PuLP's operator overloading: a 70B model has 80 x 448 of these rows, which take 2 s to build
    through expressions and 0.5 s directly. Consecutive groups of equal slope share a row.
    """
    pb = prefix[bounds]
    slopes = np.diff(pb) / np.diff(bounds)
    last = None
    for k, s in enumerate(slopes):
        if last is not None and abs(s - last) <= 1e-12 * max(abs(last), 1e-30):
            continue
        last = s
        terms = []
        for m_var, n_var, z_var in per_gpu:
            terms += [(m_var, 1.0), (n_var, -float(s)), (z_var, float(s * bounds[k] - pb[k]))]
        prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(terms), pulp.LpConstraintLE, f"prefix_{l}_{k}",
                                             0.0))


def set_start(p: Problem, v: Vars, plan: Plan) -> None:
    """Give every variable its value under `plan` (an integer solution for CBC to start from)."""
    m, c = p.model, p.costs
    J = p.n_gpus
    for var in (*v.attn_on.values(), *v.pred_on.values(), *v.out_on.values(), *v.cpu_ffn.values(),
                *v.full.values(), *v.split_mode.values(), *v.n_split.values(), *v.m_split.values(),
                *v.ffn_time.values(), *v.split.values(), *v.layer_on.values()):
        var.setInitialValue(0)
    v.out_on[plan.output].setInitialValue(1)
    for l, lb in enumerate(m.layers):
        N, k, g = lb.n_ff, int(plan.n_gpu[l]), int(plan.ffn_gpu[l])
        v.attn_on[l, int(plan.attn[l])].setInitialValue(1)
        if (l, 0) in v.pred_on:
            v.pred_on[l, int(plan.pred[l])].setInitialValue(1)
        used = {int(plan.attn[l])} | ({int(plan.pred[l])} if lb.has_predictor else set())
        if k == 0:
            v.cpu_ffn[l].setInitialValue(1)
            used.add(CPU)
        elif k == N:
            v.full[l, g].setInitialValue(1)
            used.add(g)
        else:
            bounds = p.breakpoints(l)
            mass = float(np.interp(k, bounds, p.prefix[l][bounds]))  # the ILP's prefix curve, below the true one
            v.split_mode[l, g].setInitialValue(1)
            v.n_split[l, g].setInitialValue(k)
            v.m_split[l, g].setInitialValue(mass)
            gpu = c.ffn_dispatch[g] + k * c.dense[l, g] + mass * c.sparse[l, g]
            cpu = c.ffn_dispatch[CPU] + (N - k) * c.dense[l, CPU] + (p.prefix[l][-1] - mass) * c.sparse[l, CPU]
            v.ffn_time[l].setInitialValue(US * max(gpu - c.host[l, g], cpu))
            used |= {g, CPU}
        for h in range(1, J + 1):
            if h in used and CPU in used:
                v.split[l, h].setInitialValue(1)
            if h in used and (l, h) in v.layer_on:
                v.layer_on[l, h].setInitialValue(1)


def _prefix_groups(prob, l, gpus, n_split, m_split, split_mode, prefix: np.ndarray, bounds: np.ndarray) -> None:
    """Exact variant: a binary per group, in prefix order, so counts and masses are exactly those of whole groups.
    Tens of thousands of binaries on a 70B model: for small models and for checking the relaxation."""
    sizes, masses = np.diff(bounds), np.diff(prefix[bounds])
    for g in gpus:
        on = prob.add_variable_dicts(f"group_on_{l}_{g}", range(len(sizes)), cat="Binary")
        for k in range(len(sizes)):
            prob += on[k] <= (on[k - 1] if k else split_mode[l, g]), f"group_order_{l}_{g}_{k}"
        prob += n_split[l, g] == pulp.lpSum(int(sizes[k]) * on[k] for k in on), f"group_count_{l}_{g}"
        prob += m_split[l, g] == pulp.lpSum(float(masses[k]) * on[k] for k in on), f"group_mass_{l}_{g}"


def _fix(var: pulp.LpVariable, value: bool) -> None:
    var.lowBound = var.upBound = int(bool(value))


# --- solvers ------------------------------------------------------------------------------------------------------

def _make_solver(name: str, time_limit: float, gap: float, threads: int, warm_start: bool = False,
                 lean: bool = False):
    if name == "cbc":
        # Preprocessing only strengthens the prefix rows, which the perspective form already makes tight. With a
        # good start and a tight root LP (lean) the gap usually closes at the root; CBC's own heuristics and cuts
        # would then spend seconds on tens of thousands of rows for nothing (it still branches if the gap stays open).
        options = ["preprocess off"] + (["heur off", "cuts off"] if warm_start and lean else [])
        with warnings.catch_warnings():  # PuLP 3.3 deprecates the bundled CBC in favour of pulp[cbc] in 4.0
            warnings.simplefilter("ignore", DeprecationWarning)
            return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, gapRel=gap, threads=threads,
                                     options=options, warmStart=warm_start)
    if name == "highs":
        return pulp.HiGHS(msg=False, timeLimit=time_limit, gapRel=gap, threads=threads)
    raise PinferError(f"unknown --solver '{name}' (one of {', '.join(SOLVERS)})")


def _solver(name: str, time_limit: float, gap: float, threads: int | None, warm_start: bool = False,
            lean: bool = False):
    if time_limit <= 0:
        raise PinferError(f"--time-limit must be positive, got {time_limit}")
    if not 0 <= gap < 1:
        raise PinferError(f"--gap is a fraction in [0, 1), got {gap}")
    engine = _make_solver(name, time_limit, gap, threads or min(os.cpu_count() or 1, 8), warm_start, lean)
    if not engine.available():
        hint = ("install highspy (pip install 'pinfer-llm[solvers]') or use --solver cbc" if name == "highs"
                else "reinstall pulp, which bundles CBC, or install highspy and use --solver highs")
        raise PinferError(f"solver '{name}' is not available; {hint}")
    return engine


@contextlib.contextmanager
def _quiet_stdout(enabled: bool):
    """HiGHS prints its banner from C++ before PuLP can turn its output off; keep it out of --json output."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _checked_status(prob: pulp.LpProblem) -> str | None:
    """"optimal", "time limit" (a feasible integer solution) or None (none found in time). Never use a result that
    is not a feasible integer solution."""
    if prob.status == pulp.LpStatusInfeasible or prob.sol_status == pulp.LpSolutionInfeasible:
        raise PinferError("infeasible: no placement fits the VRAM budget(s) and host RAM (parts cannot be split "
                          "finely enough); raise --vram-budget or --host-ram, or lower --ctx-size")
    if prob.sol_status == pulp.LpSolutionOptimal and prob.status == pulp.LpStatusOptimal:
        return "optimal"
    if prob.sol_status == pulp.LpSolutionIntegerFeasible:
        return "time limit"
    return None


def _gap(prob: pulp.LpProblem, solver: str, status: str, tol: float, incumbent: float | None, value: float,
         relaxation) -> float | None:
    """An upper bound on the relative optimality gap of `value`, the ILP objective of the plan returned, with the
    bound taken from the solver (never from its log); None when the solver gives none.

    HiGHS reports its best bound (info.mip_dual_bound). CBC's command line writes only a status and its incumbent:
    "Optimal" means it stopped with the incumbent within `tol` of the larger of it and the best bound (its ratioGap
    rule), which bounds the best bound; after a time limit the bound is the LP relaxation's optimum, from a second
    solve (`relaxation()`, None when that fails or runs out of time too).
    """
    minimize = prob.sense == pulp.LpMinimize
    if solver == "highs":
        bound = float(prob.solverModel.getInfo().mip_dual_bound)
    elif status == "optimal" and incumbent is not None:
        bound = incumbent * (1 - tol) if minimize else incumbent / (1 - tol)
    else:
        bound = relaxation()
    if bound is None or not (math.isfinite(bound) and math.isfinite(value)):
        return None
    return max(value - bound if minimize else bound - value, 0.0) / max(abs(value), 1e-12)


def _relaxation_bound(prob: pulp.LpProblem, tmp: str, time_limit: float, threads: int | None) -> float | None:
    """The optimum of the ILP's LP relaxation (a bound on every integer solution), or None."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        lp = pulp.PULP_CBC_CMD(msg=False, mip=False, timeLimit=time_limit, threads=threads,
                               options=["preprocess off"])
    lp.tmpDir = tmp
    try:
        prob.solve(lp)
    except pulp.PulpSolverError:
        return None
    if prob.status != pulp.LpStatusOptimal or prob.sol_status != pulp.LpSolutionOptimal:
        return None
    return float(pulp.value(prob.objective))


# --- solver files -------------------------------------------------------------------------------------------------

SOLVER_DIR = "pi-plan-solve-"  # + pid + "-" + random, in the system's temporary directory


@contextlib.contextmanager
def solver_files():
    """One temporary directory for every file a solve writes (PuLP's .mps, .mst and .sol: ~9 MB for a 70B model),
    removed however the solve ends: normally, on an exception or ^C, and on SIGTERM, which pi-plan's main turns into
    an exception. On the way out of an interrupted solve the solver's own process is stopped too. A process killed
    outright (kill -9) cannot clean up: its directory carries its pid, and the next solve removes the directories of
    processes that are gone."""
    _remove_stale_solver_files()
    path = tempfile.mkdtemp(prefix=f"{SOLVER_DIR}{os.getpid()}-")
    try:
        yield path
    except BaseException:
        _stop_children_using(path)
        raise
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _remove_stale_solver_files() -> None:
    root = tempfile.gettempdir()
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        m = re.fullmatch(rf"{SOLVER_DIR}(\d+)-\w+", entry.name)
        if m and entry.is_dir(follow_symlinks=False) and not _alive(int(m.group(1))):
            shutil.rmtree(entry.path, ignore_errors=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists, as another user's process
    return True


def _stop_children_using(path: str) -> None:
    """SIGTERM to our own child processes whose command line names `path` (the solver, when a solve is interrupted;
    PuLP waits for it without a timeout and leaves it running otherwise). Linux only: elsewhere nothing is done."""
    me = os.getpid()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == me and path.encode() in (stat.parent / "cmdline").read_bytes():
                os.kill(int(stat.parent.name), signal.SIGTERM)
        except (OSError, ValueError, IndexError):
            continue


# --- from LP values to an exact plan -------------------------------------------------------------------------------

def _val(var) -> float:
    x = var.value() if hasattr(var, "value") else var
    return float(x or 0.0)


def _polish(p: Problem, v: Vars, objective: str) -> Plan:
    """Exact prefixes from the ILP's values: per split layer the best whole-neuron count within the VRAM the ILP
    gave it, plus whatever VRAM the rounding left free on its GPU."""
    m = p.model
    L, J = m.n_layer, p.n_gpus
    attn = np.array([max(range(J + 1), key=lambda d: _val(v.attn_on[l, d])) for l in range(L)], dtype=np.uint8)
    pred = np.array([max(range(J + 1), key=lambda d: _val(v.pred_on[l, d])) if (l, 0) in v.pred_on else 0
                     for l in range(L)], dtype=np.uint8)
    out = max(range(J + 1), key=lambda d: _val(v.out_on[d]))
    ffn_gpu = np.zeros(L, dtype=np.int64)
    n_gpu = np.zeros(L, dtype=np.int64)
    split_layers = []
    for l in range(L):
        for g in range(1, J + 1):
            if _val(v.full[l, g]) > 0.5:
                ffn_gpu[l], n_gpu[l] = g, m.layers[l].n_ff
            elif _val(v.split_mode[l, g]) > 0.5:
                ffn_gpu[l] = g
                n_gpu[l] = min(int(math.floor(_val(v.n_split[l, g]) + 1e-6)), m.layers[l].n_ff)
                split_layers.append(l)
        if n_gpu[l] == 0 and max(attn[l], pred[l]) > 0:
            # FFN on the CPU beside GPU parts: already split, so neurons the rounding leaves room for cost no host
            # time or sync of their own (the ILP's groups may be too coarse to have placed a few)
            ffn_gpu[l] = max(attn[l], pred[l])
            split_layers.append(l)
    plan = _repair(p, Plan("ilp" if objective == "time" else "ilp-hot-mass", attn, pred, ffn_gpu, n_gpu, out))
    for l in split_layers:
        g = int(plan.ffn_gpu[l]) or int(ffn_gpu[l])
        lb = m.layers[l]
        slack = p.budgets[g - 1] - _gpu_bytes(p, plan, g)
        k_hi = min(int(plan.n_gpu[l]) + int(max(slack, 0) // max(lb.neuron, 1e-9)), lb.n_ff)
        while k_hi > plan.n_gpu[l] and int(lb.neuron_bytes(k_hi) - lb.neuron_bytes(plan.n_gpu[l])) > slack:
            k_hi -= 1
        ks = np.arange(k_hi + 1)
        if objective == "hot-mass":
            k = k_hi
        else:
            k = int(ks[np.argmin(ffn_times(p, l, plan.attn[l], plan.pred[l], g, ks))])
        plan.n_gpu[l] = k
        plan.ffn_gpu[l] = g if k else CPU
    return plan


def _repair(p: Problem, plan: Plan) -> Plan:
    """Take neurons back from layers until every GPU is within budget by exact byte counts (rounding can leave a
    neuron too many). Each step drops the neuron whose removal costs the least time."""
    m = p.model
    for g in range(1, p.n_gpus + 1):
        while True:
            used = _gpu_bytes(p, plan, g)
            if used <= p.budgets[g - 1]:
                break
            best, best_cost = None, math.inf
            for l in np.nonzero((plan.ffn_gpu == g) & (plan.n_gpu > 0))[0]:
                k = int(plan.n_gpu[l])
                t = ffn_times(p, l, plan.attn[l], plan.pred[l], g, np.array([k - 1, k]))
                if t[0] - t[1] < best_cost:
                    best, best_cost = l, t[0] - t[1]
            if best is None:
                raise PinferError(f"internal: plan over budget on GPU {g} with no neurons to take back")
            step = max(1, int((used - p.budgets[g - 1]) // max(m.layers[best].neuron, 1)))
            plan.n_gpu[best] = max(int(plan.n_gpu[best]) - step, 0)
            if plan.n_gpu[best] == 0:
                plan.ffn_gpu[best] = CPU
    return plan


def _gpu_bytes(p: Problem, plan: Plan, g: int) -> int:
    m = p.model
    total = m.output if plan.output == g else 0
    for l, lb in enumerate(m.layers):
        total += (lb.attn + lb.kv) * (plan.attn[l] == g) + lb.pred * (plan.pred[l] == g)
        if plan.ffn_gpu[l] == g:
            total += int(lb.neuron_bytes(plan.n_gpu[l]))
    return int(total)
