"""SmolLM2 (the demo model): tokeniser against llama.cpp's ids, greedy generation against llama.cpp's tokens."""

import re

import numpy as np
import pytest

from pinfer_llm.formats.reader import open_gguf
from pinfer_llm.formats.tokenizer import load_tokenizer

GOLDEN_IDS = {  # llama.cpp (llama-cpp-python 0.3.36) tokenize(..., add_bos=False, special=True) on the same file
    'Hello world': [19556, 905],
    'Once upon a time': [6403, 1980, 253, 655],
    '  leading spaces and trailing  ': [216, 2899, 5600, 284, 35079, 256],
    'numbers: 3.14159, 42, 1000000 and 2026-11-29': [28707, 42, 216, 35, 30, 33, 36, 33, 37, 41, 28, 216, 36, 34, 28, 216, 33, 32, 32, 32, 32, 32, 32, 284, 216, 34, 32, 34, 38, 29, 33, 33, 29, 34, 41],
    'unicode: héllo naïve café — “quotes” 世界 こんにちは 🙂👍': [35852, 42, 294, 2756, 31394, 15486, 46494, 37366, 1841, 619, 385, 2346, 573, 216, 7906, 240, 178, 239, 230, 46673, 237, 10391, 237, 41152, 7365, 111, 7365, 124, 47526, 10813, 235, 231],
    'def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)\n': [1604, 3987, 24, 94, 727, 472, 1003, 304, 585, 304, 2067, 216, 34, 1745, 3987, 24, 94, 29, 33, 25, 1232, 3987, 24, 94, 29, 34, 25, 198],
    'tabs\tand\nnewlines\r\n\n\nend': [100, 7366, 197, 397, 198, 2241, 5110, 201, 1116, 198, 486],
    "<|im_start|>user\nWhat's up?<|im_end|>\n": [1, 4093, 198, 1780, 506, 614, 47, 2, 198],
    "I'm sure they'll've done it, we're here": [57, 5248, 2090, 502, 3060, 3543, 2294, 357, 28, 392, 2316, 1535],
    'ÄÖÜ äöü ß Ελληνικά русский': [142, 222, 142, 240, 142, 246, 5549, 114, 7466, 7170, 5549, 249, 5664, 239, 17162, 17162, 25723, 11517, 12001, 21118, 26112, 216, 9175, 14714, 9382, 39511, 7872, 24958],
}

# llama.cpp greedy continuation of "Once upon a time" (", the city of Nova Haven was a thriving metropolis, ...")
GOLDEN_GREEDY = [28, 260, 2240, 282, 23324, 27108, 436, 253, 15114, 39228, 28, 351, 25854, 41658, 284, 14055]


@pytest.fixture(scope="module")
def tok(smollm2):
    return load_tokenizer(open_gguf(smollm2))


@pytest.mark.parametrize("text", list(GOLDEN_IDS))
def test_tokenizer_matches_llama_cpp(tok, text):
    assert tok.encode(text) == GOLDEN_IDS[text]
    assert tok.decode(tok.encode(text)) == text


def test_tokenizer_metadata(tok):
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (1, 2, False)
    assert 2 in tok.stop_ids  # <|im_end|> ends a chat turn
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_llama_cpp_greedy_tokens_are_ours(smollm2_model):
    """llama.cpp's greedy continuation of the same file, teacher-forced: every one of its tokens is our argmax too, or
    within 0.05 of our best logit. Such near ties exist: after "Once upon a time, in a" llama.cpp itself puts
    " Nova" 0.014 above " New", and float rounding decides them (ours picks " New" by 0.009)."""
    m = smollm2_model
    prompt = m.tokenizer.encode("Once upon a time")
    logits = m.forward_logits(prompt + GOLDEN_GREEDY[:-1])[len(prompt) - 1:]
    gaps = logits.max(-1) - logits[np.arange(len(GOLDEN_GREEDY)), GOLDEN_GREEDY]
    assert gaps.max() < 0.05, gaps
    assert (gaps == 0).sum() >= len(GOLDEN_GREEDY) - 1, gaps


def test_greedy_generation_is_coherent_english(smollm2_model):
    m = smollm2_model
    out = list(m.generate(m.tokenizer.encode("Once upon a time"), max_tokens=48, temperature=0.0))
    text = m.tokenizer.decode(out)
    words = re.findall(r"[A-Za-z']+", text)
    assert len(words) >= 25
    common = {"the", "a", "of", "and", "was", "with", "to", "in", "its", "as", "by"}
    assert sum(w.lower() in common for w in words) >= 6, text
    assert len(set(words)) / len(words) > 0.5, text  # not a loop of one phrase
