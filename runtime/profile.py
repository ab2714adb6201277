"""Activation profiling, CATS thresholds and predictor training: what pi-profile does, as plain functions.

    windows, desc = corpus_windows(model.tokenizer, builtin_corpus(), ctx=512)
    rule = activation_rule(model.cfg, sparsity=None)     # ReLU family; SwiGLU needs a target sparsity
    prof = profile(model, windows, rule, desc, sample_tokens=8192)   # counts [n_layer, n_ff] + (x, mask) samples
    preds, threshold = train_predictors(prof, ffn_bytes_per_layer(model.file, model.cfg))
    meta, tensors, drop = profile_entries(prof, n_layer)  # + predictor_entries(...): one atomic rewrite_gguf

Profiling runs the model layer by layer over all token windows, sees each FFN's input (the pre-norm residual, which
predictors read) and its gate/up pre-activations, counts the active neurons of every token, and keeps a fixed random
subset of tokens as training pairs (x, active mask), so memory is bounded whatever the corpus size.

"Active" (stored as pinfer.activation.rule):
- ReLU family (ReGLU, dReLU), "relu>0": relu(gate) > 0 (and relu(up) > 0 for dReLU), i.e. exactly the neurons
  whose output act(gate) * up can be nonzero, so skipping the others is exact.
- SwiGLU, "|silu(gate)|>thr": nothing is exactly zero, so "active" needs a threshold. For a target sparsity S each
  layer's threshold t_l is the S-quantile of |silu(gate)| over every token and neuron of the corpus (CATS), and a
  neuron is active iff |silu(gate)| > t_l.
"""

from __future__ import annotations

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
DEFAULT_RECALL = 0.95
SCORE_SCALE = 8.0
RIDGES = (1e-3, 1e-2, 1e-1)  # ridge strengths tried per layer, relative to the mean diagonal of x^T x
RECALL_MARGIN = 0.4  # thresholds aim this fraction of the way from --recall to 1 on the calibration tokens
CACHE_BYTES = 1 << 30  # SwiGLU: a layer's gate/up and |silu(gate)| for all tokens are kept up to this size


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
    """The rule for this model; SwiGLU needs --sparsity (profile() calibrates the thresholds)."""
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


# --- profiling --------------------------------------------------------------------------------------------------------

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


def _check_ffn(model) -> None:
    for i, b in enumerate(model.transformer.blocks):
        if not all(hasattr(b.ffn, a) for a in ("gate_up", "down", "n_ff", "act")):
            raise PinferError(f"layer {i} has an FFN pi-profile cannot look inside ({type(b.ffn).__name__}); "
                              f"load the model dense")


def cats_threshold(magnitudes: Sequence[torch.Tensor], sparsity: float) -> float:
    """The threshold t with a fraction `sparsity` of all |silu(gate)| values <= t: their k-th smallest value,
    k = round(sparsity * count), so exactly k of them are inactive (barring ties)."""
    v = torch.cat([m.reshape(-1) for m in magnitudes])
    k = min(max(int(round(sparsity * v.numel())), 1), v.numel())
    return float(v.kthvalue(k).values)


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

    xs = [tr.tok_embd(torch.tensor(w, dtype=torch.long)).to(tr.dtype) for w in windows]  # residual stream (T, d)
    cache_ok = n_tokens * 3 * n_ff * 4 <= CACHE_BYTES  # gate/up and |silu(gate)|, float32
    for li, b in enumerate(tr.blocks):
        ffn = b.ffn
        for w, x in enumerate(xs):
            xs[w] = x + tr.attention(li, b, tr.norm(x, b.attn_norm), 0)
        gate_up = lambda x: ffn.gate_up(tr.norm(x, b.ffn_norm))  # noqa: E731, B023
        cached = mags = None
        if rule.act == "silu":
            if cache_ok:  # every token's gate/up and |silu(gate)| stay in memory for the second loop
                cached = [gate_up(x) for x in xs]
                mags = [F.silu(g[:, :n_ff].float()).abs() for g in cached]
                rule.thresholds[li] = cats_threshold(mags, sparsity)
            else:
                rows_ = _calib_rows(windows, n_ff, seed)
                rule.thresholds[li] = cats_threshold(
                    [F.silu(gate_up(x[r])[:, :n_ff].float()).abs() for x, r in zip(xs, rows_, strict=True)], sparsity)
        for w, x in enumerate(xs):
            gu = cached[w] if cached else gate_up(x)  # (T, 2 n_ff)
            gate, up = gu[:, :n_ff], gu[:, n_ff:]
            m = mags[w] > rule.thresholds[li] if mags else rule.mask(li, gate.float(), up.float())
            counts[li] += m.sum(0, dtype=torch.float64)
            r = rows[w]
            if r.numel():
                xs_out[li, bounds[w]:bounds[w + 1]] = x[r].float().numpy()
                bits[li, bounds[w]:bounds[w + 1]] = np.packbits(m[r].numpy(), axis=1)
            h = activate(gate, up, ffn.act)
            peak[li] = torch.maximum(peak[li], h.float().abs().amax(0))
            xs[w] = x + ffn.down(h)
        del cached, mags
        if progress:
            progress(li + 1, L)
    samples = [Samples(xs_out[i], bits[i], n_ff, labels) for i in range(L)] if k else []
    date = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    return Profile(counts.numpy(), n_tokens, corpus, rule, date, time.perf_counter() - t0, samples,
                   sparsity if rule.act == "silu" else None, peak.numpy())


def _calib_rows(windows, n_ff: int, seed: int) -> list[torch.Tensor]:
    """Huge corpora only: a random subset of each window's positions whose gate values fit in CACHE_BYTES."""
    rng = np.random.default_rng(seed + 1)
    p = (CACHE_BYTES // (4 * n_ff)) / sum(len(w) for w in windows)
    return [torch.from_numpy(np.flatnonzero(rng.random(len(w)) < p)) for w in windows]


# --- predictors -------------------------------------------------------------------------------------------------------

@dataclass
class LayerPredictor:
    """A trained or imported predictor of one layer, as stored: fc1 [h, d], fc2 [n_ff, h] (float16)."""

    fc1: np.ndarray
    fc2: np.ndarray
    threshold: float  # neuron i predicted active iff fc2(relu(fc1 x))[i] >= threshold
    recall: float = float("nan")  # on the test tokens, with the stored (float16) weights
    precision: float = float("nan")
    density: float = float("nan")  # fraction of neurons predicted active per token
    true_density: float = float("nan")  # fraction actually active on the same tokens
    ladder: list[dict] = field(default_factory=list)  # per candidate size: hidden, density at the target, cost

    @property
    def hidden(self) -> int:
        return self.fc1.shape[0]

    @property
    def nbytes(self) -> int:
        return self.fc1.nbytes + self.fc2.nbytes

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        fc1, fc2 = torch.from_numpy(self.fc1).float(), torch.from_numpy(self.fc2).float()
        return F.linear(F.relu(F.linear(x.float(), fc1)), fc2)


def threshold_for_recall(scores: torch.Tensor, mask: torch.Tensor, recall: float) -> float:
    """The largest threshold t with recall(scores >= t) >= `recall` on these tokens (+inf-safe for no positives)."""
    pos = scores[mask]
    if pos.numel() == 0:
        return float(scores.max()) + 1.0
    k = int(math.floor((1.0 - recall) * pos.numel()))  # positives allowed below t
    return float(pos.kthvalue(k + 1).values) if k < pos.numel() else float(pos.max())


def confusion(scores: torch.Tensor, mask: torch.Tensor, threshold: float) -> tuple[float, float, float, float]:
    """(recall, precision, predicted density, true density) of scores >= threshold against mask."""
    pred = scores >= threshold
    tp = float((pred & mask).sum())
    n_pos, n_pred = float(mask.sum()), float(pred.sum())
    return (tp / n_pos if n_pos else 1.0, tp / n_pred if n_pred else 1.0, n_pred / mask.numel(),
            n_pos / mask.numel())


def _ridge_rrr(x: torch.Tensor, y: torch.Tensor, k_max: int, ridges: Sequence[float] = RIDGES
               ) -> list[tuple[float, torch.Tensor, torch.Tensor]]:
    """Reduced-rank ridge regression of y [N, n] on x [N, d]: y ~ (x A_k) V_k^T for every rank k <= k_max.

    For each ridge r (relative to the mean diagonal of x^T x), B is the ridge solution and V the top right singular
    vectors of the fitted values x B. With x = Q R those are the top eigenvectors of (R B)^T (R B), obtained from the
    small d x d matrix M M^T with M = R B. Returns [(r, A = B V [d, k_max], V [n, k_max])] for every ridge."""
    d = x.shape[1]
    x64 = x.double()
    G, XY = x64.T @ x64, x64.T @ y.double()
    R = torch.linalg.qr(x64, mode="r")[1]
    scale = float(G.diagonal().mean()) + 1e-12
    k = min(k_max, d)
    fits = []
    for r in ridges:
        B = torch.linalg.solve(G + r * scale * torch.eye(d, dtype=torch.float64), XY)  # (d, n)
        M = R @ B  # fitted values x B = Q M
        evals, U = torch.linalg.eigh(M @ M.T)  # ascending
        U, sv = U[:, -k:].flip(1), evals[-k:].flip(0).clamp_min(1e-30).sqrt()
        V = (M.T @ U) / sv  # (n, k): right singular vectors
        fits.append((r, (B @ V).float(), V.float().contiguous()))
    return fits


def _finetune(fc1: torch.Tensor, fc2: torch.Tensor, x: torch.Tensor, y: torch.Tensor, steps: int, seed: int,
              offset: float, judge: Callable[[torch.Tensor, torch.Tensor], float], check_every: int = 100,
              batch: int = 256, lr: float = 3e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """Binary cross-entropy on logits fc2(relu(fc1 x)) - offset with Adam; the constant offset stands in for the bias
    the format does not have (the threshold calibrated afterwards absorbs it).

    Every check_every steps `judge` scores the weights (lower is better: the predicted density at the recall target
    on the calibration tokens); training stops once a round improves it by less than 1%, and the best weights are
    returned. Layers the regression already predicts as well as this network can stop after one round."""
    best, best_w = judge(fc1, fc2), (fc1.clone(), fc2.clone())
    fc1.requires_grad_(True)
    fc2.requires_grad_(True)
    opt = torch.optim.Adam([fc1, fc2], lr=lr)
    g = torch.Generator().manual_seed(seed)
    n = x.shape[0]
    for step in range(1, steps + 1):
        with torch.enable_grad():
            idx = torch.randint(0, n, (min(batch, n),), generator=g)
            logits = F.linear(F.relu(F.linear(x[idx], fc1)), fc2) - offset
            loss = F.binary_cross_entropy_with_logits(logits, y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if step % check_every == 0 or step == steps:
            score = judge(fc1.detach(), fc2.detach())
            improved = score < best * 0.99
            if score < best:
                best, best_w = score, (fc1.detach().clone(), fc2.detach().clone())
            if not improved:
                break
    return best_w


def ladder_for(d: int, n_ff: int, ffn_bytes: float, ladder: Sequence[int], max_fraction: float) -> list[int]:
    """Candidate hidden sizes: at most 2*d (a rank-d linear map needs 2*d ReLU units) and at most max_fraction of
    the layer's FFN bytes (float16 predictor)."""
    sizes = sorted({int(h) for h in ladder if h >= 2 and h % 2 == 0})
    ok = [h for h in sizes if h <= 2 * d and 2 * h * (d + n_ff) <= max_fraction * ffn_bytes]
    return ok or sizes[:1]


def train_layer(s: Samples, ffn_bytes: float, recall: float = DEFAULT_RECALL, ladder: Sequence[int] = DEFAULT_LADDER,
                max_fraction: float = 0.10, steps: int = 600, tolerance: float = 0.02, seed: int = 0
                ) -> LayerPredictor:
    """Train one layer's predictor on its samples and choose its hidden size from the ladder.

    1. Fit: reduced-rank ridge regression of the active mask on the FFN input gives, for every rank k at once, a
       linear score (x A_k) V_k^T; as a ReLU network it is fc1 = [A_k^T; -A_k^T], fc2 = [V_k, -V_k] (h = 2k units,
       relu(z) - relu(-z) = z). A few ridge strengths are tried; the calibration tokens pick one.
    2. Choose: on the calibration tokens, each size's threshold is set to reach the recall target, and its cost per
       token is predictor bytes + predicted density * FFN bytes (what a sparse FFN reads). The smallest size within
       `tolerance` of the cheapest is taken: sparse, skewed layers stop early.
    3. Refine: Adam on binary cross-entropy from that start while the calibration density improves, rounding to
       float16, and the final threshold on the calibration tokens. The thresholds aim RECALL_MARGIN of the way from
       `recall` to 1, so that unseen text still reaches `recall`; recall and precision are then measured on the
       test tokens.
    """
    x_tr, m_tr = s.part(0)
    x_ca, m_ca = s.part(1)
    x_te, m_te = s.part(2)
    d, n_ff = x_tr.shape[1], s.n_ff
    sizes = ladder_for(d, n_ff, ffn_bytes, ladder, max_fraction)
    k_max = min(max(sizes) // 2, d, x_tr.shape[0])
    aim = recall + (1.0 - recall) * RECALL_MARGIN

    best = None  # (cost, rows, A, V)
    for ridge, A, V in _ridge_rrr(x_tr, m_tr.float(), k_max):
        rows = []
        z_ca = x_ca @ A  # (N_ca, k_max)
        for h in sizes:
            k = min(h // 2, k_max)
            sc = z_ca[:, :k] @ V[:, :k].T
            dens = confusion(sc, m_ca, threshold_for_recall(sc, m_ca, aim))[2]
            rows.append({"hidden": h, "ridge": ridge, "density": dens, "cost": 2 * h * (d + n_ff) + dens * ffn_bytes})
        cost = min(r["cost"] for r in rows)
        if best is None or cost < best[0]:
            best = (cost, rows, A, V)
    cost, rows, A, V = best
    h = next(r["hidden"] for r in rows if r["cost"] <= cost * (1 + tolerance))
    k = min(h // 2, k_max)

    # The regression scores ~P(active) in [0, 1]. Training sees logits = SCORE_SCALE * score - SCORE_SCALE / 2
    # (0.5 -> 0); the stored score keeps the + SCORE_SCALE / 2, which the calibrated threshold absorbs.
    scale = SCORE_SCALE
    fc1 = torch.cat([A[:, :k].T, -A[:, :k].T]).contiguous()  # (2k, d)
    fc2 = (scale * torch.cat([V[:, :k], -V[:, :k]], dim=1)).contiguous()  # (n_ff, 2k)
    if steps:
        def judge(w1, w2):
            sc = F.linear(F.relu(F.linear(x_ca, w1)), w2)
            return confusion(sc, m_ca, threshold_for_recall(sc, m_ca, aim))[2]

        fc1, fc2 = _finetune(fc1, fc2, x_tr, m_tr.float(), steps, seed, scale / 2, judge)
    p = LayerPredictor(fc1.half().numpy(), fc2.half().numpy(), 0.0, ladder=rows)
    p.threshold = threshold_for_recall(p.scores(x_ca), m_ca, aim)
    set_test_stats(p, x_te, m_te)
    return p


def set_test_stats(p: LayerPredictor, x: torch.Tensor, mask: torch.Tensor) -> None:
    p.recall, p.precision, p.density, p.true_density = confusion(p.scores(x), mask, p.threshold)


def fold_thresholds(preds: list[LayerPredictor]) -> float | None:
    """Make one threshold serve every layer, as PowerInfer reads a single powerinfer.sparse_threshold.

    Scaling a layer's fc2 by T / t_l > 0 maps its own threshold t_l onto T without changing any decision, so this
    works whenever all thresholds share a sign (training keeps them positive, see train_layer); then T is their
    median and every p.threshold becomes T. Otherwise nothing changes and None is returned: the layers keep their
    own thresholds (stored under pinfer.predictor.threshold)."""
    ts = np.array([p.threshold for p in preds], dtype=np.float64)
    if not ((ts > 0).all() or (ts < 0).all()):
        return None
    T = float(np.median(ts))
    if not 1e-3 <= (T / ts).min() <= (T / ts).max() <= 1e3:  # keep float16 weights far from under/overflow
        return None
    for p in preds:
        p.fc2 = (p.fc2.astype(np.float32) * (T / p.threshold)).astype(np.float16)
        p.threshold = T
    return T


def train_predictors(prof: Profile, ffn_bytes: float, recall: float = DEFAULT_RECALL,
                     ladder: Sequence[int] = DEFAULT_LADDER, max_fraction: float = 0.10, steps: int = 600,
                     seed: int = 0, progress=None) -> tuple[list[LayerPredictor], float | None]:
    """Every layer's predictor, thresholds folded into one where possible; test statistics of the stored weights."""
    need = min_train_tokens(prof.samples[0].x.shape[1]) if prof.samples else MIN_TRAIN_TOKENS
    n = prof.samples[0].x.shape[0] if prof.samples else 0
    if n < need:
        raise PinferError(f"training predictors needs at least {need} profiled tokens for this model, got {n}; "
                          f"pass more text with --corpus (or raise --tokens / --sample-tokens)")
    preds = []
    for i, s in enumerate(prof.samples):
        preds.append(train_layer(s, ffn_bytes, recall, ladder, max_fraction, steps, seed=seed + i))
        if progress:
            progress(i + 1, len(prof.samples))
    T = fold_thresholds(preds)
    for p, s in zip(preds, prof.samples, strict=True):
        set_test_stats(p, *s.part(2))
    return preds, T


def min_train_tokens(n_embd: int) -> int:
    """Profiled tokens needed to train predictors: 70% of them fit a d-dimensional regression, so at least 2 per
    input dimension, and never fewer than MIN_TRAIN_TOKENS (15% of them are the test tokens)."""
    return max(MIN_TRAIN_TOKENS, 2 * n_embd)


def ffn_bytes_per_layer(f: GGUFFile, cfg: ModelConfig) -> float:
    """Bytes of one layer's gate, up and down weights as stored (what a dense FFN reads per token)."""
    down = C.FFN_DOWN_T if cfg.down_transposed else C.FFN_DOWN
    return float(sum(f.info(C.tensor(t, 0)).nbytes for t in (C.FFN_GATE, C.FFN_UP, down)))


def check_ffn_tensors(f: GGUFFile, cfg: ModelConfig) -> None:
    """Profiling needs a llama-family FFN: gate, up and down (or PowerInfer's down_t) in every layer."""
    down = C.FFN_DOWN_T if cfg.down_transposed else C.FFN_DOWN
    for i in range(cfg.n_layer):
        for t in (C.FFN_GATE, C.FFN_UP, down):
            if not f.has(C.tensor(t, i)):
                raise PinferError(f"{f.path}: layer {i} has no {C.tensor(t, i)}; pi-profile understands only "
                                  f"llama-family FFNs (gate, up, down: SwiGLU, ReGLU, dReLU)")


# --- storage ----------------------------------------------------------------------------------------------------------

PROFILE_KEYS = (C.ACT_TOKENS, C.ACT_CORPUS, C.ACT_DATE, C.ACT_RULE, C.CATS_THRESHOLD, C.CATS_SPARSITY)
PREDICTOR_KEYS = (C.SPARSE_THRESHOLD, C.PRED_THRESHOLDS, C.PRED_RECALL, C.PRED_PRECISION, C.PRED_RECALL_TARGET,
                  C.PRED_SOURCE)


def profile_entries(prof: Profile, n_layer: int) -> tuple[dict, dict, list]:
    """(metadata to set, tensors to set, keys to drop) for a profile."""
    meta = {C.ACT_TOKENS: np.uint64(prof.tokens), C.ACT_CORPUS: prof.corpus, C.ACT_DATE: prof.date,
            C.ACT_RULE: prof.rule.name, C.FFN_ACTIVATION: prof.rule.act}
    drop = []
    if prof.rule.thresholds is not None:
        meta[C.CATS_THRESHOLD] = np.asarray(prof.rule.thresholds, dtype=np.float32)
        meta[C.CATS_SPARSITY] = np.float32(prof.cats_sparsity)
    else:
        drop += [C.CATS_THRESHOLD, C.CATS_SPARSITY]
    tensors = {C.tensor(C.ACT_COUNTS, i): prof.counts[i].astype(np.float32) for i in range(n_layer)}
    if prof.peak is not None:
        tensors.update({C.tensor(C.ACT_PEAK, i): prof.peak[i].astype(np.float32) for i in range(n_layer)})
    return meta, tensors, drop


def predictor_entries(preds: list[LayerPredictor], threshold: float | None, act: str, source: str,
                      recall_target: float | None = None) -> tuple[dict, dict, list]:
    """(metadata, tensors, keys to drop) for predictors: fc1/fc2 per layer, the global threshold (or per-layer ones
    when they cannot be folded into one), and the test statistics when known."""
    tensors = {}
    for i, p in enumerate(preds):
        tensors[C.tensor(C.PRED_FC1, i)] = np.ascontiguousarray(p.fc1, dtype=np.float16)
        tensors[C.tensor(C.PRED_FC2, i)] = np.ascontiguousarray(p.fc2, dtype=np.float16)
    ts = np.array([p.threshold for p in preds], dtype=np.float32)
    # a predictor in a llama file would otherwise make config.detect_ffn_activation read the file as ReLU
    meta = {C.PRED_SOURCE: source, C.FFN_ACTIVATION: act}
    drop = []
    if threshold is not None:
        meta[C.SPARSE_THRESHOLD] = np.float32(threshold)
        drop.append(C.PRED_THRESHOLDS)
    else:
        meta[C.SPARSE_THRESHOLD] = np.float32(np.median(ts))
        meta[C.PRED_THRESHOLDS] = ts
    stats = np.array([[p.recall, p.precision] for p in preds], dtype=np.float32)
    if recall_target is not None and np.isfinite(stats).all():
        meta[C.PRED_RECALL] = stats[:, 0].copy()
        meta[C.PRED_PRECISION] = stats[:, 1].copy()
        meta[C.PRED_RECALL_TARGET] = np.float32(recall_target)
    else:
        drop += [C.PRED_RECALL, C.PRED_PRECISION, C.PRED_RECALL_TARGET]
    return meta, tensors, drop


def stored_counts(f: GGUFFile, cfg: ModelConfig) -> tuple[np.ndarray, int]:
    """([n_layer, n_ff] counts, tokens) of the statistics stored in a file."""
    if not f.has(C.tensor(C.ACT_COUNTS, 0)) or C.ACT_TOKENS not in f.metadata:
        raise PinferError(f"{f.path}: no activation statistics; run pi-profile on it first")
    counts = np.stack([np.asarray(f.raw(C.tensor(C.ACT_COUNTS, i)), dtype=np.float64) for i in range(cfg.n_layer)])
    return counts, int(f.get(C.ACT_TOKENS))


# --- PowerInfer directories -------------------------------------------------------------------------------------------

_ACT_RE = re.compile(r"activation_(\d+)\.pt")
_PRED_RE = re.compile(r"model_(\d+)\.pt")


def _numbered(directory: Path, pattern: re.Pattern, n_layer: int, what: str) -> list[Path]:
    """Files N = 0..n_layer-1 of a PowerInfer directory, by the number in the name (not by text order: PowerInfer
    bug #247 put activation_10 before activation_2)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise PinferError(f"{directory}: no such directory")
    found: dict[int, Path] = {}
    for p in directory.iterdir():
        m = pattern.fullmatch(p.name)
        if m:
            found[int(m.group(1))] = p
    if sorted(found) != list(range(n_layer)):
        have = f"{len(found)} files" + (f" numbered {min(found)}..{max(found)}" if found else "")
        raise PinferError(f"{directory}: expected {what} files 0..{n_layer - 1} for a model with {n_layer} layers, "
                          f"found {have}; is this the directory for this model?")
    return [found[i] for i in range(n_layer)]


def _load_pt(path: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the user's input problem
        raise PinferError(f"{path}: not a readable torch file ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
                          ) from None


def import_activations(directory: Path, cfg: ModelConfig) -> np.ndarray:
    """[n_layer, n_ff] counts from PowerInfer's activation/activation_N.pt files (1-D tensors [n_ff])."""
    rows = []
    for i, p in enumerate(_numbered(directory, _ACT_RE, cfg.n_layer, "activation_N.pt")):
        t = _load_pt(p)
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != cfg.n_ff:
            shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise PinferError(f"{p}: layer {i} has {shape} counts, the model has {cfg.n_ff} neurons per layer; "
                              f"is this the directory for this model?")
        rows.append(t.double().numpy())
    counts = np.stack(rows)
    if not np.isfinite(counts).all() or (counts < 0).any():
        raise PinferError(f"{directory}: activation counts must be finite and non-negative")
    return counts


def export_activations(counts: np.ndarray, directory: Path) -> None:
    """Write activation_N.pt (int64 counts [n_ff]) for every layer, as PowerInfer's solver reads them.

    All files are written to a new sibling directory first and then renamed into place, so the directory either
    holds the complete new set or is untouched. An existing directory may hold only activation_N.pt files."""
    import shutil
    import tempfile

    directory = Path(directory)
    if directory.exists():
        if not directory.is_dir():
            raise PinferError(f"{directory}: exists and is not a directory")
        other = [p.name for p in directory.iterdir() if not _ACT_RE.fullmatch(p.name)]
        if other:
            raise PinferError(f"{directory}: holds other files ({other[0]}, ...); export into a new or empty "
                              f"directory")
    if not directory.parent.exists():
        raise PinferError(f"{directory.parent}: no such directory")
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        for i, c in enumerate(counts):
            torch.save(torch.from_numpy(np.rint(c).astype(np.int64)), tmp / C.ACTIVATION_FILE.format(bid=i))
        old = None
        if directory.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old.", dir=directory.parent))
            old.rmdir()
            directory.rename(old)
        tmp.rename(directory)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def import_predictors(directory: Path, cfg: ModelConfig) -> tuple[list[LayerPredictor], float]:
    """PowerInfer predictor directory: model_N.pt state dicts with fc1.weight [r, d] and fc2.weight [n_ff, r], and
    an optional config.json {"sparse_threshold": t}."""
    directory = Path(directory)
    files = _numbered(directory, _PRED_RE, cfg.n_layer, "model_N.pt")
    threshold = 0.0
    cfg_file = directory / "config.json"
    if cfg_file.exists():
        try:
            threshold = float(json.loads(cfg_file.read_text()).get("sparse_threshold", 0.0))
        except (ValueError, TypeError, AttributeError):
            raise PinferError(f"{cfg_file}: not a JSON object with a numeric sparse_threshold") from None
    preds = []
    for i, p in enumerate(files):
        sd = _load_pt(p)
        if not isinstance(sd, dict) or "fc1.weight" not in sd or "fc2.weight" not in sd:
            raise PinferError(f"{p}: expected a state dict with fc1.weight and fc2.weight")
        fc1, fc2 = sd["fc1.weight"], sd["fc2.weight"]
        if fc1.dim() != 2 or fc2.dim() != 2 or fc1.shape[1] != cfg.n_embd or fc2.shape[0] != cfg.n_ff \
                or fc1.shape[0] != fc2.shape[1]:
            raise PinferError(f"{p}: layer {i} predictor has fc1 {list(fc1.shape)} and fc2 {list(fc2.shape)}; "
                              f"this model needs fc1 [r, {cfg.n_embd}] and fc2 [{cfg.n_ff}, r]")
        preds.append(LayerPredictor(fc1.to(torch.float16).numpy(), fc2.to(torch.float16).numpy(), threshold))
    return preds, threshold
