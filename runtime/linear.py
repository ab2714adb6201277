"""Linear layers over GGUF weights, and the rules for turning a ggml tensor into one.

Decoding one token reads every weight once, so decode speed is set by bytes per weight. Q4_0 and Q4_1 blocks map
exactly onto torch's int4 weight-only kernel (groups of 32, one scale and one zero per group):
    Q4_1: w = d*q + m        = (q - 8)*d + (m + 8d)      -> scale d, zero m + 8d
    Q4_0: w = d*(q - 8)                                   -> scale d, zero 0
so those weights stay 4-bit with no loss. Q8_0 (w = d*q, q in -128..127, blocks of 32) splits exactly into two such
matrices: q + 128 = 16a + b with a, b in 0..15, so
    w = 16d*(a - 8) + d*b      -> A: scale 16d, zero 0;  B: scale d, zero 8d
and y = A x + B x reads 8.5 bits per weight, like Q8_0 itself. Every other type is dequantised (gguf.quants) to the
compute dtype. Scales and zeros are rounded to bf16 (see Int4Linear).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from gguf import quants
from gguf.constants import GGMLQuantizationType as T

from formats.errors import PinferError
from formats.reader import GGUFFile

SUPPORTED_TYPES = {T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K}
INT4_TYPES = {T.Q4_0, T.Q4_1}
GROUP = 32


class DenseLinear:
    def __init__(self, weight: torch.Tensor):
        self.weight = weight  # [out, in]
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def dense_weight(self) -> torch.Tensor:
        return self.weight


# From this many rows a bf16 GEMM on a dense copy beats the int4 kernel, whose cost grows linearly with the rows
# (measured, 1 thread, 3072x576: 1 row 0.13 ms int4 vs 0.45 ms bf16; 16 rows 1.0 vs 0.44; 256 rows 31 vs 6.3).
GEMM_MIN_ROWS = 16


class _Packed:
    """Shared by the int4 layers: decode (few rows) uses the packed kernel; prefill (many rows) uses a bf16 copy
    rebuilt once from the file's memory map, so short prompts never pay its memory."""

    def __init__(self, dense_source):
        self._dense_source = dense_source  # () -> float [out, in], the exact dequantised weight
        self._gemm = None

    def gemm_weight(self) -> torch.Tensor:
        if self._gemm is None:
            self._gemm = self._dense_source().to(torch.bfloat16).contiguous()
        return self._gemm

    def _gemm_call(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), self.gemm_weight())


class Int4Linear(_Packed):
    """torch's packed int4 weight-only matmul.

    Activations, scales and zeros are bf16: torch 2.x has a vectorised CPU kernel only for bf16 activations (fp32
    and fp16 take a generic path 20-70x slower, measured). bf16 keeps 8 bits of mantissa, as llama.cpp's Q8
    activation quantisation does for the same weights.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dense_source=None):
        # q: int32 [out, in] values 0..15; scale, zero: [out, in/32]
        super().__init__(dense_source or (lambda: _int4_dequant(q, scale, zero)))
        self.out_features, self.in_features = q.shape
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        sz = torch.stack((scale, zero), dim=-1).transpose(0, 1)  # [in/32, out, 2]
        self.scale_zero = sz.to(torch.bfloat16).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Answers in bf16; callers add it to an fp32 residual, which promotes without an extra op."""
        if x.shape[0] >= GEMM_MIN_ROWS:
            return self._gemm_call(x)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP, self.scale_zero)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scale_zero.numel() * self.scale_zero.element_size()

    def dense_weight(self) -> torch.Tensor:
        """The weight as the decode kernel sees it (bf16 scales), for tests."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP, self.scale_zero).T.contiguous()


class SplitInt4Linear(_Packed):
    """Sum of two Int4Linear over the same input: an exact home for 8-bit weights (Q8_0)."""

    def __init__(self, hi: Int4Linear, lo: Int4Linear, dense_source):
        super().__init__(dense_source)
        self.hi, self.lo = hi, lo
        self.out_features, self.in_features = hi.out_features, hi.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= GEMM_MIN_ROWS:
            return self._gemm_call(x)
        xb = x.to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.hi.packed, GROUP, self.hi.scale_zero).float()
        return y + torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.lo.packed, GROUP, self.lo.scale_zero)

    @property
    def nbytes(self) -> int:
        return self.hi.nbytes + self.lo.nbytes

    def dense_weight(self) -> torch.Tensor:
        return self.hi.dense_weight().float() + self.lo.dense_weight().float()


def _int4_dequant(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """(q - 8) * scale + zero per group of 32: the exact float weight of Q4_0/Q4_1 blocks."""
    out, n = q.shape
    g = q.view(out, n // GROUP, GROUP).float()
    return ((g - 8) * scale[..., None] + zero[..., None]).view(out, n)


def check_type(f: GGUFFile, name: str) -> T:
    t = f.info(name)
    try:
        qt = T(t.ggml_type)
    except ValueError:
        qt = None
    if qt not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(x.name for x in SUPPORTED_TYPES))
        raise PinferError(f"{f.path}: tensor '{name}' has type {t.type_name}, which pinfer cannot run "
                          f"(supported: {supported}); requantize the model with llama-quantize")
    return qt


def dequantize(f: GGUFFile, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor as a torch array of `dtype`. Plain types in `dtype` already are views of the memory map."""
    qt = check_type(f, name)
    raw = f.raw(name)
    if qt == T.F32:
        t = torch.from_numpy(raw)
    elif qt == T.F16:
        t = torch.from_numpy(raw)
    elif qt == T.BF16:
        t = torch.from_numpy(raw).view(torch.bfloat16)
    else:
        t = torch.from_numpy(quants.dequantize(raw, qt))
    return t if t.dtype == dtype else t.to(dtype)


def _int4_parts(f: GGUFFile, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split Q4_0/Q4_1 blocks into nibbles [out, in] and per-group scale and zero [out, in/32] (fp32)."""
    qt = T(f.info(name).ggml_type)
    raw = torch.from_numpy(f.raw(name))  # uint8 [out, n_blocks * block_bytes]
    out = raw.shape[0]
    head = 2 if qt == T.Q4_0 else 4
    blocks = raw.view(out, -1, head + 16)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()[..., 0]
    qs = blocks[..., head:]
    # element j of a block is the low nibble of byte j, element j+16 the high nibble
    q = torch.cat((qs & 0xF, qs >> 4), dim=-1).reshape(out, -1).to(torch.int32)
    if qt == T.Q4_0:
        zero = torch.zeros_like(d)
    else:
        m = blocks[..., 2:4].contiguous().view(torch.float16).float()[..., 0]
        zero = m + 8 * d
    return q, d, zero


def _q8_parts(f: GGUFFile, name: str):
    """Q8_0 blocks (f16 d, int8 q[32]) -> (a, 16d, 0) and (b, d, 8d), see the module docstring. The zeros are
    power-of-two multiples of d, so rounding them to bf16 adds no error beyond that of d itself."""
    raw = torch.from_numpy(f.raw(name))
    out = raw.shape[0]
    blocks = raw.view(out, -1, 34)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()[..., 0]
    u = blocks[..., 2:].contiguous().view(torch.int8).to(torch.int32).reshape(out, -1) + 128  # 0..255
    return (u >> 4, 16 * d, torch.zeros_like(d)), (u & 15, d, 8 * d)


def _fast_type(f: GGUFFile, names: list[str]) -> T | None:
    """The type if these tensors can share a packed int4 layer, else None."""
    types = {f.info(n).ggml_type for n in names}
    if len(types) != 1:
        return None
    qt = T(types.pop())
    if qt not in INT4_TYPES and qt != T.Q8_0:
        return None
    out = sum(f.info(n).shape[0] for n in names)
    return qt if out % 16 == 0 and f.info(names[0]).shape[1] % GROUP == 0 else None


def load_linear(f: GGUFFile, names: list[str], dtype: torch.dtype, quantized: bool = True):
    """One linear layer from one or more [out, in] tensors stacked along `out` (e.g. Q, K and V fused)."""
    for n in names:
        check_type(f, n)
    qt = _fast_type(f, names) if quantized else None
    if qt in INT4_TYPES:
        def parts():
            return (torch.cat(p, dim=0) for p in zip(*(_int4_parts(f, n) for n in names), strict=True))

        # the prefill copy is rebuilt from the file, so q (4 bytes per weight) is not kept alive
        return Int4Linear(*parts(), dense_source=lambda: _int4_dequant(*parts()))
    if qt == T.Q8_0:
        his, los = zip(*(_q8_parts(f, n) for n in names), strict=True)
        hi = Int4Linear(*(torch.cat(p, dim=0) for p in zip(*his, strict=True)), dense_source=lambda: None)
        lo = Int4Linear(*(torch.cat(p, dim=0) for p in zip(*los, strict=True)), dense_source=lambda: None)
        return SplitInt4Linear(hi, lo, lambda: torch.cat([dequantize(f, n) for n in names], dim=0))
    ws = [dequantize(f, n, dtype) for n in names]
    w = ws[0] if len(ws) == 1 else torch.cat(ws, dim=0)
    return DenseLinear(w.contiguous())


class QuantEmbedding:
    """Token embedding that dequantises only the rows it is asked for: the table stays in the memory map."""

    def __init__(self, f: GGUFFile, name: str):
        self.qtype = check_type(f, name)
        self.raw = f.raw(name)
        self.n_vocab = self.raw.shape[0]

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens.numpy()
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_vocab):
            raise PinferError(f"token id out of range 0..{self.n_vocab - 1}")
        rows = self.raw[ids]
        if self.qtype == T.F32:
            return torch.from_numpy(np.ascontiguousarray(rows))
        if self.qtype == T.F16:
            return torch.from_numpy(rows.astype(np.float32))
        if self.qtype == T.BF16:
            return torch.from_numpy(np.ascontiguousarray(rows)).view(torch.bfloat16).float()
        return torch.from_numpy(quants.dequantize(rows, self.qtype))
