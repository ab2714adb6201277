"""The Llama-family forward pass (llama, ReluLLaMA/ProSparse, Bamboo) in torch on the CPU.

One Block = attention + FFN, each a residual line. The KV cache is allocated once and written by index. Prefill runs
T tokens at once; decode runs one token through the same code with T=1. Weights come from runtime/loader.py as the
file stores them, grouped (Q, K and V in one Linear, gate and up in one) so that a decode step dispatches few ops.
Activations and the residual stream are float32.

RoPE uses the GGUF layout: llama.cpp's converter permutes Q/K rows so that rotary pairs are adjacent elements
(2i, 2i+1) of each head, not HF's half-split (i, i + head_dim/2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from formats.config import ModelConfig

from . import cpu_kernels
from .linear import Embedding, Linear


@dataclass
class BlockWeights:
    attn_norm: torch.Tensor  # [d]
    wqkv: Linear  # d -> (n_head + 2 n_head_kv) * head_dim
    wo: Linear  # n_head * head_dim -> d
    ffn_norm: torch.Tensor  # [d]
    ffn: object  # DenseFFN, SparseFFN or HybridFFN: callable(normed x [T, d], residual x [T, d]) -> [T, d]
    attn_dev: object = None  # runtime.hybrid.DeviceAttention when this layer's attention runs on the GPU


def rope_table(cfg: ModelConfig, max_pos: int) -> torch.Tensor:
    """e^(i * pos * theta_j) as complex64 [max_pos, head_dim/2], positions divided by the linear rope factor."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_base ** (torch.arange(0, half, dtype=torch.float64) * 2 / cfg.head_dim))
    ang = torch.outer(torch.arange(max_pos, dtype=torch.float64) / cfg.rope_scale, inv_freq)
    return torch.polar(torch.ones_like(ang), ang).to(torch.complex64)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x [T, H, head_dim] with adjacent rotary pairs, rotated as complex numbers by freqs [T, head_dim/2]."""
    T, H, D = x.shape
    xc = torch.view_as_complex(x.float().view(T, H, D // 2, 2))
    return torch.view_as_real(xc * freqs[:, None, :]).view(T, H, D)


class KVCache:
    """Keys and values of every layer, allocated once: k[layer], v[layer] are [n_head_kv, max_ctx, head_dim]. A layer
    whose attention runs on the GPU keeps its cache there (free() drops the host's)."""

    def __init__(self, cfg: ModelConfig, max_ctx: int, dtype: torch.dtype = torch.float32):
        shape = (cfg.n_head_kv, max_ctx, cfg.head_dim)
        # empty, not zeros: attention reads only positions already written
        self.k = [torch.empty(shape, dtype=dtype) for _ in range(cfg.n_layer)]
        self.v = [torch.empty(shape, dtype=dtype) for _ in range(cfg.n_layer)]
        self.max_ctx = max_ctx

    def free(self, layer: int) -> None:
        self.k[layer] = self.v[layer] = None


class Transformer:
    def __init__(self, cfg: ModelConfig, blocks: list[BlockWeights], tok_embd: Embedding, output_norm: torch.Tensor,
                 output: Linear, max_ctx: int):
        self.cfg, self.blocks, self.tok_embd = cfg, blocks, tok_embd
        self.output_norm, self.output = output_norm, output
        self.freqs = rope_table(cfg, max_ctx)
        self.cache = KVCache(cfg, max_ctx)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.norm_shape = (cfg.n_embd,)
        # RMSNorm and decode attention are one C++ call each (runtime/csrc) when the kernels are built
        self.fused = cpu_kernels.available()
        self.rope_cs = torch.view_as_real(self.freqs)  # (cos, sin) pairs [max_pos, head_dim/2, 2] for the C++ op

    @property
    def max_ctx(self) -> int:
        return self.cache.max_ctx

    def forward(self, tokens: torch.Tensor, pos: int, all_logits: bool = False) -> torch.Tensor:
        """tokens [T] at positions pos..pos+T-1 -> logits [T, vocab] (or [1, vocab] for the last token only)."""
        x = self.tok_embd(tokens)  # (T, d) float32
        for li, b in enumerate(self.blocks):
            x = x + self.attention(li, b, self.norm(x, b.attn_norm), pos)
            x = x + b.ffn(self.norm(x, b.ffn_norm), x)  # predictors read the pre-norm residual
        if not all_logits:
            x = x[-1:]
        return self.output(self.norm(x, self.output_norm))

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return torch.ops.pinfer.rms_norm(x.contiguous(), w, self.cfg.norm_eps)
        return F.rms_norm(x, self.norm_shape, w, self.cfg.norm_eps)

    def attention(self, li: int, b: BlockWeights, x: torch.Tensor, pos: int) -> torch.Tensor:
        if b.attn_dev is not None:
            return b.attn_dev(x, pos)
        cfg, T = self.cfg, x.shape[0]
        H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        end = pos + T
        qkv = b.wqkv(x)  # (T, (H + 2 Hkv) D)
        if T == 1 and self.fused:  # RoPE, cache write and attention in one call
            out = torch.ops.pinfer.attend_decode(qkv, self.rope_cs[pos], self.cache.k[li], self.cache.v[li],
                                                 pos, H, Hkv, self.scale)
            return b.wo(out)
        qk = apply_rope(qkv[:, :(H + Hkv) * D].view(T, H + Hkv, D), self.freqs[pos:end])  # q and k in one op
        self.cache.k[li][:, pos:end] = qk[:, H:].transpose(0, 1)
        self.cache.v[li][:, pos:end] = qkv[:, (H + Hkv) * D:].view(T, Hkv, D).transpose(0, 1)
        keys, values = self.cache.k[li][:, :end], self.cache.v[li][:, :end]  # (Hkv, end, D)
        group = H // Hkv
        q = qk[:, :H].to(keys.dtype)
        if T == 1:
            # decode: query head h uses kv head h // group, so the `group` heads of a kv head form one batch row
            out = F.scaled_dot_product_attention(q.view(Hkv, group, D), keys, values, scale=self.scale)
            return b.wo(out.view(1, H * D))
        # prefill: (H, T, D) queries against (Hkv, end, D) keys, kv heads shared by SDPA's GQA broadcast
        if pos == 0:
            out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, is_causal=True, scale=self.scale,
                                                 enable_gqa=group > 1)
        else:  # a later chunk: query t (position pos + t) sees keys 0..pos+t
            mask = torch.arange(end)[None, :] <= torch.arange(pos, end)[:, None]
            out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask, scale=self.scale,
                                                 enable_gqa=group > 1)
        return b.wo(out.transpose(0, 1).reshape(T, H * D))
