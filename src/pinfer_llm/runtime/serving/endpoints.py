"""The routes llama-server's users call besides the OpenAI API: /tokenize and /detokenize, /props, /slots,
/metrics, /v1/embeddings, and the chat page at /.

Each takes the Served context that server.create_app builds (the model, its names, the worker, the counters), and
does its parsing and tokenising off the event loop, as the generation routes do.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from pinfer_llm.runtime.serving.access import RECORD
from pinfer_llm.runtime.serving.embeddings import embed
from pinfer_llm.runtime.serving.metrics import Metrics, Slots
from pinfer_llm.runtime.serving.openai_api import (
    ApiError,
    GenRequest,
    bad,
    decode_json,
    embeddings_response,
    parse_detokenize,
    parse_embeddings,
    parse_tokenize,
)

MAX_TOKENIZE_CHARS = 1 << 20  # /tokenize counts text beyond the context too, up to ~1 s of tokenising


@dataclass
class Served:
    """What the routes share: built once by create_app."""
    m: Any
    model_id: str
    worker: Any
    metrics: Metrics
    slots: Slots
    pooling: str
    check_model: Callable[[str | None], None]
    check_length: Callable[[int, str], None]  # (characters, param): refuses text that cannot fit the context
    read_body: Callable  # async (request) -> bytes
    off_loop: Callable  # async (fn, *args) -> fn(*args) on a worker thread
    busy: Callable[[], ApiError]


def routes(s: Served) -> dict[str, tuple[Callable, list[str], bool]]:
    """path -> (endpoint, methods, public)."""
    m, tok = s.m, s.m.tokenizer

    async def tokenize(request: Request):
        raw = await s.read_body(request)

        def work():
            r = parse_tokenize(decode_json(raw))
            if len(r.content) > MAX_TOKENIZE_CHARS:
                raise bad("content", f"'content' holds {len(r.content)} characters; /tokenize takes at most "
                                     f"{MAX_TOKENIZE_CHARS}: send it in parts")
            ids = tok.encode(r.content, add_special=r.add_special)
            if not r.with_pieces:
                return JSONResponse({"tokens": ids})
            return JSONResponse({"tokens": [{"id": i, "piece": tok.decode([i])} for i in ids]})
        # the response is rendered on the worker thread too: 10^5 ids are ~20 ms of json.dumps
        return await s.off_loop(work)

    async def detokenize(request: Request):
        raw = await s.read_body(request)

        def work():
            ids = parse_detokenize(decode_json(raw))
            out = next((i for i in ids if not 0 <= i < m.cfg.vocab_size), None)
            if out is not None:
                raise bad("tokens", f"token id {out} is outside the vocabulary (0..{m.cfg.vocab_size - 1})")
            return JSONResponse({"content": tok.decode(ids)})
        return await s.off_loop(work)

    async def props(request: Request):
        d = GenRequest(chat=True)
        return JSONResponse({
            "model": s.model_id, "model_path": str(m.file.path), "n_ctx": m.ctx_size, "total_slots": s.slots.n,
            "chat_template": tok.chat_template or "", "pooling": s.pooling,
            "bos_token": _token(tok, tok.bos_id), "eos_token": _token(tok, tok.eos_id),
            "default_generation_settings": {
                "n_ctx": m.ctx_size, "model": s.model_id,
                "params": {"temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p, "min_p": d.min_p,
                           "repeat_penalty": d.repeat_penalty, "n_predict": -1, "cache_prompt": d.cache_prompt}},
            "build_info": f"pinfer {_version()}", "modalities": {"vision": False, "audio": False}})

    async def slots(request: Request):
        # counts only: what a slot's prompt says is the client's business, not every other client's
        out = []
        for i, rec in s.slots.snapshot():
            busy = rec is not None
            out.append({"id": i, "n_ctx": m.ctx_size, "is_processing": busy,
                        "endpoint": rec.endpoint if busy else None,
                        "n_prompt_tokens": rec.prompt_tokens if busy else 0,
                        "elapsed_s": round(time.perf_counter() - rec.arrived, 3) if busy else 0.0})
        return JSONResponse(out)

    async def metrics(request: Request):
        text = s.metrics.prometheus(generating=s.slots.busy, waiting=s.worker.waiting, slots=s.slots.n,
                                    ffn_active=m.sparsity(), ffn_read=m.read_counts(),
                                    n_ff=m.cfg.n_ff)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def embeddings(request: Request):
        raw = await s.read_body(request)

        def work():
            req = parse_embeddings(decode_json(raw), m.cfg.n_embd)
            s.check_model(req.model)
            all_ids = []
            for i, x in enumerate(req.inputs):
                param = "input" if len(req.inputs) == 1 else f"input[{i}]"
                if isinstance(x, str):
                    s.check_length(len(x), param)
                    x = tok.encode(x, add_special=True)
                if not x:
                    raise bad(param, f"'{param}' is empty")
                if len(x) > m.ctx_size:
                    raise ApiError(400, f"'{param}' takes {len(x)} tokens; this model's context holds {m.ctx_size}",
                                   param=param, code="context_length_exceeded")
                outside = next((t for t in x if not 0 <= t < m.cfg.vocab_size), None)
                if outside is not None:
                    raise bad(param, f"token id {outside} is outside the vocabulary (0..{m.cfg.vocab_size - 1})")
                all_ids.append(list(x))
            return req, all_ids

        req, all_ids = await s.off_loop(work)
        rec = request.scope.get(RECORD)
        if rec is not None:
            rec.endpoint, rec.prompt_tokens = "embeddings", sum(map(len, all_ids))
        if s.worker.full():
            raise s.busy()
        job = s.worker.submit(lambda cancel: iter([embed(m, all_ids, s.pooling)]))
        vecs = None
        try:
            async for item in job:
                vecs = item
        finally:
            job.cancel()
        if vecs is None:
            raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")
        return await s.off_loop(lambda: JSONResponse(embeddings_response(vecs, s.model_id, sum(map(len, all_ids)),
                                                                          req.base64)))

    async def page(request: Request):
        return HTMLResponse(chat_page())

    return {"/tokenize": (tokenize, ["POST"], False), "/detokenize": (detokenize, ["POST"], False),
            "/props": (props, ["GET"], False), "/slots": (slots, ["GET"], False),
            "/metrics": (metrics, ["GET"], False), "/v1/embeddings": (embeddings, ["POST"], False),
            "/": (page, ["GET"], True)}


@functools.cache
def chat_page() -> str:
    return resources.files("pinfer_llm.runtime.serving").joinpath("static/chat.html").read_text(encoding="utf-8")


def _token(tok, i: int | None) -> str:
    return tok.tokens[i] if i is not None and 0 <= i < len(tok.tokens) else ""


@functools.cache
def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pinfer-llm")
    except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
        return "unknown"
