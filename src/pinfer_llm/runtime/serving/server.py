"""pi-serve's HTTP side: the OpenAI API over one loaded Model, on Starlette (served by uvicorn, see cli/serve.py).

    app = create_app(m, names=["smollm2"], api_key=None, max_waiting=8)

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{id}], GET /health, and llama-server's
(endpoints.py): /tokenize, /detokenize, /props, /slots, /metrics, /v1/embeddings, the chat page at /. Requests are
read on the event loop, then parsed and tokenised on a thread, so neither a 15 MB body nor a long prompt keeps
/health or any other client waiting; generations then run on the ModelWorker's thread, up to `parallel` decoded
together in one batch (continuous batching, worker.py), the rest queued in arrival order. Any
`model` name is served with the loaded model (clients send their own names), unless strict_model. Every error,
ours or unexpected, is answered in OpenAI's error shape, and a traceback goes only to the server's log. Each
request gets one log line (access.py); CORS only for the origins in `cors`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
from collections.abc import Sequence
from pathlib import Path

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pinfer_llm.formats.errors import PinferError
from pinfer_llm.runtime.generation.chat import encode_chat
from pinfer_llm.runtime.sampling import SamplingParams
from pinfer_llm.runtime.serving import endpoints
from pinfer_llm.runtime.serving.access import RECORD, AccessLog
from pinfer_llm.runtime.serving.embeddings import POOLINGS
from pinfer_llm.runtime.serving.metrics import Metrics, Observer, Slots
from pinfer_llm.runtime.serving.openai_api import (
    ApiError,
    GenRequest,
    Reply,
    decode_json,
    error_body,
    parse_chat,
    parse_completion,
)
from pinfer_llm.runtime.serving.worker import Generation, ModelWorker

log = logging.getLogger("pi-serve")
RETRY_AFTER_S = 2  # what a refused client is told to wait: a few tokens' time frees a place in the queue
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MAX_BODY_BYTES = 16 << 20  # far above any context's worth of text
PARSERS = 4  # requests parsed and tokenised at once, on threads: more wait, and hold no more memory than their body


def model_names(m, extra: Sequence[str] = ()) -> list[str]:
    """The served model's id (its file stem) first, then every other name a request may use for it."""
    path = Path(m.file.path)
    general = m.file.metadata.get("general.name")
    names = [path.stem, path.name, *extra] + ([general] if isinstance(general, str) else [])
    return list(dict.fromkeys(n for n in names if n))


def create_app(m, names: Sequence[str] = (), api_key: str | None = None, max_waiting: int = 8,
               threads: int | None = None, strict_model: bool = False, cors: Sequence[str] = (),
               pooling: str = "mean", parallel: int = 4) -> Starlette:
    if pooling not in POOLINGS:
        raise PinferError(f"--pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    names = model_names(m, names)
    model_id = names[0]
    worker = ModelWorker(m, threads=threads, max_waiting=max_waiting, parallel=parallel)
    metrics, slots = Metrics(), Slots(worker.parallel)
    parsers = anyio.CapacityLimiter(PARSERS)
    # no token spells more characters than the longest one's text (a byte-level BPE token's text has a character
    # per byte, a text character takes at least one): text longer than ctx * longest cannot fit, and is refused
    # before tokenising it costs seconds and a GiB
    longest = max((len(t) for t in m.tokenizer.tokens), default=1) or 1

    def check_model(name: str | None) -> None:
        if strict_model and name is not None and name not in names:
            raise ApiError(404, f"the model '{name}' does not exist: this server serves '{model_id}'",
                           param="model", code="model_not_found")

    def check_length(chars: int, what: str) -> None:
        if chars > m.ctx_size * longest:
            raise ApiError(400, f"this model's context holds {m.ctx_size} tokens, but the {what} take at least "
                                f"{chars // longest} ({chars} characters); shorten the {what}, or restart pi-serve "
                                f"with a larger -c", param=what, code="context_length_exceeded")

    async def off_loop(fn, *args):
        return await anyio.to_thread.run_sync(fn, *args, limiter=parsers)

    def check_prompt(ids: list[int], req: GenRequest) -> None:
        what = "messages" if req.chat else "prompt"
        if not ids:
            raise ApiError(400, f"the {what} is empty", param=what)
        if len(ids) + 1 > m.ctx_size:
            raise ApiError(400, f"this model's context holds {m.ctx_size} tokens, but the {what} take {len(ids)} "
                                f"and the answer needs at least one more; shorten the {what}, or restart pi-serve "
                                f"with a larger -c", param=what, code="context_length_exceeded")
        bad = next((i for i in ids if not 0 <= i < m.cfg.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary (0..{m.cfg.vocab_size - 1})", param=what)

    async def chat_completions(request: Request):
        raw = await read_body(request)

        def prepare():
            req = parse_chat(decode_json(raw))
            check_model(req.model)
            check_length(sum(len(msg["content"]) for msg in req.messages), "messages")
            try:
                return req, encode_chat(m.tokenizer, req.messages)
            except PinferError as e:  # no template, or the template refused the conversation (roles out of order...)
                raise ApiError(400, str(e), param="messages") from None
        req, ids = await off_loop(prepare)
        return observed(request, start(req, ids), len(ids))

    async def completions(request: Request):
        raw = await read_body(request)

        def prepare():
            req = parse_completion(decode_json(raw))
            check_model(req.model)
            if isinstance(req.prompt, str):
                check_length(len(req.prompt), "prompt")
                return req, m.tokenizer.encode(req.prompt)
            return req, req.prompt
        req, ids = await off_loop(prepare)
        return observed(request, start(req, ids), len(ids))

    def observed(request: Request, resp: GenerationResponse, prompt_tokens: int) -> GenerationResponse:
        """The response, its generation stamped for the log line, /metrics, /slots and `timings`."""
        rec = request.scope.get(RECORD)
        if rec is not None:
            rec.endpoint = "chat" if resp.req.chat else "completion"
            rec.prompt_tokens = prompt_tokens
            resp.gen.observer = Observer(rec, slots, lambda t: setattr(resp.reply, "timings", t))
        return resp

    def busy() -> ApiError:
        return ApiError(503, f"the server is busy: {worker.generating} requests are generating (--parallel "
                             f"{worker.parallel}) and {worker.waiting} are waiting (--queue {worker.max_waiting}); "
                             f"retry in a moment", type="server_error", code="server_busy",
                        headers={"Retry-After": str(RETRY_AFTER_S)})

    def start(req: GenRequest, ids: list[int]) -> GenerationResponse:
        check_prompt(ids, req)
        if worker.full():
            raise busy()
        room = m.ctx_size - len(ids)
        max_tokens = room if req.max_tokens is None else min(req.max_tokens, room)
        try:
            sampling = SamplingParams(**req.sampling())
        except PinferError as e:  # parse_chat/parse_completion check each value; this is the sampler's own word
            raise ApiError(400, str(e)) from None
        gen = Generation(ids, max_tokens, sampling, stop=req.stop, reuse_prefix=req.cache_prompt)
        return GenerationResponse(worker, req, Reply(req.chat, model_id), gen)

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: Request):
        check_model(request.path_params["name"])  # any name is the loaded model, unless strict_model
        return JSONResponse(model_card())

    def model_card() -> dict:
        created = int(Path(m.file.path).stat().st_mtime)
        return {"id": model_id, "object": "model", "created": created, "owned_by": "pinfer",
                "meta": {"context_length": m.ctx_size, "n_vocab": m.cfg.vocab_size, "ffn_mode": m.ffn_mode,
                         "threads": threads or m.threads}}

    async def health(request: Request):
        return JSONResponse({"status": "ok", "model": model_id, "generating": worker.generating,
                             "waiting": worker.waiting, "slots": worker.parallel})

    def guarded(fn, public: bool = False):
        """Auth, then fn; every error becomes an OpenAI-shaped response, never a traceback."""
        async def endpoint(request: Request):
            try:
                if api_key and not public:
                    authorize(request, api_key)
                return await fn(request)
            except ApiError as e:
                return error_response(e)
            except Exception as e:  # noqa: BLE001 - the server keeps serving; the log gets the traceback
                log.exception("internal error on %s %s", request.method, request.url.path)
                return error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}",
                                               type="server_error", code="internal_error"))
        return endpoint

    async def http_error(request: Request, exc: HTTPException):
        what = {404: "no such route", 405: "method not allowed"}.get(exc.status_code, exc.detail)
        hint = ("; a browser page from another origin needs pi-serve --cors ORIGIN"
                if request.method == "OPTIONS" and not cors else "")
        return error_response(ApiError(exc.status_code, f"{what}: {request.method} {request.url.path}{hint}",
                                       code=str(exc.status_code), headers=exc.headers))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        worker.close()

    served = endpoints.Served(m, model_id, worker, metrics, slots, pooling, check_model, check_length, read_body,
                              off_loop, busy)
    routes = [Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
              Route("/v1/completions", guarded(completions), methods=["POST"]),
              Route("/v1/models", guarded(models), methods=["GET"]),
              Route("/v1/models/{name:path}", guarded(model), methods=["GET"]),
              Route("/health", guarded(health, public=True), methods=["GET"])]
    routes += [Route(path, guarded(fn, public=public), methods=methods)
               for path, (fn, methods, public) in endpoints.routes(served).items()]
    middleware = [Middleware(AccessLog, metrics=metrics, api_key=api_key)]
    if cors:  # browsers' preflight (OPTIONS) and CORS headers for these origins only; "*": any origin
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors), allow_methods=["GET", "POST"],
                                     allow_headers=["Authorization", "Content-Type"], max_age=600))
    app = Starlette(routes=routes, middleware=middleware, exception_handlers={HTTPException: http_error},
                    lifespan=lifespan)
    app.state.worker, app.state.model_id, app.state.metrics = worker, model_id, metrics
    return app


def authorize(request: Request, api_key: str) -> None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise ApiError(401, "missing API key: send the header 'Authorization: Bearer KEY' with the key pi-serve was "
                            "started with (--api-key)", code="invalid_api_key")
    if not secrets.compare_digest(token.strip().encode(), api_key.encode()):
        raise ApiError(401, "incorrect API key", code="invalid_api_key")


async def read_body(request: Request) -> bytes:
    body = bytearray()
    async for chunk in request.stream():  # read in pieces, so an oversized body is refused before it fills memory
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB", code="body_too_large")
    return bytes(body)


def error_response(e: ApiError) -> Response:
    # ASCII-escaped: a message can never fail to encode, whatever a client sent
    return Response(json.dumps(e.body()), e.status, headers=e.headers, media_type="application/json")


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class GenerationResponse:
    """An ASGI response that waits for the model, generates, and answers as one JSON body or as server-sent events.
    It listens for the client's disconnect the whole time: a client that leaves while queued leaves the queue, one
    that leaves while its answer is generated leaves the batch at the next step."""

    def __init__(self, worker: ModelWorker, req: GenRequest, reply: Reply, gen: Generation):
        self.worker, self.req, self.reply, self.gen = worker, req, reply, gen

    async def __call__(self, scope, receive, send) -> None:
        job = None

        async def work():
            nonlocal job
            if self.req.stream:
                await send({"type": "http.response.start", "status": 200,
                            "headers": headers({"content-type": "text/event-stream; charset=utf-8"} | SSE_HEADERS)})
            job = self.worker.generate(self.gen)
            await (self.stream(job, send) if self.req.stream else self.whole(job, send))

        try:
            async with anyio.create_task_group() as tg:
                async def watch():
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()  # the client has gone: stop waiting, stop sending

                tg.start_soon(watch)
                await work()
                tg.cancel_scope.cancel()
        finally:
            if job is not None:
                job.cancel()  # a no-op after a finished generation; else the thread stops at the next token

    async def whole(self, job, send) -> None:
        parts, body, status = [], None, 200
        try:
            async for item in job:
                if isinstance(item, str):
                    parts.append(item)
                else:
                    body = self.reply.full("".join(parts), item.finish_reason, item.usage)
        except Exception as e:  # noqa: BLE001 - a failure inside generation: answer it, log the traceback
            log.error("generation failed", exc_info=e)
            body, status = error_body(f"internal error: {type(e).__name__}: {e}", "server_error",
                                      code="internal_error"), 500
        if body is None:  # cancelled before it began: only at shutdown, when nobody reads the answer
            body, status = error_body("the server is shutting down", "server_error", code="shutting_down"), 503
        data = json.dumps(body, ensure_ascii=False).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": headers({"content-type": "application/json", "content-length": str(len(data))})})
        await send({"type": "http.response.body", "body": data})

    async def stream(self, job, send) -> None:
        r = self.reply

        async def event(obj):
            await send({"type": "http.response.body", "body": sse(obj), "more_body": True})

        try:
            if r.chat:
                await event(r.chunk(first=True))
            async for item in job:
                if isinstance(item, str):
                    await event(r.chunk(item))
                else:
                    await event(r.chunk(finish_reason=item.finish_reason))
                    if self.req.include_usage:
                        await event(r.usage_chunk(item.usage))
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        except Exception as e:  # noqa: BLE001 - headers are gone: the error travels as an event, as OpenAI's does
            log.error("generation failed", exc_info=e)
            await send({"type": "http.response.body", "more_body": False,
                        "body": sse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error",
                                               code="internal_error"))})


def headers(h: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode(), v.encode()) for k, v in h.items()]
