"""Build CUDA sources for the CPU emulation (cuda_emu.h) and launch their kernels through ctypes.

`build(code)` compiles the text as C++ with g++ (the header force-included), finds every `extern "C" __global__`
entry point in the preprocessed text, and adds one C shim per kernel, emu_launch_<name>(grid, block, seed,
params...), whose parameters are the kernel's own: a wrong argument type fails in C++ or in `Kernel.__call__`,
which checks each numpy argument's dtype against the C parameter type. Libraries are cached by the hash of the
text, the header and the flags.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

HEADER = Path(__file__).with_name("cuda_emu.h")
CXX = os.environ.get("CXX", "g++")
# -fsanitize=thread for its instrumentation only: cuda_emu.h defines the __tsan_* hooks (its race detector), and the
# link step below does not name the sanitizer, so libtsan is not linked.
# -fvisibility=hidden and -fno-gnu-unique: a process loads several kernel libraries (a planted fault beside the real
# source), and default-visibility template instances (the kernels, their __shared__ statics) would be bound to the
# first library's copies, so a planted library could run the real kernel's code and share its shared memory.
FLAGS = ("-std=c++17", "-O1", "-fPIC", "-x", "c++", "-Wall", "-Wno-unused-function", "-Wno-unknown-pragmas",
         "-fsanitize=thread", "-fvisibility=hidden", "-fno-gnu-unique")
CACHE = Path(tempfile.gettempdir()) / "pinfer-cuda-emu"

# C parameter type -> (ctypes type, accepted numpy dtypes). Pointers are checked by element type.
_SCALARS = {"int": (ctypes.c_int, (np.int32,)), "i64": (ctypes.c_longlong, (np.int64,)),
            "long long": (ctypes.c_longlong, (np.int64,)), "float": (ctypes.c_float, (np.float32,)),
            "unsigned": (ctypes.c_uint, (np.uint32,)), "u32": (ctypes.c_uint, (np.uint32,))}
_ELEMENTS = {"float": (np.float32,), "u8": (np.uint8, np.int8), "int": (np.int32,), "u16": (np.uint16, np.float16),
             "u32": (np.uint32,), "unsigned": (np.uint32,)}


class EmuError(RuntimeError):
    pass


class Kernel:
    def __init__(self, name: str, params: list[tuple[str, str]], fn):
        self.name, self.params, self.fn = name, params, fn
        argtypes = [ctypes.c_uint] * 7
        for ctype, _ in params:
            argtypes.append(ctypes.c_void_p if ctype.endswith("*") else _SCALARS[ctype][0])
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
        self.seed = 0

    def _arg(self, i: int, ctype: str, pname: str, a):
        where = f"{self.name} argument {i} ({ctype} {pname})"
        if ctype.endswith("*"):
            if isinstance(a, np.ndarray):
                base = ctype.replace("const", "").replace("*", "").strip()
                if a.dtype.type not in _ELEMENTS[base]:
                    raise TypeError(f"{where}: array of {a.dtype}")
                if not a.flags.c_contiguous:
                    raise TypeError(f"{where}: array is not contiguous")
                if not a.flags.writeable and not ctype.startswith("const"):
                    raise TypeError(f"{where}: read-only array for a non-const pointer")
                return a.ctypes.data
            if isinstance(a, np.uint64) and a == 0:  # CudaDevice's null pointer
                return None
            raise TypeError(f"{where}: {type(a).__name__} is not an array")
        ctor, dtypes = _SCALARS[ctype]
        if not isinstance(a, np.generic) or a.dtype.type not in dtypes:
            raise TypeError(f"{where}: needs a numpy {dtypes[0].__name__} scalar, got {type(a).__name__}")
        return a.item()

    def __call__(self, grid, block, args, **_):
        grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
        if len(args) != len(self.params):
            raise TypeError(f"{self.name} takes {len(self.params)} arguments, got {len(args)}")
        cargs = [self._arg(i, c, n, a) for i, ((c, n), a) in enumerate(zip(self.params, args, strict=True))]
        self.seed += 1
        if self.fn(*grid, *block, self.seed, *cargs):
            raise EmuError(f"{self.name}: {self.lib.emu_error().decode()}")


class Module:
    def __init__(self, path: Path, kernels: dict[str, list[tuple[str, str]]]):
        self.lib = ctypes.CDLL(str(path))
        self.lib.emu_error.restype = ctypes.c_char_p
        self.kernels = {}
        for name, params in kernels.items():
            k = Kernel(name, params, getattr(self.lib, f"emu_launch_{name}"))
            k.lib = self.lib
            self.kernels[name] = k

    def get_function(self, name: str) -> Kernel:
        return self.kernels[name]


_KERNEL = re.compile(r'extern\s+"C"\s+__emu_kernel__\s+void\s+(\w+)\s*\(([^)]*)\)')


def _params(text: str) -> list[tuple[str, str]]:
    out = []
    for p in text.split(","):
        p = " ".join(p.replace("__restrict__", "").split())
        m = re.fullmatch(r"(.+?)\s*(\w+)", p)
        ctype = m.group(1).replace(" *", "*").strip()
        out.append((ctype, m.group(2)))
    return out


def _shim(kernels: dict[str, list[tuple[str, str]]]) -> str:
    lines = ['#define EMU_EXPORT extern "C" __attribute__((visibility("default")))',
             'EMU_EXPORT const char* emu_error() { return emu::error.c_str(); }']
    for name, params in kernels.items():
        decl = ", ".join(f"{c} {n}" for c, n in params)
        names = ", ".join(n for _, n in params)
        lines.append(f'EMU_EXPORT int emu_launch_{name}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, '
                     f'unsigned by, unsigned bz, unsigned seed, {decl}) {{\n'
                     f'  return emu::launch(dim3{{gx, gy, gz}}, dim3{{bx, by, bz}}, seed,\n'
                     f'                     [=] {{ {name}({names}); }});\n}}')
    return "\n".join(lines) + "\n"


_lock = threading.Lock()
_modules: dict[str, Module] = {}


def build(code: str, arch: int = 0) -> Module:
    """Compile CUDA source text for the emulation (cached) and load it. arch: the architecture whose branches the
    kernels take (PINFER_ARCH, e.g. 900 for Hopper's); 0 for the generic ones."""
    flags = (*FLAGS, f"-DEMU_ARCH={arch}") if arch else FLAGS
    key = hashlib.sha256("\0".join([code, HEADER.read_text(), CXX, *flags]).encode()).hexdigest()[:20]
    with _lock:
        if key in _modules:
            return _modules[key]
    CACHE.mkdir(parents=True, exist_ok=True)
    src, lib, meta = CACHE / f"{key}.cu", CACHE / f"{key}.so", CACHE / f"{key}.kernels.json"
    if not (lib.exists() and meta.exists()):
        src.write_text(code)
        pre = subprocess.run([CXX, "-E", "-P", "-DEMU_SCAN", "-x", "c++", "-std=c++17", "-include", str(HEADER),
                              str(src)], capture_output=True, text=True)
        if pre.returncode:
            raise EmuError(pre.stderr)
        kernels = {m.group(1): _params(m.group(2)) for m in _KERNEL.finditer(pre.stdout)}
        shim = CACHE / f"{key}.shim.cpp"
        shim.write_text(f'#include "{src}"\n' + _shim(kernels))
        tmp = lib.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        obj = tmp.with_suffix(".o")
        cc = subprocess.run([CXX, *flags, "-c", "-include", str(HEADER), str(shim), "-o", str(obj)],
                            capture_output=True, text=True)
        if not cc.returncode:
            cc = subprocess.run([CXX, "-shared", "-Wl,-Bsymbolic", str(obj), "-o", str(tmp)], capture_output=True,
                                text=True)
        obj.unlink(missing_ok=True)
        if cc.returncode:
            raise EmuError(cc.stderr[-20000:])
        meta.write_text(json.dumps(kernels))
        os.replace(tmp, lib)
    # JSON, not ast.literal_eval: CPython 3.11's AST constructor failed here at random ("recursion depth mismatch")
    # after the emulation's fibers had run
    module = Module(lib, {k: [tuple(p) for p in v] for k, v in json.loads(meta.read_text()).items()})
    with _lock:
        return _modules.setdefault(key, module)
