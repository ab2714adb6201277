"""What "active" means for a neuron, per FFN activation (stored as pinfer.activation.rule).

- ReLU family (ReGLU, dReLU), "relu>0": relu(gate) > 0 (and relu(up) > 0 for dReLU), i.e. exactly the neurons
  whose output act(gate) * up can be nonzero, so skipping the others is exact. Gate-less ReLU FFNs (ReluFalcon, OPT)
  have no gate: there the up row decides, relu(up x + b) > 0.
- SwiGLU, "|silu(gate)|>thr": nothing is exactly zero, so "active" needs a threshold. For a target sparsity S each
  layer's threshold t_l is the S-quantile of |silu(gate)| over every token and neuron of the corpus (CATS), and a
  neuron is active iff |silu(gate)| > t_l.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pinfer_llm.formats.config import ModelConfig
from pinfer_llm.formats.errors import PinferError


@dataclass
class ActivationRule:
    act: str  # "relu" | "drelu" | "silu"
    thresholds: np.ndarray | None = None  # SwiGLU: per-layer threshold on |silu(gate)|

    @property
    def name(self) -> str:
        return "relu>0" if self.act in ("relu", "drelu") else "|silu(gate)|>thr"

    def mask(self, layer: int, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
        """bool [T, n_ff]; gate is None for gate-less FFNs (Falcon, OPT), whose up row decides"""
        if gate is None:
            return up > 0
        if self.act == "relu":
            return gate > 0
        if self.act == "drelu":
            return (gate > 0) & (up > 0)
        if self.thresholds is None:
            raise PinferError("SwiGLU activations have no notion of active without a threshold; pass --sparsity S")
        return F.silu(gate).abs() > float(self.thresholds[layer])

    @property
    def has_margin(self) -> bool:
        """Whether margin() gives one: the ReLU family (SwiGLU's CATS rule has none). Profiling keeps margins, and
        budgets their memory, by this."""
        return self.act != "silu"

    def margin(self, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor | None:
        """float [T, n_ff], positive exactly where the neuron is active, and linear in the FFN's normed input for
        ReLU-family FFNs: the pre-activation that decides (up for gate-less FFNs, gate for ReGLU; for dReLU the
        smaller of gate and up, the least of two linear ones). Predictor training regresses it
        (runtime/profiling/training.py). None for SwiGLU, whose CATS rule |silu(gate)| > t is not linear in
        anything."""
        if gate is None:
            return up
        if self.act == "relu":
            return gate
        if self.act == "drelu":
            return torch.minimum(gate, up)
        return None


def activation_rule(cfg: ModelConfig, sparsity: float | None = None) -> ActivationRule:
    """The rule for this model; SwiGLU needs --sparsity (profile() calibrates the thresholds)."""
    if cfg.ffn_act == "gelu":
        raise PinferError(f"this {cfg.arch} model's FFN is GELU, which is never exactly zero, so no neuron is ever "
                          f"inactive; pi-profile needs a ReLU model (ReluFalcon, OPT), or --ffn-act relu if it is one")
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


def cats_threshold(magnitudes: Sequence[torch.Tensor], sparsity: float) -> float:
    """The threshold t with a fraction `sparsity` of all |silu(gate)| values <= t: their k-th smallest value,
    k = round(sparsity * count), so exactly k of them are inactive (barring ties)."""
    v = torch.cat([m.reshape(-1) for m in magnitudes])
    k = min(max(int(round(sparsity * v.numel())), 1), v.numel())
    return float(v.kthvalue(k).values)
