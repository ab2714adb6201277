"""A fast heuristic plan for the ILP to start from (single GPU).

The root LP of the ILP is tight (gaps of 1e-5 are typical), but CBC spends seconds in its feasibility pump looking for
a first integer solution on tens of thousands of rows. Handing it a good one lets it stop at the root.

Lagrangian relaxation of the VRAM constraint: at a price lam per byte, every layer independently picks where its
attention and predictor go and how many neurons its GPU holds, minimising time + lam * bytes. The neuron count only
needs the lower convex hull of the layer's time-vs-count curve (any minimiser of t(k) + lam*b*k is a hull vertex).
Bisection on lam finds the cheapest price that fits; the VRAM left over goes to the best time-per-byte steps.
"""
# ruff: noqa: E741 - l is a layer index, as in the formulation (sum over layers l)

from __future__ import annotations

import heapq

import numpy as np

from pinfer_llm.planner.costmodel import ffn_times
from pinfer_llm.planner.plan import CPU, Plan
from pinfer_llm.planner.problem import Problem


def _hull(t: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Indices of the lower convex hull of the points (x[i], t[i]), x increasing.

    A point above (or on) the chord of its two neighbours is never a hull vertex, so all of them can go at once;
    repeat until none is left. Concave stretches vanish in one pass, convex ones stay.
    """
    idx = np.arange(len(t))
    while len(idx) > 2:
        xs, ys = x[idx].astype(np.float64), t[idx]
        cross = (ys[1:-1] - ys[:-2]) * (xs[2:] - xs[:-2]) - (ys[2:] - ys[:-2]) * (xs[1:-1] - xs[:-2])
        above = cross >= 0
        if not above.any():
            break
        idx = np.concatenate([idx[:1], idx[1:-1][~above], idx[-1:]])
    return idx


def heuristic_plan(p: Problem) -> Plan | None:
    """A good feasible single-GPU plan in well under a second, or None (several GPUs, or nothing fits)."""
    if p.n_gpus != 1:
        return None
    g, m, c = 1, p.model, p.costs
    budget = p.budgets[0]
    options = []  # per layer: list of (a, pr, hull ks, hull times incl. dense parts, dense bytes, neuron bytes)
    for l, lb in enumerate(m.layers):
        preds = (CPU, g) if lb.has_predictor else (CPU,)
        ks = p.breakpoints(l)  # group boundaries, as the ILP sees them
        opts = []
        for a in (CPU, g):
            for pr in preds:
                t = ffn_times(p, l, a, pr, g, ks) + c.attn[l, a] + c.pred[l, pr]
                h = _hull(t, ks)
                dense = (lb.attn + lb.kv) * (a == g) + lb.pred * (pr == g and lb.has_predictor)
                opts.append((a, pr, ks[h], t[h], dense, lb.neuron))
        options.append(opts)

    def choose(lam: float) -> list[tuple[int, int]]:
        """Per layer (option, hull position) minimising time + lam * bytes."""
        picks = []
        for opts in options:
            best = None
            for o, (_, _, ks, ts, dense, nb) in enumerate(opts):
                cost = ts + lam * (dense + ks * nb)
                i = int(np.argmin(cost))
                if best is None or cost[i] < best[0]:
                    best = (cost[i], o, i)
            picks.append(best[1:])
        return picks

    def nbytes(l: int, pick: tuple[int, int]) -> float:
        a, pr, ks, ts, dense, nb = options[l][pick[0]]
        return dense + ks[pick[1]] * nb

    def seconds(l: int, pick: tuple[int, int]) -> float:
        return options[l][pick[0]][3][pick[1]]

    def used(picks) -> float:
        return sum(nbytes(l, pk) for l, pk in enumerate(picks))

    out_bytes = m.output if c.output[g] < c.output[CPU] else 0  # the head goes first: one part, a big saving
    budget -= out_bytes
    if budget < 0:
        budget, out_bytes = budget + m.output, 0
    lo, hi = 0.0, 1e-6
    while used(choose(hi)) > budget:
        hi *= 4
        if hi > 1e3:
            return None
    picks = choose(lo)
    if used(picks) > budget:
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if used(choose(mid)) > budget else (lo, mid)
        # At the critical price many similar layers flip together: take the flips one by one, best first.
        picks, cheaper = choose(hi), choose(lo)
        left = budget - used(picks)
        flips = sorted((l for l in range(len(picks)) if picks[l] != cheaper[l]),
                       key=lambda l: (seconds(l, cheaper[l]) - seconds(l, picks[l]))
                       / max(nbytes(l, cheaper[l]) - nbytes(l, picks[l]), 1.0))
        for l in flips:
            extra = nbytes(l, cheaper[l]) - nbytes(l, picks[l])
            if extra <= left and seconds(l, cheaper[l]) < seconds(l, picks[l]):
                picks[l] = cheaper[l]
                left -= extra
    left = budget - used(picks)

    # Spend what is left on the steps along each layer's hull with the best time saved per byte.
    counts = [int(options[l][o][2][i]) for l, (o, i) in enumerate(picks)]
    heap = []

    def push(l: int) -> None:
        o, i = picks[l]
        a, pr, ks, ts, dense, nb = options[l][o]
        if i + 1 < len(ks):
            heapq.heappush(heap, (-(ts[i] - ts[i + 1]) / ((ks[i + 1] - ks[i]) * nb), l))

    for l in range(len(picks)):
        push(l)
    while heap and left > 0:
        rate, l = heapq.heappop(heap)
        if rate >= 0:
            break
        o, i = picks[l]
        a, pr, ks, ts, dense, nb = options[l][o]
        step = (ks[i + 1] - ks[i]) * nb
        if step <= left:
            picks[l] = (o, i + 1)
            counts[l] = int(ks[i + 1])
            left -= step
            push(l)
        else:  # part of a segment: the exact curve decides whether it still helps
            k = int(ks[i] + left // nb)
            if ffn_times(p, l, a, pr, g, np.array([k]))[0] + c.attn[l, a] + c.pred[l, pr] < ts[i]:
                counts[l] = k
            break

    L = m.n_layer
    attn, pred, ffn_gpu, n_gpu = (np.zeros(L, dtype=np.int64) for _ in range(4))
    for l, (o, _) in enumerate(picks):
        a, pr = options[l][o][:2]
        k = counts[l]
        attn[l], pred[l] = a, pr
        if 0 < k < p.c_min[l, g] and a == CPU and pr == CPU:
            k = 0  # the ILP's valid cut: such a count is never better than none
        n_gpu[l], ffn_gpu[l] = k, (g if k > 0 else CPU)
    return Plan("heuristic", attn, pred, ffn_gpu, n_gpu, g if out_bytes else CPU)
