"""What pi-serve counts: one record per request (for its log line and `timings`), the running totals behind
/metrics (Prometheus' text format), and which generation holds which slot (/slots).

A generation is observed by an Observer the model's thread calls (serving/worker.py): the time it got its slot, its
first text and its end. The prompt and generation times come from the final record's own `timings` when it has
them, else from the model's Stats of that generation.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pinfer_llm.runtime.serving.openai_api import timings

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RATE_WINDOW = 16  # the tok/s gauge: generated tokens over generation time of the last RATE_WINDOW requests


@dataclass
class RequestRecord:
    """One request, from its arrival: filled in by the handler (what it asked) and an Observer (what it got)."""
    method: str
    path: str
    client: str = "-"
    arrived: float = field(default_factory=time.perf_counter)
    status: int = 0
    endpoint: str = ""  # a generation's kind ("chat", "completion", "embeddings"), else ""
    prompt_tokens: int | None = None
    cached_tokens: int = 0
    completion_tokens: int = 0
    started: float | None = None  # its turn on the model came
    first_text: float | None = None
    finished: float | None = None
    finish_reason: str | None = None
    timings: dict | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_text is None else self.first_text - self.arrived

    def line(self, now: float) -> str:
        """The access log's line: no query string (it may hold a secret), no headers."""
        head = f'{self.client} "{self.method} {self.path}" {self.status} {now - self.arrived:.3f}s'
        if self.prompt_tokens is None:
            return head
        parts = [head, f"in {self.prompt_tokens}" + (f" (cached {self.cached_tokens})" if self.cached_tokens else "")]
        if self.endpoint != "embeddings":
            parts.append(f"out {self.completion_tokens}")
            if self.ttft is not None:
                parts.append(f"ttft {self.ttft:.3f}s")
            if self.timings and self.timings["predicted_per_second"]:
                parts.append(f"{self.timings['predicted_per_second']:.1f} tok/s")
            if self.finish_reason:
                parts.append(self.finish_reason)
        return " ".join(parts)


class Slots:
    """Which generation runs in which of the batch's `n` slots (the batch picks it: the one whose cache shares most of
    the prompt)."""

    def __init__(self, n: int):
        self.n = n
        self._held: dict[int, RequestRecord] = {}
        self._lock = threading.Lock()

    def hold(self, i: int, rec: RequestRecord) -> None:
        with self._lock:
            self._held[i] = rec

    def release(self, i: int) -> None:
        with self._lock:
            self._held.pop(i, None)

    def snapshot(self) -> list[tuple[int, RequestRecord | None]]:
        with self._lock:
            held = dict(self._held)
        return [(i, held.get(i)) for i in range(max(self.n, max(held, default=-1) + 1))]

    @property
    def busy(self) -> int:
        return len(self._held)


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}  # (path, status) -> count
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0
        self.prompt_s = self.generation_s = 0.0
        self.ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)
        self.ttft_sum, self.ttft_n = 0.0, 0
        self.recent: list[tuple[int, float]] = []  # (tokens, seconds) of the last RATE_WINDOW generations

    def record(self, rec: RequestRecord) -> None:
        with self._lock:
            key = (rec.path, rec.status)
            self.requests[key] = self.requests.get(key, 0) + 1
            if rec.prompt_tokens is None:
                return
            self.prompt_tokens += rec.prompt_tokens
            self.cached_tokens += rec.cached_tokens
            self.completion_tokens += rec.completion_tokens
            t = rec.timings
            if t:
                self.prompt_s += t["prompt_ms"] / 1e3
                self.generation_s += t["predicted_ms"] / 1e3
                if t["predicted_n"]:
                    self.recent = (self.recent + [(t["predicted_n"], t["predicted_ms"] / 1e3)])[-RATE_WINDOW:]
            if rec.ttft is not None:
                self.ttft_counts[next((i for i, b in enumerate(TTFT_BUCKETS) if rec.ttft <= b),
                                      len(TTFT_BUCKETS))] += 1
                self.ttft_sum += rec.ttft
                self.ttft_n += 1

    def prometheus(self, generating: int, waiting: int, slots: int, ffn_active: list[float] | None = None,
                   ffn_read: list[tuple[int, int]] | None = None, n_ff: int = 0) -> str:
        """The text exposition format (version 0.0.4)."""
        with self._lock:
            out: list[str] = []

            def metric(name, kind, help_, samples):
                out.append(f"# HELP pinfer_{name} {help_}")
                out.append(f"# TYPE pinfer_{name} {kind}")
                for labels, v in samples:
                    out.append(f"pinfer_{name}{labels} {v:.6g}" if isinstance(v, float) else
                               f"pinfer_{name}{labels} {v}")

            metric("requests_total", "counter", "HTTP requests answered, by path and status.",
                   [(f'{{path="{_label(p)}",status="{s}"}}', n) for (p, s), n in sorted(self.requests.items())])
            metric("prompt_tokens_total", "counter", "Prompt tokens of generations and embeddings.",
                   [("", self.prompt_tokens)])
            metric("prompt_cached_tokens_total", "counter", "Prompt tokens taken from the KV cache.",
                   [("", self.cached_tokens)])
            metric("generated_tokens_total", "counter", "Tokens generated.", [("", self.completion_tokens)])
            metric("prompt_seconds_total", "counter", "Time spent on prompts (prefill).", [("", self.prompt_s)])
            metric("generation_seconds_total", "counter", "Time spent generating tokens.", [("", self.generation_s)])
            tokens, secs = sum(n for n, _ in self.recent), sum(s for _, s in self.recent)
            metric("generation_tokens_per_second", "gauge",
                   f"Generated tokens per second over the last {RATE_WINDOW} generations.",
                   [("", tokens / secs if secs else 0.0)])
            cum, buckets = 0, []
            for b, n in zip((*TTFT_BUCKETS, "+Inf"), self.ttft_counts, strict=True):
                cum += n
                buckets.append((f'_bucket{{le="{b}"}}', cum))
            metric("time_to_first_token_seconds", "histogram", "From a request's arrival to its first text.",
                   buckets + [("_sum", float(self.ttft_sum)), ("_count", self.ttft_n)])
            metric("requests_generating", "gauge", "Requests holding a slot now.", [("", generating)])
            metric("requests_waiting", "gauge", "Requests queued for a slot now.", [("", waiting)])
            metric("slots", "gauge", "Slots (requests generated at once).", [("", slots)])
            if ffn_active is not None:  # a sparse model: activation locality at work
                metric("ffn_active_fraction", "gauge", "Share of FFN neurons computed per token and layer since the "
                       "start (each token its own neurons), by layer.",
                       [(f'{{layer="{i}"}}', float(f)) for i, f in enumerate(ffn_active)])
            if ffn_read is not None and n_ff:  # with predictors: what a batch reads, the union of its rows' neurons
                metric("ffn_step_fraction", "gauge", "Share of FFN neurons whose rows a forward pass read, per pass "
                       "and layer since the start (a batch of rows: the union of their neurons), by layer.",
                       [(f'{{layer="{i}"}}', r / (n * n_ff) if n else 0.0) for i, (n, r) in enumerate(ffn_read)])
                metric("ffn_passes_total", "counter", "Forward passes through each layer with predictors.",
                       [(f'{{layer="{i}"}}', n) for i, (n, _) in enumerate(ffn_read)])
                metric("ffn_neurons_read_total", "counter", "FFN neurons whose rows the passes read, summed over the "
                       "passes, by layer.", [(f'{{layer="{i}"}}', r) for i, (_, r) in enumerate(ffn_read)])
            return "\n".join(out) + "\n"


def _label(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Observer:
    """One generation's stamps, called on the model's thread (serving/worker.py): its slot, first text, end; the
    final record's usage and timings go into rec, and on_timings gets the timings before the final record is passed
    on, so the response can carry them."""

    def __init__(self, rec: RequestRecord, slots: Slots, on_timings: Callable[[dict], None]):
        self.rec, self.slots, self.on_timings = rec, slots, on_timings
        self.slot: int | None = None

    def start(self, slot: int) -> None:
        self.rec.started = time.perf_counter()
        self.slot = slot
        self.slots.hold(slot, self.rec)

    def text(self, delta: str) -> None:
        if self.rec.first_text is None and delta:
            self.rec.first_text = time.perf_counter()

    def end(self, item: Any) -> None:
        self.rec.finished = time.perf_counter()
        if item is not None:
            final(self.rec, item)
            if self.rec.timings is not None:
                self.on_timings(self.rec.timings)
        if self.slot is not None:
            self.slots.release(self.slot)


def final(rec: RequestRecord, item: Any) -> None:
    usage = getattr(item, "usage", None) or {}
    rec.finish_reason = getattr(item, "finish_reason", None)
    rec.completion_tokens = usage.get("completion_tokens", 0)
    rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    t = getattr(item, "timings", None)
    if isinstance(t, dict):  # the generation's own figures, where it keeps them per request
        rec.timings = t
        return
    st = getattr(getattr(item, "m", None), "stats", None)  # else the model's Stats of the generation just run
    if st is not None and rec.prompt_tokens is not None:
        rec.timings = timings(rec.prompt_tokens - rec.cached_tokens, st.prompt_s, rec.completion_tokens, st.decode_s,
                              cache_n=rec.cached_tokens)
