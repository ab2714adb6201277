"""Activation profiling, CATS thresholds and predictor training: what pi-profile does, as plain functions.

    windows, desc = corpus_windows(model.tokenizer, builtin_corpus(), ctx=512)
    rule = activation_rule(model.cfg)                       # ReLU family: active iff the activation is > 0
    prof = profile(model, windows, rule, sample_tokens=4096)  # counts [n_layer, n_ff] + sampled (x, mask) pairs
    preds = [train_layer(prof.samples[l], ...) for l in range(n_layer)]
    write_results(model.file, prof, preds, dest)             # atomic rewrite of the GGUF

Profiling wraps each block's FFN in a recorder that sees the FFN input (the pre-norm residual, which predictors
read) and the gate/up pre-activations, counts active neurons on every token, and keeps a fixed random subset of
tokens as training pairs (x, active mask) so memory is bounded whatever the corpus size.

"Active" (ACT_RULE):
- ReLU family (ReGLU, dReLU): the activation is > 0, i.e. relu(gate) > 0 (and relu(up) > 0 for dReLU). Exactly
  the neurons whose output h = act(gate) * up can be nonzero, so skipping the others is exact.
- SwiGLU: nothing is exactly zero, so there is no notion of active without a threshold. With a target sparsity S,
  a per-layer threshold t_l on |silu(gate)| is calibrated CATS-style (the S-quantile of |silu(gate)| over every
  token and neuron of the layer, from a log-spaced histogram in a first pass) and active means |silu(gate)| > t_l.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from formats import constants as C
from formats.config import ModelConfig
from formats.errors import PinferError
from formats.reader import GGUFFile

from .ffn import activate

CORPUS_DIR = Path(__file__).parent / "corpus"
HELDOUT = CORPUS_DIR / "heldout.txt"  # never profiled: kept for perplexity measurements

SPLIT_BLOCK = 32  # sampled tokens are split into train/calibration/test in runs of this many consecutive tokens
SPLIT = (0.7, 0.15, 0.15)  # train / calibration (threshold, ladder choice) / test (reported numbers)
MIN_TRAIN_TOKENS = 1000  # profiled tokens needed to train predictors (about 150 held out for each of calib/test)
DEFAULT_LADDER = (16, 32, 64, 128, 256, 512, 1024, 2048)
DEFAULT_RECALL = 0.99
# CATS histogram of |silu(gate)|: log-spaced bins; values below the first edge (incl. exact zeros) go to bin 0.
HIST_LO, HIST_HI, HIST_BINS = 1e-7, 1e3, 8192


# --- corpus -----------------------------------------------------------------------------------------------------------

def builtin_corpus() -> list[Path]:
    """The calibration texts shipped with the package (prose, dialogue, code, notes); not the held-out text."""
    return sorted(p for p in CORPUS_DIR.glob("*.txt") if p != HELDOUT)


def corpus_windows(tokenizer, files: Sequence[Path], ctx: int, max_tokens: int | None = None
                   ) -> tuple[list[list[int]], str]:
    """Tokenise each file (with the tokenizer's BOS handling) and cut it into windows of at most ctx tokens.

    Files are not concatenated across a window, so every window starts at a document boundary or continues one.
    Returns (windows, description of the corpus for ACT_CORPUS)."""
    if ctx < 2:
        raise PinferError(f"--ctx must be at least 2, got {ctx}")
    windows: list[list[int]] = []
    total, used = 0, []
    for p in files:
        p = Path(p)
        if not p.is_file():
            raise PinferError(f"{p}: no such corpus file")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise PinferError(f"{p}: not UTF-8 text; pass plain text files with --corpus") from None
        ids = tokenizer.encode(text)
        if max_tokens is not None:
            ids = ids[:max(0, max_tokens - total)]
        if not ids:
            continue
        used.append(p.name)
        for s in range(0, len(ids), ctx):
            windows.append(ids[s:s + ctx])
        total += len(ids)
        if max_tokens is not None and total >= max_tokens:
            break
    if total == 0:
        raise PinferError("the corpus is empty; pass text files with --corpus")
    builtin = [p.name for p in builtin_corpus()]
    what = "built-in" if used and all(n in builtin for n in used) else "user"
    return windows, f"{what}: {', '.join(used)} ({total} tokens)"


# --- what counts as active --------------------------------------------------------------------------------------------

@dataclass
class ActivationRule:
    act: str  # "relu" | "drelu" | "silu"
    thresholds: np.ndarray | None = None  # SwiGLU: per-layer threshold on |silu(gate)|

    @property
    def name(self) -> str:
        return "relu>0" if self.act in ("relu", "drelu") else "|silu(gate)|>thr"

    def mask(self, layer: int, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """bool [T, n_ff]"""
        if self.act == "relu":
            return gate > 0
        if self.act == "drelu":
            return (gate > 0) & (up > 0)
        if self.thresholds is None:
            raise PinferError("SwiGLU activations have no notion of active without a threshold; pass --sparsity S")
        return F.silu(gate).abs() > float(self.thresholds[layer])


def activation_rule(cfg: ModelConfig, sparsity: float | None = None) -> ActivationRule:
    """The rule for this model; SwiGLU needs --sparsity (thresholds are filled in by calibrate_cats)."""
    if cfg.ffn_act == "silu":
        if sparsity is None:
            raise PinferError("this is a SwiGLU model: no neuron is ever exactly inactive, so profiling needs a "
                              "threshold; pass --sparsity S (e.g. 0.3) to calibrate CATS thresholds for sparsity S, "
                              "or --ffn-act relu if the model really is ReLU")
        if not 0.0 < sparsity < 1.0:
            raise PinferError(f"--sparsity must be between 0 and 1 (exclusive), got {sparsity}")
    elif sparsity is not None:
        raise PinferError(f"--sparsity applies to SwiGLU models only; this model's FFN is {cfg.ffn_act}, whose "
                          f"inactive neurons are exactly zero")
    return ActivationRule(cfg.ffn_act)


# --- recording ----------------------------------------------------------------------------------------------------------

class _Recorder:
    """Stands in for a block's DenseFFN: computes the same output and shows the sink what happened."""

    def __init__(self, ffn, layer: int, sink):
        self.ffn, self.layer, self.sink = ffn, layer, sink

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        f = self.ffn
        gu = f.gate_up(x)  # (T, 2 n_ff)
        gate, up = gu[:, :f.n_ff].float(), gu[:, f.n_ff:].float()
        self.sink(self.layer, residual, gate, up)
        return f.down(activate(gate, up, f.act).to(gu.dtype))


@contextlib.contextmanager
def recording(model, sink):
    blocks = model.transformer.blocks
    for i, b in enumerate(blocks):
        if not all(hasattr(b.ffn, a) for a in ("gate_up", "down", "n_ff", "act")):
            raise PinferError(f"layer {i} has an FFN pi-profile cannot look inside ({type(b.ffn).__name__}); "
                              f"load the model dense")
    saved = [b.ffn for b in blocks]
    try:
        for i, b in enumerate(blocks):
            b.ffn = _Recorder(b.ffn, i, sink)
        yield
    finally:
        for b, ffn in zip(blocks, saved):
            b.ffn = ffn


def _run(model, windows: list[list[int]], sink_window: Callable[[int], None], progress, label: str) -> None:
    tr = model.transformer
    for w, ids in enumerate(windows):
        if len(ids) > tr.max_ctx:
            raise PinferError(f"window of {len(ids)} tokens exceeds the context {tr.max_ctx}; lower --ctx")
        sink_window(w)
        with torch.inference_mode():
            tr.forward(torch.tensor(ids, dtype=torch.long), 0)
        if progress:
            progress(label, w + 1, len(windows), len(ids))


# --- CATS calibration (SwiGLU) ------------------------------------------------------------------------------------------

_EDGES = torch.logspace(math.log10(HIST_LO), math.log10(HIST_HI), HIST_BINS - 1, dtype=torch.float64)


def cats_thresholds(hist: np.ndarray, sparsity: float) -> np.ndarray:
    """Per-layer threshold t with P(|silu(gate)| <= t) = sparsity, from [n_layer, HIST_BINS] counts.

    Bin 0 holds values below HIST_LO, bin k (1..BINS-2) values in [edge k-1, edge k), the last bin values above
    HIST_HI. Within a bin the threshold is interpolated geometrically."""
    edges = _EDGES.numpy()
    lo = np.concatenate(([0.0], edges))  # lower edge of each bin
    hi = np.concatenate((edges, [np.inf]))
    out = np.zeros(hist.shape[0], dtype=np.float32)
    for layer, h in enumerate(hist):
        cdf = np.cumsum(h) / h.sum()
        k = int(np.searchsorted(cdf, sparsity, side="left"))
        below = cdf[k - 1] if k > 0 else 0.0
        frac = (sparsity - below) / max(cdf[k] - below, 1e-300)
        a, b = lo[k], hi[k]
        if a <= 0.0:
            t = b * frac
        elif not np.isfinite(b):
            t = a
        else:
            t = a * (b / a) ** frac
        out[layer] = t
    return out


def calibrate_cats(model, windows, sparsity: float, progress=None) -> np.ndarray:
    """First pass for SwiGLU models: histogram |silu(gate)| of every token and neuron, per layer."""
    L = model.cfg.n_layer
    hist = torch.zeros(L, HIST_BINS, dtype=torch.float64)

    def sink(layer, residual, gate, up):
        idx = torch.bucketize(F.silu(gate).abs().reshape(-1).double(), _EDGES, right=True)
        hist[layer] += torch.bincount(idx, minlength=HIST_BINS).double()

    with recording(model, sink):
        _run(model, windows, lambda w: None, progress, "calibrating")
    return cats_thresholds(hist.numpy(), sparsity)


# --- profiling ------------------------------------------------------------------------------------------------------------

@dataclass
class Samples:
    """Training pairs of one layer: FFN inputs and active masks of the sampled tokens."""

    x: np.ndarray  # float32 [N, d]: pre-norm residual (the predictor input)
    mask_bits: np.ndarray  # uint8 [N, ceil(n_ff/8)]: np.packbits of the active mask
    n_ff: int
    split: np.ndarray  # int8 [N]: 0 train, 1 calibration, 2 test

    def mask(self, rows=slice(None)) -> np.ndarray:
        return np.unpackbits(self.mask_bits[rows], axis=1, count=self.n_ff).astype(bool)

    def part(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.flatnonzero(self.split == k)
        return torch.from_numpy(self.x[rows]), torch.from_numpy(self.mask(rows))


@dataclass
class Profile:
    counts: np.ndarray  # float64 [n_layer, n_ff]: tokens on which each neuron was active
    tokens: int
    corpus: str
    rule: ActivationRule
    date: str
    seconds: float = 0.0
    samples: list[Samples] = field(default_factory=list)
    cats_sparsity: float | None = None

    @property
    def frequency(self) -> np.ndarray:
        return self.counts / max(self.tokens, 1)

    @property
    def sparsity(self) -> np.ndarray:
        """Per-layer fraction of (token, neuron) pairs that were inactive."""
        return 1.0 - self.frequency.mean(axis=1)


def split_labels(n_tokens: int, seed: int = 0) -> np.ndarray:
    """int8 [n_tokens]: train/calibration/test by runs of SPLIT_BLOCK consecutive tokens (neighbouring tokens share
    context, so a random split by token would leak)."""
    rng = np.random.default_rng(seed)
    n_blocks = -(-n_tokens // SPLIT_BLOCK)
    labels = rng.choice(3, size=n_blocks, p=SPLIT).astype(np.int8)
    # tiny corpora: make sure every part has at least one block
    for k in range(3):
        if n_blocks >= 3 and not (labels == k).any():
            labels[rng.integers(n_blocks)] = k
    return np.repeat(labels, SPLIT_BLOCK)[:n_tokens]


def profile(model, windows: list[list[int]], rule: ActivationRule, corpus: str = "", sample_tokens: int = 0,
            seed: int = 0, progress=None) -> Profile:
    """Count active neurons per layer over all windows; keep up to sample_tokens random tokens as training pairs."""
    t0 = time.perf_counter()
    cfg = model.cfg
    L, n_ff, d = cfg.n_layer, cfg.n_ff, cfg.n_embd
    n_tokens = sum(len(w) for w in windows)
    counts = torch.zeros(L, n_ff, dtype=torch.float64)

    k = min(sample_tokens, n_tokens)
    picked = np.sort(np.random.default_rng(seed).choice(n_tokens, size=k, replace=False)) if k else np.zeros(0, int)
    labels = split_labels(n_tokens, seed)[picked]
    starts = np.cumsum([0] + [len(w) for w in windows])
    xs = np.zeros((L, k, d), dtype=np.float32)
    bits = np.zeros((L, k, -(-n_ff // 8)), dtype=np.uint8)
    cur = {"rows": torch.zeros(0, dtype=torch.long), "dst": slice(0, 0)}

    def on_window(w):
        lo, hi = np.searchsorted(picked, [starts[w], starts[w + 1]])
        cur["rows"] = torch.from_numpy(picked[lo:hi] - starts[w])
        cur["dst"] = slice(int(lo), int(hi))

    def sink(layer, residual, gate, up):
        m = rule.mask(layer, gate, up)
        counts[layer] += m.sum(0, dtype=torch.float64)
        rows = cur["rows"]
        if rows.numel():
            xs[layer, cur["dst"]] = residual[rows].float().numpy()
            bits[layer, cur["dst"]] = np.packbits(m[rows].numpy(), axis=1)

    with recording(model, sink):
        _run(model, windows, on_window, progress, "profiling")
    samples = [Samples(xs[i], bits[i], n_ff, labels) for i in range(L)] if k else []
    return Profile(counts.numpy(), n_tokens, corpus, rule, _dt.datetime.now(_dt.timezone.utc).isoformat(
        timespec="seconds"), time.perf_counter() - t0, samples)
