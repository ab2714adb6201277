"""Finding the GPU pi-run may use: a CUDA device through CuPy, or the CPU stand-in the tests use.

    dev, info, why = acquire("auto")   # (CudaDevice, GPUInfo, "") or (None, None, "CuPy is not installed: ...")

`--gpu none` never looks. `--gpu reference` (or PINFER_GPU=reference) is runtime.gpu.ReferenceDevice: the same
interface computed by torch on the CPU, so the hybrid executor can be run and tested without a GPU; it pretends to
be the card named by PINFER_REFERENCE_GPU ("rtx4090:24" = the planner's rtx4090 row with 24 GiB, the default).
"""

from __future__ import annotations

import os

from pinfer_llm.formats.errors import PinferError
from pinfer_llm.runtime.hybrid.placement import GIB, GPUInfo, match_gpu_table

GPU_CHOICES = ("auto", "none", "cuda", "reference")


def _cuda_info(dev) -> GPUInfo:
    cp = dev.cp
    props = cp.cuda.runtime.getDeviceProperties(dev.device.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    free, total = cp.cuda.runtime.memGetInfo()
    bw = None
    if props.get("memoryClockRate") and props.get("memoryBusWidth"):  # kHz, bits; DDR: two transfers per clock
        bw = 2 * props["memoryClockRate"] * 1e3 * props["memoryBusWidth"] / 8 / 1e9
    return GPUInfo(name, int(total), int(free), bw, match_gpu_table(name, int(total)))


def _reference_info() -> GPUInfo:
    spec = os.environ.get("PINFER_REFERENCE_GPU", "rtx4090:24")
    name, _, gib = spec.partition(":")
    try:
        total = int(float(gib or 24) * GIB)
    except ValueError:
        raise PinferError(f"PINFER_REFERENCE_GPU={spec!r}: expected NAME:GIB, e.g. rtx4090:24") from None
    from pinfer_llm.planner.hardware import gpu_table

    return GPUInfo(f"reference ({name})", total, total, None, name if name in gpu_table() else None)


def acquire(kind: str = "auto"):
    """(device, GPUInfo, "") for the GPU to use, or (None, None, why not). `kind`: auto | none | cuda | reference.
    auto uses a CUDA device when CuPy finds one; cuda insists (a missing GPU is an error)."""
    kind = os.environ.get("PINFER_GPU", kind) if kind == "auto" else kind
    if kind not in GPU_CHOICES:
        raise PinferError(f"unknown --gpu '{kind}' (one of {', '.join(GPU_CHOICES)})")
    if kind == "none":
        return None, None, "--gpu none"
    if kind == "reference":
        from pinfer_llm.runtime.gpu import ReferenceDevice

        return ReferenceDevice(), _reference_info(), ""
    from pinfer_llm.runtime.gpu import CudaDevice, GPUUnavailable

    try:
        dev = CudaDevice(0)
        return dev, _cuda_info(dev), ""
    except GPUUnavailable as e:
        if kind == "cuda":
            raise PinferError(f"--gpu cuda: {e}") from None
        return None, None, str(e)
