"""The part of CuPy that CudaDevice uses, on the CPU: kernels run in the emulation (emu.py), arrays are numpy.

Passed as CudaDevice(cupy=fake_cupy), it runs the real wrapper code (argument packing, grids, layouts) against the
real kernels. Every array is allocated with 64 guard bytes on each side; after each launch the guards of every live
array are checked, so a kernel writing out of bounds fails its test.

Stream capture as CuPy's (Stream.begin_capture / end_capture -> Graph, Graph.launch(stream)): while the current stream
captures, launches, copies, fills and event records are kept, not run, with their arguments as they were when
queued (pointers and scalars by value, as a CUDA graph holds them), and each Graph.launch runs them in order. A
kernel that read a scalar the host meant to change per step (a position) replays the captured one, so the tests
see it. Allocations during capture run at once, as in CuPy's relaxed capture mode.

`calls` counts what a real CuPy would ask of the driver (launch, copy_up, copy_down, alloc, fill, event_record,
event_wait, stream_sync, graph_launch, capture); a replayed graph's nodes are not counted again, as the driver runs
them itself. `calls.reset()` starts a count.
"""

from __future__ import annotations

import collections
import time
import types
import weakref

import numpy as np

from . import emu

GUARD = 64
_PATTERN = 0xA5
_live: list[weakref.ref] = []
# False: plain numpy allocations and no guard checks (benchmarks/hybrid_overhead.py times the wrappers alone)
CHECKED = True


class _Calls(collections.Counter):
    def reset(self) -> None:
        self.clear()

    def total(self) -> int:
        return sum(self.values())


calls = _Calls()
_streams: list = []  # the current stream (`with stream:`), innermost last


def _capturing(stream=None):
    """The stream capturing the work queued on `stream` (or on the current one), or None."""
    s = stream if stream is not None else (_streams[-1] if _streams else None)
    return s if s is not None and s._graph is not None else None


def _queue(kind: str, fn, stream=None) -> None:
    """Run fn now, or keep it in the graph being captured on the stream."""
    calls[kind] += 1
    s = _capturing(stream)
    if s is None:
        fn()
    else:
        s._graph._nodes.append(fn)


class FakeArray(np.ndarray):
    """numpy, plus CuPy's transfer methods."""

    def set(self, host, stream=None):
        src = host  # a page-locked buffer: read when the copy runs (at each replay), as the DMA engine reads it
        _queue("copy_up", lambda: self.__setitem__(Ellipsis, src), stream)

    def get(self, stream=None, out=None, blocking=True):
        if out is None:
            calls["copy_down"] += 1
            return np.array(self)
        _queue("copy_down", lambda: out.__setitem__(Ellipsis, self), stream)
        return out

    def fill(self, value):
        _queue("fill", lambda: np.ndarray.fill(self, value))


def _alloc(shape, dtype) -> FakeArray:
    dtype = np.dtype(dtype)
    shape = tuple(np.atleast_1d(shape)) if not isinstance(shape, tuple) else shape
    calls["alloc"] += 1
    if not CHECKED:
        return np.empty(shape, dtype).view(FakeArray)
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
    if not CHECKED:
        return
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
    if CHECKED:
        a.view(np.uint8)[...] = 0xCD  # not zeros: a kernel must write what it returns
    return a


def zeros(shape, dtype=np.float32) -> FakeArray:
    a = _alloc(shape, dtype)
    a.fill(0)  # cupy.zeros: an allocation and a memset on the current stream
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


def copyto(dst, src):
    _queue("launch", lambda: np.copyto(dst, src))  # CuPy's copyto is an elementwise kernel


def ascontiguousarray(a):
    return np.ascontiguousarray(a).view(FakeArray)


# The architecture whose branches the emulated kernels take (emu.build's arch: 900 runs Hopper's); 0, the generic ones.
ARCH = 0


class RawModule:
    def __init__(self, code: str, options=()):
        assert "--std=c++17" in options
        self._module = emu.build(code, ARCH)

    def get_function(self, name: str):
        kernel = self._kernel(name)

        def launch(grid, block, args, **kw):
            args = tuple(args)  # by value, as cuLaunchKernel copies them

            def run():
                kernel(grid, block, args, **kw)
                check_guards()

            _queue("launch", run)

        return launch

    def _kernel(self, name: str):
        return self._module.get_function(name)


class _Device:
    attributes = {"MultiProcessorCount": 2}
    compute_capability = "90"

    def __init__(self, device_id=0):
        self.id = device_id

    def use(self):
        pass

    def synchronize(self):
        calls["device_sync"] += 1


class CaptureError(RuntimeError):
    """What CUDA refuses while a stream captures (cudaErrorStreamCaptureUnsupported and its kin)."""


class Graph:
    """A captured sequence of work: launch() runs it on a stream, after the work queued there before."""

    def __init__(self):
        self._nodes: list = []

    def launch(self, stream=None):
        if _capturing(stream) is not None:
            raise CaptureError("a graph launched into a capture")
        calls["graph_launch"] += 1
        for fn in self._nodes:
            fn()


class _Stream:
    def __init__(self, non_blocking=False):
        self._graph: Graph | None = None
        self.ptr = id(self)

    def __enter__(self):
        _streams.append(self)
        return self

    def __exit__(self, *exc):
        _streams.pop()
        return False

    def synchronize(self):
        if self._graph is not None:
            raise CaptureError("stream synchronized while it captures")
        calls["stream_sync"] += 1

    def record(self, event=None):
        event = _Event() if event is None else event
        event.record(self)
        return event

    def begin_capture(self, mode=None):
        if self._graph is not None:
            raise CaptureError("the stream captures already")
        calls["capture"] += 1
        self._graph = Graph()

    def end_capture(self) -> Graph:
        if self._graph is None:
            raise CaptureError("the stream does not capture")
        g, self._graph = self._graph, None
        return g

    def is_capturing(self) -> bool:
        return self._graph is not None


class _Event:
    """Work on the CPU is done when it runs: an event happens when its record runs (in a graph: at each replay, as
    an external event node; CudaDevice records those with record_external)."""

    t = 0.0

    def __init__(self, block=False, blocking=False, disable_timing=False, interprocess=False):
        self.ptr = id(self)
        self.pending = False  # recorded in a capture and not yet replayed: a wait on it would wait on nothing

    def record(self, stream=None):
        self._record(stream, external=False)

    def _record(self, stream, external: bool):
        s = _capturing(stream)
        if s is not None and not external:
            raise CaptureError("a plain event record in a capture only orders streams; the host cannot wait on it")

        def happen():
            self.t = time.perf_counter()
            self.pending = False

        if s is not None:
            self.pending = True
        _queue("event_record", happen, stream)

    def synchronize(self):
        if self.pending:
            raise CaptureError("the host waited on an event of a graph not launched yet")
        calls["event_wait"] += 1


def record_external(event, stream):
    """cuEventRecordWithFlags(event, stream, CU_EVENT_RECORD_EXTERNAL): in a capture, an event node that fires at
    each replay; outside one, a plain record."""
    event._record(stream, external=True)


def _pinned(n: int) -> bytearray:
    calls["alloc"] += 1
    return bytearray(n)


cuda = types.SimpleNamespace(
    Device=_Device, Stream=_Stream, Event=_Event, Graph=Graph, alloc_pinned_memory=_pinned,
    record_external=record_external,
    get_elapsed_time=lambda a, b: 1e3 * (b.t - a.t), runtime=types.SimpleNamespace(getDeviceCount=lambda: 1))
