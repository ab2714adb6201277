"""Kill every writer (kill -9 and SIGTERM) at each of its steps: the file stays valid and holds either what it held
or everything it was to hold; no temporary file survives the next write.

A child process runs one write with formats.atomic.hook set to signal itself at a named step (see the checkpoint()
calls in formats/atomic.py, formats/encoder.py and formats/update.py)."""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.gpuidx import write_gpuidx
from pinfer_llm.formats.reader import open_gguf
from pinfer_llm.formats.update import update_model, write_copy
from pinfer_llm.formats.writer import write_gguf
from tests.tiny import write_tiny

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import os, signal, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from pinfer_llm.formats import atomic
from tests.test_kill_writers import do_write
kind, path, point, sig, tmpfile = sys.argv[2:7]
def hook(name):
    if name == point:
        os.kill(os.getpid(), getattr(signal, sig))
        time.sleep(2)  # SIGTERM: the handler raises at the next bytecode, here
atomic.hook = hook
atomic.USE_O_TMPFILE = tmpfile == "1"
do_write(kind, path)
"""

BIG = np.arange(400_000, dtype=np.float32)  # 1.6 MB: kept by reference across updates


def do_write(kind: str, path: str) -> None:
    """The write under test (the child runs it with a kill planted; the parent runs it whole for the expected)."""
    p = Path(path)
    if kind in ("update", "update-first"):
        update_model(p, set_metadata={"pinfer.new": 1, "pinfer.plan.gpus": ["t4"]}, drop_keys=["pinfer.old"],
                     set_tensors={"blk.0.act_counts": np.arange(64, dtype=np.float32) + 1, "big2": BIG * 2})
    elif kind == "copy":
        write_copy(open_gguf(p), p.parent / "out.gguf", set_metadata={"pinfer.new": 1})
    elif kind == "new":
        write_gguf(p, {C.ARCHITECTURE: "llama", "x.v": 2}, {"w": np.full((64, 64), 2, np.float32)})
    elif kind == "gpuidx":
        write_gpuidx(p, [np.array([1, 0] * 32, np.int32)] * 2, None, 2)
    else:
        raise ValueError(kind)


def setup(kind: str, d: Path) -> Path:
    p = d / "m.gguf"
    if kind == "update-first":
        write_tiny(p)
    elif kind == "update":
        write_tiny(p)
        update_model(p, set_metadata={"pinfer.old": 1}, set_tensors={"blk.0.act_counts": np.zeros(64, np.float32),
                                                                     "big": BIG})
    elif kind == "copy":
        write_tiny(p)
        update_model(p, set_metadata={"pinfer.old": 1})
        write_gguf(d / "out.gguf", {C.ARCHITECTURE: "llama", "x.v": 1}, {"w": np.ones(4, np.float32)})
    elif kind == "new":
        write_gguf(p, {C.ARCHITECTURE: "llama", "x.v": 1}, {"w": np.ones((64, 64), np.float32)})
    elif kind == "gpuidx":
        p = d / "m.gguf.generated.gpuidx"
        write_gpuidx(p, [np.array([0, 1] * 32, np.int32)] * 2, None, 1)
    return p


def content(path: Path) -> str:
    """What pinfer reads from a file: merged metadata and every tensor's bytes."""
    f = open_gguf(path)
    h = hashlib.sha256()
    for k in sorted(f.metadata):
        v = f.metadata[k]
        h.update(f"{k}={v.tolist() if isinstance(v, np.ndarray) else v}".encode())
    for n in sorted(f.tensors):
        h.update(n.encode() + np.ascontiguousarray(f.raw(n)).tobytes())
    return h.hexdigest()


def target(kind: str, p: Path) -> Path:
    return p.parent / "out.gguf" if kind == "copy" else p


UPDATE_POINTS = ["directory-written", "data", "section-written", "section-synced", "slot-start", "slot-torn",
                 "slot-written", "slot-synced", "reclaimed"]
FILE_POINTS = ["temp-created", "data", "written", "synced", "linked", "renamed"]
CASES = ([("update-first", pt, sig, "1") for pt in UPDATE_POINTS for sig in ("SIGKILL", "SIGTERM")]
         + [("update", pt, sig, "1") for pt in UPDATE_POINTS[1:] for sig in ("SIGKILL", "SIGTERM")]
         + [("new", pt, sig, tmp) for pt in FILE_POINTS for sig in ("SIGKILL", "SIGTERM") for tmp in "10"
            if pt != "linked" or tmp == "1"]  # a named temporary (no O_TMPFILE) needs no link
         + [("copy", pt, "SIGKILL", tmp) for pt, tmp in (("data", "1"), ("data", "0"), ("linked", "1"),
                                                          ("renamed", "0"))]
         + [("gpuidx", pt, "SIGKILL", tmp) for pt, tmp in (("written", "1"), ("written", "0"), ("linked", "1"))])


@pytest.mark.parametrize("kind, point, sig, tmpfile", CASES)
def test_killed_writer_leaves_a_valid_file_and_no_temporary(tmp_path, kind, point, sig, tmpfile):
    (tmp_path / "want").mkdir()
    (tmp_path / "run").mkdir()
    want = setup(kind, tmp_path / "want")
    old_bytes, old = target(kind, want).read_bytes(), content(target(kind, want))
    model_end = open_gguf(target(kind, want)).data_end
    do_write(kind, str(want))
    new_bytes, new = target(kind, want).read_bytes(), content(target(kind, want))
    assert old != new

    p = setup(kind, tmp_path / "run")
    r = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), kind, str(p), point, sig, tmpfile],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0, f"the child was not killed at {point}: {r.stderr[-500:]}"
    t = target(kind, p)
    got = content(t)  # opens: the file is valid
    assert got in (old, new), f"{kind} killed at {point} by {sig}: neither the old nor the new content"
    if kind.startswith("update"):  # the model's own bytes are never written
        assert t.read_bytes()[:model_end] == old_bytes[:model_end]
    else:  # a whole file is replaced or not
        assert t.read_bytes() in (old_bytes, new_bytes)
    if sig == "SIGTERM":  # SIGTERM cleans up like ^C: nothing left to remove
        assert not [x for x in t.parent.iterdir() if x.name.endswith(".tmp")]

    # the next write of the file succeeds and leaves exactly the files that belong there
    do_write(kind, str(p))
    assert content(t) == new
    names = sorted(x.name for x in t.parent.iterdir())
    assert not [n for n in names if n.endswith(".tmp")], names
    if kind.startswith("update"):
        # garbage a kill left after the directory is reused or freed: the file ends where the new content does
        assert os.path.getsize(t) <= os.path.getsize(target(kind, want)) + 2 * C.SECTION_PAGE + BIG.nbytes * 2
    shutil.rmtree(tmp_path / "run")
