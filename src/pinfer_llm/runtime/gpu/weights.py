"""What a device holds: weight matrices and one layer's GPU neurons, the same objects for every device.

`data` is device-specific (CudaDevice: a cupy uint8 [rows, stride] array in the device layout of layout.py;
ReferenceDevice: the dequantised torch matrix), everything else is plain numbers, so code that builds on a device
never looks inside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pinfer_llm.runtime.gpu import layout

# FFN activation codes (the kernels' `act`; 0-2 equal runtime/sparse_ffn.py's ACT_CODES).
SILU, RELU, DRELU, RELU_UP, GELU_UP = 0, 1, 2, 3, 4
ACT_CODES = {"silu": SILU, "relu": RELU, "drelu": DRELU, "relu_up": RELU_UP, "gelu_up": GELU_UP}
GATED = (SILU, RELU, DRELU)  # codes with a gate matrix; RELU_UP and GELU_UP read up (+ bias) only


def act_code(act: int | str) -> int:
    code = ACT_CODES.get(act, act) if isinstance(act, str) else act
    if code not in ACT_CODES.values():
        raise ValueError(f"unknown FFN activation {act!r}: one of {', '.join(ACT_CODES)} (or codes 0-4)")
    return int(code)


@dataclass(eq=False)
class Matrix:
    """A weight matrix [rows, cols] of type `ty` (layout ids) on a device."""

    ty: int
    rows: int
    cols: int
    data: Any
    stride: int = 0  # bytes between device rows (CudaDevice)

    @property
    def nbytes(self) -> int:
        """Bytes of the weights in their encoding (what a kernel reading every row touches)."""
        return self.rows * layout.row_bytes(self.ty, self.cols)


@dataclass(eq=False)
class FFNRows:
    """One layer's GPU-resident neurons: k rows of gate (None for gate-less acts), up and down_t, GPU row j being
    neuron bucket[j]; bias: the up bias of those neurons in the same order (gate-less acts), or None.
    CudaDevice keeps a neuron's gate and up rows adjacent (one buffer, gate and up Matrix views with a row stride of
    two rows) and `work`: the device's selection buffers for this layer (entries, count, per-block counts),
    allocated once at upload."""

    act: int
    n_ff: int
    gate: Matrix | None
    up: Matrix
    down: Matrix
    bucket: Any  # int32 [k] on the device
    bias: Any = None  # fp32 [k] on the device
    work: Any = None  # CudaDevice: (entries int32 [k], count int32 [1], counts int32 [sm_count])

    @property
    def k(self) -> int:
        return self.up.rows

    @property
    def d(self) -> int:
        return self.up.cols


@dataclass(eq=False)
class PredictorWeights:
    """PowerInfer's predictor, scores = fc2 @ relu(fc1 @ x), in one of two forms (runtime/gpu/cuda.py predict):
    - transposed (a float predictor): fc1 [r_pad, d] and fc2 stored transposed, fc2 = fc2_t [r_pad, n_ff], both F16,
      r padded to a multiple of 32 with zero rows (relu(0) = 0, so padding reads nothing); scores are an axpy over
      the rows of the hidden units ReLU keeps (about half of fc2 is read);
    - as stored (a Q4_0/Q4_1/Q8_0 fc2, as PowerInfer's `quantize` makes): fc1 [r, d] and fc2 [n_ff, r] in their own
      encodings, scores a GEMV over all of fc2 (a 4-bit fc2 whole is fewer bytes than half of an F16 one, and block
      rows cannot be transposed without re-quantising)."""

    fc1: Matrix
    fc2: Matrix
    r: int
    transposed: bool = True

    @property
    def n_ff(self) -> int:
        return self.fc2.cols if self.transposed else self.fc2.rows

    @property
    def nbytes(self) -> int:
        return self.fc1.nbytes + self.fc2.nbytes


STORED_PREDICTOR_TYPES = (layout.Q4_0, layout.Q4_1, layout.Q8_0)  # an fc2 of these stays as stored on the device


def gather_rows(raw: np.ndarray, ty: int, cols: int, rows: np.ndarray | None) -> np.ndarray:
    """The file's rows (uint8 [n, row_bytes]), only `rows` of them in that order when given."""
    r = layout.as_rows(raw, ty, cols)
    return r if rows is None else r[np.asarray(rows, dtype=np.int64)]


def upload_predictor(upload_matrix, fc1, fc2) -> PredictorWeights:
    """A device's upload_predictor through its upload_matrix. fc1 [r, d] and fc2 [n_ff, r] as float arrays: the
    transposed F16 form. fc2 as the file's rows, a tuple (raw, type, cols) of one of STORED_PREDICTOR_TYPES: both
    kept as stored (fc1 a tuple too, or floats)."""
    if isinstance(fc2, tuple):
        f2 = upload_matrix(*fc2)
        if f2.ty not in STORED_PREDICTOR_TYPES:
            raise ValueError(f"an fc2 of type {f2.ty} is uploaded as floats (transposed), not as stored")
        f1 = upload_matrix(*fc1) if isinstance(fc1, tuple) else upload_matrix(np.asarray(fc1, np.float16), layout.F16,
                                                                               np.shape(fc1)[1])
        if f1.rows != f2.cols:
            raise ValueError(f"predictor fc1 has {f1.rows} rows and fc2 {f2.cols} columns: they do not chain")
        return PredictorWeights(f1, f2, f1.rows, transposed=False)
    a, b, r = predictor_arrays(fc1, fc2)
    return PredictorWeights(upload_matrix(a, layout.F16, a.shape[1]), upload_matrix(b, layout.F16, b.shape[1]), r)


def predictor_arrays(fc1: np.ndarray, fc2: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """fc1 [r, d] and fc2 [n_ff, r] (PowerInfer's layout, any float dtype) -> F16 fc1 [r_pad, d] and
    fc2_t [r_pad, n_ff]."""
    fc1, fc2 = np.asarray(fc1), np.asarray(fc2)
    r, d = fc1.shape
    n_ff = fc2.shape[0]
    if fc2.shape[1] != r:
        raise ValueError(f"fc2 is {fc2.shape}, expected [n_ff, {r}]")
    if d % 32 or n_ff % 32:
        raise ValueError(f"predictor sizes d={d}, n_ff={n_ff} must be multiples of 32")
    r_pad = -(-r // 32) * 32
    a = np.zeros((r_pad, d), np.float16)
    a[:r] = fc1
    b = np.zeros((r_pad, n_ff), np.float16)
    b[:r] = fc2.T
    return a, b, r
