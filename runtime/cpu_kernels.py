"""pinfer's C++ CPU kernels (runtime/csrc/*.cpp): built once with the host compiler, cached, loaded into torch.ops.

The CPU counterpart of CuPy's RawKernel: the source ships with the package and is compiled on the machine that runs
it, so it can use that CPU's vector width (-march=native) and link torch's own libraries and OpenMP runtime (the
kernels run on torch's thread pool, honouring torch.set_num_threads). The build takes ~15 s once; the library is
cached under $PINFER_CACHE_DIR/kernels (default ~/.cache/pinfer/kernels, beside pi-plan's cache) by a hash of
everything that affects it, written to a temporary file and renamed, so concurrent processes and interrupted builds
never load half a library.

Without a C++ compiler (or with PINFER_CPU_KERNELS=0) `available()` is False and pinfer uses torch's own
operators instead: same results, slower (measurements in runtime/sparse_ops.py and runtime/csrc).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SOURCES = (Path(__file__).with_name("csrc") / "cpu_kernels.cpp",)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-fPIC", "-shared", "-w")

_state: dict = {}  # "ok": bool, "why": str (when not ok), "path": Path (when ok)


def cache_dir() -> Path:
    root = os.environ.get("PINFER_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "pinfer")
    return Path(root).expanduser() / "kernels"


def _cpu_model() -> str:
    try:  # -march=native code is only valid on this CPU model: part of the cache key
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("model name", "flags"))), platform.processor())
    except OSError:
        return platform.processor()


def _compile_cmd(cxx: str, src: list[Path], out: Path) -> list[str]:
    torch_dir = Path(torch.__file__).parent
    lib = torch_dir / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [cxx, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{torch_dir / 'include'}",
            f"-I{torch_dir / 'include/torch/csrc/api/include'}",
            *map(str, src), "-o", str(out), f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]


def build(verbose: bool = False) -> Path:
    """Compile the kernels (or find them in the cache) and return the shared library's path. Raises RuntimeError."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ('{cxx}'): install g++ (Debian: apt install g++) or set CXX")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256()
    for part in (*(p.read_bytes() for p in SOURCES), *FLAGS, torch.__version__, *version, _cpu_model(),
                 sys.version):
        key.update(part if isinstance(part, bytes) else part.encode())
    out = cache_dir() / f"pinfer_cpu_{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: build into the temp directory instead
        out = Path(tempfile.gettempdir()) / f"pinfer-{os.getuid()}" / out.name
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so.tmp", dir=out.parent)
    os.close(fd)
    try:
        from rich.console import Console

        with Console(stderr=True).status("building pinfer's CPU kernels (once, ~10 s)"):
            res = subprocess.run(_compile_cmd(cxx, list(SOURCES), Path(tmp)), capture_output=True, text=True)
        if res.returncode != 0:
            tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"compiling the CPU kernels failed: {' | '.join(tail)}")
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def available() -> bool:
    """True when torch.ops.pinfer's kernels are loaded (building them on first use)."""
    if "ok" not in _state:
        if os.environ.get("PINFER_CPU_KERNELS", "1") == "0":
            _state.update(ok=False, why="disabled by PINFER_CPU_KERNELS=0")
        else:
            try:
                path = build()
                torch.ops.load_library(str(path))
                _state.update(ok=True, path=path)
            except (RuntimeError, OSError) as e:
                _state.update(ok=False, why=str(e))
    return _state["ok"]


def status() -> str:
    """One line for --verbose output and benchmarks: which kernels the sparse FFN uses, and why."""
    if available():
        return f"pinfer C++ kernels ({_state['path'].name})"
    return f"torch kernels ({_state['why']})"
