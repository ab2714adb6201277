"""The one thread that runs the model for pi-serve: up to `parallel` generations decoded together (continuous
batching, runtime/generation/batch.py), and the model's other work (embeddings) between their steps.

The event loop must stay free for /health, queueing and other connections while the model runs, so the model runs
on this thread (torch releases the GIL in its kernels). A generation's items (text deltas, then a final record) come
back to the loop through an asyncio queue. A request joins the batch at the next step once a slot is free, in
arrival order, and leaves when it is done, when a stop string matched, or at the next step after its client went
away; one beyond the slots waits (pi-serve refuses it with a 503 beyond `max_waiting`).

    worker = ModelWorker(m, threads=2, max_waiting=8, parallel=4)
    if worker.full(): ...refuse...
    job = worker.generate(Generation(ids, max_tokens=64, sampling=SamplingParams(temperature=0.0)))
    try:
        async for item in job: ...       # str deltas, then a Finished
    finally:
        job.cancel()
    job = worker.submit(lambda cancel: iter([embed(m, ids)]))   # exclusive work, between steps

A generation's answer never depends on the others in its batch (batch.py says how); a model whose numerics are not
row-invariant (GPU parts) gets one slot, and then generations run one at a time as before.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pinfer_llm.runtime.cpu import kernels as cpu_kernels
from pinfer_llm.runtime.generation import batch as batching
from pinfer_llm.runtime.generation.textgen import TextOut, usage
from pinfer_llm.runtime.sampling import SamplingParams
from pinfer_llm.runtime.serving.openai_api import timings as llama_timings

log = logging.getLogger("pi-serve")
_ITEM, _END, _ERROR = range(3)
REASONS = {"stop": "stop", "length": "length", "context full": "length", "cancelled": "cancelled"}


class Job:
    """One request's work on the model's thread, seen from the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.cancelled = threading.Event()
        self.items: asyncio.Queue = asyncio.Queue()  # unbounded: a slow client costs memory, never stalls the model

    def cancel(self) -> None:
        self.cancelled.set()

    def post(self, kind: int, value: Any = None) -> None:
        deliver(self.loop, [(self, kind, value)])

    def __aiter__(self):
        return self

    async def __anext__(self) -> Any:
        kind, value = await self.items.get()
        if kind == _END:
            raise StopAsyncIteration
        if kind == _ERROR:
            raise value
        return value


def deliver(loop: asyncio.AbstractEventLoop, posts: list[tuple[Job, int, Any]]) -> None:
    """Hand (job, kind, value) items to their jobs' queues on the event loop, in order, with one wake-up.

    Each call_soon_threadsafe writes to the loop's self-pipe and wakes it; the model's thread then competes with the
    loop for the GIL at its next torch call, and the loop's work steals a core from the threads of the next step. A
    step's items for every client go in one call (ModelWorker._flush)."""
    def put() -> None:
        for job, kind, value in posts:
            job.items.put_nowait((kind, value))
    try:
        loop.call_soon_threadsafe(put)
    except RuntimeError:  # the loop has closed: the server is shutting down and nobody is listening
        for job, _kind, _value in posts:
            job.cancelled.set()


class ExclusiveJob(Job):
    """produce(cancel) run alone on the model's thread, between batch steps."""

    def __init__(self, loop, produce: Callable[[threading.Event], Iterator[Any]]):
        super().__init__(loop)
        self.produce = produce

    def run(self) -> None:
        try:
            if not self.cancelled.is_set():  # else the client left while it waited
                for item in self.produce(self.cancelled):
                    self.post(_ITEM, item)
                    if self.cancelled.is_set():
                        break
            self.post(_END)
        except Exception as e:  # noqa: BLE001 - reported to the request, which answers with an error
            self.post(_ERROR, e)


@dataclass
class Finished:
    """A generation's last item: what an API response reports at its end."""
    finish_reason: str
    usage: dict
    timings: dict
    stop_string: str | None = None


@dataclass
class Generation:
    """What a request asks of the batch: a checked prompt, its sampling and its stops. observer (optional): start(slot
    index), text(delta), end(Finished or None) on the model's thread (serving/metrics.py Observer)."""
    ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: Sequence[str] = ()
    reuse_prefix: bool = True
    observer: Any = None


class GenerationJob(Job):
    def __init__(self, loop, gen: Generation):
        super().__init__(loop)
        self.gen = gen
        self.seq: batching.Sequence | None = None
        self.out: TextOut | None = None
        self.count: list[int] = [0]  # tokens generated, shared with ModelWorker.runs


class ModelWorker:
    def __init__(self, m, threads: int | None = None, max_waiting: int = 8, parallel: int = 4,
                 max_rows: int | None = None):
        self.m, self.threads, self.max_waiting = m, threads, max_waiting
        self.batch = batching.Batch(m, parallel, max_rows)
        self.parallel = len(self.batch.slots)  # 1 where the model's numerics are not row-invariant
        self.runs: collections.deque[list[int]] = collections.deque(maxlen=64)  # tokens of recent generations
        self.started = 0  # generations that got a slot
        self._lock = threading.Lock()
        self._queued = 0  # submitted, not yet in a slot or run
        self._running = 0  # in a slot, or the exclusive job now running
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: list[tuple[Job, int, Any]] = []  # a step's items for the event loop, sent together (_flush)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="pi-serve-model", daemon=True)
        self._thread.start()

    # --- seen from the event loop ---------------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot or their turn."""
        with self._lock:
            return self._queued

    @property
    def generating(self) -> int:
        with self._lock:
            return self._running

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._running + self._queued > 0

    def full(self) -> bool:
        """True when a new request would find no slot and no place in the queue."""
        with self._lock:
            return self._running + self._queued >= self.parallel + self.max_waiting

    def generate(self, gen: Generation) -> GenerationJob:
        job = GenerationJob(asyncio.get_running_loop(), gen)
        self._enqueue(job)
        return job

    def submit(self, produce: Callable[[threading.Event], Iterator[Any]]) -> ExclusiveJob:
        """produce(cancel_event) alone on the model's thread, in its turn between steps."""
        job = ExclusiveJob(asyncio.get_running_loop(), produce)
        self._enqueue(job)
        return job

    def close(self) -> None:
        """Stop every generation and the thread (at shutdown)."""
        self._closed = True
        self._inbox.put(None)

    def _enqueue(self, job: Job) -> None:
        with self._lock:
            self._queued += 1
        self._inbox.put(job)

    # --- the model's thread ---------------------------------------------------------------------------------------

    def _loop(self) -> None:
        if self.threads:  # torch's thread count is per calling thread: ours, on the model's thread
            cpu_kernels.set_threads(self.threads)
        waiting: collections.deque[Job] = collections.deque()  # arrival order, generations and exclusive jobs
        jobs: dict[int, GenerationJob] = {}  # id(sequence) -> its job, for those in a slot
        while True:
            idle = not jobs and not waiting
            try:
                while True:  # everything that arrived; block only when there is nothing to do
                    job = self._inbox.get(block=idle)
                    idle = False
                    if job is None:
                        return self._shutdown(waiting, jobs)
                    waiting.append(job)
            except queue.Empty:
                pass
            self._admit(waiting, jobs)
            if jobs:
                self._step(jobs)
            if not jobs:  # else the next step's launch sends what this one left
                self._flush()

    def _admit(self, waiting: collections.deque, jobs: dict) -> None:
        """In arrival order: generations into free slots; an exclusive job when it is first in line and may run
        (the batch's slots are not the model's own cache, which it overwrites, or no generation is running)."""
        while waiting:
            job = waiting[0]
            if job.cancelled.is_set():  # its client left while it waited: never run
                waiting.popleft()
                self._dequeued(running=False)
                job.post(_END)
                continue
            if isinstance(job, ExclusiveJob):
                if jobs and self.batch.uses_model_cache:
                    return
                waiting.popleft()
                self._dequeued(running=True)
                self._flush()  # the generations' last tokens first: this job may take a while
                try:
                    job.run()
                finally:
                    with self._lock:
                        self._running -= 1
                continue
            if not self.batch.free_slots():
                return
            waiting.popleft()
            g = job.gen
            seq = batching.Sequence(list(g.ids), g.max_tokens, g.sampling, self.m.tokenizer.stop_ids,
                                    reuse_prefix=g.reuse_prefix)
            self.batch.admit(seq)
            job.seq, job.out = seq, TextOut(self.m.tokenizer, g.stop)
            jobs[id(seq)] = job
            self.runs.append(job.count)
            self.started += 1
            self._dequeued(running=True)
            if g.observer is not None:
                g.observer.start(seq.slot.index)

    def _step(self, jobs: dict) -> None:
        for job in jobs.values():
            if job.cancelled.is_set() and not job.seq.done:
                job.seq.cancelled = True
        try:
            # the items the last step left go to the event loop as this pass's kernels start: the loop then formats
            # and sends them while the kernels run without the GIL. Sent before the pass, its wake-up took the GIL
            # from this thread's Python between steps (pi-serve, SmolLM2, 4 clients: 4 token embeddings took 0.34 ms
            # against 8 us alone, a logits check 0.14 ms against 0.03)
            events = self.batch.step(launch=self._flush)
        except Exception as e:  # noqa: BLE001 - every generation in the step fails; the server goes on
            log.error("generation failed", exc_info=e)
            self.batch.cancel_all()
            for job in list(jobs.values()):
                self._end(jobs, job, error=e)
            return
        for seq, tok in events:
            job = jobs[id(seq)]
            job.count[0] += 1
            delta = job.out.push(tok)
            if delta:
                self._text(job, delta)
            if job.out.finish_reason is not None and not seq.done:  # a stop string matched
                self.batch.finish(seq, "stop")
        for job in [j for j in jobs.values() if j.seq.done]:
            self._end(jobs, job)

    def _text(self, job: GenerationJob, delta: str) -> None:
        if job.gen.observer is not None:
            job.gen.observer.text(delta)
        self._outbox.append((job, _ITEM, delta))

    def _end(self, jobs: dict, job: GenerationJob, error: Exception | None = None) -> None:
        seq = job.seq
        del jobs[id(seq)]
        with self._lock:
            self._running -= 1
        error = error or seq.error
        fin = None
        if error is None:
            tail = job.out.end(REASONS.get(seq.stats.stop_reason, "length"))
            if tail:
                self._text(job, tail)
            st = seq.stats
            fin = Finished(job.out.finish_reason, usage(st.prompt_tokens, st.decode_tokens, st.reused_tokens),
                           timings(st), job.out.stop_string)
        if job.gen.observer is not None:
            job.gen.observer.end(fin)
        if error is not None:
            self._outbox.append((job, _ERROR, error))
        else:
            if fin.finish_reason != "cancelled":
                self._outbox.append((job, _ITEM, fin))
            self._outbox.append((job, _END, None))

    def _flush(self) -> None:
        posts, self._outbox = self._outbox, []
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for post in posts:
            by_loop.setdefault(post[0].loop, []).append(post)
        for loop, items in by_loop.items():
            deliver(loop, items)

    def _dequeued(self, running: bool) -> None:
        with self._lock:
            self._queued -= 1
            self._running += running

    def _shutdown(self, waiting: collections.deque, jobs: dict) -> None:
        self.batch.cancel_all()
        for job in list(jobs.values()):
            self._end(jobs, job)
        self._flush()
        for job in waiting:
            job.post(_END)


def timings(st: batching.SeqStats) -> dict:
    return llama_timings(st.prompt_tokens - st.reused_tokens, st.prompt_s, st.decode_tokens, st.decode_s,
                         cache_n=st.reused_tokens)
