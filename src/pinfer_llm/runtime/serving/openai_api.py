"""The OpenAI API's request and response shapes, without any I/O: request bodies are checked field by field into a
GenRequest (a bad field raises ApiError naming it), and responses, stream chunks and errors are built as dicts.

Sampling fields left out take pi-run's defaults (temperature 0.8, top_p 0.95, top_k 40, min_p 0.05), as
llama.cpp's server does. llama.cpp's own extensions are accepted too: top_k, min_p, repeat_penalty, cache_prompt,
n_predict (max_tokens by its llama.cpp name; -1: no limit). grammar and json_schema are refused with a 400: pinfer
has no constrained sampler, and a client that asked for a grammar must not get free text it thinks was checked.
presence_penalty and frequency_penalty other than 0 are refused: they subtract from the logits of tokens already
seen (once, or per occurrence), while pinfer's sampler has llama.cpp's repetition penalty, which divides them; one
is no stand-in for the other, so the error says to pass repeat_penalty instead.
"""

from __future__ import annotations

import base64
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

MAX_STOP_STRINGS = 16
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class ApiError(Exception):
    """An error response in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class GenRequest:
    chat: bool
    model: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)  # chat: roles system/user/assistant, text only
    prompt: str | list[int] = ""  # completions: text, or token ids
    max_tokens: int | None = None  # None: until a stop or the end of the context
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    cache_prompt: bool = True

    def sampling(self) -> dict:
        """Keyword arguments for Model.generate."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "repeat_penalty": self.repeat_penalty, "seed": self.seed}


def decode_json(raw: bytes) -> Any:
    """A request body as JSON, or a 400 naming what is wrong. Runs off the event loop (server.py): a 15 MB body
    takes a while. Refused here: nesting deep enough to exhaust Python's recursion ('[' * 100000), and strings
    holding a lone UTF-16 surrogate ("\\ud800"), valid JSON that is no text: no tokenizer, log or response can
    encode it, so it is caught once here rather than as a 500 wherever it would reach."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({_short(str(e))[1:-1]})",
                       code="invalid_json") from None
    if not _may_hold_surrogates(raw):
        return body
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        where = next((k for k, v in body.items() if not _encodes(k) or not _encodes(v)), None) \
            if isinstance(body, dict) else None
        raise ApiError(400, "the request holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not a "
                            "character; send UTF-8 text", param=where if where is None or _encodes(where) else None,
                       code="invalid_text") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply", code="invalid_json") from None
    return body


# A UTF-16 surrogate reaches a parsed body only as a \uD800-\uDFFF escape, as UTF-8-encoded surrogate bytes
# (json.loads decodes bytes with 'surrogatepass') or in a UTF-16/32 body.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE_UTF8 = re.compile(rb"\xed[\xa0-\xbf]")


def _may_hold_surrogates(raw: bytes) -> bool:
    """Whether the body may hold a surrogate, from its bytes. Re-encoding every parsed body instead held the GIL
    twice as long as parsing it (a 15 MB body: 55 ms against 29 for json.loads and ~17 for these scans), and with it
    the event loop, which then could not answer /health within 100 ms."""
    if not isinstance(raw, bytes) or 0 in raw[:4]:  # str, or a UTF-16/32 body: the full check
        return True
    # bytes.find first: a plain body has neither lead (a fast memory scan), and the regular expressions run only
    # where one occurs
    return (b"\\u" in raw and _SURROGATE_ESCAPE.search(raw) is not None) or \
        (b"\xed" in raw and _SURROGATE_UTF8.search(raw) is not None)


def _encodes(v: Any) -> bool:
    try:
        json.dumps(v, ensure_ascii=False).encode()
        return True
    except UnicodeEncodeError:
        return False


def parse_chat(body: Any) -> GenRequest:
    body = _object(body)
    req = GenRequest(chat=True)
    _common(body, req)
    limit = body.get("max_completion_tokens")  # the newer name in the chat API; wins over max_tokens
    if limit is not None:
        req.max_tokens = _int(body, "max_completion_tokens", 0)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "'messages' must be a non-empty array of {role, content} objects")
    req.messages = [_message(m, i) for i, m in enumerate(msgs)]
    for name in ("tools", "functions", "tool_choice"):
        _unsupported(body, name, "tool calls are not supported")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad("response_format", "'response_format' is not supported (only {\"type\": \"text\"})",
                  "unsupported_parameter")
    return req


def parse_completion(body: Any) -> GenRequest:
    body = _object(body)
    req = GenRequest(chat=False)
    _common(body, req)
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]  # one prompt in an array; several prompts would be a batch, which this server does not run
    if isinstance(p, str):
        req.prompt = p
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        req.prompt = list(p)
    else:
        raise bad("prompt", "'prompt' must be a string, an array holding one string, or an array of token ids "
                            "(one prompt per request)")
    for name in ("suffix", "echo", "best_of"):
        if name == "best_of" and body.get(name) in (None, 1):
            continue
        _unsupported(body, name, "it is not supported")
    return req


def _common(body: dict, req: GenRequest) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "'model' must be a string")
    req.model = model
    if body.get("max_tokens") is not None:
        req.max_tokens = _int(body, "max_tokens", 0)
    elif body.get("n_predict") is not None:  # llama.cpp's name; its -1 is "until a stop or the context's end"
        n = _int(body, "n_predict", -1)
        req.max_tokens = None if n == -1 else n
    req.temperature = _num(body, "temperature", 0.0, 2.0, req.temperature)
    req.top_p = _num(body, "top_p", 0.0, 1.0, req.top_p)
    req.min_p = _num(body, "min_p", 0.0, 1.0, req.min_p)
    req.repeat_penalty = _num(body, "repeat_penalty", 1e-3, 10.0, req.repeat_penalty)
    if body.get("top_k") is not None:
        req.top_k = _int(body, "top_k", 0)
    if body.get("seed") is not None:
        req.seed = _int(body, "seed", -(2**63), 2**64 - 1)
    req.stop = _stop(body.get("stop"))
    req.stream = _bool(body, "stream", False)
    req.cache_prompt = _bool(body, "cache_prompt", True)
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("stream_options", "'stream_options' must be an object")
        req.include_usage = _bool(opts, "include_usage", False, "stream_options.include_usage")
    for name in ("presence_penalty", "frequency_penalty"):
        if _num(body, name, -2.0, 2.0, 0.0) != 0.0:
            raise bad(name, f"'{name}' is not supported: pinfer has llama.cpp's repetition penalty, which divides "
                            f"the logits of recent tokens instead of subtracting from them; pass 'repeat_penalty' "
                            f"(e.g. 1.1) instead, or {name} 0", "unsupported_parameter")
    if body.get("n") not in (None, 1):
        raise bad("n", "'n' must be 1: one completion per request", "unsupported_parameter")
    for name in ("logprobs", "top_logprobs", "logit_bias"):
        _unsupported(body, name, "it is not supported")
    for name in ("grammar", "json_schema"):
        _unsupported(body, name, "constrained sampling is not supported: pinfer would answer with unconstrained "
                                 "text; leave it out")


def _unsupported(body: dict, name: str, why: str) -> None:
    if body.get(name) not in (None, False, 0, {}, []):
        raise bad(name, f"'{name}': {why}", "unsupported_parameter")


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def _message(m: Any, i: int) -> dict[str, str]:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(param, f"'{param}' must be an object with 'role' and 'content'")
    role = m.get("role")
    if not isinstance(role, str) or role not in ROLES:  # a list or dict role is unhashable: checked first
        raise bad(f"{param}.role", f"'{param}.role' must be one of {', '.join(ROLES)} (got {_short(role)})")
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text ones
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"{param}.content[{j}]", f"'{param}.content[{j}]': only text parts are supported")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise bad(f"{param}.content", f"'{param}.content' must be a string or an array of text parts")
    return {"role": ROLES[role], "content": content}


def _stop(v: Any) -> list[str]:
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)
            or len(stops) > MAX_STOP_STRINGS):
        raise bad("stop", f"'stop' must be a non-empty string or an array of at most {MAX_STOP_STRINGS} of them")
    return stops


def _num(body: dict, name: str, lo: float, hi: float, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
        raise bad(name, f"'{name}' must be a number from {lo:g} to {hi:g} (got {_short(v)})")
    return float(v)


def _int(body: dict, name: str, lo: int, hi: int | None = None) -> int:
    v = body.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise bad(name, f"'{name}' must be an integer >= {lo} (got {_short(v)})")
    return v


def _short(v: Any) -> str:
    """A value for an error message: a 15 MB string is not repeated back in full."""
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _bool(body: dict, name: str, default: bool, param: str | None = None) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(param or name, f"'{param or name}' must be true or false (got {_short(v)})")
    return v


# ---- responses ---------------------------------------------------------------------------------------------------

def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


@dataclass
class Reply:
    """What every response and chunk of one request shares. `timings` (llama-server's figures, see timings()) is
    set when the generation ends and goes into the full response and the stream's last chunk."""
    chat: bool
    model: str
    id: str = ""
    created: int = 0
    timings: dict | None = None

    def __post_init__(self):
        self.id = self.id or new_id(self.chat)
        self.created = self.created or int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish_reason: str, usage: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            return self._head("chat.completion") | {"choices": [choice], "usage": usage} | self._timings()
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._head("text_completion") | {"choices": [choice], "usage": usage} | self._timings()

    def _timings(self) -> dict:
        return {} if self.timings is None else {"timings": self.timings}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            last = self._timings() if finish_reason else {}
            return self._head("chat.completion.chunk") | {"choices": [choice]} | last
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return self._head("text_completion") | {"choices": [choice]} | (self._timings() if finish_reason else {})

    def usage_chunk(self, usage: dict) -> dict:
        """The last chunk when stream_options.include_usage is set: no choices, the usage."""
        return self._head("chat.completion.chunk" if self.chat else "text_completion") | {"choices": [],
                                                                                          "usage": usage}


def timings(prompt_n: int, prompt_s: float, predicted_n: int, predicted_s: float, cache_n: int = 0) -> dict:
    """llama-server's `timings`: prompt tokens computed (those taken from the cache are cache_n) and generated, each
    with its time in ms, per token and per second."""
    def rate(n, s):
        return (s * 1e3 / n if n else 0.0), (n / s if s > 0 else 0.0)

    ppt, pps = rate(prompt_n, prompt_s)
    dpt, dps = rate(predicted_n, predicted_s)
    return {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": round(prompt_s * 1e3, 3),
            "prompt_per_token_ms": round(ppt, 3), "prompt_per_second": round(pps, 3),
            "predicted_n": predicted_n, "predicted_ms": round(predicted_s * 1e3, 3),
            "predicted_per_token_ms": round(dpt, 3), "predicted_per_second": round(dps, 3)}


# ---- llama-server's /tokenize and /detokenize, OpenAI's /v1/embeddings -------------------------------------------

MAX_EMBEDDING_INPUTS = 64


@dataclass
class TokenizeRequest:
    content: str
    add_special: bool = False
    with_pieces: bool = False


def parse_tokenize(body: Any) -> TokenizeRequest:
    body = _object(body)
    content = body.get("content")
    if not isinstance(content, str):
        raise bad("content", "'content' must be a string")
    return TokenizeRequest(content, _bool(body, "add_special", False), _bool(body, "with_pieces", False))


def parse_detokenize(body: Any) -> list[int]:
    body = _object(body)
    toks = body.get("tokens")
    if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
        raise bad("tokens", "'tokens' must be an array of token ids")
    return toks


@dataclass
class EmbeddingRequest:
    inputs: list[str | list[int]]
    model: str | None = None
    base64: bool = False


def parse_embeddings(body: Any, n_embd: int) -> EmbeddingRequest:
    body = _object(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "'model' must be a string")
    x = body.get("input")
    if isinstance(x, str) or (isinstance(x, list) and x and all(_is_id(t) for t in x)):
        inputs = [x]
    elif isinstance(x, list) and x and all(isinstance(e, str) or (isinstance(e, list) and e and all(map(_is_id, e)))
                                           for e in x):
        inputs = list(x)
    else:
        raise bad("input", "'input' must be a string, an array of strings, an array of token ids, or an array of "
                           "such arrays (none empty)")
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise bad("input", f"'input' holds {len(inputs)} inputs; at most {MAX_EMBEDDING_INPUTS} per request")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad("encoding_format", "'encoding_format' must be \"float\" or \"base64\"")
    dims = body.get("dimensions")
    if dims is not None and dims != n_embd:
        raise bad("dimensions", f"'dimensions': this model's embeddings have {n_embd} (leave it out)",
                  "unsupported_parameter")
    return EmbeddingRequest(inputs, model, fmt == "base64")


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def embeddings_response(vectors, model: str, prompt_tokens: int, as_base64: bool) -> dict:
    """vectors: float32 [n, d] (numpy). base64 is the little-endian float32 bytes, as OpenAI's client expects."""
    def enc(v):
        return base64.b64encode(v.astype("<f4").tobytes()).decode() if as_base64 else [float(f) for f in v]

    data = [{"object": "embedding", "index": i, "embedding": enc(v)} for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
