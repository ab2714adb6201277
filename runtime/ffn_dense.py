"""The dense feed-forward block: SwiGLU, ReGLU or dReLU, then the down projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def activate(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    if act == "silu":  # SwiGLU (Llama, SmolLM2)
        return F.silu(gate) * up
    if act == "relu":  # ReGLU (ReluLLaMA, ProSparse)
        return F.relu(gate) * up
    if act == "drelu":  # dReLU (Bamboo)
        return F.relu(gate) * F.relu(up)
    raise ValueError(f"unknown FFN activation {act}")


class DenseFFN:
    """gate and up share one fused matrix [2*n_ff, d] so a decode step is two matmuls."""

    def __init__(self, gate_up, down, act: str, n_ff: int):
        self.gate_up, self.down, self.act, self.n_ff = gate_up, down, act, n_ff

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up(x)  # (T, 2 n_ff)
        return activate(gu[:, :self.n_ff], gu[:, self.n_ff:], self.act)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: the ffn_norm output [T, d]; residual (the pre-norm input, which predictors read) is unused here."""
        return self.down(self.hidden(x))
