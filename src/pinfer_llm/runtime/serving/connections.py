"""pi-serve's connections: a client gets `timeout` seconds to send a whole request (headers and body), and at most
`max_connections` are open at once; an idle keep-alive connection is closed after KEEP_ALIVE_S.

uvicorn closes idle keep-alive connections, but a connection that never completes a request (partial headers, a
body dripped a byte a second) would stay open for ever, and enough of them use up the process's descriptors. So the
HTTP protocol is uvicorn's h11 one with a deadline per request: armed when the connection opens and again after
each response, disarmed once the request has arrived whole (a long generation is not limited by it). A connection
beyond the bound is answered 503 in OpenAI's shape and closed at once.

    config = uvicorn_config(app, timeout=30, max_connections=512, log_level="info")
    uvicorn.Server(config).run(sockets=[sock])

The HTTP parser is httptools' (C, llhttp) and the event loop uvloop's where they are installed (uvicorn's own
choice; both are pinfer's dependencies, uvloop except on Windows), else h11 and asyncio's: each streamed token is one
event through the loop and the parser's framing, on the cores the decode step needs.
"""

from __future__ import annotations

import asyncio
import json
import logging

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools not installed: uvicorn's module imports it
    HttpToolsProtocol = None

from pinfer_llm.runtime.serving.openai_api import error_body

TIMEOUT_S = 30.0  # a request's headers and body; far longer than any client on a working network needs
MAX_CONNECTIONS = 512
KEEP_ALIVE_S = 5  # uvicorn's default: an idle connection between requests

log = logging.getLogger("pi-serve")


def uvicorn_config(app, timeout: float = TIMEOUT_S, max_connections: int = MAX_CONNECTIONS, parser: str = "auto",
                   **kw) -> uvicorn.Config:
    """uvicorn's Config with the guarded protocol and without uvicorn's access log (the server writes its own
    line per request, without the query string: see access.py). parser: "httptools", "h11", or "auto" (httptools
    where installed)."""
    if parser == "auto":
        parser = "h11" if HttpToolsProtocol is None else "httptools"
    base = GuardedHttpTools if parser == "httptools" else GuardedH11
    protocol = type(base.__name__, (base,), {"request_timeout": timeout, "max_connections": max_connections})
    return uvicorn.Config(app, http=protocol, access_log=False, timeout_keep_alive=KEEP_ALIVE_S, **kw)


class Guard:
    """The deadline and the bound, over either of uvicorn's HTTP protocols (the classes below): each tells, in its
    own hook, when a request has arrived whole (_arrived)."""
    request_timeout: float = TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        if len(self.connections) > self.max_connections:
            body = json.dumps(error_body(f"the server has {self.max_connections} connections open, its limit "
                                         f"(--max-connections); retry in a moment", "server_error",
                                         code="server_busy")).encode()
            transport.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                            b"retry-after: 2\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            transport.close()
            return
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        if not self._answering():
            self._deadline = self.loop.call_later(self.request_timeout, self._expire)

    def _answering(self) -> bool:
        """Has the current request arrived whole, its answer not yet complete? (A pipelined one may have arrived
        before the answer to the one before it is done: httptools' protocol makes it current at once.)"""
        c = self.cycle
        return c is not None and not c.more_body and not c.response_complete

    def _disarm(self) -> None:
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            client = f"{self.client[0]}:{self.client[1]} " if self.client else ""
            log.info("%sdropped: no complete request within %gs (--timeout)", client, self.request_timeout)
            self.transport.close()

    def _arrived(self) -> None:
        # a request that has arrived whole (its body too): what it does next is not bound by the deadline
        if self._deadline is not None and self._answering():
            self._disarm()

    def on_response_complete(self) -> None:
        # armed first (unless a pipelined request has already arrived whole): uvicorn goes on to a pipelined
        # request, whose arrival then disarms it
        self._arm()  # the next request on this connection has its own `timeout` to arrive
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


class GuardedH11(Guard, H11Protocol):
    def handle_events(self) -> None:
        super().handle_events()
        self._arrived()


if HttpToolsProtocol is not None:
    class GuardedHttpTools(Guard, HttpToolsProtocol):
        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._arrived()
else:
    GuardedHttpTools = GuardedH11
