"""Activation profiling: what pi-profile measures, as plain functions.

    windows, desc = corpus_windows(model.tokenizer, builtin_corpus(), ctx=512)       # runtime.profiling.corpus
    rule = activation_rule(model.cfg, sparsity=None)     # runtime.profiling.activity; SwiGLU needs a target sparsity
    prof = profile(model, windows, rule, desc, sample_tokens=8192)   # counts [n_layer, n_ff] + (x, mask) samples
    preds, threshold = train_predictors(prof, ffn_bytes_per_layer(model.file, model.cfg))   # runtime.profiling.training
    meta, tensors, drop = profile_entries(prof, n_layer)  # runtime.profiling.store: what to write into the model

Profiling runs the model layer by layer over all token windows, sees each FFN's input (the pre-norm residual, which
predictors read: the stream after attention, or for Falcon's parallel block the layer input) and its gate/up
pre-activations (up + bias alone for gate-less FFNs), counts the active neurons of every token
(runtime/profiling/activity.py says what "active" means), and keeps a fixed random subset of tokens as training pairs
(x, active mask, and for ReLU-family FFNs the pre-activation that decides the mask), so memory is bounded whatever the
corpus size.
"""

from __future__ import annotations

import datetime as _dt
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from pinfer_llm.formats.errors import PinferError
from pinfer_llm.runtime.ffn.dense import activate
from pinfer_llm.runtime.profiling.activity import ActivationRule, cats_threshold

SPLIT_BLOCK = 32  # sampled tokens are split into train/calibration/test in runs of this many consecutive tokens
SPLIT = (0.7, 0.15, 0.15)  # train / calibration (threshold, ladder choice) / test (reported numbers)
CACHE_BYTES = 1 << 30  # SwiGLU: a layer's gate/up and |silu(gate)| for all tokens are kept up to this size


@dataclass
class Samples:
    """Training pairs of one layer: FFN inputs and active masks of the sampled tokens, and for ReLU-family FFNs
    each neuron's deciding pre-activation (ActivationRule.margin), as int8 with one scale per token: a quarter of
    float32's memory, and the regression that uses it loses nothing measurable (planted OPT layer: precision 0.753
    vs 0.754 at recall 0.995)."""

    x: np.ndarray  # float32 [N, d]: pre-norm residual (the predictor input)
    mask_bits: np.ndarray  # uint8 [N, ceil(n_ff/8)]: np.packbits of the active mask
    n_ff: int
    split: np.ndarray  # int8 [N]: 0 train, 1 calibration, 2 test
    margin_q: np.ndarray | None = None  # int8 [N, n_ff]: margin / margin_scale[:, None], rounded
    margin_scale: np.ndarray | None = None  # float32 [N]

    @staticmethod
    def int8_rows(margin: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """float [N, n_ff] -> (margin_q, margin_scale): each row rounded to int8 with its own scale max|row| / 127."""
        scale = margin.abs().amax(1).clamp_min(1e-30) / 127
        return torch.round(margin / scale[:, None]).to(torch.int8).numpy(), scale.numpy()

    def margins(self, k: int) -> torch.Tensor | None:
        """float32 [n, n_ff] margins of part k (None when not recorded)."""
        if self.margin_q is None:
            return None
        rows = np.flatnonzero(self.split == k)
        return torch.from_numpy(self.margin_q[rows].astype(np.float32) * self.margin_scale[rows, None])

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
    peak: np.ndarray | None = None  # float32 [n_layer, n_ff]: largest |activation| of each neuron

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


def sample_bytes(n_layer: int, n_embd: int, n_ff: int, tokens: int, with_margin: bool) -> int:
    """Memory the training pairs of `tokens` sampled tokens take over all layers (Samples): the input in float32,
    the mask bits, and with margins one int8 per neuron plus a float32 scale."""
    per_token = 4 * n_embd + -(-n_ff // 8) + (n_ff + 4 if with_margin else 0)
    return n_layer * tokens * per_token


def available_ram_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_ffn(model) -> None:
    for i, b in enumerate(model.transformer.blocks):
        if not all(hasattr(b.ffn, a) for a in ("pre_activations", "down_proj", "n_ff", "act")):
            raise PinferError(f"layer {i} has an FFN pi-profile cannot look inside ({type(b.ffn).__name__}); "
                              f"load the model dense")


@torch.inference_mode()
def profile(model, windows: list[list[int]], rule: ActivationRule, corpus: str = "", sample_tokens: int = 0,
            sparsity: float | None = None, seed: int = 0, progress=None) -> Profile:
    """Count active neurons per layer over all windows; keep up to sample_tokens random tokens as training pairs.

    The model runs layer by layer over all windows (each window from position 0, as its own sequence), not window
    by window: a layer's CATS threshold can then be calibrated on every token of the corpus before that layer's
    neurons are counted, in a single pass. The arithmetic is the same as Transformer.forward (the tests check the
    counts against an independent forward).
    """
    t0 = time.perf_counter()
    _check_ffn(model)
    cfg, tr = model.cfg, model.transformer
    L, n_ff, d = cfg.n_layer, cfg.n_ff, cfg.n_embd
    if rule.act == "silu":
        if sparsity is None:
            raise PinferError("SwiGLU profiling needs --sparsity S")
        rule.thresholds = np.zeros(L, dtype=np.float32)
    for w in windows:
        if len(w) > tr.max_ctx:
            raise PinferError(f"a window of {len(w)} tokens exceeds the context {tr.max_ctx}; lower --ctx")
    n_tokens = sum(len(w) for w in windows)
    counts = torch.zeros(L, n_ff, dtype=torch.float64)
    peak = torch.zeros(L, n_ff, dtype=torch.float32)

    k = min(sample_tokens, n_tokens)
    picked = np.sort(np.random.default_rng(seed).choice(n_tokens, size=k, replace=False)) if k else np.zeros(0, int)
    labels = split_labels(n_tokens, seed)[picked]
    starts = np.cumsum([0] + [len(w) for w in windows])
    bounds = np.searchsorted(picked, starts)  # picked[bounds[w]:bounds[w+1]] fall in window w
    rows = [torch.from_numpy(picked[bounds[w]:bounds[w + 1]] - starts[w]) for w in range(len(windows))]
    xs_out = np.zeros((L, k, d), dtype=np.float32)
    bits = np.zeros((L, k, -(-n_ff // 8)), dtype=np.uint8)
    with_margin = rule.has_margin
    margin_q = np.zeros((L, k, n_ff), dtype=np.int8) if with_margin else None
    margin_scale = np.zeros((L, k), dtype=np.float32) if with_margin else None

    xs = [tr.embed(torch.tensor(w, dtype=torch.long), 0) for w in windows]  # residual stream (T, d)
    cache_ok = n_tokens * 3 * n_ff * 4 <= CACHE_BYTES  # gate/up and |silu(gate)|, float32
    for li, b in enumerate(tr.blocks):
        ffn = b.ffn
        # per window: the FFN's normed input and residual input (what predictors read), and x + attention. Falcon's
        # parallel block feeds the FFN the layer input, sequential blocks the stream after attention.
        parts = [tr.attend(li, b, x, 0) for x in xs]
        xs = [p[2] for p in parts]
        fin = [p[0] for p in parts]
        res = [p[1] for p in parts]
        del parts
        pre = ffn.pre_activations  # -> (gate, up) [T, n_ff]; gate None for gate-less FFNs
        cached = mags = None
        if rule.act == "silu":
            if cache_ok:  # every token's gate/up and |silu(gate)| stay in memory for the second loop
                cached = [pre(x) for x in fin]
                mags = [F.silu(g).abs() for g, _ in cached]
                rule.thresholds[li] = cats_threshold(mags, sparsity)
            else:
                rows_ = _calib_rows(windows, n_ff, seed)
                rule.thresholds[li] = cats_threshold(
                    [F.silu(pre(x[r])[0]).abs() for x, r in zip(fin, rows_, strict=True)], sparsity)
        for w, x in enumerate(xs):
            gate, up = cached[w] if cached else pre(fin[w])
            m = mags[w] > rule.thresholds[li] if mags else rule.mask(li, gate, up)
            counts[li] += m.sum(0, dtype=torch.float64)
            r = rows[w]
            if r.numel():
                xs_out[li, bounds[w]:bounds[w + 1]] = res[w][r].float().numpy()
                bits[li, bounds[w]:bounds[w + 1]] = np.packbits(m[r].numpy(), axis=1)
                if with_margin:
                    q, sc = Samples.int8_rows(rule.margin(None if gate is None else gate[r], up[r]).float())
                    margin_q[li, bounds[w]:bounds[w + 1]], margin_scale[li, bounds[w]:bounds[w + 1]] = q, sc
            h = activate(gate, up, ffn.act)
            peak[li] = torch.maximum(peak[li], h.float().abs().amax(0))
            y = ffn.down_proj(h)
            xs[w] = x + (y if b.ffn_bias is None else y + b.ffn_bias)
        del cached, mags, fin, res
        if progress:
            progress(li + 1, L)
    samples = [Samples(xs_out[i], bits[i], n_ff, labels, None if margin_q is None else margin_q[i],
                       None if margin_scale is None else margin_scale[i]) for i in range(L)] if k else []
    date = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    return Profile(counts.numpy(), n_tokens, corpus, rule, date, time.perf_counter() - t0, samples,
                   sparsity if rule.act == "silu" else None, peak.numpy())


def _calib_rows(windows, n_ff: int, seed: int) -> list[torch.Tensor]:
    """Huge corpora only: a random subset of each window's positions whose gate values fit in CACHE_BYTES."""
    rng = np.random.default_rng(seed + 1)
    p = (CACHE_BYTES // (4 * n_ff)) / sum(len(w) for w in windows)
    return [torch.from_numpy(np.flatnonzero(rng.random(len(w)) < p)) for w in windows]
