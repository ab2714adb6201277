"""The part of CuPy that CudaDevice uses, on the CPU: kernels run in the emulation (emu.py), arrays are numpy.

Passed as CudaDevice(cupy=fake_cupy), it runs the real wrapper code (argument packing, grids, layouts) against the
real kernels. Every array is allocated with 64 guard bytes on each side; after each launch the guards of every live
array are checked, so a kernel writing out of bounds fails its test.
"""

from __future__ import annotations

import time
import types
import weakref

import numpy as np

from . import emu

GUARD = 64
_PATTERN = 0xA5
_live: list[weakref.ref] = []


class FakeArray(np.ndarray):
    """numpy, plus CuPy's transfer methods."""

    def set(self, host, stream=None):
        self[...] = host

    def get(self, stream=None, out=None, blocking=True):
        if out is None:
            return np.array(self)
        out[...] = self
        return out


def _alloc(shape, dtype) -> FakeArray:
    dtype = np.dtype(dtype)
    shape = tuple(np.atleast_1d(shape)) if not isinstance(shape, tuple) else shape
    n = int(np.prod(shape)) * dtype.itemsize
    buf = np.full(n + 2 * GUARD, _PATTERN, np.uint8)
    _live.append(weakref.ref(buf))
    memory.live += n
    memory.peak = max(memory.peak, memory.live)
    weakref.finalize(buf, memory.free, n)
    return buf[GUARD:GUARD + n].view(dtype).reshape(shape).view(FakeArray)


class _Memory:
    """Device bytes held by live arrays, and the most held at once since reset_peak(): what a real device's memory
    pool would have to hold (arrays are freed when their last reference goes, as CuPy's are)."""

    def __init__(self):
        self.live = self.peak = 0

    def free(self, n: int) -> None:
        self.live -= n

    def reset_peak(self) -> None:
        self.peak = self.live


memory = _Memory()


def check_guards() -> None:
    alive = []
    for ref in _live:
        buf = ref()
        if buf is None:
            continue
        alive.append(ref)
        if (buf[:GUARD] != _PATTERN).any() or (buf[-GUARD:] != _PATTERN).any():
            raise AssertionError("a kernel wrote outside an array (guard bytes changed)")
    _live[:] = alive


def empty(shape, dtype=np.float32) -> FakeArray:
    a = _alloc(shape, dtype)
    a.view(np.uint8)[...] = 0xCD  # not zeros: a kernel must write what it returns
    return a


def zeros(shape, dtype=np.float32) -> FakeArray:
    a = _alloc(shape, dtype)
    a[...] = 0
    return a


def asarray(a) -> FakeArray:
    a = np.asarray(a)
    out = _alloc(a.shape, a.dtype)
    out[...] = a
    return out


def asnumpy(a) -> np.ndarray:
    return np.array(a)


def matmul(a, b):
    out = _alloc(np.broadcast_shapes(a.shape[:-1] + (1,), (1,) * (a.ndim - 1) + b.shape[-1:]),
                 np.result_type(a, b))
    return np.matmul(a, b, out=out)


maximum = np.maximum
copyto = np.copyto


def ascontiguousarray(a):
    return np.ascontiguousarray(a).view(FakeArray)


# The architecture whose branches the emulated kernels take (emu.build's arch: 900 runs Hopper's); 0, the generic ones.
ARCH = 0


class RawModule:
    def __init__(self, code: str, options=()):
        assert "--std=c++17" in options
        self._module = emu.build(code, ARCH)

    def get_function(self, name: str):
        kernel = self._module.get_function(name)

        def launch(grid, block, args, **kw):
            kernel(grid, block, args, **kw)
            check_guards()

        return launch


class _Device:
    attributes = {"MultiProcessorCount": 2}
    compute_capability = "90"

    def __init__(self, device_id=0):
        self.id = device_id

    def use(self):
        pass

    def synchronize(self):
        pass


class _Stream:
    def __init__(self, non_blocking=False):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass

    def record(self):  # an Event: work on the CPU is done when queued
        return self


class _Event:  # work on the CPU is done when queued: an event happens when it is recorded
    t = 0.0

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass


cuda = types.SimpleNamespace(
    Device=_Device, Stream=_Stream, Event=_Event, alloc_pinned_memory=lambda n: bytearray(n),
    get_elapsed_time=lambda a, b: 1e3 * (b.t - a.t), runtime=types.SimpleNamespace(getDeviceCount=lambda: 1))
