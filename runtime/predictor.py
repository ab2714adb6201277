"""PowerInfer's activation predictors: per layer, Linear -> ReLU -> Linear without biases.

Neuron i is predicted active iff fc2(relu(fc1 x))[i] >= threshold, where x is the layer's pre-norm residual (the FFN
input before ffn_norm). GGUF stores fc1 as [r, d] and fc2 as [n_ff, r] in numpy order (ggml ne [d, r] / [r, n_ff]),
usually F16; the runtime reads fc1 as stored, in place, and for decoding keeps fc2 transposed (see load_predictors).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType as T

from formats import constants as C
from formats.errors import PinferError
from formats.reader import GGUFFile

from . import qops
from .weights import qweight


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
    # fc2 transposed, [r, n_ff], for decoding; must equal fc2.T. Given, or made on first use by fc2_t_source
    # (load_predictors(..., fc2_t=True)): a predictor that runs on a GPU, or never decodes, never makes it.
    fc2_t: torch.Tensor | None = field(default=None, repr=False, compare=False)
    fc2_t_source: Callable[[], torch.Tensor] | None = field(default=None, repr=False, compare=False)
    _f32: tuple | None = field(default=None, repr=False, compare=False)  # (fc1, fc2, float copies), see _float

    @property
    def hidden(self) -> int:
        return self.fc1.shape[0]

    @property
    def nbytes(self) -> int:
        return self.fc1.numel() * self.fc1.element_size() + self.fc2.numel() * self.fc2.element_size()

    def _float(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fc1, fc2 as float32 (a copy made once when they are stored in half precision)."""
        if self.fc1.dtype == self.fc2.dtype == torch.float32:
            return self.fc1, self.fc2
        c = self._f32
        if c is None or c[0] is not self.fc1 or c[1] is not self.fc2:  # training may replace fc2 (fold_thresholds)
            c = self._f32 = (self.fc1, self.fc2, self.fc1.float(), self.fc2.float())
        return c[2], c[3]

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, d] -> [T, n_ff], computed in float32: by the C++ kernels on fc1/fc2 as stored when they apply (no
        copy of the weights), else by torch on float32 copies."""
        x = x.float().contiguous()
        if qops.available() and not {self.fc1.dtype, self.fc2.dtype} - _KERNEL_DTYPES.keys():
            h = torch.ops.pinfer.qmatmul(x, [_bytes(self.fc1)], [_KERNEL_DTYPES[self.fc1.dtype]])
            return torch.ops.pinfer.qmatmul(F.relu(h), [_bytes(self.fc2)], [_KERNEL_DTYPES[self.fc2.dtype]])
        fc1, fc2 = self._float()
        return F.linear(F.relu(F.linear(x, fc1)), fc2)

    def mask(self, x: torch.Tensor) -> torch.Tensor:
        return self.scores(x) >= self.threshold

    def fused_indices(self, x: torch.Tensor, always: torch.Tensor | None = None) -> torch.Tensor | None:
        """One token x [1, d] -> the ascending indices of its predicted-active neurons, plus `always`, by the C++
        kernel over fc1 and fc2 (or fc2_t) as stored (F16 or F32, read in place); None where it does not apply (no
        kernels, another dtype): then use mask(). With fc2_t the second layer adds the rows of the hidden units
        that ReLU keeps (about half): it reads about half of fc2's bytes, in long rows (measured on planted OPT,
        12 layers of 8192 x 128: 2.3 -> 1.5 ms per token)."""
        if self.fc2_t is None and self.fc2_t_source is not None:
            self.fc2_t = self.fc2_t_source()
        w2 = self.fc2_t if self.fc2_t is not None else self.fc2
        if not qops.available() or {self.fc1.dtype, w2.dtype} - _KERNEL_DTYPES.keys():
            return None
        return torch.ops.pinfer.qpredict_active(
            x.float().contiguous(), _bytes(self.fc1), _KERNEL_DTYPES[self.fc1.dtype], _bytes(w2),
            _KERNEL_DTYPES[w2.dtype], self.threshold, always, self.fc2_t is not None)


_KERNEL_DTYPES = {torch.float32: int(T.F32), torch.float16: int(T.F16)}


def _bytes(w: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, row_bytes] view of a contiguous 2-D weight (how the kernels take every weight)."""
    return w.contiguous().view(torch.uint8)


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


def load_predictors(f: GGUFFile, n_layer: int, fc2_t: bool = False) -> list[Predictor]:
    """Every layer's predictor from a file, as stored (F16 or F32 views of the memory map; other types are
    dequantised); raises if any layer lacks one. fc2_t: decoding on the CPU (fused_indices) makes each fc2's
    transposed copy on first use, read from the file without the map: the map's pages of fc2 stay untouched while
    only single tokens are decoded, so the copy replaces them rather than adding to them."""
    thr = layer_thresholds(f, n_layer)
    preds = []
    for i in range(n_layer):
        n1, n2 = C.tensor(C.PRED_FC1, i), C.tensor(C.PRED_FC2, i)
        if not (f.has(n1) and f.has(n2)):
            raise PinferError(f"{f.path}: layer {i} has no predictor ({n1}); run `pi-profile {f.path.name} "
                              f"--train-predictors` first, or run with --dense")
        fc1, fc2 = _stored(f, n1), _stored(f, n2)
        if fc1.dim() != 2 or fc2.dim() != 2 or fc1.shape[0] != fc2.shape[1]:
            raise PinferError(f"{f.path}: predictor of layer {i} has fc1 {list(fc1.shape)} and fc2 {list(fc2.shape)}, "
                              f"which do not chain")
        preds.append(Predictor(fc1, fc2, thr[i], fc2_t_source=partial(_transposed, f, n2) if fc2_t else None))
    return preds


def _transposed(f: GGUFFile, name: str) -> torch.Tensor:
    """A [rows, cols] F16/F32 tensor as a contiguous [cols, rows] copy, its bytes read with pread (not through the
    memory map); other types are dequantised first."""
    t = f.info(name)
    dtype = {T.F16: torch.float16, T.F32: torch.float32}.get(T(t.ggml_type))
    if dtype is None:
        return _stored(f, name).t().contiguous()
    buf = bytearray(t.nbytes)
    got = os.preadv(f.fileno(), [buf], t.offset)
    if got != t.nbytes:
        raise PinferError(f"{f.path}: tensor '{name}' is cut short ({got} of {t.nbytes} bytes); the file is truncated")
    return torch.frombuffer(buf, dtype=dtype).view(t.shape).t().contiguous()


def _stored(f: GGUFFile, name: str) -> torch.Tensor:
    w = qweight(f, name)
    if w.qtype == T.F16:
        return w.data.view(torch.float16)
    if w.qtype == T.F32:
        return w.data.view(torch.float32)
    return w.dequantize()
