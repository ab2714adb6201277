"""The one thread that runs generations for pi-serve, one at a time, in arrival order.

The event loop must stay free for /health, queueing and other connections while a model generates, so generation
runs on a worker thread (torch releases the GIL in its kernels). Its items (text deltas, then a final record) come
back to the loop through an asyncio queue. The model is held from the moment a request's turn comes until the
worker thread has really stopped, never just until the client went away: two generations must never share the KV
cache. A cancelled job stops at the next token, so the next request waits at most one token for an abandoned one.

    worker = ModelWorker(threads=2, max_waiting=8)
    if worker.full(): ...refuse...
    job = await worker.submit(lambda cancel: produce_items(cancel))    # waits for its turn (FIFO)
    try:
        async for item in job: ...
    finally:
        job.cancel()
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

_ITEM, _END, _ERROR = range(3)


class Job:
    """One generation on the worker thread, seen from the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, produce: Callable[[threading.Event], Iterator[Any]]):
        self.loop, self.produce = loop, produce
        self.cancelled = threading.Event()
        self.items: asyncio.Queue = asyncio.Queue()  # unbounded: a slow client costs memory, never stalls the model

    def cancel(self) -> None:
        self.cancelled.set()

    def run(self) -> None:
        """On the worker thread: produce items until done or cancelled."""
        try:
            if self.cancelled.is_set():  # the client left between its turn coming and the thread starting
                return self._post(_END, None)
            for item in self.produce(self.cancelled):
                self._post(_ITEM, item)
                if self.cancelled.is_set():
                    break
            self._post(_END, None)
        except Exception as e:  # noqa: BLE001 - reported to the request, which answers with an error
            self._post(_ERROR, e)

    def _post(self, kind: int, value: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, (kind, value))
        except RuntimeError:  # the loop has closed: the server is shutting down and nobody is listening
            self.cancelled.set()

    def __aiter__(self):
        return self

    async def __anext__(self) -> Any:
        kind, value = await self.items.get()
        if kind == _END:
            raise StopAsyncIteration
        if kind == _ERROR:
            raise value
        return value


class ModelWorker:
    def __init__(self, threads: int | None = None, max_waiting: int = 8):
        self.threads, self.max_waiting = threads, max_waiting
        self.waiting = 0  # requests waiting for their turn, not counting the one generating
        self.current: Job | None = None
        self._turn = asyncio.Lock()  # FIFO: asyncio wakes waiters in the order they came
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="pi-serve-model", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._turn.locked()

    def full(self) -> bool:
        """True when a new request would find no place in the queue."""
        return self.busy and self.waiting >= self.max_waiting

    async def submit(self, produce: Callable[[threading.Event], Iterator[Any]]) -> Job:
        """Wait for this request's turn, then start produce(cancel_event) on the worker thread. Cancelling the
        wait (the client went away) leaves the queue."""
        self.waiting += 1
        try:
            await self._turn.acquire()
        finally:
            self.waiting -= 1
        loop = asyncio.get_running_loop()
        job = self.current = Job(loop, produce)

        def run():
            try:
                job.run()
            finally:
                self.current = None
                try:
                    loop.call_soon_threadsafe(self._turn.release)
                except RuntimeError:  # the loop has closed
                    pass

        self._jobs.put(run)
        return job

    def close(self) -> None:
        """Stop the current generation and the thread (at shutdown)."""
        if self.current is not None:
            self.current.cancel()
        self._jobs.put(None)

    def _loop(self) -> None:
        if self.threads:
            # torch's thread count is per calling thread, and a thread's first torch call sets it from the last
            # value set anywhere in the process: make that first call here, then set ours on the model's thread
            import torch

            torch.get_num_threads()
            torch.set_num_threads(self.threads)
        while (fn := self._jobs.get()) is not None:
            fn()
