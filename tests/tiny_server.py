"""pi-serve in-process for tests: a tiny chat model (ChatML template), uvicorn on a free loopback port in a thread,
and a model wrapper whose generation can be slowed down to hold the server busy on purpose."""

from __future__ import annotations

import threading
import time

import numpy as np
import torch
import uvicorn

from pinfer_llm.cli.serve import listen
from pinfer_llm.formats import constants as C
from pinfer_llm.formats.model_writer import write_llama
from pinfer_llm.runtime import load_model
from pinfer_llm.runtime.serving.connections import uvicorn_config
from pinfer_llm.runtime.serving.server import create_app
from tests.tiny import random_weights, tiny_config

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def write_chat_model(path, seed: int = 0, eos_row_from: int | None = None, **kw):
    """A tiny llama with the byte vocabulary (<|im_end|> = eos = 2) and a ChatML template, whose answers are
    printable ASCII on one line: the output rows of the special tokens and of all other bytes are zero, and a logit
    of 0 never beats the largest of ~130 random ones. Its answers read back as the same text, as a real model's do.
    eos_row_from=t makes the end-of-turn token's row twice token t's, so greedy decoding ends a turn early."""
    cfg = tiny_config(n_ctx_train=256, **kw)
    w = random_weights(cfg, seed)
    printable = set(range(32, 127))
    silent = [0, 1, 2] + [3 + b for b in range(256) if b not in printable]  # byte b is token 3 + b
    w[C.OUTPUT][silent] = 0
    if eos_row_from is not None:
        w[C.OUTPUT][2] = 2 * w[C.OUTPUT][eos_row_from]
    write_llama(path, cfg, w, extra_metadata={C.TOKENIZER_CHAT_TEMPLATE: CHATML})
    return cfg, w


class SlowModel:
    """The model, with `delay` seconds after each batched forward pass, i.e. per generated token (0: full speed);
    `fail` makes the next passes fail, to test the server's answer to an internal error; `torch_threads` is the
    thread count the model's thread ran with. `runs` (the tokens of each recent generation) and `started` come from
    the server's worker once start_server has attached it."""

    def __init__(self, m):
        self.m, self.delay, self.fail, self.worker = m, 0.0, False, None

    def __getattr__(self, name):
        return getattr(self.m, name)

    def __setattr__(self, name, value):  # the model's state (cached_ids...) is the model's, not the wrapper's
        if name in ("m", "delay", "fail", "torch_threads", "worker"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.m, name, value)

    def run_rows(self, *a, **kw):
        if self.fail:
            raise RuntimeError("planted failure")
        self.torch_threads = torch.get_num_threads()  # on the thread that runs the model
        out = self.m.run_rows(*a, **kw)
        if self.delay:
            time.sleep(self.delay)
        return out

    @property
    def runs(self) -> list[int]:
        return [c[0] for c in self.worker.runs]

    @property
    def started(self) -> int:
        return self.worker.started


class RunningServer:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a daemon thread."""

    def __init__(self, app, **config_kw):
        self.app = app
        sock = listen("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        # pi-serve's own config (connections.py: the request deadline, the connection bound, no uvicorn access log)
        config_kw = {"log_level": "critical", "timeout_graceful_shutdown": 1} | config_kw
        self.server = uvicorn.Server(uvicorn_config(app, **config_kw))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)

    def close(self):
        self.server.should_exit = True
        self.thread.join(5)


def start_server(path, config: dict | None = None, load_kw: dict | None = None,
                 **app_kw) -> tuple[RunningServer, SlowModel]:
    m = SlowModel(load_model(path, threads=1, **(load_kw or {})))
    app = create_app(m, threads=1, **app_kw)
    m.worker = app.state.worker
    return RunningServer(app, **(config or {})), m


def random_prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 300, n)]
