"""Each kind of bad input to pi-run: a one-line error naming the problem, non-zero exit, no traceback."""

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T
from typer.testing import CliRunner

from pinfer_llm.cli.run import app
from pinfer_llm.formats import constants as C
from pinfer_llm.formats.encoder import RawTensor
from pinfer_llm.formats.model_writer import write_llama
from tests.tiny import random_weights, tiny_config, write_tiny

runner = CliRunner()


def run(*args):
    res = runner.invoke(app, [str(a) for a in args])
    out = res.output.strip()
    return res.exit_code, out


def assert_one_line_error(code, out, *needles):
    assert code != 0, out
    assert "Traceback" not in out, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    assert lines[0].startswith("pi-run: error:"), out
    for n in needles:
        assert n in lines[0], out


def test_missing_path(tmp_path):
    assert_one_line_error(*run(tmp_path / "nope.gguf", "-p", "hi"), "nope.gguf", "no such file")


def test_not_gguf(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("this is a text file, not a model\n" * 4)
    assert_one_line_error(*run(p, "-p", "hi"), "notes.gguf", "not a GGUF file")


@pytest.mark.parametrize("keep", [0.3, 0.9])
def test_truncated(tmp_path, keep):
    write_tiny(tmp_path / "m.gguf")
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:int(len(data) * keep)])
    assert_one_line_error(*run(tmp_path / "cut.gguf", "-p", "hi"), "cut.gguf", "truncated")


@pytest.mark.parametrize("arch", ["mamba", "gptneox", "bloom"])
def test_unknown_architecture(tmp_path, arch):
    cfg = tiny_config(arch=arch)
    write_llama(tmp_path / "m.gguf", cfg, random_weights(cfg))
    assert_one_line_error(*run(tmp_path / "m.gguf", "-p", "hi"), f"architecture '{arch}' is not supported",
                          "(supported: llama, bamboo, falcon, opt)")


def test_unsupported_tensor_type(tmp_path):
    cfg = tiny_config(n_embd=256, n_ff=256, n_head=4, n_head_kv=4)
    w = random_weights(cfg)
    rows = cfg.n_ff
    w[C.tensor(C.FFN_UP, 1)] = RawTensor(np.zeros((rows, 84), np.uint8), T.Q2_K, (rows, 256))  # Q2_K: 84 B/256
    write_llama(tmp_path / "m.gguf", cfg, w)
    assert_one_line_error(*run(tmp_path / "m.gguf", "-p", "hi"), "blk.1.ffn_up.weight", "Q2_K")


def test_missing_tensor(tmp_path):
    cfg = tiny_config()
    w = random_weights(cfg)
    del w[C.tensor(C.FFN_GATE, 1)]
    write_llama(tmp_path / "m.gguf", cfg, w)
    assert_one_line_error(*run(tmp_path / "m.gguf", "-p", "hi"), "missing tensor 'blk.1.ffn_gate.weight'")


def test_prompt_longer_than_context(tmp_path):
    write_tiny(tmp_path / "m.gguf")
    code, out = run(tmp_path / "m.gguf", "-p", "a long prompt " * 20, "--ctx-size", "16", "-n", "4")
    assert_one_line_error(code, out, "context holds 16", "--ctx-size")


def test_verbose_shows_traceback(tmp_path):
    code, out = run(tmp_path / "nope.gguf", "-p", "hi", "--verbose")
    assert code != 0 and "Traceback" in out


def test_json_output(tmp_path):
    import json

    write_tiny(tmp_path / "m.gguf")
    code, out = run(tmp_path / "m.gguf", "-p", "hello", "-n", "5", "--temp", "0", "--json")
    assert code == 0, out
    obj = json.loads(out)
    assert len(obj["tokens"]) == 5 and obj["timings"]["decode_tokens"] == 5 and isinstance(obj["text"], str)
    assert obj["kv_type"] == "f16" and obj["ctx_size"] > 0
    code, out = run(tmp_path / "m.gguf", "-p", "hello", "-n", "2", "--kv-type", "f32", "--json")
    assert code == 0 and json.loads(out)["kv_type"] == "f32"


@pytest.mark.parametrize("args,needles", [
    (["-c", "0"], ["-c/--ctx-size", "at least 1", "got 0"]),
    (["-c", "-4", "--perplexity", "FILE"], ["-c/--ctx-size", "at least 1"]),
    (["-t", "-3"], ["-t/--threads", "at least 1", "got -3"]),
    (["-t", "0"], ["-t/--threads", "at least 1"]),
    (["--top-p", "2"], ["--top-p", "[0, 1]", "got 2"]),
    (["--top-p", "nan"], ["--top-p", "[0, 1]"]),
    (["--min-p", "2"], ["--min-p", "[0, 1]", "got 2"]),
    (["--repeat-penalty", "-1"], ["--repeat-penalty", "> 0", "got -1"]),
    (["--repeat-penalty", "0"], ["--repeat-penalty", "> 0"]),
    (["--top-k", "-5"], ["--top-k", ">= 0"]),
    (["--repeat-last-n", "-1"], ["--repeat-last-n", ">= 0"]),
    (["--temp", "inf"], ["--temp", "finite"]),
    (["--seed", str(1 << 64)], ["--seed", "2^64"]),
    (["--kv-type", "q4_0"], ["--kv-type", "q4_0", "f16, f32"]),
])
def test_option_out_of_range(tmp_path, args, needles):
    write_tiny(tmp_path / "m.gguf")
    (tmp_path / "t.txt").write_text("some text " * 20)
    args = [str(tmp_path / "t.txt") if a == "FILE" else a for a in args]
    assert_one_line_error(*run(tmp_path / "m.gguf", "-p", "hi", "-n", "2", *args), *needles)


def test_too_many_threads_are_capped_with_a_warning(tmp_path):
    import os

    import torch

    write_tiny(tmp_path / "m.gguf")
    cores = len(os.sched_getaffinity(0))
    try:
        res = runner.invoke(app, [str(tmp_path / "m.gguf"), "-p", "hi", "-n", "2", "-t", "1000", "--json"])
        assert res.exit_code == 0, res.output
        lines = [ln for ln in res.stderr.splitlines() if "other processes keep" not in ln]  # a busy machine's word
        assert lines == [f"pi-run: warning: -t 1000 is more than the {cores} cores this process may use; using {cores}"]
        assert torch.get_num_threads() == cores
    finally:
        torch.set_num_threads(2)


@pytest.mark.parametrize("temp", ["0", "0.8"])
def test_corrupt_weights_giving_nan_logits(tmp_path, temp):
    cfg = tiny_config()
    w = random_weights(cfg)
    w[C.tensor(C.FFN_DOWN, 1)][3, 5] = np.nan  # one corrupt value: every logit becomes NaN
    write_llama(tmp_path / "m.gguf", cfg, w)
    code, out = run(tmp_path / "m.gguf", "-p", "hi", "-n", "3", "--temp", temp, "--json")
    assert_one_line_error(code, out, "m.gguf", "weights are corrupt", "not finite")


def test_unreadable_model_file(tmp_path, monkeypatch):
    import builtins
    import os

    write_tiny(tmp_path / "m.gguf")
    path = tmp_path / "m.gguf"
    path.chmod(0)
    if os.geteuid() == 0:  # root reads it anyway: refuse it as the kernel would refuse another user
        real_open, real_os_open = builtins.open, os.open

        def denied(file, *a, **kw):
            if str(file) == str(path):
                raise PermissionError(13, "Permission denied", str(file))
            return real_open(file, *a, **kw)

        def os_denied(file, *a, **kw):
            if str(file) == str(path):
                raise PermissionError(13, "Permission denied", str(file))
            return real_os_open(file, *a, **kw)

        monkeypatch.setattr(builtins, "open", denied)
        monkeypatch.setattr(os, "open", os_denied)
    try:
        assert_one_line_error(*run(path, "-p", "hi"), "m.gguf", "permission denied")
    finally:
        path.chmod(0o644)


def test_vocabulary_the_tokenizer_library_rejects(tmp_path):
    from pinfer_llm.formats.model_writer import byte_vocab

    cfg = tiny_config()
    vocab = byte_vocab(cfg.vocab_size)
    vocab[C.TOKENIZER_MERGES] = [*vocab[C.TOKENIZER_MERGES], "zz qq"]  # a merge of tokens that do not exist
    write_llama(tmp_path / "m.gguf", cfg, random_weights(cfg), tokenizer=vocab)
    assert_one_line_error(*run(tmp_path / "m.gguf", "-p", "hi"), "m.gguf", "tokenizer library rejects",
                          "out of vocabulary")


def _python(code: str, timeout: float = 60):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


def test_a_fifo_as_model_is_refused_at_once(tmp_path):
    """Opening a FIFO for reading waits for a writer: all the tools hung in open(). In a subprocess with a timeout,
    so that a regression fails instead of hanging the suite."""
    import os

    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)
    r = _python(f"from pinfer_llm.formats.reader import open_gguf\nopen_gguf({str(fifo)!r})", timeout=30)
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].endswith(
        f"PinferError: {fifo}: is a FIFO, not a file: give the path of a .gguf file (models are mapped, not streamed)")
    assert_one_line_error(*run(fifo, "-p", "hi"), "is a FIFO, not a file")


def test_ctrl_c_while_a_command_still_imports_is_one_line():
    """A Ctrl-C before the command's own handler exists (torch's import takes seconds) gave Python's traceback and
    rc -2; a command says `interrupted` and exits 130. Once main() runs, Ctrl-C raises KeyboardInterrupt again, which
    the commands report themselves."""
    early = _python("import sys; sys.argv[0] = '/usr/bin/pi-run'\nimport os, signal, time\nimport pinfer_llm.cli\n"
                    "os.kill(os.getpid(), signal.SIGINT)\ntime.sleep(10)\nprint('not interrupted')")
    assert (early.returncode, early.stdout, early.stderr) == (130, "", "pi-run: interrupted\n")
    later = _python("import sys; sys.argv[0] = '/usr/bin/pi-run'\nimport os, signal\nimport pinfer_llm.cli\n"
                    "pinfer_llm.cli.interrupts_raise()\ntry:\n    os.kill(os.getpid(), signal.SIGINT)\n"
                    "    import time; time.sleep(10)\nexcept KeyboardInterrupt:\n    print('raised')")
    assert (later.returncode, later.stdout) == (0, "raised\n")
    imported = _python("import os, signal\nimport pinfer_llm.cli\n"  # by a script or a test: left alone
                       "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)")
    assert imported.stdout == "True\n"


@pytest.mark.parametrize("value", [2**32 - 1, 22])
def test_a_layer_count_beyond_the_files_tensors_fails_fast(tmp_path, value):
    """One 4-byte field, llama.block_count, set to 2^32-1: pi-run and pi-plan built 4.3 billion tensor names (past
    30 s, ~40 MB/s). The count is checked against the tensors the file holds before anything loops over it; 22 is
    one more than the tiny model's 21 tensors."""
    import struct
    import subprocess
    import sys

    write_tiny(tmp_path / "t.gguf")
    b = bytearray((tmp_path / "t.gguf").read_bytes())
    i = b.find(b"llama.block_count") + len("llama.block_count")
    assert struct.unpack_from("<II", b, i) == (4, 2)  # u32, 2 layers
    struct.pack_into("<I", b, i + 4, value)
    (tmp_path / "m.gguf").write_bytes(b)
    want = f"metadata 'llama.block_count' is {value}, but the file holds only 21 tensors; the file is corrupt"
    for tool, args in (("run", ["-p", "hi"]), ("plan", ["show"])):  # subprocesses: a regression fails, not hangs
        cmd = [sys.executable, "-m", f"pinfer_llm.cli.{tool}"] + ([args[0]] if tool == "plan" else [])
        cmd += [str(tmp_path / "m.gguf")] + (args if tool == "run" else [])
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and r.stderr == f"pi-{tool}: error: {tmp_path / 'm.gguf'}: {want}\n", r.stderr


@pytest.mark.parametrize("prog,module,argv", [("pi-plan", "plan", "['show', 'x.gguf']"), ("pi-run", "run", "None")])
def test_ctrl_c_while_typer_builds_or_parses_the_command_is_one_line(prog, module, argv):
    """main() used to switch Ctrl-C to KeyboardInterrupt before typer built and parsed the command line: one there
    (hostile_pass: SIGINT 0.47 s into pi-plan) was a traceback, or a silent exit 130 (typer's own handler). The
    switch happens inside each command's error handling; until then the early handler answers."""
    code = (f"import sys; sys.argv = ['/usr/bin/{prog}', 'x.gguf']\nimport os, signal, typer.main\n"
            f"import pinfer_llm.cli.{module} as cli\nreal = typer.main.get_command\n"
            "def building(app):\n    os.kill(os.getpid(), signal.SIGINT)\n    return real(app)\n"
            f"typer.main.get_command = building\ncli.main({'' if argv == 'None' else argv})")
    r = _python(code)
    assert (r.returncode, r.stderr) == (130, f"{prog}: interrupted\n"), (r.returncode, r.stderr[-2000:])


def test_ctrl_c_after_the_command_is_done_is_ignored(tmp_path):
    """A SIGINT 1.45 s into pi-profile, after it had written its file, killed the process as it finalized (rc -2):
    Python resets SIGINT to its default action once its handlers are gone. Once the status is decided, run_app
    ignores SIGINT. Here it comes from an atexit callback (before that reset), where it was a KeyboardInterrupt
    traceback ("Exception ignored in atexit callback")."""
    code = (f"import sys; sys.argv = ['/usr/bin/pi-plan', 'show', {str(tmp_path / 'x.gguf')!r}]\n"
            "import atexit, os, signal\nimport pinfer_llm.cli.plan as cli\n"
            "atexit.register(lambda: os.kill(os.getpid(), signal.SIGINT))\ncli.main()")
    r = _python(code)
    assert (r.returncode, r.stderr) == (1, f"pi-plan: error: {tmp_path / 'x.gguf'}: no such file\n"), r.stderr[-2000:]
