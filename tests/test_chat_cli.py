"""The terminal chat (`pi-run MODEL --chat` without -p): answers stream, each turn reuses the KV cache of the
conversation so far, Ctrl-C stops an answer and not the program, /exit and end of input quit. Driven in-process
through chat_loop with scripted input, and as a real subprocess through stdin, with SIGINT mid-answer."""

import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from pinfer_llm.cli.chat import chat_loop
from pinfer_llm.runtime import load_model
from pinfer_llm.runtime.generation.chat import encode_chat
from tests.tiny_server import write_chat_model

ROOT = Path(__file__).resolve().parent.parent
GREEDY = {"temperature": 0.0, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0, "repeat_last_n": 64,
          "seed": None}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    threads = torch.get_num_threads()
    p = tmp_path_factory.mktemp("chat") / "tiny-chat.gguf"
    write_chat_model(p)
    yield p, load_model(p, threads=1), load_model(p, threads=1)  # the chat's model, and one for references
    torch.set_num_threads(threads)


def answers(ref, turns, n):
    """What greedy answers the conversation should get, each turn seeing the ones before."""
    msgs, out = [], []
    for user in turns:
        msgs.append({"role": "user", "content": user})
        toks = list(ref.generate(encode_chat(ref.tokenizer, msgs), max_tokens=n, temperature=0.0))
        out.append(ref.tokenizer.decode(toks, skip_special=True))
        msgs.append({"role": "assistant", "content": out[-1]})
    return out


def scripted(lines):
    it = iter(lines)

    def read(prompt):
        line = next(it, None)
        if line is None:
            raise EOFError
        if isinstance(line, BaseException):
            raise line
        return line
    return read


def test_turns_stream_and_reuse_the_cache(chat_model):
    _, m, ref = chat_model
    a1, a2, a3 = answers(ref, ["hello", "and you?", "bye"], 8)
    out, err = io.StringIO(), io.StringIO()
    chat_loop(m, None, 8, GREEDY, read=scripted(["hello", "and you?", "bye"]), out=out, err=err)
    assert out.getvalue() == f"{a1}\n{a2}\n{a3}\n\n"  # the last newline: end of input
    reused = [int(x) for x in re.findall(r"(\d+) reused from the cache", err.getvalue())]
    prompt = [len(encode_chat(ref.tokenizer, [{"role": "user", "content": "hello"}]))]
    assert reused[0] == 0 and reused[1] > prompt[0] and reused[2] > reused[1]


def test_commands(chat_model):
    _, m, ref = chat_model
    (a1,) = answers(ref, ["hello"], 6)
    out, err = io.StringIO(), io.StringIO()
    chat_loop(m, None, 6, GREEDY, read=scripted(["hello", "/reset", "", "/nope", "hello", "/exit", "never read"]),
              out=out, err=err)
    assert out.getvalue() == f"{a1}\n{a1}\n"  # /reset forgot the first turn; /exit ended without a newline
    assert "unknown command /nope" in err.getvalue()


def test_ctrl_c_stops_the_answer_not_the_chat(chat_model):
    """KeyboardInterrupt in the middle of an answer: the answer stops, what was said stays in the conversation,
    and the next turn is what a fresh model says to that conversation (the cache was left consistent)."""
    _, m, ref = chat_model

    class Interrupting:
        def __init__(self, m):
            self.m, self.calls = m, 0

        def __getattr__(self, name):
            return getattr(self.m, name)

        def generate(self, ids, **kw):
            self.calls += 1
            gen = self.m.generate(ids, **kw)
            if self.calls > 1:
                return gen

            def first():
                for i, tok in enumerate(gen):
                    if i == 3:
                        raise KeyboardInterrupt
                    yield tok
            return first()

    out, err = io.StringIO(), io.StringIO()
    try:
        chat_loop(Interrupting(m), None, 8, GREEDY, read=scripted(["hello", KeyboardInterrupt(), "go on"]), out=out,
                  err=err)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C ended the chat")
    partial, second = out.getvalue().split("\n")[0], out.getvalue().split("\n")[2]
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": partial},
            {"role": "user", "content": "go on"}]
    toks = list(ref.generate(encode_chat(ref.tokenizer, msgs), max_tokens=8, temperature=0.0))
    assert second == ref.tokenizer.decode(toks, skip_special=True)
    assert ", stopped]" in err.getvalue() and len(partial) > 0


def run_pi_run(args, stdin, env_extra=None, **kw):
    env = os.environ | {"PYTHONUNBUFFERED": "1"} | (env_extra or {})
    return subprocess.run([sys.executable, "-m", "pinfer_llm.cli.run", *args], input=stdin, capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=120, **kw)


def test_subprocess_conversation_through_stdin(chat_model):
    """Two turns through a pipe, then end of input quits (/exit is tested in-process)."""
    path, _, ref = chat_model
    a1, a2 = answers(ref, ["hello", "how are you"], 8)
    r = run_pi_run([str(path), "--chat", "--temp", "0", "-n", "8", "-t", "1"], "hello\nhow are you\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"> {a1}\n> {a2}\n> \n"
    assert "Traceback" not in r.stderr


# Slows the first answer to 0.1 s a token, so SIGINT lands while it generates.
SLOW_FIRST_ANSWER = """
import sys, time
from pinfer_llm.runtime import engine
fast, calls = engine.Model._generate, []
def slow(self, *a, **kw):
    calls.append(1)
    for tok in fast(self, *a, **kw):
        if len(calls) == 1:
            time.sleep(0.1)
        yield tok
engine.Model._generate = slow
from pinfer_llm.cli.run import app
app(sys.argv[1:], prog_name="pi-run")
"""


def test_subprocess_sigint_stops_the_answer_not_the_program(chat_model):
    path, _, _ = chat_model
    p = subprocess.Popen([sys.executable, "-c", SLOW_FIRST_ANSWER, str(path), "--chat", "--temp", "0", "-n", "200",
                          "-t", "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         cwd=ROOT, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    got = bytearray()

    def pump():
        while chunk := p.stdout.read1(4096):
            got.extend(chunk)
    t = threading.Thread(target=pump, daemon=True)
    t.start()
    try:
        p.stdin.write(b"hello\n")
        p.stdin.flush()
        deadline = time.monotonic() + 60
        while len(got) < 6 and time.monotonic() < deadline:  # "> " and a few characters of the answer
            time.sleep(0.02)
        assert len(got) >= 6, got
        p.send_signal(signal.SIGINT)
        p.stdin.write(b"again\n/exit\n")
        p.stdin.close()
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    t.join(5)  # the pump reads stdout to its end; stderr is a few lines, read now
    err = p.stderr.read().decode()
    assert p.returncode == 0, err
    assert ", stopped]" in err and "interrupted" not in err
    lines = got.decode().split("\n")
    assert len(lines) == 3 and lines[1].startswith("> ") and len(lines[1]) > 2 and lines[2] == "> "
    assert len(re.findall(r"\[\d+ tokens", err)) == 2 and int(re.findall(r"\[(\d+) tokens", err)[0]) < 100
