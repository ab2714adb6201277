"""pi-profile: activation counts, CATS thresholds, predictor training, storage, PowerInfer directories, bad input."""

import hashlib
import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from pinfer_llm import synth
from pinfer_llm.cli.profile import app
from pinfer_llm.formats import constants as C
from pinfer_llm.formats.reader import open_gguf
from pinfer_llm.runtime.engine import load_model
from pinfer_llm.runtime.ffn.predictor import Predictor, load_predictors
from pinfer_llm.runtime.profiling import activity, corpus
from pinfer_llm.runtime.profiling import store as profile_store
from pinfer_llm.runtime.profiling import training as predictor_training
from pinfer_llm.runtime.profiling.counting import profile
from tests.tiny import random_weights, tiny_config, write_tiny

runner = CliRunner()


def invoke(*args):
    res = runner.invoke(app, [str(a) for a in args])
    return res.exit_code, res.output.strip()


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_one_line_error(code, out, *needles):
    assert code == 1, out
    assert "Traceback" not in out, out
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1, out
    assert lines[0].startswith("pi-profile: error:"), out
    for n in needles:
        assert n in lines[0], out


def planted(path, **kw):
    spec = dict(n_layer=2, n_embd=64, n_ff=256, n_head=4, n_head_kv=2, vocab="bytes", sparsity=0.9, skew=1.0,
                calib_tokens=2048, seed=0)
    spec.update(kw)
    synth.generate(path, synth.SynthSpec(**spec))
    return path


@pytest.fixture(scope="module")
def relu_model(tmp_path_factory):
    return planted(tmp_path_factory.mktemp("relu") / "planted.gguf")


@pytest.fixture(scope="module")
def silu_model(tmp_path_factory):
    p = tmp_path_factory.mktemp("silu") / "swiglu.gguf"
    write_tiny(p, vocab_size=300)
    return p


def forward_record(m, ids):
    """Run the ordinary Transformer.forward and capture each FFN's (residual, gate, up): the brute-force side."""
    seen = {}
    blocks = m.transformer.blocks
    saved = [b.ffn for b in blocks]

    class Spy:
        def __init__(self, ffn, i):
            self.ffn, self.i = ffn, i

        def __call__(self, x, residual):
            gate, up = self.ffn.pre_activations(x)
            seen[self.i] = (residual.clone(), gate.clone(), up.clone())
            return self.ffn(x, residual)

    try:
        for i, b in enumerate(blocks):
            b.ffn = Spy(b.ffn, i)
        with torch.inference_mode():
            m.transformer.forward(torch.tensor(ids), 0)
    finally:
        for b, f in zip(blocks, saved, strict=True):
            b.ffn = f
    return seen


def windows_of(m, n_tokens, ctx=128):
    return corpus.corpus_windows(m.tokenizer, corpus.builtin_corpus(), ctx, n_tokens)[0]


# --- counting ---------------------------------------------------------------------------------------------------------

def test_counts_equal_brute_force(relu_model):
    m = load_model(relu_model, threads=2, ctx_size=128, ffn_mode="dense")
    windows = windows_of(m, 300, ctx=128)
    prof = profile(m, windows, activity.activation_rule(m.cfg))
    brute = np.zeros_like(prof.counts)
    peak = np.zeros_like(prof.counts)
    reference = np.zeros_like(prof.counts)
    for ids in windows:
        seen = forward_record(m, ids)
        for i, (_, gate, up) in seen.items():
            brute[i] += (gate > 0).sum(0).numpy()
            peak[i] = np.maximum(peak[i], (torch.relu(gate) * up).abs().amax(0).numpy())
        _, act = synth.reference_forward(open_gguf(relu_model), ids, collect_activity=True)
        reference += act.sum(1).numpy()
    assert prof.tokens == 300
    np.testing.assert_array_equal(prof.counts, brute)
    np.testing.assert_allclose(prof.peak, peak, rtol=1e-5)  # the largest |activation| of each neuron
    # an independent implementation of the forward pass (synth): only gates within rounding of 0 may differ
    assert np.abs(prof.counts - reference).sum() <= 1e-3 * reference.sum()
    assert 0.8 < prof.sparsity.mean() < 0.97  # the planted model is ~90% sparse


def test_cats_threshold_hits_target_sparsity(silu_model):
    m = load_model(silu_model, threads=2, ctx_size=128, ffn_mode="dense")
    windows = windows_of(m, 400)
    with pytest.raises(Exception, match="--sparsity"):
        activity.activation_rule(m.cfg)
    rule = activity.activation_rule(m.cfg, 0.4)
    prof = profile(m, windows, rule, sparsity=0.4)
    np.testing.assert_allclose(prof.sparsity, 0.4, atol=1e-5)
    brute = np.zeros_like(prof.counts)
    for ids in windows:
        for i, (_, gate, _) in forward_record(m, ids).items():
            brute[i] += (torch.nn.functional.silu(gate).abs() > rule.thresholds[i]).sum(0).numpy()
    np.testing.assert_array_equal(prof.counts, brute)


# --- storage ----------------------------------------------------------------------------------------------------------

def test_store_new_file_and_in_place(relu_model, tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(relu_model.read_bytes())
    before = digest(src)
    code, out = invoke(src, "--tokens", 400, "--ctx", 128, "-o", tmp_path / "out.gguf", "--json")
    assert code == 0, out
    summary = json.loads(out)
    assert digest(src) == before  # -o leaves the original alone
    f = open_gguf(tmp_path / "out.gguf")
    assert f.get(C.ACT_TOKENS) == 400 == summary["tokens"]
    assert f.get(C.ACT_RULE) == "relu>0" and f.get(C.ACT_DATE) and "built-in" in f.get(C.ACT_CORPUS)
    assert f.value_types[C.ACT_TOKENS][0] == 10  # u64
    counts = np.stack([np.asarray(f.raw(C.tensor(C.ACT_COUNTS, i))) for i in range(2)])
    assert counts.dtype == np.float32 and counts.shape == (2, 256)
    np.testing.assert_allclose(1 - counts.mean(1) / 400, [r["sparsity"] for r in summary["layers"]], atol=1e-6)
    # every original tensor and key survives
    g = open_gguf(src)
    assert set(g.tensors) < set(f.tensors)
    for name in g.tensors:
        assert np.array_equal(np.asarray(g.raw(name)), np.asarray(f.raw(name))), name
    # in place: same statistics, and the model still loads as the ReLU model it is
    code, out = invoke(src, "--tokens", 400, "--ctx", 128, "--json")
    assert code == 0, out
    h = open_gguf(src)
    assert np.array_equal(np.asarray(h.raw(C.tensor(C.ACT_COUNTS, 1))), counts[1])
    assert load_model(src, ctx_size=64, ffn_mode="dense").cfg.ffn_act == "relu"


def test_interrupted_rewrite_leaves_original(relu_model, tmp_path, monkeypatch):
    from pinfer_llm.formats import atomic

    src = tmp_path / "m.gguf"
    src.write_bytes(relu_model.read_bytes())
    before = digest(src)
    points = []

    def dies_midway(point):
        points.append(point)
        if point == "section-written":
            raise KeyboardInterrupt  # after the statistics' bytes, before the slot that commits them

    monkeypatch.setattr(atomic, "hook", dies_midway)
    code, out = invoke(src, "--tokens", 300, "--ctx", 128)
    assert code == 130 and "interrupted" in out
    assert "section-written" in points
    assert digest(src) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # no temporary file left behind


# --- PowerInfer directories -------------------------------------------------------------------------------------------

def activation_dir(tmp_path, per_layer):
    """A PowerInfer activation/ directory: activation_N.pt holds layer N's per-neuron counts."""
    act = tmp_path / "activation"
    act.mkdir()
    for i, counts in enumerate(per_layer):
        torch.save(counts, act / f"activation_{i}.pt")
    return act


@pytest.fixture(scope="module")
def twelve_layers(tmp_path_factory):
    p = tmp_path_factory.mktemp("deep") / "deep.gguf"
    cfg = tiny_config(n_layer=12, n_embd=32, n_ff=48, n_head=2, n_head_kv=2, ffn_act="relu")
    from pinfer_llm.formats.model_writer import write_llama

    write_llama(p, cfg, random_weights(cfg))
    return p, cfg


def test_activation_dir_import_export_numeric_order(twelve_layers, tmp_path):
    model, cfg = twelve_layers
    src = tmp_path / "m.gguf"
    src.write_bytes(model.read_bytes())
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 1000, size=(cfg.n_layer, cfg.n_ff)).astype(np.int64)
    act = activation_dir(tmp_path, [torch.from_numpy(c) for c in counts])
    # text order would read activation_10 as layer 2 (PowerInfer bug #247): make sure the order matters here
    assert sorted(p.name for p in act.iterdir())[2] == "activation_10.pt"
    code, out = invoke(src, "--import-activations", act, "--tokens", 1000, "--json")
    assert code == 0, out
    f = open_gguf(src)
    stored = np.stack([np.asarray(f.raw(C.tensor(C.ACT_COUNTS, i))) for i in range(cfg.n_layer)])
    np.testing.assert_array_equal(stored, counts)
    assert f.get(C.ACT_TOKENS) == 1000

    out_dir = tmp_path / "exported"
    code, out = invoke(src, "--export-activations", out_dir)
    assert code == 0, out
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(f"activation_{i}.pt" for i in range(cfg.n_layer))
    for i in (2, 10):
        np.testing.assert_array_equal(torch.load(out_dir / f"activation_{i}.pt").numpy(), counts[i])
    code, out = invoke(src, "--export-activations", out_dir)  # re-export over its own files
    assert code == 0, out


def test_import_activations_without_token_count(twelve_layers, tmp_path):
    model, cfg = twelve_layers
    src = tmp_path / "m.gguf"
    src.write_bytes(model.read_bytes())
    act = activation_dir(tmp_path, [torch.full((cfg.n_ff,), 7.0 + i) for i in range(cfg.n_layer)])
    code, out = invoke(src, "--import-activations", act, "--json")
    assert code == 0, out
    f = open_gguf(src)
    assert f.get(C.ACT_TOKENS) == 18 and "token count unknown" in f.get(C.ACT_CORPUS)


def test_import_activations_drops_stale_peaks(relu_model, tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(relu_model.read_bytes())
    code, out = invoke(src, "--tokens", 300, "--ctx", 128)
    assert code == 0, out
    assert open_gguf(src).has(C.tensor(C.ACT_PEAK, 0))  # a profile records each neuron's peak
    act = activation_dir(tmp_path, [torch.arange(256, dtype=torch.float32)] * 2)
    code, out = invoke(src, "--import-activations", act, "--tokens", 1000)
    assert code == 0, out
    f = open_gguf(src)
    assert not any(f.has(C.tensor(C.ACT_PEAK, i)) for i in range(2))  # they described the old statistics
    assert np.array_equal(np.asarray(f.raw(C.tensor(C.ACT_COUNTS, 1))), np.arange(256, dtype=np.float32))


def test_predictor_dir_import(twelve_layers, tmp_path):
    model, cfg = twelve_layers
    src = tmp_path / "m.gguf"
    src.write_bytes(model.read_bytes())
    pdir = tmp_path / "predictor"
    pdir.mkdir()
    rng = np.random.default_rng(1)
    ranks = [8 + 2 * i for i in range(cfg.n_layer)]
    weights = []
    for i, r in enumerate(ranks):
        fc1 = torch.from_numpy(rng.standard_normal((r, cfg.n_embd)).astype(np.float32))
        fc2 = torch.from_numpy(rng.standard_normal((cfg.n_ff, r)).astype(np.float32))
        torch.save({"fc1.weight": fc1, "fc2.weight": fc2}, pdir / f"model_{i}.pt")
        weights.append((fc1, fc2))
    (pdir / "config.json").write_text(json.dumps({"sparse_threshold": 0.25}))
    code, out = invoke(src, "--import-predictors", pdir, "--json")
    assert code == 0, out
    f = open_gguf(src)
    assert abs(f.get(C.SPARSE_THRESHOLD) - 0.25) < 1e-7
    assert f.info(C.tensor(C.PRED_FC1, 10)).type_name == "F16"
    preds = load_predictors(f, cfg.n_layer, fc2_t=True)
    for p, (fc1, fc2), r in zip(preds, weights, ranks, strict=True):
        assert p.hidden == r and p.threshold == pytest.approx(0.25)
        torch.testing.assert_close(p.fc1, fc1.half())  # stored F16 and read as stored
        torch.testing.assert_close(p.fc2, fc2.half())
        assert p.fc2_t is None and torch.equal(p.fc2_t_source(), p.fc2.t())  # the decoding copy, made on first use


# --- predictors -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_quantised_predictors_are_read_in_place(tmp_path, qtype):
    """A PowerInfer file whose predictors PowerInfer's `quantize` made Q4_0 (or Q4_1, Q8_0): they stay in that
    encoding (no float copy, none transposed), and their scores and decode indices equal the float predictor's with
    the same (dequantised) weights, up to the kernels' 8-bit activation blocks."""
    from gguf import quants
    from gguf.constants import GGMLQuantizationType as T

    from pinfer_llm.formats.encoder import RawTensor
    from pinfer_llm.runtime.weights import QWeight
    from tests.tiny import to_powerinfer_layout

    cfg = tiny_config(ffn_act="relu", n_ff=192)
    w = to_powerinfer_layout(cfg, random_weights(cfg, seed=5, scale=0.15), rank=32)
    qt = T[qtype]
    for i in range(cfg.n_layer):
        for name in (C.tensor(C.PRED_FC1, i), C.tensor(C.PRED_FC2, i)):
            a = w[name].astype(np.float32)
            w[name] = RawTensor(quants.quantize(a, qt), int(qt), a.shape)
    path = tmp_path / "q.gguf"
    from pinfer_llm.formats.model_writer import write_llama
    write_llama(path, cfg, w, powerinfer=True)
    preds = load_predictors(open_gguf(path), cfg.n_layer, fc2_t=True)
    g = torch.Generator().manual_seed(0)
    for p in preds:
        assert isinstance(p.fc1, QWeight) and isinstance(p.fc2, QWeight) and p.fc2_t_source is None
        ref = Predictor(p.fc1.dequantize(), p.fc2.dequantize(), threshold=0.0)
        x = torch.randn(6, cfg.n_embd, generator=g)
        got, want = p.scores(x), ref.scores(x)
        tol = 2e-2 * want.abs().max()
        assert (got - want).abs().max() <= tol, qtype
        for t in range(6):
            idx = p.fused_indices(x[t:t + 1])
            mask = torch.zeros(cfg.n_ff, dtype=torch.bool)
            mask[idx] = True
            far = (want[t] - p.threshold).abs() > tol
            assert torch.equal(mask[far], (want[t] >= p.threshold)[far])
        assert p._f32 is None and p.fc2_t is None  # nothing was converted
    m = load_model(path, ffn_mode="sparse")  # and the model decodes with them
    assert len(list(m.generate([5, 6, 7], max_tokens=4, temperature=0.0))) == 4



def test_trained_predictors_reach_recall(relu_model, tmp_path):
    out = tmp_path / "pred.gguf"
    code, text = invoke(relu_model, "--train-predictors", "--tokens", 3000, "--ctx", 256, "--max-fraction", 0.25,
                        "-o", out, "--json")
    assert code == 0, text
    summary = json.loads(text)
    for row in summary["layers"]:
        assert row["recall"] >= 0.95, row
        # better than "everything is active": a real predictor, not a threshold at -inf
        assert row["predicted_density"] < 0.6 and row["precision"] > 2 * (1 - row["sparsity"]), row
        assert row["bytes_pct"] <= 25.0
    # the stored file, read by the runtime's loader, on text it never saw (the held-out corpus)
    f = open_gguf(out)
    assert f.get(C.PRED_SOURCE) == "pi-profile" and len(f.get(C.PRED_RECALL)) == 2
    preds = load_predictors(f, 2)
    m = load_model(out, ctx_size=256, ffn_mode="dense")
    ids = m.tokenizer.encode(corpus.HELDOUT.read_text())[:1024]
    hit = total = 0
    for s in range(0, len(ids), 256):
        for i, (resid, gate, _) in forward_record(m, ids[s:s + 256]).items():
            truth = gate > 0
            hit += int((preds[i].mask(resid) & truth).sum())
            total += int(truth.sum())
    assert hit / total >= 0.93, hit / total


@pytest.mark.parametrize("variant", ["relu", "drelu", "opt"])
def test_samples_keep_the_margin_that_decides_the_mask(tmp_path, variant):
    """The stored pre-activation (gate for ReGLU, up + bias for OPT) is > 0 where the neuron is active, < 0 where
    not, and 0 only where int8 rounding (one scale per token) reaches it: not its negation, nor a constant."""
    path = planted(tmp_path / f"{variant}.gguf", n_layer=1, variant=variant)
    m = load_model(path, ctx_size=256, ffn_mode="dense")
    prof = profile(m, windows_of(m, 1500, ctx=256), activity.activation_rule(m.cfg), sample_tokens=1500)
    s = prof.samples[0]
    for k in range(3):
        mg, mask = s.margins(k), s.part(k)[1]
        assert bool((mg[mask] >= 0).all()) and bool((mg[~mask] <= 0).all())
        assert float((mg[mask] > 0).float().mean()) > 0.9 and float((mg[~mask] < 0).float().mean()) > 0.9
    # a SwiGLU model's CATS rule has no linear margin: none is kept
    write_tiny(tmp_path / "silu.gguf", vocab_size=300)
    m = load_model(tmp_path / "silu.gguf", ctx_size=128, ffn_mode="dense")
    prof = profile(m, windows_of(m, 300), activity.activation_rule(m.cfg, sparsity=0.5), sample_tokens=300,
                   sparsity=0.5)
    assert prof.samples[0].margins(0) is None


def test_margin_regression_beats_mask_regression():
    """Inputs in clusters with their own means (OPT's learned positions do this) and neurons with their own
    thresholds: least squares on the 0/1 mask ranks tokens badly and puts neurons on different scales, the margin
    (the pre-activation minus the threshold) does neither. Regression only (steps=0), the same ladder."""
    from pinfer_llm.runtime.profiling.counting import Samples, split_labels

    g = torch.Generator().manual_seed(0)
    N, d, n_ff, r, P = 6000, 64, 256, 8, 64
    basis = torch.linalg.qr(torch.randn(d, r, generator=g))[0]
    W = (torch.randn(n_ff, r, generator=g) @ basis.T) * 0.99 + 0.05 * torch.randn(n_ff, d, generator=g) / d ** 0.5
    centers = 0.8 * torch.randn(P, d, generator=g)
    x = torch.randn(N, d, generator=g) + centers[torch.arange(N) % P]
    x = torch.cat([x, torch.full((N, 1), 2.0)], 1)  # a constant input, as residual streams have
    pre = x[:, :d] @ W.T
    margin = pre - torch.quantile(pre, 0.95, dim=0)  # each neuron active on 5% of tokens
    mask = margin > 0
    mq, sc = Samples.int8_rows(margin)
    bits, split = np.packbits(mask.numpy(), axis=1), split_labels(N, 0)
    got = {}
    for name, s in (("mask", Samples(x.numpy(), bits, n_ff, split)),
                    ("margin", Samples(x.numpy(), bits, n_ff, split, mq, sc))):
        p = predictor_training.train_layer(s, ffn_bytes=50 * n_ff * d, recall=0.95, ladder=(8, 16, 32, 64),
                                           max_fraction=1.0, steps=0)
        assert p.recall >= 0.94, (name, p.recall)
        got[name] = p.precision
    assert got["margin"] > 0.9 and got["margin"] > got["mask"] + 0.2, got


def test_margin_fits_keep_thresholds_negative(relu_model, monkeypatch):
    """A layer predicted perfectly puts its recall threshold at or above the margin fit's boundary 0, while the
    others land below it: one threshold could then not serve every layer (PowerInfer reads one). Seen on planted
    Falcon's first layer; simulated here by a calibration that answers +0.5."""
    m = load_model(relu_model, ctx_size=256, ffn_mode="dense")
    prof = profile(m, windows_of(m, 1500, ctx=256), activity.activation_rule(m.cfg), sample_tokens=1500)
    monkeypatch.setattr(predictor_training, "threshold_for_recall", lambda *a: 0.5)
    p = predictor_training.train_layer(prof.samples[0], 1e6, ladder=(8, 16), max_fraction=1.0, steps=0)
    assert p.threshold == predictor_training.MARGIN_THRESHOLD_CAP < 0


def test_rrr_eigensolver_fallback_gives_the_same_fit(monkeypatch):
    """When LAPACK's eigensolver gives up (seen on a planted Falcon's first layer, whose inputs are a few token
    embeddings), the SVD fallback must produce the same rank-k scores."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, 24, generator=g)
    y = x @ torch.randn(24, 40, generator=g) + 0.1 * torch.randn(500, 40, generator=g)
    want = predictor_training._ridge_rrr(x, y, 6)

    def refuse(*a, **k):
        raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "eigh", refuse)
    got = predictor_training._ridge_rrr(x, y, 6)
    for (r0, A0, V0), (r1, A1, V1) in zip(want, got, strict=True):
        assert r0 == r1
        for k in (1, 3, 6):
            torch.testing.assert_close(x @ A1[:, :k] @ V1[:, :k].T, x @ A0[:, :k] @ V0[:, :k].T, rtol=1e-4, atol=1e-4)


def test_ladder_picks_smaller_predictor_for_sparser_layer(tmp_path):
    hidden = {}
    for name, sparsity, skew in (("sparse", 0.97, 1.5), ("dense", 0.6, 0.2)):
        # isotropic gate rows: how predictable a layer is then depends on its sparsity and skew alone
        path = planted(tmp_path / f"{name}.gguf", n_layer=1, sparsity=sparsity, skew=skew, gate_rank=0)
        m = load_model(path, ctx_size=256, ffn_mode="dense")
        prof = profile(m, windows_of(m, 3000, ctx=256), activity.activation_rule(m.cfg), sample_tokens=3000)
        ffn_bytes = predictor_training.ffn_bytes_per_layer(m.file, m.cfg)[0]
        p = predictor_training.train_layer(prof.samples[0], ffn_bytes, ladder=(8, 16, 32, 64, 128), max_fraction=1.0,
                                           steps=0)
        hidden[name] = p.hidden
        assert p.recall >= 0.94
    assert hidden["sparse"] < hidden["dense"], hidden


def test_fold_thresholds_keeps_decisions():
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(0)
    preds = [Predictor(torch.randn(8, 16, generator=g).half(), torch.randn(32, 8, generator=g).half(), t)
             for t in (0.5, 2.0, 1.0)]
    x = torch.from_numpy(rng.standard_normal((200, 16)).astype(np.float32))
    before = [p.scores(x) >= p.threshold for p in preds]
    T = predictor_training.fold_thresholds(preds)
    assert T == 1.0 and all(p.threshold == 1.0 for p in preds)
    for p, b in zip(preds, before, strict=True):
        assert (p.scores(x) >= T).eq(b).float().mean() > 0.995  # float16 rounding of the rescaled fc2 only
    mixed = [Predictor(preds[0].fc1, preds[0].fc2, t) for t in (-1.0, 1.0)]
    assert predictor_training.fold_thresholds(mixed) is None and [p.threshold for p in mixed] == [-1.0, 1.0]


def test_per_layer_thresholds_when_signs_differ(relu_model, tmp_path):
    from pinfer_llm.formats.update import rewrite_gguf

    g = torch.Generator().manual_seed(0)
    preds = [Predictor(torch.randn(8, 64, generator=g).half(), torch.randn(256, 8, generator=g).half(), t)
             for t in (-0.5, 0.25)]
    assert predictor_training.fold_thresholds(preds) is None
    meta, tensors, drop = profile_store.predictor_entries(preds, None, "relu", "pi-profile")
    out = tmp_path / "m.gguf"
    rewrite_gguf(open_gguf(relu_model), out, set_metadata=meta, set_tensors=tensors, drop_keys=drop, progress=False)
    loaded = load_predictors(open_gguf(out), 2)
    assert [p.threshold for p in loaded] == [-0.5, 0.25]


# --- bad input --------------------------------------------------------------------------------------------------------

def test_no_ffn_we_understand(tmp_path):
    from pinfer_llm.formats.model_writer import write_llama

    cfg = tiny_config()
    w = random_weights(cfg)
    for i in range(cfg.n_layer):
        del w[C.tensor(C.FFN_GATE, i)]  # an up/down-only FFN (Falcon/OPT style)
    p = tmp_path / "m.gguf"
    write_llama(p, cfg, w)
    before = digest(p)
    assert_one_line_error(*invoke(p), "blk.0.ffn_gate.weight", "gate, up and down")
    assert digest(p) == before


def test_swiglu_needs_sparsity(silu_model, tmp_path):
    before = digest(silu_model)
    assert_one_line_error(*invoke(silu_model), "SwiGLU", "--sparsity")
    assert digest(silu_model) == before


def test_too_few_tokens_for_predictors(relu_model):
    before = digest(relu_model)
    assert_one_line_error(*invoke(relu_model, "--train-predictors", "--tokens", 200), "at least 1000",
                          "200 tokens")
    assert digest(relu_model) == before


def test_training_pairs_larger_than_memory_are_refused_before_running(relu_model, monkeypatch):
    from pinfer_llm.runtime.profiling import counting as profile_mod

    before = digest(relu_model)
    # 2 layers x 3000 tokens x (64 floats + 32 mask bytes + 256 margins + a scale) = 3.1 MiB of pairs
    monkeypatch.setattr(profile_mod, "available_ram_bytes", lambda: 4 << 20)
    code, out = invoke(relu_model, "--train-predictors", "--tokens", 3000, "--sample-tokens", 3000)
    assert_one_line_error(code, out, "takes 3.1 MiB", "of the 4.0 MiB available", "pass --sample-tokens")
    fits = int(out.split("--sample-tokens ")[1].split()[0])
    assert 1000 <= fits < 3000 and profile_mod.sample_bytes(2, 64, 256, fits, True) <= 0.7 * (4 << 20)
    monkeypatch.setattr(profile_mod, "available_ram_bytes", lambda: 1 << 20)
    assert_one_line_error(*invoke(relu_model, "--train-predictors", "--tokens", 3000), "at least 1000",
                          "larger machine")
    assert digest(relu_model) == before


@pytest.mark.parametrize("case", ["layers", "neurons"])
def test_import_wrong_activation_dir(relu_model, tmp_path, case):
    n_files, n_ff = (3, 256) if case == "layers" else (2, 100)
    act = activation_dir(tmp_path, [torch.ones(n_ff)] * n_files)
    before = digest(relu_model)
    needle = "expected activation_N.pt files 0..1" if case == "layers" else "256 neurons per layer"
    assert_one_line_error(*invoke(relu_model, "--import-activations", act, "--tokens", 10), needle)
    assert digest(relu_model) == before


def test_import_wrong_predictor_dir(relu_model, tmp_path):
    pdir = tmp_path / "pred"
    pdir.mkdir()
    for i in range(2):
        torch.save({"fc1.weight": torch.zeros(8, 64), "fc2.weight": torch.zeros(100, 8)}, pdir / f"model_{i}.pt")
    before = digest(relu_model)
    assert_one_line_error(*invoke(relu_model, "--import-predictors", pdir), "fc2 [256, r]")
    assert digest(relu_model) == before


def test_cli_ladder_is_the_trainers():
    """pi-profile's --ladder default (spelled out there so --help needs no torch) is the trainer's, all sizes
    multiples of 32 (PowerInfer's quantize needs whole blocks of 32 in fc2's rows)."""
    from pinfer_llm.cli import profile as profile_cli

    assert profile_cli.DEFAULT_LADDER == predictor_training.DEFAULT_LADDER
    assert all(h % 32 == 0 for h in predictor_training.DEFAULT_LADDER)
