"""Perplexity over a text file, the way llama.cpp's perplexity tool measures it.

The token stream is cut into non-overlapping windows of ctx tokens. Each window is evaluated from position 0 and only
its second half is scored, so every scored token has at least ctx/2 tokens of context. PPL = exp(mean NLL); the
error bar is the standard error of the mean NLL carried through exp.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pinfer_llm.formats.errors import PinferError


@dataclass
class PerplexityResult:
    ppl: float
    stderr: float  # of ppl
    tokens_scored: int
    windows: int
    ctx: int
    seconds: float

    def as_dict(self) -> dict:
        return {"perplexity": round(self.ppl, 4), "stderr": round(self.stderr, 4), "tokens_scored": self.tokens_scored,
                "windows": self.windows, "ctx": self.ctx, "seconds": round(self.seconds, 2)}


def window_nll(logits: np.ndarray, ids: list[int], first: int) -> np.ndarray:
    """Negative log-likelihood of ids[t+1] under logits[t], for t >= first - 1 (so tokens first.. are scored)."""
    lg = logits[first - 1:-1].astype(np.float64)
    lg -= lg.max(-1, keepdims=True)
    logz = np.log(np.exp(lg).sum(-1))
    tgt = np.asarray(ids[first:])
    return logz - lg[np.arange(len(tgt)), tgt]


def perplexity(model, text: str, ctx: int | None = None, progress: Callable[[int, int], None] | None = None,
               max_windows: int | None = None) -> PerplexityResult:
    import time

    ctx = ctx or min(model.ctx_size, 512)
    if ctx > model.ctx_size:
        raise PinferError(f"perplexity window {ctx} exceeds the context size {model.ctx_size}; pass a larger "
                          f"--ctx-size")
    if ctx < 8:
        raise PinferError(f"perplexity window {ctx} is too small; use --ctx-size of at least 8")
    tok = model.tokenizer
    bos = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    ids = tok.encode(text, add_special=False)
    per = ctx - len(bos)
    n_windows = len(ids) // per
    if max_windows:
        n_windows = min(n_windows, max_windows)
    if n_windows == 0:
        raise PinferError(f"the text has {len(ids)} tokens, fewer than one window of {per}; use a longer file "
                          f"or a smaller --ctx-size")
    t0 = time.perf_counter()
    nll = []
    for w in range(n_windows):
        window = bos + ids[w * per:(w + 1) * per]
        logits = model.forward_logits(window)
        nll.append(window_nll(logits, window, ctx // 2))
        if progress:
            progress(w + 1, n_windows)
    all_nll = np.concatenate(nll)
    mean = float(all_nll.mean())
    sem = float(all_nll.std(ddof=1) / math.sqrt(len(all_nll))) if len(all_nll) > 1 else 0.0
    ppl = math.exp(mean)
    return PerplexityResult(ppl, ppl * sem, len(all_nll), n_windows, ctx, time.perf_counter() - t0)
