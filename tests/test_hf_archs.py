"""Falcon and OPT against HF transformers on the same fp32 weights: logits of a prefill and of token-by-token decode,
through pinfer's C++ kernels and through torch's operators (the fallback), from llama.cpp-style GGUF files and from
PowerInfer's PWRI layout; the byte-level BPE tokenizer of such files against HF's."""

import json

import numpy as np
import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.errors import PinferError
from pinfer_llm.formats.model_writer import byte_vocab
from pinfer_llm.runtime import load_model
from tests import hf_archs as H

TOL = 1e-4


def check_against_hf(m, hf, n: int = 40, seed: int = 1):
    ids = [int(i) for i in np.random.default_rng(seed).integers(0, H.VOCAB, n)]
    ref = H.hf_logits(hf, ids)
    ours = m.forward_logits(ids)
    assert ours.shape == ref.shape == (n, H.VOCAB)
    assert np.abs(ref).max() > 0.5  # not two near-zero tensors
    assert np.abs(ours - ref).max() < TOL, np.abs(ours - ref).max()
    tr = m.transformer
    tr.cache = type(tr.cache)(m.cfg, tr.max_ctx)  # a fresh cache for the decode pass
    with torch.inference_mode():
        steps = torch.cat([tr.forward(torch.tensor([t]), p) for p, t in enumerate(ids)]).numpy()
    assert np.abs(steps - ref).max() < TOL, np.abs(steps - ref).max()


@pytest.mark.parametrize("case", H.FALCON_CASES)
def test_falcon_matches_transformers(tmp_path, case, kernels):
    hf = H.make_falcon(case)
    path = H.write(tmp_path / "f.gguf", H.falcon_metadata(hf), H.falcon_tensors(hf))
    m = load_model(path, threads=2, kv_type="f32")
    c = H.FALCON_CASES[case]
    assert m.cfg.arch == "falcon" and m.cfg.ffn_act == c["act"] and m.cfg.n_head_kv == H.falcon_kv_heads(hf.config)
    assert m.cfg.tied_embeddings == c["tied"] and m.transformer.fused == (kernels == "kernels")
    b = m.transformer.blocks[0]
    assert (b.attn_norm is b.ffn_norm) == (not c["new_arch"])  # 40B layout: two norms
    check_against_hf(m, hf)


def test_opt_matches_transformers(tmp_path, kernels):
    hf = H.make_opt()
    path = H.write(tmp_path / "o.gguf", H.opt_metadata(hf), H.opt_tensors(hf))
    m = load_model(path, threads=2, kv_type="f32")
    assert m.cfg.arch == "opt" and m.cfg.ffn_act == "relu" and m.cfg.tied_embeddings
    assert m.cfg.n_ctx_train == hf.config.max_position_embeddings
    check_against_hf(m, hf)


@pytest.mark.parametrize("arch", ["falcon", "opt"])
@pytest.mark.parametrize("mode", ["dense", "oracle"])
def test_powerinfer_files_match_transformers(tmp_path, arch, mode, kernels):
    """PowerInfer's layout (PWRI magic, ffn_down_t and for OPT its renamed bias, fc1/fc2, OPT without head_count_kv or
    epsilon, its lm_head written as output): dense, and exact ReLU masks (which equal dense)."""
    if arch == "falcon":
        hf = H.make_falcon("40b_gqa_relu")
        meta, w = H.falcon_metadata(hf), H.falcon_tensors(hf)
    else:
        hf = H.make_opt()
        meta, w = H.opt_metadata(hf, powerinfer_keys=True), H.opt_tensors(hf, output=True)
    h = hf.config
    w = H.to_powerinfer(w, h.num_hidden_layers, h.hidden_size, w[C.tensor(C.FFN_UP, 0)].shape[0])
    if arch == "opt":
        assert C.tensor(C.FFN_DOWN_T_B, 0) in w
    path = H.write(tmp_path / "p.gguf", meta, w, powerinfer=True)
    m = load_model(path, threads=2, ffn_mode=mode, kv_type="f32")
    assert m.file.is_powerinfer and m.cfg.down_transposed and m.cfg.has_predictors and m.cfg.ffn_act == "relu"
    check_against_hf(m, hf)


def test_powerinfer_sparse_mode_runs_the_predictors(tmp_path, kernels):
    hf = H.make_opt()
    h = hf.config
    w = H.to_powerinfer(H.opt_tensors(hf), h.num_hidden_layers, h.hidden_size, h.ffn_dim)
    m = load_model(H.write(tmp_path / "p.gguf", H.opt_metadata(hf, True), w, powerinfer=True), threads=2, kv_type="f32")
    assert m.ffn_mode == "sparse"
    out = list(m.generate([1, 2, 3], max_tokens=4, temperature=0.0))
    assert len(out) == 4 and 0 < min(m.sparsity()) and max(m.sparsity()) < 1


def test_opt_positions_bound_the_context(tmp_path):
    hf = H.make_opt(max_pos=32)
    path = H.write(tmp_path / "o.gguf", H.opt_metadata(hf), H.opt_tensors(hf))
    assert load_model(path, threads=2).ctx_size == 32
    with pytest.raises(PinferError, match="learned positions for 32 tokens"):
        load_model(path, threads=2, ctx_size=64)


def test_opt_350m_projection_is_refused(tmp_path):
    hf = H.make_opt()
    w = H.opt_tensors(hf)
    w[C.TOKEN_EMBD] = np.zeros((H.VOCAB, 32), np.float32)  # word_embed_proj_dim 32 != hidden_size 64
    with pytest.raises(PinferError, match="word_embed_proj_dim"):
        load_model(H.write(tmp_path / "o.gguf", H.opt_metadata(hf), w), threads=2)


def test_gelu_falcon_has_no_exact_masks(tmp_path):
    hf = H.make_falcon("7b_mqa_gelu")
    path = H.write(tmp_path / "f.gguf", H.falcon_metadata(hf), H.falcon_tensors(hf))
    with pytest.raises(PinferError, match="GELU, which is never exactly zero"):
        load_model(path, threads=2, ffn_mode="oracle")


# --- tokenizer ------------------------------------------------------------------------------------------------------

CORPUS = ["Hello world! The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x ** 2  # square",
          "Numbers: 12345 and 3.14159, dates 2024-01-31.", "Ünïcödé text — with dashes… and emoji 🙂🚀",
          "  leading spaces\tand tabs\n\nnewlines", "don't can't won't it's we're they've I'm you'll he'd"] * 20
TRICKY = ["Hello world", " leading space", "trailing space ", "multiple   spaces\there", "line\nbreaks\r\n\n",
          "don't STOP it's", "12345678 1.5e-3 $100", "Ünïcödé 🙂 日本語 ñ", "a+b=c; <tag> ~x^y | `code`",
          "", " ", "\n\n\n", "x" * 50, "éé éé",
          "2024 1999 123456789 31415926"]  # Falcon's digit groups of three: a GPT-2 split merges across them


def train_bpe(pre) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def gguf_vocab(tok: Tokenizer, pre: str) -> dict:
    """tokenizer.ggml.* as a converter writes them from an HF tokenizer: tokens by id, merges, 'gpt2'."""
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [C.TOKEN_TYPE_CONTROL if t == "</s>" else C.TOKEN_TYPE_NORMAL for t in tokens]
    meta = byte_vocab(259)  # only for the key names' sake: every value is replaced
    meta.update({C.TOKENIZER_MODEL: "gpt2", C.TOKENIZER_PRE: pre, C.TOKENIZER_TOKENS: tokens,
                 C.TOKENIZER_TOKEN_TYPE: np.array(types, np.int32), C.TOKENIZER_MERGES: merges,
                 C.TOKENIZER_BOS_ID: vocab["</s>"], C.TOKENIZER_EOS_ID: vocab["</s>"]})
    return meta


PRE_TOKENIZERS = {
    # OPT and GPT-2: byte-level with GPT-2's regex
    "gpt-2": pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    # Falcon's tokenizer.json: punctuation runs, byte-level, digit runs, then threes of digits (llama.cpp "falcon")
    "falcon": pre_tokenizers.Sequence([
        pre_tokenizers.Punctuation(), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        pre_tokenizers.Digits(individual_digits=False),
        pre_tokenizers.Split(Regex(r"[0-9][0-9][0-9]"), behavior="isolated")]),
}


@pytest.mark.parametrize("pre", PRE_TOKENIZERS)
def test_byte_level_bpe_matches_hf(tmp_path, pre):
    tok = train_bpe(PRE_TOKENIZERS[pre])
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok)
    hf = H.make_opt()
    meta = gguf_vocab(tok, pre)
    n_vocab = len(meta[C.TOKENIZER_TOKENS])
    assert n_vocab > 300  # merges were learned
    w = H.opt_tensors(hf)
    w[C.TOKEN_EMBD] = np.resize(w[C.TOKEN_EMBD], (n_vocab, hf.config.hidden_size))
    m = load_model(H.write(tmp_path / "t.gguf", H.opt_metadata(hf), w, tokenizer=meta), threads=2, kv_type="f32")
    for text in TRICKY:
        want = hf_tok.encode(text, add_special_tokens=False)
        assert m.tokenizer.encode(text, add_special=False) == want, text
        assert m.tokenizer.decode(want) == text
