"""PowerInfer's activation predictors: per layer, Linear -> ReLU -> Linear without biases.

Neuron i is predicted active iff fc2(relu(fc1 x))[i] >= threshold, where x is the layer's pre-norm residual (the FFN
input before ffn_norm). GGUF stores fc1 as [r, d] and fc2 as [n_ff, r] in numpy order (ggml ne [d, r] / [r, n_ff]),
usually F16 (Q4_0 in files from PowerInfer's `quantize`); the runtime reads them as stored, in place, and for
decoding keeps an F16/F32 fc2 transposed as well (see load_predictors).
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

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.errors import PinferError
from pinfer_llm.formats.header import GGUFFile
from pinfer_llm.runtime.cpu import qops
from pinfer_llm.runtime.weights import QWeight, qweight


@dataclass
class Predictor:
    """One layer's predictor. The runtime keeps fc1/fc2 as loaded; pi-profile trains and stores float16 ones and
    records how they did on held-out profiled tokens (nan when unknown, e.g. imported predictors).

    fc1 [r, d] and fc2 [n_ff, r] are float tensors (trained, imported, or F16/F32 views of the file), or QWeights:
    a file's BF16/Q4_0/Q4_1/Q8_0 predictors (PowerInfer's `quantize` makes Q4_0 ones) stay in that encoding, read in
    place by the kernels. float32 copies: kept only for the torch fallback (float32()); a GPU upload takes as_float,
    which copies nothing but a QWeight's dequantisation."""

    fc1: torch.Tensor | QWeight
    fc2: torch.Tensor | QWeight
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
    _f32: tuple | None = field(default=None, repr=False, compare=False)  # (fc1, fc2, float copies), see float32

    @property
    def hidden(self) -> int:
        return _shape(self.fc1)[0]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.fc1) + _nbytes(self.fc2)

    def float32(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fc1, fc2 as float32 (a copy made once, unless they are float32 tensors already)."""
        if all(isinstance(w, torch.Tensor) and w.dtype == torch.float32 for w in (self.fc1, self.fc2)):
            return self.fc1, self.fc2
        c = self._f32
        if c is None or c[0] is not self.fc1 or c[1] is not self.fc2:  # training may replace fc2 (fold_thresholds)
            c = self._f32 = (self.fc1, self.fc2, as_float(self.fc1).float(), as_float(self.fc2).float())
        return c[2], c[3]

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, d] -> [T, n_ff], computed in float32: by the C++ kernels on fc1/fc2 as stored when they apply (no
        copy of the weights), else by torch on float32 copies."""
        x = x.float().contiguous()
        k1, k2 = _kernel_view(self.fc1), _kernel_view(self.fc2)
        if qops.available() and k1 and k2:
            h = torch.ops.pinfer.qmatmul(x, [k1[0]], [k1[1]])
            return torch.ops.pinfer.qmatmul(F.relu(h), [k2[0]], [k2[1]])
        fc1, fc2 = self.float32()
        return F.linear(F.relu(F.linear(x, fc1)), fc2)

    def mask(self, x: torch.Tensor) -> torch.Tensor:
        return self.scores(x) >= self.threshold

    def fused_indices(self, x: torch.Tensor, always: torch.Tensor | None = None) -> torch.Tensor | None:
        """One token x [1, d] -> the ascending indices of its predicted-active neurons, plus `always`, by the C++
        kernel over fc1 and fc2 (or fc2_t) as stored, read in place; None where it does not apply (no kernels, a
        type without one): then use mask(). With fc2_t the second layer adds the rows of the hidden units that ReLU
        keeps (about half): it reads about half of fc2's bytes, in long rows (measured on planted OPT, 12 layers of
        8192 x 128: 2.0 -> 1.4 ms per token)."""
        k = self.kernel_args()
        if k is None:
            return None
        (w1, t1), (w2, t2), transposed = k
        return torch.ops.pinfer.qpredict_active(x.float().contiguous(), w1, t1, w2, t2, self.threshold, always,
                                                transposed)

    def kernel_args(self) -> tuple[tuple[torch.Tensor, int], tuple[torch.Tensor, int], bool] | None:
        """((fc1 bytes, type), (fc2 or fc2_t bytes, type), fc2 transposed) as qpredict_active and the decode step
        (runtime/cpu/step.py) take them, or None where the kernels cannot read them."""
        if self.fc2_t is None and self.fc2_t_source is not None:
            self.fc2_t = self.fc2_t_source()
        k1, k2 = _kernel_view(self.fc1), _kernel_view(self.fc2_t if self.fc2_t is not None else self.fc2)
        if not (qops.available() and k1 and k2):
            return None
        return k1, k2, self.fc2_t is not None


_KERNEL_DTYPES = {torch.float32: int(T.F32), torch.float16: int(T.F16)}


def _bytes(w: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, row_bytes] view of a contiguous 2-D weight (how the kernels take every weight)."""
    return w.contiguous().view(torch.uint8)


def _kernel_view(w: torch.Tensor | QWeight) -> tuple[torch.Tensor, int] | None:
    """(uint8 rows, ggml type) as the kernels take w, or None when they cannot read it."""
    if isinstance(w, QWeight):
        return (w.data, int(w.qtype)) if w.in_kernel else None
    t = _KERNEL_DTYPES.get(w.dtype)
    return None if t is None else (_bytes(w), t)


def _shape(w: torch.Tensor | QWeight) -> tuple[int, int]:
    return (w.rows, w.cols) if isinstance(w, QWeight) else tuple(w.shape)


def _nbytes(w: torch.Tensor | QWeight) -> int:
    return w.nbytes if isinstance(w, QWeight) else w.numel() * w.element_size()


def as_float(w: torch.Tensor | QWeight) -> torch.Tensor:
    """A predictor weight as a float tensor, not kept: a float tensor as it is (no copy), a QWeight dequantised."""
    return w.dequantize() if isinstance(w, QWeight) else w


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
    """Every layer's predictor from a file, as stored (F16/F32 views of the memory map, QWeights over it for the
    other types the kernels read; the rest dequantised); raises if any layer lacks one. fc2_t: decoding on the CPU
    (fused_indices) makes each F16/F32 fc2's transposed copy on first use, read from the file without the map: the
    map's pages of fc2 stay untouched while only single tokens are decoded, so the copy replaces them rather than
    adding to them. A quantised fc2 is read as stored: all of a Q4_0 fc2 is fewer bytes than half of an F16 copy."""
    thr = layer_thresholds(f, n_layer)
    preds = []
    for i in range(n_layer):
        n1, n2 = C.tensor(C.PRED_FC1, i), C.tensor(C.PRED_FC2, i)
        if not (f.has(n1) and f.has(n2)):
            raise PinferError(f"{f.path}: layer {i} has no predictor ({n1}); run `pi-profile {f.path.name} "
                              f"--train-predictors` first, or run with --dense")
        fc1, fc2 = _stored(f, n1), _stored(f, n2)
        if _shape(fc1)[0] != _shape(fc2)[1]:
            raise PinferError(f"{f.path}: predictor of layer {i} has fc1 {list(_shape(fc1))} and fc2 "
                              f"{list(_shape(fc2))}, which do not chain")
        plain = T(f.info(n2).ggml_type) in (T.F16, T.F32)
        preds.append(Predictor(fc1, fc2, thr[i],
                               fc2_t_source=partial(_transposed, f, n2) if fc2_t and plain else None))
    return preds


def _transposed(f: GGUFFile, name: str) -> torch.Tensor:
    """An F16/F32 [rows, cols] tensor as a contiguous [cols, rows] copy, its bytes read with pread (not through the
    memory map)."""
    t = f.info(name)
    dtype = {T.F16: torch.float16, T.F32: torch.float32}[T(t.ggml_type)]
    buf = bytearray(t.nbytes)
    got = os.preadv(f.fileno(), [buf], t.offset)
    if got != t.nbytes:
        raise PinferError(f"{f.path}: tensor '{name}' is cut short ({got} of {t.nbytes} bytes); the file is truncated")
    return torch.frombuffer(buf, dtype=dtype).view(t.shape).t().contiguous()


def _stored(f: GGUFFile, name: str) -> torch.Tensor | QWeight:
    w = qweight(f, name)
    if w.qtype == T.F16:
        return w.data.view(torch.float16)
    if w.qtype == T.F32:
        return w.data.view(torch.float32)
    return w if w.in_kernel else w.dequantize()
