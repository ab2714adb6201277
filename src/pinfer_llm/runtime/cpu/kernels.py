"""pinfer's C++ CPU kernels (runtime/cpu/csrc/): built once with the host compiler, smoke-tested, cached, loaded into
torch.ops.pinfer.

The CPU counterpart of CuPy's RawKernel: the source ships with the package and is compiled on the machine that runs
it, so it can use that CPU's instruction set (-march=$PINFER_CPU_MARCH, default native; x86-64-v3 builds the AVX2
path, x86-64 the portable one) and link torch's own libraries and OpenMP runtime (the kernels run on torch's thread
pool, honouring torch.set_num_threads). The op list and semantics are in runtime/cpu/csrc/ops.cpp.

Build: each source file compiles to an object in parallel (the kernel files include no torch headers), the objects
link into one library, and a subprocess loads it and runs every op once on tiny inputs (a smoke test: a library built
for instructions this CPU lacks dies there with SIGILL, not in the caller). Only then is it renamed into the cache,
$PINFER_CACHE_DIR/kernels (default $XDG_CACHE_HOME/pinfer/kernels, ~/.cache/pinfer/kernels), under a hash of
everything that affects it: sources, flags (with -march), compiler version, the CPU's feature flags, torch's version.
A failed build or smoke test is remembered in a marker file under the same hash (holding the error), so later
processes fall back at once instead of retrying. Concurrent processes serialise on a lock file; the library appears
atomically (temporary file + rename).

Without a compiler, with a failed build, or with PINFER_CPU_KERNELS=0, `available()` is False and pinfer uses torch's
own operators instead: same results, slower. Nothing here raises out of `available()`.

Why not torch.utils.cpp_extension.load, which also caches, locks and rebuilds on change: it needs ninja (not a torch
dependency), its cache key is the sources and flags but not the CPU's features (a cache shared by two machines could
load a library that dies with SIGILL), it runs no smoke test, it does not remember a failed build (every process
retries a broken compiler), and its lock is a file whose existence is the lock, so a killed build leaves every later
process waiting on it.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

import torch

SRC_DIR = Path(__file__).with_name("csrc")
KERNEL_SOURCES = ("dot.cpp", "matmul.cpp", "sparse_ffn.cpp", "predictor.cpp", "attention.cpp", "norm.cpp",
                  "device_layout.cpp", "requant.cpp", "step.cpp", "kquant.cpp")
TORCH_SOURCES = ("torch_bridge.cpp", "ops.cpp")  # the two files that include torch's headers (slow to compile)
HEADERS = ("simd.h", "quant.h", "kernels.h")
NAMESPACE = "pinfer"  # torch.ops.pinfer: the runtime's build
CPUINFO = "/proc/cpuinfo"
COMMON_FLAGS = ("-std=c++17", "-fPIC", "-fvisibility=hidden", "-fopenmp", "-w")
SMOKE_TIMEOUT_S = 300

_state: dict = {}  # "ok": bool, "why": str (when not ok), "path": Path (when ok)
_variants: dict[str, object] = {}  # march -> torch.ops namespace, for tests and benchmarks
_compile_slots = threading.BoundedSemaphore(os.cpu_count() or 2)  # compiler processes at once, across builds
_build_lock = threading.Lock()
_built: set[str] = set()  # namespaces this process compiled (rather than found in the cache)


def cache_dir() -> Path:
    """$PINFER_CACHE_DIR/kernels, else $XDG_CACHE_HOME/pinfer/kernels, else ~/.cache/pinfer/kernels. An empty or
    relative XDG_CACHE_HOME counts as unset (the XDG spec says to ignore relative paths), so the cache never lands in
    the current directory."""
    root = os.environ.get("PINFER_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "pinfer")
    return Path(root).expanduser() / "kernels"


def march() -> str:
    """The -march value of the runtime's build: $PINFER_CPU_MARCH, default native."""
    return os.environ.get("PINFER_CPU_MARCH") or "native"


def cpu_flags() -> str:
    """The CPU's feature flags line from /proc/cpuinfo (x86 "flags", ARM "Features"): what decides which instructions
    a -march=native library may contain. Two CPUs with one model name can differ here (AVX-512 disabled in a VM)."""
    try:
        with open(CPUINFO) as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.strip()
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def _compiler() -> str:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ('{cxx}'): install g++ (Debian: apt install g++) or set CXX")
    return cxx


def _flags(march_: str, ns: str) -> list[str]:
    # $PINFER_CPU_CXXFLAGS: extra flags for experiments (e.g. -DNAME=value); part of the cache key like the rest
    return [f"-march={march_}", f"-DPINFER_NS={ns}", *COMMON_FLAGS, *os.environ.get("PINFER_CPU_CXXFLAGS", "").split()]


def cache_key(march_: str, ns: str = NAMESPACE, cxx: str | None = None) -> str:
    cxx = cxx or _compiler()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        version = f"unknown ({e})"
    h = hashlib.sha256()
    for name in (*KERNEL_SOURCES, *TORCH_SOURCES, *HEADERS):
        h.update(name.encode() + b"\0" + (SRC_DIR / name).read_bytes())
    for part in (*_flags(march_, ns), torch.__version__, version.splitlines()[0] if version else "", cpu_flags()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:20]


def _torch_flags() -> list[str]:
    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{torch_dir / 'include'}",
            f"-I{torch_dir / 'include/torch/csrc/api/include'}"]


def _run_compiler(cmd: list[str]) -> None:
    with _compile_slots:
        res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-4:]
        raise RuntimeError(f"compiling the CPU kernels failed ({Path(cmd[-1]).name}): {' | '.join(tail)}")


def _compile_and_link(cxx: str, flags: list[str], work: Path, out: Path) -> None:
    jobs = [[cxx, "-O3", *flags, "-c", str(SRC_DIR / s), "-o", str(work / (s + ".o"))] for s in KERNEL_SOURCES]
    jobs += [[cxx, "-O2", *flags, *_torch_flags(), "-c", str(SRC_DIR / s), "-o", str(work / (s + ".o"))]
             for s in TORCH_SOURCES]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        for f in [pool.submit(_run_compiler, cmd) for cmd in jobs]:
            f.result()
    lib = Path(torch.__file__).parent / "lib"
    objs = [str(work / (s + ".o")) for s in (*KERNEL_SOURCES, *TORCH_SOURCES)]
    _run_compiler([cxx, "-shared", *flags, *objs, f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}",
                   "-o", str(out)])


def _smoke_cmd(lib: Path, ns: str) -> list[str]:
    # this file as a standalone module (not the runtime package: nothing else gets imported), then _smoke()
    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('pinfer_smoke', sys.argv[1]); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); m._smoke(sys.argv[2], sys.argv[3])")
    return [sys.executable, "-c", code, str(Path(__file__).resolve()), str(lib), ns]


def _smoke_test(lib: Path, ns: str) -> None:
    try:
        res = subprocess.run(_smoke_cmd(lib, ns), capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the CPU kernels' smoke test did not finish in {SMOKE_TIMEOUT_S} s") from None
    if res.returncode != 0:
        why = (f"killed by signal {-res.returncode}" if res.returncode < 0 else f"exit {res.returncode}")
        tail = " | ".join((res.stderr or res.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"the CPU kernels' smoke test failed ({why}){': ' + tail if tail else ''}")


def _writable(d: Path) -> Path:
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=d):
            pass
        return d
    except OSError:  # a read-only home: build into the temp directory instead
        d = Path(tempfile.gettempdir()) / f"pinfer-{os.getuid()}" / "kernels"
        d.mkdir(parents=True, exist_ok=True)
        return d


def expected_isa(march_: str) -> str:
    """The instruction-set path a build for -march=march_ will take on this CPU, named as csrc/simd.h's isa_name()
    names it (said before a build, when the library cannot be asked yet)."""
    if march_ != "native":
        return {"x86-64-v3": "avx2", "x86-64-v4": "avx512", "x86-64": "portable"}.get(march_, f"-march={march_}")
    flags = set(cpu_flags().split())
    if not {"avx2", "fma", "f16c"} <= flags:
        return "portable"
    avx512 = {"avx512f", "avx512bw", "avx512vl"} <= flags
    vnni = "avx512_vnni" in flags and "avx512vl" in flags or "avx_vnni" in flags
    return ("avx512" if avx512 else "avx2") + ("+vnni" if avx512 and vnni else "+avx-vnni" if vnni else "")


def build_estimate_s() -> int:
    """About how long a build takes here: ~55 s of compiler time, spread over the cores (measured on 2 cores: ~30 s,
    most of it the two files that include torch's headers)."""
    return max(10, round(55 / min(len(KERNEL_SOURCES) + len(TORCH_SOURCES), _cores()) / 5) * 5)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class _Notice:
    """What a build says on stderr, once: a spinner on a terminal, one line elsewhere (a log, a pipe), then what it
    cost. A build is rare (once per machine and version), and 30 s of silence looks like a hang."""

    def __init__(self, enabled: bool, what: str, done: str):
        self.enabled, self.what, self.done, self.status = enabled, what, done, None

    def __enter__(self):
        if not self.enabled:
            return self
        self.t0 = time.perf_counter()
        if sys.stderr.isatty():
            from rich.console import Console

            self.status = Console(stderr=True).status(self.what)
            self.status.__enter__()
        else:
            print(f"pinfer: {self.what}", file=sys.stderr, flush=True)
        return self

    def __exit__(self, kind, *rest):
        if self.status is not None:
            self.status.__exit__(kind, *rest)
        if self.enabled and kind is None:
            print(f"pinfer: {self.done} in {time.perf_counter() - self.t0:.1f} s", file=sys.stderr, flush=True)


def build(march_: str | None = None, ns: str = NAMESPACE, spinner: bool = True) -> Path:
    """Compile the kernels for -march=march_ (default march()) under torch.ops.<ns>, or find them in the cache; return
    the library's path. Raises RuntimeError (with the reason) when there is no compiler, the build or the smoke test
    fails, or an earlier build with the same key failed. spinner: say so on stderr while building (never for a hit)."""
    march_ = march_ or march()
    cxx = _compiler()
    key = cache_key(march_, ns, cxx)
    d = _writable(cache_dir())
    out, failed = d / f"pinfer_cpu_{key}.so", d / f"pinfer_cpu_{key}.failed"

    def cached() -> Path | None:
        if out.exists():
            return out
        if failed.exists():
            raise RuntimeError(f"{failed.read_text().strip()} (an earlier build; delete {failed} to retry)")
        return None

    if (hit := cached()) is not None:
        return hit
    with open(d / f"pinfer_cpu_{key}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process is building the same key: wait for it, then use its result
            with _Notice(spinner, "waiting for another process that is building the CPU kernels", "waited"):
                fcntl.flock(lock, fcntl.LOCK_EX)
        if (hit := cached()) is not None:
            return hit
        work = Path(tempfile.mkdtemp(prefix=f"build_{key}_", dir=d))
        tmp = work / out.name
        try:
            with _Notice(spinner, f"building the CPU kernels for {expected_isa(march_)}, once "
                                  f"(~{build_estimate_s()} s on {_cores()} cores)", f"built them into {d}"):
                _compile_and_link(cxx, _flags(march_, ns), work, tmp)
                _smoke_test(tmp, ns)
            os.replace(tmp, out)
            _built.add(ns)
        except RuntimeError as e:
            failed.write_text(f"{e}\n")
            raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return out


def available() -> bool:
    """True when torch.ops.pinfer's kernels are loaded (building them on first use). Never raises: any failure means
    False, and status() says why."""
    with _build_lock:
        if "ok" not in _state:
            if os.environ.get("PINFER_CPU_KERNELS", "1") == "0":
                _state.update(ok=False, why="disabled by PINFER_CPU_KERNELS=0")
            else:
                try:
                    path = build()
                    torch.ops.load_library(str(path))
                    _state.update(ok=True, path=path, isa=torch.ops.pinfer.isa())
                except Exception as e:  # noqa: BLE001 - a kernel problem must never stop pinfer: torch's ops remain
                    _state.update(ok=False, why=" ".join(str(e).split()) or type(e).__name__)
    return _state["ok"]


def set_threads(n: int) -> None:
    """torch.set_num_threads(n) for the calling thread, the kernels' loops included. ATen gives a thread the
    process-wide thread count on its first parallel loop, checked by an inline function with a thread_local flag of
    which the kernel library has its own copy: a thread that set its count before the kernels' first loop would get
    the process-wide count then (pi-serve's model thread ran its kernels on the main thread's count). So one tiny
    kernel runs first, then the count is set."""
    torch.get_num_threads()
    if available():
        torch.ops.pinfer.rms_norm(torch.ones(1, 8), torch.ones(8), 1e-5)
    torch.set_num_threads(n)


def guard_map(f) -> bool:
    """Make a read fault in the model file's memory map one line on stderr and exit status 1 instead of a bus error
    (rc 135): its pages are gone when the file is truncated while mapped, or when it lives on a tmpfs that filled up
    after a hole in it was mapped (a copy with holes). No Python code can catch that fault, so the handler is the
    kernels' (on_sigbus in csrc/ops.cpp); without them a fault stays a bus error. `f` is a formats.reader.GGUFFile.
    The guard goes when `f` is collected. Returns whether it is in place (not with 64 files mapped at once)."""
    if not available():
        return False
    mm = f.mm
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    prog = prog if prog.startswith("pi-") else "pinfer"
    path = str(f.path)
    path = path if len(path) <= 300 else path[:150] + "..." + path[-150:]
    line = (f"{prog}: error: {path}: part of the file could not be read through its memory map (it was truncated or "
            f"overwritten while in use, or its filesystem ran out of space): free space there, keep the file "
            f"unchanged while pinfer uses it, and run again")
    addr = mm.ctypes.data
    if not torch.ops.pinfer.guard_map(addr, mm.size, line):
        return False
    weakref.finalize(f, torch.ops.pinfer.unguard_map, addr)
    return True


def built_here() -> bool:
    """Whether this process compiled the runtime's kernels (the first run on a machine) rather than loading them."""
    return NAMESPACE in _built


def status() -> str:
    """One line for --verbose output and benchmarks: which kernels run, and why."""
    if available():
        return f"pinfer C++ kernels ({_state['isa']}, -march={march()}, {_state['path'].name})"
    return f"torch kernels ({_state['why']})"


def variant_namespace(march_: str) -> str:
    return NAMESPACE + "_" + "".join(c if c.isalnum() else "_" for c in march_)


def load_variants(marches: list[str]) -> dict[str, object]:
    """Build (in parallel) and load the kernels for several -march values side by side, each under its own namespace
    torch.ops.pinfer_<march> (one process can hold them all): for tests and benchmarks. Returns march -> namespace
    object. Raises RuntimeError when one fails."""
    todo = [m for m in marches if m not in _variants]
    with concurrent.futures.ThreadPoolExecutor(max(1, len(todo))) as pool:
        paths = dict(zip(todo, pool.map(lambda m: build(m, variant_namespace(m), spinner=False), todo), strict=True))
    for m, path in paths.items():
        torch.ops.load_library(str(path))
        _variants[m] = getattr(torch.ops, variant_namespace(m))
    return {m: _variants[m] for m in marches}


def _smoke(lib: str, ns: str) -> None:
    """Run every op of a freshly built library once on tiny inputs (in a subprocess: a crash here marks the build
    bad). Coarse checks against torch; the exactness tests are tests/test_qkernels.py."""
    import numpy as np

    torch.ops.load_library(lib)
    ops = getattr(torch.ops, ns)
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)

    def close(a, b, tol):
        err = (a - b).norm() / max(b.norm(), 1e-6)
        assert err <= tol, f"relative error {err:.3g} > {tol}"

    def blocks(rows, cols, nbytes, head):  # random block-type rows with small half scales at the block starts
        raw = rng.integers(0, 256, (rows, cols // 32, nbytes), dtype=np.uint8)
        raw[:, :, :2 * head] = np.full((rows, cols // 32, head), 0.01, np.float16).view(np.uint8)
        return torch.from_numpy(raw.reshape(rows, -1))

    x = torch.randn(20, 64, generator=g)
    weights = {0: torch.randn(8, 64, generator=g), 1: torch.randn(8, 64, generator=g).half(),
               30: torch.randn(8, 64, generator=g).bfloat16(), 2: blocks(8, 64, 18, 1), 3: blocks(8, 64, 20, 2),
               8: blocks(8, 64, 34, 1)}
    for t, w in weights.items():
        ref = ops.qdequant(w, t)
        assert ref.shape == (8, 64) and torch.isfinite(ref).all()
        close(ops.qembed(w, t, torch.tensor([3, 1])), ref[[3, 1]], 0)
        for T in (1, 3, 20):  # GEMV, multi-token tiles, GEMM
            close(ops.qmatmul(x[:T], [w, w], [t, t]), torch.cat([x[:T] @ ref.T] * 2, 1), 0.05)
        y, n = ops.qffn_sparse(x[:2], w, t, w, t, w, t, torch.tensor([5, 0, 2]), None, 0, None, 0.0)
        assert y.shape == (2, 64) and n == 6
        ops.qffn_sparse(x[:2], None, 0, w, t, w, t, None, None, 4, torch.zeros(8), 0.0)
    w1, w2 = torch.randn(16, 64, generator=g), torch.randn(32, 16, generator=g)
    s = torch.relu(x[:1] @ w1.T) @ w2.T
    want = set((s[0] >= 0.5).nonzero().view(-1).tolist()) | {1}
    for fc2, tr in ((w2.half(), False), (w2.T.contiguous().half(), True)):
        got = ops.qpredict_active(x[0], w1.half(), 1, fc2, 1, 0.5, torch.tensor([1]), tr).tolist()
        assert len(set(got) ^ want) <= 2, (got, want)
    ops.predict_active(x[:1], w1, w2.T.contiguous(), 0.5, None)
    gu, dt = torch.randn(8, 2, 64, generator=g), torch.randn(8, 64, generator=g)
    ops.ffn_sparse_rows(x[:1], gu, dt, torch.tensor([1, 4]), None, 1)
    close(ops.rms_norm(x, torch.ones(64), 1e-6), torch.nn.functional.rms_norm(x, (64,), eps=1e-6), 1e-5)
    close(ops.layer_norm(x, torch.ones(64), None, 1e-5), torch.nn.functional.layer_norm(x, (64,)), 1e-5)
    for dt_ in (torch.float32, torch.float16):
        kc, vc = torch.zeros(2, 8, 16, dtype=dt_), torch.zeros(2, 8, 16, dtype=dt_)
        rope = torch.tensor([[1.0, 0.0]] * 8)
        out = ops.attend_decode(torch.randn(1, 8 * 16, generator=g), rope, kc, vc, 0, 4, 2, 0.25)
        assert out.shape == (1, 64) and torch.isfinite(out).all()
    wg, wu, wd = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g), torch.randn(64, 32, generator=g)
    h = torch.nn.functional.silu(x[:3] @ wg.T) * (x[:3] @ wu.T)
    close(ops.ffn_mm(x[:3], wg, 0, wu, 0, wd, 0, 0, None), h @ wd.T, 1e-4)
    # the decode step: one llama layer and the head, f16 cache (its exactness: tests/test_decode_step.py)
    step = getattr(torch.classes, ns).DecodeStep(64, 4, 2, 0.25, False, torch.tensor([[[1.0, 0.0]] * 8] * 8))
    kc, vc = torch.zeros(2, 8, 16, dtype=torch.float16), torch.zeros(2, 8, 16, dtype=torch.float16)
    ones = torch.ones(64)
    step.add_attention(ones, None, 1e-5, False, [torch.randn(128, 64, generator=g)], [0], None,
                       [torch.randn(64, 64, generator=g)], [0], None, kc, vc, False)
    step.set_ffn_norm(ones, None, 1e-5, False)
    step.set_ffn(0, wg, 0, wu, 0, wd, 0, 0, None, 0.0, None)
    step.set_output(ones, None, 1e-5, False, [torch.randn(10, 64, generator=g)], [0])
    assert step.run(x[:1], 0).shape == (1, 10) and torch.isfinite(step.run(x[1:2], 1)).all()
    print(ops.isa())
