"""Exactness of the C++ kernels on weights as GGUF stores them (runtime/cpu/csrc/ops.cpp), for every op, weight type and
instruction-set path: each test runs on three builds loaded side by side, the runtime's (-march=native here) and the
x86-64-v3 (AVX2) and x86-64 (portable) ones.

References are float64 and independent of the kernels: the block formats are decoded here with numpy from their
layout (cross-checked once against gguf.quants). Where a kernel quantises activations to q8 blocks (block-type
weights in a dot product), the reference applies the same q8 round trip to x and the kernel must match it to fp32
rounding; it must also match the pure fp32 reference within the q8 error bound, computed exactly per block.
Weights always sit at odd addresses (slices of a larger buffer at offsets 1..63).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import quants
from gguf.constants import GGMLQuantizationType as GT

from pinfer_llm.runtime.cpu import kernels as cpu_kernels

pytestmark = pytest.mark.skipif(os.environ.get("PINFER_CPU_KERNELS") == "0", reason="PINFER_CPU_KERNELS=0")

F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
TYPES = {"F32": F32, "F16": F16, "BF16": BF16, "Q4_0": Q4_0, "Q4_1": Q4_1, "Q8_0": Q8_0}
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
RTOL = 2e-5  # fp32 rounding of a dot product, relative to sum |w x| (q8 differs from fp32 by ~1e-4..1e-3 of it)
# $PINFER_TEST_BUILDS narrows the builds (a comma list of these three), e.g. to iterate on one instruction-set path
BUILDS = tuple(os.environ.get("PINFER_TEST_BUILDS", "runtime,x86-64-v3,x86-64").split(","))


# --- builds ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def kernel_builds() -> dict:
    """The runtime's build (torch.ops.pinfer) and the AVX2 and portable builds, compiled in parallel on first use."""
    x86 = platform.machine() in ("x86_64", "AMD64")
    marches = [m for m in ("x86-64-v3", "x86-64")
               if m in BUILDS and x86 and (m == "x86-64" or " avx2" in cpu_kernels.cpu_flags())]
    with ThreadPoolExecutor(1) as pool:
        runtime = pool.submit(cpu_kernels.available)
        variants = cpu_kernels.load_variants(marches)
        assert runtime.result(), cpu_kernels.status()  # a kernel that fails to build is a failure, not a skip
    return {"runtime": torch.ops.pinfer, **variants}


@pytest.fixture(params=BUILDS)
def ops(request, kernel_builds):
    if request.param not in kernel_builds:
        pytest.skip(f"-march={request.param} cannot run on this CPU")
    return kernel_builds[request.param]


# --- reference encodings ---------------------------------------------------------------------------------------------

def row_bytes(t: int, cols: int) -> int:
    return cols // 32 * BLOCK_BYTES[t] if t in BLOCK_BYTES else cols * (4 if t == F32 else 2)


def encode(rng: np.random.Generator, rows: int, cols: int, t: int, scale: float = 0.5) -> np.ndarray:
    """Random weights in type t as uint8 [rows, row_bytes]: every nibble / byte pattern, scales of both signs."""
    if t not in BLOCK_BYTES:
        w = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        if t == F16:
            return w.astype(np.float16).view(np.uint8)
        if t == BF16:
            return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return w.view(np.uint8)
    nb = cols // 32
    raw = rng.integers(0, 256, (rows, nb, BLOCK_BYTES[t]), dtype=np.uint8)
    heads = 2 if t == Q4_1 else 1  # d (and Q4_1's m) as half floats at the block start
    half = (rng.standard_normal((rows, nb, heads)) * scale * (0.25 if t == Q8_0 else 2) / 16).astype(np.float16)
    raw[:, :, :2 * heads] = half.view(np.uint8)
    return raw.reshape(rows, nb * BLOCK_BYTES[t])


def decode(raw: np.ndarray, t: int) -> np.ndarray:
    """Reference dequantisation, float64 [rows, cols], from the block layouts (runtime/cpu/csrc/quant.h)."""
    raw = np.ascontiguousarray(raw)
    rows = raw.shape[0]
    if t == F32:
        return raw.view(np.float32).astype(np.float64)
    if t == F16:
        return raw.view(np.float16).astype(np.float64)
    if t == BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    blocks = raw.reshape(rows, -1, BLOCK_BYTES[t])
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float64)  # [rows, nb, 1]
    if t == Q8_0:
        return (d * blocks[..., 2:].view(np.int8)).reshape(rows, -1)
    qs = blocks[..., 4:] if t == Q4_1 else blocks[..., 2:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float64)  # values j, then j + 16
    if t == Q4_0:
        return (d * (q - 8)).reshape(rows, -1)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float64)
    return (d * q + m).reshape(rows, -1)


def place(raw: np.ndarray, offset: int) -> torch.Tensor:
    """raw as a zero-copy tensor at `offset` bytes into a larger buffer (an odd address, as in a memory map)."""
    buf = np.zeros(raw.size + 64, np.uint8)
    view = buf[offset:offset + raw.size].reshape(raw.shape)
    view[...] = raw
    return torch.from_numpy(view)


def q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' q8 round trip of x [T, n] (float32), as float64 values, and each value's block scale d."""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    d = np.abs(xb).max(-1) / np.float32(127)  # float32, as the kernels compute it
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None])  # round half to even, like cvtps2dq
    d_each = np.broadcast_to(d[..., None], xb.shape).reshape(x.shape).astype(np.float64)
    return (q.astype(np.float64) * d[..., None]).reshape(x.shape), d_each


def assert_dot_close(got, w: np.ndarray, x: np.ndarray, t: int, uses_q8: bool, what: str = ""):
    """got [T, rows] against x @ w.T: exactly (fp32 rounding) for the activations the kernel used, and within the
    exact q8 error bound of the fp32 result."""
    got = got.numpy().astype(np.float64) if isinstance(got, torch.Tensor) else got
    x64 = x.astype(np.float64)
    xq, d = q8(x) if uses_q8 else (x64, np.zeros_like(x64))
    ref = xq @ w.T
    absref = np.abs(xq) @ np.abs(w).T
    err = np.abs(got - ref)
    assert np.all(err <= RTOL * absref + 1e-30), (
        f"{what} type {t}: max err/bound {np.max(err / (RTOL * absref + 1e-30)):.3g}")
    if uses_q8:  # |sum_j w_j (x_j - xq_j)| <= sum_j |w_j| d_j / 2
        bound = (d / 2) @ np.abs(w).T + 2 * RTOL * absref + 1e-30
        assert np.all(np.abs(got - x64 @ w.T) <= bound), f"{what} type {t}: outside the q8 error bound"


def test_reference_decoder_matches_gguf():
    """The test's own block decoder against gguf-py's, once per type."""
    import gguf

    rng = np.random.default_rng(0)
    for name, t in TYPES.items():
        raw = encode(rng, 5, 96, t)
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])
        np.testing.assert_array_equal(decode(raw, t).astype(np.float32), want.reshape(5, 96))


# --- qdequant, qembed -------------------------------------------------------------------------------------------------

def assert_values_exact(got: torch.Tensor, raw: np.ndarray, t: int):
    """Dequantised values are single-rounding exact (Q4_1's d*q + m may round twice: one ulp of its terms)."""
    ref = decode(raw, t)
    if t == Q4_1:
        blocks = raw.reshape(raw.shape[0], -1, 20)
        d = np.abs(blocks[..., 0:2].copy().view(np.float16).astype(np.float64))
        m = np.abs(blocks[..., 2:4].copy().view(np.float16).astype(np.float64))
        scale = np.broadcast_to(d * 15 + m, (*d.shape[:2], 32)).reshape(ref.shape)
    else:
        scale = np.abs(ref)
    assert np.all(np.abs(got.numpy().astype(np.float64) - ref) <= 1.2e-7 * scale), f"type {t}"


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows,cols", [(1, 32), (7, 96), (33, 160), (257, 4128)])
def test_qdequant_and_qembed(ops, name, rows, cols):
    t = TYPES[name]
    rng = np.random.default_rng(rows * 7 + cols + t)
    raw = encode(rng, rows, cols, t)
    w = place(raw, 1 + (rows + t) % 63)
    assert_values_exact(ops.qdequant(w, t), raw, t)
    ids = torch.tensor([[rows - 1, 0, rows // 2], [0, 0, rows - 1]])
    got = ops.qembed(w, t, ids)
    assert got.shape == (2, 3, cols)
    assert_values_exact(got.view(6, cols), raw[ids.view(-1).numpy()], t)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.qembed(w, t, torch.tensor([rows]))


def test_float_dtypes_are_accepted(ops):
    """F32 / F16 / BF16 weights may come as float tensors instead of bytes; a mismatched dtype is an error."""
    w = torch.randn(5, 64)
    for t, v in ((F32, w), (F16, w.half()), (BF16, w.bfloat16())):
        torch.testing.assert_close(ops.qdequant(v, t), v.float(), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="uint8 bytes"):
        ops.qdequant(w.half(), F32)


def test_bad_weights_are_clear_errors(ops):
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="unsupported weight type"):
        ops.qmatmul(x, [torch.zeros(4, 36, dtype=torch.uint8)], [9])  # Q8_1: ggml's, not a weight type
    with pytest.raises(RuntimeError, match="expected 64"):
        ops.qmatmul(x, [torch.zeros(4, 18, dtype=torch.uint8)], [Q4_0])
    with pytest.raises(RuntimeError, match="not a whole number"):
        ops.qmatmul(x, [torch.zeros(4, 37, dtype=torch.uint8)], [Q4_0])


# --- qmatmul ----------------------------------------------------------------------------------------------------------

MATMUL_CASES = [(1, 32, 1), (7, 96, 2), (33, 160, 5), (257, 4128, 1), (7, 4128, 17), (33, 4128, 24), (257, 96, 100),
                (33, 160, 512), (1, 4128, 512)]


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows,cols,T", MATMUL_CASES)
def test_qmatmul(ops, name, rows, cols, T):
    """Both regimes on every shape: the streaming tiles (forced with gemm_min_t huge: q8 activations for block
    types) and the dequantised-tile GEMM (gemm_min_t=1: exact fp32), and the default choice between them."""
    t = TYPES[name]
    rng = np.random.default_rng(rows * 1000 + cols + T + t)
    raw = encode(rng, rows, cols, t)
    w, wref = place(raw, 1 + (cols + t) % 63), decode(raw, t)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    xt = torch.from_numpy(x)
    block = t in BLOCK_BYTES
    streaming, gemm = ops.qmatmul(xt, [w], [t], 1 << 30), ops.qmatmul(xt, [w], [t], 1)
    assert_dot_close(streaming, wref, x, t, block, "streaming")
    assert_dot_close(gemm, wref, x, t, False, "gemm")
    default = ops.qmatmul(xt, [w], [t])
    assert torch.equal(default, streaming if T < ops.gemm_min_t() else gemm)


@pytest.mark.parametrize("name", [n for n, t in TYPES.items() if t in BLOCK_BYTES])
@pytest.mark.parametrize("rows,cols", [(7, 96), (40, 160), (33, 4128)])
def test_qmatmul_tokens_get_their_bits_alone(ops, name, rows, cols):
    """A token's sums through the streaming tiles are the same bits whatever tokens share its call: one token, a
    few (the rows streamed per tile of 4), or 8 and more (a row group's lane registers packed once, dot.cpp
    packed_group); 16-row groups, the 8-row tail and padded last rows alike."""
    t = TYPES[name]
    rng = np.random.default_rng(rows + cols + t)
    raw = encode(rng, rows, cols, t)
    w = place(raw, 1 + cols % 63)
    xt = torch.from_numpy(rng.standard_normal((64, cols)).astype(np.float32))
    alone = torch.cat([ops.qmatmul(xt[i:i + 1], [w], [t], 1 << 30) for i in range(64)])
    for T in (2, 4, 5, 8, 13, 64):
        assert torch.equal(ops.qmatmul(xt[:T], [w], [t], 1 << 30), alone[:T]), T


# --- K-quants: Q4_K and Q6_K read in place by dot products (runtime/cpu/csrc/kquant.cpp) ----------------------------

Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS = 6, 7, 12, 13, 14, 20, 23
KQUANTS = {"Q5_0": Q5_0, "Q5_1": Q5_1, "Q4_K": Q4_K, "Q5_K": Q5_K, "Q6_K": Q6_K, "IQ4_NL": IQ4_NL,
           "IQ4_XS": IQ4_XS}  # the types read by dot products only


def encode_kquant(rng: np.random.Generator, rows: int, cols: int, t: int) -> np.ndarray:
    """Random Q4_K, Q5_K, Q6_K, IQ4_NL or IQ4_XS rows, uint8 [rows, cols / values per unit * unit bytes]: every bit
    pattern of the quants and the sub-block scales (and Q4_K's / Q5_K's mins), and half float scales of both signs."""
    if t in (Q5_0, Q5_1):  # d (and Q5_1's m), then qh and the nibbles
        raw = rng.integers(0, 256, (rows, cols // 32, 22 if t == Q5_0 else 24), dtype=np.uint8)
        n = 1 if t == Q5_0 else 2
        raw[..., 0:2 * n] = (rng.standard_normal((rows, cols // 32, n)) * 2e-3).astype(np.float16).view(np.uint8)
    elif t == IQ4_NL:
        raw = rng.integers(0, 256, (rows, cols // 32, 18), dtype=np.uint8)
        raw[..., 0:2] = (rng.standard_normal((rows, cols // 32, 1)) * 2e-3).astype(np.float16).view(np.uint8)
    elif t == IQ4_XS:
        raw = rng.integers(0, 256, (rows, cols // 256, 136), dtype=np.uint8)
        raw[..., 0:2] = (rng.standard_normal((rows, cols // 256, 1)) * 2e-3).astype(np.float16).view(np.uint8)
    elif t == Q6_K:
        raw = rng.integers(0, 256, (rows, cols // 256, 210), dtype=np.uint8)
        raw[..., 208:] = (rng.standard_normal((rows, cols // 256, 1)) * 2e-3).astype(np.float16).view(np.uint8)
    else:
        raw = rng.integers(0, 256, (rows, cols // 256, 176 if t == Q5_K else 144), dtype=np.uint8)
        raw[..., 0:4] = (rng.standard_normal((rows, cols // 256, 2)) * 2e-3).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("name", KQUANTS)
@pytest.mark.parametrize("rows,cols,T", [(1, 256, 1), (7, 512, 2), (33, 768, 5), (257, 2048, 1), (9, 4096, 17),
                                         (33, 256, 100)])
def test_kquant_dot_products(ops, name, rows, cols, T):
    """K-quant rows against the values gguf decodes them to: qdequant exactly; the dot products of the streaming path
    exact for the q8 activations they use (and within the q8 bound of fp32), the GEMM path's exact in fp32."""
    t = KQUANTS[name]
    rng = np.random.default_rng(rows * 7 + cols + T + t)
    raw = encode_kquant(rng, rows, cols, t)
    wref = quants.dequantize(raw, GT(t)).reshape(rows, cols)
    w = place(raw, 1 + cols % 61)
    assert np.array_equal(ops.qdequant(w, t).numpy(), wref)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    xt = torch.from_numpy(x)
    streaming, gemm = ops.qmatmul(xt, [w], [t], 1 << 30), ops.qmatmul(xt, [w], [t], 1)
    assert_dot_close(streaming, wref.astype(np.float64), x, t, True, "streaming")
    assert_dot_close(gemm, wref.astype(np.float64), x, t, False, "gemm")
    assert torch.equal(ops.qmatmul(xt, [w], [t]), streaming if T < ops.gemm_min_t() else gemm)
    ids = torch.tensor([rows - 1, 0, rows // 2])
    assert np.array_equal(ops.qembed(w, t, ids).numpy(), wref[ids.numpy()])


@pytest.mark.parametrize("name", KQUANTS)
def test_kquant_row_bits_are_the_same_alone_in_a_batch_and_in_every_build(kernel_builds, name):
    """A K-quant row's sum for a token is the same bits whatever tokens share the call and whichever rows sit beside
    it (a fused matrix of mixed types), and in every build: AVX-512, AVX2 without VNNI, the portable loop."""
    t = KQUANTS[name]
    rng = np.random.default_rng(5)
    rows, cols = 45, 1024
    raw = encode_kquant(rng, rows, cols, t)
    w = place(raw, 3)
    q4 = place(encode(rng, 11, cols, Q4_0), 5)
    xt = torch.from_numpy(rng.standard_normal((13, cols)).astype(np.float32))
    got = {}
    for build, ops in kernel_builds.items():
        alone = torch.cat([ops.qmatmul(xt[i:i + 1], [w], [t], 1 << 30) for i in range(13)])
        for T in (2, 4, 5, 13):
            assert torch.equal(ops.qmatmul(xt[:T], [w], [t], 1 << 30), alone[:T]), (build, T)
        fused = ops.qmatmul(xt[:6], [q4, w], [Q4_0, t], 1 << 30)
        assert torch.equal(fused[:, 11:], alone[:6]), build
        got[build] = alone
    first = next(iter(got.values()))
    for build, alone in got.items():
        assert torch.equal(alone, first), build


# the types whose quants are unsigned levels (quant.h dot_levels): block bytes, values per block, the offsets of their
# f16 scales
UNSIGNED_LEVELS = {"Q4_0": (Q4_0, 18, 32, (0,)), "Q4_1": (Q4_1, 20, 32, (0, 2)), "Q5_0": (Q5_0, 22, 32, (0,)),
                   "Q5_1": (Q5_1, 24, 32, (0, 2)), "Q4_K": (Q4_K, 144, 256, (0, 2)), "Q5_K": (Q5_K, 176, 256, (0, 2)),
                   "Q6_K": (Q6_K, 210, 256, (208,))}


@pytest.mark.parametrize("name", UNSIGNED_LEVELS)
def test_largest_levels_against_largest_activations(ops, name):
    """Every quant at its top level (all bits set: 15, 31 for the 5-bit types, 63 for Q6_K; the K-quants' largest
    sub-block scales) against activations at the int8 extreme of either sign, 1 to 17 tokens: the AVX2 tiles without
    VNNI add products in 16 bits, and a sum that wrapped there would be far off."""
    t, size, values, scales = UNSIGNED_LEVELS[name]
    rows, cols = 19, 512
    raw = np.full((rows, cols // values, size), 0xFF, np.uint8)
    for at in scales:
        raw[..., at:at + 2] = np.full((rows, cols // values, 1), 1e-3, np.float16).view(np.uint8)
    raw = raw.reshape(rows, -1)
    wref = quants.dequantize(raw, GT(t)).reshape(rows, cols).astype(np.float64)
    w = place(raw, 7)
    for T in (1, 2, 4, 17):
        x = np.where(np.arange(T)[:, None] % 2 == 0, 1.0, -1.0) * np.ones((1, cols))
        x = x.astype(np.float32)
        assert_dot_close(ops.qmatmul(torch.from_numpy(x), [w], [t], 1 << 30), wref, x, t, True, f"{name} T={T}")


@pytest.mark.parametrize("name", KQUANTS)
def test_kquant_rows_are_refused_as_neuron_rows(ops, name):
    """axpy (ffn_down_t, a transposed predictor fc2) has no K-quant path: an op given such rows says so instead of
    computing nothing."""
    t = KQUANTS[name]
    rng = np.random.default_rng(3)
    d, n_ff = 256, 64
    up = torch.from_numpy(encode(rng, n_ff, d, Q8_0))
    down_t = torch.from_numpy(encode_kquant(rng, n_ff, d, t))
    x = torch.from_numpy(rng.standard_normal((1, d)).astype(np.float32))
    with pytest.raises(RuntimeError, match=f"{name} rows are read by dot products only"):
        ops.qffn_sparse(x, None, 0, up, Q8_0, down_t, t, None, None, 3, None, 0.0)


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("rows,cols,T", [(1, 1, 1), (7, 7, 2), (33, 33, 5), (257, 4100, 1), (7, 100, 17),
                                         (33, 4100, 24), (9, 37, 100)])
def test_qmatmul_float_types_any_width(ops, name, rows, cols, T):
    """Float types take any row length: the tails after the last full vector (cols % 16 != 0) in both regimes."""
    t = TYPES[name]
    rng = np.random.default_rng(rows + cols + T + t)
    raw = encode(rng, rows, cols, t)
    w, wref = place(raw, 1 + cols % 63), decode(raw, t)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    for gemm_min_t in (1 << 30, 1):
        assert_dot_close(ops.qmatmul(torch.from_numpy(x), [w], [t], gemm_min_t), wref, x, t, False)


@pytest.mark.parametrize("T", [1, 5, 100])
def test_qmatmul_fuses_matrices_of_mixed_types(ops, T):
    """Q, K and V stored as three tensors (here of three types) are one call; outputs side by side."""
    rng = np.random.default_rng(T)
    mats = [(Q4_0, 7), (F16, 33), (Q8_0, 1), (Q4_1, 9)]
    raws = [encode(rng, r, 160, t) for t, r in mats]
    x = rng.standard_normal((T, 160)).astype(np.float32)
    got = ops.qmatmul(torch.from_numpy(x), [place(r, 5 + i) for i, r in enumerate(raws)], [t for t, _ in mats])
    assert got.shape == (T, sum(r for _, r in mats))
    col = 0
    streaming = T < ops.gemm_min_t()  # the default regime
    for (t, r), raw in zip(mats, raws, strict=True):
        assert_dot_close(got[:, col:col + r], decode(raw, t), x, t, t in BLOCK_BYTES and streaming)
        col += r


def test_qmatmul_threads(ops):
    """Rows split across threads: same result on 1 and 2 threads (each output is one thread's dot product)."""
    rng = np.random.default_rng(3)
    raw = encode(rng, 300, 4128, Q4_0)
    w = place(raw, 3)
    x = torch.from_numpy(rng.standard_normal((3, 4128)).astype(np.float32))
    torch.set_num_threads(1)
    try:
        one = ops.qmatmul(x, [w], [Q4_0])
    finally:
        torch.set_num_threads(2)
    torch.testing.assert_close(ops.qmatmul(x, [w], [Q4_0]), one, rtol=0, atol=0)


# --- qffn_sparse ------------------------------------------------------------------------------------------------------

def silu(g):
    return g / (1 + np.exp(-g))


def ffn_reference(x, g, u, dn, idx, act, mask=None, bias=None, cats=0.0, g_q8=False, u_q8=False) -> dict:
    """float64 FFN over neurons idx as the kernel defines it (q8 x for block-type gate/up rows): y [T, d], the number
    of nonzero (token, neuron) activations, the pre-activations, and `tol`, a per-output bound on the kernel's fp32
    error (its dot products err by RTOL of sum |w x|, which moves each activation by at most its magnitude terms)."""
    xg = q8(x)[0] if g_q8 else x.astype(np.float64)
    xu = q8(x)[0] if u_q8 else x.astype(np.float64)
    b = 0 if bias is None else bias[idx].astype(np.float64)
    uu = xu @ u[idx].T + b
    mag_u = np.abs(uu) + np.abs(xu) @ np.abs(u[idx]).T + np.abs(b)
    gg = xg @ g[idx].T if g is not None else None
    if act == 0:
        s = silu(gg)
        h = np.where(np.abs(s) <= cats, 0.0, s * uu) if cats > 0 else s * uu
    elif act == 1:
        h = np.maximum(gg, 0) * uu
    elif act == 2:
        h = np.maximum(gg, 0) * np.maximum(uu, 0)
    elif act == 3:
        h = np.maximum(uu, 0)
    else:
        h = 0.5 * uu * torch.special.erfc(torch.from_numpy(-uu / np.sqrt(2))).numpy()
    mag = mag_u if g is None else mag_u * (np.abs(gg) + np.abs(xg) @ np.abs(g[idx]).T)
    if mask is not None:
        h, mag = h * mask, mag * mask
    tol = 5 * RTOL * mag @ np.abs(dn[idx]) + 1e-30
    near = (np.abs(uu) < 1e-5 * np.abs(uu).max(initial=1)) if act in (2, 3, 4) else np.zeros(uu.shape, bool)
    near |= (act == 4) & (np.abs(h) < 1e-30)  # GELU of u < -13 underflows fp32 to 0 (or a subnormal)
    if gg is not None:
        near |= np.abs(gg) < 1e-5 * np.abs(gg).max(initial=1)
    return {"y": h @ dn[idx], "nonzero": int((h != 0).sum()), "g": gg, "u": uu, "tol": tol,
            "near": int(near.sum())}


# Scenarios per (type, act): T, which neurons, row mask, up bias (T = 1, 2, 5, 17, 24; idx empty/one/all/unsorted).
SCENARIOS = [(1, "all", False, False), (2, "subset", True, False), (5, "one", False, True), (17, "none", False, False),
             (24, "subset", True, True), (1, "empty", False, False), (5, "perm", True, False)]


def pick(kind: str, n_ff: int, rng) -> np.ndarray | None:
    return {"none": None, "empty": np.zeros(0, np.int64), "one": np.array([n_ff // 2]),
            "all": np.arange(n_ff), "perm": rng.permutation(n_ff),
            "subset": rng.permutation(n_ff)[: max(1, n_ff // 3)]}[kind]


@pytest.mark.parametrize("act", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("name", TYPES)
def test_qffn_sparse(ops, name, act):
    t = TYPES[name]
    for n_ff, d in ((33, 96), (7, 160), (257, 4128)) + (((9, 37),) if t not in BLOCK_BYTES else ()):
        rng = np.random.default_rng(n_ff + d + t + act)
        raws = [encode(rng, n_ff, d, t, 0.3) for _ in range(3)]
        g, u, dn = (decode(r, t) for r in raws)
        gate = place(raws[0], 7) if act <= 2 else None
        up, down = place(raws[1], 11), place(raws[2], 13)
        for T, kind, masked, biased in SCENARIOS if d < 4096 else SCENARIOS[:2]:
            x = rng.standard_normal((T, d)).astype(np.float32)
            idx = pick(kind, n_ff, rng)
            sel = np.arange(n_ff) if idx is None else idx
            mask = rng.random((T, sel.size)) < 0.7 if masked else None
            bias = rng.standard_normal(n_ff).astype(np.float32) * 0.3 if biased else None
            cats = 0.0
            if act == 0 and masked:  # CATS: a threshold in a wide gap between two |silu(g)| values
                s = np.sort(np.abs(silu(q8(x)[0] @ g.T if t in BLOCK_BYTES else x @ g.T)).ravel())
                i = int(np.argmax(np.diff(s[s.size // 4: 3 * s.size // 4]))) + s.size // 4
                cats = float((s[i] + s[i + 1]) / 2)
            ref = ffn_reference(x, g if act <= 2 else None, u, dn, sel, act, mask, bias, cats, t in BLOCK_BYTES,
                                t in BLOCK_BYTES)
            y, count = ops.qffn_sparse(
                torch.from_numpy(x), gate, t, up, t, down, t, None if idx is None else torch.from_numpy(idx),
                None if mask is None else torch.from_numpy(mask), act,
                None if bias is None else torch.from_numpy(bias), cats)
            err = np.abs(y.numpy() - ref["y"])
            assert np.all(err <= ref["tol"]), f"n_ff {n_ff} d {d} T {T} {kind}: {np.max(err / ref['tol']):.3g}"
            assert abs(count - ref["nonzero"]) <= ref["near"], (count, ref["nonzero"])


@pytest.mark.parametrize("types", [(F16, Q4_0, Q8_0), (Q4_1, BF16, F32), (Q8_0, F32, Q4_1)])
def test_qffn_sparse_mixed_types(ops, types):
    """gate, up and down of three different types in one layer."""
    tg, tu, td = types
    rng = np.random.default_rng(sum(types))
    n_ff, d, T = 40, 160, 3
    raws = [encode(rng, n_ff, d, t, 0.3) for t in types]
    g, u, dn = (decode(r, t) for r, t in zip(raws, types, strict=True))
    x = rng.standard_normal((T, d)).astype(np.float32)
    idx = rng.permutation(n_ff)[:25]
    ref = ffn_reference(x, g, u, dn, idx, 1, g_q8=tg in BLOCK_BYTES, u_q8=tu in BLOCK_BYTES)
    y, count = ops.qffn_sparse(torch.from_numpy(x), place(raws[0], 3), tg, place(raws[1], 5), tu, place(raws[2], 9),
                               td, torch.from_numpy(idx), None, 1, None, 0.0)
    assert np.all(np.abs(y.numpy() - ref["y"]) <= ref["tol"])
    assert abs(count - ref["nonzero"]) <= ref["near"]


@pytest.mark.parametrize("act", [0, 1, 2, 3])
@pytest.mark.parametrize("name", TYPES)
def test_qffn_sparse_rows_are_the_bits_they_get_alone(ops, name, act):
    """Batch invariance (sparse_ffn.cpp): T rows over the union of their neurons, each masked to its own, give each
    row the bits the one-row call over its own neurons gives it; likewise every neuron (exact masks). On 2 threads,
    which split the neurons between them; for several row counts, unions and a neuron count not a multiple of 8."""
    t = TYPES[name]
    rng = np.random.default_rng(100 * t + act)
    n_ff, d = 301, 256
    raws = [encode(rng, n_ff, d, t, 0.3) for _ in range(3)]
    gate = place(raws[0], 7) if act <= 2 else None
    up, down = place(raws[1], 11), place(raws[2], 13)
    bias = torch.from_numpy(rng.standard_normal(n_ff).astype(np.float32) * 0.3) if act == 3 else None
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for T, share in ((2, 0.1), (3, 0.4), (8, 0.12), (17, 0.03)):
            x = torch.from_numpy(rng.standard_normal((T, d)).astype(np.float32))
            own = [np.flatnonzero(rng.random(n_ff) < share) for _ in range(T)]
            union = np.unique(np.concatenate(own))
            mask = torch.from_numpy(np.stack([np.isin(union, o) for o in own]))
            y, count = ops.qffn_sparse(x, gate, t, up, t, down, t, torch.from_numpy(union), mask, act, bias, 0.0)
            ye, count_e = ops.qffn_sparse(x, gate, t, up, t, down, t, None, None, act, bias, 0.0)
            alone = 0
            for r in range(T):
                yr, c = ops.qffn_sparse(x[r:r + 1].clone(), gate, t, up, t, down, t, torch.from_numpy(own[r]), None,
                                        act, bias, 0.0)
                alone += c
                assert torch.equal(y[r], yr[0]), f"T {T} row {r}: {(y[r] - yr[0]).abs().max():.3g}"
                yr, c = ops.qffn_sparse(x[r:r + 1].clone(), gate, t, up, t, down, t, None, None, act, bias, 0.0)
                assert torch.equal(ye[r], yr[0]), f"T {T} row {r}, every neuron: {(ye[r] - yr[0]).abs().max():.3g}"
            assert count == alone
    finally:
        torch.set_num_threads(threads)


def guarded_rows(raw: np.ndarray, readable: np.ndarray) -> tuple[torch.Tensor, mmap.mmap]:
    """raw's rows one per page of an anonymous mapping; the pages of rows not `readable` are PROT_NONE, so touching
    them kills the process: the proof that a kernel never reads them."""
    page = mmap.PAGESIZE
    rows, rb = raw.shape
    assert rb <= page - 64
    mem = mmap.mmap(-1, rows * page)
    buf = np.frombuffer(mem, np.uint8).reshape(rows, page)
    buf[:, 17:17 + rb] = raw  # an odd offset inside each page
    libc = ctypes.CDLL(None, use_errno=True)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    for r in np.flatnonzero(~readable):
        assert libc.mprotect(ctypes.c_void_p(base + int(r) * page), ctypes.c_size_t(page), 0) == 0
    t = torch.frombuffer(mem, dtype=torch.uint8).as_strided((rows, rb), (page, 1), 17)
    return t, mem


def dead_rows_check(build: str) -> None:
    """Gate-first, for ReLU, dReLU, CATS-SwiGLU (the gate row decides) and gate-less ReLU (the up row decides): the
    other rows of a neuron whose activation is 0 for every token, or that every token masks out, are never read: their
    pages are unreadable here, so a read kills the process (run in a subprocess by the test below)."""
    if build == "runtime":
        assert cpu_kernels.available(), cpu_kernels.status()
        ops = torch.ops.pinfer
    else:
        ops = cpu_kernels.load_variants([build])[build]
    for act in (1, 2, 3, 0):
        rng = np.random.default_rng(act)
        n_ff, d, T, t = 64, 256, 3, Q4_0
        raws = [encode(rng, n_ff, d, t, 0.3) for _ in range(3)]
        g, u, dn = (decode(r, t) for r in raws)
        x = rng.standard_normal((T, d)).astype(np.float32)
        mask = np.ones((T, n_ff), bool)
        mask[:, 5] = False  # neuron 5: masked out for every token
        first = q8(x)[0] @ (g if act != 3 else u).T  # the deciding pre-activations [T, n_ff]
        cats = float(np.quantile(np.abs(silu(first)), 0.6)) if act == 0 else 0.0
        dead = np.all(np.abs(silu(first)) < cats * 0.999, axis=0) if act == 0 else np.all(first < -1e-3, axis=0)
        dead |= ~mask.any(0)
        assert 5 < dead.sum() < n_ff - 5
        gate = place(raws[0], 1) if act != 3 else None
        up, keep_up = (place(raws[1], 1), None) if act == 3 else guarded_rows(raws[1], ~dead)
        down, keep_down = guarded_rows(raws[2], ~dead)
        y, count = ops.qffn_sparse(torch.from_numpy(x), gate, t, up, t, down, t, None, torch.from_numpy(mask), act,
                                   None, cats)
        ref = ffn_reference(x, g if act != 3 else None, u, dn, np.arange(n_ff), act, mask, None, cats, True, True)
        assert np.all(np.abs(y.numpy() - ref["y"]) <= ref["tol"]), act
        assert abs(count - ref["nonzero"]) <= ref["near"], act
        del keep_up, keep_down
    print("ok")


@pytest.mark.parametrize("build", BUILDS)
def test_qffn_sparse_never_reads_dead_rows(kernel_builds, build):
    if build not in kernel_builds:
        pytest.skip(f"-march={build} cannot run on this CPU")
    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('tq', sys.argv[1]); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); m.dead_rows_check(sys.argv[2])")
    res = subprocess.run([sys.executable, "-c", code, __file__, build], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert res.returncode == 0 and res.stdout.strip() == "ok", (
        f"exit {res.returncode} (-11: a read of a dead neuron's row): {res.stderr[-2000:]}")


def test_qffn_sparse_rejects_bad_arguments(ops):
    w = torch.zeros(8, 18, dtype=torch.uint8)
    x = torch.randn(1, 32)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.qffn_sparse(x, w, Q4_0, w, Q4_0, w, Q4_0, torch.tensor([0, 8]), None, 1, None, 0.0)
    with pytest.raises(RuntimeError, match="gate-less"):
        ops.qffn_sparse(x, w, Q4_0, w, Q4_0, w, Q4_0, None, None, 3, None, 0.0)
    with pytest.raises(RuntimeError, match="need a gate"):
        ops.qffn_sparse(x, None, 0, w, Q4_0, w, Q4_0, None, None, 1, None, 0.0)


# --- qpredict_active --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("name", ["F16", "F32", "BF16"])
@pytest.mark.parametrize("r,d,n_ff", [(16, 96, 33), (64, 4128, 257), (7, 32, 1), (40, 160, 700)])
def test_qpredict_active(ops, name, transposed, r, d, n_ff):
    t = TYPES[name]
    rng = np.random.default_rng(r + d + n_ff + t)
    raw1, raw2 = encode(rng, r, d, t, 0.2), encode(rng, n_ff, r, t, 0.5)
    w1, w2 = decode(raw1, t), decode(raw2, t)
    fc2 = place(np.ascontiguousarray(raw2.view(np.uint16 if t != F32 else np.float32).T).view(np.uint8), 3) \
        if transposed else place(raw2, 3)
    always = np.array([0, n_ff - 1]) if n_ff > 1 else None
    for _ in range(3):
        x = rng.standard_normal(d).astype(np.float32)
        hidden = np.maximum(w1 @ x.astype(np.float64), 0)
        scores = w2 @ hidden
        thr = float(np.median(scores))
        got = ops.qpredict_active(torch.from_numpy(x), place(raw1, 5), t, fc2, t, thr,
                                  None if always is None else torch.from_numpy(always), transposed).numpy()
        assert np.all(got[1:] > got[:-1])  # ascending, no duplicates
        want = scores >= thr
        if always is not None:
            want[always] = True
        near = np.abs(scores - thr) <= 1e-4 * (np.abs(w2) @ hidden + 1e-30)
        got_mask = np.zeros(n_ff, bool)
        got_mask[got] = True
        assert np.array_equal(got_mask[~near], want[~near])
        if always is not None:
            assert got_mask[always].all()


# --- legacy fp32 ops, norms, attention --------------------------------------------------------------------------------

def test_legacy_ffn_sparse_rows_and_predict_active(ops):
    """The fp32 ops the runtime uses today, on every build (test_sparse_ops covers them in depth on the runtime's)."""
    gen = torch.Generator().manual_seed(0)
    n_ff, d = 50, 96
    gu, dt = torch.randn(n_ff, 2, d, generator=gen), torch.randn(n_ff, d, generator=gen)
    x = torch.randn(3, d, generator=gen)
    idx = torch.tensor([7, 3, 40, 0, 49])
    for act in (0, 1, 2):
        y, _ = ops.ffn_sparse_rows(x, gu, dt, idx, None, act)
        a = x @ gu[idx, 0].T
        b = x @ gu[idx, 1].T
        h = F.silu(a) * b if act == 0 else F.relu(a) * b if act == 1 else F.relu(a) * F.relu(b)
        torch.testing.assert_close(y, h @ dt[idx], rtol=1e-4, atol=1e-4)
    fc1, fc2 = torch.randn(16, d, generator=gen), torch.randn(n_ff, 16, generator=gen)
    s = torch.relu(x[:1] @ fc1.T) @ fc2.T
    got = ops.predict_active(x[:1], fc1, fc2.T.contiguous(), 0.3, None)
    near = (s[0] - 0.3).abs() < 1e-4
    want = (s[0] >= 0.3)
    mask = torch.zeros(n_ff, dtype=torch.bool)
    mask[got] = True
    assert torch.equal(mask[~near], want[~near])


@pytest.mark.parametrize("T,d", [(1, 4128), (3, 7), (70, 96)])
def test_norms(ops, T, d):
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(T, d, generator=gen) * 3 + 5  # a large mean: LayerNorm must centre before squaring
    w, b = torch.randn(d, generator=gen), torch.randn(d, generator=gen)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), F.rms_norm(x, (d,), w, 1e-6), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.layer_norm(x, w, b, 1e-5), F.layer_norm(x, (d,), w, b, 1e-5), rtol=1e-4,
                               atol=1e-4)
    torch.testing.assert_close(ops.layer_norm(x, w, None, 1e-5), F.layer_norm(x, (d,), w, None, 1e-5), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("H,Hkv,pos,D", [(4, 4, 0, 32), (8, 2, 37, 40), (6, 1, 299, 64)])
def test_attend_decode(ops, dtype, neox, H, Hkv, pos, D):
    """RoPE (adjacent or NeoX pairs) + cache write + attention against float64, for float32 and float16 caches."""
    gen = torch.Generator().manual_seed(pos * 7 + H + neox)
    ctx = 320
    k_cache = (torch.randn(Hkv, ctx, D, generator=gen) * 3).to(dtype)
    v_cache = torch.randn(Hkv, ctx, D, generator=gen).to(dtype)
    qkv = torch.randn(1, (H + 2 * Hkv) * D, generator=gen) * 3
    ang = torch.rand(D // 2, generator=gen) * 6
    rope = torch.stack([ang.cos(), ang.sin()], -1).contiguous()
    k_ref, v_ref = k_cache.double(), v_cache.double()
    out = ops.attend_decode(qkv, rope, k_cache, v_cache, pos, H, Hkv, 0.5, neox)

    def rot(v):
        v = v.double().view(-1, D)
        if neox:
            a, b = v[:, : D // 2], v[:, D // 2:]
        else:
            a, b = v.view(-1, D // 2, 2).unbind(-1)
        c, s = rope.double().unbind(-1)
        ra, rb = a * c - b * s, a * s + b * c
        return torch.cat([ra, rb], -1) if neox else torch.stack([ra, rb], -1).view(-1, D)

    q = rot(qkv[0, :H * D])
    k_ref[:, pos] = rot(qkv[0, H * D:(H + Hkv) * D]).to(dtype).double()  # stored in the cache's precision
    v_ref[:, pos] = qkv[0, (H + Hkv) * D:].view(Hkv, D).to(dtype).double()
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(k_cache[:, pos].double(), k_ref[:, pos], rtol=tol, atol=tol)
    torch.testing.assert_close(v_cache[:, pos].double(), v_ref[:, pos], rtol=0, atol=0)
    want = []
    for h in range(H):
        gk = h // (H // Hkv)
        p = torch.softmax(k_ref[gk, :pos + 1] @ q[h] * 0.5, -1)
        want.append(p @ v_ref[gk, :pos + 1])
    torch.testing.assert_close(out.double().view(H, D), torch.stack(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("H,Hkv,D,pos,T,neox", [(8, 2, 32, 0, 96, False), (6, 3, 40, 53, 70, True),
                                                  (4, 4, 64, 7, 3, False)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_attend_prompt_is_attend_decode_row_by_row(ops, dtype, H, Hkv, D, pos, T, neox, threads):
    """A prompt's rows in one call (the rows' heads shared out among the threads, the last rows first) give every
    row the bits of its own attend_decode at its position, and the same cache; the first two cases are large enough
    (>= 2^16 multiply-adds) to run on the threads."""
    gen = torch.Generator().manual_seed(T * 31 + pos + H)
    ctx = pos + T + 5
    k0 = (torch.randn(Hkv, ctx, D, generator=gen) * 3).to(dtype)
    v0 = torch.randn(Hkv, ctx, D, generator=gen).to(dtype)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=gen) * 3
    ang = torch.rand(ctx, D // 2, generator=gen) * 6
    rope = torch.stack([ang.cos(), ang.sin()], -1).contiguous()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kp, vp = k0.clone(), v0.clone()
        got = ops.attend_prompt(qkv, rope, kp, vp, pos, H, Hkv, 0.125, neox)
        kd, vd = k0.clone(), v0.clone()
        want = torch.cat([ops.attend_decode(qkv[t:t + 1], rope[pos + t], kd, vd, pos + t, H, Hkv, 0.125, neox)
                          for t in range(T)])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, want)
    assert torch.equal(kp, kd) and torch.equal(vp, vd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D,pos", [(64, 300), (128, 130), (64, 0)])
def test_attend_head_bits_do_not_depend_on_its_group(ops, dtype, D, pos):
    """A query head's output is the same bits whichever of its kv group's heads share its call: attend_prompt takes a
    kv group's heads together (the values summed in registers, attention.cpp values_reg, in passes of 4 vectors of
    values for up to 4 heads on AVX-512, 2 on AVX2), attend_decode one head at a time; and both agree with
    float64."""
    gen = torch.Generator().manual_seed(D + pos)
    ctx = pos + 8
    k0 = torch.randn(1, ctx, D, generator=gen).to(dtype)  # unscaled: softmax weights spread over every position
    v0 = torch.randn(1, ctx, D, generator=gen).to(dtype)
    q = torch.randn(6, D, generator=gen)
    kv = torch.randn(2, D, generator=gen)
    ang = torch.rand(ctx, D // 2, generator=gen) * 6
    rope = torch.stack([ang.cos(), ang.sin()], -1).contiguous()
    for H in range(1, 7):  # one kv group of H query heads
        qkv = torch.cat([q[:H].reshape(-1), kv.reshape(-1)])[None]
        together = ops.attend_prompt(qkv, rope, k0.clone(), v0.clone(), pos, H, 1, 0.125, False)
        alone = ops.attend_decode(qkv, rope[pos], k0.clone(), v0.clone(), pos, H, 1, 0.125, False)
        assert torch.equal(together, alone), H
    k, v = k0.double()[0], v0.double()[0]
    c, s_ = rope[pos].double().unbind(-1)
    a, b = kv[0].double().view(D // 2, 2).unbind(-1)
    k[pos] = torch.stack([a * c - b * s_, a * s_ + b * c], -1).view(D).to(dtype).double()
    v[pos] = kv[1].to(dtype).double()
    qa, qb = q.double().view(6, D // 2, 2).unbind(-1)
    qr = torch.stack([qa * c - qb * s_, qa * s_ + qb * c], -1).view(6, D)
    want = torch.softmax(qr @ k[:pos + 1].T * 0.125, -1) @ v[:pos + 1]
    torch.testing.assert_close(together.double().view(6, D), want, rtol=1e-4, atol=1e-4)


def test_half_cache_conversions_are_exact(ops):
    """Cache writes round to half exactly as torch does (nearest even, subnormals, overflow, inf, nan, -0), and
    reads convert back exactly: with one position the output is the stored value."""
    special = [0.0, -0.0, 1.0, -2.5, 65504.0, 65519.0, 65520.0, 1e6, -1e6, 6.1e-5, 6.0e-5, 5.96e-8, 2.98e-8, 2.99e-8,
               1e-9, 1.00048828125, 1.00146484375, 0.333333, float("inf"), float("-inf"), float("nan"), 3.14159,
               -1.0009765625, 2049.0, 2051.0, 4097.0, -7.6e-6]
    rng = np.random.default_rng(0)
    vals = np.concatenate([np.array(special, np.float32), (rng.standard_normal(101) * 10.0 ** rng.integers(
        -9, 6, 101)).astype(np.float32)])
    D = 128
    vals = np.resize(vals, D).astype(np.float32)
    qkv = torch.zeros(1, 3 * D)
    qkv[0, 2 * D:] = torch.from_numpy(vals)  # v = the values; q, k = 0
    rope = torch.tensor([[1.0, 0.0]] * (D // 2))
    kc, vc = torch.zeros(1, 4, D, dtype=torch.float16), torch.zeros(1, 4, D, dtype=torch.float16)
    out = ops.attend_decode(qkv, rope, kc, vc, 0, 1, 1, 1.0)
    want = torch.from_numpy(vals).half()
    assert torch.equal(vc[0, 0].view(torch.int16), want.view(torch.int16))  # bit for bit, nan and -0 included
    got, back = out[0], want.float()
    assert torch.equal(got.isnan(), back.isnan())
    assert torch.equal(got[~back.isnan()], back[~back.isnan()])


def test_ffn_act(ops):
    """The C++ FFNs' activation (step.cpp ffn_act_rows): SwiGLU's vector silu against float64 over the range a gate
    takes and beyond, each value's bits the same at any position of a row of any length (a last partial vector is
    padded), and the other activations exactly torch's formulas."""
    gen = torch.Generator().manual_seed(5)
    g = torch.cat([torch.randn(997, generator=gen) * 4, torch.linspace(-120, 120, 1001),
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 87.5, -87.5])])
    u = torch.randn(g.shape, generator=gen)
    ref = (g.double() / (1 + torch.exp(-g.double())) * u.double())
    h = ops.ffn_act(g.view(1, -1), u.view(1, -1), 0)[0]
    # relative error of a few ulps where silu is representable; below e^-87 the value is ~0 and kept tiny
    torch.testing.assert_close(h.double(), ref, rtol=1e-6, atol=1e-30)
    # the same value alone, in rows of 3 and of 17, as a [n, 1] column: the same bits
    for w in (1, 3, 17):
        n = g.numel() // w * w
        assert torch.equal(ops.ffn_act(g[:n].view(-1, w), u[:n].view(-1, w), 0).view(-1), h[:n]), w
    bias = torch.randn(g.numel(), generator=gen)
    assert torch.equal(ops.ffn_act(g.view(1, -1), u.view(1, -1), 0, bias)[0],
                       ops.ffn_act(g.view(1, -1), (u + bias).view(1, -1), 0)[0])
    torch.testing.assert_close(ops.ffn_act(g, u, 1), torch.relu(g) * u, rtol=0, atol=0)
    torch.testing.assert_close(ops.ffn_act(g, u, 2), torch.relu(g) * torch.relu(u), rtol=0, atol=0)
    torch.testing.assert_close(ops.ffn_act(None, u, 3), torch.relu(u), rtol=0, atol=0)
    torch.testing.assert_close(ops.ffn_act(None, u, 4).double(), torch.nn.functional.gelu(u.double()), rtol=1e-6,
                               atol=1e-7)
    with pytest.raises(RuntimeError, match="a gate for acts"):
        ops.ffn_act(None, u, 0)


# --- the cache write of attention: RoPE and the half rounding --------------------------------------------------------

def fma32(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """float32 x * y + z with one rounding (to nearest, ties to even), elementwise, from exact rationals."""
    out = np.empty(len(x), np.float32)
    for i, (a, b, c) in enumerate(zip(x.tolist(), y.tolist(), z.tolist(), strict=True)):
        exact = Fraction(a) * Fraction(b) + Fraction(c)
        near = np.float32(float(exact))
        cands = [near, np.nextafter(near, np.float32(np.inf)), np.nextafter(near, np.float32(-np.inf))]
        out[i] = min(cands, key=lambda f: (abs(Fraction(float(f)) - exact), int(f.view(np.uint32)) & 1))
    return out


@pytest.mark.parametrize("kv", ["f32", "f16"])
@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("D", [64, 40, 24])
def test_cache_write_is_ropes_fused_formula_bit_for_bit(ops, kv, neox, D):
    """The key written at pos is (fma(a, c, -(b s)), fma(b, c, a s)) per rotary pair (a, b), the products b s and
    a s rounded to float32, then rounded to half (nearest even) for a half cache; the value is copied (or rounded)
    as is: in every build, in the vector path (head sizes whose pairs fill vectors) and the scalar one (the others)."""
    H, Hkv, pos, ctx = 2, 1, 3, 8
    rng = np.random.default_rng(D + 2 * neox)
    qkv = torch.from_numpy((rng.standard_normal((1, (H + 2 * Hkv) * D)) * 3).astype(np.float32))
    ang = rng.random(D // 2) * 6
    rope = torch.from_numpy(np.stack([np.cos(ang), np.sin(ang)], -1).astype(np.float32))
    dt = torch.float32 if kv == "f32" else torch.float16
    k_cache, v_cache = torch.zeros(Hkv, ctx, D, dtype=dt), torch.zeros(Hkv, ctx, D, dtype=dt)
    ops.attend_decode(qkv, rope, k_cache, v_cache, pos, H, Hkv, 0.5, neox)
    k = qkv[0, H * D:(H + 1) * D].numpy()
    half = D // 2
    a, b = (k[:half], k[half:]) if neox else (k[0::2], k[1::2])
    c, s = rope[:, 0].numpy(), rope[:, 1].numpy()
    lo, hi = fma32(a, c, -(b * s)), fma32(b, c, a * s)  # numpy float32 products: each rounded on its own
    want = np.empty(D, np.float32)
    if neox:
        want[:half], want[half:] = lo, hi
    else:
        want[0::2], want[1::2] = lo, hi
    want_v = qkv[0, (H + 1) * D:].numpy()
    if kv == "f16":
        want, want_v = want.astype(np.float16), want_v.astype(np.float16)
    assert np.array_equal(k_cache[0, pos].numpy().view(np.uint8), want.view(np.uint8))
    assert np.array_equal(v_cache[0, pos].numpy().view(np.uint8), want_v.view(np.uint8))
