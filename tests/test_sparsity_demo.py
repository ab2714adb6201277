"""benchmarks/sparsity_demo.py, the planted-model part of `make demo`: its numbers are measurements, not constants."""

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.config import config_from_gguf
from pinfer_llm.formats.reader import open_gguf
from pinfer_llm.runtime import load_model

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "sparsity_demo.py"
TINY = dict(n_layer=2, n_embd=64, n_ff=256, n_head=4, n_head_kv=2)


def load_script():
    spec = importlib.util.spec_from_file_location("sparsity_demo", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


demo = load_script()


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A tiny planted model with predictors, made the way the demo makes its own (synth, then the real pi-profile)."""
    path = tmp_path_factory.mktemp("demo") / "planted.gguf"
    took = demo.ensure_model(path, TINY, threads=2, say=lambda m: None)
    assert set(took) == {"synth_s", "profile_s"}
    return path


@pytest.fixture(scope="module")
def result(planted):
    return demo.compare(planted, tokens=24, rounds=2, threads=2)


def test_ensure_model_makes_once_and_remakes_a_broken_file(planted, tmp_path):
    assert config_from_gguf(open_gguf(planted)).has_predictors
    assert demo.ensure_model(planted, TINY, threads=2, say=lambda m: None) == {}  # present and valid: nothing to do
    other = dict(TINY, n_ff=128)
    assert not demo.is_valid(planted, other, 0.9) and not demo.is_valid(planted, TINY, 0.8)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(planted.read_bytes()[:5000])  # a truncated copy: opens no more
    assert not demo.is_valid(broken, TINY, 0.9)
    # make=False (a --model of the user's) never replaces the file, it only adds predictors
    bare = tmp_path / "bare.gguf"
    from pinfer_llm.synth import SynthSpec, generate

    generate(bare, SynthSpec(**dict(TINY, n_layer=1), vocab="bytes"))
    took = demo.ensure_model(bare, TINY, threads=2, say=lambda m: None, make=False)
    assert set(took) == {"profile_s"} and config_from_gguf(open_gguf(bare)).n_layer == 1
    assert config_from_gguf(open_gguf(bare)).has_predictors


def test_random_corpus_reaches_the_byte_vocabulary(planted):
    tok = load_model(planted, ffn_mode="dense").tokenizer
    ids = tok.encode(demo.random_text(demo.CORPUS_CHARS))
    assert len(ids) >= 8000  # pi-profile's 8192 training samples per layer, about
    assert len(set(ids)) >= 240  # every byte value UTF-8 can hold (256 less C0, C1, F5..FF)


def test_numbers_are_measured(planted, result):
    dense, sparse = result["rows"]
    assert (dense["mode"], sparse["mode"]) == ("dense", "sparse")
    # dense computes every neuron and is its own reference
    assert dense["neurons_computed"] == 1.0 and dense["speedup"] == 1.0 and dense["top1_agreement"] == 1.0
    # the planted model is 90% sparse: ~10% of neurons fire, the predictors pick those and some more, far from all
    assert 0.05 < result["neurons_firing"] < 0.15
    assert 0.9 * result["neurons_firing"] <= sparse["neurons_computed"] < 0.5
    # agreement is a share of positions, and trained predictors get most of them right
    assert 0.5 <= sparse["top1_agreement"] <= 1.0
    assert sparse["top1_agreement"] * result["tokens"] == pytest.approx(round(sparse["top1_agreement"]
                                                                               * result["tokens"]), abs=0.01)
    # the dense model's greedy tokens, teacher-forced through the sparse one, here with the library directly
    d, sp = load_model(planted, ffn_mode="dense"), load_model(planted, ffn_mode="sparse")
    prompt = d.tokenizer.encode(result["prompt"])
    cont = list(d.generate(prompt, max_tokens=result["tokens"], temperature=0.0, stop_ids=set()))
    logits = sp.forward_logits(prompt + cont[:-1])
    hits = sum(int(logits[len(prompt) - 1 + k].argmax() == t) for k, t in enumerate(cont))
    assert sparse["top1_agreement"] == pytest.approx(hits / len(cont), abs=1e-4)
    # speeds: positive, one per round, and the speed-up is the median of the per-round ratios
    for r in (dense, sparse):
        assert len(r["decode_tokens_per_s_rounds"]) == result["rounds"]
        assert all(t > 0 for t in r["decode_tokens_per_s_rounds"])
    ratios = [s / d for s, d in zip(sparse["decode_tokens_per_s_rounds"], dense["decode_tokens_per_s_rounds"],
                                    strict=True)]
    assert sparse["speedup"] == pytest.approx(statistics.median(ratios), rel=0.01)
    # bytes: from the file's own tensor sizes, computed here independently
    f = open_gguf(planted)
    size = lambda t: sum(f.info(C.tensor(t, i)).nbytes for i in range(TINY["n_layer"]))  # noqa: E731
    gate, up_down, preds = size(C.FFN_GATE), size(C.FFN_UP) + size(C.FFN_DOWN_T), size(C.PRED_FC1) + size(C.PRED_FC2)
    fires = result["neurons_firing"]
    assert dense["ffn_bytes_per_token"] == pytest.approx(gate + fires * up_down, abs=1 + 5e-5 * up_down)
    # the shares are printed to 4 decimals: each may be off by 5e-5 of what it multiplies
    assert sparse["ffn_bytes_per_token"] == pytest.approx(preds + sparse["neurons_computed"] * gate
                                                          + fires * up_down, abs=1 + 5e-5 * (gate + up_down))
    assert sparse["ffn_bytes_per_token"] < dense["ffn_bytes_per_token"] < gate + up_down
    assert result["bytes_ratio"] == pytest.approx(dense["ffn_bytes_per_token"] / sparse["ffn_bytes_per_token"],
                                                  rel=1e-3)


def test_dense_against_itself_agrees_everywhere(planted):
    res = demo.compare(planted, tokens=16, rounds=1, threads=2, mode="dense")
    a, b = res["rows"]
    assert b["top1_agreement"] == 1.0 and b["neurons_computed"] == 1.0 and b["first_divergence"] is None
    assert a["ffn_bytes_per_token"] == b["ffn_bytes_per_token"]


def test_exact_masks_agree_with_dense(planted):
    """ffn_mode "oracle" computes only the neurons that fire, exactly: agreement 1, share = the firing share."""
    res = demo.compare(planted, tokens=16, rounds=1, threads=2, mode="oracle")
    exact = res["rows"][1]
    assert exact["top1_agreement"] == 1.0
    assert exact["neurons_computed"] < 0.2


def test_agreement_scores_each_position_against_its_own_token(planted):
    m = load_model(planted, ffn_mode="dense")
    prompt = m.tokenizer.encode(demo.PROMPT)
    cont = list(m.generate(prompt, max_tokens=20, temperature=0.0, stop_ids=set()))
    assert demo.top1_agreement(m, prompt, cont) == 1.0
    # the last token is never fed back, so changing it changes exactly one of the 20 positions
    wrong = cont[:-1] + [(cont[-1] + 1) % m.cfg.vocab_size]
    assert demo.top1_agreement(m, prompt, wrong) == pytest.approx(19 / 20)
    # a continuation that is not the model's: next to no position agrees
    shifted = [(t + 7) % m.cfg.vocab_size for t in cont]
    assert demo.top1_agreement(m, prompt, shifted) < 0.3


def test_script_json(planted):
    out = subprocess.run([sys.executable, str(SCRIPT), "--model", str(planted), "-n", "8", "--rounds", "1",
                          "-t", "1", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["setup_s"] == {} and res["tokens"] == 8 and res["threads"] == 1
    assert [r["mode"] for r in res["rows"]] == ["dense", "sparse"]


def test_script_table(planted):
    out = subprocess.run([sys.executable, str(SCRIPT), "--model", str(planted), "-n", "8", "--rounds", "1",
                          "-t", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for row in ("--dense", "--sparse"):
        assert any(ln.strip().startswith(row) for ln in lines), out.stdout
    assert "(reference)" in out.stdout and "fewer FFN bytes" in out.stdout


def test_the_all_rows_row_is_a_dense_engine_on_the_same_weights(planted, tmp_path):
    """The third row: the model in llama.cpp's layout, decoded dense, reads every FFN row and gives the same tokens."""
    twin = tmp_path / "twin.gguf"
    demo.ensure_twin(planted, twin, say=lambda m: None)
    f = open_gguf(twin)
    assert f.has(C.tensor(C.FFN_DOWN, 0)) and not f.has(C.tensor(C.FFN_DOWN_T, 0))
    assert not config_from_gguf(f).has_predictors
    res = demo.compare(planted, tokens=12, rounds=1, threads=2, twin=twin)
    every, dense, sparse = res["rows"][2], res["rows"][0], res["rows"][1]
    b = res["ffn_bytes"]
    assert every["ffn_bytes_per_token"] == b["gate"] + b["up_down"] > dense["ffn_bytes_per_token"]
    assert every["neurons_computed"] == 1.0
    assert every["sparse_speedup_over_it"] == pytest.approx(sparse["decode_tokens_per_s"]
                                                            / every["decode_tokens_per_s"], rel=1e-2)
