"""pi-serve through the official openai client: chat and completions (whole and streamed) equal Model.generate's
greedy output, stop strings, usage, seeds, prefix reuse across turns, the bounded queue, and client disconnects.
The server runs in-process on a free loopback port with a tiny chat model."""

import threading
import time

import httpx
import openai
import pytest
import torch

from pinfer_llm.runtime import load_model
from pinfer_llm.runtime.generation.chat import encode_chat
from tests.tiny_server import start_server, write_chat_model

HELLO = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    threads = torch.get_num_threads()
    d = tmp_path_factory.mktemp("serve")
    write_chat_model(d / "tiny-chat.gguf")
    srv, slow = start_server(d / "tiny-chat.gguf", names=["tiny"], max_waiting=1, parallel=1)  # one slot: the queue
    ref = load_model(d / "tiny-chat.gguf", threads=1)  # its own KV cache, for reference outputs
    yield srv, slow, ref
    srv.close()
    torch.set_num_threads(threads)


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture
def slow(served):
    """The served model, slowed to `delay` s per token by the test; full speed again afterwards."""
    yield served[1]
    served[1].delay = 0.0
    wait_idle(served[0].url)


def wait_idle(url, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = httpx.get(url + "/health").json()
        if not h["generating"] and h["waiting"] == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"the server is still busy: {h}")


def wait_for(url, cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = httpx.get(url + "/health").json()
        if cond(h):
            return h
        time.sleep(0.01)
    raise AssertionError(f"health never matched: {h}")


def reference(ref, ids, n, **kw):
    """Token ids and text of Model.generate (greedy unless told), as the server should answer."""
    kw.setdefault("temperature", 0.0)
    toks = list(ref.generate(ids, max_tokens=n, **kw))
    return toks, ref.tokenizer.decode(toks, skip_special=True)


def test_models(client, served):
    assert [m.id for m in client.models.list().data] == ["tiny-chat"]
    assert client.models.retrieve("tiny-chat").id == "tiny-chat"
    assert client.models.retrieve("gpt-4").id == "tiny-chat"  # any name is the loaded model (--strict-model: 404)


@pytest.mark.parametrize("name", ["tiny-chat", "tiny-chat.gguf", "tiny"])  # no name at all: test_server_http.py
def test_chat_equals_model_generate(client, served, name):
    ref = served[2]
    ids = encode_chat(ref.tokenizer, HELLO)
    toks, text = reference(ref, ids, 12)
    r = client.chat.completions.create(model=name, messages=HELLO, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and len(toks) == 12
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 12, len(ids) + 12)
    assert r.model == "tiny-chat" and r.object == "chat.completion"


def test_chat_stream_equals_whole(client, served):
    ref = served[2]
    ids = encode_chat(ref.tokenizer, HELLO)
    _, text = reference(ref, ids, 15)
    chunks = list(client.chat.completions.create(model="tiny-chat", messages=HELLO, max_tokens=15, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 15
    assert chunks[-1].usage.prompt_tokens == len(ids)
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


@pytest.mark.parametrize("as_ids", [False, True])
def test_completions_whole_and_streamed(client, served, as_ids):
    ref = served[2]
    ids = ref.tokenizer.encode("Once upon a time")
    _, text = reference(ref, ids, 10)
    prompt = ids if as_ids else "Once upon a time"
    r = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=10, temperature=0)
    assert r.choices[0].text == text and r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 10
    parts = list(client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=10, temperature=0,
                                           stream=True))
    assert "".join(p.choices[0].text for p in parts) == text
    assert parts[-1].choices[0].finish_reason == "length"


def stop_across_tokens(ref, toks):
    """A stop string that starts inside one token's text and ends inside a later one's, and where it cuts."""
    tok = ref.tokenizer
    text = tok.decode(toks, skip_special=True)
    for k in range(3, len(toks) - 2):
        cut = len(tok.decode(toks[:k], skip_special=True))
        stop = text[cut - 1:cut + 2]
        # the token boundary at `cut` is stable and the stop string is not found earlier
        if text.startswith(tok.decode(toks[:k], skip_special=True)) and 2 <= len(stop.strip()) and \
                text.find(stop) == cut - 1 and len(tok.decode(toks[k:k + 1])) < 3:
            return stop, text[:cut - 1]
    raise AssertionError("no stop string across tokens in this output")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_stop_string_across_tokens(client, served, stream, chat):
    ref = served[2]
    ids = encode_chat(ref.tokenizer, HELLO) if chat else ref.tokenizer.encode("Once upon a time")
    toks, _ = reference(ref, ids, 30)
    stop, want = stop_across_tokens(ref, toks)
    kw = dict(model="tiny-chat", max_tokens=30, temperature=0, stop=[stop, "\x00never"], stream=stream)
    r = client.chat.completions.create(messages=HELLO, **kw) if chat else \
        client.completions.create(prompt="Once upon a time", **kw)
    if stream:
        parts = [c.choices[0] for c in r if c.choices]
        text = "".join((p.delta.content or "") if chat else p.text for p in parts)
        finish = parts[-1].finish_reason
    else:
        text = r.choices[0].message.content if chat else r.choices[0].text
        finish = r.choices[0].finish_reason
    assert text == want and finish == "stop"


def test_stop_string_as_plain_string(client, served):
    ref = served[2]
    ids = ref.tokenizer.encode("Once upon a time")
    toks, _ = reference(ref, ids, 30)
    stop, want = stop_across_tokens(ref, toks)
    r = client.completions.create(model="tiny-chat", prompt="Once upon a time", max_tokens=30, temperature=0,
                                  stop=stop)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 30


def test_seed_reproduces_sampling(client, served):
    ref = served[2]
    ids = encode_chat(ref.tokenizer, HELLO)
    _, text = reference(ref, ids, 12, temperature=1.0, seed=7)  # the server's defaults: top_k 40, top_p 0.95
    kw = dict(model="tiny-chat", messages=HELLO, max_tokens=12, temperature=1.0)
    a = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    c = client.chat.completions.create(seed=8, **kw).choices[0].message.content
    assert a == b == text and c != a


def test_extensions_top_k_and_repeat_penalty(client, served):
    ref = served[2]
    ids = encode_chat(ref.tokenizer, HELLO)
    _, text = reference(ref, ids, 12, repeat_penalty=1.5)
    r = client.chat.completions.create(model="tiny-chat", messages=HELLO, max_tokens=12, temperature=0,
                                       extra_body={"repeat_penalty": 1.5, "top_k": 1})
    assert r.choices[0].message.content == text


def test_end_of_turn_token_finishes_with_stop(tmp_path):
    """A model whose end-of-turn token wins early: finish_reason "stop", the token itself not in the text."""
    threads = torch.get_num_threads()
    write_chat_model(tmp_path / "plain.gguf")
    m = load_model(tmp_path / "plain.gguf", threads=1)
    first = list(m.generate(encode_chat(m.tokenizer, HELLO), max_tokens=1, temperature=0))[0]
    write_chat_model(tmp_path / "eos.gguf", eos_row_from=first)
    srv, _ = start_server(tmp_path / "eos.gguf")
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        r = c.chat.completions.create(model="eos", messages=HELLO, max_tokens=20, temperature=0)
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 20
        assert "<|im_end|>" not in r.choices[0].message.content
        s = list(c.chat.completions.create(model="eos", messages=HELLO, max_tokens=20, temperature=0, stream=True))
        assert s[-1].choices[0].finish_reason == "stop"
    finally:
        srv.close()
        torch.set_num_threads(threads)


def test_next_turn_reuses_the_cache(client, served):
    ref = served[2]
    turn1 = [{"role": "user", "content": "tell me a story"}]
    ids1 = encode_chat(ref.tokenizer, turn1)
    toks1, text1 = reference(ref, ids1, 10)
    r1 = client.chat.completions.create(model="tiny-chat", messages=turn1, max_tokens=10, temperature=0)
    assert r1.choices[0].message.content == text1
    turn2 = turn1 + [{"role": "assistant", "content": text1}, {"role": "user", "content": "and then?"}]
    ids2 = encode_chat(ref.tokenizer, turn2)
    held = ids1 + toks1[:-1]  # the answer's last token was sampled, never forwarded: not in the cache
    common = next((i for i, (a, b) in enumerate(zip(ids2, held, strict=False)) if a != b), min(len(ids2), len(held)))
    assert common > len(ids1)  # the answer's tokens are in the cache, not only the first prompt's
    _, text2 = reference(ref, ids2, 10)
    r2 = client.chat.completions.create(model="tiny-chat", messages=turn2, max_tokens=10, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens == min(common, len(ids2) - 1)
    assert r2.choices[0].message.content == text2
    r3 = client.chat.completions.create(model="tiny-chat", messages=turn2, max_tokens=10, temperature=0,
                                        extra_body={"cache_prompt": False})
    assert r3.usage.prompt_tokens_details.cached_tokens == 0 and r3.choices[0].message.content == text2


def stream_in_thread(url, body, chunks_before_close=None):
    """POST a streaming request from a thread; keep its events; close after `chunks_before_close` events."""
    out = {"events": [], "error": None}

    def run():
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body | {"stream": True}, timeout=30) as r:
                out["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        out["events"].append(line[6:])
                        if chunks_before_close and len(out["events"]) >= chunks_before_close:
                            return  # leaving the with-block closes the connection
        except Exception as e:  # noqa: BLE001
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


LONG = {"model": "tiny-chat", "messages": HELLO, "max_tokens": 200, "temperature": 0}


def test_disconnect_stops_the_generation(client, served, slow):
    url = served[0].url
    slow.delay = 0.05  # 200 tokens would take 10 s
    t, out = stream_in_thread(url, LONG, chunks_before_close=4)
    t.join(10)
    assert not t.is_alive() and out["error"] is None
    t0 = time.monotonic()
    r = client.chat.completions.create(model="tiny-chat", messages=HELLO, max_tokens=3, temperature=0)
    # the next request did not wait for the abandoned one's 200 tokens, which stopped soon after the disconnect
    assert time.monotonic() - t0 < 2.0 and r.usage.completion_tokens == 3
    assert slow.runs[-2] < 15


def test_queue_bound_and_retry_after(client, served, slow):
    url = served[0].url  # the server was started with --queue 1
    slow.delay = 0.05
    t_run, running = stream_in_thread(url, LONG, chunks_before_close=None)
    wait_for(url, lambda h: h["generating"])
    waiting = {}
    t_wait = threading.Thread(target=lambda: waiting.update(r=client.chat.completions.create(
        model="tiny-chat", messages=HELLO, max_tokens=3, temperature=0)), daemon=True)
    t_wait.start()
    wait_for(url, lambda h: h["waiting"] == 1)
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="tiny-chat", messages=HELLO, max_tokens=3, temperature=0)
    assert e.value.status_code == 503 and int(e.value.response.headers["retry-after"]) > 0
    assert e.value.body["code"] == "server_busy"
    slow.delay = 0.0  # the running request finishes; then the waiting one runs
    t_run.join(20)
    t_wait.join(20)
    assert running["events"][-1] == "[DONE]" and waiting["r"].usage.completion_tokens == 3


def test_client_leaving_the_queue_is_never_run(served, slow):
    url = served[0].url
    slow.delay = 0.05
    runs = len(slow.runs) + 1  # the long stream's run; "generating" may show before its first token is asked for
    t_run, _ = stream_in_thread(url, LONG, chunks_before_close=None)
    wait_for(url, lambda h: h["generating"] and len(slow.runs) == runs)
    with pytest.raises(httpx.ReadTimeout):  # a client that gives up while queued
        httpx.post(url + "/v1/chat/completions", json=LONG | {"max_tokens": 5}, timeout=0.5)
    wait_for(url, lambda h: h["waiting"] == 0, timeout=2)
    slow.delay = 0.0
    t_run.join(20)
    wait_idle(url)
    assert len(slow.runs) == runs and slow.runs[-1] == 200  # the long stream ran to its end; the other never ran


def test_health_answers_while_generating(served, slow):
    url = served[0].url
    slow.delay = 0.05
    t, _ = stream_in_thread(url, LONG, chunks_before_close=None)
    wait_for(url, lambda h: h["generating"])
    t0 = time.monotonic()
    h = httpx.get(url + "/health").json()
    assert time.monotonic() - t0 < 0.5 and h["status"] == "ok" and h["generating"]
    slow.delay = 0.0
    t.join(20)


def test_hybrid_model_serves_turns(served):
    """pi-serve over a model split between the GPU stand-in and the CPU (runtime/hybrid/executor.py: attention and the
    residual stream on the device, every FFN split): requests run on the server's worker thread, the second turn
    reuses the KV cache (in device memory), and the answers are the CPU model's."""
    import numpy as np

    from pinfer_llm.runtime.gpu import ReferenceDevice
    from pinfer_llm.runtime.hybrid import executor as hybrid
    from pinfer_llm.runtime.hybrid.placement import Placement
    from pinfer_llm.runtime.serving.server import create_app
    from tests.tiny_server import RunningServer

    ref = served[2]
    m = load_model(ref.file.path, threads=1)
    L, n_ff = m.cfg.n_layer, m.cfg.n_ff
    hybrid.apply(m, Placement("test", np.ones(L, bool), np.zeros(L, bool), [np.arange(0, n_ff, 3)] * L, True, "test"),
                 ReferenceDevice())
    srv = RunningServer(create_app(m, threads=1))
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        turn1 = [{"role": "user", "content": "tell me a story"}]
        toks1, text1 = reference(ref, encode_chat(ref.tokenizer, turn1), 10)
        assert c.chat.completions.create(model="tiny-chat", messages=turn1, max_tokens=10,
                                         temperature=0).choices[0].message.content == text1
        turn2 = turn1 + [{"role": "assistant", "content": text1}, {"role": "user", "content": "and then?"}]
        _, text2 = reference(ref, encode_chat(ref.tokenizer, turn2), 10)
        r2 = c.chat.completions.create(model="tiny-chat", messages=turn2, max_tokens=10, temperature=0)
        assert r2.usage.prompt_tokens_details.cached_tokens > 0 and r2.choices[0].message.content == text2
    finally:
        srv.close()
