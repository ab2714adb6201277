"""Every GPU kernel source compiles with nvcc for sm_80, sm_89 and sm_90, warnings as errors, and the decode kernels
do not spill registers (ptxas -v).

sm_90 is a full nvcc build (its code differs: 16-byte atomics). sm_80 and sm_89 share one PTX (nvcc -ptx for
compute_80; nothing in the sources differs below sm_90) that ptxas assembles for each, which is what nvcc would do
after the same front end, at a third less time. Reports are cached by the hash of source, flags and nvcc version
($PINFER_CACHE_DIR/nvcc-tests), so an unchanged source is not compiled twice on a machine.

Decode kernels are all but the 8-token batch variants (*_t8): ptxas spills a few bytes there for its own
scheduling reasons at any register cap we tried (80 to 255), which costs a 2-8-token batch little.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pinfer_llm.runtime.gpu.sources import MODULES, source

NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
pytestmark = [pytest.mark.skipif(NVCC is None, reason="nvcc is not installed (CUDA toolkit); kernels not compiled"),
              pytest.mark.slow]
ARCHS = ("sm_80", "sm_89", "sm_90")
FLAGS = ("-std=c++17", "-Werror", "all-warnings", "-Xptxas", "-v,--warning-as-error")


def _cache_dir() -> Path:
    root = os.environ.get("PINFER_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "pinfer")
    return Path(root).expanduser() / "nvcc-tests"


def _run(cmd: list[str]) -> tuple[int, str]:
    p = subprocess.run(cmd, capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


def _compile(module: str, version: str) -> dict[str, tuple[int, str]]:
    """{arch: (returncode, compiler output)} for one module, from the cache when the inputs are unchanged."""
    text = source(module)
    key = hashlib.sha256("\0".join([text, version, *FLAGS]).encode()).hexdigest()[:24]
    cached = _cache_dir() / f"{module}-{key}"
    if all((cached / f"{a}.log").exists() for a in ARCHS):
        return {a: (int((cached / f"{a}.rc").read_text()), (cached / f"{a}.log").read_text()) for a in ARCHS}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / f"{module}.cu"
        src.write_text(text)
        out["sm_90"] = _run([NVCC, "-cubin", "-arch=sm_90", *FLAGS, str(src), "-o", f"{tmp}/k90.cubin"])
        rc, log = _run([NVCC, "-ptx", "-arch=compute_80", *FLAGS[:3], str(src), "-o", f"{tmp}/k80.ptx"])
        for arch in ("sm_80", "sm_89"):
            if rc:
                out[arch] = (rc, log)
            else:
                prc, plog = _run([str(Path(NVCC).parent / "ptxas"), f"-arch={arch}", "-v", "--warning-as-error",
                                  f"{tmp}/k80.ptx", "-o", f"{tmp}/{arch}.cubin"])
                out[arch] = (prc, log + plog)
    cached.mkdir(parents=True, exist_ok=True)
    for a, (rc, log) in out.items():
        (cached / f"{a}.rc").write_text(str(rc))
        (cached / f"{a}.log").write_text(log)
    return out


@pytest.fixture(scope="module")
def reports() -> dict[tuple[str, str], tuple[int, str]]:
    version = subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout
    # largest first, so the two cores finish together
    order = sorted(MODULES, key=lambda m: -len(source(m)))
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        results = dict(zip(order, pool.map(lambda m: _compile(m, version), order), strict=True))
    return {(m, a): results[m][a] for m in MODULES for a in ARCHS}


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """{kernel: {"regs", "spill", "stack"}} from ptxas -v output."""
    out: dict[str, dict[str, int]] = {}
    cur = None
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            cur = out.setdefault(m.group(1), {})
        elif cur is not None and (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                                                 r"(\d+) bytes spill loads", line)):
            cur.update(stack=int(m.group(1)), spill=int(m.group(2)) + int(m.group(3)))
        elif cur is not None and (m := re.search(r"Used (\d+) registers", line)):
            cur["regs"] = int(m.group(1))
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("module", MODULES)
def test_compiles_without_warnings(reports, module, arch):
    rc, log = reports[module, arch]
    assert rc == 0, f"{module}.cu for {arch}:\n{log[-5000:]}"
    assert "warning" not in log.lower(), log[-5000:]
    assert parse_ptxas(log), f"no kernels in {module}.cu?"


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_kernels_do_not_spill(reports, arch):
    spills = {}
    for module in MODULES:
        for name, info in parse_ptxas(reports[module, arch][1]).items():
            if not name.endswith("_t8") and info.get("spill", 0):
                spills[name] = info
    assert not spills, f"{arch}: register spills in {spills}"


def test_every_type_has_every_entry_point(reports):
    """CudaDevice calls kernels by name: each weight type must have its gemv, dequant and sparse FFN variants."""
    from pinfer_llm.runtime.gpu import layout

    names = set()
    for module in MODULES:
        names |= set(parse_ptxas(reports[module, "sm_90"][1]))
    for t in layout.NAMES.values():
        for n in (f"gemv_{t}_t1", f"gemv_{t}_t8", f"dequant_{t}", f"sparse_up_{t}_t1", f"sparse_up_{t}_t8",
                  f"sparse_down_{t}_t1", f"sparse_down_{t}_t2"):
            assert n in names, n
    for n in ("select_active", "rms_norm", "layer_norm", "rope_kv_store", "attn_partial", "attn_combine", "add_f32",
              "gather_rows_f32"):
        assert n in names, n


def test_parse_ptxas():
    log = ("ptxas info    : Compiling entry function 'k_t1' for 'sm_90'\n"
           "ptxas info    : Function properties for k_t1\n"
           "    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 40 registers, used 1 barriers\n")
    assert parse_ptxas(log) == {"k_t1": {"stack": 8, "spill": 16, "regs": 40}}
