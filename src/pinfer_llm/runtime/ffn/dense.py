"""The dense feed-forward block: every neuron of the layer, then the down projection."""

from __future__ import annotations

import torch

from pinfer_llm.runtime.cpu import qops
from pinfer_llm.runtime.ffn.ops import KERNEL_MAX_T, FFNRows, activate, ffn_dense
from pinfer_llm.runtime.linear import Linear

__all__ = ["DenseFFN", "activate"]


class DenseFFN:
    """Files with ffn_down: gate and up in one fused matmul, then down (two calls per token). PowerInfer files, which
    store only the neuron-major ffn_down_t: the sparse kernel over every neuron (exact, each row read once) for a few
    tokens, GEMMs over dequantised row blocks for more."""

    def __init__(self, rows: FFNRows, down: Linear | None):
        self.rows, self.down = rows, down
        self.act, self.n_ff = rows.act, rows.n_ff

    def pre_activations(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(gate, up) [T, n_ff]; gate is None for gate-less FFNs."""
        return self.rows.pre_activations(x)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return activate(*self.pre_activations(x), self.act)

    def down_proj(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(h) if self.down is not None else self.rows.down(h)

    def invariant_rows(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """T rows that get the bits each row's decode step gives it, or None (see SparseFFN.invariant_rows): ffn_mm's
        rows are independent below the GEMM crossover; PowerInfer's ffn_down_t runs the sparse kernel over every
        neuron, batch-invariant for as many tokens as it takes."""
        if self.down is not None:
            return self(x)
        if self.rows.kernels and x.shape[0] <= KERNEL_MAX_T:
            return ffn_dense(self.rows, x)
        return None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: the ffn_norm output [T, d]; residual (the pre-norm input, which predictors read) is unused here."""
        if self.down is None:
            return ffn_dense(self.rows, x)
        r = self.rows
        if len(self.down.ws) == 1 and qops.kernels_for(r.gate, r.up, *self.down.ws):
            # one C++ call, the one the decode step (runtime/cpu/step.py) makes, so the two agree to the bit
            d = self.down.ws[0]
            return torch.ops.pinfer.ffn_mm(x.float().contiguous(), None if r.gate is None else r.gate.data,
                                           0 if r.gate is None else int(r.gate.qtype), r.up.data, int(r.up.qtype),
                                           d.data, int(d.qtype), r.code, r.up_bias)
        return self.down(self.hidden(x))
