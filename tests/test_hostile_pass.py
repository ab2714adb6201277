"""benchmarks/hostile_pass.py cannot report all-clean by mistake: its classifier, fed tiny python commands that end
each way a tool can end, names each one; a hang is killed with what it started; the NaN oracle finds a planted NaN;
every mutant kind writes a changed, reproducible file; any failing run makes the pass exit non-zero.

Plants (each made a test below fail, then restored): classify() without its traceback check; execute() killing the
child alone instead of its process group (the grandchild survives); nonfinite() skipping F32 tensors;
exit_status() returning 0 always."""

from __future__ import annotations

import os
import signal
import struct
import sys
import time

import numpy as np
import pytest

from benchmarks import hostile_pass as hp
from tests.tiny import write_tiny

PY = sys.executable


def py(code: str, timeout: float = 20, **kw) -> hp.Run:
    return hp.execute([PY, "-c", code], timeout, env=dict(os.environ), **kw)


@pytest.mark.parametrize("code,want", [
    ("pass", "ok"),
    ("import sys; print('pi-run: error: x.gguf: no such file', file=sys.stderr); sys.exit(1)", "clean"),
    ("import sys; print('pi-run: warning: w', file=sys.stderr); print('pi-run: error: e', file=sys.stderr); "
     "sys.exit(1)", "clean"),
    ("raise ValueError('boom')", "traceback"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "signal"),
    ("import os; os.abort()", "signal"),
    ("import sys; sys.exit(135)", "signal"),  # a shell's 128 + SIGBUS
    ("import sys; print('pi-run: internal error: KeyError: 3 (rerun with --verbose)', file=sys.stderr); "
     "sys.exit(2)", "internal"),
    ("import sys; [print(f'pi-run: error: line {i}', file=sys.stderr) for i in range(3)]; sys.exit(1)",
     "long-stderr"),
    ("import sys; print('pi-run: error: ' + 'x' * 500, file=sys.stderr); sys.exit(1)", "long-stderr"),
    ("import sys; sys.stderr.write('y' * 100_000); sys.exit(0)", "long-stderr"),
    ("import sys; sys.exit(1)", "unexplained"),
    ("import sys; print('pi-run: error: out of memory; try a smaller --ctx-size', file=sys.stderr); sys.exit(1)",
     "oom"),
    ("import sys; print('Usage: pi-run [OPTIONS]', file=sys.stderr); sys.exit(2)", "unexplained"),
    ("import sys; print('pi-run: warning: other processes keep 2.0 of 2 cores busy', file=sys.stderr); "
     "print('pi-run: error: e', file=sys.stderr); print('pinfer: building the CPU kernels', file=sys.stderr); "
     "sys.exit(1)", "clean"),  # the machine's lines are not counted
])
def test_each_ending_is_classified(code, want):
    assert hp.classify(py(code)) == want


def test_a_hang_is_killed_with_what_it_started(tmp_path):
    """A child that starts a grandchild and sleeps: after the timeout both are gone (the process group is killed),
    and the run is a hang."""
    pidfile = tmp_path / "grandchild"
    code = (f"import subprocess, sys, time\np = subprocess.Popen([sys.executable, '-c', 'import time; "
            f"time.sleep(60)'])\nopen({str(pidfile)!r}, 'w').write(str(p.pid))\ntime.sleep(60)")
    t0 = time.monotonic()
    run = py(code, timeout=3)
    assert hp.classify(run) == "hang" and time.monotonic() - t0 < 20
    grandchild = int(pidfile.read_text())
    for pid in (run.pid, grandchild):
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            # a zombie whose parent is gone is reaped by init soon after
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.1)
        else:
            pytest.fail(f"process {pid} survived the hang's kill")


def test_sigint_endings():
    handled = ("import os, signal, sys, time\n"
               "def h(s, f):\n    os.write(2, b'pi-run: interrupted\\n'); os._exit(130)\n"
               "signal.signal(signal.SIGINT, h)\nprint('ready', flush=True)\ntime.sleep(30)")
    assert hp.classify(py(handled, signal_at=(1.0, signal.SIGINT))) == "interrupted"
    # Python's own KeyboardInterrupt: a traceback (and death by SIGINT)
    assert hp.classify(py("import time; time.sleep(30)", signal_at=(1.0, signal.SIGINT))) == "traceback"
    silent = hp.Run(["pi-run"], -signal.SIGINT, b"", 0, b"", 0.01, sent=signal.SIGINT)
    assert hp.classify(silent) == "interrupted"  # killed before the interpreter had a handler: nothing printed
    assert hp.classify(hp.Run(["pi-run"], 130, b"", 0, b"", 1.0)) == "signal"  # 130 that nobody sent
    killed = py("import time; time.sleep(30)", signal_at=(0.5, signal.SIGKILL))
    assert hp.classify(killed) == "killed"


def test_tool_names():
    assert hp.tool_of(hp.tool_cmd("pi-plan", "show", "m.gguf")) == "pi-plan show"
    assert hp.tool_of(hp.tool_cmd("pi-plan", "m.gguf", "--gpu", "t4")) == "pi-plan plan"
    assert hp.tool_of([PY, "-m", "pinfer_llm.cli.plan", "compare", "m.gguf"]) == "pi-plan compare"
    assert hp.tool_of(hp.tool_cmd("pi-run", "m.gguf")) == "pi-run"
    assert hp.tool_of([PY, "-m", "pinfer_llm.cli.serve", "m.gguf"]) == "pi-serve"


def test_expectations():
    assert hp.judge("ok", "clean") == "accepted"
    assert hp.judge("clean", "ok") == "refused"
    assert hp.judge("traceback", "ok") == "traceback" and hp.judge("hang", "clean") == "hang"
    assert hp.judge("clean", "clean") == "clean" and hp.judge("ok", "any") == "ok"


def test_any_failing_run_fails_the_pass():
    ok = hp.Result("values", "pi-run", "c", "ok")
    assert hp.exit_status([ok, hp.Result("values", "pi-run", "c", "clean")], 0) == 0
    for cls in hp.FAILING:
        assert hp.exit_status([ok, hp.Result("mutants", "pi-run", "c", cls)], 0) == 1, cls
    assert hp.exit_status([ok], skipped=3) == 3  # incomplete is not a pass


def _base(tmp_path):
    """A tiny PowerInfer-layout model with a section holding statistics and a plan mask, as the pass's base."""
    from pinfer_llm.formats import constants as C
    from pinfer_llm.formats.update import update_model

    p = tmp_path / "b.gguf"
    write_tiny(p, powerinfer=True)
    update_model(p, set_metadata={C.ACT_TOKENS: np.uint64(40)},
                 set_tensors={**{C.tensor(C.ACT_COUNTS, i): np.full(160, 3, np.float32) for i in range(2)},
                              C.tensor(C.GPU_IDX, 0): np.ones(160, np.int32)})
    return hp.load_base("tiny", p, False, [])


def test_the_nan_oracle_finds_a_planted_nan(tmp_path):
    base = _base(tmp_path)
    assert hp.nonfinite(base.data, base.used) == []
    h = hp.walk(base.data)
    t = next(t for t in h.tensors if t.name == "blk.1.ffn_up.weight")  # F32
    b = bytearray(base.data)
    struct.pack_into("<f", b, h.data_offset + t.offset + 4 * 17, float("inf"))
    assert hp.nonfinite(bytes(b), base.used) == ["blk.1.ffn_up.weight"]
    f16 = next(t for t in h.tensors if t.name == "blk.0.fc1.weight")
    b = bytearray(base.data)
    struct.pack_into("<e", b, h.data_offset + f16.offset + 6, float("nan"))
    assert hp.nonfinite(bytes(b), base.used | {"blk.0.fc1.weight"}) == ["blk.0.fc1.weight"]


def test_every_mutant_kind_changes_the_file_and_is_reproducible(tmp_path):
    base = _base(tmp_path)
    kinds = set()
    for i in range(len(hp.KINDS)):
        a, b = tmp_path / "a.gguf", tmp_path / "b2.gguf"
        kind, desc, _ = hp.make_mutant(base, i, 7, a)
        assert hp.make_mutant(base, i, 7, b)[1] == desc and a.read_bytes() == b.read_bytes(), desc
        assert a.read_bytes() != base.data, desc
        kinds.add(kind)
    assert kinds == set(hp.KINDS)
