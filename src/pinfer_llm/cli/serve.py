"""pi-serve: an OpenAI-compatible HTTP server for one GGUF/PWRI model (the API itself is in runtime/serving/server.py).

    pi-serve smollm2                                  # http://127.0.0.1:8080/v1/chat/completions
    pi-serve model.gguf --port 8000 -t 4 -c 4096 --api-key KEY
    pi-serve -m model.gguf -ngl 99                    # as llama-server: every layer on the GPU
    pi-serve smollm2 --cors http://localhost:3000     # a web front-end on another origin may call it
"""

from __future__ import annotations

import logging
import socket
import sys
from typing import Annotated

import typer

from pinfer_llm.cli import interrupts_raise
from pinfer_llm.cli.options import (
    Dense,
    FfnAct,
    Gpu,
    KvType,
    ModelArg,
    ModelOpt,
    NGpuLayers,
    OracleMasks,
    PlacementOpt,
    Sparse,
    VramBudget,
    checked_threads,
    ffn_mode,
    pick_model,
    print_warnings,
    run_app,
    utf8,
    version_option,
    warn_ctx,
)
from pinfer_llm.cli.threads import BusyCores, warn_if_busy
from pinfer_llm.formats.errors import QUOTE_LIMIT, PinferError, quote, report

# runtime/serving/connections.py's defaults, repeated so that `pi-serve --help` need not import torch
# (tests/test_server_cli.py checks they agree)
TIMEOUT_S, MAX_CONNECTIONS = 30.0, 512

app = typer.Typer(add_completion=False, rich_markup_mode=None, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]})


@app.command()
def serve(
    model_arg: ModelArg = None,
    model_opt: ModelOpt = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (0.0.0.0: every interface).")]
    = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port (0: any free one, printed at start).")] = 8080,
    threads: Annotated[int | None, typer.Option("-t", "--threads", help="CPU threads (default: all cores).")] = None,
    ctx_size: Annotated[int | None, typer.Option("-c", "--ctx-size", help="Context length (KV cache size).")] = None,
    parallel: Annotated[int, typer.Option("-np", "--parallel", help="Requests decoded together in one batch, each "
                                          "in its own KV cache slot (as llama-server's -np).")] = 4,
    queue: Annotated[int, typer.Option("--queue", help="Requests that may wait while every slot is generating; "
                                       "more get 503 with Retry-After.")] = 8,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="PINFER_API_KEY", help="Require "
                                                "'Authorization: Bearer KEY' (also from $PINFER_API_KEY).")] = None,
    strict_model: Annotated[bool, typer.Option("--strict-model", help="Refuse (404) a request naming another model; "
                                               "by default any name is served with the loaded model, as "
                                               "llama-server does.")] = False,
    cors: Annotated[list[str] | None, typer.Option("--cors", help="Allow browser pages from ORIGIN (e.g. "
                                                   "http://localhost:3000; '*': any) to call the API; repeatable. "
                                                   "Default: none, only the page pi-serve serves at /.")] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds a client has to send a whole request; a "
                                           "connection that has not is closed.")] = TIMEOUT_S,
    max_connections: Annotated[int, typer.Option("--max-connections", help="Open connections at most; more are "
                                                 "answered 503 and closed.")] = MAX_CONNECTIONS,
    pooling: Annotated[str, typer.Option("--pooling", help="/v1/embeddings: pool the last hidden states by 'mean', "
                                         "'last' or 'cls' (first token).")] = "mean",
    ffn_act: FfnAct = None,
    sparse: Sparse = False,
    dense: Dense = False,
    oracle_masks: OracleMasks = False,
    gpu: Gpu = "auto",
    n_gpu_layers: NGpuLayers = None,
    placement: PlacementOpt = None,
    vram_budget: VramBudget = None,
    kv_type: KvType = "f16",
    verbose: Annotated[bool, typer.Option("--verbose", help="Show tracebacks on errors.")] = False,
    version: version_option("pi-serve") = False,
) -> None:
    """Serve a model over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models),
    llama-server's endpoints (/tokenize, /detokenize, /props, /slots, /metrics, /health) and a chat page at /."""
    try:
        interrupts_raise()  # here, not in main(): a Ctrl-C while typer parses is still one line
        model = pick_model(model_arg, model_opt)
        mode = ffn_mode(sparse, dense, oracle_masks)
        if queue < 0:
            raise PinferError(f"--queue must be >= 0, got {queue}")
        if not 1 <= parallel <= 256:
            raise PinferError(f"--parallel must be from 1 to 256, got {parallel}")
        threads = checked_threads(threads, "pi-serve")  # capped to the cores, as pi-run's
        if not timeout > 0:
            raise PinferError(f"--timeout must be > 0 seconds, got {timeout:g}")
        if max_connections < 1:
            raise PinferError(f"--max-connections must be >= 1, got {max_connections}")
        check_api_key(api_key)
        for origin in cors or ():
            if not utf8("--cors", origin).strip():
                raise PinferError("--cors is empty (an unset variable?); pass an origin such as http://localhost:3000, "
                                  "or '*' for any")
        from pinfer_llm.runtime.serving.embeddings import POOLINGS

        if pooling not in POOLINGS:
            raise PinferError(f"--pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        sock = listen(host, port)  # before loading: a taken port fails in a second, not after the load
        from pinfer_llm.runtime import load_model
        from pinfer_llm.runtime.serving.server import create_app

        cores = BusyCores()  # measured over the load
        m = load_model(model, threads=threads, ctx_size=ctx_size, ffn_act=ffn_act, ffn_mode=mode, gpu=gpu,
                       placement=placement, vram_budget=vram_budget, kv_type=kv_type, n_gpu_layers=n_gpu_layers,
                       say=lambda msg: print(f"pi-serve: {msg}", file=sys.stderr, flush=True))
        print_warnings(m, "pi-serve")
        warn_ctx(m, ctx_size, "pi-serve")
        for n in m.notices:
            print(f"pi-serve: note: {n}", file=sys.stderr)
        # a server outlives the load it starts beside: warned about, the thread count left as asked
        warn_if_busy("pi-serve", m.threads, cores)
        app_ = create_app(m, names=[model], api_key=api_key, max_waiting=queue, threads=m.threads,
                          strict_model=strict_model, cors=cors or (), pooling=pooling, parallel=parallel)
        run_uvicorn(app_, sock, m, app_.state.model_id, queue, bool(api_key), timeout, max_connections)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - every failure becomes one line
        raise typer.Exit(report(e, verbose, prog="pi-serve")) from None


def check_api_key(key: str | None) -> None:
    """A key clients can send: `--api-key ''` (an unset variable, PINFER_API_KEY='') served every request without
    one, and a key that is not printable ASCII or has spaces at its ends can never match what a client's
    'Authorization: Bearer KEY' header carries (its bytes are read as Latin-1, the token stripped)."""
    if key is None:
        return
    utf8("--api-key", key)
    if not key.strip():
        raise PinferError("--api-key is empty (an unset variable, or PINFER_API_KEY=''?), which would serve every "
                          "request without a key; pass a key, or drop --api-key")
    if key != key.strip() or not (key.isascii() and key.isprintable()):
        raise PinferError("--api-key must be printable ASCII without spaces at its ends: no client's 'Authorization: "
                          "Bearer KEY' header could match it otherwise")


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (uvicorn starts listening on it), or a one-line error."""
    if not 0 <= port <= 65535:
        raise PinferError(f"--port must be from 0 to 65535, got {port}")
    utf8("--host", host)
    where = f"{host if len(host) <= QUOTE_LIMIT else quote(host)}:{port}"  # 300 characters once made 2 lines
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise PinferError(f"cannot listen on {where}: {e.strerror}") from None
    except UnicodeError as e:  # the IDNA codec: a label over 63 characters, an empty one ("a..b")
        raise PinferError(f"cannot listen on {where}: not a host name or address ({e})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise PinferError(f"cannot listen on {where}: {e.strerror}") from None
    return sock


def run_uvicorn(app_, sock: socket.socket, m, model_id: str, queue: int, auth: bool, timeout: float = TIMEOUT_S,
                max_connections: int = MAX_CONNECTIONS) -> None:
    import uvicorn

    from pinfer_llm.runtime.serving.connections import uvicorn_config

    logging.basicConfig(level=logging.INFO, format="pi-serve: %(message)s")
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    gpu = m.hybrid_report()
    on = f", GPU {gpu['gpu']} ({gpu['placement']['name']})" if gpu else ""
    slots = app_.state.worker.parallel
    print(f"pi-serve: {model_id} on {url}/v1 (context {m.ctx_size}, {m.threads} threads, FFN {m.ffn_mode}{on}, "
          f"{slots} slot{'s' if slots != 1 else ''}, queue {queue}{', API key required' if auth else ''})",
          file=sys.stderr, flush=True)
    print(f"pi-serve: chat page on {url}/", file=sys.stderr, flush=True)
    config = uvicorn_config(app_, timeout=timeout, max_connections=max_connections, log_level="info",
                            timeout_graceful_shutdown=3)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn has shut down cleanly, then re-raises the Ctrl-C it caught
        pass
    print("pi-serve: stopped", file=sys.stderr)


def main() -> None:
    run_app(app, "pi-serve")


if __name__ == "__main__":
    main()
