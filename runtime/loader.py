"""Build a Transformer from a GGUF file: one place maps GGUF tensor names to runtime weights."""

from __future__ import annotations

import torch

from formats import constants as C
from formats.config import ModelConfig
from formats.errors import PinferError
from formats.reader import GGUFFile

from .ffn_dense import DenseFFN
from .ffn_sparse import CatsOracleMasker, PredictorMasker, ReluOracleMasker, SparseFFN, outlier_neurons
from .linear import DenseLinear, QuantEmbedding, dequantize, load_linear
from .model import BlockWeights, Transformer
from .predictor import load_predictors
from .sparse_ops import pack_ffn


def check_shapes(f: GGUFFile, cfg: ModelConfig) -> None:
    """Every tensor the forward pass needs exists and has the shape the metadata implies."""
    d, ff, hd = cfg.n_embd, cfg.n_ff, cfg.head_dim
    expect = {C.TOKEN_EMBD: (cfg.vocab_size, d), C.OUTPUT_NORM: (d,)}
    if not cfg.tied_embeddings:
        expect[C.OUTPUT] = (cfg.vocab_size, d)
    for i in range(cfg.n_layer):
        expect.update({
            C.tensor(C.ATTN_NORM, i): (d,), C.tensor(C.FFN_NORM, i): (d,),
            C.tensor(C.ATTN_Q, i): (cfg.n_head * hd, d), C.tensor(C.ATTN_K, i): (cfg.n_head_kv * hd, d),
            C.tensor(C.ATTN_V, i): (cfg.n_head_kv * hd, d), C.tensor(C.ATTN_OUT, i): (d, cfg.n_head * hd),
            C.tensor(C.FFN_GATE, i): (ff, d), C.tensor(C.FFN_UP, i): (ff, d),
        })
        if cfg.down_transposed:
            expect[C.tensor(C.FFN_DOWN_T, i)] = (ff, d)
        else:
            expect[C.tensor(C.FFN_DOWN, i)] = (d, ff)
    for name, shape in expect.items():
        got = f.info(name).shape  # raises "missing tensor" with the file name
        if tuple(got) != shape:
            raise PinferError(f"{f.path}: tensor '{name}' has shape {list(got)}, the metadata implies {list(shape)}; "
                              f"the file is inconsistent")


FFN_MODES = ("dense", "sparse", "oracle")


def load_dense_ffn(f: GGUFFile, cfg: ModelConfig, i: int, dtype: torch.dtype, quantized: bool) -> DenseFFN:
    t = lambda template: C.tensor(template, i)  # noqa: E731
    gate_up = load_linear(f, [t(C.FFN_GATE), t(C.FFN_UP)], dtype, quantized)
    if cfg.down_transposed:
        # ffn_down_t is [n_ff, d]; F.linear(x, W) with W = down_t.T is a plain GEMM on the contiguous rows.
        down = DenseLinear(dequantize(f, t(C.FFN_DOWN_T), dtype).T)
    else:
        down = load_linear(f, [t(C.FFN_DOWN)], dtype, quantized)
    return DenseFFN(gate_up, down, cfg.ffn_act, cfg.n_ff)


def load_sparse_ffn(f: GGUFFile, cfg: ModelConfig, i: int, masker) -> SparseFFN:
    """The layer's FFN in the neuron-major layout of runtime.sparse_ops (fp32: the SDDMM kernel's dtype)."""
    t = lambda template: C.tensor(template, i)  # noqa: E731
    down_name = t(C.FFN_DOWN_T) if cfg.down_transposed else t(C.FFN_DOWN)
    w = pack_ffn(dequantize(f, t(C.FFN_GATE)), dequantize(f, t(C.FFN_UP)), dequantize(f, down_name),
                 down_transposed=cfg.down_transposed, act=cfg.ffn_act, dtype=torch.float32)
    return SparseFFN(w, masker)


def maskers(f: GGUFFile, cfg: ModelConfig, mode: str) -> list:
    """One masker per layer for the sparse modes (see runtime/ffn_sparse.py)."""
    if mode == "sparse":
        peaks = [dequantize(f, C.tensor(C.ACT_PEAK, i)) if f.has(C.tensor(C.ACT_PEAK, i)) else None
                 for i in range(cfg.n_layer)]
        return [PredictorMasker(p, outlier_neurons(pk))
                for p, pk in zip(load_predictors(f, cfg.n_layer), peaks, strict=True)]
    if cfg.is_relu:
        return [ReluOracleMasker() for _ in range(cfg.n_layer)]
    thresholds = f.get(C.CATS_THRESHOLD)
    if thresholds is None or len(thresholds) != cfg.n_layer:
        raise PinferError(f"{f.path}: exact masks for a SwiGLU model need CATS thresholds; run "
                          f"`pi-profile {f.path.name} --sparsity 0.3` first, or run with --dense")
    return [CatsOracleMasker(float(thr)) for thr in thresholds]


def load_block(f: GGUFFile, cfg: ModelConfig, i: int, dtype: torch.dtype, quantized: bool,
               masker=None) -> BlockWeights:
    t = lambda template: C.tensor(template, i)  # noqa: E731
    return BlockWeights(
        attn_norm=dequantize(f, t(C.ATTN_NORM), dtype),
        wqkv=load_linear(f, [t(C.ATTN_Q), t(C.ATTN_K), t(C.ATTN_V)], dtype, quantized),
        wo=load_linear(f, [t(C.ATTN_OUT)], dtype, quantized),
        ffn_norm=dequantize(f, t(C.FFN_NORM), dtype),
        ffn=load_dense_ffn(f, cfg, i, dtype, quantized) if masker is None else load_sparse_ffn(f, cfg, i, masker),
    )


def load_transformer(f: GGUFFile, cfg: ModelConfig, dtype: torch.dtype = torch.float32, max_ctx: int = 4096,
                     quantized: bool = True, ffn_mode: str = "dense", progress=None) -> Transformer:
    """ffn_mode: "dense"; "sparse" (predictors decide each token's neurons); "oracle" (exact masks)."""
    if ffn_mode not in FFN_MODES:
        raise PinferError(f"unknown FFN mode '{ffn_mode}' (choose {', '.join(FFN_MODES)})")
    check_shapes(f, cfg)
    masks = maskers(f, cfg, ffn_mode) if ffn_mode != "dense" else [None] * cfg.n_layer
    blocks = []
    for i in range(cfg.n_layer):
        blocks.append(load_block(f, cfg, i, dtype, quantized, masks[i]))
        if progress:
            progress(i + 1, cfg.n_layer)
    out_name = C.TOKEN_EMBD if cfg.tied_embeddings else C.OUTPUT
    output = load_linear(f, [out_name], dtype, quantized)
    return Transformer(cfg, blocks, QuantEmbedding(f, C.TOKEN_EMBD), dequantize(f, C.OUTPUT_NORM), output, dtype,
                       max_ctx)
