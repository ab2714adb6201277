"""A first run and a busy machine: the kernel build says so once and what it cost, the load line splits its seconds,
torch's threads wait in a way that does not collapse beside another process, and -t beyond the free cores is said.
"""

import os
import re
import subprocess
import sys
import time

import pytest
import torch

from pinfer_llm.cli import threads as T
from pinfer_llm.runtime.cpu import kernels as cpu_kernels
from tests.tiny import write_tiny


def fake_build(monkeypatch, tmp_path):
    """build() with the compiler and the smoke test replaced by writing a file: what it says, not what it makes."""
    monkeypatch.setenv("PINFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_kernels, "_compile_and_link", lambda cxx, flags, work, out: out.write_bytes(b"lib"))
    monkeypatch.setattr(cpu_kernels, "_smoke_test", lambda lib, ns: None)


def test_a_build_says_so_once_with_its_cost(monkeypatch, tmp_path, capsys):
    fake_build(monkeypatch, tmp_path)
    path = cpu_kernels.build(spinner=True)
    err = capsys.readouterr().err.splitlines()
    isa = cpu_kernels.expected_isa(cpu_kernels.march())
    assert err[0] == f"pinfer: building the CPU kernels for {isa}, once (~{cpu_kernels.build_estimate_s()} s on " \
                     f"{len(os.sched_getaffinity(0))} cores)"
    assert re.fullmatch(rf"pinfer: built them into {re.escape(str(path.parent))} in \d+\.\d s", err[1])
    assert len(err) == 2
    assert cpu_kernels.build(spinner=True) == path  # the cache: not a word
    assert capsys.readouterr().err == ""


def test_the_named_isa_is_the_one_the_library_reports():
    """What the build announces is what the compiled library says it took (csrc/simd.h's isa_name())."""
    if not cpu_kernels.available():
        pytest.skip(cpu_kernels.status())
    assert cpu_kernels.expected_isa(cpu_kernels.march()) == torch.ops.pinfer.isa()


@pytest.mark.parametrize("flags, isa", [
    ("fpu sse2 avx", "portable"),
    ("avx2 fma f16c", "avx2"),
    ("avx2 fma f16c avx_vnni", "avx2+avx-vnni"),
    ("avx2 fma f16c avx512f avx512bw avx512vl", "avx512"),
    ("avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni", "avx512+vnni"),
    ("avx2 fma f16c avx512f avx512bw", "avx2"),  # no VL: simd.h stays on the AVX2 path
    ("avx2 fma f16c avx512f avx512bw avx512_vnni", "avx2"),  # nor does VNNI count without VL
])
def test_expected_isa_follows_simd_h(monkeypatch, flags, isa):
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: "flags\t: " + flags)
    assert cpu_kernels.expected_isa("native") == isa


def test_the_load_line_splits_import_kernels_and_model(tmp_path):
    path = tmp_path / "t.gguf"
    write_tiny(path)
    code = "import time; time.sleep(0.6); from pinfer_llm.cli.run import main; main()"
    res = subprocess.run([sys.executable, "-c", code, str(path), "-p", "ab", "-n", "2", "-t", "1", "--temp", "0"],
                         capture_output=True, text=True, timeout=300, check=True)
    line = next(ln for ln in res.stderr.splitlines() if ln.startswith("load"))
    m = re.match(r"load\s+([\d.]+) s\s+import ([\d.]+) s \+ CPU kernels ([\d.]+) s( \(built, once\))? \+ model "
                 r"([\d.]+) s; t\.gguf", line)
    assert m, line
    total, imp, kern, model = (float(m.group(i)) for i in (1, 2, 3, 5))
    assert imp >= 0.6  # the process's age when loading began: the sleep, Python's start and the imports
    assert abs(total - (imp + kern + model)) <= 0.015


def test_process_age_counts_from_the_process_start():
    code = "import time; time.sleep(0.5); from pinfer_llm.runtime.engine import process_age_s; print(process_age_s())"
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0.5 <= age < 30


@pytest.mark.parametrize("env, want", [
    ({}, T.SPINCOUNT),
    ({"GOMP_SPINCOUNT": "77"}, "77"),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, None),  # the user's choice: nothing added beside it
])
def test_the_cli_sets_a_wait_policy_unless_the_user_did(env, want):
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = "import os, pinfer_llm.cli; print(os.environ.get('GOMP_SPINCOUNT'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=base | env,
                         check=True).stdout.strip()
    assert out == str(want)


def fake_ticks(monkeypatch, samples):
    """/proc as a list of ((busy, total) of our CPUs, this process's ticks), one per reading."""
    it = iter(samples)
    cur = {}

    def cpu(cpus):
        cur["s"] = next(it)
        return cur["s"][0]

    monkeypatch.setattr(T, "_cpu_ticks", cpu)
    monkeypatch.setattr(T, "_own_ticks", lambda: cur["s"][1])
    monkeypatch.setattr(T, "usable_cores", lambda: [0, 1])
    monkeypatch.setattr(T.BusyCores, "MIN_WINDOW_S", 0.0)


def test_busy_cores_leave_this_process_out(monkeypatch):
    # 2 CPUs, 600 ticks in the window: 300 busy, 100 of them this process's: others keep 200/300 = 0.67 cores
    fake_ticks(monkeypatch, [((100, 1000), 10), ((400, 1600), 110)])
    assert T.BusyCores().free() == pytest.approx(2 - 2 / 3)


@pytest.mark.parametrize("busy_others, threads, warned", [(0, 2, False), (150, 2, False), (200, 2, True),
                                                           (200, 1, False), (600, 2, True)])
def test_a_warning_when_threads_outnumber_free_cores(monkeypatch, capsys, busy_others, threads, warned):
    fake_ticks(monkeypatch, [((0, 0), 0), ((busy_others + 50, 600), 50)])
    T.warn_if_busy("pi-run", threads, T.BusyCores())
    err = capsys.readouterr().err
    assert bool(err) == warned
    if warned:
        free = 2 - busy_others / 300
        assert err == (f"pi-run: warning: {threads} threads, but other processes keep {2 - free:.1f} of 2 cores "
                       f"busy: -t {max(1, round(free))} may be faster\n")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_busy_cores_sees_a_spinning_process():
    sample = T.BusyCores()
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 1.0\nwhile time.time() < t: pass"])
    t0 = time.time()
    while time.time() - t0 < 0.6:  # this process busy too: not counted
        pass
    free = sample.free()
    spin.wait()
    assert free is not None and free <= len(sample.cpus) - 0.5


class _M:
    threads = 2


@pytest.mark.parametrize("explicit, busy_others, threads, said", [
    (False, 300, 1, "pi-run: other processes keep 1.0 of 2 cores busy: using 1 thread (-t 2 to use every core anyway)"),
    (False, 100, 2, None),  # a third of a core: both threads stay
    (True, 300, 2, "pi-run: warning: 2 threads, but other processes keep 1.0 of 2 cores busy: -t 1 may be faster"),
    (False, 600, 1, "pi-run: other processes keep 2.0 of 2 cores busy: using 1 thread (-t 2 to use every core anyway)"),
])
def test_threads_fit_the_free_cores_unless_asked(monkeypatch, capsys, explicit, busy_others, threads, said):
    fake_ticks(monkeypatch, [((0, 0), 0), ((busy_others + 50, 600), 50)])
    m = _M()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        T.fit_threads("pi-run", m, explicit, T.BusyCores())
        assert m.threads == threads and torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    assert capsys.readouterr().err == (said + "\n" if said else "")
