"""pi-run as llama.cpp's llama-cli users type it: -m, a prompt after the model or on stdin, -n -1, -s, -r, -i/-cnv,
-no-cnv, -sys, --version; on a terminal without a prompt, the chat. Each combination that cannot mean anything is a
one-line error, each that can go on sensibly one warning line. In-process through typer's CliRunner, and as real
processes on a pipe and on a pseudo-terminal."""

import io
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import pinfer_llm
from pinfer_llm.cli.chat import chat_loop
from pinfer_llm.cli.run import app, choose_mode
from pinfer_llm.formats.errors import PinferError
from pinfer_llm.runtime import load_model
from pinfer_llm.runtime.generation.chat import encode_chat
from tests.tiny import write_tiny
from tests.tiny_server import write_chat_model

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()
GREEDY = ["--temp", "0"]
GREEDY_KW = {"temperature": 0.0, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0,
             "repeat_last_n": 64, "seed": None}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A tiny model without a chat template (trained context 256)."""
    path = tmp_path_factory.mktemp("run") / "plain.gguf"
    write_tiny(path)
    return path


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A tiny model with a ChatML template whose answers are printable text (tests/tiny_server.py)."""
    path = tmp_path_factory.mktemp("run") / "chat.gguf"
    write_chat_model(path)
    return path


def invoke(*args, input=None):
    return runner.invoke(app, [str(a) for a in args], input=input)


def result(*args, input=None) -> dict:
    res = invoke(*args, "--json", input=input)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def one_line_error(res, *needles):
    out = res.output.strip()
    assert res.exit_code != 0 and "Traceback" not in out, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("pi-run: error:"), out
    for n in needles:
        assert n in lines[0], out


# --- the model and the prompt -------------------------------------------------------------------------------------

def test_model_as_argument_or_option(plain):
    want = result(plain, "-p", "hello", "-n", "4", *GREEDY)["tokens"]
    assert result("-m", plain, "-p", "hello", "-n", "4", *GREEDY)["tokens"] == want
    assert result("--model", plain, "-p", "hello", "-n", "4", *GREEDY)["tokens"] == want
    one_line_error(invoke(plain, "-m", plain, "-p", "hi"), "the model is given twice", "pass one")
    one_line_error(invoke("-p", "hi"), "no model", "-m MODEL")


def test_prompt_after_the_model_is_the_prompt(plain, tmp_path):
    r = result(plain, "hello", "-n", "4", *GREEDY)
    assert r["prompt"] == "hello" and r["tokens"] == result(plain, "-p", "hello", "-n", "4", *GREEDY)["tokens"]
    (tmp_path / "p.txt").write_text("hi\n")
    one_line_error(invoke(plain, "hello", "-p", "hi"), "-p and the PROMPT argument both give the prompt")
    one_line_error(invoke(plain, "-p", "hi", "-f", tmp_path / "p.txt"), "-p and -f both give the prompt")
    one_line_error(invoke(plain, "hello", "-f", tmp_path / "p.txt"), "the PROMPT argument and -f both give")


def test_prompt_from_stdin(plain, tmp_path):
    """Piped into pi-run, or -f -: the prompt, less echo's trailing newline (as llama.cpp reads -f); so is a file."""
    want = result(plain, "-p", "hello", "-n", "4", *GREEDY)["tokens"]
    piped = result(plain, "-n", "4", *GREEDY, input="hello\n")
    dash = result(plain, "-f", "-", "-n", "4", *GREEDY, input="hello\n")
    (tmp_path / "p.txt").write_text("hello\n")
    file = result(plain, "-f", tmp_path / "p.txt", "-n", "4", *GREEDY)
    assert piped["prompt"] == dash["prompt"] == file["prompt"] == "hello"
    assert piped["tokens"] == dash["tokens"] == file["tokens"] == want
    one_line_error(invoke(plain, input=""), "no prompt: stdin is empty")


# --- generation ----------------------------------------------------------------------------------------------------

def test_n_minus_one_generates_until_the_context_is_full(plain):
    r = result(plain, "-p", "hello", "-n", "-1", "-c", "200", *GREEDY)
    t = r["timings"]
    assert t["stop_reason"] == "context full" and t["decode_tokens"] == 200 - t["prompt_tokens"] + 1 > 128
    one_line_error(invoke(plain, "-p", "hello", "-n", "-2"), "-n must be >= 0, or -1", "got -2")


def test_n_minus_one_stops_at_the_end_of_the_turn(chat, tmp_path):
    first = result(chat, "--chat", "-p", "hi", "-n", "1", *GREEDY)["tokens"][0]
    write_chat_model(tmp_path / "eos.gguf", eos_row_from=first)  # the end-of-turn token wins at once
    t = result(tmp_path / "eos.gguf", "--chat", "-p", "hi", "-n", "-1", *GREEDY)["timings"]
    assert t["stop_reason"] == "stop" and t["decode_tokens"] == 1


RANDOM = ["--temp", "1.5", "--top-k", "0", "--top-p", "1", "--min-p", "0", "-n", "16"]


def test_seed(plain):
    """-s N repeats a sampled run; -s -1 is llama.cpp's random seed, so two runs differ."""
    a = result(plain, "-p", "hi", *RANDOM, "-s", "7")["tokens"]
    assert result(plain, "-p", "hi", *RANDOM, "--seed", "7")["tokens"] == a
    assert result(plain, "-p", "hi", *RANDOM, "-s", "-1")["tokens"] != result(plain, "-p", "hi", *RANDOM, "-s",
                                                                            "-1")["tokens"]


def test_temperature_alias_and_negative_temperature_is_greedy(plain):
    want = result(plain, "-p", "hi", "-n", "6", "--temp", "0")["tokens"]
    assert result(plain, "-p", "hi", "-n", "6", "--temperature", "0")["tokens"] == want
    assert result(plain, "-p", "hi", "-n", "6", "--temp", "-1", "-s", "1")["tokens"] == want


def stop_inside(text: str) -> tuple[str, int]:
    """A 3-character piece of `text` whose first occurrence starts at k >= 3: (piece, k)."""
    for k in range(3, len(text) - 3):
        if text.find(text[k:k + 3]) == k and text[k:k + 3].strip():
            return text[k:k + 3], k
    raise AssertionError(f"no stop string to cut {text!r} at")


def test_reverse_prompt_stops_the_text_before_it(chat):
    full = result(chat, "-p", "hello", "-n", "24", *GREEDY)
    stop, k = stop_inside(full["text"])
    r = result(chat, "-p", "hello", "-n", "24", *GREEDY, "-r", "never there", "-r", stop)
    assert r["text"] == full["text"][:k] and r["timings"]["stop_reason"] == "reverse prompt"
    assert len(r["tokens"]) < 24
    res = invoke(chat, "-p", "hello", "-n", "24", *GREEDY, "--reverse-prompt", stop)
    assert res.exit_code == 0 and res.stdout == "hello" + full["text"][:k] + "\n", res.output
    assert "(reverse prompt)" in res.stderr


def test_reverse_prompt_ends_a_chat_answer(chat):
    """In the chat, -r ends the answer where it appears; the conversation keeps the answer up to there."""
    m, ref = load_model(chat, threads=1), load_model(chat, threads=1)
    torch.set_num_threads(2)

    def greedy(msgs):
        toks = list(ref.generate(encode_chat(ref.tokenizer, msgs), max_tokens=24, temperature=0.0))
        return ref.tokenizer.decode(toks, skip_special=True)

    hello = [{"role": "user", "content": "hello"}]
    answer = greedy(hello)
    stop, k = stop_inside(answer)
    second = greedy(hello + [{"role": "assistant", "content": answer[:k]}, {"role": "user", "content": "more"}])
    second = second[:second.find(stop)] if stop in second else second
    lines = iter(["hello", "more"])

    def read(_prompt):
        if (line := next(lines, None)) is None:
            raise EOFError
        return line

    out, err = io.StringIO(), io.StringIO()
    chat_loop(m, None, 24, GREEDY_KW, read=read, out=out, err=err, stop=[stop])
    assert out.getvalue() == f"{answer[:k]}\n{second}\n\n"


def test_context_beyond_the_trained_one_is_a_warning(plain):
    res = invoke(plain, "-p", "hi", "-n", "1", "-c", "512", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["ctx_size"] == 512
    assert res.stderr.strip() == ("pi-run: warning: -c 512 is more than the 256 tokens the model was trained on "
                                  "(llama.context_length): quality degrades beyond them")
    res = invoke(plain, "-p", "hi", "-n", "1", "-c", "256", "--json")
    assert res.exit_code == 0 and res.stderr == ""


def test_system_message_implies_the_chat_template(chat):
    args = ["-p", "hi", "-n", "4", *GREEDY]
    want = result(chat, "--chat", "--system", "be brief", *args)
    got = result(chat, "-sys", "be brief", *args)
    assert got["tokens"] == want["tokens"] and got["timings"]["prompt_tokens"] == want["timings"]["prompt_tokens"]
    assert result(chat, *args)["timings"]["prompt_tokens"] < want["timings"]["prompt_tokens"]


@pytest.mark.parametrize("args, needles", [
    (["--chat", "--json"], ["--json prints one answer", "-p TEXT"]),
    (["-cnv", "-p", "hi", "--json"], ["--json prints one answer"]),
    (["-no-cnv", "-cnv"], ["-no-cnv asks for plain completion"]),
    (["--no-conversation", "--chat", "-p", "hi"], ["-no-cnv asks for plain completion"]),
    (["-no-cnv", "--system", "x", "-p", "hi"], ["--system is the chat's system message"]),
    (["-i", "-f", "-"], ["-f - reads the prompt from stdin"]),
    (["--perplexity", "FILE", "-p", "hi", "--chat"], ["--perplexity scores a text file", "drop -p, --chat"]),
    (["-ngl", "2", "--placement", "plan", "-p", "hi"], ["-ngl 2 is the layers placement", "--placement plan"]),
    (["-ngl", "-1", "-p", "hi"], ["-ngl/--n-gpu-layers must be >= 0"]),
])
def test_combinations_that_cannot_mean_anything(chat, tmp_path, args, needles):
    (tmp_path / "t.txt").write_text("some text " * 20)
    args = [tmp_path / "t.txt" if a == "FILE" else a for a in args]
    one_line_error(invoke(chat, *args), *needles)


@pytest.mark.parametrize("prompt, flags, tty, want", [
    (True, {}, True, "plain"),
    (True, {}, False, "plain"),
    (True, {"chat": True}, True, "chat"),
    (True, {"system": True}, False, "chat"),
    (True, {"conversation": True}, False, "interactive"),
    (False, {}, True, "interactive"),
    (False, {"system": True}, True, "interactive"),
    (False, {}, False, "stdin"),
    (False, {"chat": True}, False, "interactive"),
    (False, {"no_conversation": True}, False, "stdin"),
    (True, {"no_conversation": True}, True, "plain"),
    (False, {"no_conversation": True}, True, "error"),
])
def test_choose_mode(prompt, flags, tty, want):
    kw = {"chat": False, "conversation": False, "no_conversation": False, "system": False} | flags
    if want == "error":
        with pytest.raises(PinferError, match="no prompt"):
            choose_mode(prompt, stdin_tty=tty, **kw)
    else:
        assert choose_mode(prompt, stdin_tty=tty, **kw) == want


@pytest.mark.parametrize("prog, module", [("pi-run", "run"), ("pi-profile", "profile"), ("pi-serve", "serve")])
def test_version_and_help(prog, module):
    import importlib

    cli = importlib.import_module(f"pinfer_llm.cli.{module}")
    res = runner.invoke(cli.app, ["--version"])
    assert res.exit_code == 0 and res.output == f"{prog} pinfer-llm {pinfer_llm.__version__}\n"
    res = runner.invoke(cli.app, ["-h"])
    assert res.exit_code == 0 and "-m, --model MODEL" in res.output


def test_profile_takes_the_model_as_an_option(tmp_path):
    from pinfer_llm.cli.profile import app as profile

    res = runner.invoke(profile, ["-m", str(tmp_path / "nope.gguf")])
    assert res.exit_code != 0 and res.output.strip().startswith("pi-profile: error:") and "nope.gguf" in res.output
    res = runner.invoke(profile, ["a.gguf", "-m", "b.gguf"])
    assert res.exit_code != 0 and "the model is given twice" in res.output


# --- real processes: a pipe, a terminal ----------------------------------------------------------------------------

def greedy_answers(path, turns, n):
    ref = load_model(path, threads=1)
    try:
        msgs, out = [], []
        for user in turns:
            msgs.append({"role": "user", "content": user})
            toks = list(ref.generate(encode_chat(ref.tokenizer, msgs), max_tokens=n, temperature=0.0))
            out.append(ref.tokenizer.decode(toks, skip_special=True))
            msgs.append({"role": "assistant", "content": out[-1]})
        return out
    finally:
        torch.set_num_threads(2)


ENV = os.environ | {"PYTHONUNBUFFERED": "1", "TERM": "dumb"}


@pytest.mark.parametrize("flag", ["-cnv", "-i"])
def test_conversation_mode_with_a_first_message(chat, flag):
    """-cnv/-i -p TEXT: the chat, TEXT its first message (shown as typed), then the turns on stdin."""
    a1, a2 = greedy_answers(chat, ["hello", "how are you"], 8)
    r = subprocess.run([sys.executable, "-m", "pinfer_llm.cli.run", str(chat), flag, "-p", "hello", "--temp", "0",
                        "-n", "8", "-t", "1"], input="how are you\n", capture_output=True, text=True, cwd=ROOT,
                       env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"> hello\n{a1}\n> {a2}\n> \n"


def on_a_terminal(args, lines: list[str], timeout: float = 120) -> tuple[int, str]:
    """pi-run with a pseudo-terminal as stdin, stdout and stderr: each line is typed once the prompt "> " is
    showing (after the last one, Ctrl-D); returns the exit status and everything the terminal showed."""
    master, slave = os.openpty()
    p = subprocess.Popen([sys.executable, "-m", "pinfer_llm.cli.run", *map(str, args)], stdin=slave, stdout=slave,
                         stderr=slave, cwd=ROOT, env=ENV, start_new_session=True)
    os.close(slave)
    shown, typed = bytearray(), 0
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if typed <= len(lines) and shown.count(b"> ") > typed:
                os.write(master, lines[typed].encode() + b"\n" if typed < len(lines) else b"\x04")
                typed += 1
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # EIO: the process closed the terminal
                    break
                if not chunk:
                    break
                shown.extend(chunk)
            elif p.poll() is not None:
                break
        p.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)
    return p.returncode, shown.decode(errors="replace").replace("\r\n", "\n")


def without_busy_warning(shown: str) -> str:
    """shown less the line a loaded machine adds ("other processes keep N of M cores busy", cli/threads.py)."""
    return "\n".join(ln for ln in shown.splitlines() if not (ln.startswith("pi-run: warning: ") and " busy" in ln))


def test_on_a_terminal_pi_run_model_opens_the_chat(chat):
    (a1,) = greedy_answers(chat, ["hello"], 8)
    code, shown = on_a_terminal([chat, "--temp", "0", "-n", "8", "-t", "1"], ["hello"])
    assert code == 0, shown
    assert "pi-run: chat with chat.gguf" in shown and f"{a1}\n" in shown and "[8 tokens" in shown, shown


def test_on_a_terminal_without_a_chat_template_or_with_no_cnv(plain, chat):
    code, shown = on_a_terminal([plain, "-t", "1"], [])
    shown = without_busy_warning(shown)
    assert code == 1 and shown.strip() == ("pi-run: error: this model has no chat template "
                                           "(tokenizer.chat_template), so there is no chat: pass a prompt with "
                                           "-p TEXT"), shown
    code, shown = on_a_terminal([chat, "-no-cnv", "-t", "1"], [])
    shown = without_busy_warning(shown)
    assert code == 1 and shown.strip().startswith("pi-run: error: no prompt:"), shown
