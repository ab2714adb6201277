"""Captured device work (CUDA graphs): what a replayed decode step needs from the device.

A hybrid decode step queues, per split layer, a dozen launches and two copies; each costs the host microseconds in
CuPy and the driver, more than the kernels take on the GPU. Captured once (CuPy's stream capture) and replayed, the
layer is one graph launch. Capture fixes every launch's arguments, so what changes per step lives in device memory
(the position: attention.cu's pos_at) and every buffer a graph touches must outlive it at the same address:

- Scratch (the temporaries of a step: projections, scores, attention's partial sums, h) comes from a workspace of
  slots kept by the device: the n-th allocation of a shape and dtype in a capture is slot n of that shape, so every
  layer's graph shares the same few buffers (graphs run one after another on one stream, and none keeps scratch
  across its end), allocated once, never freed while the device lives.
- The host waits inside a graph: an event recorded as an external event node (cuEventRecordWithFlags with
  CU_EVENT_RECORD_EXTERNAL) fires at each replay, between the copy down of what the CPU needs and the device's own
  FFN rows, so the CPU computes its neurons while the GPU computes its own. CuPy has no binding for that call; it is
  made through the driver library, which every CUDA process has loaded.
"""

from __future__ import annotations

import ctypes
import ctypes.util

CU_EVENT_RECORD_EXTERNAL = 0x1


class Capture:
    """One capture in progress on a stream: scratch handed out by shape, the event nodes recorded."""

    def __init__(self, workspace: dict):
        self.workspace = workspace
        self.taken: dict[tuple, int] = {}
        self.graph = None

    def scratch(self, shape: tuple, dtype, make):
        key = (tuple(shape), str(dtype))
        n = self.taken.get(key, 0)
        self.taken[key] = n + 1
        slots = self.workspace.setdefault(key, [])
        if n == len(slots):
            slots.append(make(shape, dtype))
        return slots[n]


def driver_record_external():
    """record(event, stream) through libcuda's cuEventRecordWithFlags, or None where it cannot be loaded (then the
    device does not capture, and the executor runs every step eagerly)."""
    name = ctypes.util.find_library("cuda") or "libcuda.so.1"
    try:
        lib = ctypes.CDLL(name)
        fn = lib.cuEventRecordWithFlags
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint], ctypes.c_int

    def record(event, stream) -> None:
        err = fn(ctypes.c_void_p(event.ptr), ctypes.c_void_p(stream.ptr), CU_EVENT_RECORD_EXTERNAL)
        if err:
            raise RuntimeError(f"cuEventRecordWithFlags failed with CUresult {err}")

    return record
