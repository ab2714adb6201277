"""Every supported ggml type loads and runs: logits equal those of an F32 file holding the dequantised values.

Every type is read in place by the C++ kernels (float32 copies when the kernels are unavailable); the types only dot
products read (Q5_0, Q5_1, the K-quants, IQ4) are re-encoded where axpy or a GPU would read them. Both are checked at
decode size (one token at a time, the GEMV kernels) and at prefill size (many rows, the GEMM path).
"""

import os

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType as T

from pinfer_llm.formats.encoder import RawTensor
from pinfer_llm.formats.model_writer import write_llama
from pinfer_llm.formats.reader import open_gguf
from pinfer_llm.runtime import load_model
from pinfer_llm.runtime.cpu import qops
from pinfer_llm.runtime.loader import _matrices
from pinfer_llm.runtime.weights import KERNEL_TYPES, ROW_TYPES, SUPPORTED_TYPES, QWeight, as_q8_0, qweight
from tests.tiny import random_weights, tiny_config

QUANTIZABLE = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.BF16]  # gguf.quants can write these
# gguf.quants only reads these: (values, bytes) per block, the offsets of its f16 scales, and the scale d that gives
# random blocks values of ~0.05 like the other encodings' (larger ones make attention's scores saturate, so that the
# 8-bit activations' rounding moves a model of such matrices by up to 30% of its logits)
K_QUANTS = {T.Q4_K: (256, 144, (0, 2), 2e-4), T.Q5_K: (256, 176, (0, 2), 1e-4), T.Q6_K: (256, 210, (208,), 3e-4),
            T.IQ4_NL: (32, 18, (0,), 1e-3), T.IQ4_XS: (256, 136, (0,), 5e-5)}
KERNELS = os.environ.get("PINFER_CPU_KERNELS") != "0"


def random_k_blocks(qt: T, shape: tuple[int, int], rng) -> np.ndarray:
    """Random K-quant (or IQ4) rows with sane fp16 scales (their bits are random otherwise)."""
    rows, cols = shape
    values, size, scales, scale = K_QUANTS[qt]
    nb = cols // values
    blocks = rng.integers(0, 256, (rows, nb, size), dtype=np.uint8)
    d = np.full((rows, nb), scale, dtype=np.float16).view(np.uint8).reshape(rows, nb, 2)
    for o in scales:
        blocks[..., o:o + 2] = d
    if qt == T.Q6_K:  # int8 sub-block scales up to 20 either way (random bytes reach -128: a few wild sub-blocks)
        blocks[..., 192:208] = rng.integers(-20, 21, (rows, nb, 16)).astype(np.int8).view(np.uint8)
    return blocks.reshape(rows, nb * size)


def encode(qt: T, a: np.ndarray, rng) -> RawTensor:
    if qt == T.F32:
        return RawTensor(a.astype(np.float32), qt, a.shape)
    if qt == T.F16:
        return RawTensor(a.astype(np.float16), qt, a.shape)
    if qt in K_QUANTS:
        return RawTensor(random_k_blocks(qt, a.shape, rng), qt, a.shape)
    return RawTensor(quants.quantize(a, qt), qt, a.shape)


def twin(path, out, cfg):
    """The same model with every tensor dequantised to F32 (by gguf.quants, independently of the runtime)."""
    f = open_gguf(path)
    w = {}
    for name, t in f.tensors.items():
        qt = T(t.ggml_type)
        raw = f.raw(name)
        if qt in (T.F32, T.F16):
            a = np.asarray(raw, dtype=np.float32)
        elif qt == T.BF16:
            a = (np.asarray(raw).astype(np.uint32) << 16).view(np.float32)
        else:
            a = quants.dequantize(np.asarray(raw), qt)
        w[name] = a.reshape(t.shape).astype(np.float32)
    write_llama(out, cfg, w)


@pytest.fixture(scope="module", params=["row-types", "every-type"])
def model(request, tmp_path_factory):
    """A model whose matrices cycle through the types axpy and the GPU read too (ROW_TYPES), or through every
    supported type, and its dequantised F32 twin."""
    d = tmp_path_factory.mktemp("quant")
    cfg = tiny_config(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, vocab_size=320)
    w = random_weights(cfg, seed=11, scale=0.05)
    rng = np.random.default_rng(0)
    rows = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q8_0]
    types = rows if request.param == "row-types" else rows + [T.Q5_0, T.Q5_1, *K_QUANTS]
    mixed, i = {}, 0
    for name, a in w.items():
        if a.ndim == 2:
            mixed[name] = encode(types[i % len(types)], a, rng)
            i += 1
        else:
            mixed[name] = a
    write_llama(d / "mixed.gguf", cfg, mixed)
    twin(d / "mixed.gguf", d / "f32.gguf", cfg)
    used = {T(t.ggml_type) for t in open_gguf(d / "mixed.gguf").tensors.values()}
    return request.param, d / "mixed.gguf", d / "f32.gguf", used


def test_every_supported_type_is_exercised(model):
    kind, _, _, used = model
    assert (ROW_TYPES if kind == "row-types" else SUPPORTED_TYPES) <= used


def test_kernels_read_the_kernel_types_in_place(model):
    """The C++ kernels, not a float copy, serve every weight of a kernel type (and only those)."""
    kind, path, _, _ = model
    m = load_model(path)
    f = m.file
    for name, t in f.tensors.items():
        if len(t.shape) == 2:
            w = qweight(f, name)
            assert qops.kernels_for(w) == (KERNELS and w.qtype in KERNEL_TYPES), name
    notes = " ".join(m.notices)
    if KERNELS:
        assert all(w.in_kernel for w in _matrices(m.transformer))  # every matrix the layers use, a kernel reads
        assert "re-encoded" not in notes  # every type in place (Q5_*, K-quants, IQ4: runtime/cpu/csrc/kquant.cpp)
        assert "float32 copies" not in notes
    else:
        assert "float32 copies" in notes


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("qt", [T.Q5_0, T.Q5_1, *K_QUANTS])
def test_q8_0_re_encoding_is_ggmls(qt, kernel):
    """A type without a kernel becomes exactly the Q8_0 that gguf.quants makes of its dequantised values (Q5_0: the
    Q8_0 that holds its values exactly), by the C++ op (runtime/cpu/csrc/requant.cpp) and by the numpy path alike."""
    if kernel and not KERNELS:
        pytest.skip("the C++ kernels are not built here")
    rng = np.random.default_rng(int(qt))
    cols = 512 if qt in K_QUANTS and K_QUANTS[qt][0] == 256 else 544  # 32-value blocks: rows of 17 blocks too
    a = rng.standard_normal((40, cols)).astype(np.float32)
    raw = encode(qt, a, rng).data
    w = QWeight("w", qt, 40, cols, torch.from_numpy(np.ascontiguousarray(raw).reshape(40, -1)))
    q = as_q8_0(w, chunk_rows=16, kernel=kernel)  # chunks that do not divide the rows
    values = quants.dequantize(np.asarray(raw).reshape(40, -1), qt)
    assert q.qtype == T.Q8_0
    if qt == T.Q5_0:  # repacked: every value kept exactly
        assert np.array_equal(quants.dequantize(q.data.numpy(), T.Q8_0), values)
    else:
        want = quants.quantize(values, T.Q8_0)
        assert np.array_equal(q.data.numpy(), np.asarray(want).reshape(40, -1))


@pytest.mark.parametrize("n", [13, 40])  # 13 tokens: decode one at a time and a small batch; 40: the GEMM path
def test_logits_match_f32_twin(model, n):
    kind, path, f32, _ = model
    ids = list(range(3, 3 * n + 3, 3))
    a = load_model(path).forward_logits(ids)
    b = load_model(f32).forward_logits(ids)
    # the quantised kernels round activations to 8-bit blocks, as llama.cpp does: a small relative error
    tol = 0.03 if KERNELS else 1e-4
    assert np.abs(a - b).max() < tol * np.abs(b).max()
    # the same top token for most positions: random weights leave near-ties that 8-bit activations may flip (once 11
    # of 13 tokens with a smaller max error than another encoding's 12); the error bound above is the exact check
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.8


def test_decode_matches_prefill(model):
    """Token-by-token decode (T = 1: the GEMV kernels and the fused attention) equals the batched prefill."""
    _, path, _, _ = model
    m = load_model(path)
    ids = list(range(5, 50, 4))
    full = m.forward_logits(ids)
    tr = m.transformer
    import torch

    with torch.inference_mode():
        step = [tr.forward(torch.tensor([t]), p)[-1].numpy() for p, t in enumerate(ids)]
    step = np.stack(step)
    assert np.abs(step - full).max() < 0.03 * np.abs(full).max()


def test_planner_counts_what_the_runtime_holds(model):
    """pi-plan's byte accounting charges each matrix what pinfer's GPU holds: as stored for the types its kernels
    read, the re-encoding (runtime.weights.runnable, then rows_runnable) for the others; the planner's table of
    re-encoded types is the runtime's."""
    from pinfer_llm.planner.memory import RUN_AS, account, run_bytes
    from pinfer_llm.runtime.weights import ROW_TYPES, rows_runnable, runnable

    if not KERNELS:
        pytest.skip("the re-encodings are C++ ops (without the kernels the runtime holds float32 copies)")
    assert set(RUN_AS) == SUPPORTED_TYPES - ROW_TYPES
    kind, path, _, _ = model
    f = open_gguf(path)
    for name, t in f.tensors.items():
        if len(t.shape) == 2:
            held = rows_runnable(runnable(qweight(f, name)))
            assert held.qtype in ROW_TYPES and run_bytes(t) == held.data.numel(), name
    acct = account(f)
    stored = sum(t.nbytes for t in f.tensors.values() if t.name.startswith("blk."))
    counted = sum(lb.attn + lb.ffn + lb.pred for lb in acct.layers)
    # the GPU's copies (Q4_1, Q8_0) outweigh the types only dot products read, which they replace
    assert (counted > stored) == (kind == "every-type")


def q4k_as_q4_1_reference(raw: np.ndarray, cols: int) -> np.ndarray:
    """Q4_K rows [n, cols / 256 * 144] as Q4_1 rows, in numpy (the definition runtime/cpu/csrc/requant.cpp follows)."""
    n = raw.shape[0]
    b = raw.reshape(n, cols // 256, 144)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)[..., None]
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)[..., None]
    s = b[..., 4:16].astype(np.int32)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], -1)  # ggml's
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)  # get_scale_min_k4
    dh = (d * sc.astype(np.float32)).astype(np.float16)  # [n, nsb, 8]
    mh = (-(dmin * mn.astype(np.float32))).astype(np.float16)
    qs = b[..., 16:].reshape(n, cols // 256, 4, 32)
    vals = np.stack([qs & 0xF, qs >> 4], axis=3).reshape(n, cols // 256, 8, 32)  # sub-blocks 2p (low), 2p+1 (high)
    packed = (vals[..., :16] | (vals[..., 16:] << 4)).astype(np.uint8)
    out = np.concatenate([dh[..., None].view(np.uint8), mh[..., None].view(np.uint8), packed], -1)
    return out.reshape(n, cols // 32 * 20)


def test_q4_k_becomes_q4_1_exactly_as_defined():
    """Q4_K re-encodes as Q4_1 byte for byte as the numpy definition says, and its values are the Q4_K values up to
    the f16 rounding of each sub-block's scale and min (Q8_0 would round every value to 8 bits instead)."""
    if not KERNELS:
        pytest.skip("the C++ kernels are not built here")
    from pinfer_llm.runtime.weights import as_q4_1

    rng = np.random.default_rng(4)
    rows, cols = 37, 768
    raw = random_k_blocks(T.Q4_K, (rows, cols), rng)
    w = QWeight("w", T.Q4_K, rows, cols, torch.from_numpy(np.ascontiguousarray(raw).reshape(rows, -1)))
    q = as_q4_1(w)
    want = q4k_as_q4_1_reference(np.asarray(raw).reshape(rows, -1), cols)
    assert q.qtype == T.Q4_1 and np.array_equal(q.data.numpy(), want)
    exact = quants.dequantize(np.asarray(raw).reshape(rows, -1), T.Q4_K).reshape(rows, cols)
    got = quants.dequantize(q.data.numpy(), T.Q4_1).reshape(rows, cols)
    step = np.abs(exact).max()
    assert 0 < np.abs(got - exact).max() < 2.0 ** -10 * step  # rounded, and only in the scales' 11th bit
    q8 = quants.dequantize(as_q8_0(w).data.numpy(), T.Q8_0).reshape(rows, cols)
    assert np.abs(got - exact).mean() < np.abs(q8 - exact).mean() / 4
