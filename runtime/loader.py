"""Build a Transformer from a GGUF file: one place maps GGUF tensor names to runtime weights."""

from __future__ import annotations

import torch

from formats import constants as C
from formats.config import ModelConfig
from formats.errors import PinferError
from formats.reader import GGUFFile

from .ffn import DenseFFN
from .linear import DenseLinear, QuantEmbedding, dequantize, load_linear
from .model import BlockWeights, Transformer


def required_tensors(cfg: ModelConfig) -> list[str]:
    names = [C.TOKEN_EMBD, C.OUTPUT_NORM]
    down = C.FFN_DOWN_T if cfg.down_transposed else C.FFN_DOWN
    for i in range(cfg.n_layer):
        for t in (C.ATTN_NORM, C.ATTN_Q, C.ATTN_K, C.ATTN_V, C.ATTN_OUT, C.FFN_NORM, C.FFN_GATE, C.FFN_UP, down):
            names.append(C.tensor(t, i))
    return names


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


def load_block(f: GGUFFile, cfg: ModelConfig, i: int, dtype: torch.dtype, quantized: bool) -> BlockWeights:
    t = lambda template: C.tensor(template, i)  # noqa: E731
    wqkv = load_linear(f, [t(C.ATTN_Q), t(C.ATTN_K), t(C.ATTN_V)], dtype, quantized)
    wo = load_linear(f, [t(C.ATTN_OUT)], dtype, quantized)
    gate_up = load_linear(f, [t(C.FFN_GATE), t(C.FFN_UP)], dtype, quantized)
    if cfg.down_transposed:
        # ffn_down_t is [n_ff, d]; F.linear(x, W) with W = down_t.T is a plain GEMM on the contiguous rows.
        down = DenseLinear(dequantize(f, t(C.FFN_DOWN_T), dtype).T)
    else:
        down = load_linear(f, [t(C.FFN_DOWN)], dtype, quantized)
    return BlockWeights(
        attn_norm=dequantize(f, t(C.ATTN_NORM), dtype),
        wqkv=wqkv,
        wo=wo,
        ffn_norm=dequantize(f, t(C.FFN_NORM), dtype),
        ffn=DenseFFN(gate_up, down, cfg.ffn_act, cfg.n_ff),
    )


def load_transformer(f: GGUFFile, cfg: ModelConfig, dtype: torch.dtype = torch.float32, max_ctx: int = 4096,
                     quantized: bool = True, progress=None) -> Transformer:
    check_shapes(f, cfg)
    blocks = []
    for i in range(cfg.n_layer):
        blocks.append(load_block(f, cfg, i, dtype, quantized))
        if progress:
            progress(i + 1, cfg.n_layer)
    out_name = C.TOKEN_EMBD if cfg.tied_embeddings else C.OUTPUT
    output = load_linear(f, [out_name], dtype, quantized)
    return Transformer(cfg, blocks, QuantEmbedding(f, C.TOKEN_EMBD), dequantize(f, C.OUTPUT_NORM), output, dtype,
                       max_ctx)
