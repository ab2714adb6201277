"""Continuous batching: several generations decoded together, one forward pass per step for all of them.

    batch = Batch(m, n_slots=4)
    seq = Sequence(ids, max_tokens=128, sampling=SamplingParams(temperature=0.0), stop_ids=m.tokenizer.stop_ids)
    batch.admit(seq)                      # False when every slot is taken: the caller keeps it waiting
    while batch.active:
        for seq, tok in batch.step(): ...  # each step: one token for every decoding sequence, prompt rows for others

Each slot owns a KV cache and remembers the tokens it holds, so a new request takes the free slot that shares the
longest prefix with its prompt and prefills only the rest (a chat re-sends the whole conversation each turn). A step
gathers one row per decoding sequence, then fills the rows left (up to `max_rows`) with the prompt rows of
sequences still prefilling, in arrival order: a newcomer's prompt delays the others' next token by at most one
chunk, and a request joins at the next step and leaves when it is done.

Answers never depend on what else ran. The rows of a step go through Model.run_rows, whose every row is the bits it
gets alone (runtime/model.py Transformer.forward_rows: fewer rows than the kernels' GEMM crossover, attention row by
row, a sparse FFN over each row's own neurons), and each sequence has its own sampler and seed: a greedy answer is
pi-run's for the same prompt whoever else is batched, whatever its slot held before and however its prompt was cut
into chunks (tests/test_batching.py). A model without row-invariant numerics (no C++ kernels, GPU parts) gets one
slot, the model's own cache, and prompts prefilled in Model.generate's chunks, so it still answers as pi-run does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from pinfer_llm.formats.errors import PinferError
from pinfer_llm.runtime.sampling import SamplingParams, finite_rows, make_sampler


@dataclass
class SeqStats:
    """One sequence's figures, as Model.Stats has them for Model.generate."""
    prompt_tokens: int = 0
    reused_tokens: int = 0
    prompt_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    stop_reason: str = ""


@dataclass(eq=False)
class Sequence:
    ids: list[int]  # the prompt, checked by the caller (Model.check_prompt)
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: set[int] = field(default_factory=set)
    reuse_prefix: bool = True  # keep what the slot's cache shares with the prompt (llama.cpp's cache_prompt)
    tokens: list[int] = field(default_factory=list)  # generated so far
    done: bool = False
    cancelled: bool = False  # set from any thread: the sequence leaves at the next step
    error: Exception | None = None  # why it ended, when stats.stop_reason is "error"
    stats: SeqStats = field(default_factory=SeqStats)

    def __post_init__(self):
        self.sample = make_sampler(self.sampling)
        self.history = list(self.ids)  # what the repetition penalty looks back on
        self.slot: Slot | None = None
        self.pending: list[int] = []  # prompt tokens not yet through the model
        self.pos = 0  # the next cache position to write
        self._t0 = self._t1 = 0.0


class Slot:
    """A KV cache and the token ids it holds at positions 0..len-1 (entered only once a forward pass wrote them)."""

    def __init__(self, index: int, cache, model=None):
        self.index, self.cache, self.seq = index, cache, None
        self._model = model  # the slot that is the model's own cache shares its record with the model (pi-run's)
        self._ids: list[int] = []

    @property
    def cached_ids(self) -> list[int]:
        return self._model.cached_ids if self._model is not None else self._ids

    @cached_ids.setter
    def cached_ids(self, ids: list[int]) -> None:
        if self._model is not None:
            self._model.cached_ids = ids
        else:
            self._ids = ids


class Batch:
    def __init__(self, m, n_slots: int = 4, max_rows: int | None = None):
        self.m = m
        self.batched = m.batchable()
        if not self.batched:  # one slot, the model's own cache: Model.generate's path
            n_slots = 1
        if n_slots < 1:
            raise PinferError(f"--parallel must be at least 1, got {n_slots}")
        if self.batched:
            self.slots = [Slot(i, m.new_cache()) for i in range(n_slots)]
        else:
            self.slots = [Slot(0, m.transformer.cache, model=m)]
        self.max_rows = max_rows or m.batch_rows()
        self.active: list[Sequence] = []  # in arrival order: who prefills first
        self.steps = 0
        self.rows_run = 0  # rows through the model, prompt rows and decode rows

    @property
    def uses_model_cache(self) -> bool:
        """Whether the slots hold the model's own KV cache (which an embeddings pass overwrites)."""
        return not self.batched

    def free_slots(self) -> int:
        return sum(s.seq is None for s in self.slots)

    def admit(self, seq: Sequence) -> bool:
        """Give seq a slot (the free one sharing the longest prefix with its prompt); False when none is free."""
        free = [s for s in self.slots if s.seq is None]
        if not free:
            return False
        keep = {id(s): self.m.reusable_prefix(seq.ids, s.cached_ids) if seq.reuse_prefix else 0 for s in free}
        slot = max(free, key=lambda s: (keep[id(s)], -len(s.cached_ids)))  # else the emptiest: keep others' prefixes
        n = keep[id(slot)]
        slot.seq, seq.slot = seq, slot
        slot.cached_ids = slot.cached_ids[:n]
        seq.pending, seq.pos = list(seq.ids[n:]), n
        seq.stats = SeqStats(prompt_tokens=len(seq.ids), reused_tokens=n)
        seq._t0 = time.perf_counter()
        self.active.append(seq)
        return True

    def step(self, launch: Callable[[], None] | None = None) -> list[tuple[Sequence, int]]:
        """One forward pass over every active sequence -> the tokens sampled, in row order. Sequences that finish
        (or were cancelled) leave their slot. launch: called just before the pass's kernels start, if there is a
        pass (Model.run_rows)."""
        for seq in [s for s in self.active if s.cancelled]:
            self.finish(seq, "cancelled")
        rows: list[tuple[Sequence, int, int, bool]] = []  # (sequence, token, position, its logits wanted)
        decoding = [s for s in self.active if not s.pending]
        if len(decoding) > self.max_rows:  # more than one pass may take (--parallel above it): in turns
            k = self.steps % len(decoding)
            decoding = (decoding[k:] + decoding[:k])[:self.max_rows]
        for seq in decoding:  # its last token goes in
            rows.append((seq, seq.tokens[-1], seq.pos, True))
        budget = self.max_rows - len(rows)
        for seq in self.active:
            if seq.pending and budget > 0:
                chunk = seq.pending[:budget]
                last = len(chunk) == len(seq.pending)
                rows += [(seq, t, seq.pos + i, last and i == len(chunk) - 1) for i, t in enumerate(chunk)]
                budget -= len(chunk)
                if not self.batched:
                    break  # one sequence's rows per pass on the model's own path
        if not rows:
            return []
        out_rows = [i for i, r in enumerate(rows) if r[3]]
        logits = self.m.run_rows([r[1] for r in rows], [r[2] for r in rows], [r[0].slot.cache for r in rows],
                                 out_rows, launch)
        self.steps += 1
        self.rows_run += len(rows)
        fed: dict[int, int] = {}  # prompt rows per sequence
        for seq, tok, _pos, _want in rows:  # the rows are in the caches now
            seq.slot.cached_ids.append(tok)
            seq.pos += 1
            if seq.pending:
                fed[id(seq)] = fed.get(id(seq), 0) + 1
        for seq in self.active:
            if id(seq) in fed:
                del seq.pending[:fed[id(seq)]]
        now = time.perf_counter()
        events = []
        facts = self.m.head_facts()  # the step's [finite, argmax] per row: neither re-read from another core
        if facts is None or len(facts) != len(out_rows):
            facts = None
        ok = [f[0] for f in facts] if facts else finite_rows(logits)
        for li, i in enumerate(out_rows):
            seq = rows[i][0]
            if not seq.tokens:  # its prompt is through: the first new token's logits
                seq.stats.prompt_s = now - seq._t0
                seq._t1 = now
            if seq.stats.decode_tokens >= seq.max_tokens:  # max_tokens 0: the prompt is prefilled, nothing said
                self.finish(seq, "length")
                continue
            row = logits[li]
            if not ok[li]:  # this sequence fails; the others go on
                seq.error = PinferError(f"{self.m.file.path}: the model's weights are corrupt: the logits at "
                                        f"position {seq.pos} are not finite (NaN or inf)")
                self.finish(seq, "error")
                continue
            tok = seq.sample(row, seq.history, facts[li][1] if facts else None)
            seq.history.append(tok)
            seq.tokens.append(tok)
            seq.stats.decode_tokens += 1
            seq.stats.decode_s = time.perf_counter() - seq._t1
            events.append((seq, tok))
            if tok in seq.stop_ids:
                self.finish(seq, "stop")
            elif seq.pos >= self.m.ctx_size:
                self.finish(seq, "context full")
            elif seq.stats.decode_tokens >= seq.max_tokens:
                self.finish(seq, "length")
        return events

    def finish(self, seq: Sequence, reason: str) -> None:
        """seq leaves its slot now (done, a stop string matched in its text, its client left)."""
        seq.done, seq.stats.stop_reason = True, reason
        if seq.slot is not None:
            if seq.pending:  # left mid-prompt: the cache holds what was written, which cached_ids says
                seq.pending = []
            seq.slot.seq = None
        if seq in self.active:
            self.active.remove(seq)

    def cancel_all(self) -> None:
        for seq in list(self.active):
            self.finish(seq, "cancelled")


def generate_alone(m, ids: Seq[int], max_tokens: int, **sampling) -> list[int]:
    """One sequence through a one-slot Batch: what the batched path says for a prompt by itself (for tests and
    benchmarks, against Model.generate)."""
    b = Batch(m, 1)
    seq = Sequence(list(ids), max_tokens, SamplingParams(**sampling), m.tokenizer.stop_ids)
    b.admit(seq)
    while b.active:
        b.step()
    if seq.error is not None:
        raise seq.error
    return seq.tokens
