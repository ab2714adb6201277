"""Activation-sparse FFN execution: decide each token's active neurons, compute only those.

Three ways to decide (a "masker" maps (normed x, pre-norm residual) -> bool [T, n_ff]):
- predictors: PowerInfer's per-layer Linear -> ReLU -> Linear on the pre-norm residual (pi-run --sparse; for Falcon's
  parallel block that is the layer input);
- exact ReLU masks: gate (and up, for dReLU; up + bias alone for the gate-less Falcon and OPT) computed for every
  neuron, active iff the activation is > 0 (pi-run --oracle-masks, for debugging and for measuring what predictors
  cost);
- CATS thresholds for SwiGLU models: active iff |silu(gate)| > the layer's threshold (written by
  pi-profile --sparsity S); exact with --oracle-masks, predicted with --sparse.

Masks are per token. For one token the FFN runs on its own active set (runtime.ffn.ops.ffn_sparse). For several
tokens (prefill, perplexity) it runs on the union of their sets and then zeroes each token's inactive neurons, so a
token's result never depends on which other tokens share its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pinfer_llm.runtime.ffn.ops import KERNEL_MAX_T, FFNRows, ffn_exact, ffn_masked, ffn_qrows, ffn_sparse
from pinfer_llm.runtime.ffn.predictor import Predictor

# A neuron whose profiled peak |activation| exceeds this many times its layer's median peak is an outlier ("massive
# activation", typically on the first token of SwiGLU models) and is computed for every token: a predictor that
# misses one of them once can ruin a whole sequence (measured: SmolLM2, layer 11, |h| = 1803 against peaks ~10).
OUTLIER_FACTOR = 20.0


def outlier_neurons(peak: torch.Tensor | None) -> torch.Tensor | None:
    if peak is None:
        return None
    idx = (peak > OUTLIER_FACTOR * peak.median()).nonzero().view(-1)
    return idx if idx.numel() else None


class PredictorMasker:
    def __init__(self, pred: Predictor, always: torch.Tensor | None = None):
        self.pred, self.always = pred, always

    def __call__(self, w: FFNRows, x: torch.Tensor, resid: torch.Tensor) -> torch.Tensor:
        mask = self.pred.mask(resid)
        if self.always is not None:
            mask[:, self.always] = True
        return mask

    def indices(self, w: FFNRows, x: torch.Tensor, resid: torch.Tensor) -> torch.Tensor:
        """One token: the active neurons' indices, straight from the fused kernel when it applies."""
        idx = self.pred.fused_indices(resid, self.always)
        return idx if idx is not None else self(w, x, resid)[0].nonzero().view(-1)


class ReluOracleMasker:
    """Exact: neuron i is active iff its post-activation value is > 0."""

    def __call__(self, w: FFNRows, x: torch.Tensor, resid: torch.Tensor) -> torch.Tensor:
        g, u = w.pre_activations(x)
        if g is None:  # gate-less: relu(up) > 0
            return u > 0
        if w.act == "drelu":
            return (g > 0) & (u > 0)
        return g > 0


class CatsOracleMasker:
    """Exact CATS: neuron i is active iff |silu(gate_i)| > threshold."""

    def __init__(self, threshold: float):
        self.threshold = threshold

    def __call__(self, w: FFNRows, x: torch.Tensor, resid: torch.Tensor) -> torch.Tensor:
        return F.silu(w.pre_activations(x)[0]).abs() > self.threshold


@dataclass
class SparsityStats:
    tokens: int = 0  # token-layer evaluations
    active: int = 0  # active neurons summed over them
    # with predictors: forward passes (steps) of the layer and the neurons whose rows each read, summed: a batch of
    # rows reads the union of their predicted neurons (each row computed over its own), so this share grows with it
    steps: int = 0
    read: int = 0

    def add(self, mask: torch.Tensor) -> None:
        self.add_counts(mask.shape[0], int(mask.sum()))

    def add_counts(self, tokens: int, active: int) -> None:
        self.tokens += tokens
        self.active += active

    def add_read(self, steps: int, read: int) -> None:
        self.steps += steps
        self.read += read


@dataclass
class SparseFFN:
    w: FFNRows
    masker: object
    stats: SparsityStats = field(default_factory=SparsityStats)

    def __call__(self, x: torch.Tensor, resid: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and isinstance(self.masker, PredictorMasker):  # decode with predictors
            idx = self.masker.indices(self.w, x, resid)
            self.stats.add_counts(1, idx.numel())
            self.stats.add_read(1, idx.numel())
            return ffn_sparse(self.w, x, idx)
        if isinstance(self.masker, ReluOracleMasker | CatsOracleMasker):
            # exact masks: the kernel finds the active neurons itself (ReLU: by their gates; CATS: by |silu(gate)|)
            cats = self.masker.threshold if isinstance(self.masker, CatsOracleMasker) else 0.0
            done = ffn_exact(self.w, x, cats)
            if done is not None:
                self.stats.add_counts(x.shape[0], done[1])
                return done[0]
        mask = self.masker(self.w, x, resid)  # (T, n_ff) bool
        self.stats.add(mask)
        if x.shape[0] == 1:
            return ffn_sparse(self.w, x, mask[0].nonzero().view(-1))
        return ffn_masked(self.w, x, mask)

    def invariant_rows(self, x: torch.Tensor, resid: torch.Tensor) -> torch.Tensor | None:
        """T rows as one kernel call that gives each row the bits its decode step gives it (a row-invariant prefill
        chunk or batch): the C++ kernel over the union of the rows' neurons, each row masked to its own, which by the
        kernel's batch invariance (runtime/cpu/csrc/sparse_ffn.cpp) equals the row alone; the weights are read once
        for all rows. None where that kernel does not serve this layer's decode step (the caller goes row by row)."""
        w, T = self.w, x.shape[0]
        if not (isinstance(w, FFNRows) and w.kernels and T <= KERNEL_MAX_T):
            return None
        if isinstance(self.masker, ReluOracleMasker | CatsOracleMasker):
            cats = self.masker.threshold if isinstance(self.masker, CatsOracleMasker) else 0.0
            done = ffn_exact(w, x, cats)
            if done is None:
                return None
            self.stats.add_counts(T, done[1])
            return done[0]
        if not isinstance(self.masker, PredictorMasker):
            return None
        own = [self.masker.indices(w, x[t:t + 1], resid[t:t + 1]) for t in range(T)]  # as each decode step does
        self.stats.add_counts(T, sum(i.numel() for i in own))
        union = torch.unique(torch.cat(own))  # ascending
        if union.numel() == 0:
            return x.new_zeros(T, w.n_embd)
        mask = torch.zeros(T, union.numel(), dtype=torch.bool)
        for t, i in enumerate(own):
            mask[t, torch.searchsorted(union, i)] = True
        return ffn_qrows(w, x, union, mask)
