"""Operators over weights as the file stores them (runtime/weights.QWeight).

Each op runs pinfer's C++ kernel on the encoded bytes in place (torch.ops.pinfer.*, runtime/cpu/csrc) when the kernels
are built and the types have one, and otherwise torch on float32 copies of the weights (made once per weight, see
QWeight.dense). Both give the same result up to rounding: the kernels for Q4_0/Q4_1/Q8_0 round the activations to
8-bit blocks first, as llama.cpp does (see runtime/cpu/csrc/quant.h), which the tests account for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pinfer_llm.runtime.cpu import kernels as cpu_kernels
from pinfer_llm.runtime.weights import QWeight

# FFN variants, as the kernels number them. The gate-less ones (Falcon, OPT) compute act(up x + b): the up row then
# decides activity as the gate row does in the gated ones.
ACT_CODES = {("silu", True): 0, ("relu", True): 1, ("drelu", True): 2, ("relu", False): 3, ("gelu", False): 4}
# Rows of a transposed weight dequantised per GEMM in matmul_t: ~4 MB of float32 for a 4096-wide row.
_T_CHUNK = 256


def available() -> bool:
    """Whether the quantised-row kernels are loaded (a library built from older sources may lack them)."""
    if not cpu_kernels.available():
        return False
    try:
        torch.ops.pinfer.qmatmul  # noqa: B018 - raises when the op is not registered
    except (AttributeError, RuntimeError):
        return False
    return True


def kernels_for(*ws: QWeight | None) -> bool:
    """Whether the C++ kernels run ops over these weights (all of a type the kernels read)."""
    return available() and all(w is None or w.in_kernel for w in ws)


def act_code(act: str, gated: bool) -> int:
    try:
        return ACT_CODES[(act, gated)]
    except KeyError:
        raise ValueError(f"no FFN variant {act!r} {'with' if gated else 'without'} a gate") from None


def matmul(x: torch.Tensor, ws: list[QWeight]) -> torch.Tensor:
    """x [T, in] -> [T, sum(out_i)]: y = x W_i^T for each weight, outputs side by side (Q, K and V in one call)."""
    x = x.float().contiguous()
    if kernels_for(*ws):
        return torch.ops.pinfer.qmatmul(x, [w.data for w in ws], [int(w.qtype) for w in ws])
    if len(ws) == 1:
        return F.linear(x, ws[0].dense())
    return torch.cat([F.linear(x, w.dense()) for w in ws], dim=-1)


def matmul_t(h: torch.Tensor, w: QWeight) -> torch.Tensor:
    """h [T, rows] -> [T, cols]: y = h W for a weight stored row-major along h's dimension (ffn_down_t: row i is
    neuron i's output column). Dequantises a few rows at a time, so no whole-matrix copy is made."""
    h = h.float()
    if not kernels_for(w):
        return h @ w.dense()
    y = h.new_zeros(h.shape[0], w.cols)
    for a in range(0, w.rows, _T_CHUNK):
        b = min(a + _T_CHUNK, w.rows)
        y.addmm_(h[:, a:b], torch.ops.pinfer.qdequant(w.data[a:b], int(w.qtype)))
    return y


def embed(w: QWeight, ids: torch.Tensor) -> torch.Tensor:
    """float32 rows [n, cols] of w for the given row ids (token embeddings, row gathers)."""
    if kernels_for(w):
        return torch.ops.pinfer.qembed(w.data, int(w.qtype), ids.contiguous())
    return w.dequantize(ids)


def rows(w: QWeight, lo: int, hi: int) -> torch.Tensor:
    """float32 [hi - lo, cols]: a block of rows, dequantised."""
    if kernels_for(w):
        return torch.ops.pinfer.qdequant(w.data[lo:hi], int(w.qtype))
    return w.dequantize(slice(lo, hi))
