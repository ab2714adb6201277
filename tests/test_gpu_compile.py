"""Every GPU kernel source compiles with nvcc for sm_80, sm_89 and sm_90, warnings as errors, and the decode kernels
do not spill registers (ptxas -v).

sm_90 is a full nvcc build (its code differs: 16-byte atomics). sm_80 and sm_89 share one PTX (nvcc -ptx for
compute_80; nothing in the sources differs below sm_90) that ptxas assembles for each, which is what nvcc would do
after the same front end, at a third less time. Reports are cached by the hash of source, flags and nvcc version
($PINFER_CACHE_DIR/nvcc-tests), so an unchanged source is not compiled twice on a machine.

Decode kernels are all but the 8-token batch variants (*_t8) and the prefill helpers (dequant_*, ffn_act): ptxas
spills in the t8 variants for its own scheduling reasons at any register cap we tried (80 to 255), which costs a
2-8-token batch little. `pytest -s -k occupancy` prints each decode kernel's registers, spills, shared memory and
blocks per SM on sm_89 (RTX 4090) and sm_90 (H100/H200).
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
    for n in ("select_count", "select_rows", "select_active", "rms_norm", "layer_norm", "rope_kv_store", "attn_partial",
              "attn_combine", "add_f32", "gather_rows_f32"):
        assert n in names, n


def test_parse_ptxas():
    log = ("ptxas info    : Compiling entry function 'k_t1' for 'sm_90'\n"
           "ptxas info    : Function properties for k_t1\n"
           "    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 40 registers, used 1 barriers\n")
    assert parse_ptxas(log) == {"k_t1": {"stack": 8, "spill": 16, "regs": 40}}


# Per SM: registers, most resident warps and blocks, shared memory (bytes; a block reserves 1 KB more).
SM_LIMITS = {"sm_89": (65536, 48, 24, 100 * 1024), "sm_90": (65536, 64, 32, 228 * 1024)}
# Threads per block as runtime/gpu/cuda.py launches them, and the blocks per SM the design counts on (launch
# bounds' second argument): sparse_down's two blocks share an SM so one block's reduction overlaps the other's
# stream; sparse_up's sixteen warps per SM keep ~32 KB of its weight loads in flight.
BLOCK = {"sparse_up": (128, 4), "sparse_down": (256, 2), "gemv": (128, 3), "select": (256, 1), "rms_norm": (256, 1),
         "layer_norm": (256, 1), "rope_kv_store": (64, 1), "attn_partial": (128, 1), "attn_combine": (128, 1),
         "add_f32": (256, 1), "gather_rows_f32": (256, 1), "set_cols_f32": (256, 1),
         "count_active": (256, 1)}


def blocks_per_sm(arch: str, threads: int, regs: int, smem: int) -> int:
    """Resident blocks per SM by registers (allocated per warp in units of 256), warps, blocks and shared memory."""
    reg_sm, max_warps, max_blocks, smem_sm = SM_LIMITS[arch]
    warps = -(-threads // 32)
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = (reg_sm // per_warp) // warps
    by_smem = smem_sm // (smem + 1024) if smem else max_blocks
    return min(by_regs, max_warps // warps, max_blocks, by_smem)


def parse_smem(log: str) -> dict[str, int]:
    out, cur = {}, None
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            cur = m.group(1)
        elif cur is not None and "Used" in line and "registers" in line:
            m = re.search(r"(\d+) bytes smem", line)
            out[cur] = int(m.group(1)) if m else 0
    return out


def _decode_kernel(name: str) -> tuple[int, int] | None:
    if name.endswith("_t8") or name.startswith("dequant_") or name == "ffn_act":
        return None
    for prefix, cfg in BLOCK.items():
        if name.startswith(prefix):
            return cfg
    raise AssertionError(f"{name}: a kernel this test does not know the launch of (add it to BLOCK)")


def test_block_sizes_are_what_cuda_py_launches():
    from pinfer_llm.runtime.gpu import cuda

    assert BLOCK["sparse_up"][0] == cuda.UP_THREADS and BLOCK["select"][0] == cuda.SELECT_THREADS


@pytest.mark.parametrize("arch", ("sm_89", "sm_90"))
def test_decode_kernels_occupancy(reports, arch):
    """Every decode kernel: no spill, and the blocks per SM its launch bounds ask for (ptxas -v's registers and
    shared memory against the SM's limits)."""
    rows, bad = [], []
    for module in MODULES:
        log = reports[module, arch][1]
        smem = parse_smem(log)
        for name, info in sorted(parse_ptxas(log).items()):
            cfg = _decode_kernel(name)
            if cfg is None:
                continue
            threads, want = cfg
            b = blocks_per_sm(arch, threads, info["regs"], smem[name])
            rows.append(f"{arch} {name:<22} {threads:4d} thr {info['regs']:4d} regs {info.get('spill', 0):4d} B spill "
                        f"{smem[name]:6d} B smem {b:3d} blocks/SM ({b * threads // 32} warps)")
            if info.get("spill", 0) or b < want:
                bad.append(rows[-1] + f": needs {want} blocks/SM, no spill")
    print("\n" + "\n".join(rows))
    assert rows and not bad, "\n".join(bad)


def test_blocks_per_sm():
    assert blocks_per_sm("sm_90", 256, 128, 18432) == 2  # 128 regs x 256 threads = half the register file
    assert blocks_per_sm("sm_89", 256, 123, 36864) == 2  # smem: 2 x 37 KB of 100 KB
    assert blocks_per_sm("sm_89", 128, 40, 0) == 12  # warps: 48 / 4
    assert blocks_per_sm("sm_89", 128, 129, 0) == 3  # 136 regs per thread after rounding
    assert blocks_per_sm("sm_90", 256, 33, 0) == 6  # 40 after rounding: 51 warps, not 64 / 8
    assert blocks_per_sm("sm_89", 256, 32, 60000) == 1  # smem
