"""The ASGI layer around pi-serve's routes: one log line per request and its count in /metrics, and no secret in
either. uvicorn's own access log is off (connections.uvicorn_config): it writes the query string, where a client
may have put its API key. Here the line has the path alone, and a query string that carries a credential is refused
before any route sees it: the key is accepted only from the Authorization header.

    app = AccessLog(starlette_app, metrics)
    # in a route: record = request.scope[RECORD]; record.prompt_tokens = ...
"""

from __future__ import annotations

import json
import logging
import time
from urllib.parse import parse_qsl

from pinfer_llm.runtime.serving.metrics import Metrics, RequestRecord
from pinfer_llm.runtime.serving.openai_api import error_body

RECORD = "pinfer.record"
# query parameters that name a credential, as clients of other servers send them (?key=, ?api_key=, ...)
SECRET_PARAMS = {"key", "api_key", "api-key", "apikey", "access_token", "token", "auth", "authorization",
                 "password", "secret"}

log = logging.getLogger("pi-serve")


class AccessLog:
    def __init__(self, app, metrics: Metrics, api_key: str | None = None):
        self.app, self.metrics, self.api_key = app, metrics, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        client = scope.get("client")
        rec = RequestRecord(scope["method"], scope["path"], client=client[0] if client else "-")
        scope[RECORD] = rec

        done = False

        def finish():
            nonlocal done
            if done:
                return
            done = True
            if not rec.status:  # the client left before an answer began
                rec.status = 499
            log.info("%s", rec.line(time.perf_counter()))
            self.metrics.record(rec)

        async def sending(message):
            if message["type"] == "http.response.start":
                rec.status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                # counted before its last bytes go: a client that has read its whole answer and asks /metrics
                # finds the request there (counted after the app returned, the next request on the same
                # connection could be answered first)
                finish()
            await send(message)

        try:
            if self._secret_in_query(scope.get("query_string", b"")):
                await refuse(sending, 400, "an API key or other credential in the URL is refused: URLs are kept in "
                                           "logs and browser history; send it as the header 'Authorization: Bearer "
                                           "KEY'", code="credential_in_url")
            else:
                await self.app(scope, receive, sending)
        finally:
            finish()

    def _secret_in_query(self, qs: bytes) -> bool:
        if not qs:
            return False
        try:
            pairs = parse_qsl(qs.decode("latin-1"), keep_blank_values=True)
        except ValueError:
            return False
        return any(k.lower() in SECRET_PARAMS or (self.api_key and self.api_key in (k, v)) for k, v in pairs)


async def refuse(send, status: int, message: str, code: str) -> None:
    body = json.dumps(error_body(message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
