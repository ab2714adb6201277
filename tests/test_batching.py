"""Continuous batching (runtime/generation/batch.py): a greedy answer is pi-run's (Model.generate) token for token,
alone, in a batch of 4 different prompts, after a cached prefix of every length 1-32 in its slot, and however its
prompt was cut into chunks; and one forward over several sequences' rows gives every row the logits it gets alone,
to the bit, through the C++ step and through the Python forward."""

import dataclasses
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType as T

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.encoder import RawTensor
from pinfer_llm.formats.errors import PinferError
from pinfer_llm.formats.model_writer import write_llama
from pinfer_llm.runtime import load_model
from pinfer_llm.runtime.generation.batch import Batch, Sequence
from pinfer_llm.runtime.generation.chat import encode_chat
from pinfer_llm.runtime.sampling import SamplingParams
from tests.tiny import random_weights, tiny_config, to_powerinfer_layout
from tests.tiny_server import start_server, write_chat_model

N = 12  # tokens per answer


def quantised(w: dict) -> dict:
    return {name: RawTensor(quants.quantize(a, T.Q4_0), T.Q4_0, a.shape) if a.ndim == 2 and name != C.TOKEN_EMBD
            else a for name, a in w.items()}


@pytest.fixture(scope="module", params=["q4_0-dense", "relu-oracle", "relu-predicted"])
def model(request, tmp_path_factory):
    cfg = tiny_config(n_layer=2, n_ctx_train=256)
    w = random_weights(cfg)
    p = tmp_path_factory.mktemp("batch") / "m.gguf"
    if request.param == "q4_0-dense":
        write_llama(p, cfg, quantised(w))
        kw = {}
    else:  # a ReLU model in PowerInfer's layout, with predictors: each token's own neurons
        write_llama(p, cfg, to_powerinfer_layout(cfg, w), powerinfer=True)
        kw = {"ffn_act": "relu", "ffn_mode": "oracle" if request.param == "relu-oracle" else "sparse"}
    threads = torch.get_num_threads()
    m = load_model(p, threads=1, **kw)
    assert m.batchable()
    yield m
    torch.set_num_threads(threads)


def prompt(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 300, n)]


PROMPTS = [prompt(n, 100 + n) for n in (5, 37, 12, 61)]


def alone(m, ids, n=N):
    """pi-run's answer: Model.generate from a fresh prefill."""
    m.cached_ids = []
    return list(m.generate(ids, max_tokens=n, temperature=0.0, stop_ids=set()))


def seq(ids, n=N, **kw):
    return Sequence(list(ids), n, SamplingParams(temperature=0.0), set(), **kw)


def run(b: Batch, seqs, join_at=None):
    """Admit seqs (those in join_at at the given step instead) and step until all are done."""
    join_at = join_at or {}
    for s in seqs:
        if id(s) not in join_at:
            assert b.admit(s)
    step = 0
    while b.active or any(not s.done for s in seqs):
        for s in seqs:
            if join_at.get(id(s)) == step:
                assert b.admit(s)
        b.step()
        step += 1
    return [s.tokens for s in seqs]


@pytest.fixture(scope="module")
def refs(model):
    return [alone(model, p) for p in PROMPTS]


def test_one_sequence_alone_is_pi_runs_answer(model, refs):
    for p, ref in zip(PROMPTS, refs, strict=True):
        assert run(Batch(model, 1), [seq(p)]) == [ref]


@pytest.mark.parametrize("max_rows", [None, 1, 3, 7])
def test_four_prompts_in_one_batch_any_chunking(model, refs, max_rows):
    """Decode rows of some beside prompt chunks of others, in chunks of max_rows rows (None: the model's)."""
    b = Batch(model, 4, max_rows)
    assert run(b, [seq(p) for p in PROMPTS]) == refs
    # every prompt row and every answer token but the last went through once, several rows per pass
    assert b.rows_run == sum(len(p) + N - 1 for p in PROMPTS)
    assert b.steps == b.rows_run if max_rows == 1 else b.steps < b.rows_run / 2


def test_requests_joining_mid_batch(model, refs):
    """Newcomers join at later steps, while the others decode; a fifth waits for a free slot."""
    b = Batch(model, 3, 4)
    seqs = [seq(p) for p in PROMPTS]
    late = {id(seqs[1]): 3, id(seqs[2]): 9}
    assert run(b, seqs[:3], join_at=late) == refs[:3]
    assert run(b, [seqs[3]]) == [refs[3]]


def test_admission_waits_for_a_free_slot(model):
    b = Batch(model, 2)
    assert b.admit(seq(PROMPTS[0])) and b.admit(seq(PROMPTS[1]))
    assert not b.admit(seq(PROMPTS[2])) and b.free_slots() == 0


def test_answer_is_the_same_after_a_cached_prefix_of_every_length(model, refs):
    """issue #28's repro, at every length: another request's prompt of 1..32 tokens answered with max_tokens 0
    leaves its keys in the slot; the next request reuses them and must answer as a fresh run."""
    ids = PROMPTS[3]
    b = Batch(model, 1)
    for n in range(1, 33):
        first = seq(ids[:n], n=0)
        assert run(b, [first]) == [[]]
        s = seq(ids)
        assert run(b, [s]) == [refs[3]], f"after a cached prefix of {n}"
        assert s.stats.reused_tokens == n


def test_a_new_request_takes_the_slot_holding_its_prefix(model, refs):
    """Slot choice by shared prefix: a chat's next turn finds its conversation; the others' slots stay theirs."""
    b = Batch(model, 3)
    run(b, [seq(PROMPTS[0]), seq(PROMPTS[1]), seq(PROMPTS[2])])
    turn2 = PROMPTS[1] + refs[1][:-1] + prompt(9, 7)
    s = seq(turn2)
    run(b, [s])
    assert s.stats.reused_tokens == len(PROMPTS[1]) + N - 1
    assert s.tokens == alone(model, turn2)


def test_reuse_off_prefills_everything(model, refs):
    b = Batch(model, 1)
    run(b, [seq(PROMPTS[2])])
    s = seq(PROMPTS[2], reuse_prefix=False)
    assert run(b, [s]) == [refs[2]] and s.stats.reused_tokens == 0


def test_cancelled_sequence_leaves_and_others_go_on(model, refs):
    b = Batch(model, 4)
    seqs = [seq(p) for p in PROMPTS]
    for s in seqs:
        b.admit(s)
    for _ in range(3):
        b.step()
    seqs[1].cancelled = True
    while b.active:
        b.step()
    assert seqs[1].stats.stop_reason == "cancelled" and len(seqs[1].tokens) < N
    assert [seqs[i].tokens for i in (0, 2, 3)] == [refs[i] for i in (0, 2, 3)]



def test_a_sequence_whose_logits_are_not_finite_fails_alone(model, refs, monkeypatch):
    """NaN in one sequence's logits (from its third token on: a NaN put into its KV cache, so that the kernels
    compute them, as corrupt values would reach them) ends it with the corrupt-weights error; the others answer as
    alone. And pi-run's loop (Model.generate) refuses the same logits."""
    b = Batch(model, 4)
    seqs = [seq(p) for p in PROMPTS]
    for s in seqs:
        assert b.admit(s)
    real_rows, real_forward = model.run_rows, model.transformer.forward

    def poisoned_rows(ids, pos, caches, out_rows, launch=None):
        if len(seqs[1].tokens) == 2:
            seqs[1].slot.cache.v[0][:, 0, :] = float("nan")
        return real_rows(ids, pos, caches, out_rows, launch)

    monkeypatch.setattr(model, "run_rows", poisoned_rows)
    while b.active:
        b.step()
    assert seqs[1].stats.stop_reason == "error" and "not finite" in str(seqs[1].error)
    assert len(seqs[1].tokens) == 2
    assert [seqs[i].tokens for i in (0, 2, 3)] == [refs[i] for i in (0, 2, 3)]

    def poisoned_forward(tokens, pos, *a, **kw):
        if pos > 0:  # a decode step: the prompt's first value row, which every position reads, made inf
            model.transformer.cache.v[0][:, 0, :] = float("inf")
        return real_forward(tokens, pos, *a, **kw)

    monkeypatch.setattr(model.transformer, "forward", poisoned_forward)
    got = []
    with pytest.raises(PinferError, match="not finite"):
        for tok in model.generate(PROMPTS[0], max_tokens=N, temperature=0.0, stop_ids=set()):
            got.append(tok)
    assert got == refs[0][:1]  # the prompt's token; the first decode step's logits are refused
    model.cached_ids = []  # the model's cache holds an inf now: no later prompt may reuse what it held


def mixed_rows(m):
    """Four caches, each filled with a prompt; then one forward of 2 decode rows and a 3-row prompt chunk."""
    caches = [m.new_cache() for _ in range(3)]
    for c, p in zip(caches, PROMPTS, strict=False):
        m.run_rows(p, list(range(len(p))), [c] * len(p), [])
    toks = [7, 9, 11, 13, 15]
    pos = [len(PROMPTS[0]), len(PROMPTS[1]), len(PROMPTS[2]), len(PROMPTS[2]) + 1, len(PROMPTS[2]) + 2]
    rows = [caches[0], caches[1], caches[2], caches[2], caches[2]]
    return caches, toks, pos, rows


@pytest.mark.parametrize("use_step", [True, False])
def test_rows_of_a_batch_are_the_bits_of_each_alone(model, use_step):
    """run_rows over rows of three sequences == each row by itself in its own cache (the C++ step, or the Python
    forward with use_step off), and the keys each row wrote are the same bits."""
    m, tr = model, model.transformer
    tr.use_step = use_step
    try:
        caches, toks, pos, rows = mixed_rows(m)
        together = m.run_rows(toks, pos, rows, list(range(5)))
        keys = [c.k[1][:, :p + 1].clone() for c, p in zip(caches, (pos[0], pos[1], pos[4]), strict=True)]
        caches, toks, pos, rows = mixed_rows(m)
        each = torch.cat([m.run_rows([t], [p], [c], [0]) for t, p, c in zip(toks, pos, rows, strict=True)])
        assert torch.equal(together, each)
        for c, p, k in zip(caches, (pos[0], pos[1], pos[4]), keys, strict=True):
            assert torch.equal(c.k[1][:, :p + 1], k)
    finally:
        tr.use_step = True


def test_step_and_python_forward_agree(model):
    m, tr = model, model.transformer
    caches, toks, pos, rows = mixed_rows(m)
    fused = m.run_rows(toks, pos, rows, [0, 1, 4])
    tr.use_step = False
    try:
        caches, toks, pos, rows = mixed_rows(m)
        python = m.run_rows(toks, pos, rows, [0, 1, 4])
    finally:
        tr.use_step = True
    assert torch.equal(fused, python)


def random_q4_k(shape: tuple[int, int], rng) -> np.ndarray:
    """Random Q4_K rows (gguf cannot write Q4_K): random quants, 6-bit scales and mins under d = dmin = 1e-4."""
    rows, cols = shape
    blocks = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    blocks[..., 0:4] = np.frombuffer(np.float16(1e-4).tobytes() * 2, np.uint8)
    return blocks.reshape(rows, -1)


@pytest.fixture(scope="module")
def wide_relu(tmp_path_factory):
    """A ReLU model in PowerInfer's layout wide enough (512 neurons) that the sparse kernels split their work across
    two threads, in F32 and in Q4_0 (whose several-token axpy differs from its one-token one); and 256 wide in Q4_K
    (its gate and up rows read in place, its ffn_down_t rows re-encoded as Q4_1, which axpy reads)."""
    cfg = tiny_config(n_layer=2, n_ctx_train=256, n_ff=512, n_embd=128)
    w = to_powerinfer_layout(cfg, random_weights(cfg), rank=32)
    d = tmp_path_factory.mktemp("wide")
    paths = {"f32": d / "f32.gguf", "q4_0": d / "q4.gguf", "q4_k": d / "q4_k.gguf"}
    write_llama(paths["f32"], cfg, w, powerinfer=True)
    q = {n: RawTensor(quants.quantize(a.astype(np.float32), T.Q4_0), T.Q4_0, a.shape)
         if a.ndim == 2 and n != C.TOKEN_EMBD and "fc" not in n else a for n, a in w.items()}
    write_llama(paths["q4_0"], cfg, q, powerinfer=True)
    cfg = tiny_config(n_layer=2, n_ctx_train=256, n_ff=512, n_embd=256)
    w, rng = to_powerinfer_layout(cfg, random_weights(cfg), rank=32), np.random.default_rng(7)
    q = {n: RawTensor(random_q4_k(a.shape, rng), T.Q4_K, a.shape)
         if a.ndim == 2 and n != C.TOKEN_EMBD and "fc" not in n and a.shape[1] % 256 == 0 else a for n, a in w.items()}
    assert {n.split(".")[-2] for n, a in q.items() if isinstance(a, RawTensor)} >= {"ffn_gate", "ffn_up", "ffn_down_t"}
    write_llama(paths["q4_k"], cfg, q, powerinfer=True)
    return paths


@pytest.mark.parametrize("qtype", ["f32", "q4_0", "q4_k"])
@pytest.mark.parametrize("mode", ["oracle", "sparse"])
def test_prefill_of_a_sparse_model_is_the_bits_of_its_decode_steps(wide_relu, qtype, mode):
    """With two threads a prompt's chunked prefill gives each row the logits that row gets decoded alone, although
    a chunk's FFN runs once over the union of its rows' neurons (runtime/cpu/csrc/sparse_ffn.cpp's batch
    invariance: threads split the neurons by id ranges, the down rows summed in index order)."""
    threads = torch.get_num_threads()
    try:
        m = load_model(wide_relu[qtype], threads=2, ffn_act="relu", ffn_mode=mode)
        ids = PROMPTS[3]
        chunked = m.forward_logits(ids)
        c = m.new_cache()
        rows = torch.cat([m.run_rows([t], [i], [c], [0]) for i, t in enumerate(ids)]).numpy()
        assert np.array_equal(chunked, rows)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("use_step", [True, False])
@pytest.mark.parametrize("qtype", ["f32", "q4_0", "q4_k"])
@pytest.mark.parametrize("mode", ["oracle", "sparse", "sparse-fc2-stored"])
def test_batched_rows_of_a_sparse_model_are_the_bits_of_each_alone(wide_relu, qtype, mode, use_step):
    """Two threads, rows of three sequences in one forward (the C++ step's decode_team, or the Python forward): the
    FFN over the union of the rows' neurons gives each row its bits alone, and so do the rows' predictors, run
    together (fc2 transposed, as the runtime decodes, or as stored: one pass over fc2's rows for every row)."""
    threads = torch.get_num_threads()
    try:
        m = load_model(wide_relu[qtype], threads=2, ffn_act="relu", ffn_mode=mode.removesuffix("-fc2-stored"))
        if mode.endswith("-fc2-stored"):  # before the first forward builds the step
            for b in m.transformer.blocks:
                b.ffn.masker.pred = dataclasses.replace(b.ffn.masker.pred, fc2_t=None, fc2_t_source=None)
        m.transformer.use_step = use_step
        caches, toks, pos, rows = mixed_rows(m)
        together = m.run_rows(toks, pos, rows, list(range(5)))
        caches, toks, pos, rows = mixed_rows(m)
        each = torch.cat([m.run_rows([t], [p], [c], [0]) for t, p, c in zip(toks, pos, rows, strict=True)])
        assert torch.equal(together, each)
    finally:
        torch.set_num_threads(threads)


def test_bad_rows_are_refused(model):
    m = model
    c = m.new_cache()
    with pytest.raises(RuntimeError, match="position order"):
        m.run_rows([5, 6], [1, 0], [c, c], [1])
    with pytest.raises(RuntimeError, match="outside the cache"):
        m.run_rows([5], [m.ctx_size], [c], [0])


def test_model_without_row_invariance_gets_one_slot(model, refs):
    """No row-invariant numerics: one slot, the model's own cache, prompts in Model.generate's chunks."""
    model.row_invariant = False
    try:
        b = Batch(model, 4)
        assert len(b.slots) == 1 and b.uses_model_cache
        s = [seq(PROMPTS[0]), seq(PROMPTS[1])]
        assert b.admit(s[0]) and not b.admit(s[1])
        while b.active:
            b.step()
        assert s[0].tokens == alone(model, PROMPTS[0])
    finally:
        model.row_invariant = True


# --- pi-serve with --parallel 4 ---------------------------------------------------------------------------------------

def stream_text(url, body) -> tuple[str, str | None, list[float]]:
    """One streaming chat request from a thread: its text, finish reason, and the arrival times of its deltas."""
    text, finish, times = "", None, []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body | {"stream": True}, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:])["choices"][0]
                if ch["delta"].get("content"):
                    text += ch["delta"]["content"]
                    times.append(time.monotonic())
                finish = ch.get("finish_reason") or finish
    return text, finish, times


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    threads = torch.get_num_threads()
    p = tmp_path_factory.mktemp("srv") / "chat.gguf"
    write_chat_model(p)
    srv, slow = start_server(p, parallel=4)
    yield srv, slow, load_model(p, threads=1)
    srv.close()
    torch.set_num_threads(threads)


TOPICS = ["the sea", "a cat", "trains", "the moon and the stars above the hills"]


def test_server_decodes_four_clients_together(server):
    """Four streams at once: each answer is pi-run's for its prompt (Model.generate in another model object), and
    they were decoded in shared steps, their deltas interleaved."""
    srv, slow, ref = server
    worker = srv.app.state.worker
    bodies = [{"messages": [{"role": "user", "content": f"tell me about {t}"}], "max_tokens": 24,
               "temperature": 0} for t in TOPICS]
    want = [ref.tokenizer.decode(list(ref.generate(encode_chat(ref.tokenizer, b["messages"]), max_tokens=24,
                                                   temperature=0.0)), skip_special=True) for b in bodies]
    steps0, rows0 = worker.batch.steps, worker.batch.rows_run
    slow.delay = 0.01  # every step takes a while: the four requests surely overlap
    try:
        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(lambda b: stream_text(srv.url, b), bodies))
    finally:
        slow.delay = 0.0
    assert [g[0] for g in got] == want
    steps, rows = worker.batch.steps - steps0, worker.batch.rows_run - rows0
    assert steps < rows / 2, (steps, rows)  # several rows per forward pass
    first_done = min(g[2][-1] for g in got)
    assert all(g[2][0] < first_done for g in got)  # every stream had begun before any had ended


def test_a_client_leaving_leaves_the_batch_and_the_others_go_on(server):
    srv, slow, ref = server
    long = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 150, "temperature": 0}
    other = {"messages": [{"role": "user", "content": "tell me about a cat"}], "max_tokens": 30, "temperature": 0}
    want = ref.tokenizer.decode(list(ref.generate(encode_chat(ref.tokenizer, other["messages"]), max_tokens=30,
                                                  temperature=0.0)), skip_special=True)
    slow.delay = 0.02
    try:
        with ThreadPoolExecutor(2) as ex:
            def leave():
                with httpx.stream("POST", srv.url + "/v1/chat/completions", json=long | {"stream": True},
                                  timeout=30) as r:
                    for i, _ in enumerate(r.iter_lines()):
                        if i > 6:
                            return  # closing the stream: the client has gone
            f1, f2 = ex.submit(leave), ex.submit(stream_text, srv.url, other)
            f1.result()
            text, finish, _ = f2.result()
    finally:
        slow.delay = 0.0
    assert text == want and finish == "length"
    deadline = time.monotonic() + 5
    while srv.app.state.worker.generating and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.app.state.worker.generating == 0
    assert slow.runs[-2:] and min(slow.runs[-2:]) < 60  # the abandoned one stopped long before its 150 tokens
