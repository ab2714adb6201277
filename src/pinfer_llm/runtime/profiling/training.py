"""Training PowerInfer-style predictors (Linear -> ReLU -> Linear per layer) from profiled samples.

Per layer: a reduced-rank ridge regression of each neuron's deciding pre-activation (its "margin", for ReLU-family
FFNs; of the active mask for SwiGLU) gives a starting point for every hidden size on the ladder at once; each size's
threshold is set on calibration tokens for the recall target and its cost is predictor bytes + predicted density x
FFN bytes; the smallest size within 2% of the cheapest wins; Adam on cross-entropy then refines it while it
improves. See train_layer for the details.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.config import ModelConfig
from pinfer_llm.formats.errors import PinferError
from pinfer_llm.formats.header import GGUFFile
from pinfer_llm.runtime.ffn.predictor import Predictor
from pinfer_llm.runtime.profiling.counting import Profile, Samples
from pinfer_llm.runtime.profiling.store import ffn_tensors

MIN_TRAIN_TOKENS = 1000  # profiled tokens needed to train predictors (about 150 held out for each of calib/test)
DEFAULT_LADDER = (32, 64, 128, 256, 512, 1024, 2048)  # multiples of 32: PowerInfer quantizes fc2 rows in blocks of 32
DEFAULT_RECALL = 0.95
SCORE_SCALE = 8.0
RIDGES = (1e-3, 1e-2, 1e-1)  # ridge strengths tried per layer, relative to the mean diagonal of x^T x
RECALL_MARGIN = 0.4  # thresholds aim this fraction of the way from --recall to 1 on the calibration tokens
# A margin fit's scores are logits with the boundary at 0. Its threshold is kept at least this far below 0, so that
# every layer's is negative and one threshold can serve them all (fold_thresholds; PowerInfer reads one): a layer
# predicted perfectly would otherwise land at or above 0 (seen: planted Falcon's first layer). Lowering a threshold
# only adds neurons: here those with P(active) in [0.475, 0.5).
MARGIN_THRESHOLD_CAP = -0.1


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
        try:
            evals, U = torch.linalg.eigh(M @ M.T)  # ascending
        except torch.linalg.LinAlgError:
            # inputs of low rank (a first layer that sees only the corpus's few distinct token embeddings: planted
            # Falcon, 8192 tokens) can defeat LAPACK's eigensolver; the SVD of M gives the same, at ~4x the cost
            U, sv_all, _ = torch.linalg.svd(M, full_matrices=False)
            evals, U = (sv_all ** 2).flip(0), U.flip(1)
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
                ) -> Predictor:
    """Train one layer's predictor on its samples and choose its hidden size from the ladder.

    1. Fit: reduced-rank ridge regression on the FFN input gives, for every rank k at once, a linear score
       (x A_k) V_k^T; as a ReLU network it is fc1 = [A_k^T; -A_k^T], fc2 = [V_k, -V_k] (h = 2k units,
       relu(z) - relu(-z) = z). A few ridge strengths are tried; the calibration tokens pick one. What is regressed:
       for ReLU-family FFNs the pre-activation that decides activity (Samples.margins), which is linear in the
       normed input, so the regression recovers the deciding directions; the 0/1 mask is not, and where the
       inputs are not one Gaussian cloud its least-squares fit points elsewhere (planted OPT, whose learned
       positions give every position its own mean: precision 0.34 from the mask vs 0.75 from the pre-activation
       at recall 0.995, rank 32; planted ReLU llama 0.84 vs 0.93). SwiGLU (CATS) has only the mask.
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
    margin = s.margins(0)
    spread = float(margin.std()) if margin is not None else 0.0
    from_margin = spread > 0  # a dead layer has no margin to regress
    target = margin if from_margin else m_tr.float()
    del margin

    best = None  # (cost, rows, A, V)
    for ridge, A, V in _ridge_rrr(x_tr, target, k_max):
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

    # A mask regression scores ~P(active) in [0, 1]: training sees logits = SCORE_SCALE * score - SCORE_SCALE / 2
    # (0.5 -> 0), and the stored score keeps the + SCORE_SCALE / 2, which the calibrated threshold absorbs. A margin
    # regression scores the pre-activation (0 at the boundary): logits = SCORE_SCALE * score / its spread.
    scale = SCORE_SCALE / spread if from_margin else SCORE_SCALE
    offset = 0.0 if from_margin else SCORE_SCALE / 2
    del target
    fc1 = torch.cat([A[:, :k].T, -A[:, :k].T]).contiguous()  # (2k, d)
    fc2 = (scale * torch.cat([V[:, :k], -V[:, :k]], dim=1)).contiguous()  # (n_ff, 2k)
    if steps:
        def judge(w1, w2):
            sc = F.linear(F.relu(F.linear(x_ca, w1)), w2)
            return confusion(sc, m_ca, threshold_for_recall(sc, m_ca, aim))[2]

        fc1, fc2 = _finetune(fc1, fc2, x_tr, m_tr.float(), steps, seed, offset, judge)
    p = Predictor(fc1.half(), fc2.half(), 0.0, ladder=rows)
    p.threshold = threshold_for_recall(p.scores(x_ca), m_ca, aim)
    if from_margin:
        p.threshold = min(p.threshold, MARGIN_THRESHOLD_CAP)
    set_test_stats(p, x_te, m_te)
    return p


def set_test_stats(p: Predictor, x: torch.Tensor, mask: torch.Tensor) -> None:
    p.recall, p.precision, p.density, p.true_density = confusion(p.scores(x), mask, p.threshold)


def fold_thresholds(preds: list[Predictor]) -> float | None:
    """Make one threshold serve every layer, as PowerInfer reads a single powerinfer.sparse_threshold.

    Scaling a layer's fc2 by T / t_l > 0 maps its own threshold t_l onto T without changing any decision, so this
    works whenever all thresholds share a sign, as they do when every layer was trained alike (mask fits end
    positive, margin fits below their boundary 0: negative); then T is their median and every p.threshold becomes
    T. Otherwise nothing changes and None is returned: the layers keep their own thresholds (stored under
    pinfer.predictor.threshold)."""
    ts = np.array([p.threshold for p in preds], dtype=np.float64)
    if not ((ts > 0).all() or (ts < 0).all()):
        return None
    T = float(np.median(ts))
    if not 1e-3 <= (T / ts).min() <= (T / ts).max() <= 1e3:  # keep float16 weights far from under/overflow
        return None
    for p in preds:
        p.fc2 = (p.fc2.float() * (T / p.threshold)).half()
        p.threshold = T
    return T


def train_predictors(prof: Profile, ffn_bytes: Sequence[float], recall: float = DEFAULT_RECALL,
                     ladder: Sequence[int] = DEFAULT_LADDER, max_fraction: float = 0.10, steps: int = 600,
                     seed: int = 0, progress=None) -> tuple[list[Predictor], float | None]:
    """Every layer's predictor, thresholds folded into one where possible; test statistics of the stored weights."""
    need = min_train_tokens(prof.samples[0].x.shape[1]) if prof.samples else MIN_TRAIN_TOKENS
    n = prof.samples[0].x.shape[0] if prof.samples else 0
    if n < need:
        raise PinferError(f"training predictors needs at least {need} profiled tokens for this model, got {n}; "
                          f"pass more text with --corpus (or raise --tokens / --sample-tokens)")
    preds = []
    for i, s in enumerate(prof.samples):
        preds.append(train_layer(s, ffn_bytes[i], recall, ladder, max_fraction, steps, seed=seed + i))
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


def ffn_bytes_per_layer(f: GGUFFile, cfg: ModelConfig) -> list[float]:
    """Per layer, bytes of its gate (gated archs), up and down weights as stored (what a dense FFN reads per token);
    layers may be quantised differently (llama.cpp's mixed quantisations keep some layers at higher precision)."""
    return [float(sum(f.info(C.tensor(t, i)).nbytes for t in ffn_tensors(cfg))) for i in range(cfg.n_layer)]
