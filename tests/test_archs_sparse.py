"""Falcon and OPT through the sparse machinery: the planted generator against its golden forward, the profiler against
HF's own FFN activations, pi-profile's predictors, pi-plan's byte accounting and plans, and the hybrid executor."""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from pinfer_llm import synth
from pinfer_llm.formats import constants as C
from pinfer_llm.formats.reader import open_gguf
from pinfer_llm.runtime import load_model
from pinfer_llm.runtime.gpu import ReferenceDevice
from pinfer_llm.runtime.hybrid import executor as hybrid
from pinfer_llm.runtime.profiling.activity import activation_rule
from pinfer_llm.runtime.profiling.corpus import HELDOUT
from pinfer_llm.runtime.profiling.counting import profile
from tests import hf_archs as H
from tests.strict_device import StrictStreams
from tests.test_hybrid import logits, random_placement

ARCHS = ["falcon", "opt"]


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """Planted ReLU models, 90% sparse: ReluFalcon in the 40B layout (grouped KV, two norms) and OPT."""
    out = {}
    for arch in ARCHS:
        path = tmp_path_factory.mktemp(arch) / f"{arch}.gguf"
        synth.generate(path, synth.SynthSpec(n_layer=2, n_embd=64, n_ff=256, n_head=4, n_head_kv=2 if arch == "falcon"
                                             else 4, vocab="bytes", variant=arch, sparsity=0.9, seed=1))
        out[arch] = path
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_planted_model_equals_its_golden_forward(planted, arch, kernels):
    path = planted[arch]
    f = open_gguf(path)
    assert f.architecture == arch and f.is_powerinfer
    ids = [int(i) for i in np.random.default_rng(0).integers(0, 257, 48)]
    ref, active = synth.reference_forward(f, ids, collect_activity=True)
    assert 0.05 < float(active.float().mean()) < 0.2  # planted ~10% activity
    for mode in ("dense", "oracle"):
        m = load_model(path, threads=2, ffn_mode=mode, kv_type="f32")
        assert np.abs(m.forward_logits(ids) - ref).max() < 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("arch", ARCHS)
def test_planted_frequencies(planted, arch):
    f = open_gguf(planted[arch])
    got, want = synth.measure_frequencies(f, n_tokens=1024), synth.target_frequencies(f)
    for i in range(len(got)):
        assert abs(got[i].mean() - want[i].mean()) < 0.02
        assert np.corrcoef(got[i], want[i])[0, 1] > 0.95


def hf_ffn_record(hf, ids):
    """HF's own per-layer FFN pre-activations (up x + b) and FFN residual inputs (what PowerInfer's predictors read:
    the layer input for Falcon, the stream after attention for OPT), by forward hooks. One sequence; OPT's layers
    flatten it to [tokens, d] before the FFN."""
    pre, resid, hooks = {}, {}, []
    keep = lambda store, i, t: store.__setitem__(i, t.detach().reshape(-1, t.shape[-1]).clone())  # noqa: E731
    if isinstance(hf, H.transformers.FalconForCausalLM):
        for i, layer in enumerate(hf.transformer.h):
            hooks.append(layer.mlp.dense_h_to_4h.register_forward_hook(lambda mod, a, out, i=i: keep(pre, i, out)))
            hooks.append(layer.register_forward_pre_hook(lambda mod, a, i=i: keep(resid, i, a[0])))
    else:
        for i, layer in enumerate(hf.model.decoder.layers):
            hooks.append(layer.fc1.register_forward_hook(lambda mod, a, out, i=i: keep(pre, i, out)))
            hooks.append(layer.final_layer_norm.register_forward_pre_hook(lambda mod, a, i=i: keep(resid, i, a[0])))
    try:
        H.hf_logits(hf, ids)
    finally:
        for h in hooks:
            h.remove()
    return pre, resid


@pytest.mark.parametrize("arch", ARCHS)
def test_profile_counts_and_samples_equal_hf(tmp_path, arch):
    """The profiler's rule for gate-less FFNs, relu(up x + b) > 0, and its predictor inputs, against HF's modules."""
    if arch == "falcon":
        hf = H.make_falcon("40b_gqa_relu")
        path = H.write(tmp_path / "m.gguf", H.falcon_metadata(hf), H.falcon_tensors(hf))
    else:
        hf = H.make_opt()
        path = H.write(tmp_path / "m.gguf", H.opt_metadata(hf), H.opt_tensors(hf))
    m = load_model(path, threads=2, kv_type="f32")
    rng = np.random.default_rng(3)
    windows = [[int(i) for i in rng.integers(0, H.VOCAB, n)] for n in (30, 17)]
    prof = profile(m, windows, activation_rule(m.cfg), sample_tokens=47)
    counts = np.zeros_like(prof.counts)
    resid = []
    for w in windows:
        pre, res = hf_ffn_record(hf, w)
        counts += np.stack([(pre[i] > 0).sum(0).numpy() for i in range(len(pre))])
        resid.append(res)
    assert prof.tokens == 47 and 0 < counts.mean() / 47 < 1
    np.testing.assert_array_equal(prof.counts, counts)
    # every token was sampled: its predictor input is HF's FFN residual input, in window order
    for i in range(m.cfg.n_layer):
        want = torch.cat([r[i] for r in resid]).numpy()
        np.testing.assert_allclose(prof.samples[i].x, want, atol=1e-4 * np.abs(want).max())


def run_profile_cli(*args):
    from pinfer_llm.cli.profile import app

    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, r.output.strip()


@pytest.fixture(scope="module")
def profiled(planted, tmp_path_factory):
    """pi-profile --train-predictors --recall 0.99 on each planted model."""
    out = {}
    for arch, path in planted.items():
        dst = tmp_path_factory.mktemp(arch) / "pred.gguf"
        code, text = run_profile_cli(path, "--train-predictors", "--recall", 0.99, "--tokens", 3000, "--ctx", 256,
                                     "-o", dst, "--json")
        assert code == 0, text
        out[arch] = (dst, json.loads(text))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_trained_predictors_on_gateless_models(profiled, arch):
    path, summary = profiled[arch]
    for row in summary["layers"]:
        assert row["recall"] >= 0.95, row
        assert row["predicted_density"] < 0.5 and 0.85 < row["sparsity"] < 0.95, row
    f = open_gguf(path)
    assert f.get(C.ACT_RULE) == "relu>0" and f.has(C.tensor(C.PRED_FC2, 1))
    ids = load_model(path).tokenizer.encode(HELDOUT.read_text())[:200]
    dense, sparse = (load_model(path, threads=2, ffn_mode=mode).forward_logits(ids) for mode in ("dense", "sparse"))
    agree = float((dense.argmax(-1) == sparse.argmax(-1)).mean())
    assert agree >= 0.9, agree


@pytest.mark.parametrize("arch", ARCHS)
def test_plan_accounts_two_rows_per_neuron(profiled, arch):
    from pinfer_llm.planner.memory import account

    path, _ = profiled[arch]
    f = open_gguf(path)
    mb = account(f)
    lb = mb.layers[0]
    up, down = f.info(C.tensor(C.FFN_UP, 0)), f.info(C.tensor(C.FFN_DOWN_T, 0))
    bias = 4 if arch == "opt" else 0  # OPT's up bias: one float per neuron
    assert lb.neuron == pytest.approx((up.nbytes + down.nbytes) / lb.n_ff + bias)
    assert set(lb.row_types) == {"ffn_up", "ffn_down_t"} and mb.quant == "F32"
    dense_names = ([C.ATTN_QKV, C.ATTN_NORM, C.ATTN_NORM_B, C.ATTN_NORM_2, C.ATTN_NORM_2_B, C.ATTN_OUT]
                   if arch == "falcon" else
                   [C.ATTN_Q, C.ATTN_Q_B, C.ATTN_K, C.ATTN_K_B, C.ATTN_V, C.ATTN_V_B, C.ATTN_OUT, C.ATTN_OUT_B,
                    C.ATTN_NORM, C.ATTN_NORM_B, C.FFN_NORM, C.FFN_NORM_B, C.FFN_DOWN_T_B])
    assert lb.attn == sum(f.info(C.tensor(t, 0)).nbytes for t in dense_names)
    host = f.info(C.TOKEN_EMBD).nbytes + (f.info(C.POS_EMBD).nbytes if arch == "opt" else 0)
    assert mb.host_fixed == host


@pytest.mark.parametrize("arch", ARCHS)
def test_pi_plan_plans_the_file(profiled, arch, tmp_path, monkeypatch):
    from pinfer_llm.cli.plan import app

    monkeypatch.setenv("PINFER_CACHE_DIR", str(tmp_path / "cache"))
    path, _ = profiled[arch]
    r = CliRunner().invoke(app, ["plan", str(path), "--gpu", "rtx4090", "--dry-run", "--json", "--cpu-cores", "4",
                                 "--cpu-bw", "20", "--host-ram", "64"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["model"]["arch"] == arch and out["model"]["skeleton"] is False and out["plan"]["tokens_per_s"] > 0
    assert out["plan"]["status"] in ("optimal", "baseline") and len(out["plan"]["layers"]) == 2


@pytest.mark.parametrize("arch", [*ARCHS, "falcon-7b"])
@pytest.mark.parametrize("mode", ["dense", "oracle", "sparse-pred-cpu", "sparse-pred-gpu"])
def test_hybrid_equals_cpu(tmp_path, arch, mode):
    """The GPU half on the CPU stand-in: DeviceAttention with NeoX rope and fused QKV (Falcon), biases and no rope
    (OPT), the FFN's up bias, LayerNorm on the device, Falcon 7B's one norm for both branches; any placement gives
    the CPU's logits."""
    if arch.startswith("falcon"):
        hf = H.make_falcon("7b_mqa_relu" if arch == "falcon-7b" else "40b_gqa_relu")
        meta, w = H.falcon_metadata(hf), H.falcon_tensors(hf)
    else:
        hf = H.make_opt()
        meta, w = H.opt_metadata(hf), H.opt_tensors(hf)
    h = hf.config
    n_ff = w[C.tensor(C.FFN_UP, 0)].shape[0]
    path = H.write(tmp_path / "p.gguf", meta, H.to_powerinfer(w, h.num_hidden_layers, h.hidden_size, n_ff),
                   powerinfer=True)
    pred = {"sparse-pred-cpu": False, "sparse-pred-gpu": True}.get(mode)
    mode = mode.split("-")[0]
    cpu = load_model(path, ffn_mode=mode, kv_type="f32")
    ids = [int(t) for t in np.random.default_rng(7).integers(3, H.VOCAB, 12)]
    for seed in (1, 2):
        hyb = load_model(path, ffn_mode=mode, kv_type="f32")
        hybrid.apply(hyb, random_placement(cpu.cfg, seed, pred=pred), StrictStreams())  # CUDA's copy timing
        for decode_from in (None, 4):
            want, got = logits(cpu, ids, decode_from), logits(hyb, ids, decode_from)
            assert np.abs(got - want).max() < 1e-3 * np.abs(want).max(), (seed, decode_from)
    if mode == "dense":  # and dense is HF
        assert np.abs(logits(cpu, ids) - H.hf_logits(hf, ids)).max() < 1e-4


def small_pwri(tmp_path, arch: str):
    """A small Falcon (40B layout) or OPT PowerInfer file of 128 neurons per layer, and its layer count."""
    if arch == "falcon":
        hf = H.make_falcon("40b_gqa_relu", d=64, n_ff=128)
        meta, w = H.falcon_metadata(hf), H.falcon_tensors(hf)
    else:
        hf = H.make_opt(n_ff=128)
        meta, w = H.opt_metadata(hf), H.opt_tensors(hf)
    h = hf.config
    L = h.num_hidden_layers
    return H.write(tmp_path / "p.gguf", meta, H.to_powerinfer(w, L, h.hidden_size, 128), powerinfer=True), L


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_kernels_in_the_executor(tmp_path, arch):
    """The real .cu kernels (CPU emulation): NeoX rope / no rope (n_rot 0), biases, LayerNorm, gate-less FFN rows."""
    from pinfer_llm.runtime.gpu import CudaDevice
    from tests.cuda_emu import fake_cupy

    path, _ = small_pwri(tmp_path, arch)
    ids = [5, 9, 200, 31, 7]
    want = logits(load_model(path, ffn_mode="sparse"), ids, decode_from=2)
    hyb = load_model(path, ffn_mode="sparse")
    hybrid.apply(hyb, random_placement(hyb.cfg, 2, pred=True), CudaDevice(cupy=fake_cupy))
    got = logits(hyb, ids, decode_from=2)
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("device", ["reference", "strict", "cuda-emulated"])
def test_layers_wholly_on_the_device(tmp_path, arch, device):
    """A layer on the GPU whole (attention, predictor, every neuron: what --placement layers makes), beside split
    ones: OPT's down bias is added on the device, to every token of a chunk; Falcon's parallel block keeps its
    stream there; the logits are the CPU's."""
    from pinfer_llm.runtime.gpu import CudaDevice
    from pinfer_llm.runtime.hybrid.placement import Placement
    from tests.cuda_emu import fake_cupy

    path, L = small_pwri(tmp_path, arch)
    ids = [5, 9, 200, 31, 7, 11]
    want = logits(load_model(path, ffn_mode="sparse"), ids, decode_from=3)
    hyb = load_model(path, ffn_mode="sparse")
    buckets = [np.arange(128)] + [np.arange(0, 128, 2)] * (L - 1)  # layer 0 whole, the others split
    place = Placement("test", np.ones(L, bool), np.ones(L, bool), buckets, True, "whole layer 0")
    hybrid.apply(hyb, place, {"reference": ReferenceDevice, "strict": StrictStreams}.get(
        device, lambda: CudaDevice(cupy=fake_cupy))())
    got = logits(hyb, ids, decode_from=3)
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()
