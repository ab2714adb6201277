"""The placement ILP against brute force, and the cost model against itself."""
# ruff: noqa: E741 - l is a layer index, as in the formulation (sum over layers l)

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pulp
import pytest
from test_plan_helpers import fast_hw, gpu, tiny_model

from pinfer_llm.formats.reader import open_gguf
from pinfer_llm.planner import ilp
from pinfer_llm.planner.costmodel import evaluate
from pinfer_llm.planner.ilp import build_model, solve
from pinfer_llm.planner.memory import account
from pinfer_llm.planner.plan import CPU, Plan
from pinfer_llm.planner.problem import build_problem


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
    from pinfer_llm.planner.costmodel import min_gpu_neurons

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
    # the CPU's half starts after the host's work for the layer
    assert ev.layer_time[0] == pytest.approx(c.attn[0, 1] + c.pred[0, 1] + max(gpu_part, c.host[0, 1] + cpu_part)
                                             + c.sync[0, 1])
    # layer 1: dense parts on the CPU, all neurons on the GPU: split, the host's work in series; layer 2 all CPU
    assert list(ev.split) == [True, True, False]
    gpu_all = c.ffn_dispatch[1] + m.layers[1].n_ff * c.dense[1, 1] + p.prefix[1][-1] * c.sparse[1, 1]
    assert ev.layer_time[1] == pytest.approx(c.attn[1, 0] + c.pred[1, 0] + gpu_all + c.sync[1, 1] + c.host[1, 1])
    assert c.host[0, 1] > 0
    assert ev.vram[0] == (m.layers[0].attn + m.layers[0].kv + m.layers[0].pred + int(lb.neuron_bytes(5))
                          + m.layers[1].ffn + m.gpu_workspace)


# --- what the solver reports, and what it leaves behind -------------------------------------------------------------

@pytest.fixture
def tmpdir_for_solvers(tmp_path, monkeypatch):
    """The system temporary directory, private to the test: where solves put (and must remove) their files."""
    d = tmp_path / "systemp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


@pytest.fixture
def small_problem(tmp_path):
    path = tiny_model(tmp_path / "m.gguf", n_layer=12)  # few layers: CBC's root LP is integral before any clock
    half = account(open_gguf(path)).total // 2
    return build_problem(path, fast_hw([gpu(budget_bytes=half, model=path)]))


RELAX = ilp._relaxation_bound


def test_time_limited_gap_is_a_bound_or_unknown(small_problem, monkeypatch):
    """A solve stopped by its time limit reports an upper bound on its gap taken from the solver, or None: never a
    made-up 0."""
    monkeypatch.setattr(ilp, "_relaxation_bound", lambda *a: None)  # the solver gives no bound
    sol = solve(small_problem, time_limit=1e-9)  # stops at once, with its start as incumbent
    assert sol.status == "time limit" and sol.evaluation.fits
    assert sol.gap is None and any("gap unknown" in n for n in sol.notes)

    monkeypatch.setattr(ilp, "_relaxation_bound", lambda prob, tmp, tl, threads: RELAX(prob, tmp, 30.0, threads))
    sol = solve(small_problem, time_limit=1e-9)  # the relaxation alone gets time enough
    assert sol.status == "time limit" and sol.gap is not None and sol.gap >= 0
    assert any(f"gap at most {sol.gap:.2%}" in n for n in sol.notes)
    bound = sol.ilp_value * (1 - sol.gap)
    longer = solve(small_problem, time_limit=2)
    assert bound <= longer.ilp_value * (1 + 1e-9)  # a bound below every solution, a longer solve's too


def test_solver_files_go_and_stale_ones_are_removed(small_problem, tmpdir_for_solvers, monkeypatch):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    stale = tmpdir_for_solvers / f"{ilp.SOLVER_DIR}{int(dead.stdout)}-abc123"  # left by a kill -9
    stale.mkdir()
    (stale / "x-pulp.mps").write_bytes(b"0" * 1000)
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as live_proc:
        try:
            live = tmpdir_for_solvers / f"{ilp.SOLVER_DIR}{live_proc.pid}-def456"  # another solve, running
            live.mkdir()
            dirs = []
            real = pulp.LpProblem.solve

            def spy(prob, engine):
                dirs.append(engine.tmpDir)  # where PuLP writes its .mps, .mst and .sol files
                return real(prob, engine)

            monkeypatch.setattr(pulp.LpProblem, "solve", spy)
            solve(small_problem)
            assert dirs and os.path.dirname(dirs[-1]) == str(tmpdir_for_solvers)
            assert os.path.basename(dirs[-1]).startswith(f"{ilp.SOLVER_DIR}{os.getpid()}-")
            assert sorted(os.listdir(tmpdir_for_solvers)) == [live.name]  # ours gone, the stale one too
        finally:
            live_proc.kill()


def test_interrupted_solve_leaves_nothing(small_problem, tmpdir_for_solvers, monkeypatch):
    def interrupted(self, lp, **kw):
        (Path(self.tmpDir) / "half-written-pulp.mps").write_text("...")
        raise KeyboardInterrupt

    monkeypatch.setattr(pulp.PULP_CBC_CMD, "solve_CBC", interrupted)
    with pytest.raises(KeyboardInterrupt):
        solve(small_problem)
    assert os.listdir(tmpdir_for_solvers) == []


def test_sigterm_stops_the_solver_and_cleans_up(tmp_path):
    """pi-plan killed with SIGTERM in the middle of a solve: exit 143 with one line, its solver process stopped,
    its solver directory removed."""
    model = tiny_model(tmp_path / "m.gguf", n_layer=12)
    total = account(open_gguf(model)).total
    ws = account(open_gguf(model)).gpu_workspace
    # fast_hw's constants and two GPUs: a problem CBC does not close within its time limit (and no coarse solve)
    hw = tmp_path / "hw.toml"
    hw.write_text("[cpu]\ncores = 8\nmem_bw_gbs = 2\nhost_ram_gib = 64\nop_us = 0.01\ntoken_us = 0\n"
                  "[pcie]\nlatency_us = 0.05\n[engine]\ngpu_launch_us = 0.01\nsync_us = 0.05\n"
           "[host]\nsplit_layer_us = 0.03\ncall_us = 0.001\n"
                  + "".join(f"[[gpu]]\nname = 'g{i}'\nvram_gib = 80\nmem_bw_gbs = 800\npcie_gen = 4\n"
                            f"pcie_lanes = 16\nfp16_tflops = 50\nvram_budget_gib = {(ws + total / d) / (1 << 30)}\n"
                            for i, d in ((1, 2), (2, 4))))
    systemp = tmp_path / "systemp"
    systemp.mkdir()
    env = dict(os.environ, TMPDIR=str(systemp), PINFER_CACHE_DIR=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "pinfer_llm.cli.plan", str(model), "--hw", str(hw), "--dry-run", "--time-limit", "120"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parent.parent)
    solver_pid, deadline = None, time.monotonic() + 120
    while solver_pid is None and proc.poll() is None and time.monotonic() < deadline:
        solver_pid = next((pid for pid in _children(proc.pid) if b"cbc" in _cmdline(pid)), None)
        time.sleep(0.01)
    assert solver_pid is not None, "the solve ended before CBC was seen"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert err.strip() == "pi-plan: terminated"
    assert os.listdir(systemp) == []
    for _ in range(100):  # the solver gets SIGTERM too; give it a moment (left alone it runs to its time limit)
        if not _cmdline(solver_pid):
            break
        time.sleep(0.01)
    assert not _cmdline(solver_pid)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for t in Path(f"/proc/{pid}/task").iterdir()
                for c in (t / "children").read_text().split()]
    except OSError:
        return []


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_baselines_are_computed_once(tmp_path, monkeypatch):
    """plan_model computes the baselines and hands them to the solve, whose start and coarse solve use them."""
    from pinfer_llm.cli import plan as cli
    from pinfer_llm.planner import baselines
    from pinfer_llm.planner.machine import resolve_hardware
    from pinfer_llm.planner.skeleton import make_skeleton

    path = make_skeleton("llama2-7b", tmp_path / "7b.gguf", quant="q4_0", n_layer=3)  # > 64 groups: a coarse solve
    calls = []
    real = baselines.all_baselines

    def counted(p):
        calls.append(p)
        return real(p)

    monkeypatch.setattr(cli, "all_baselines", counted)
    monkeypatch.setattr(ilp, "all_baselines", counted)
    coarse = []
    real_solve = ilp.solve

    def spy(p, *a, **kw):
        coarse.append(p.bounds is not None)
        return real_solve(p, *a, **kw)

    monkeypatch.setattr(ilp, "solve", spy)  # the recursive coarse call goes through the module's name
    hw = resolve_hardware(["rtx3060-12g"], cpu_cores=8, cpu_bw_gbs=40, host_ram=64, vram_budget_gib=1.0)
    cli.plan_model(path, hw, write=False)
    assert any(coarse), "no coarse solve: the test needs a model with more breakpoints"
    assert len(calls) == 1
