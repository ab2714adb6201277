"""StrictStreams: the reference device with CUDA's timing rules for what crosses the bus, so that the hybrid
executor's asynchronous copies are checked on a CPU.

ReferenceDevice copies at once, so an executor that reads a page-locked buffer before its copy has landed, or
refills one while its copy to the device may still be reading it, gets the right numbers there and wrong ones on a
GPU. Here a copy lands only when the host waits for it, as on a GPU:
- to_host_async(a, out) takes a's value now (every op before it in the stream has run: ops run at once, in order)
  and fills `out` with 0xFF bytes (NaN as float32, -1 as int32) until an event recorded after the copy, the stream
  or the device is synchronised. A host that reads `out` earlier reads poison; one that writes into it before then
  (a race with the copy) is an error when the copy lands.
- to_device_async(host, out) copies at once (the device side runs in stream order) but the host bytes must not
  change until the host has synchronised past the copy: a page-locked buffer refilled while its copy may still be
  reading it is an error at the next synchronisation, naming the copy. (A copy to the host queued later on the
  same stream runs after it, so it may overwrite those bytes.)
- every copy must be queued on the stream the executor is inside (`with stream:`), the one its events follow.
"""

from __future__ import annotations

import numpy as np
import torch

from pinfer_llm.runtime.gpu import ReferenceDevice

POISON = 0xFF


class StreamOrderError(AssertionError):
    pass


class _Event:
    def __init__(self, dev: StrictStreams, seq: int):
        self.dev, self.seq = dev, seq

    def synchronize(self) -> None:
        self.dev._land(self.seq)


class _Stream:
    def __init__(self, dev: StrictStreams):
        self.dev = dev

    def __enter__(self):
        self.dev._current.append(self)
        return self

    def __exit__(self, *exc):
        self.dev._current.pop()
        return False

    def synchronize(self) -> None:
        self.dev._land(self.dev.seq)

    def record(self) -> _Event:
        return _Event(self.dev, self.dev.seq)


class StrictStreams(ReferenceDevice):
    name = "reference with CUDA's copy timing (tests/strict_device.py)"

    def __init__(self):
        super().__init__()
        self.seq = 0  # copies queued so far; an event is the count when it was recorded
        self._down: list[tuple] = []  # (seq, out, the value it will get, whether out must still be poison)
        self._up: list[tuple[int, np.ndarray, np.ndarray | None]] = []  # (seq, host bytes, their value when queued)
        self._current: list[_Stream] = []
        self.landed = {"up": 0, "down": 0}  # copies checked and landed, so that a test sees this device worked

    def stream(self) -> _Stream:
        return _Stream(self)

    def _on_stream(self, stream, what: str) -> None:
        if stream is None or not self._current or stream is not self._current[-1]:
            raise StreamOrderError(f"{what} queued on {'no stream' if stream is None else 'a stream'} other than "
                                   f"the one the executor is inside: nothing orders it with its work")

    def to_device_async(self, host: np.ndarray, out: torch.Tensor, stream=None) -> torch.Tensor:
        self._on_stream(stream, "a copy to the device")
        self.seq += 1
        out.copy_(torch.from_numpy(np.ascontiguousarray(host)))
        self._up.append((self.seq, host, np.array(host, copy=True)))
        return out

    def to_host_async(self, a: torch.Tensor, out: np.ndarray, stream=None) -> np.ndarray:
        self._on_stream(stream, "a copy to the host")
        self.seq += 1
        for i, (seq, host, was) in enumerate(self._up):  # copies up from these bytes run before this one
            if np.shares_memory(host, out):
                self._check_up(seq, host, was)
                self._up[i] = (seq, host, None)
        # a copy down into bytes an earlier one still has to fill lands after it, over its value
        check = not any(np.shares_memory(o, out) for _, o, _, _ in self._down)
        value = a.numpy().copy()
        out.view(np.uint8)[...] = POISON
        self._down.append((self.seq, out, value, check))
        return out

    def _check_up(self, seq: int, host: np.ndarray, was: np.ndarray | None) -> None:
        if was is not None and not np.array_equal(host.view(np.uint8), was.view(np.uint8)):
            raise StreamOrderError(f"copy {seq} to the device: its page-locked bytes changed before the host waited "
                                   f"for it (a GPU may have sent either value)")

    def _land(self, upto: int) -> None:
        ups, self._up = [u for u in self._up if u[0] <= upto], [u for u in self._up if u[0] > upto]
        downs, self._down = [d for d in self._down if d[0] <= upto], [d for d in self._down if d[0] > upto]
        for seq, host, was in ups:
            self._check_up(seq, host, was)
            self.landed["up"] += 1
        for seq, out, value, check in downs:
            if check and not (out.view(np.uint8) == POISON).all():
                raise StreamOrderError(f"copy {seq} to the host: the host wrote into its buffer before it landed")
            out[...] = value
            self.landed["down"] += 1

    def synchronize(self) -> None:
        self._land(self.seq)

    def to_numpy(self, a: torch.Tensor) -> np.ndarray:  # a synchronous copy: the stream's work before it is done
        self._land(self.seq)
        return super().to_numpy(a)
