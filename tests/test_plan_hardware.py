"""The GPU table, --hw files and flags, CPU detection with its cache, and the CPU calibration."""

import json

import numpy as np
import pytest

from pinfer_llm.formats.errors import PinferError
from pinfer_llm.planner import machine
from pinfer_llm.planner.calibration import Sample, calibrate, fit
from pinfer_llm.planner.hardware import CPU, gpu_table, load_hw_file, lookup_gpu
from pinfer_llm.planner.machine import resolve_hardware


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PINFER_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def no_measuring(monkeypatch):
    calls = []

    def fake(cores, mib=256, repeats=5):
        calls.append(cores)
        return 12.5 * cores

    monkeypatch.setattr(machine, "measure_cpu_bandwidth", fake)
    return calls


def test_table_covers_the_issue_and_is_sane():
    table = gpu_table()
    for name in ("rtx4090", "rtx4080", "rtx3090", "rtx3060-12g", "rtx2080ti", "a100-40g", "a100-80g", "h100-pcie",
                 "h200", "l4", "t4"):
        assert name in table
    for name in table:
        g = lookup_gpu(name)
        assert 8 <= g.vram_gib <= 160 and 200 <= g.mem_bw_gbs <= 5000 and 5 <= g.fp16_tflops <= 200
        assert g.pcie_gen in (3, 4, 5) and g.pcie_lanes in (8, 16)
    assert lookup_gpu("rtx4090").pcie_gbs == pytest.approx(1.969 * 16 * 0.8)
    assert lookup_gpu("rtx4060ti-16g").pcie_gbs == pytest.approx(lookup_gpu("rtx4090").pcie_gbs / 2)
    assert lookup_gpu("RTX4090").name == "rtx4090"


def test_unknown_gpu_suggests():
    with pytest.raises(PinferError, match="close names: .*a100-80g"):
        lookup_gpu("a100-80")


def test_flags_override_the_hw_file(tmp_path, no_measuring):
    hw_file = tmp_path / "hw.toml"
    hw_file.write_text("[cpu]\ncores = 8\nmem_bw_gbs = 50\nhost_ram_gib = 32\n[[gpu]]\nname = 't4'\n")
    hw = resolve_hardware(None, hw_file=hw_file)
    assert [g.name for g in hw.gpus] == ["t4"] and hw.cpu.cores == 8 and hw.cpu.mem_bw_gbs == 50
    hw = resolve_hardware(["l4"], hw_file=hw_file, cpu_cores=2, pcie_bw_gbs=7, vram_budget_gib=10)
    assert [g.name for g in hw.gpus] == ["l4"] and hw.cpu.cores == 2 and hw.cpu.mem_bw_gbs == 50
    assert hw.pcie_gbs(hw.gpus[0]) == 7 and hw.gpus[0].budget_bytes == 10 << 30
    assert not no_measuring
    with pytest.raises(PinferError, match="exceeds"):
        resolve_hardware(["t4"], vram_budget_gib=40, cpu_bw_gbs=10)


def test_cpu_bandwidth_is_measured_once(no_measuring):
    a = resolve_hardware(["t4"], cpu_cores=3)
    b = resolve_hardware(["t4"], cpu_cores=3)
    assert no_measuring == [3] and a.cpu.mem_bw_gbs == b.cpu.mem_bw_gbs == 37.5
    cached = json.loads((machine.cache_dir() / "cpu.json").read_text())
    assert any(k.endswith("|3") for k in cached)


def test_bad_flags():
    for kw in ({"cpu_cores": 0}, {"cpu_bw_gbs": -1}, {"vram_budget_gib": 0}):
        with pytest.raises(PinferError, match="positive"):
            resolve_hardware(["t4"], **kw)


def test_hw_file_custom_gpu(tmp_path):
    f = tmp_path / "hw.toml"
    f.write_text("[[gpu]]\nname = 'lab-card'\nvram_gib = 48\nmem_bw_gbs = 960\npcie_gen = 5\npcie_lanes = 8\n"
                 "fp16_tflops = 91.5\nvram_budget_gib = 40\n[engine]\nsync_us = 0\n")
    spec = load_hw_file(f)
    g = spec["gpus"][0]
    assert (g.name, g.vram_gib, g.pcie_gen, g.budget_bytes) == ("lab-card", 48.0, 5, 40 << 30)
    assert spec["engine"] == {"sync_us": 0.0}


def _samples(per_byte, per_op, per_token):
    shapes = [(1e8, 300), (3e8, 300), (5e7, 150), (2e8, 600)]
    return [Sample(f"s{i}", b, o, b * per_byte + o * per_op + per_token) for i, (b, o) in enumerate(shapes)]


def test_calibration_fit_recovers_constants():
    got = fit(_samples(1 / 8e9, 20e-6, 3e-3))
    assert got == pytest.approx((1 / 8e9, 20e-6, 3e-3), rel=1e-6)


def test_calibration_is_never_negative():
    # More operators, less time: unconstrained least squares wants a negative cost per operator (and a negative
    # cost per token); the fit must drop those terms instead.
    data = [Sample("a", 1e8, 100, 0.0100), Sample("b", 1e8, 300, 0.0090), Sample("c", 2e8, 100, 0.0195),
            Sample("d", 2e8, 300, 0.0185), Sample("e", 3e8, 200, 0.0283)]
    X = np.array([[s.cpu_bytes, s.cpu_ops, 1.0] for s in data])
    y = np.array([s.seconds for s in data])
    unconstrained, *_ = np.linalg.lstsq(X / y[:, None], np.ones(len(y)), rcond=None)
    assert unconstrained[1] < 0  # the case needs the constraint
    per_byte, per_op, per_token = fit(data)
    assert per_byte > 0 and per_op == 0 and per_token >= 0
    assert per_byte == pytest.approx(1e-10, rel=0.1)  # ~10 GB/s, as the data say


def test_calibration_is_cached_and_applied(no_measuring, monkeypatch):
    monkeypatch.setattr(machine, "cpu_name", lambda: "Test CPU")
    monkeypatch.setattr(machine, "detect_cores", lambda: 2)
    assert machine.this_cpu_key() == "Test CPU|2"
    cal = calibrate("Test CPU|2", 25.0, _samples(1 / 5e9, 40e-6, 2e-3))
    assert cal.bw_gbs == pytest.approx(5.0) and cal.op_us == pytest.approx(40) and cal.token_us == pytest.approx(2000)
    assert machine.load_calibration("Test CPU|2") is None  # fitting stores nothing
    machine.save_calibration(cal)
    assert machine.load_calibration("Test CPU|2").bw_gbs == pytest.approx(5.0)
    hw = resolve_hardware(["t4"])  # this machine's own CPU: calibrated
    assert hw.cpu.calibrated and hw.cpu.op_us == pytest.approx(40)
    assert hw.cpu.mem_bw_gbs * hw.cpu.bw_efficiency == pytest.approx(5.0)
    assert not resolve_hardware(["t4"], calibration=False).cpu.calibrated
    assert not resolve_hardware(["t4"], cpu_bw_gbs=30).cpu.calibrated  # a described CPU is not this machine's
    machine.forget_calibration("Test CPU|2")
    assert machine.load_calibration("Test CPU|2") is None


def test_cost_model_uses_the_link():
    from pinfer_llm.planner.costmodel import speeds
    from pinfer_llm.planner.hardware import Hardware

    cpu = CPU("c", 8, 50.0, 64.0)
    fast, slow = Hardware(cpu, [lookup_gpu("rtx4090")]), Hardware(cpu, [lookup_gpu("rtx4060ti-16g")])
    assert speeds(fast)[1].bw > speeds(slow)[1].bw
    assert fast.pcie_gbs(fast.gpus[0]) == 2 * slow.pcie_gbs(slow.gpus[0])


def test_cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PINFER_CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty counts as unset (XDG spec), not as the working directory
    assert machine.cache_dir() == tmp_path / "home" / ".cache" / "pinfer"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert machine.cache_dir() == tmp_path / "xdg" / "pinfer"
    monkeypatch.setenv("PINFER_CACHE_DIR", str(tmp_path / "mine"))
    assert machine.cache_dir() == tmp_path / "mine"


def test_hybrid_calibration_recovers_the_machine(tmp_path):
    """calibrate_hybrid on runs 'measured' on a known machine (the cost model with other constants): it finds the
    CPU's bandwidth from the CPU-only run and the host's time per split layer from the split run, and then predicts
    the runs it was not fitted on exactly; its --hw lines give that machine back."""
    from dataclasses import replace

    from pinfer_llm.formats.reader import open_gguf
    from pinfer_llm.planner.baselines import cpu_plan, layers_plan, powerinfer_plan
    from pinfer_llm.planner.calibration import DeviceFit, calibrate_hybrid
    from pinfer_llm.planner.costmodel import costs, evaluate
    from pinfer_llm.planner.memory import account
    from pinfer_llm.planner.plan import Plan
    from pinfer_llm.planner.problem import build_problem
    from tests.test_plan_helpers import fast_hw, gpu, tiny_model

    path = tiny_model(tmp_path / "m.gguf", n_layer=6, n_ff=96)
    total = account(open_gguf(path)).total
    p = build_problem(path, fast_hw([gpu(budget_bytes=total // 2, model=path)]))
    L, n_ff = p.model.n_layer, p.model.n_ff
    split = Plan("split", np.ones(L), np.ones(L), np.ones(L), [n // 3 for n in n_ff], 1)
    device = DeviceFit(0.5, {"q4_0": 0.2}, {"q4_0": 0.05})
    machine_hw = replace(p.hw, cpu=replace(p.hw.cpu, mem_bw_gbs=0.7, bw_efficiency=1.0), host_split_layer_us=400.0,
                         gpu_launch_us=0.5, gpu_dense_efficiency=p.hw.gpu_dense_efficiency | {"q4_0": 0.2},
                         gpu_sparse_efficiency=p.hw.gpu_sparse_efficiency | {"q4_0": 0.05})
    truth = replace(p, hw=machine_hw, costs=costs(p.model, machine_hw))
    plans = {"cpu": cpu_plan(p), "plan": split, "layers": layers_plan(p), "powerinfer": powerinfer_plan(p)}
    runs = {k: (plan, evaluate(truth, plan).time) for k, plan in plans.items()}
    assert evaluate(p, split).tokens_per_s > 1.5 / runs["plan"][1]  # the planner's defaults are far off here

    fit = calibrate_hybrid(p, runs, device=device)
    assert fit.cpu_bw_gbs == pytest.approx(0.7, rel=1e-6) and fit.host_split_layer_us == pytest.approx(400.0, rel=1e-6)
    assert fit.fitted_on == ["cpu", "plan"]
    assert all(abs(e) < 1e-6 for e in fit.errors().values()), fit.errors()
    assert fit.errors_before()["plan"] > 0.5  # before: the defaults
    hw_file = tmp_path / "fitted.toml"
    hw_file.write_text(fit.hw_lines() + "[[gpu]]\nname = 'g'\nvram_gib = 80\nmem_bw_gbs = 800\npcie_gen = 4\n"
                       "pcie_lanes = 16\nfp16_tflops = 50\n")
    again = resolve_hardware(None, hw_file=hw_file)
    assert again.host_split_layer_us == pytest.approx(400.0, abs=0.1) and again.gpu_launch_us == 0.5
    assert again.gpu_efficiency("Q4_0", sparse=True) == 0.05 and again.cpu.mem_bw_gbs == pytest.approx(0.7)
    with pytest.raises(ValueError, match="no split layer"):
        calibrate_hybrid(p, runs, split_run="cpu")


def test_hybrid_calibration_fits_fixed_costs_a_run_beats(tmp_path):
    """A CPU-only run faster than the planner's operator and token costs alone (the fused decode step's machine:
    fixed costs a quarter of the defaults, at the planner's bandwidth): the fit scales both fixed costs down at that
    bandwidth instead of failing, predicts the CPU run exactly, and its --hw lines carry them. Plant: the old
    ValueError ('nothing left to fit a bandwidth to') kept: fails."""
    from dataclasses import replace

    from pinfer_llm.formats.reader import open_gguf
    from pinfer_llm.planner.baselines import cpu_plan
    from pinfer_llm.planner.calibration import calibrate_hybrid
    from pinfer_llm.planner.costmodel import costs, evaluate
    from pinfer_llm.planner.memory import account
    from pinfer_llm.planner.plan import Plan
    from pinfer_llm.planner.problem import build_problem
    from tests.test_plan_helpers import fast_hw, gpu, tiny_model

    path = tiny_model(tmp_path / "m.gguf", n_layer=6, n_ff=96)
    total = account(open_gguf(path)).total
    p = build_problem(path, fast_hw([gpu(budget_bytes=total // 2, model=path)]))
    c = p.hw.cpu
    c = replace(c, op_us=max(c.op_us, 2.0), token_us=max(c.token_us, 50.0))
    p = replace(p, hw=replace(p.hw, cpu=c), costs=costs(p.model, replace(p.hw, cpu=c)))
    L, n_ff = p.model.n_layer, p.model.n_ff
    machine_hw = replace(p.hw, cpu=replace(c, op_us=c.op_us / 4, token_us=c.token_us / 4), host_split_layer_us=300.0)
    truth = replace(p, hw=machine_hw, costs=costs(p.model, machine_hw))
    plans = {"cpu": cpu_plan(p), "plan": Plan("split", np.ones(L), np.ones(L), np.ones(L), [n // 3 for n in n_ff], 1)}
    runs = {k: (plan, evaluate(truth, plan).time) for k, plan in plans.items()}
    assert evaluate(replace(p, costs=costs(p.model, replace(p.hw, cpu=replace(c, mem_bw_gbs=1e5)))),
                    plans["cpu"]).time > runs["cpu"][1]  # the defaults' fixed costs alone outlast the run
    fit = calibrate_hybrid(p, runs)
    assert fit.cpu_fixed_us == pytest.approx((c.op_us / 4, c.token_us / 4), rel=1e-3)
    assert fit.errors()["cpu"] == pytest.approx(0, abs=1e-6)
    assert "op_us = " in fit.hw_lines() and "token_us = " in fit.hw_lines()


def test_device_constants_from_timed_kernels():
    """fit_device: the latency from a kernel that moves nothing, each type's efficiency from its bytes over its time
    less that latency, the sparse one over up and down together."""
    from pinfer_llm.planner.calibration import fit_device

    recs = [{"kernel": "latency", "type": "f32", "us": 2.0, "touched_bytes": 0},
            {"kernel": "latency", "type": "f32", "us": 4.0, "touched_bytes": 0},
            {"kernel": "gemv", "type": "F16", "us": 13.0, "touched_bytes": 10e6},  # 10 MB in 10 us: 1 TB/s
            {"kernel": "sparse_up", "type": "q4_0", "us": 8.0, "touched_bytes": 2e6},
            {"kernel": "sparse_down", "type": "q4_0", "us": 4.0, "touched_bytes": 1e6}]  # 3 MB in 6 us
    d = fit_device(recs, datasheet_gbs=2000)
    assert d.gpu_launch_us == 3.0
    assert d.dense == {"f16": 0.5} and d.sparse == {"q4_0": 0.25}
