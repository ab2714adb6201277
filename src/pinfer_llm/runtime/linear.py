"""Linear layers and embeddings over weights as the file stores them (runtime/weights.QWeight).

A Linear is one or more [out, in] matrices stacked along `out` (Q, K and V, or gate and up, computed in one call with
no copy). Decode reads every weight once, so decode speed is set by bytes per weight: the C++ kernels read F16,
BF16, Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, the K-quants and IQ4_NL / IQ4_XS rows in place (runtime/cpu/qops.py).
"""

from __future__ import annotations

import torch

from pinfer_llm.formats.errors import PinferError
from pinfer_llm.runtime.cpu import qops
from pinfer_llm.runtime.weights import QWeight


class Linear:
    def __init__(self, ws: list[QWeight]):
        if len({w.cols for w in ws}) != 1:
            raise PinferError(f"cannot stack {[w.name for w in ws]}: their input widths differ; the file is "
                              f"inconsistent")
        self.ws = ws
        self.in_features = ws[0].cols
        self.out_features = sum(w.rows for w in ws)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> float32 [T, out]"""
        return qops.matmul(x, self.ws)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.ws)

    @property
    def in_kernel(self) -> bool:
        return all(w.in_kernel for w in self.ws)


class Embedding:
    """Token embedding that decodes only the rows it is asked for: the table stays in the memory map."""

    def __init__(self, w: QWeight):
        self.w = w

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.w.rows):
            raise PinferError(f"token id out of range 0..{self.w.rows - 1}")
        return qops.embed(self.w, tokens)
