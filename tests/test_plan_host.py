"""The host thread in the cost model: a split layer costs the host's launches, copies and Python, and the CPU's
neurons start only after them; per-type GPU efficiencies and the host constants come from the machine file.

Plants (each made the test below fail, then restored):
- costmodel.costs without `host[:, k] = ...` (no host term): test_high_host_cost_means_fewer_split_layers;
- ilp.build_model without the host in the split's objective term (host only in evaluate): the same test's "the ILP
  alone" check;
- hardware.Hardware.gpu_efficiency always returning gpu_bw_efficiency: test_gpu_efficiency_is_per_weight_type;
- the JSON branch of load_hw_file removed: test_host_constants_from_hybrid_overhead_json;
- ilp.build_model's ffn_gpu_time without "- host" (the GPU's half no longer hides the host):
  test_ilp_equals_brute_force_with_the_host;
- ilp._blocks_start returning Plan.on_cpu: test_several_gpus_start_from_blocks_of_layers.
"""
# ruff: noqa: E741

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T

from pinfer_llm.formats.errors import PinferError
from pinfer_llm.formats.reader import open_gguf
from pinfer_llm.planner.costmodel import evaluate
from pinfer_llm.planner.hardware import HOST_CALLS_PER_SPLIT_LAYER
from pinfer_llm.planner.ilp import solve
from pinfer_llm.planner.machine import resolve_hardware
from pinfer_llm.planner.memory import account
from pinfer_llm.planner.problem import build_problem
from tests.test_plan_helpers import tiny_model, workspace_bytes

GIB = 1 << 30


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PINFER_CACHE_DIR", str(tmp_path / "cache"))


def machine_file(path, split_layer_us: float, budget_gib: float, *, extra: str = "", gpu_bw: float = 800):
    """test_plan_helpers.fast_hw's constants as a --hw file, with the host's time per split layer given."""
    path.write_text("[cpu]\ncores = 4\nmem_bw_gbs = 2\nhost_ram_gib = 64\nop_us = 0.01\ntoken_us = 0\n"
                    "[pcie]\nlatency_us = 0.05\n[engine]\ngpu_launch_us = 0.01\nsync_us = 0.05\n" + extra +
                    f"[host]\nsplit_layer_us = {split_layer_us}\ncall_us = 0\n"
                    f"[[gpu]]\nname = 'lab'\nvram_gib = 80\nmem_bw_gbs = {gpu_bw}\npcie_gen = 4\npcie_lanes = 16\n"
                    f"fp16_tflops = 50\nvram_budget_gib = {budget_gib!r}\n")
    return path


def split_layers(p, plan) -> int:
    """Layers whose FFN is split between the GPU and the CPU."""
    return int(sum(0 < k < lb.n_ff for k, lb in zip(plan.n_gpu, p.model.layers, strict=True)))


def test_high_host_cost_means_fewer_split_layers(tmp_path):
    """Half the FFN bytes fit the GPU. With a cheap host the plan splits every layer (its hot neurons on the GPU);
    when a split layer costs the host more than its GPU neurons save the CPU, the plan splits none (it puts one
    whole layer on the GPU instead), and it is faster under those costs than the cheap-host plan would be."""
    model = tiny_model(tmp_path / "m.gguf", n_layer=6, n_ff=256)
    mb = account(open_gguf(model))
    budget = (workspace_bytes(model) + 0.5 * sum(lb.ffn for lb in mb.layers)) / GIB
    plans = {}
    for name, us in (("cheap", 0.05), ("costly", 400.0)):
        hw = resolve_hardware(None, hw_file=machine_file(tmp_path / f"{name}.toml", us, budget))
        assert hw.host_split_us == us
        p = build_problem(model, hw, group=8)
        sol = solve(p, "time", gap=0.0)
        assert sol.status == "optimal"
        # the ILP alone (exact groups, no start plan to fall back on) finds as good a plan, and its value is the
        # cost model's: the host term is written in the ILP as in evaluate
        alone = solve(p, "time", gap=0.0, exact=True)
        assert alone.evaluation.time == pytest.approx(sol.evaluation.time, rel=1e-2)  # groups of 8: a little off
        assert alone.ilp_value * 1e-6 + p.costs.token == pytest.approx(alone.evaluation.time, rel=1e-2)
        plans[name] = (p, sol)
    p_cheap, cheap = plans["cheap"]
    p_costly, costly = plans["costly"]
    assert split_layers(p_cheap, cheap.plan) == 6, cheap.plan.n_gpu
    assert split_layers(p_costly, costly.plan) == 0, costly.plan.n_gpu
    assert costly.evaluation.split.sum() == 0  # nor any other split (attention on one side, FFN on the other)
    assert costly.plan.n_gpu.max() == 256  # the VRAM goes to a whole layer
    # under the costly host the cheap plan pays its split layers' host time, all of it: the CPU's halves wait
    t_cheap_there = evaluate(p_costly, cheap.plan).time
    assert t_cheap_there > costly.evaluation.time
    assert t_cheap_there - cheap.evaluation.time == pytest.approx(6 * (400.0 - 0.05) * 1e-6, rel=1e-6)


def test_host_time_delays_only_the_cpus_half(tmp_path):
    """A split FFN costs max(GPU part, host + CPU part): a GPU half longer than host + CPU hides the host entirely;
    a layer split with its FFN whole on the CPU pays the host in series."""
    from dataclasses import replace

    from pinfer_llm.planner.plan import Plan

    model = tiny_model(tmp_path / "m.gguf", n_layer=2, n_ff=96)
    hw = resolve_hardware(None, hw_file=machine_file(tmp_path / "hw.toml", 3.0, 1.0, gpu_bw=0.5))
    p = build_problem(model, hw)
    c = p.costs
    L = p.model.n_layer
    ffn_on_cpu = Plan("attn-gpu", np.ones(L), np.ones(L), np.zeros(L), np.zeros(L), 1)
    base = evaluate(p, ffn_on_cpu).layer_time
    slow = replace(p, costs=replace(c, host=c.host * 2))
    assert evaluate(slow, ffn_on_cpu).layer_time == pytest.approx(base + c.host[:, 1])
    k = p.model.layers[0].n_ff - 1  # all but one neuron on the GPU: the GPU's half is the long one
    mostly_gpu = Plan("k", np.ones(L), np.ones(L), np.ones(L), np.full(L, k), 1)
    gpu_half = c.ffn_dispatch[1] + k * c.dense[0, 1] + p.prefix[0][k] * c.sparse[0, 1]
    cpu_half = c.ffn_dispatch[0] + c.dense[0, 0] + (p.prefix[0][-1] - p.prefix[0][k]) * c.sparse[0, 0]
    assert gpu_half > cpu_half + c.host[0, 1]
    assert evaluate(slow, mostly_gpu).layer_time[0] == pytest.approx(evaluate(p, mostly_gpu).layer_time[0])


def test_host_constants_from_hybrid_overhead_json(tmp_path):
    """`--hw` takes benchmarks/hybrid_overhead.py --json's output: its host figures become the [host] constants,
    everything else stays as detected or given."""
    out = {"layers": 40, "hybrid_us_per_layer": 90.0, "with_cuda_wrappers_us_per_layer": 123.4,
           "cpu_path_us_per_layer": 80.0, "cupy_calls_per_split_layer": 4}
    f = tmp_path / "overhead.json"
    f.write_text(json.dumps(out))
    hw = resolve_hardware(["rtx4090"], hw_file=f, cpu_cores=4, cpu_bw_gbs=20, host_ram=32)
    assert (hw.host_split_layer_us, hw.host_calls_per_split_layer) == (123.4, 4)
    assert hw.host_split_us == pytest.approx(123.4 + 4 * hw.host_call_us)
    assert hw.gpus[0].name == "rtx4090" and hw.cpu.cores == 4
    del out["cupy_calls_per_split_layer"]  # before helper graph's counter: the default call count stays
    f.write_text(json.dumps(out))
    assert resolve_hardware(["t4"], hw_file=f, cpu_cores=4, cpu_bw_gbs=20,
                            host_ram=32).host_calls_per_split_layer == HOST_CALLS_PER_SPLIT_LAYER
    f.write_text(json.dumps({"layers": 40}))
    with pytest.raises(PinferError, match="hybrid_overhead.py --json"):
        resolve_hardware(["t4"], hw_file=f, cpu_cores=4, cpu_bw_gbs=20, host_ram=32)
    f.write_text("{not json")
    with pytest.raises(PinferError, match="malformed JSON"):
        resolve_hardware(["t4"], hw_file=f, cpu_cores=4, cpu_bw_gbs=20, host_ram=32)


@pytest.mark.parametrize("bad, why", [("gpu_dense_efficiency = { f16 = 1.5 }", "in \\[1e-09, 1\\]"),
                                      ("gpu_dense_efficiency = 0.5", "table of weight types"),
                                      ("gpu_sparse_efficiency = { q4_0 = 'x' }", "share of the bandwidth")])
def test_bad_efficiency_tables_are_one_line(tmp_path, bad, why):
    f = tmp_path / "hw.toml"
    f.write_text(f"[engine]\n{bad}\n")
    with pytest.raises(PinferError, match=why):
        resolve_hardware(["t4"], hw_file=f, cpu_cores=4, cpu_bw_gbs=20, host_ram=32)


def test_gpu_efficiency_is_per_weight_type(tmp_path):
    """The GPU's time for a part is its bytes at its weight type's efficiency: Q4_0 rows read at the Q4_0 figure,
    F16 at F16's, from the machine file (types it does not name keep the defaults; Q4_1 as Q4_0)."""
    extra = "gpu_dense_efficiency = { q4_0 = 0.2 }\ngpu_sparse_efficiency = { q4_0 = 0.1, f16 = 0.4 }\n"
    hw = resolve_hardware(None, hw_file=machine_file(tmp_path / "hw.toml", 1.0, 1.0, extra=extra))
    assert hw.gpu_efficiency("Q4_0") == 0.2 and hw.gpu_efficiency("q4_1") == 0.2
    assert hw.gpu_efficiency("F16") == 0.87  # not in the file: the H200 default
    assert hw.gpu_efficiency("Q4_0", sparse=True) == 0.1 and hw.gpu_efficiency("BF16", sparse=True) == 0.4
    assert hw.gpu_efficiency("IQ2_XS") == hw.gpu_bw_efficiency
    per_byte = {}
    for qtype in (T.Q4_0, T.F16):
        p = build_problem(tiny_model(tmp_path / f"{qtype.name}.gguf", qtype=qtype), hw)
        lb, c = p.model.layers[0], p.costs
        per_byte[qtype] = c.sparse[0, 1] / lb.sparse_per_neuron
        assert per_byte[qtype] == pytest.approx(1 / (800e9 * hw.gpu_efficiency(qtype.name, sparse=True)))
    assert per_byte[T.Q4_0] == pytest.approx(4 * per_byte[T.F16])


@pytest.mark.parametrize("host_us", [0.2, 1.0, 3.0])
def test_ilp_equals_brute_force_with_the_host(tmp_path, host_us):
    """The ILP against enumeration when the host's time is of the order of a layer's: split FFNs whose GPU half
    hides the host, splits the host makes not worth it, and whole layers, as the cost model prices them."""
    from tests.test_plan_helpers import fast_hw, gpu
    from tests.test_plan_ilp import brute_force

    path = tiny_model(tmp_path / "m.gguf", n_layer=3, n_ff=12)
    total = account(open_gguf(path)).total
    g = gpu("g", budget_bytes=int(0.45 * total), model=path, mem_bw_gbs=3.0)  # a slow GPU: its half can be long
    p = build_problem(path, fast_hw([g], host_split_layer_us=host_us, host_call_us=0.0), group=1)
    best, _ = brute_force(p)
    sol = solve(p, "time", gap=0.0, exact=True)
    assert sol.status == "optimal"
    assert sol.evaluation.time == pytest.approx(best, rel=1e-7)
    assert sol.ilp_value * 1e-6 + p.costs.token == pytest.approx(sol.evaluation.time, rel=1e-3)


def test_several_gpus_start_from_blocks_of_layers(tmp_path):
    """Two GPUs: the start handed to CBC (ilp._blocks_start) gives each GPU a contiguous block of layers planned by
    the single-GPU heuristic; it fits, uses both, and is no slower than any baseline (with the host's time the
    relaxation of several GPUs is loose, and CBC may stop at its start: solve returns nothing slower than it)."""
    from pinfer_llm.planner import ilp
    from pinfer_llm.planner.baselines import all_baselines
    from tests.test_plan_helpers import fast_hw, gpu

    path = tiny_model(tmp_path / "m.gguf", n_layer=6, n_ff=96)
    total = account(open_gguf(path)).total
    gpus = [gpu(f"g{j}", budget_bytes=total // 4, model=path) for j in range(2)]
    p = build_problem(path, fast_hw(gpus, host_split_layer_us=0.5), group=8)
    start = ilp._blocks_start(p)
    ev = evaluate(p, start)
    assert ev.fits and set(start.ffn_gpu[start.n_gpu > 0]) == {1, 2}
    on = np.maximum(np.maximum(start.attn, start.pred), start.ffn_gpu)
    assert (np.diff(on[on > 0]) >= 0).all()  # GPU 1's layers, then GPU 2's
    base = [b.time for b in all_baselines(p).values() if b.time is not None]
    assert ev.time <= min(base)
    assert ilp._blocks_start(build_problem(path, fast_hw(gpus[:1]))) is None  # one GPU: the heuristic itself
