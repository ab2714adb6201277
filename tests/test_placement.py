"""Where pi-run's parts run with a GPU (runtime/hybrid/placement.py): the plan in the file, PowerInfer's .gpuidx, or a
new plan, each refused with a one-line reason when it was made for another model, GPU or more memory."""

import numpy as np
import pytest

from pinfer_llm.cli.plan import main as pi_plan
from pinfer_llm.formats import constants as C
from pinfer_llm.formats.gpuidx import gpuidx_path, write_gpuidx
from pinfer_llm.formats.model_writer import write_llama
from pinfer_llm.formats.reader import open_gguf
from pinfer_llm.formats.update import update_model
from pinfer_llm.runtime.hybrid import placement as pl
from tests.tiny import random_weights, tiny_config

GIB = 1 << 30


@pytest.fixture
def model(tmp_path, monkeypatch):
    monkeypatch.setenv("PINFER_CACHE_DIR", str(tmp_path / "cache"))
    cfg = tiny_config(ffn_act="relu", n_layer=3, n_ff=192)
    path = tmp_path / "m.gguf"
    write_llama(path, cfg, random_weights(cfg, seed=2))
    update_model(path, set_tensors={C.tensor(C.ACT_COUNTS, i): np.linspace(50, 1, cfg.n_ff).astype(np.float32)
                                    for i in range(cfg.n_layer)},
                 set_metadata={C.ACT_TOKENS: np.uint64(50)})
    return path, cfg


def gpu(name="rtx4090", gib=24.0):
    return pl.GPUInfo(name, int(gib * GIB), int(gib * GIB), None, name)


def plan_it(path, *extra):
    with pytest.raises(SystemExit) as e:
        pi_plan([str(path), "--gpu", "rtx4090", "--vram-budget", "0.3", "--cpu-cores", "2", "--cpu-bw", "5",
                 "--host-ram", "16", *extra])
    assert e.value.code in (0, None)


def test_stored_plan_is_used(model):
    path, cfg = model
    plan_it(path)
    said = []
    p = pl.choose(open_gguf(path), gpu(), vram_budget_gib=0.3, ctx=256, threads=2, say=said.append)
    assert p.name == "plan" and "the plan in m.gguf" in p.source and not said


def test_plan_for_another_gpu_or_more_memory_is_replanned(model):
    path, _ = model
    plan_it(path)
    said = []
    p = pl.choose(open_gguf(path), gpu("a100-80g", 80), vram_budget_gib=0.3, ctx=256, threads=2, say=said.append)
    assert "made for rtx4090, not a100-80g" in said[0] and p.source.startswith("pi-plan for a100-80g")
    said.clear()
    p = pl.choose(open_gguf(path), gpu(), vram_budget_gib=0.29, ctx=256, threads=2, say=said.append)
    assert "GiB of VRAM" in said[0] and "planning again" in said[0] and "pi-plan for rtx4090" in p.source


def test_plan_that_a_longer_context_no_longer_fits_is_replanned(model):
    """pi-plan fitted its plan to its own context; run with a context whose KV cache takes the room the plan's GPU
    parts had, it is planned again, for this context, in one line."""
    path, _ = model
    plan_it(path)
    said = []
    p = pl.choose(open_gguf(path), gpu(), vram_budget_gib=0.3, ctx=256, threads=2, say=said.append)
    assert p.name == "plan" and not said
    p = pl.choose(open_gguf(path), gpu(), vram_budget_gib=0.3, ctx=2_000_000, threads=2, say=said.append)
    assert "does not fit 0.30 GiB with a context of 2000000" in said[0], said
    assert "planning again" in said[0] and p.source.startswith("pi-plan for rtx4090")


def test_plan_for_another_model_is_refused(model, tmp_path):
    path, cfg = model
    plan_it(path)
    other = tmp_path / "other.gguf"
    write_llama(other, cfg, random_weights(cfg, seed=2) | {C.tensor(C.FFN_UP, 0): np.zeros((cfg.n_ff, cfg.n_embd),
                                                                                               np.float16)})
    f = open_gguf(path)
    update_model(other, set_metadata={k: v for k, v in f.metadata.items() if k.startswith(C.PLAN_PREFIX)}
                 | {C.ACT_TOKENS: np.uint64(50)},
                 set_tensors={n: np.asarray(f.raw(n)) for n in f.tensors if ".gpu_" in n or "act_counts" in n})
    said = []
    pl.choose(open_gguf(other), gpu(), vram_budget_gib=0.3, ctx=256, threads=2, say=said.append)
    assert "another model" in said[0]


def test_powerinfer_sidecar(model):
    path, cfg = model
    rng = np.random.default_rng(0)
    masks = [(rng.random(cfg.n_ff) < 0.3).astype(np.int32) for _ in range(cfg.n_layer)]
    write_gpuidx(gpuidx_path(path), masks, None, vram_capacity=1 << 20)
    said = []
    p = pl.choose(open_gguf(path), gpu(), vram_budget_gib=0.3, ctx=256, threads=2, say=said.append)
    assert p.name == "gpuidx" and not said
    for b, m in zip(p.buckets, masks, strict=True):
        np.testing.assert_array_equal(b, np.flatnonzero(m))
    write_gpuidx(gpuidx_path(path), masks, None, vram_capacity=GIB)  # made for more memory than the budget
    p = pl.choose(open_gguf(path), gpu(), vram_budget_gib=0.3, ctx=256, threads=2, say=said.append)
    assert p.name == "plan" and "made for 1.00 GiB" in said[0] and "planning again" in said[0]
    write_gpuidx(gpuidx_path(path), [m[:100] for m in masks], None, vram_capacity=1 << 20)  # another model
    said.clear()
    p = pl.choose(open_gguf(path), gpu(), vram_budget_gib=0.3, ctx=256, threads=2, say=said.append)
    assert "another model" in said[0] and p.name == "plan"


def test_baselines_and_budget_errors(model):
    path, _ = model
    f = open_gguf(path)
    layers = pl.choose(f, gpu(), placement="layers", vram_budget_gib=0.3, ctx=256, threads=2)
    cpu = pl.choose(f, gpu(), placement="cpu", ctx=256, threads=2)
    assert layers.name == "layers" and cpu.name == "cpu" and not cpu.on_gpu
    with pytest.raises(Exception, match="more than the .* free"):
        pl.choose(f, gpu(gib=1), vram_budget_gib=2, ctx=256, threads=2)
    with pytest.raises(Exception, match="unknown --placement"):
        pl.choose(f, gpu(), placement="everything", ctx=256, threads=2)


def test_whole_model_placement_that_does_not_fit_says_by_how_much(model):
    """--placement gpu with too little VRAM: the error names what the model needs, what the budget leaves after
    the workspace, and what to do."""
    from pinfer_llm.planner.memory import account

    path, _ = model
    f = open_gguf(path)
    ws = account(f, 256).gpu_workspace
    with pytest.raises(Exception) as e:
        pl.choose(f, gpu(), placement="gpu", vram_budget_gib=(ws + 100_000) / GIB, ctx=256, threads=2)
    msg = str(e.value)
    assert "--placement gpu is not possible" in msg and "MiB, the GPU budget leaves 0.1 MiB for them" in msg, msg
    assert "a larger --vram-budget" in msg, msg
    assert pl.choose(f, gpu(), placement="gpu", vram_budget_gib=0.3, ctx=256, threads=2).name == "gpu"


def test_ngl_is_exactly_that_many_layers(model):
    """n_gpu_layers (pi-run -ngl N): the last N layers whole on the GPU, the output head as well only when N is more
    than the layer count, as llama.cpp counts it; N layers that do not fit are an error saying by how much."""
    from pinfer_llm.planner.memory import account

    path, cfg = model
    f = open_gguf(path)
    for n, attn, output in ((0, [0, 0, 0], False), (1, [0, 0, 1], False), (2, [0, 1, 1], False),
                            (3, [1, 1, 1], False), (4, [1, 1, 1], True), (99, [1, 1, 1], True)):
        p = pl.choose(f, gpu(), placement="layers", n_gpu_layers=n, vram_budget_gib=0.3, ctx=256, threads=2)
        assert p.name == "layers" and p.attn.tolist() == [bool(a) for a in attn], (n, p.attn)
        assert [len(b) for b in p.buckets] == [cfg.n_ff * a for a in attn] and p.output == output, n
    ws = account(f, 256).gpu_workspace
    with pytest.raises(Exception) as e:
        pl.choose(f, gpu(), n_gpu_layers=3, placement="layers", vram_budget_gib=(ws + 100_000) / GIB, ctx=256,
                  threads=2)
    msg = str(e.value)
    assert "-ngl 3 puts the last 3 of 3 layers on rtx4090" in msg and "the GPU budget leaves 0.1 MiB" in msg, msg
    assert "a smaller -ngl" in msg
    with pytest.raises(Exception, match="-ngl 2 is the layers placement"):
        pl.choose(f, gpu(), placement="powerinfer", n_gpu_layers=2, ctx=256, threads=2)


@pytest.mark.parametrize("name,gib,want", [("NVIDIA GeForce RTX 4090", 24, "rtx4090"), ("NVIDIA H200", 141, "h200"),
                                           ("NVIDIA A100-SXM4-40GB", 40, "a100-40g"), ("Tesla T4", 15, "t4"),
                                           ("Some New Card", 48, None)])
def test_gpu_names_match_the_table(name, gib, want):
    assert pl.match_gpu_table(name, int(gib * GIB)) == want


def test_a_model_without_statistics_on_a_card_the_table_lacks(tmp_path, monkeypatch):
    """A plain llama.cpp file (no activation statistics) on a GPU the planner's table does not know: planned as a
    whole-layer offload, said in one line, on a row built from the device's own memory and bandwidth."""
    monkeypatch.setenv("PINFER_CACHE_DIR", str(tmp_path / "cache"))
    cfg = tiny_config(ffn_act="relu", n_layer=3, n_ff=192)
    path = tmp_path / "plain.gguf"
    write_llama(path, cfg, random_weights(cfg, seed=2))
    card = pl.GPUInfo("Some New Card", int(1.0 * GIB), int(1.0 * GIB), 700.0, None)
    assert card.planner_gpu(int(0.8 * GIB)).mem_bw_gbs == 700.0
    said = []
    p = pl.choose(open_gguf(path), card, vram_budget_gib=0.8, ctx=256, threads=2, say=said.append)
    assert any("no activation statistics" in s and "whole-layer offload" in s for s in said), said
    assert p.name == "plan" and "Some New Card" in p.source
    assert all(len(b) in (0, cfg.n_ff) for b in p.buckets)  # whole layers' neurons, or none


def test_the_cuda_device_as_its_driver_describes_it(monkeypatch):
    """What pi-run takes from CuPy about the GPU: the name (bytes or str, as CuPy versions give it), total and free
    memory, the bandwidth from the memory clock and bus width when the driver reports them (CUDA 13 no longer
    does: then None, and the planner's table row or its default serves), and the table row matched by name and
    memory."""
    import types

    from pinfer_llm.runtime.gpu import CudaDevice
    from pinfer_llm.runtime.hybrid import devices
    from tests.cuda_emu import fake_cupy

    props = {"name": b"NVIDIA GeForce RTX 4090", "memoryClockRate": 10_501_000, "memoryBusWidth": 384}
    rt = types.SimpleNamespace(getDeviceCount=lambda: 1, getDeviceProperties=lambda i: dict(props),
                               memGetInfo=lambda: (20 * GIB, int(23.99 * GIB)))
    monkeypatch.setattr(fake_cupy.cuda, "runtime", rt)
    info = devices._cuda_info(CudaDevice(cupy=fake_cupy))
    assert info.name == "NVIDIA GeForce RTX 4090" and info.table_name == "rtx4090"
    assert info.total_bytes == int(23.99 * GIB) and info.free_bytes == 20 * GIB
    assert abs(info.mem_bw_gbs - 1008.0) < 1.0  # 2 x 10.5 GHz x 384 bits
    props.update(name="NVIDIA H200", memoryClockRate=0)
    rt.memGetInfo = lambda: (139 * GIB, 140 * GIB)
    info = devices._cuda_info(CudaDevice(cupy=fake_cupy))
    assert info.mem_bw_gbs is None and info.table_name == "h200"
    assert pl.budget_bytes(info, None) <= info.free_bytes
