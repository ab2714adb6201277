"""TextStream: the streamed deltas of a token list join to its whole decode, each push decoding a short window (not
every token so far), for both tokenizer kinds: SentencePiece (a leading space stripped, byte fallback) and byte-level
BPE (SmolLM2: characters split over tokens)."""

import pytest
from test_smollm2 import GOLDEN_IDS
from test_spm_tokenizer import TEXTS, gguf_metadata, spm_model  # noqa: F401 - spm_model is a fixture used here

from pinfer_llm.formats.reader import open_gguf
from pinfer_llm.formats.tokenizer import load_tokenizer
from pinfer_llm.runtime.generation.stream import TextStream

LONG = "Once upon a time, in a land far away — “quoted” 世界 🙂 and then, café naïve. " * 40


class Counting:
    """A tokenizer that records how many ids each decode was given."""

    def __init__(self, tok):
        self.tok, self.widths = tok, []

    def decode(self, ids, skip_special=False):
        self.widths.append(len(ids))
        return self.tok.decode(ids, skip_special=skip_special)


def check(tok, text):
    ids = tok.encode(text, add_special=False)
    whole = tok.decode(ids, skip_special=True)
    counting = Counting(tok)
    s = TextStream(counting)
    sent = ""
    for t in ids:
        sent += s.push(t)
        assert whole.startswith(sent)  # nothing streamed is ever taken back
    assert sent + s.text[s.sent:] == whole


def widest_push(tok, text):
    counting = Counting(tok)
    s = TextStream(counting)
    for t in tok.encode(text, add_special=False):
        s.push(t)
    return max(counting.widths)


@pytest.mark.parametrize("text", [*TEXTS, LONG])
def test_sentencepiece_deltas_join_to_the_decode(spm_model, text):  # noqa: F811
    check(load_tokenizer(gguf_metadata(spm_model)), text)


@pytest.fixture(scope="module")
def smol(smollm2):
    return load_tokenizer(open_gguf(smollm2))


@pytest.mark.parametrize("text", [*GOLDEN_IDS, LONG])
def test_byte_level_deltas_join_to_the_decode(smol, text):
    check(smol, text)


def test_a_push_decodes_a_window_not_the_answer(spm_model, smol):  # noqa: F811
    # LONG is ~1,000 tokens; a push decodes the last delta's tokens and the new ones (a character split over bytes
    # waits for its last byte: up to 4 byte tokens)
    for tok in (load_tokenizer(gguf_metadata(spm_model)), smol):
        assert len(tok.encode(LONG, add_special=False)) > 800
        assert widest_push(tok, LONG) <= 10
