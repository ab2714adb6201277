"""The OpenAI API's request and response shapes, without any I/O: request bodies are checked field by field into a
GenRequest (a bad field raises ApiError naming it), and responses, stream chunks and errors are built as dicts.

Sampling fields left out take pi-run's defaults (temperature 0.8, top_p 0.95, top_k 40, min_p 0.05), as
llama.cpp's server does. llama.cpp's own extensions are accepted too: top_k, min_p, repeat_penalty, cache_prompt.
presence_penalty and frequency_penalty other than 0 are refused: they subtract from the logits of tokens already
seen (once, or per occurrence), while pinfer's sampler has llama.cpp's repetition penalty, which divides them; one
is no stand-in for the other, so the error says to pass repeat_penalty instead.
"""

from __future__ import annotations

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
    if role not in ROLES:
        raise bad(f"{param}.role", f"'{param}.role' must be one of {', '.join(ROLES)} (got {role!r})")
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
        raise bad(name, f"'{name}' must be a number from {lo:g} to {hi:g} (got {v!r})")
    return float(v)


def _int(body: dict, name: str, lo: int, hi: int | None = None) -> int:
    v = body.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise bad(name, f"'{name}' must be an integer >= {lo} (got {v!r})")
    return v


def _bool(body: dict, name: str, default: bool, param: str | None = None) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(param or name, f"'{param or name}' must be true or false (got {v!r})")
    return v


# ---- responses ---------------------------------------------------------------------------------------------------

def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


@dataclass
class Reply:
    """What every response and chunk of one request shares."""
    chat: bool
    model: str
    id: str = ""
    created: int = 0

    def __post_init__(self):
        self.id = self.id or new_id(self.chat)
        self.created = self.created or int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish_reason: str, usage: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            return self._head("chat.completion") | {"choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._head("text_completion") | {"choices": [choice], "usage": usage}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._head("chat.completion.chunk") | {"choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return self._head("text_completion") | {"choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        """The last chunk when stream_options.include_usage is set: no choices, the usage."""
        return self._head("chat.completion.chunk" if self.chat else "text_completion") | {"choices": [],
                                                                                          "usage": usage}
