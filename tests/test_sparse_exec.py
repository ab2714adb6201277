"""Sparse FFN execution in the runtime: exact masks reproduce dense, predictors are applied per token."""

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.model_writer import write_llama
from pinfer_llm.runtime import load_model
from pinfer_llm.synth import SynthSpec, generate
from tests.tiny import random_weights, tiny_config


@pytest.fixture(scope="module", params=["relu", "drelu"])
def planted(request, tmp_path_factory):
    """A tiny planted model at 90% sparsity: unions of a few tokens stay sparse, so every sparse path runs."""
    path = tmp_path_factory.mktemp("planted") / f"{request.param}.gguf"
    generate(path, SynthSpec(n_layer=2, n_embd=64, n_ff=512, n_head=4, n_head_kv=2, vocab="bytes",
                             sparsity=0.9, variant=request.param, seed=1, calib_tokens=512, calib_seq_len=64))
    return path


def decode_logits(m, ids: list[int], prefill: int) -> np.ndarray:
    """Logits of every position, prefilling `prefill` tokens then decoding one token at a time."""
    tr = m.transformer
    with torch.inference_mode():
        out = [tr.forward(torch.tensor(ids[:prefill]), 0, all_logits=True)]
        for p in range(prefill, len(ids)):
            out.append(tr.forward(torch.tensor([ids[p]]), p))
    return torch.cat(out).numpy()


def test_oracle_masks_equal_dense(planted):
    """ReLU/dReLU with exact masks: prefill (union + per-row masks) and decode (own mask) equal dense."""
    dense = load_model(planted, ffn_mode="dense")
    oracle = load_model(planted, ffn_mode="oracle")
    ids = list(np.random.default_rng(0).integers(3, 250, 24))
    ref = dense.forward_logits(ids)
    assert np.abs(oracle.forward_logits(ids) - ref).max() < 1e-4
    for prefill in (1, 3):  # 3-token prefill: a sparse union; then single-token decode steps
        assert np.abs(decode_logits(oracle, ids, prefill) - ref).max() < 1e-4
    frac = oracle.sparsity()
    assert all(0.03 < f < 0.2 for f in frac), frac  # ~10% of neurons computed: the sparse paths really ran


def test_oracle_kernel_path_counts_like_the_masks(planted, monkeypatch):
    """Decode with --oracle-masks runs the C++ kernel over every neuron (gate rows decide); its logits and active
    counts equal the mask-then-compute path's (torch's kernels)."""
    from pinfer_llm.runtime.cpu import kernels as cpu_kernels
    from pinfer_llm.runtime.ffn import ops as S
    from pinfer_llm.runtime.ffn import sparse as ffn_sparse

    if os.environ.get("PINFER_CPU_KERNELS") == "0":
        pytest.skip("PINFER_CPU_KERNELS=0: the C++ kernels are disabled")
    assert cpu_kernels.available(), cpu_kernels.status()  # a kernel that fails to build is a failure, not a skip
    calls = []
    real = ffn_sparse.ffn_exact
    monkeypatch.setattr(ffn_sparse, "ffn_exact", lambda *a: calls.append(1) or real(*a))
    ids = list(np.random.default_rng(3).integers(3, 250, 20))
    fast = load_model(planted, ffn_mode="oracle", kv_type="f32")
    fast.transformer.use_step = False  # the forward's own kernel path (the fused step: tests/test_decode_step.py)
    got = decode_logits(fast, ids, 2)
    assert len(calls) >= len(ids) - 2  # every decode step (and the 2-token prefill) took the kernel path
    monkeypatch.setattr(S, "KERNEL_MAX_T", 0)
    slow = load_model(planted, ffn_mode="oracle", kv_type="f32")
    want = decode_logits(slow, ids, 2)
    assert np.abs(got - want).max() < 1e-4
    for a, b in zip(fast.transformer.blocks, slow.transformer.blocks, strict=True):
        assert (a.ffn.stats.tokens, a.ffn.stats.active) == (b.ffn.stats.tokens, b.ffn.stats.active)


def test_cats_oracle_equals_thresholded_dense(tmp_path):
    cfg = tiny_config(ffn_act="silu")
    w = random_weights(cfg, seed=4, scale=0.2)
    thr = [0.05, 0.08]
    write_llama(tmp_path / "m.gguf", cfg, w, extra_metadata={C.CATS_THRESHOLD: np.array(thr, np.float32)})
    oracle = load_model(tmp_path / "m.gguf", ffn_mode="oracle")
    ref = load_model(tmp_path / "m.gguf", ffn_mode="dense")
    # reference: the dense FFN with sub-threshold neurons zeroed
    for b, t in zip(ref.transformer.blocks, thr, strict=True):
        dense_ffn = b.ffn

        def masked(x, resid, ffn=dense_ffn, t=t):
            g, u = ffn.pre_activations(x)
            return ffn.down_proj(F.silu(g) * u * (F.silu(g).abs() > t))

        b.ffn = masked
    ids = list(range(10, 80, 5))
    a, r = oracle.forward_logits(ids), ref.forward_logits(ids)
    assert np.abs(a - r).max() < 1e-4
    assert np.abs(a - load_model(tmp_path / "m.gguf", ffn_mode="dense").forward_logits(ids)).max() > 1e-3


def test_predictor_masks_are_applied_per_token(tmp_path):
    """--sparse equals the dense FFN with each token's predicted mask, in prefill and in decode."""
    cfg = tiny_config(ffn_act="relu")
    w = random_weights(cfg, seed=6, scale=0.2)
    rng = np.random.default_rng(0)
    r = 8
    for i in range(cfg.n_layer):
        w[C.tensor(C.PRED_FC1, i)] = (rng.standard_normal((r, cfg.n_embd)) * 0.3).astype(np.float16)
        w[C.tensor(C.PRED_FC2, i)] = (rng.standard_normal((cfg.n_ff, r)) * 0.3).astype(np.float16)
    write_llama(tmp_path / "m.gguf", cfg, w, extra_metadata={C.SPARSE_THRESHOLD: 0.02})
    sp = load_model(tmp_path / "m.gguf")
    assert sp.ffn_mode == "sparse"
    ref = load_model(tmp_path / "m.gguf", ffn_mode="dense")
    for i, b in enumerate(ref.transformer.blocks):
        fc1 = torch.tensor(w[C.tensor(C.PRED_FC1, i)]).float()
        fc2 = torch.tensor(w[C.tensor(C.PRED_FC2, i)]).float()
        dense_ffn = b.ffn

        def masked(x, resid, ffn=dense_ffn, fc1=fc1, fc2=fc2):
            keep = (F.relu(resid @ fc1.T) @ fc2.T) >= 0.02
            return ffn.down_proj(ffn.hidden(x) * keep)

        b.ffn = masked
    ids = list(range(20, 60, 3))
    want = ref.forward_logits(ids)
    assert np.abs(sp.forward_logits(ids) - want).max() < 1e-4
    assert np.abs(decode_logits(sp, ids, 2) - want).max() < 1e-4
    assert 0.05 < np.mean(sp.sparsity()) < 0.95


def test_sparse_without_predictors_says_what_to_run(tmp_path):
    from typer.testing import CliRunner

    from pinfer_llm.cli.run import app

    cfg = tiny_config(ffn_act="relu")
    write_llama(tmp_path / "m.gguf", cfg, random_weights(cfg))
    res = CliRunner().invoke(app, [str(tmp_path / "m.gguf"), "-p", "hi", "--sparse"])
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert "pi-profile" in res.output and "--train-predictors" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_outlier_neurons_are_always_computed(tmp_path):
    """A neuron whose profiled peak is an outlier is computed for every token, whatever the predictor says."""
    cfg = tiny_config(ffn_act="relu")
    w = random_weights(cfg, seed=6, scale=0.2)
    r = 4
    for i in range(cfg.n_layer):  # predictors that select nothing: fc2 = 0 < threshold
        w[C.tensor(C.PRED_FC1, i)] = np.ones((r, cfg.n_embd), np.float16)
        w[C.tensor(C.PRED_FC2, i)] = np.zeros((cfg.n_ff, r), np.float16)
        peak = np.ones(cfg.n_ff, np.float32)
        peak[[3, 77]] = 500.0  # two "massive activation" neurons
        w[C.tensor(C.ACT_PEAK, i)] = peak
    write_llama(tmp_path / "m.gguf", cfg, w, extra_metadata={C.SPARSE_THRESHOLD: 1.0})
    m = load_model(tmp_path / "m.gguf", ffn_mode="sparse")
    assert [b.ffn.masker.always.tolist() for b in m.transformer.blocks] == [[3, 77]] * cfg.n_layer
    m.forward_logits([5, 6, 7])
    st = m.transformer.blocks[0].ffn.stats
    assert st.active == 2 * st.tokens  # exactly the two outliers, for every token


def test_stored_down_t_is_used(tmp_path):
    """pi-profile --store-down-t puts ffn_down_t beside ffn_down (in pinfer's section): sparse runs read it instead of
    transposing ffn_down at load, with the same logits, and a dense run still reads ffn_down."""
    from pinfer_llm.cli.profile import app

    cfg = tiny_config(ffn_act="relu")
    path = tmp_path / "m.gguf"
    write_llama(path, cfg, random_weights(cfg, seed=8, scale=0.2))
    before = load_model(path, ffn_mode="oracle")
    assert any("transposed in memory" in n for n in before.notices)
    ids = list(range(4, 90, 6))
    want = before.forward_logits(ids)
    from typer.testing import CliRunner

    r = CliRunner().invoke(app, [str(path), "--store-down-t", "--tokens", "200", "--ctx", "64"])
    assert r.exit_code == 0, r.output
    after = load_model(path, ffn_mode="oracle")
    assert not any("transposed in memory" in n for n in after.notices)
    assert after.file.part(C.tensor(C.FFN_DOWN_T, 0)) == "section"
    assert after.transformer.blocks[0].ffn.w.down_t.name == C.tensor(C.FFN_DOWN_T, 0)
    np.testing.assert_allclose(after.forward_logits(ids), want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert load_model(path).transformer.blocks[0].ffn.down is not None  # dense: ffn_down as before
