"""Bad files through the tools (issue #27): each case a user met, reproduced on a tiny model and answered with one
short line (or a warning and a correct run), never an internal error, a traceback, a signal or a hang.

The tools run in-process (typer's CliRunner) so that the corpus stays cheap; a case that could hang runs in a
subprocess with a timeout instead."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pinfer_llm.cli import plan as plan_cli
from pinfer_llm.cli import profile as profile_cli
from pinfer_llm.cli import run as run_cli
from pinfer_llm.formats.errors import PinferError, quote
from tests.tiny import write_tiny

runner = CliRunner()
MAX_LINE = 400  # a one-line error with a long temporary path still fits in this


def tool(name: str, path: Path, *args) -> tuple[int, str]:
    """Run pi-run / pi-plan show / pi-profile on `path` in-process: (exit code, stdout and stderr)."""
    if name == "run":
        app, argv = run_cli.app, [str(path), "-p", "hello", "-n", "3", "--temp", "0", "-t", "1", *args]
    elif name == "show":
        app, argv = plan_cli.app, ["show", str(path), *args]
    else:
        app, argv = profile_cli.app, [str(path), "--tokens", "40", "--ctx", "20", "--sparsity", "0.3", "-t", "1",
                                       "-o", str(path.with_suffix(".out.gguf")), *args]
    res = runner.invoke(app, [str(a) for a in argv])
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    return res.exit_code, res.output


def one_line(code: int, out: str, prog: str, *needles: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert code == 1 and len(lines) == 1, (code, out[:2000])
    assert lines[0].startswith(f"{prog}: error: ") and len(lines[0]) < MAX_LINE, lines[0][:2000]
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


PROG = {"run": "pi-run", "show": "pi-plan", "profile": "pi-profile"}


def test_a_quoted_string_is_cut_and_so_is_any_message():
    assert quote("blk.0.ffn_up.weight") == "'blk.0.ffn_up.weight'"
    assert quote("x" * 10_000) == f"'{'x' * 64}...' (10000 characters)"
    assert len(quote(list(range(300_000)))) < 100  # a vocabulary-sized list is not printed
    e = PinferError("m.gguf: " + "y\n" * 10_000_000)  # 20 MB: cut before its newlines are escaped
    assert len(str(e)) < 5000 and "\n" not in str(e) and str(e).endswith("(19999008 more characters)")


@pytest.mark.parametrize("which", ["run", "show", "profile"])
def test_a_name_length_that_swallows_the_file_is_one_short_line(tmp_path, which):
    """The u64 length of a tensor name set past the rest of the header: the "name" swallowed the file and the error
    quoted all of it (198,623,106 bytes on SmolLM2, 12-107 s). ggml takes names of at most 63 bytes: longer is refused
    as it is read."""
    write_tiny(tmp_path / "t.gguf")
    b = bytearray((tmp_path / "t.gguf").read_bytes())
    name = b"blk.1.ffn_norm.weight"
    at = b.find(name) - 8
    assert struct.unpack_from("<Q", b, at)[0] == len(name)
    struct.pack_into("<Q", b, at, len(b) - at - 200)  # fits in the file: only the bound stops it
    (tmp_path / "m.gguf").write_bytes(b)
    one_line(*tool(which, tmp_path / "m.gguf"), PROG[which], f"a tensor name of {len(b) - at - 200} bytes at byte "
             f"{at}; ggml takes at most 63")


def test_a_long_architecture_name_is_quoted_short(tmp_path):
    from pinfer_llm.formats import constants as C
    from pinfer_llm.formats.update import update_model

    write_tiny(tmp_path / "m.gguf")
    update_model(tmp_path / "m.gguf", set_metadata={C.ARCHITECTURE: "q" * 10_000})
    line = one_line(*tool("run", tmp_path / "m.gguf"), "pi-run", "(10000 characters) is not supported")
    assert line.count("q") < 100


def test_counts_beyond_what_the_header_bytes_hold_are_refused_at_once(tmp_path):
    """n_tensors and n_kv are checked against the bytes left before any loop: each tensor info takes at least 24
    bytes and each key/value 13."""
    write_tiny(tmp_path / "t.gguf")
    b = bytearray((tmp_path / "t.gguf").read_bytes())
    struct.pack_into("<Q", b, 8, len(b) // 24)  # n_tensors: fewer than bytes, more than the bytes can hold
    (tmp_path / "m.gguf").write_bytes(b)
    one_line(*tool("run", tmp_path / "m.gguf"), "pi-run", f"claims {len(b) // 24} tensors and")

