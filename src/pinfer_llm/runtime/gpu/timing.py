"""The device's own time, by kind of work: what `pi-run --gpu-timing` adds to the per-token split.

The host's view of a hybrid step (runtime/hybrid/executor.py Split: CPU work, waiting, staging copies) cannot say how
long the GPU itself computed or how long a copy was on the bus: both run asynchronously, overlapped with the CPU. A
Timeline brackets every outermost device operation (a kernel or a few, as one call of the device's interface makes them;
a copy) with a pair of events on the stream it is queued on, and sums each pair's elapsed time by kind once the work
is done (collect(), after the step's result was waited for). On one stream operations run one after another, so
the sums are the GPU's busy time and its copy time; an operation whose events bracket a kernel that starts late
(the GPU was idle, waiting for the host) counts that launch latency too.

Costs host time: two event records per operation (a driver call each; not yet measured on a GPU) and reading
them back; hence off unless asked for, and installed on the device instance only then (install()): an untimed device
runs its plain methods. On runtime.gpu.ReferenceDevice, whose operations are synchronous, an "event" is the host
clock when it is recorded.
"""

from __future__ import annotations

import time

KINDS = ("compute", "copy")


class Timeline:
    """Pairs of events around operations, summed by kind. event(): a fresh event (record(stream=None),
    synchronize()); elapsed_s(a, b): seconds from a to b once both happened."""

    def __init__(self, event, elapsed_s):
        self._event, self._elapsed = event, elapsed_s
        self._free: list = []
        self._pending: list[tuple[str, object, object]] = []
        self.depth = 0  # > 0 inside an operation: the ones it calls are part of it
        self.seconds = dict.fromkeys(KINDS, 0.0)

    def _take(self):
        return self._free.pop() if self._free else self._event()

    def run(self, kind: str, stream, fn, /, *args, **kw):
        a, b = self._take(), self._take()
        a.record(stream)
        self.depth += 1
        try:
            return fn(*args, **kw)
        finally:
            self.depth -= 1
            b.record(stream)
            self._pending.append((kind, a, b))

    def collect(self) -> dict[str, float]:
        """Wait for the operations timed so far, add their time to `seconds`, and return it."""
        for kind, a, b in self._pending:
            b.synchronize()
            self.seconds[kind] += self._elapsed(a, b)
            self._free += (a, b)
        self._pending.clear()
        return self.seconds

    def reset(self) -> None:
        self.collect()
        self.seconds = dict.fromkeys(KINDS, 0.0)

    def install(self, dev) -> Timeline:
        """Time dev's operations from now on: each is replaced, on this instance only, by one that brackets the
        outermost call with events on the stream a copy is given, else the current one (an untimed device pays
        nothing). Returns self, also kept as dev.timeline."""
        for kind, ops, at in (("compute", COMPUTE_OPS, None), ("copy", COPY_OPS, 2)):
            for name in ops:
                setattr(dev, name, _timed(self, kind, getattr(type(dev), name).__get__(dev), at))
        dev.timeline = self
        return self

    @staticmethod
    def uninstall(dev) -> None:
        for name in COMPUTE_OPS + COPY_OPS:
            dev.__dict__.pop(name, None)
        dev.timeline = None


# The device interface's operations (runtime/gpu/__init__.py), by kind; copies take their stream third.
COMPUTE_OPS = ("zero", "copy", "matmul", "dequant_rows", "ffn_up", "ffn_down", "ffn", "predict", "rms_norm",
               "layer_norm", "attention", "add", "set_cols", "count_active", "gather_rows")
COPY_OPS = ("to_device_async", "to_host_async")


def _timed(tl: Timeline, kind: str, op, stream_at: int | None):
    def inner(*args, **kw):
        if tl.depth:  # called by another timed operation: part of it
            return op(*args, **kw)
        stream = kw.get("stream", args[stream_at] if stream_at is not None and len(args) > stream_at else None)
        return tl.run(kind, stream, op, *args, **kw)

    return inner


class HostEvent:
    """An event on a synchronous device: the host clock when recorded."""

    t = 0.0

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass


def host_timeline() -> Timeline:
    return Timeline(HostEvent, lambda a, b: b.t - a.t)
