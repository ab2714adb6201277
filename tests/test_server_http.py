"""pi-serve over raw HTTP: every bad request gets OpenAI's error shape with the right status and never a traceback,
and the server keeps serving after it; the server-sent events on the wire; API keys."""

import json

import httpx
import pytest
import torch

from tests.tiny_server import start_server, write_chat_model

HELLO = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
GOOD = {"messages": HELLO, "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    threads = torch.get_num_threads()
    d = tmp_path_factory.mktemp("http")
    write_chat_model(d / "tiny-chat.gguf")
    srv, slow = start_server(d / "tiny-chat.gguf", names=["tiny"])
    keyed, _ = start_server(d / "tiny-chat.gguf", api_key="sesame")
    strict, _ = start_server(d / "tiny-chat.gguf", names=["tiny"], strict_model=True)
    yield srv, slow, keyed, strict
    srv.close()
    keyed.close()
    strict.close()
    torch.set_num_threads(threads)


@pytest.fixture
def http(served):
    with httpx.Client(base_url=served[0].url, timeout=30) as c:
        yield c


def assert_error(r, status, *needles, param=None, code=None):
    assert r.status_code == status, r.text
    assert "Traceback" not in r.text and 'File "' not in r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), err
    for n in needles:
        assert n in err["message"], err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def still_serving(http):
    r = http.post(CHAT, json=GOOD)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("body, needle, param", [
    (b"{not json", "not valid JSON", None),
    (b"", "not valid JSON", None),
    (b"\xff\xfe\x00garbage", "not valid JSON", None),
    (b"[1, 2]", "JSON object", None),
    (json.dumps({"max_tokens": 3}).encode(), "'messages'", "messages"),
    (json.dumps({"messages": []}).encode(), "'messages'", "messages"),
    (json.dumps({"messages": ["hi"]}).encode(), "messages[0]", "messages[0]"),
    (json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(), "role", "messages[0].role"),
    (json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), "content", "messages[0].content"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}).encode(),
     "only text parts", "messages[0].content[0]"),
    (json.dumps(GOOD | {"temperature": "hot"}).encode(), "'temperature' must be a number", "temperature"),
    (json.dumps(GOOD | {"temperature": 9}).encode(), "from 0 to 2", "temperature"),
    (json.dumps(GOOD | {"top_p": -0.1}).encode(), "'top_p'", "top_p"),
    (json.dumps(GOOD | {"max_tokens": -1}).encode(), "'max_tokens' must be an integer", "max_tokens"),
    (json.dumps(GOOD | {"max_tokens": 2.5}).encode(), "'max_tokens'", "max_tokens"),
    (json.dumps(GOOD | {"max_tokens": True}).encode(), "'max_tokens'", "max_tokens"),
    (json.dumps(GOOD | {"stop": 5}).encode(), "'stop'", "stop"),
    (json.dumps(GOOD | {"stop": [""]}).encode(), "'stop'", "stop"),
    (json.dumps(GOOD | {"stop": ["a"] * 17}).encode(), "at most 16", "stop"),
    (json.dumps(GOOD | {"stream": "yes"}).encode(), "'stream' must be true or false", "stream"),
    (json.dumps(GOOD | {"stream_options": {"include_usage": 1}}).encode(), "include_usage",
     "stream_options.include_usage"),
    (json.dumps(GOOD | {"seed": "x"}).encode(), "'seed'", "seed"),
    (json.dumps(GOOD | {"n": 2}).encode(), "'n' must be 1", "n"),
    (json.dumps(GOOD | {"presence_penalty": 0.5}).encode(), "repeat_penalty", "presence_penalty"),
    (json.dumps(GOOD | {"frequency_penalty": -1}).encode(), "repeat_penalty", "frequency_penalty"),
    (json.dumps(GOOD | {"frequency_penalty": 3}).encode(), "from -2 to 2", "frequency_penalty"),
    (json.dumps(GOOD | {"logprobs": True}).encode(), "not supported", "logprobs"),
    (json.dumps(GOOD | {"tools": [{"type": "function"}]}).encode(), "tool calls", "tools"),
    (json.dumps(GOOD | {"response_format": {"type": "json_object"}}).encode(), "response_format", "response_format"),
    (json.dumps(GOOD | {"model": 7}).encode(), "'model' must be a string", "model"),
])
def test_bad_chat_request_is_400_and_the_server_goes_on(http, body, needle, param):
    assert_error(http.post(CHAT, content=body, headers={"content-type": "application/json"}), 400, needle,
                 param=param)
    still_serving(http)


@pytest.mark.parametrize("body, needle, param", [
    ({"prompt": 5}, "'prompt'", "prompt"),
    ({"prompt": ["a", "b"]}, "one prompt per request", "prompt"),
    ({"prompt": [1, "a"]}, "'prompt'", "prompt"),
    ({"prompt": "hi", "echo": True}, "'echo'", "echo"),
    ({"prompt": "hi", "suffix": "x"}, "'suffix'", "suffix"),
    ({"prompt": [1, 5, 99999]}, "outside the vocabulary", "prompt"),
    ({"prompt": ""}, "empty", "prompt"),
])
def test_bad_completion_request_is_400(http, body, needle, param):
    assert_error(http.post("/v1/completions", json=body | {"max_tokens": 2}), 400, needle, param=param)
    still_serving(http)


def test_oversized_body_is_413(http):
    assert_error(http.post(CHAT, content=b" " * (17 << 20)), 413, "larger than 16 MiB")
    still_serving(http)


def test_penalties_of_zero_are_accepted(http):
    r = http.post(CHAT, json=GOOD | {"presence_penalty": 0, "frequency_penalty": 0.0, "n": 1, "user": "me"})
    assert r.status_code == 200


def test_conversation_longer_than_the_context(http):
    long = [{"role": "user", "content": "word " * 400}]  # ~ 800 byte-level tokens against a context of 256
    err = assert_error(http.post(CHAT, json={"messages": long}), 400, "context holds 256", "-c",
                       param="messages", code="context_length_exceeded")
    assert "take" in err["message"]
    assert_error(http.post("/v1/completions", json={"prompt": "x" * 300}), 400, "context", param="prompt")
    still_serving(http)


def test_context_boundary(http):
    ok = http.post("/v1/completions", json={"prompt": [5] * 255, "max_tokens": 4}).json()  # room for one token
    assert ok["usage"]["completion_tokens"] >= 1 and ok["choices"][0]["finish_reason"] == "length"
    assert_error(http.post("/v1/completions", json={"prompt": [5] * 256}), 400, "context holds 256",
                 code="context_length_exceeded")
    still_serving(http)


def test_model_runs_on_the_threads_it_was_given(tmp_path):
    """torch's thread count is per thread: the worker sets -t on itself, whatever the main thread has."""
    threads = torch.get_num_threads()
    write_chat_model(tmp_path / "m.gguf")
    srv, slow = start_server(tmp_path / "m.gguf")  # loads with 1 thread, serves with threads=1
    try:
        torch.set_num_threads(2)
        assert httpx.post(srv.url + CHAT, json=GOOD).status_code == 200
        assert slow.torch_threads == 1
    finally:
        srv.close()
        torch.set_num_threads(threads)


def test_max_tokens_beyond_the_context_is_cut_to_it(http):
    r = http.post("/v1/completions", json={"prompt": "x" * 250, "max_tokens": 100, "temperature": 0}).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["total_tokens"] <= 257


@pytest.mark.parametrize("name", ["tiny-chat", "tiny-chat.gguf", "tiny", None, "gpt-4o", "", "llama3:8b"])
def test_any_model_name_is_the_loaded_model(http, name):
    """As llama-server: Ollama-style clients send their own names; the answer names the model that served it."""
    r = http.post(CHAT, json=GOOD | ({} if name is None else {"model": name}))
    assert r.status_code == 200 and r.json()["model"] == "tiny-chat"
    assert http.get(f"/v1/models/{name or 'x'}").json()["id"] == "tiny-chat"


@pytest.mark.parametrize("name, status", [("tiny-chat", 200), ("tiny-chat.gguf", 200), ("tiny", 200),
                                          (None, 200), ("gpt-4o", 404), ("", 404)])
def test_strict_model_names(served, name, status):
    body = GOOD | ({} if name is None else {"model": name})
    r = httpx.post(served[3].url + CHAT, json=body)
    if status == 404:
        assert_error(r, 404, "does not exist", "tiny-chat", param="model", code="model_not_found")
        assert_error(httpx.get(served[3].url + "/v1/models/other"), 404, "does not exist")
    else:
        assert r.status_code == 200 and r.json()["model"] == "tiny-chat"


def test_routes_and_methods(http):
    assert_error(http.get("/v1/nothing"), 404, "no such route")
    assert_error(http.get(CHAT), 405, "method not allowed")
    still_serving(http)


def test_text_parts_and_developer_role(http):
    msgs = [{"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}]
    assert http.post(CHAT, json={"messages": msgs, "max_tokens": 2}).status_code == 200


def test_server_sent_events_on_the_wire(http):
    with http.stream("POST", CHAT, json=GOOD | {"stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    chunks = [json.loads(e[6:]) for e in events[:-2]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["choices"][0]["delta"] == {}


def test_internal_error_is_500_without_traceback(http, served):
    slow = served[1]
    slow.fail = True
    try:
        assert_error(http.post(CHAT, json=GOOD), 500, "internal error", "planted failure", code="internal_error")
        with http.stream("POST", CHAT, json=GOOD | {"stream": True}) as r:
            raw = r.read().decode()
        assert r.status_code == 200 and "planted failure" in raw and "Traceback" not in raw
        assert json.loads(raw.split("\n\n")[-2][6:])["error"]["code"] == "internal_error"
    finally:
        slow.fail = False
    still_serving(http)


def test_failure_in_a_handler_is_500_without_traceback(http, monkeypatch):
    def broken(*a, **kw):
        raise RuntimeError("planted failure in the handler")
    monkeypatch.setattr("pinfer_llm.runtime.serving.server.encode_chat", broken)
    assert_error(http.post(CHAT, json=GOOD), 500, "internal error", "planted failure in the handler",
                 code="internal_error")
    monkeypatch.undo()
    still_serving(http)


def test_api_key(served):
    url = served[2].url
    assert_error(httpx.post(url + CHAT, json=GOOD), 401, "Authorization: Bearer", code="invalid_api_key")
    assert_error(httpx.post(url + CHAT, json=GOOD, headers={"Authorization": "Bearer nope"}), 401, "incorrect",
                 code="invalid_api_key")
    assert_error(httpx.get(url + "/v1/models", headers={"Authorization": "Basic c2VzYW1l"}), 401)
    assert httpx.post(url + CHAT, json=GOOD, headers={"Authorization": "Bearer sesame"}).status_code == 200
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200
    assert httpx.get(url + "/health").json()["status"] == "ok"  # health checks need no key
