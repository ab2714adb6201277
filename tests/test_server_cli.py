"""pi-serve's command line: each user error is one line and a non-zero exit, before any model is loaded where it
can be; and a real `pi-serve` process that starts, answers, and stops cleanly on SIGINT."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

import pinfer_llm
from pinfer_llm.cli import serve as serve_cli
from pinfer_llm.cli.serve import app
from tests.tiny_server import write_chat_model

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    p = tmp_path_factory.mktemp("cli") / "tiny-chat.gguf"
    write_chat_model(p)
    return p


def one_line_error(args, *needles):
    res = runner.invoke(app, [str(a) for a in args])
    out = res.output.strip()
    assert res.exit_code != 0 and "Traceback" not in out, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("pi-serve: error:"), out
    for n in needles:
        assert n in lines[0], out


def test_bad_port(tmp_path):
    # checked before the model is looked for (a missing one here): the error names the port
    one_line_error([tmp_path / "nope.gguf", "--port", "70000"], "--port must be from 0 to 65535", "70000")


def test_missing_model(tmp_path):
    one_line_error([tmp_path / "nope.gguf", "--port", "0"], "nope.gguf", "no such file")


def test_port_in_use(model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        one_line_error([model, "--port", s.getsockname()[1]], "cannot listen on 127.0.0.1:", "in use")


def test_unknown_host(model):
    one_line_error([model, "--host", "no-such-host.invalid", "--port", "0"], "cannot listen on no-such-host.invalid")


@pytest.mark.parametrize("args, needle", [(["--queue", "-1"], "--queue must be >= 0"),
                                          (["--sparse", "--dense"], "choose one of"),
                                          (["-t", "0"], "-t/--threads must be at least 1, got 0"),
                                          (["--timeout", "0"], "--timeout must be > 0"),
                                          (["--max-connections", "0"], "--max-connections must be >= 1"),
                                          (["--pooling", "max"], "--pooling must be one of mean, last, cls")])
def test_bad_options(model, args, needle):
    one_line_error([model, "--port", "0", *args], needle)


def served_model(monkeypatch, args):
    """The model pi-serve would serve with these arguments (run_uvicorn is replaced), and its stderr."""
    got = []
    monkeypatch.setattr(serve_cli, "run_uvicorn", lambda app_, sock, m, *rest: (sock.close(), got.append(m)))
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == 0 and len(got) == 1, res.output
    return got[0], res.stderr


def test_placement_options_reach_the_model(model, monkeypatch, tmp_path):
    """-m, -ngl and --placement get to the loader: on the reference device, -ngl 1 puts exactly the last layer on
    the GPU; without a GPU, each GPU option is one warning line and the CPU serves."""
    monkeypatch.setenv("PINFER_CACHE_DIR", str(tmp_path))
    m, err = served_model(monkeypatch, ["-m", model, "--port", "0", "--gpu", "reference", "-ngl", "1"])
    assert m.placement.name == "layers" and m.placement.attn.tolist() == [False, True] and not m.placement.output
    m, err = served_model(monkeypatch, [model, "--port", "0", "--gpu", "none", "--placement", "layers",
                                        "--vram-budget", "1"])
    assert m.placement is None
    warned = [line for line in err.splitlines() if line.startswith("pi-serve: warning:")]
    assert len(warned) == 2 and "--placement layers needs a GPU" in warned[0] and "--vram-budget 1" in warned[1], err


def test_model_option_and_version(model, monkeypatch):
    m, _ = served_model(monkeypatch, ["--model", model, "--port", "0", "--gpu", "none"])
    assert m.file.path == model
    one_line_error([model, "-m", model, "--port", "0"], "the model is given twice")
    one_line_error(["--port", "0"], "no model")
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output == f"pi-serve pinfer-llm {pinfer_llm.__version__}\n"


def test_context_beyond_the_trained_one_is_a_warning(model, monkeypatch):
    m, err = served_model(monkeypatch, [model, "--port", "0", "--gpu", "none", "-c", "512"])
    assert m.ctx_size == 512
    assert err.strip() == ("pi-serve: warning: -c 512 is more than the 256 tokens the model was trained on "
                           "(llama.context_length): quality degrades beyond them"), err


def test_serves_on_the_reference_device(model):
    """--gpu reference: the hybrid executor with the CPU stand-in for the GPU serves the same greedy answer."""
    from starlette.testclient import TestClient

    from pinfer_llm.runtime import load_model
    from pinfer_llm.runtime.serving.server import create_app

    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
    answers = []
    for gpu in ("none", "reference"):
        m = load_model(model, threads=1, gpu=gpu, placement="layers" if gpu == "reference" else "plan")
        assert (m.hybrid_report() is not None) == (gpu == "reference")
        with TestClient(create_app(m, names=[str(model)])) as c:
            answers.append(c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"])
    assert answers[0] == answers[1]


def test_serves_and_stops_on_sigint(model):
    p = subprocess.Popen([sys.executable, "-m", "pinfer_llm.cli.serve", str(model), "--port", "0", "-t", "1",
                          "--api-key", "k"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=os.environ | {"PYTHONUNBUFFERED": "1"})
    try:
        line = ""
        while " on http" not in line and p.poll() is None:  # the line that says where it listens
            line = p.stderr.readline()
        url = re.search(r"on (http://127\.0\.0\.1:\d+)/v1 ", line)
        assert url, line
        url = url.group(1)
        deadline = time.monotonic() + 30
        while True:
            try:
                assert httpx.get(url + "/health").json()["status"] == "ok"
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": "Bearer k"},
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert "tiny-chat" in line and "API key required" in line and "1 threads" in line
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0 and "Traceback" not in err and err.rstrip().endswith("pi-serve: stopped"), err


def test_server_options_reach_the_app(model, monkeypatch):
    """--strict-model, --cors, --pooling reach create_app; --timeout and --max-connections reach uvicorn's config."""
    got = []
    monkeypatch.setattr(serve_cli, "run_uvicorn", lambda app_, sock, m, *rest: (sock.close(), got.append((app_,
                                                                                                         rest))))
    res = runner.invoke(app, [str(model), "--port", "0", "--strict-model", "--cors", "http://a.example", "--cors",
                              "http://b.example", "--pooling", "last", "--timeout", "7", "--max-connections", "9"])
    assert res.exit_code == 0, res.output
    app_, rest = got[0]
    assert rest[-2:] == (7.0, 9)
    from starlette.testclient import TestClient

    with TestClient(app_) as c:
        assert c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "model": "x"}).status_code == 404
        assert c.get("/props").json()["pooling"] == "last"
        pre = {"Origin": "http://b.example", "Access-Control-Request-Method": "POST"}
        assert c.options("/v1/completions", headers=pre).headers["access-control-allow-origin"] == "http://b.example"
