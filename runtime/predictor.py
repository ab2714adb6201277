"""PowerInfer's activation predictors: per layer, Linear -> ReLU -> Linear without biases.

Neuron i is predicted active iff fc2(relu(fc1 x))[i] >= threshold, where x is the layer's pre-norm residual (the FFN
input before ffn_norm). GGUF stores fc1 as [r, d] and fc2 as [n_ff, r] in numpy order (ggml ne [d, r] / [r, n_ff]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from formats import constants as C
from formats.errors import PinferError
from formats.reader import GGUFFile

from . import cpu_kernels


@dataclass
class Predictor:
    """One layer's predictor. The runtime keeps fc1/fc2 as loaded; pi-profile trains and stores float16 ones and
    records how they did on held-out profiled tokens (nan when unknown, e.g. imported predictors)."""

    fc1: torch.Tensor  # [r, d]
    fc2: torch.Tensor  # [n_ff, r]
    threshold: float = 0.0  # neuron i predicted active iff fc2(relu(fc1 x))[i] >= threshold
    recall: float = math.nan
    precision: float = math.nan
    density: float = math.nan  # fraction of neurons predicted active per token
    true_density: float = math.nan  # fraction actually active on the same tokens
    ladder: list[dict] = field(default_factory=list)  # training: per candidate size, hidden, density, cost

    @property
    def hidden(self) -> int:
        return self.fc1.shape[0]

    @property
    def nbytes(self) -> int:
        return self.fc1.numel() * self.fc1.element_size() + self.fc2.numel() * self.fc2.element_size()

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, d] -> [T, n_ff], computed in float32 (a no-op conversion for float32 weights)"""
        return F.linear(F.relu(F.linear(x.float(), self.fc1.float())), self.fc2.float())

    def mask(self, x: torch.Tensor) -> torch.Tensor:
        return self.scores(x) >= self.threshold

    def fused_indices(self, x: torch.Tensor, always: torch.Tensor | None = None) -> torch.Tensor | None:
        """One token x [1, d] -> the ascending indices of its predicted-active neurons, plus `always`, by the fused
        C++ kernel; None where it does not apply (fc2 not stored transposed as load_predictors stores it, half
        precision, no kernels): then use mask()."""
        fc2_t = self.fc2.t()
        if self.fc1.dtype != torch.float32 or not fc2_t.is_contiguous() or not cpu_kernels.available():
            return None
        return torch.ops.pinfer.predict_active(x.to(torch.float32).contiguous(), self.fc1, fc2_t, self.threshold,
                                               always)


def sparse_threshold(f: GGUFFile) -> float:
    return float(f.get(C.SPARSE_THRESHOLD, 0.0))


def layer_thresholds(f: GGUFFile, n_layer: int) -> list[float]:
    """Each layer's threshold: pinfer.predictor.threshold [n_layer] when the file has it (pi-profile writes it only
    when one global threshold cannot serve every layer), else powerinfer.sparse_threshold for all."""
    per_layer = f.get(C.PRED_THRESHOLDS)
    if per_layer is None:
        return [sparse_threshold(f)] * n_layer
    if len(per_layer) != n_layer:
        raise PinferError(f"{f.path}: {C.PRED_THRESHOLDS} has {len(per_layer)} entries for {n_layer} layers; "
                          f"rerun pi-profile --train-predictors")
    return [float(t) for t in per_layer]


def load_predictors(f: GGUFFile, n_layer: int, dtype: torch.dtype = torch.float32) -> list[Predictor]:
    """Every layer's predictor from a file; raises if any layer lacks one."""
    from .linear import dequantize

    thr = layer_thresholds(f, n_layer)
    preds = []
    for i in range(n_layer):
        n1, n2 = C.tensor(C.PRED_FC1, i), C.tensor(C.PRED_FC2, i)
        if not (f.has(n1) and f.has(n2)):
            raise PinferError(f"{f.path}: layer {i} has no predictor ({n1}); run `pi-profile {f.path.name} "
                              f"--train-predictors` first, or run with --dense")
        fc1, fc2 = dequantize(f, n1, dtype), dequantize(f, n2, dtype)
        if fc1.shape[0] != fc2.shape[1]:
            raise PinferError(f"{f.path}: predictor of layer {i} has fc1 {list(fc1.shape)} and fc2 {list(fc2.shape)}, "
                              f"which do not chain")
        # fc2 kept as a transposed view of a contiguous [r, n_ff]: one token's second layer is then an axpy over the
        # rows of the hidden units ReLU keeps (Predictor.fused_indices), and batches still multiply by the view
        preds.append(Predictor(fc1.contiguous(), fc2.t().contiguous().t(), thr[i]))
    return preds
