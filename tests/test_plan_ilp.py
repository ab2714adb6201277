"""The placement ILP against brute force, and the cost model against itself."""
# ruff: noqa: E741 - l is a layer index, as in the formulation (sum over layers l)


import numpy as np
import pytest
from test_plan_helpers import fast_hw, gpu, tiny_model

from formats.reader import open_gguf
from planner.costmodel import evaluate
from planner.ilp import build_model, solve
from planner.memory import account
from planner.plan import CPU, Plan
from planner.problem import build_problem


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PINFER_CACHE_DIR", str(tmp_path / "cache"))


def brute_force(p) -> tuple[float, Plan]:
    """The fastest plan by enumeration: per layer a GPU g, attention and predictor on the CPU or g, the k hottest
    neurons on g (k = 0..n_ff), and the output head anywhere. Layers interact only through memory, so each layer's
    options are enumerated once and combined with numpy."""
    m = p.model
    L, J = m.n_layer, p.n_gpus
    combos_t = np.zeros(1)
    combos_v = np.zeros((1, J))
    combos_h = np.zeros(1)
    per_layer = []
    for l, lb in enumerate(m.layers):
        opts = []
        for g in range(1, J + 1):
            for a in (CPU, g):
                for pr in ((CPU, g) if lb.has_predictor else (CPU,)):
                    for k in range(lb.n_ff + 1):
                        plan = Plan.on_cpu(L)
                        plan.attn[l], plan.pred[l], plan.n_gpu[l] = a, pr, k
                        plan.ffn_gpu[l] = g if k else CPU
                        t = evaluate(p, plan).layer_time[l]
                        nb = int(lb.neuron_bytes(k))
                        v = np.zeros(J)
                        v[g - 1] = (lb.attn + lb.kv) * (a == g) + lb.pred * (pr == g) + nb
                        h = (lb.attn + lb.kv) * (a == CPU) + lb.pred * (pr == CPU and lb.has_predictor) + lb.ffn - nb
                        opts.append((t, v, h, (g, a, pr, k)))
        per_layer.append(opts)
        t = np.array([o[0] for o in opts])
        v = np.array([o[1] for o in opts])
        h = np.array([o[2] for o in opts])
        combos_t = (combos_t[:, None] + t[None, :]).ravel()
        combos_v = (combos_v[:, None, :] + v[None, :, :]).reshape(-1, J)
        combos_h = (combos_h[:, None] + h[None, :]).ravel()
    best, best_plan = np.inf, None
    for out in range(J + 1):
        tt = combos_t + p.costs.output[out] + p.costs.token
        vv = combos_v.copy()
        hh = combos_h + (m.output if out == CPU else 0)
        if out:
            vv[:, out - 1] += m.output
        ok = (vv <= np.array(p.budgets)[None, :]).all(axis=1) & (hh <= p.host_budget)
        if not ok.any():
            continue
        i = int(np.argmin(np.where(ok, tt, np.inf)))
        if tt[i] < best:
            best = float(tt[i])
            idx = np.unravel_index(i, [len(o) for o in per_layer])
            picks = [per_layer[l][j][3] for l, j in enumerate(idx)]
            best_plan = Plan("brute", [c[1] for c in picks], [c[2] for c in picks],
                             [c[0] if c[3] else 0 for c in picks], [c[3] for c in picks], out)
    return best, best_plan


def _problem(tmp_path, *, share, predictor=True, n_gpus=1, n_layer=3, n_ff=12, group=1, host=None, freqs=None,
             seed=0):
    path = tiny_model(tmp_path / f"m{seed}.gguf", n_layer=n_layer, n_ff=n_ff, predictor=predictor, seed=seed,
                      freqs=freqs)
    total = account(open_gguf(path)).total
    gpus = [gpu(f"g{j}", budget_bytes=int(share * total / n_gpus), model=path, mem_bw_gbs=20.0 + 10 * j)
            for j in range(n_gpus)]
    hw = fast_hw(gpus)
    if host is not None:
        hw.cpu.host_ram_gib = host
    return build_problem(path, hw, group=group)


@pytest.mark.parametrize("share", [0.15, 0.45, 0.8, 1.2])
@pytest.mark.parametrize("predictor", [True, False])
def test_ilp_equals_brute_force(tmp_path, share, predictor):
    p = _problem(tmp_path, share=share, predictor=predictor)
    best, _ = brute_force(p)
    sol = solve(p, "time", gap=0.0, exact=True)
    assert sol.status == "optimal"
    assert sol.evaluation.time == pytest.approx(best, rel=1e-7)
    # The ILP's objective is a bound: its balance point may fall between two whole neurons, which the polished
    # plan cannot use (worth one neuron per layer, visible only in toy layers of a dozen neurons).
    ilp = sol.ilp_value * 1e-6 + p.costs.token
    assert ilp <= sol.evaluation.time * (1 + 1e-9)
    assert ilp == pytest.approx(sol.evaluation.time, rel=1e-3)


def test_ilp_equals_brute_force_with_groups(tmp_path):
    # frequencies constant within groups of 4: the group-level prefix curve is exact, so groups lose nothing
    rng = np.random.default_rng(3)
    freqs = [np.repeat(np.sort(rng.uniform(0.05, 1, 4))[::-1], 4) for _ in range(3)]
    p = _problem(tmp_path, share=0.4, n_ff=16, group=4, freqs=freqs)
    best, _ = brute_force(p)
    sol = solve(p, "time", gap=0.0, exact=True)
    assert sol.evaluation.time == pytest.approx(best, rel=1e-7)


def test_ilp_equals_brute_force_two_gpus(tmp_path):
    p = _problem(tmp_path, share=0.5, n_gpus=2, n_layer=2, n_ff=8)
    best, _ = brute_force(p)
    sol = solve(p, "time", gap=0.0, exact=True)
    assert sol.evaluation.time == pytest.approx(best, rel=1e-7)
    assert sol.evaluation.fits


def test_ilp_respects_host_ram(tmp_path):
    # the host cannot hold the model: the GPU must take enough of it
    p0 = _problem(tmp_path, share=0.7)
    need = p0.model.total + p0.model.host_fixed + p0.model.host_reserve
    p = _problem(tmp_path, share=0.7, host=(need - 0.4 * p0.model.total) / (1 << 30))
    best, _ = brute_force(p)
    sol = solve(p, "time", gap=0.0, exact=True)
    assert sol.evaluation.fits
    assert sol.evaluation.time == pytest.approx(best, rel=1e-7)


def test_continuous_counts_close_to_exact(tmp_path):
    p = _problem(tmp_path, share=0.45, n_ff=24, seed=1)
    best, _ = brute_force(p)
    sol = solve(p, "time", gap=0.0)  # fractional counts, then polished to whole neurons
    assert sol.evaluation.fits
    assert best <= sol.evaluation.time <= best * 1.001


def test_min_gpu_neurons_is_a_valid_cut(tmp_path):
    # With C_l, and without it, the optimum is the same (it only removes placements that are never better).
    p = _problem(tmp_path, share=0.3, seed=2)
    p.costs.sync[:] *= 50  # a costly sync makes C_l large
    from planner.costmodel import min_gpu_neurons

    p.c_min = min_gpu_neurons(p.costs, p.prefix)
    assert p.c_min[:, 1].min() > 1
    with_cut = solve(p, "time", gap=0.0, exact=True).evaluation.time
    p.c_min[:] = 0
    without = solve(p, "time", gap=0.0, exact=True).evaluation.time
    assert with_cut == pytest.approx(without, rel=1e-7)
    assert with_cut == pytest.approx(brute_force(p)[0], rel=1e-7)


def test_model_reads_like_the_math(tmp_path):
    p = _problem(tmp_path, share=0.5)
    prob, v = build_model(p)
    names = {c.name for c in prob.constraints()} if callable(prob.constraints) else set(prob.constraints)
    for expected in ("attn_placed_0", "pred_placed_2", "ffn_mode_1", "output_placed", "vram_1", "host_ram",
                     "ffn_gpu_time_0", "ffn_cpu_time_0", "split_neurons_0_1", "prefix_0_0"):
        assert expected in names
    assert v.attn_on[0, CPU].name == "attn_on_(0,_0)"


def test_evaluate_matches_hand_computation(tmp_path):
    p = _problem(tmp_path, share=0.5)
    m, c = p.model, p.costs
    plan = Plan("x", [1, 0, 0], [1, 0, 0], [1, 1, 0], [5, 12, 0], CPU)
    ev = evaluate(p, plan)
    l, k, lb = 0, 5, m.layers[0]
    pre = p.prefix[l]
    gpu_part = c.ffn_dispatch[1] + k * c.dense[l, 1] + pre[k] * c.sparse[l, 1]
    cpu_part = c.ffn_dispatch[0] + (lb.n_ff - k) * c.dense[l, 0] + (pre[-1] - pre[k]) * c.sparse[l, 0]
    assert ev.layer_time[0] == pytest.approx(c.attn[0, 1] + c.pred[0, 1] + max(gpu_part, cpu_part) + c.sync[0, 1])
    # layer 1: dense parts on the CPU, all neurons on the GPU: split; layer 2 all CPU: not split
    assert list(ev.split) == [True, True, False]
    assert ev.vram[0] == (m.layers[0].attn + m.layers[0].kv + m.layers[0].pred + int(lb.neuron_bytes(5))
                          + m.layers[1].ffn + m.gpu_workspace)
