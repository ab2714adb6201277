"""The device's own time, by kind of work: what `pi-run --gpu-timing` adds to the per-token split.

The host's view of a hybrid step (runtime/hybrid.py Split: CPU work, waiting, staging copies) cannot say how long the
GPU itself computed or how long a copy was on the bus: both run asynchronously, overlapped with the CPU. A Timeline
brackets every outermost device operation (a kernel or a few, as one call of the device's interface makes them; a
copy) with a pair of events on the stream it is queued on, and sums each pair's elapsed time by kind once the work
is done (collect(), after the step's result was waited for). On one stream operations run one after another, so
the sums are the GPU's busy time and its copy time; an operation whose events bracket a kernel that starts late
(the GPU was idle, waiting for the host) counts that launch latency too.

Costs host time: two event records per operation, ~2-3 us each on CuPy, about as much as the launches themselves;
hence off unless asked for. On runtime.gpu.ReferenceDevice, whose operations are synchronous, an "event" is the host
clock when it is recorded.
"""

from __future__ import annotations

import functools
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


def timed(kind: str, stream_at: int | None = None):
    """Decorate a device method: with self.timeline set, the outermost call is bracketed by events on the stream it
    is given (the copies' argument `stream`, at position stream_at after self), else on the current stream."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(self, *args, **kw):
            tl = self.timeline
            if tl is None or tl.depth:
                return fn(self, *args, **kw)
            stream = None
            if stream_at is not None:
                stream = kw.get("stream", args[stream_at] if len(args) > stream_at else None)
            return tl.run(kind, stream, fn, self, *args, **kw)

        return inner

    return wrap


class HostEvent:
    """An event on a synchronous device: the host clock when recorded."""

    t = 0.0

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass


def host_timeline() -> Timeline:
    return Timeline(HostEvent, lambda a, b: b.t - a.t)
