"""The GPU kernels' results, without a GPU: CudaDevice runs the real .cu sources in the CPU emulation
(tests/cuda_emu: g++, fibers for threads, fake CuPy arrays with guard bytes) and is compared with ReferenceDevice
(torch, float64, weights dequantised from the file's encoding). Every kernel, every weight type, every act code,
edge shapes (rows and index counts not multiples of the warp or block, widths with and without whole 1024-value
tiles, T = 1 and T > 1 incl. more than one 8-token chunk), GQA/MQA, both RoPE orders, pos 0 and later.

Errors are measured against the scale of the summed terms (|x| @ |W|^T) or of the result, so a tolerance of 1e-5
means fp32 rounding, not luck.
"""

from __future__ import annotations

import dataclasses
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from cuda_emu import emu, fake_cupy

from pinfer_llm.runtime.gpu import ACT_CODES, CudaDevice, GPUUnavailable, ReferenceDevice
from pinfer_llm.runtime.gpu import layout as L
from pinfer_llm.runtime.gpu.sources import MODULES, source

TOL = 1e-5


@pytest.fixture(scope="session")
def dev() -> CudaDevice:
    with ThreadPoolExecutor(2) as pool:  # build the emulated modules on both cores
        list(pool.map(lambda m: emu.build(source(m)), MODULES))
    return CudaDevice(cupy=fake_cupy)


@pytest.fixture(scope="session")
def ref() -> ReferenceDevice:
    return ReferenceDevice()


def rel_err(got, want, scale) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    return float(np.max(np.abs(got - want) / scale, initial=0.0))


def on_both(dev, ref, fn):
    """fn(device) on the emulated GPU and on the reference, results as numpy."""
    a, b = fn(dev), fn(ref)
    conv = (lambda d, v: d.to_numpy(v))
    if isinstance(a, tuple):
        return tuple(conv(dev, v) for v in a), tuple(conv(ref, v) for v in b)
    return conv(dev, a), conv(ref, b)


# ------------------------------------------------------------------ layout and dequantisation

@pytest.mark.parametrize("ty", L.TYPES, ids=L.NAMES.get)
@pytest.mark.parametrize("cols", [32, 96, 1024, 1024 + 31 * 32, 2048 + 64])
def test_dequant_rows_is_exact(dev, ty, cols):
    """The device layout decoded by the kernels equals the file's values bit for bit (all rows, a gather, f16)."""
    rng = np.random.default_rng(cols)
    raw = L.random_rows(rng, ty, 7, cols)
    want = L.dequantize(raw, ty, cols)
    w = dev.upload_matrix(raw, ty, cols)
    assert w.data.shape == (7, L.device_stride(ty, cols)) and L.device_stride(ty, cols) % 16 == 0
    np.testing.assert_array_equal(dev.to_numpy(dev.dequant_rows(w)), want)
    idx = np.array([6, 0, 3, 3], np.int32)
    np.testing.assert_array_equal(dev.to_numpy(dev.dequant_rows(w, dev.asarray(idx))), want[idx])
    np.testing.assert_array_equal(dev.to_numpy(dev.dequant_rows(w, dev.asarray(idx), np.float16)),
                                  want[idx].astype(np.float16))


def test_layout_is_a_permutation_within_rows():
    """to_device only moves data within a row: the same multiset of nibbles (Q4 regroups nibbles into bytes, the
    others move whole bytes), plus zero padding."""
    rng = np.random.default_rng(0)

    def nibbles(b):
        return np.sort(np.concatenate([b & 15, b >> 4]))

    for ty in L.TYPES:
        raw = L.random_rows(rng, ty, 3, 2048 + 96)
        dv = L.to_device(raw, ty, 2048 + 96)
        pad = dv.shape[1] - raw.shape[1]
        assert (dv[:, raw.shape[1]:] == 0).all()
        for r in range(3):
            np.testing.assert_array_equal(nibbles(raw[r]), nibbles(dv[r])[2 * pad:])


@pytest.mark.parametrize("cols", [32, 96, 1024, 1056, 3104, 5120])
def test_layout_kernel_equals_its_definition(cols):
    """The C++ layout op (runtime/cpu/csrc/device_layout.cpp, what uploads use) equals layout.py's numpy definition byte
    for byte: every type, rows of whole tiles, tiles plus tail blocks, and tails alone; padding included."""
    from pinfer_llm.runtime.cpu import kernels as cpu_kernels

    assert L._layout_op() is not None, cpu_kernels.status()
    rng = np.random.default_rng(cols)
    for ty in L.TYPES:
        raw = L.random_rows(rng, ty, 9, cols)
        np.testing.assert_array_equal(L.to_device(raw, ty, cols), L.to_device_numpy(raw, ty, cols), err_msg=L.NAMES[ty])


def test_dequantize_known_blocks():
    """The file formats, by hand: Q4_0 nibble order and offset, Q4_1's min, Q8_0's signed bytes, BF16's bits."""
    d = np.array([0.5], np.float16).view(np.uint8)
    qs = np.arange(16, dtype=np.uint8) | (np.arange(16, dtype=np.uint8)[::-1] << 4)
    v = L.dequantize(np.concatenate([d, qs])[None], L.Q4_0, 32)[0]
    np.testing.assert_array_equal(v[:16], 0.5 * (np.arange(16) - 8))
    np.testing.assert_array_equal(v[16:], 0.5 * (np.arange(16)[::-1] - 8))
    m = np.array([-2], np.float16).view(np.uint8)
    v = L.dequantize(np.concatenate([d, m, qs])[None], L.Q4_1, 32)[0]
    np.testing.assert_array_equal(v[:16], 0.5 * np.arange(16) - 2)
    q8 = np.arange(-16, 16, dtype=np.int8).view(np.uint8)
    np.testing.assert_array_equal(L.dequantize(np.concatenate([d, q8])[None], L.Q8_0, 32)[0], 0.5 * np.arange(-16, 16))
    f = np.linspace(-3, 3, 32).astype(np.float32)
    bf = (f.view(np.uint32) >> 16).astype(np.uint16)
    np.testing.assert_array_equal(L.dequantize(bf.view(np.uint8)[None], L.BF16, 32)[0],
                                  (bf.astype(np.uint32) << 16).view(np.float32))


def test_bad_widths_are_refused(dev):
    with pytest.raises(ValueError, match="multiple of 32"):
        L.row_bytes(L.F16, 48)
    with pytest.raises(ValueError, match="unsupported weight type"):
        dev.upload_matrix(np.zeros((1, 64), np.uint8), 12, 32)


# ------------------------------------------------------------------ dense matmul

@pytest.mark.parametrize("ty", L.TYPES, ids=L.NAMES.get)
@pytest.mark.parametrize("rows,cols,T", [(37, 64, 1), (5, 1056, 3), (1, 1024, 1), (33, 3104, 9)])
def test_matmul(dev, ref, ty, rows, cols, T):
    rng = np.random.default_rng(rows * cols + T)
    raw = L.random_rows(rng, ty, rows, cols)
    x = rng.standard_normal((T, cols)).astype(np.float32)
    bias = rng.standard_normal(rows).astype(np.float32)
    scale = np.abs(x) @ np.abs(L.dequantize(raw, ty, cols)).T + np.abs(bias) + 1e-30
    for kw in ({}, {"bias": True, "relu": True}, {"accumulate": True}):
        def run(D, kw=kw):
            out = D.asarray(np.ones((T, rows), np.float32))
            b = D.asarray(bias) if kw.get("bias") else None
            return D.matmul(D.upload_matrix(raw, ty, cols), D.asarray(x), bias=b, out=out,
                            accumulate=kw.get("accumulate", False), relu=kw.get("relu", False))

        got, want = on_both(dev, ref, run)
        assert rel_err(got, want, scale + 1) < TOL, kw


def test_matmul_prefill_path(dev, ref, monkeypatch):
    """T >= PREFILL_T: dequantised tiles of W through (fake) cuBLAS, several tiles."""
    from pinfer_llm.runtime.gpu import cuda as C

    monkeypatch.setattr(C, "DEQUANT_TILE_BYTES", 4 * 1056 * 7)  # 7 rows per tile
    rng = np.random.default_rng(5)
    raw = L.random_rows(rng, L.Q4_0, 20, 1056)
    x = rng.standard_normal((C.PREFILL_T, 1056)).astype(np.float32)
    bias = rng.standard_normal(20).astype(np.float32)
    got, want = on_both(dev, ref, lambda D: D.matmul(D.upload_matrix(raw, L.Q4_0, 1056), D.asarray(x),
                                                     bias=D.asarray(bias), relu=True))
    assert rel_err(got, want, np.abs(x) @ np.abs(L.dequantize(raw, L.Q4_0, 1056)).T + 1) < TOL


def test_upload_gathers_rows(dev, ref):
    rng = np.random.default_rng(1)
    raw = L.random_rows(rng, L.Q8_0, 10, 64)
    rows = np.array([9, 2, 2, 0])
    w = dev.upload_matrix(raw, L.Q8_0, 64, rows=rows)
    assert w.rows == 4
    np.testing.assert_array_equal(dev.to_numpy(dev.dequant_rows(w)), L.dequantize(raw, L.Q8_0, 64)[rows])


# ------------------------------------------------------------------ sparse FFN

def _ffn_case(rng, ty, act, n_ff, d, k):
    gated = act in ("silu", "relu", "drelu")
    mats = [L.random_rows(rng, ty, n_ff, d, 0.3) for _ in range(3)]
    bucket = rng.permutation(n_ff)[:k].astype(np.int32)
    bias = None if gated else rng.standard_normal(n_ff).astype(np.float32)
    return dict(gate=mats[0] if gated else None, up=mats[1], down_t=mats[2], bucket=bucket, bias=bias)


def _run_ffn(D, case, ty, act, d, x, scores, threshold, cats):
    f = D.upload_ffn(case["up"], case["down_t"], ty, d, case["bucket"], act=act, gate=case["gate"],
                     up_bias=case["bias"])
    h = D.ffn_up(f, D.asarray(x), scores=None if scores is None else D.asarray(scores), threshold=threshold,
                 cats=cats)
    y0 = np.linspace(-1, 1, x.shape[0] * d, dtype=np.float32).reshape(x.shape[0], d)  # ffn_down adds into out
    return h, D.ffn_down(f, h, D.asarray(y0))


ACTS = list(ACT_CODES)


@pytest.mark.parametrize("ty", L.TYPES, ids=L.NAMES.get)
@pytest.mark.parametrize("act", ACTS)
def test_sparse_ffn_each_type_and_act(dev, ref, ty, act):
    """k = 77 of 150 neurons (not a multiple of the 32-row group), d = 1056 (one tile + one tail block), T = 1 and
    T = 3, a random 40% of rows per token predicted active; CATS on for SwiGLU at T = 3."""
    rng = np.random.default_rng(zlib.crc32(f"{ty} {act}".encode()))
    n_ff, d = 150, 1056
    case = _ffn_case(rng, ty, act, n_ff, d, 77)
    for T in (1, 3):
        x = rng.standard_normal((T, d)).astype(np.float32)
        scores = rng.random((T, n_ff)).astype(np.float32)
        cats = 0.05 if act == "silu" and T == 3 else None
        (gh, gy), (wh, wy) = on_both(dev, ref, lambda D, x=x, s=scores, c=cats: _run_ffn(D, case, ty, act, d, x, s,
                                                                                            0.6, c))
        if cats is not None:
            assert (wh == 0).mean() > (scores[:, case["bucket"]] < 0.6).mean()  # CATS zeroed some selected rows
        assert rel_err(gh, wh, np.abs(wh).max() + 1e-30) < TOL
        assert rel_err(gy, wy, np.abs(wy).max() + 1e-30) < TOL
        assert ((gh != 0) <= (scores[:, case["bucket"]] >= 0.6)).all()  # unselected rows are exactly 0


@pytest.mark.parametrize("ty", [L.F16, L.Q4_0, L.Q8_0])
@pytest.mark.parametrize("d,k,T", [(3104, 40, 1), (3104, 33, 2), (96, 300, 9), (4096, 31, 1)])
def test_sparse_ffn_shapes(dev, ref, ty, d, k, T):
    """Several tiles (the block's warps split a row), a tail only, T > 8 (two launches), all rows active."""
    rng = np.random.default_rng(d + k + T)
    n_ff = max(k, 64)
    case = _ffn_case(rng, ty, "relu", n_ff, d, k)
    x = rng.standard_normal((T, d)).astype(np.float32)
    (gh, gy), (wh, wy) = on_both(dev, ref, lambda D: _run_ffn(D, case, ty, "relu", d, x, None, 0.0, None))
    assert (wh != 0).mean() > 0.2
    assert rel_err(gh, wh, np.abs(wh).max()) < TOL
    assert rel_err(gy, wy, np.abs(wy).max()) < TOL


@pytest.mark.parametrize("ty", [L.F16, L.Q4_0])
@pytest.mark.parametrize("act", ACTS)
def test_sparse_ffn_prefill_path(dev, ref, monkeypatch, ty, act):
    """From PREFILL_T tokens, ffn() multiplies dequantised tiles of the GPU rows (several tiles here) and ffn_act
    applies the same selection and activation as ffn_up: scores per token, CATS, the up bias of gate-less FFNs."""
    from pinfer_llm.runtime.gpu import cuda as C

    rng = np.random.default_rng(zlib.crc32(f"prefill {ty} {act}".encode()))
    n_ff, d, k = 150, 1056, 77
    monkeypatch.setattr(C, "DEQUANT_TILE_BYTES", 4 * d * 3 * 20)  # 20 to 30 rows per tile: 3 or 4 tiles
    case = _ffn_case(rng, ty, act, n_ff, d, k)
    T = C.PREFILL_T + 3
    x = rng.standard_normal((T, d)).astype(np.float32)
    cats = 0.05 if act == "silu" else None
    for scores in (rng.random((T, n_ff)).astype(np.float32), None):
        def run(D, scores=scores):
            f = D.upload_ffn(case["up"], case["down_t"], ty, d, case["bucket"], act=act, gate=case["gate"],
                             up_bias=case["bias"])
            y0 = np.linspace(-1, 1, T * d, dtype=np.float32).reshape(T, d)
            return D.ffn(f, D.asarray(x), scores=None if scores is None else D.asarray(scores), threshold=0.6,
                         cats=cats, out=D.asarray(y0))
        got, want = on_both(dev, ref, run)
        assert rel_err(got, want, np.abs(want).max()) < TOL


@pytest.mark.parametrize("blocks", [1, 3, 200])
def test_sparse_up_grid_sizes(dev, ref, blocks):
    """One block (each warp walks many selected rows, the pipeline crossing rows), a few, and more warps than rows
    (most exit at the count): the same h."""
    rng = np.random.default_rng(blocks)
    case = _ffn_case(rng, L.Q4_1, "drelu", 100, 1056, 100)
    x = rng.standard_normal((1, 1056)).astype(np.float32)
    scores = rng.random((1, 100)).astype(np.float32)
    dev.up_blocks = blocks
    try:
        (gh, gy), (wh, wy) = on_both(dev, ref, lambda D: _run_ffn(D, case, L.Q4_1, "drelu", 1056, x, scores, 0.5, None))
    finally:
        dev.up_blocks = None
    assert rel_err(gh, wh, np.abs(wh).max()) < TOL and rel_err(gy, wy, np.abs(wy).max()) < TOL


@pytest.mark.parametrize("splits", [1, 5, 40])
def test_sparse_down_grid_sizes(dev, ref, splits):
    """Shares of 90, 18 and 3 rows per block (fewer than the 8 warps' groups: warps with nothing still meet at the
    tree's barriers), over the selection and over every row."""
    rng = np.random.default_rng(splits)
    case = _ffn_case(rng, L.BF16, "silu", 90, 2048 + 96, 90)
    x = rng.standard_normal((3, 2048 + 96)).astype(np.float32)
    scores = rng.random((3, 90)).astype(np.float32)
    dev.down_splits = splits
    try:
        (_, gy), (_, wy) = on_both(dev, ref, lambda D: _run_ffn(D, case, L.BF16, "silu", 2048 + 96, x, None, 0, None))
        g2, w2 = on_both(dev, ref, lambda D: _ffn_whole(D, case, L.BF16, "silu", 2048 + 96, x, scores, 0.5))
    finally:
        dev.down_splits = None
    assert rel_err(gy, wy, np.abs(wy).max()) < TOL
    assert rel_err(g2, w2, np.abs(w2).max()) < TOL


def _ffn_whole(D, case, ty, act, d, x, scores, threshold, cats=None):
    """ffn(): sparse_down over the selection sparse_up made (not ffn_down's pass over every row)."""
    f = D.upload_ffn(case["up"], case["down_t"], ty, d, case["bucket"], act=act, gate=case["gate"],
                     up_bias=case["bias"])
    y0 = np.linspace(-1, 1, x.shape[0] * d, dtype=np.float32).reshape(x.shape[0], d)
    return D.ffn(f, D.asarray(x), scores=None if scores is None else D.asarray(scores), threshold=threshold,
                 cats=cats, out=D.asarray(y0))


@pytest.mark.parametrize("ty", L.TYPES, ids=L.NAMES.get)
def test_ffn_over_the_device_selection(dev, ref, ty):
    """ffn() with scores: the selection made on the device, sparse_up and sparse_down over its list. Every weight
    type; T = 1, 3 and 9 (two chunks of tokens, each its own selection); none, some and all rows selected; a gated
    and a gate-less code; odd k and a width with a tail."""
    rng = np.random.default_rng(zlib.crc32(f"whole {ty}".encode()))
    n_ff, d, k = 150, 1056, 77
    for act in ("silu", "gelu_up"):
        case = _ffn_case(rng, ty, act, n_ff, d, k)
        for T, thr in ((1, 0.7), (3, 2.0), (3, 0.7), (3, -1.0), (9, 0.7)):  # thr: ~30% per token; none; all
            x = rng.standard_normal((T, d)).astype(np.float32)
            scores = rng.random((T, n_ff)).astype(np.float32)
            got, want = on_both(dev, ref, lambda D, x=x, s=scores, t=thr, c=case, a=act:
                                _ffn_whole(D, c, ty, a, d, x, s, t))
            assert rel_err(got, want, np.abs(want).max()) < TOL, (act, T, thr)


def _select_on_device(dev, scores, bucket, threshold, T, k):
    sel, count, counts = dev.empty((k,), np.uint32), dev.empty((1,), np.int32), dev.empty((dev.sm_count,), np.int32)
    zero = dev.asarray(np.full((T, k), 7.0, np.float32))
    dev._select("select_rows", k, T, sel, count, counts, scores=dev.asarray(scores), bucket=dev.asarray(bucket),
                n_ff=scores.shape[1], threshold=threshold, zero=zero)
    n = int(dev.to_numpy(count)[0])
    return dev.to_numpy(sel)[:n], dev.to_numpy(zero)


@pytest.mark.parametrize("k,T", [(1, 1), (255, 8), (700, 3)])
def test_row_selection_is_the_ascending_list_with_tokens(dev, k, T):
    """select_count + select_rows: the GPU rows any token selects, ascending (several blocks of several rounds at
    k = 700: 2 emulated SMs), each with its tokens' bits, and h zeroed exactly where a token does not select."""
    rng = np.random.default_rng(k)
    n_ff = k + 13
    bucket = rng.permutation(n_ff)[:k].astype(np.int32)
    scores = rng.random((T, n_ff)).astype(np.float32)
    entries, zero = _select_on_device(dev, scores, bucket, 0.8, T, k)
    on = scores[:, bucket] >= 0.8  # [T, k]
    rows = np.flatnonzero(on.any(0))
    np.testing.assert_array_equal(entries & 0xFFFFFF, rows)
    np.testing.assert_array_equal(entries >> 24, (on[:, rows] << np.arange(T)[:, None]).sum(0))
    np.testing.assert_array_equal(zero == 0, ~on)  # selected stay as they were (sparse_up writes them)
    assert _select_on_device(dev, scores, bucket, 2.0, T, k)[0].size == 0
    assert _select_on_device(dev, scores, bucket, -1.0, T, k)[0].size == k


def test_launches_do_not_depend_on_the_selection(dev, monkeypatch):
    """Grids and blocks depend on shapes and T only (a captured CUDA graph replays them for any step): the same
    launches for no row, some rows and every row selected."""
    rng = np.random.default_rng(11)
    case = _ffn_case(rng, L.Q4_0, "relu", 150, 1056, 77)
    seen = []
    launch = CudaDevice._launch
    monkeypatch.setattr(CudaDevice, "_launch", lambda self, m, name, grid, block, args: (
        seen.append((name, tuple(grid), tuple(block))), launch(self, m, name, grid, block, args))[1])
    x = rng.standard_normal((2, 1056)).astype(np.float32)
    runs = []
    for thr in (2.0, 0.5, -1.0):
        seen.clear()
        _ffn_whole(dev, case, L.Q4_0, "relu", 1056, x, rng.random((2, 150)).astype(np.float32), thr)
        runs.append(list(seen))
    assert runs[0] == runs[1] == runs[2] and [n for n, *_ in runs[0]] == [
        "select_count", "select_rows", "sparse_up_q4_0_t8", "sparse_down_q4_0_t2"], runs[0]


def test_gate_and_up_rows_are_adjacent_on_the_device(dev):
    """A neuron's gate and up rows are one contiguous stretch of device memory (sparse_up streams them together);
    the gate and up matrices remain ordinary matrices for gemv, dequant and the prefill GEMM."""
    rng = np.random.default_rng(12)
    case = _ffn_case(rng, L.Q8_0, "silu", 40, 1056, 9)
    f = dev.upload_ffn(case["up"], case["down_t"], L.Q8_0, 1056, case["bucket"], act="silu", gate=case["gate"])
    stride = L.device_stride(L.Q8_0, 1056)
    flat = dev.to_numpy(f.gate.data)
    assert f.gate.stride == f.up.stride == 2 * stride and flat.size == 2 * 9 * stride
    pairs = flat.reshape(9, 2, stride)
    for m, half in ((case["gate"], 0), (case["up"], 1)):
        np.testing.assert_array_equal(pairs[:, half], L.to_device(m[case["bucket"]], L.Q8_0, 1056))
    np.testing.assert_array_equal(dev.to_numpy(dev.dequant_rows(f.up)),
                                  L.dequantize(case["up"][case["bucket"]], L.Q8_0, 1056))


def test_no_active_row(dev, ref):
    rng = np.random.default_rng(3)
    case = _ffn_case(rng, L.F16, "relu", 64, 1056, 50)
    x = rng.standard_normal((2, 1056)).astype(np.float32)
    scores = np.zeros((2, 64), np.float32)
    (gh, gy), _ = on_both(dev, ref, lambda D: _run_ffn(D, case, L.F16, "relu", 1056, x, scores, 0.5, None))
    assert (gh == 0).all()
    np.testing.assert_array_equal(gy, np.linspace(-1, 1, 2 * 1056, dtype=np.float32).reshape(2, 1056))


def test_down_rows_with_zero_activation_are_not_read(dev):
    """A down row whose h is 0 for every token is full of NaN: if stage B read it, y would be NaN."""
    rng = np.random.default_rng(4)
    d, k, T = 1056, 70, 2
    down = L.random_rows(rng, L.F16, k, d)
    h = rng.standard_normal((T, k)).astype(np.float32)
    dead = rng.random(k) < 0.6
    h[:, dead] = 0
    down = down.copy()
    down.view(np.uint16)[dead] = 0x7E00  # f16 NaN
    w = dev.upload_matrix(down, L.F16, d)
    ffn = dataclasses.replace(dev.upload_ffn(down, down, L.F16, d, np.arange(k), act="relu_up"), down=w)
    y = dev.to_numpy(dev.ffn_down(ffn, dev.asarray(h), dev.zeros((T, d))))
    assert np.isfinite(y).all()
    live = L.dequantize(down[~dead], L.F16, d)
    np.testing.assert_allclose(y, h[:, ~dead] @ live, rtol=1e-4, atol=1e-4)


def test_scores_for_one_token_may_be_a_vector(dev, ref):
    rng = np.random.default_rng(6)
    case = _ffn_case(rng, L.Q8_0, "relu", 64, 96, 64)
    x = rng.standard_normal((1, 96)).astype(np.float32)
    s = rng.random(64).astype(np.float32)
    got = dev.to_numpy(dev.ffn(dev.upload_ffn(case["up"], case["down_t"], L.Q8_0, 96, case["bucket"], act="relu",
                                              gate=case["gate"]), dev.asarray(x), scores=dev.asarray(s),
                               threshold=0.5))
    want = ref.to_numpy(ref.ffn(ref.upload_ffn(case["up"], case["down_t"], L.Q8_0, 96, case["bucket"], act="relu",
                                               gate=case["gate"]), ref.asarray(x), scores=ref.asarray(s),
                                threshold=0.5))
    assert rel_err(got, want, np.abs(want).max()) < TOL


def test_ffn_upload_checks(dev):
    z = np.zeros((4, 64), np.float16)
    with pytest.raises(ValueError, match="needs gate"):
        dev.upload_ffn(z, z, L.F16, 64, [0], act="relu")
    with pytest.raises(ValueError, match="takes no gate"):
        dev.upload_ffn(z, z, L.F16, 64, [0], act="gelu_up", gate=z)
    with pytest.raises(ValueError, match="outside"):
        dev.upload_ffn(z, z, L.F16, 64, [4], act="relu_up")
    with pytest.raises(ValueError, match="unknown FFN activation"):
        dev.upload_ffn(z, z, L.F16, 64, [0], act="tanh")


# ------------------------------------------------------------------ predictor

@pytest.mark.parametrize("r,d,n_ff,T", [(40, 96, 256, 1), (64, 1056, 96, 3), (7, 32, 1120, 1)])
def test_predictor(dev, ref, r, d, n_ff, T):
    rng = np.random.default_rng(r + n_ff)
    fc1 = (rng.standard_normal((r, d)) / np.sqrt(d)).astype(np.float16)
    fc2 = (rng.standard_normal((n_ff, r)) / np.sqrt(r)).astype(np.float16)
    skip = (rng.random(n_ff) < 0.25).astype(np.uint8)
    x = rng.standard_normal((T, d)).astype(np.float32)
    for sk in (None, skip):
        (gs, gf), (ws, wf) = on_both(dev, ref, lambda D, sk=sk: D.predict(
            D.upload_predictor(fc1, fc2), D.asarray(x), threshold=0.1, skip=None if sk is None else D.asarray(sk),
            ids=True))
        assert rel_err(gs, ws, np.abs(ws).max()) < TOL
        assert gf.shape == (1 + n_ff,)  # [count, ids...]
        gi, wi = gf[1:1 + gf[0]], wf[1:1 + wf[0]]
        assert (np.diff(gi) > 0).all()  # ascending
        near = (np.abs(ws - 0.1) < 1e-5).any(0)
        assert set(np.setxor1d(gi, wi)) <= set(np.flatnonzero(near))
        assert 0 < gf[0] < n_ff


@pytest.mark.parametrize("ty2", [L.Q4_0, L.Q4_1, L.Q8_0], ids=L.NAMES.get)
@pytest.mark.parametrize("ty1", [L.Q4_0, L.F16, None], ids=lambda t: "float" if t is None else L.NAMES[t])
@pytest.mark.parametrize("r,d,n_ff,T", [(64, 96, 256, 1), (32, 1056, 96, 3), (1024, 64, 160, 1)])
def test_quantised_predictor_stays_as_stored(dev, ref, r, d, n_ff, T, ty1, ty2):
    """A Q4_0/Q4_1/Q8_0 fc2 (PowerInfer's `quantize` makes Q4_0 predictors) stays in its encoding on the device, with
    fc1 as stored too (or floats): its bytes, not an F16 copy 2-3.6x larger, and scores equal to the reference's."""
    rng = np.random.default_rng(r + d + n_ff)
    raw1 = L.random_rows(rng, ty1, r, d) if ty1 is not None else None
    fc1 = (raw1, ty1, d) if ty1 is not None else (rng.standard_normal((r, d)) / np.sqrt(d)).astype(np.float32)
    fc2 = (L.random_rows(rng, ty2, n_ff, r), ty2, r)
    x = rng.standard_normal((T, d)).astype(np.float32)
    skip = (rng.random(n_ff) < 0.25).astype(np.uint8)
    up = dev.upload_predictor(fc1, fc2)
    assert not up.transposed and up.fc2.ty == ty2 and up.nbytes == (
        L.row_bytes(ty1 if ty1 is not None else L.F16, d) * r + L.row_bytes(ty2, r) * n_ff)
    (gs, gf), (ws, wf) = on_both(dev, ref, lambda D: D.predict(D.upload_predictor(fc1, fc2), D.asarray(x),
                                                               threshold=0.0, skip=D.asarray(skip), ids=True))
    assert rel_err(gs, ws, np.abs(ws).max()) < TOL
    gi, wi = gf[1:1 + gf[0]], wf[1:1 + wf[0]]
    near = (np.abs(ws) < 1e-5 * np.abs(ws).max()).any(0)
    assert set(np.setxor1d(gi, wi)) <= set(np.flatnonzero(near)) and 0 < gf[0] < n_ff
    with pytest.raises(ValueError, match="as floats"):
        dev.upload_predictor(fc1, (rng.standard_normal((n_ff, r)).astype(np.float16), L.F16, r))


# ------------------------------------------------------------------ norms and small ops

@pytest.mark.parametrize("d,T", [(96, 1), (1056, 3), (5120, 2)])
def test_norms(dev, ref, d, T):
    rng = np.random.default_rng(d)
    x = (rng.standard_normal((T, d)) * 3 + 5).astype(np.float32)
    w, b = rng.standard_normal(d).astype(np.float32), rng.standard_normal(d).astype(np.float32)
    g, r = on_both(dev, ref, lambda D: D.rms_norm(D.asarray(x), D.asarray(w), 1e-6))
    assert rel_err(g, r, np.abs(r).max()) < TOL
    for bb in (b, None):
        g, r = on_both(dev, ref, lambda D, bb=bb: D.layer_norm(D.asarray(x), D.asarray(w),
                                                               None if bb is None else D.asarray(bb), 1e-5))
        assert rel_err(g, r, np.abs(r).max()) < TOL


@pytest.mark.parametrize("d,T", [(96, 1), (1056, 3), (5120, 2)])
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norms_add_into_x_and_copy_it(dev, ref, d, T, kind):
    """add: x += add first, in place, then the norm of the sum; copy: receives x as normed (after the add). Each on
    its own and both: what a hybrid layer step does in the launch of its norm."""
    rng = np.random.default_rng(d + T)
    x = (rng.standard_normal((T, d)) * 3 + 5).astype(np.float32)
    p = rng.standard_normal((T, d)).astype(np.float32)
    w, b = rng.standard_normal(d).astype(np.float32), rng.standard_normal(d).astype(np.float32)
    for with_add, with_copy in ((True, False), (False, True), (True, True)):
        def run(D, with_add=with_add, with_copy=with_copy):
            xx, cp = D.asarray(x), D.zeros((T, d))
            kw = dict(add=D.asarray(p) if with_add else None, copy=cp if with_copy else None)
            y = (D.rms_norm(xx, D.asarray(w), 1e-6, **kw) if kind == "rms" else
                 D.layer_norm(xx, D.asarray(w), D.asarray(b), 1e-5, **kw))
            return y, xx, cp

        (gy, gx, gc), (ry, rx, rc) = on_both(dev, ref, run)
        want_x = x + p if with_add else x
        np.testing.assert_array_equal(gx, want_x)  # the fp32 sum, as add() makes it
        np.testing.assert_array_equal(gc, want_x if with_copy else 0)
        assert rel_err(gy, ry, np.abs(ry).max()) < TOL
        np.testing.assert_array_equal(rx, gx)
        np.testing.assert_array_equal(rc, gc)


def test_add_and_gather(dev, ref):
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((3, 100)).astype(np.float32), rng.standard_normal((3, 100)).astype(np.float32)
    g, r = on_both(dev, ref, lambda D: D.add(D.asarray(a), D.asarray(b)))
    np.testing.assert_array_equal(g, a + b)
    ga = dev.asarray(a)
    dev.add(ga, dev.asarray(b), out=ga)  # residual update in place
    np.testing.assert_array_equal(dev.to_numpy(ga), a + b)
    bias = rng.standard_normal(100).astype(np.float32)  # a bias added to every row, in place
    g, r = on_both(dev, ref, lambda D: D.add(ga := D.asarray(a), D.asarray(bias), out=ga))
    np.testing.assert_array_equal(g, a + bias)
    np.testing.assert_array_equal(r, a + bias)
    with pytest.raises(ValueError, match="expected"):
        dev.add(dev.asarray(a), dev.asarray(bias[:50]))
    idx = np.array([2, 2, 0, 1], np.int32)
    g, r = on_both(dev, ref, lambda D: D.gather_rows(D.asarray(a), D.asarray(idx)))
    np.testing.assert_array_equal(g, a[idx])
    np.testing.assert_array_equal(r, a[idx])


# ------------------------------------------------------------------ attention

ATTN_CASES = [  # n_head, n_kv, hd, n_rot, neox, T, pos
    (4, 4, 64, 64, False, 1, 0),  # MHA, first token
    (8, 2, 128, 128, False, 1, 37),  # GQA
    (6, 1, 64, 32, True, 1, 100),  # MQA, NeoX, partial rotary
    (4, 2, 80, 80, True, 4, 50),  # prefill chunk, head 80 (not a power of two)
    (2, 2, 32, 32, False, 3, 0),  # prefill from 0
    (2, 1, 256, 128, False, 1, 70),  # widest head, partial rotary
]


@pytest.mark.parametrize("n_head,n_kv,hd,n_rot,neox,T,pos", ATTN_CASES)
def test_attention(dev, ref, n_head, n_kv, hd, n_rot, neox, T, pos):
    rng = np.random.default_rng(n_head * hd + pos)
    ctx = 160
    q = rng.standard_normal((T, n_head, hd)).astype(np.float32)
    k, v = (rng.standard_normal((T, n_kv, hd)).astype(np.float32) for _ in range(2))
    ck, cv = (rng.standard_normal((n_kv, ctx, hd)).astype(np.float16) for _ in range(2))
    dev.attn_chunk = 32  # several chunks per query, so the partial/combine path is exercised at small sizes

    def run(D):
        qq, kk, kc, vc = D.asarray(q), D.asarray(k), D.asarray(ck), D.asarray(cv)
        out = D.attention(qq, kk, D.asarray(v), kc, vc, pos, n_rot=n_rot, neox=neox, base=10000.0,
                          rope_scale=2.0)
        return out, qq, kc, vc

    try:
        (go, gq, gk, gv), (wo, wq, wk, wv) = on_both(dev, ref, run)
    finally:
        dev.attn_chunk = 256
    assert rel_err(gq, wq, np.abs(wq).max()) < TOL  # q rotated in place
    np.testing.assert_array_equal(gv, wv)  # v stored as f16, nothing else touched
    f16_step = np.abs(wk.astype(np.float32)) * 2**-10 + 1e-7  # k may differ by one f16 rounding
    assert (np.abs(gk.astype(np.float32) - wk.astype(np.float32)) <= f16_step).all()
    np.testing.assert_array_equal(gk[:, :pos], ck[:, :pos])
    np.testing.assert_array_equal(gk[:, pos + T:], ck[:, pos + T:])
    assert rel_err(go, wo, np.abs(wo).max()) < 1e-4


def test_attention_matches_plain_softmax():
    """The reference itself, against a direct float64 computation: MQA, one token, no rotation (pos 0)."""
    rng = np.random.default_rng(8)
    ref = ReferenceDevice()
    q = rng.standard_normal((1, 3, 32)).astype(np.float32)
    k, v = rng.standard_normal((1, 1, 32)).astype(np.float32), rng.standard_normal((1, 1, 32)).astype(np.float32)
    kc, vc = ref.kv_cache(1, 8, 32)
    out = ref.to_numpy(ref.attention(ref.asarray(q), ref.asarray(k), ref.asarray(v), kc, vc, 0))
    np.testing.assert_allclose(out[0], np.repeat(v[0].astype(np.float16).astype(np.float32), 3, 0), rtol=1e-6)


def test_attention_shape_checks(dev):
    q = dev.zeros((1, 4, 20))
    kc, vc = dev.kv_cache(2, 8, 20)
    with pytest.raises(ValueError, match="head_dim"):
        dev.attention(q, dev.zeros((1, 2, 20)), dev.zeros((1, 2, 20)), kc, vc, 0)
    kc, vc = dev.kv_cache(2, 8, 32)
    with pytest.raises(ValueError, match="do not fit"):
        dev.attention(dev.zeros((1, 4, 32)), dev.zeros((1, 2, 32)), dev.zeros((1, 2, 32)), kc, vc, 8)


# ------------------------------------------------------------------ the device wrapper without a GPU

def test_no_cupy_is_a_one_line_error(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_cupy(name, *a, **kw):
        if name == "cupy":
            raise ImportError("No module named 'cupy'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_cupy)
    with pytest.raises(GPUUnavailable, match=r"CuPy is not installed: pip install 'pinfer-llm\[gpu-cuda12\]'") as e:
        CudaDevice()
    assert "\n" not in str(e.value)


def test_no_driver_is_a_one_line_error():
    import types

    def fail():
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient\nmore detail")

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=fail)))
    with pytest.raises(GPUUnavailable, match="no usable CUDA driver: cudaErrorInsufficientDriver") as e:
        CudaDevice(cupy=fake)
    assert "\n" not in str(e.value)
    fake.cuda.runtime.getDeviceCount = lambda: 0
    with pytest.raises(GPUUnavailable, match="no CUDA device 0"):
        CudaDevice(cupy=fake)


def test_kernel_arguments_are_type_checked(dev):
    """The emulation refuses a wrong scalar or array type, so CudaDevice's packing is checked by every test."""
    k = emu.build(source("ops")).get_function("add_f32")
    a = fake_cupy.zeros((4,), np.float32)
    with pytest.raises(TypeError, match="int64"):
        k((1,), (32,), (a, a, a, np.int32(4), np.int64(4)))
    with pytest.raises(TypeError, match="float64"):
        k((1,), (32,), (a, a, a.astype(np.float64), np.int64(4), np.int64(4)))


def test_pinned_and_stream_helpers(dev, ref):
    for D in (dev, ref):
        h = D.pinned((2, 3), np.float32)
        h[...] = 7
        a = D.zeros((2, 3))
        with D.stream() as s:
            D.to_device_async(h, a, s)
            back = np.zeros((2, 3), np.float32)
            D.to_host_async(a, back, s)
            s.synchronize()
        np.testing.assert_array_equal(back, 7)


def test_reference_in_float32_agrees(ref):
    """ReferenceDevice(float32) is a usable fast stand-in: it agrees with the float64 default to fp32 rounding."""
    rng = np.random.default_rng(9)
    raw = L.random_rows(rng, L.Q4_0, 16, 256)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    r32 = ReferenceDevice(torch.float32)
    a = r32.to_numpy(r32.matmul(r32.upload_matrix(raw, L.Q4_0, 256), r32.asarray(x)))
    b = ref.to_numpy(ref.matmul(ref.upload_matrix(raw, L.Q4_0, 256), ref.asarray(x)))
    assert rel_err(a, b, np.abs(x) @ np.abs(L.dequantize(raw, L.Q4_0, 256)).T) < TOL


def test_attention_long_context_keeps_its_chunk_count(dev, ref, monkeypatch):
    """Past ATTN_MAX_CHUNKS chunks of attn_chunk positions, chunks grow instead of multiplying, so the partial sums
    stay within what the planner reserves (planner/memory.py gpu_scratch_bytes); the result is the same."""
    from pinfer_llm.runtime.gpu import cuda

    monkeypatch.setattr(cuda, "ATTN_MAX_CHUNKS", 3)
    rng = np.random.default_rng(7)
    n_head, n_kv, hd, T, pos, ctx = 4, 2, 64, 2, 150, 160  # 152 positions: 5 chunks of 32, or 3 of 51
    q = rng.standard_normal((T, n_head, hd)).astype(np.float32)
    k, v = (rng.standard_normal((T, n_kv, hd)).astype(np.float32) for _ in range(2))
    ck, cv = (rng.standard_normal((n_kv, ctx, hd)).astype(np.float16) for _ in range(2))
    shapes = []
    empty = dev.empty
    monkeypatch.setattr(dev, "empty", lambda shape, *a: shapes.append(tuple(shape)) or empty(shape, *a))
    monkeypatch.setattr(dev, "attn_chunk", 32)

    def run(D):
        return D.attention(D.asarray(q), D.asarray(k), D.asarray(v), D.asarray(ck), D.asarray(cv), pos)

    go, wo = on_both(dev, ref, run)
    assert (T, n_head, 3, hd + 2) in shapes, shapes  # the partial sums: 3 chunks, not 5
    assert rel_err(go, wo, np.abs(wo).max()) < 1e-4


def test_kernels_are_looked_up_once(monkeypatch):
    """A launch reuses its kernel object: CuPy's RawModule.get_function makes a new one and asks the driver again
    on every call, which each kernel of each layer of each token would otherwise repeat."""
    from tests.cuda_emu import fake_cupy

    calls = []
    get = fake_cupy.RawModule.get_function
    monkeypatch.setattr(fake_cupy.RawModule, "get_function", lambda self, name: calls.append(name) or get(self, name))
    d = CudaDevice(cupy=fake_cupy)
    a = d.asarray(np.arange(8, dtype=np.float32))
    for _ in range(3):
        d.add(a, a)
    d.rms_norm(a.reshape(2, 4), d.asarray(np.ones(4, np.float32)), 1e-5)
    assert calls == ["add_f32", "rms_norm"]
    np.testing.assert_array_equal(d.to_numpy(d.add(a, a)), 2 * np.arange(8))
