"""The Llama-family forward pass (llama, ReluLLaMA/ProSparse, Bamboo) in torch on the CPU.

One Block = attention + FFN, each a residual line. The KV cache is allocated once and written by index. Prefill runs
T tokens at once; decode runs one token through the same code with T=1. Weights come from runtime/loader.py already
fused (QKV in one matrix, gate+up in one matrix) so that a decode step dispatches few, large ops.

RoPE uses the GGUF layout: llama.cpp's converter permutes Q/K rows so that rotary pairs are adjacent elements
(2i, 2i+1) of each head, not HF's half-split (i, i + head_dim/2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from formats.config import ModelConfig

from .linear import DenseLinear, Int4Linear, SplitInt4Linear

Linear = DenseLinear | Int4Linear | SplitInt4Linear


@dataclass
class BlockWeights:
    attn_norm: torch.Tensor  # [d]
    wqkv: Linear  # d -> (n_head + 2 n_head_kv) * head_dim
    wo: Linear  # n_head * head_dim -> d
    ffn_norm: torch.Tensor  # [d]
    ffn: object  # runtime.ffn.DenseFFN or SparseFFN: callable(x [T, d], residual [T, d]) -> [T, d]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Computed in fp32 whatever the activation dtype, as llama.cpp does.
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def rope_tables(cfg: ModelConfig, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_pos, head_dim/2] for positions scaled by the linear rope factor."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_base ** (torch.arange(0, half, dtype=torch.float64) * 2 / cfg.head_dim))
    pos = torch.arange(max_pos, dtype=torch.float64) / cfg.rope_scale
    ang = torch.outer(pos, inv_freq)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, head_dim] with adjacent rotary pairs; cos/sin [T, head_dim/2]."""
    T, H, D = x.shape
    xp = x.float().view(T, H, D // 2, 2)
    x0, x1 = xp[..., 0], xp[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).view(T, H, D).to(x.dtype)


class KVCache:
    """Keys and values of every layer, allocated once: [n_layer, n_head_kv, max_ctx, head_dim] each."""

    def __init__(self, cfg: ModelConfig, max_ctx: int, dtype: torch.dtype):
        shape = (cfg.n_layer, cfg.n_head_kv, max_ctx, cfg.head_dim)
        # empty, not zeros: attention reads only positions already written
        self.k = torch.empty(shape, dtype=dtype)
        self.v = torch.empty(shape, dtype=dtype)
        self.max_ctx = max_ctx


class Transformer:
    def __init__(self, cfg: ModelConfig, blocks: list[BlockWeights], tok_embd, output_norm: torch.Tensor,
                 output: Linear, dtype: torch.dtype, max_ctx: int):
        self.cfg, self.blocks, self.tok_embd = cfg, blocks, tok_embd
        self.output_norm, self.output, self.dtype = output_norm, output, dtype
        self.cos, self.sin = rope_tables(cfg, max_ctx)
        self.cache = KVCache(cfg, max_ctx, dtype)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    @property
    def max_ctx(self) -> int:
        return self.cache.max_ctx

    def forward(self, tokens: torch.Tensor, pos: int, all_logits: bool = False) -> torch.Tensor:
        """tokens [T] at positions pos..pos+T-1 -> logits [T, vocab] (or [1, vocab] for the last token only)."""
        x = self.tok_embd(tokens).to(self.dtype)  # (T, d)
        for li, b in enumerate(self.blocks):
            x = x + self.attention(li, b, rms_norm(x, b.attn_norm, self.cfg.norm_eps), pos)
            x = b.ffn(rms_norm(x, b.ffn_norm, self.cfg.norm_eps), x)  # adds the FFN output to x
        if not all_logits:
            x = x[-1:]
        return self.output(rms_norm(x, self.output_norm, self.cfg.norm_eps)).float()

    def attention(self, li: int, b: BlockWeights, x: torch.Tensor, pos: int) -> torch.Tensor:
        cfg, T = self.cfg, x.shape[0]
        H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        qkv = b.wqkv(x)  # (T, (H + 2 Hkv) D)
        q, k, v = qkv.split((H * D, Hkv * D, Hkv * D), dim=-1)
        cos, sin = self.cos[pos:pos + T], self.sin[pos:pos + T]
        q = apply_rope(q.view(T, H, D), cos, sin)
        k = apply_rope(k.view(T, Hkv, D), cos, sin)
        end = pos + T
        self.cache.k[li, :, pos:end] = k.transpose(0, 1)
        self.cache.v[li, :, pos:end] = v.view(T, Hkv, D).transpose(0, 1)
        keys, values = self.cache.k[li, :, :end], self.cache.v[li, :, :end]  # (Hkv, end, D)
        # GQA as a batched matmul over kv heads: (Hkv, T*group, D) queries share each kv head.
        group = H // Hkv
        qg = q.view(T, Hkv, group, D).permute(1, 0, 2, 3).reshape(Hkv, T * group, D)
        if T == 1:
            att = torch.softmax((qg @ keys.transpose(1, 2)).float() * self.scale, dim=-1).to(values.dtype)
            out = att @ values  # (Hkv, group, D)
        else:
            # causal mask for a chunk that starts at `pos`: query t sees keys 0..pos+t
            qpos = torch.arange(pos, end).repeat_interleave(group)
            mask = torch.arange(end)[None, :] <= qpos[:, None]
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=self.scale)
        out = out.view(Hkv, T, group, D).permute(1, 0, 2, 3).reshape(T, H * D)
        return b.wo(out)
