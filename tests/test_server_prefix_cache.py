"""Model.generate(reuse_prefix=True): the KV cache of the previous call is kept for the longest common prefix and only
the rest is prefilled. Each case checks the greedy tokens against a fresh run and, sharper than tokens, that the
cache then holds the same keys as a fresh run's cache at every position it claims."""

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType as T

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.encoder import RawTensor
from pinfer_llm.formats.model_writer import write_llama
from pinfer_llm.runtime import load_model
from pinfer_llm.runtime.engine import REUSE_MIN_PREFILL
from tests.tiny import random_weights, tiny_config, write_tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    p = tmp_path_factory.mktemp("prefix") / "m.gguf"
    write_tiny(p, n_layer=2, n_ctx_train=256)
    threads = torch.get_num_threads()
    # one thread: a tiny model gains nothing from two, and spinning OpenMP threads crawl on a busy machine
    yield load_model(p, threads=1)
    torch.set_num_threads(threads)


def prompt(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 300, n)]


def greedy(m, ids, n=8, reuse=False):
    return list(m.generate(ids, max_tokens=n, temperature=0.0, stop_ids=set(), reuse_prefix=reuse))


def cached_keys(m) -> torch.Tensor:
    """The keys at every position the record claims, all layers: [n_layer, n_head_kv, positions, head_dim]."""
    return torch.stack([k[:, :len(m.cached_ids)] for k in m.transformer.cache.k])


def fresh(m, ids, n=8):
    """Tokens and cached keys of a run that prefills everything."""
    out = greedy(m, ids, n)
    return out, cached_keys(m)


def check_same_as_fresh(m, ids, expect_reused, n=8, atol=1e-4):
    out = greedy(m, ids, n, reuse=True)
    assert m.stats.reused_tokens == expect_reused
    assert m.stats.prompt_tokens == len(ids)
    keys = cached_keys(m)
    cached = list(m.cached_ids)
    ref, ref_keys = fresh(m, ids, n)
    assert out == ref
    assert cached == m.cached_ids == ids + ref  # max_tokens ran out: the consumer's last next() forwarded the last
    # the cache is f16: the two prefills' f32 keys may differ by rounding, which can move an f16 key by one ulp
    torch.testing.assert_close(keys, ref_keys, atol=atol, rtol=2.0 ** -10 if keys.dtype == torch.float16 else atol)


def test_off_by_default(model):
    a = prompt(20, 1)
    greedy(model, a)
    greedy(model, a)
    assert model.stats.reused_tokens == 0


def test_next_turn_reuses_prompt_and_answer(model):
    a = prompt(24, 2)
    out = greedy(model, a, reuse=True)
    assert model.cached_ids == a + out
    check_same_as_fresh(model, a + out + prompt(20, 3), expect_reused=len(a) + len(out))


def test_answer_that_ended_on_a_stop_token(model):
    a = prompt(24, 2)
    out = greedy(model, a)
    gen = model.generate(a, max_tokens=8, temperature=0.0, stop_ids={out[3]}, reuse_prefix=True)
    assert list(gen) == out[:4] and model.stats.stop_reason == "stop"
    assert model.cached_ids == a + out[:3]  # the stop token was never forwarded
    check_same_as_fresh(model, a + out[:4] + prompt(20, 3), expect_reused=len(a) + 3)


def test_diverging_prompt_shorter_than_cache(model):
    a = prompt(40, 4)
    greedy(model, a, reuse=True)
    b = a[:15] + prompt(16, 5)  # differs from position 15 on, and ends well before what the cache holds
    assert b[15] != a[15]
    check_same_as_fresh(model, b, expect_reused=15)


def test_same_prompt_again_prefills_the_minimum(model):
    a = prompt(30, 6)
    greedy(model, a, reuse=True)
    check_same_as_fresh(model, a, expect_reused=29)  # row-invariant numerics: one row, whose logits pick the token


def test_without_row_invariance_reuse_keeps_a_fresh_runs_kernel_rows(model):
    model.row_invariant = False
    try:
        a = prompt(30, 6)
        greedy(model, a, reuse=True)
        # 16 tokens, the rows from which a fresh prefill takes the GEMM kernel
        check_same_as_fresh(model, a, expect_reused=30 - REUSE_MIN_PREFILL)
    finally:
        model.row_invariant = True


def test_short_prompt_that_is_a_prefix_of_the_cache_prefills_one_token(model):
    a = prompt(30, 7)
    greedy(model, a, reuse=True)
    check_same_as_fresh(model, a[:12], expect_reused=11)  # 12 < 16: a fresh prefill takes the decode kernel too


def test_nothing_in_common(model):
    greedy(model, prompt(20, 8), reuse=True)
    b = prompt(20, 9)
    b[0] = 299
    check_same_as_fresh(model, b, expect_reused=0)


def test_interrupted_generation_leaves_a_true_record(model):
    a = prompt(20, 10)
    gen = model.generate(a, max_tokens=50, temperature=0.0, stop_ids=set(), reuse_prefix=True)
    got = [next(gen) for _ in range(3)]
    gen.close()
    assert model.cached_ids == a + got[:2]
    check_same_as_fresh(model, a + got + prompt(16, 11), expect_reused=len(a) + 2)


def test_forward_logits_replaces_the_record(model):
    greedy(model, prompt(20, 12), reuse=True)
    b = prompt(25, 13)
    model.forward_logits(b)
    assert model.cached_ids == b
    check_same_as_fresh(model, b + prompt(16, 14), expect_reused=25)


def test_prefix_across_prefill_chunks(model, monkeypatch):
    monkeypatch.setattr("pinfer_llm.runtime.engine.PREFILL_CHUNK", 8)
    a = prompt(30, 15)
    greedy(model, a, reuse=True)
    check_same_as_fresh(model, a[:21] + prompt(16, 16), expect_reused=21)


@pytest.fixture(scope="module")
def q4_model(tmp_path_factory):
    """A tiny model whose matrices are Q4_0: prefill (16+ rows) runs an fp32 GEMM, fewer rows 8-bit dot products."""
    cfg = tiny_config(n_ctx_train=256)
    w = random_weights(cfg)
    for name, a in list(w.items()):
        if a.ndim == 2 and name != C.TOKEN_EMBD:
            w[name] = RawTensor(quants.quantize(a, T.Q4_0), T.Q4_0, a.shape)
    p = tmp_path_factory.mktemp("q4") / "q4.gguf"
    write_llama(p, cfg, w)
    threads = torch.get_num_threads()
    yield load_model(p, threads=1)
    torch.set_num_threads(threads)


def test_quantised_model_reuse_gives_a_fresh_runs_bits(q4_model):
    """Row-invariant numerics: the 12 new tokens prefilled alone give the fresh run's keys to the bit."""
    a = prompt(40, 17)
    greedy(q4_model, a, reuse=True)
    check_same_as_fresh(q4_model, a[:28] + prompt(12, 18), expect_reused=28, atol=0)


def logits_and_keys(m, ids, n=12):
    """Greedy tokens, then the logits at every position and the keys of prompt + answer, after whatever ran."""
    out = list(m.generate(ids, max_tokens=n, temperature=0.0, stop_ids=set(), reuse_prefix=True))
    return out, torch.stack([k[:, :len(ids) + n - 1] for k in m.transformer.cache.k]).clone()


def test_answer_is_the_same_after_a_cached_prefix_of_every_length(q4_model):
    """issue #28's repro, at every length: another request's prompt of 1..32 tokens, answered with max_tokens 0,
    leaves its keys in the cache; the next request reuses them and must answer as a fresh run, token for token, with
    the same keys to the bit. Before row-invariant numerics a prefix of fewer than 64 rows took the 8-bit tiles where
    the fresh prefill of 70 took the GEMM."""
    m = q4_model
    ids = prompt(70, 19)
    m.cached_ids = []
    ref, ref_keys = logits_and_keys(m, ids)
    for n in range(1, 33):
        assert list(m.generate(ids[:n], max_tokens=0, temperature=0.0, reuse_prefix=True)) == []
        out, keys = logits_and_keys(m, ids)
        assert m.stats.reused_tokens == n
        assert out == ref, f"after a cached prefix of {n}"
        assert torch.equal(keys, ref_keys), f"after a cached prefix of {n}"


@pytest.mark.parametrize("chunk", [1, 5, 23])
def test_chunking_changes_no_bit(q4_model, monkeypatch, chunk):
    m = q4_model
    ids = prompt(70, 20)
    ref = m.forward_logits(ids)
    monkeypatch.setattr("pinfer_llm.runtime.engine.PREFILL_CHUNK", chunk)
    assert np.array_equal(m.forward_logits(ids), ref)
