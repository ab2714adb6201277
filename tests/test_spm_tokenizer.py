"""SentencePiece (tokenizer.ggml.model = "llama") tokenisation against sentencepiece itself.

No LLaMA vocabulary can be downloaded here, so the test trains a small SentencePiece BPE model the way LLaMA's was
configured (identity normalisation, dummy prefix, digits split, byte fallback), exports it the way llama.cpp's
converter does (pieces, scores, token types), and compares our ids with sentencepiece's own encoder.
"""

import numpy as np
import pytest
import sentencepiece as spm  # the test extra: a missing reference is a failure, not a skip

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.tokenizer import load_tokenizer

TEXTS = [
    "Hello world",
    "Once upon a time, in a land far away",
    "  leading spaces and trailing  ",
    "numbers: 3.14159, 42, 1000000",
    "unicode: héllo naïve café — 世界 🙂",  # characters outside the training text fall back to bytes
    "def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)",
    "tabs\tand\nnewlines\n\nend",
    "The lighthouse keeper's daughter didn't know.",
]


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    from pinfer_llm.runtime.profiling.corpus import builtin_corpus

    d = tmp_path_factory.mktemp("spm")
    text = "\n".join(p.read_text(encoding="utf-8") for p in builtin_corpus())
    (d / "train.txt").write_text(text, encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(d / "train.txt"), model_prefix=str(d / "m"), vocab_size=800, model_type="bpe",
        byte_fallback=True, split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0, minloglevel=2)
    return spm.SentencePieceProcessor(model_file=str(d / "m.model"))


def gguf_metadata(sp) -> dict:
    """What llama.cpp's converter writes for a SentencePiece vocabulary."""
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(C.TOKEN_TYPE_UNKNOWN if sp.is_unknown(i) else C.TOKEN_TYPE_CONTROL if sp.is_control(i)
                     else C.TOKEN_TYPE_BYTE if sp.is_byte(i) else C.TOKEN_TYPE_UNUSED if sp.is_unused(i)
                     else C.TOKEN_TYPE_NORMAL)
    return {C.TOKENIZER_MODEL: "llama", C.TOKENIZER_TOKENS: tokens,
            C.TOKENIZER_SCORES: np.array(scores, np.float32), C.TOKENIZER_TOKEN_TYPE: np.array(types, np.int32),
            C.TOKENIZER_BOS_ID: 1, C.TOKENIZER_EOS_ID: 2, C.TOKENIZER_UNK_ID: 0, C.TOKENIZER_ADD_BOS: True}


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_sentencepiece(spm_model, text):
    tok = load_tokenizer(gguf_metadata(spm_model))
    assert tok.encode(text) == [1] + spm_model.encode(text)  # add_bos from the metadata
    assert tok.decode(tok.encode(text, add_special=False)) == text
