"""A weight matrix as the file stores it: ggml type, rows x cols, and a zero-copy view of its bytes.

Nothing here copies a weight. The bytes stay in the file's read-only memory map, and the C++ kernels
(runtime/cpu/csrc, through runtime/cpu/qops.py) compute on them in place: a Q4_0 model needs about its file size in
memory, and a model larger than RAM still opens (the page cache holds what is touched). Only the torch fallback (no C++
compiler, or a type without a kernel) makes a float32 copy, on first use, and says so when the model loads.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType as T

from pinfer_llm.formats.errors import PinferError, quote
from pinfer_llm.formats.header import GGUFFile, tensor_nbytes

# Types pinfer's C++ kernels read in place: every type it reads (without the kernels, each is dequantised by
# gguf.quants to a float copy). Q5_0, Q5_1, the K-quants and IQ4_NL / IQ4_XS only as matrices (dot products,
# runtime/cpu/csrc/kquant.cpp); neuron rows that are added up (ffn_down_t, axpy) and the GPU's copies take ROW_TYPES
# (rows_runnable: Q4_K as Q4_1, the others as Q8_0).
KERNEL_TYPES = frozenset({T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q8_0, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K,
                          T.IQ4_NL, T.IQ4_XS})
ROW_TYPES = frozenset({T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q8_0})
# Types gguf.quants can dequantise: the ones a model may use at all.
SUPPORTED_TYPES = KERNEL_TYPES


def as_tensor(a: np.ndarray) -> torch.Tensor:
    """A torch view of a numpy array, read-only memory maps included (torch warns about those because writing
    through the view would crash; pinfer never writes to weights)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


@dataclass(eq=False)
class QWeight:
    """A 2-D weight [rows, cols] in a ggml encoding. `data` is uint8 [rows, row_bytes]: row r holds the encoded
    values of output r (for ffn_down_t and the predictors' fc2, of neuron r)."""

    name: str
    qtype: T
    rows: int
    cols: int
    data: torch.Tensor
    _dense: torch.Tensor | None = field(default=None, repr=False)

    @property
    def row_bytes(self) -> int:
        return self.data.shape[1]

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def type_name(self) -> str:
        return self.qtype.name

    @property
    def in_kernel(self) -> bool:
        """Whether the C++ kernels read this encoding in place."""
        return self.qtype in KERNEL_TYPES

    def dequantize(self, rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        """float32 [n, cols] of the given rows (all by default), computed from the bytes (gguf.quants)."""
        raw = self.data if rows is None else self.data[rows]
        a = raw.numpy()
        if self.qtype == T.F32:
            out = a.view(np.float32)
        elif self.qtype == T.F16:
            out = a.view(np.float16).astype(np.float32)
        elif self.qtype == T.BF16:
            out = (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            out = quants.dequantize(a, self.qtype)
        return as_tensor(np.ascontiguousarray(out, dtype=np.float32)).reshape(-1, self.cols)

    def dense(self) -> torch.Tensor:
        """The weight as float32, for the torch fallback: a copy made once and kept (F32: the mapped rows themselves).
        The kernels never need it."""
        if self._dense is None:
            self._dense = self.dequantize()  # F32: a view of the mapped rows, no copy
        return self._dense


def check_type(f: GGUFFile, name: str) -> T:
    t = f.info(name)
    try:
        qt = T(t.ggml_type)
    except ValueError:
        qt = None
    if qt not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(x.name for x in SUPPORTED_TYPES))
        raise PinferError(f"{f.path}: tensor {quote(name)} has type {t.type_name}, which pinfer cannot run "
                          f"(supported: {supported}); requantize the model with llama-quantize")
    return qt


def qweight(f: GGUFFile, name: str) -> QWeight:
    """The 2-D tensor `name` as a QWeight over the file's memory map (no copy)."""
    qt = check_type(f, name)
    t = f.info(name)
    if len(t.shape) != 2:
        raise PinferError(f"{f.path}: tensor {quote(name)} has shape {list(t.shape)}, expected a matrix; the file is "
                          f"inconsistent")
    rows, cols = t.shape
    row_bytes = tensor_nbytes((cols,), int(qt))
    raw = f.mm[t.offset:t.offset + rows * row_bytes].reshape(rows, row_bytes)
    return QWeight(name, qt, rows, cols, as_tensor(raw))


def vector(f: GGUFFile, name: str) -> torch.Tensor:
    """A small tensor (norm weights, biases, statistics) as a float32 copy in its numpy shape."""
    qt = check_type(f, name)
    raw = f.raw(name)
    if qt == T.BF16:
        a = (raw.astype(np.uint32) << 16).view(np.float32)
    elif qt in (T.F32, T.F16):
        a = raw
    else:
        a = quants.dequantize(raw, qt)
    out = np.array(a, dtype=np.float32).reshape(f.info(name).shape)
    if not np.isfinite(out).all():  # norms, biases, statistics: small, so every value is checked
        raise PinferError(f"{f.path}: tensor {quote(name)} holds values that are not finite (NaN or inf): the "
                          f"model's weights are corrupt; download or convert it again")
    return torch.from_numpy(out)


def q8_0_bytes(a: torch.Tensor) -> torch.Tensor:
    """float32 [rows, cols] (cols a multiple of 32) encoded as ggml's Q8_0: per block of 32, an f16 scale
    d = max|x| / 127 and 32 int8 round(x / d), ties away from zero: the same bytes as ggml and gguf.quants.quantize
    (tested), and about as fast (0.20 s vs 0.17 s for 8192 x 2048 here), without leaving torch."""
    rows, cols = a.shape
    blocks = a.float().reshape(rows, cols // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    v = blocks * inv
    q = (torch.sign(v) * torch.floor(v.abs() + 0.5)).clamp_(-127, 127).to(torch.int8)  # C's roundf: ties away from 0
    scale = d.to(torch.float16).view(torch.uint8)  # [rows, nb, 2]
    return torch.cat([scale, q.view(torch.uint8)], dim=-1).reshape(rows, -1)


def as_q8_0(w: QWeight, chunk_rows: int = 1024, *, kernel: bool = True) -> QWeight:
    """`w` re-encoded as Q8_0 in anonymous memory: for the types only dot products read (Q5_0, Q5_1, K-quants, IQ4)
    where axpy or a GPU reads them, at 1.06 bytes per weight, 8 bits per value being finer than the 4-6 bits of the
    types it replaces; Q5_0 is repacked exactly (q5_0_as_q8_0). By the C++ op (runtime/cpu/csrc/requant.cpp,
    multithreaded) when the kernels are built, else (or with kernel=False) in numpy (through gguf.quants a block of
    rows at a time, so no float copy of the whole matrix exists at once): the same bytes (tested), ~30x slower."""
    from pinfer_llm.runtime.cpu import kernels as cpu_kernels

    if kernel and cpu_kernels.available():
        out = torch.ops.pinfer.requant_q8_0(w.data, int(w.qtype), w.cols)
        return QWeight(w.name, T.Q8_0, w.rows, w.cols, out)
    if w.qtype == T.Q5_0:
        return QWeight(w.name, T.Q8_0, w.rows, w.cols, torch.from_numpy(q5_0_as_q8_0(w.data.numpy())))
    out = torch.empty((w.rows, w.cols // 32 * 34), dtype=torch.uint8)
    for r in range(0, w.rows, chunk_rows):
        out[r:r + chunk_rows] = q8_0_bytes(w.dequantize(slice(r, r + chunk_rows)))
    return QWeight(w.name, T.Q8_0, w.rows, w.cols, out)


def q5_0_as_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q5_0 rows [n, nb * 22] as Q8_0 rows [n, nb * 34], exactly: a Q5_0 block's values d (q - 16) are a Q8_0
    block's with the same d and int8 q - 16 (requantising would round them again)."""
    b = raw.reshape(raw.shape[0], -1, 22)
    qh = b[..., 2:6].copy().view("<u4")  # [n, nb, 1]
    j = np.arange(16, dtype=np.uint32)
    lo = (b[..., 6:22] & 0xF) | (((qh >> j) << 4) & 0x10).astype(np.uint8)
    hi = (b[..., 6:22] >> 4) | ((qh >> (j + 12)) & 0x10).astype(np.uint8)
    q = (np.concatenate([lo, hi], -1).astype(np.int16) - 16).astype(np.int8).view(np.uint8)
    return np.ascontiguousarray(np.concatenate([b[..., :2], q], -1).reshape(raw.shape[0], -1))


def as_q4_1(w: QWeight) -> QWeight:
    """A Q4_K weight as Q4_1 by the C++ op (runtime/cpu/csrc/requant.cpp): each 32-value sub-block of a Q4_K super-block
    is a Q4_1 block once its scale d * sc and min dmin * m are rounded to f16, the only rounding (Q8_0 would round
    every value to 8 bits instead), at 20 bytes per 32 values (Q8_0: 34; the file: 18)."""
    from pinfer_llm.runtime.cpu import kernels as cpu_kernels

    if w.qtype != T.Q4_K:
        raise ValueError(f"{w.name}: as_q4_1 takes Q4_K, not {w.type_name}")
    if not cpu_kernels.available():
        raise RuntimeError(f"re-encoding {w.name} needs the C++ kernels ({cpu_kernels.status()})")
    return QWeight(w.name, T.Q4_1, w.rows, w.cols, torch.ops.pinfer.requant_q4_1(w.data, w.cols))


def runnable(w: QWeight) -> QWeight:
    """w in a type the kernels read: itself (every type today), or, for a type whose kernel is taken out (as
    benchmarks/kquant.py does to compare), its re-encoding: Q4_K as Q4_1, the others as Q8_0."""
    if w.in_kernel:
        return w
    return as_q4_1(w) if w.qtype == T.Q4_K else as_q8_0(w)


def rows_runnable(w: QWeight) -> QWeight:
    """w in a type that axpy and the GPU kernels read too (ROW_TYPES): itself, or re-encoded (Q4_K as Q4_1; the other
    dot-product-only types as Q8_0, Q5_0 exactly)."""
    if w.qtype not in KERNEL_TYPES or w.qtype in ROW_TYPES:
        return w
    return as_q4_1(w) if w.qtype == T.Q4_K else as_q8_0(w)


def quantize_like(a: torch.Tensor, qtype: T, name: str) -> QWeight:
    """Encode float32 [rows, cols] in `qtype` (gguf.quants), in anonymous memory: for the few weights pinfer must
    rearrange (a transposed ffn_down when the file has no ffn_down_t)."""
    if qtype == T.Q8_0:
        return QWeight(name, qtype, a.shape[0], a.shape[1], q8_0_bytes(a))
    arr = a.float().contiguous().numpy()
    if qtype == T.F32:
        raw = arr.view(np.uint8)
    elif qtype == T.F16:
        raw = arr.astype(np.float16).view(np.uint8)
    else:
        raw = quants.quantize(arr, qtype)
    raw = np.ascontiguousarray(raw).reshape(arr.shape[0], -1)
    return QWeight(name, qtype, arr.shape[0], arr.shape[1], torch.from_numpy(raw))


# Per block type: (bytes per block, offsets of its f16 scales). A block's values are integers times these (plus a
# min for the _1 and K types), so they are all finite exactly when its scales are.
_SCALES = {T.Q4_0: (18, (0,)), T.Q4_1: (20, (0, 2)), T.Q8_0: (34, (0,)), T.Q5_0: (22, (0,)), T.Q5_1: (24, (0, 2)),
           T.Q4_K: (144, (0, 2)), T.Q5_K: (176, (0, 2)), T.Q6_K: (210, (208,)), T.IQ4_NL: (18, (0,)),
           T.IQ4_XS: (136, (0,))}


def has_nonfinite(w: QWeight, stride: int = 1) -> bool:
    """Whether the weight holds NaN or inf: its float values, or its blocks' f16 scales (for the block types), in
    every `stride`-th row."""
    a = w.data[::stride].numpy()
    if w.qtype in (T.F32, T.F16, T.BF16):
        bits = a.view(np.uint32 if w.qtype == T.F32 else np.uint16)
        exp = {T.F32: 0x7F800000, T.F16: 0x7C00, T.BF16: 0x7F80}[w.qtype]
        return bool(((bits & exp) == exp).any())
    if w.qtype not in _SCALES:
        return not bool(np.isfinite(w.dequantize(slice(None, None, stride))).all())
    size, offsets = _SCALES[w.qtype]
    halves = a.view(np.uint16).reshape(-1, size // 2)  # every block size is even, and rows are whole blocks
    return any(bool((np.bitwise_and(halves[:, o // 2], 0x7C00) == 0x7C00).any()) for o in offsets)
