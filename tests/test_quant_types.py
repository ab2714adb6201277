"""Every supported ggml type loads and runs: logits equal those of an F32 file holding the dequantised values."""

import numpy as np
import pytest
from gguf import quants
from gguf.constants import GGMLQuantizationType as T

from formats import constants as C
from formats.model_writer import write_llama
from formats.reader import open_gguf
from formats.writer import RawTensor
from runtime import load_model
from runtime.linear import SUPPORTED_TYPES, dequantize
from tests.tiny import random_weights, tiny_config

QUANTIZABLE = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.BF16]  # gguf.quants can write these
K_QUANTS = {T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}  # bytes per 256-weight block; gguf.quants only reads these


def random_k_blocks(qt: T, shape: tuple[int, int], rng) -> np.ndarray:
    """Random K-quant rows with sane fp16 scales (their bits are random otherwise)."""
    rows, cols = shape
    nb = cols // 256
    blocks = rng.integers(0, 256, (rows, nb, K_QUANTS[qt]), dtype=np.uint8)
    d = np.full((rows, nb), 0.002, dtype=np.float16).view(np.uint8).reshape(rows, nb, 2)
    if qt == T.Q6_K:
        blocks[..., -2:] = d  # ql, qh, scales, d
    else:
        blocks[..., 0:2] = d  # d, dmin, scales, ...
        blocks[..., 2:4] = d
    return blocks.reshape(rows, nb * K_QUANTS[qt])


def encode(qt: T, a: np.ndarray, rng) -> RawTensor:
    if qt == T.F32:
        return RawTensor(a.astype(np.float32), qt, a.shape)
    if qt == T.F16:
        return RawTensor(a.astype(np.float16), qt, a.shape)
    if qt in K_QUANTS:
        return RawTensor(random_k_blocks(qt, a.shape, rng), qt, a.shape)
    return RawTensor(quants.quantize(a, qt), qt, a.shape)


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory):
    """One model whose 2-D weights cycle through every supported type, and its dequantised F32 twin."""
    d = tmp_path_factory.mktemp("quant")
    cfg = tiny_config(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, vocab_size=320)
    w = random_weights(cfg, seed=11, scale=0.05)
    rng = np.random.default_rng(0)
    types = [T.F32, T.F16] + QUANTIZABLE + list(K_QUANTS)
    mixed, i = {}, 0
    for name, a in w.items():
        if a.ndim == 2:
            mixed[name] = encode(types[i % len(types)], a, rng)
            i += 1
        else:
            mixed[name] = a
    write_llama(d / "mixed.gguf", cfg, mixed)
    f = open_gguf(d / "mixed.gguf")
    used = {f.info(n).ggml_type for n in f.tensors}
    twin = {n: dequantize(f, n).numpy().astype(np.float32) for n in f.tensors}
    write_llama(d / "f32.gguf", cfg, twin)
    return cfg, d / "mixed.gguf", d / "f32.gguf", used


def test_every_supported_type_is_exercised(mixed_model):
    *_, used = mixed_model
    assert {int(t) for t in SUPPORTED_TYPES} <= used


def test_dequantised_path_matches_f32_twin(mixed_model):
    cfg, mixed, f32, _ = mixed_model
    ids = list(range(3, 40, 3))
    a = load_model(mixed, quantized=False).forward_logits(ids)
    b = load_model(f32).forward_logits(ids)
    assert np.abs(a - b).max() < 1e-4


@pytest.mark.parametrize("n", [13, 40])  # 13 rows: int4 kernels; 40 rows: the bf16 GEMM prefill path
def test_int4_kernels_match_f32_twin(mixed_model, n):
    """Q4_0/Q4_1/Q8_0 stay packed (int4 kernels, bf16 activations): equal up to bf16 rounding."""
    cfg, mixed, f32, _ = mixed_model
    ids = list(range(3, 3 * n + 3, 3))
    a = load_model(mixed).forward_logits(ids)
    b = load_model(f32).forward_logits(ids)
    assert np.abs(a - b).max() < 0.02 * np.abs(b).max()
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("qt", [T.Q4_0, T.Q4_1, T.Q8_0])
def test_int4_layer_equals_dequantised_weight(tmp_path, qt):
    from runtime.linear import load_linear

    a = np.random.default_rng(1).standard_normal((64, 128)).astype(np.float32)
    from formats.writer import write_gguf

    write_gguf(tmp_path / "w.gguf", {C.ARCHITECTURE: "llama"}, {"w": RawTensor(quants.quantize(a, qt), qt, a.shape)})
    f = open_gguf(tmp_path / "w.gguf")
    lin = load_linear(f, ["w"], dtype=__import__("torch").float32)
    assert type(lin).__name__ in ("Int4Linear", "SplitInt4Linear")
    ref = dequantize(f, "w").numpy()
    got = lin.dense_weight().float().numpy()
    # scales are bf16 (8-bit mantissa): relative error per weight <= ~2^-8
    assert np.abs(got - ref).max() <= 2 ** -7 * np.abs(ref).max()
