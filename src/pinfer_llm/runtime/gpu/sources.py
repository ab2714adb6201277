"""The CUDA sources of pinfer's GPU kernels, as the compilers receive them.

Each .cu in kernels/ includes quant.cuh; `source()` inlines it, so one self-contained text goes to NVRTC (CuPy keys
its kernel cache on the text: an edited header must change the key), to nvcc and to the CPU emulation in the tests.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

KERNEL_DIR = Path(__file__).with_name("kernels")
MODULES = ("sparse_ffn", "gemv", "predictor", "norm", "attention", "ops")  # kernels/<name>.cu
_INCLUDE = '#include "quant.cuh"'


@cache
def source(module: str) -> str:
    """kernels/<module>.cu with quant.cuh inlined."""
    text = (KERNEL_DIR / f"{module}.cu").read_text()
    header = (KERNEL_DIR / "quant.cuh").read_text().replace("#pragma once\n", "")
    return text.replace(_INCLUDE, f"// ---- quant.cuh ----\n{header}// ---- end of quant.cuh ----", 1)
