"""The decoder forward pass in torch on the CPU: llama (Llama, ReluLLaMA/ProSparse), bamboo, falcon and opt.

One Block = attention + FFN, each a residual line:
- llama, bamboo, opt (sequential):  x = x + attn(norm_a(x));  x = x + ffn(norm_f(x))
- falcon (parallel):                x = x + attn(norm_a(x)) + ffn(norm_f(x)), both branches reading the layer input
  (7B layout: norm_a and norm_f are the one attn_norm; 40B layout: attn_norm_2 = HF's ln_attn feeds attention,
  attn_norm = ln_mlp feeds the FFN).
Norms are RMSNorm (llama, bamboo) or LayerNorm with bias (falcon, opt). OPT adds learned absolute position embeddings
to the token embeddings and has biases on every projection; the FFN's down bias is added here, after the FFN block
(dense, sparse or split between GPU and CPU), since it does not belong to any neuron.

The KV cache is allocated once and written by index, in f16 by default as llama.cpp's (keys and values rounded
once when written: half the memory, and half the bytes decode attention reads) or f32. Prefill runs T tokens at
once; decode runs one token through the same code with T=1. Weights come from runtime/loader.py as the file stores
them, grouped (Q, K and V in one Linear, gate and up in one) so that a decode step dispatches few ops. Activations
and the residual stream are float32.

RoPE, in the GGUF layouts: llama.cpp's llama converter permutes Q/K rows so that rotary pairs are adjacent elements
(2i, 2i+1) of each head, not HF's half-split (i, i + head_dim/2); its falcon converter keeps HF's rows, so Falcon
rotates the half-split pairs (NeoX order). OPT has no rotary embedding.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.config import ModelConfig
from pinfer_llm.formats.errors import PinferError
from pinfer_llm.runtime.cpu import kernels as cpu_kernels
from pinfer_llm.runtime.cpu import step as cpu_step
from pinfer_llm.runtime.ffn.dense import DenseFFN
from pinfer_llm.runtime.ffn.sparse import SparseFFN
from pinfer_llm.runtime.linear import Embedding, Linear


@dataclass(eq=False)
class Norm:
    """RMSNorm (llama, bamboo) or LayerNorm with an optional bias (falcon, opt)."""

    w: torch.Tensor  # [d]
    b: torch.Tensor | None
    eps: float
    layer: bool  # LayerNorm: mean-centred, then scaled and shifted


@dataclass
class BlockWeights:
    attn_norm: Norm  # feeds attention (falcon 40B layout: attn_norm_2)
    wqkv: Linear  # d -> (n_head + 2 n_head_kv) * head_dim: q, k, v side by side (falcon: one fused matrix)
    wo: Linear  # n_head * head_dim -> d
    ffn_norm: Norm  # feeds the FFN (falcon: attn_norm, the same object as attn_norm in the 7B layout)
    ffn: object  # DenseFFN, SparseFFN or HybridFFN: callable(normed x [T, d], residual x [T, d]) -> [T, d]
    bqkv: torch.Tensor | None = None  # [(n_head + 2 n_head_kv) * head_dim] biases of q, k, v (opt)
    bo: torch.Tensor | None = None  # [d] (opt)
    ffn_bias: torch.Tensor | None = None  # [d] the down projection's bias (opt)
    parallel: bool = False  # falcon: attention and FFN read the same layer input
    attn_dev: object = None  # runtime.hybrid.executor.DeviceAttention when this layer's attention runs on the GPU


def _invariant_rows(ffn, xf: torch.Tensor, resid: torch.Tensor) -> torch.Tensor | None:
    """Several rows through the FFN as one call that gives each row its decode step's bits (DenseFFN and SparseFFN
    .invariant_rows), or None where the FFN has none (then row by row). Only the exact class: a wrapper (profiler,
    hybrid) may compute differently."""
    if type(ffn) in (DenseFFN, SparseFFN):
        return ffn.invariant_rows(xf, resid)
    return None


def rope_table(cfg: ModelConfig, max_pos: int) -> torch.Tensor:
    """e^(i * pos * theta_j) as complex64 [max_pos, head_dim/2], positions divided by the linear rope factor. For a
    model without rotary embeddings (opt) every angle is 0: the C++ decode op then rotates by the identity."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_base ** (torch.arange(0, half, dtype=torch.float64) * 2 / cfg.head_dim))
    if cfg.rope == "none":
        inv_freq.zero_()
    ang = torch.outer(torch.arange(max_pos, dtype=torch.float64) / cfg.rope_scale, inv_freq)
    return torch.polar(torch.ones_like(ang), ang).to(torch.complex64)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x [T, H, head_dim] with adjacent rotary pairs, rotated as complex numbers by freqs [T, head_dim/2]."""
    T, H, D = x.shape
    xc = torch.view_as_complex(x.float().view(T, H, D // 2, 2))
    return torch.view_as_real(xc * freqs[:, None, :]).view(T, H, D)


def apply_rope_neox(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x [T, H, head_dim] with half-split rotary pairs (i, i + head_dim/2) (GPT-NeoX, Falcon), rotated by freqs."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    cos, sin = freqs.real[:, None, :], freqs.imag[:, None, :]  # (T, 1, half)
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


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
    def __init__(self, cfg: ModelConfig, blocks: list[BlockWeights], tok_embd: Embedding, output_norm: Norm,
                 output: Linear, max_ctx: int, pos_embd: Embedding | None = None,
                 kv_dtype: torch.dtype = torch.float16):
        self.cfg, self.blocks, self.tok_embd = cfg, blocks, tok_embd
        self.output_norm, self.output = output_norm, output
        self.pos_embd = pos_embd  # opt: learned positions, row p + OPT_POS_OFFSET for position p
        if pos_embd is not None and max_ctx > pos_embd.w.rows - C.OPT_POS_OFFSET:
            raise PinferError(f"the model has learned positions for {pos_embd.w.rows - C.OPT_POS_OFFSET} tokens, "
                              f"fewer than the context of {max_ctx}; pass a smaller --ctx-size")
        self.freqs = rope_table(cfg, max_ctx)
        self.cache = KVCache(cfg, max_ctx, kv_dtype)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.norm_shape = (cfg.n_embd,)
        # norms and decode attention are one C++ call each (runtime/cpu/csrc) when the kernels are built
        self.fused = cpu_kernels.available()
        self.rope_cs = torch.view_as_real(self.freqs)  # (cos, sin) pairs [max_pos, head_dim/2, 2] for the C++ op
        # one token's pass through every layer as one C++ call (runtime/cpu/step.py), built on the first decode step;
        # use_step=False runs every token through the Python forward below (the reference)
        self.use_step = True
        self._rows_invariant = False  # this forward's row_invariant (read by attention)
        self._step: cpu_step.DecodeStep | None = None
        self._facts_step: cpu_step.DecodeStep | None = None  # the step that computed the last forward's logits
        self._no_step_sig: list | None = None  # the blocks for which build() said no, not to ask again each token

    @property
    def max_ctx(self) -> int:
        return self.cache.max_ctx

    def forward(self, tokens: torch.Tensor, pos: int, all_logits: bool = False,
                row_invariant: bool = False) -> torch.Tensor:
        """tokens [T] at positions pos..pos+T-1 -> logits [T, vocab] (or [1, vocab] for the last token only).
        row_invariant: every row goes through the decode attention kernel, one row at a time, so that a token's keys,
        values and logits are the same bits whether it was prefilled alone, in a chunk of any length below the
        kernels' GEMM crossover (the engine's chunking keeps to it, Model.row_invariant) or decoded."""
        self._rows_invariant = row_invariant
        self._facts_step = None
        x = self.embed(tokens, pos)  # (T, d) float32
        if x.shape[0] == 1 and self.use_step and (step := self.decode_step()) is not None:
            self._facts_step = step
            return step(x, pos)
        for li, b in enumerate(self.blocks):
            xf, resid, x = self.attend(li, b, x, pos)
            x = x + self.ffn(b, xf, resid)
        if not all_logits:
            x = x[-1:]
        return self.output(self.norm(x, self.output_norm))

    def batchable(self) -> bool:
        """Whether forward_rows applies: the C++ kernels, every layer's attention on the CPU."""
        return self.fused and all(b.attn_dev is None for b in self.blocks)

    def forward_rows(self, tokens: torch.Tensor, pos: torch.Tensor, caches: list[KVCache],
                     out_rows: torch.Tensor, launch: Callable[[], None] | None = None) -> torch.Tensor:
        """A batch: tokens [T], row t at position pos[t] of the KV cache caches[t] (a cache's rows in position order:
        several sequences' decode steps, a prompt's rows, or both) -> logits [len(out_rows), vocab] of the rows
        out_rows. Row t's logits and cache rows are the bits it gets alone, as a decode step or in a row-invariant
        prefill: fewer rows than the kernels' GEMM crossover, attention row by row, a neuron-major FFN over the
        union of the rows' neurons, each row masked to its own (the C++ step does the same in one call, csrc/step.cpp
        decode_rows).

        launch (optional) is called once the inputs are ready, just before the pass's kernels start: pi-serve hands
        the previous step's tokens to its event loop there, so the loop's work overlaps the kernels (which run
        without the GIL) instead of taking the GIL from this thread's own Python between steps."""
        if not self.batchable():
            raise PinferError("batched rows need the C++ kernels and every layer's attention on the CPU")
        self._facts_step = None
        x = self.tok_embd(tokens)
        if self.pos_embd is not None:
            x = x + self.pos_embd(pos + C.OPT_POS_OFFSET)
        if self.use_step and (step := self.decode_step()) is not None:
            self._facts_step = step
            return step.rows(x, pos, caches, out_rows, launch)
        if launch is not None:
            launch()
        cfg = self.cfg
        H, Hkv, D, neox = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.rope == "neox"
        ps = pos.tolist()
        self._rows_invariant = True  # Transformer.ffn: a neuron-major FFN's batch-invariant call
        for li, b in enumerate(self.blocks):
            xa = self.norm(x, b.attn_norm)
            qkv = b.wqkv(xa)
            if b.bqkv is not None:
                qkv += b.bqkv
            qkv = qkv.contiguous()
            heads = torch.cat([torch.ops.pinfer.attend_decode(qkv[t:t + 1], self.rope_cs[p], c.k[li], c.v[li], p, H,
                                                              Hkv, self.scale, neox=neox).view(1, H * D)
                               for t, (p, c) in enumerate(zip(ps, caches, strict=True))])
            y = x + self.out_proj(b, heads)
            if b.parallel:
                xf, resid = (xa if b.ffn_norm is b.attn_norm else self.norm(x, b.ffn_norm)), x
            else:
                xf, resid = self.norm(y, b.ffn_norm), y
            x = y + self.ffn(b, xf, resid)
        return self.output(self.norm(x[out_rows], self.output_norm))

    def head_facts(self) -> list[list[int]] | None:
        """[finite, argmax] of each row of the logits the last forward / forward_rows returned: 1 if every value
        is finite, and the index of the first largest (-1 where not finite), taken by the C++ step's threads while
        the values were in their caches (sampling.finite and a greedy sampler, fed these, never read the row); None
        where the step did not compute them."""
        return None if self._facts_step is None else self._facts_step.native.head_facts().tolist()

    def decode_step(self) -> cpu_step.DecodeStep | None:
        """The fused decode step for the blocks as they are now (rebuilt when a block's FFN or attention object was
        replaced, e.g. by the hybrid executor or a profiler's wrapper), or None where it does not apply."""
        st = self._step
        if st is not None and st.matches(self.blocks):
            return st
        self._step = None
        sig = cpu_step.signature(self)
        if self._no_step_sig is not None and all(map(operator.is_, sig, self._no_step_sig)):
            return None
        self._step = cpu_step.build(self)
        self._no_step_sig = sig if self._step is None else None
        return self._step

    def embed(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        x = self.tok_embd(tokens)
        if self.pos_embd is not None:
            x = x + self.pos_embd(torch.arange(pos, pos + tokens.numel()) + C.OPT_POS_OFFSET)
        return x

    def attend(self, li: int, b: BlockWeights, x: torch.Tensor, pos: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention half of block li for the layer input x: (the FFN's normed input, the FFN's residual input,
        which predictors read, x + attention). Sequential blocks: both FFN inputs come after attention. Falcon's
        parallel block: the FFN reads the layer input x itself, its norm shared with attention in the 7B layout."""
        xa = self.norm(x, b.attn_norm)
        y = x + self.attention(li, b, xa, pos)
        if b.parallel:
            return (xa if b.ffn_norm is b.attn_norm else self.norm(x, b.ffn_norm)), x, y
        return self.norm(y, b.ffn_norm), y, y

    def ffn(self, b: BlockWeights, xf: torch.Tensor, resid: torch.Tensor) -> torch.Tensor:
        if self._rows_invariant and xf.shape[0] > 1:
            # each row the bits of its decode step: one batch-invariant call where the FFN has one, else row by row
            y = _invariant_rows(b.ffn, xf, resid)
            if y is None:
                y = torch.cat([b.ffn(xf[t:t + 1], resid[t:t + 1]) for t in range(xf.shape[0])])
        else:
            y = b.ffn(xf, resid)
        return y if b.ffn_bias is None else y + b.ffn_bias

    def norm(self, x: torch.Tensor, n: Norm) -> torch.Tensor:
        if self.fused:
            if n.layer:
                return torch.ops.pinfer.layer_norm(x.contiguous(), n.w, n.b, n.eps)
            return torch.ops.pinfer.rms_norm(x.contiguous(), n.w, n.eps)
        if n.layer:
            return F.layer_norm(x, self.norm_shape, n.w, n.b, n.eps)
        return F.rms_norm(x, self.norm_shape, n.w, n.eps)

    def attention(self, li: int, b: BlockWeights, x: torch.Tensor, pos: int) -> torch.Tensor:
        if b.attn_dev is not None:
            return b.attn_dev(x, pos)
        cfg, T = self.cfg, x.shape[0]
        H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        end = pos + T
        qkv = b.wqkv(x)  # (T, (H + 2 Hkv) D)
        if b.bqkv is not None:
            qkv += b.bqkv
        if T == 1 and self.fused:  # RoPE, cache write and attention in one call
            out = torch.ops.pinfer.attend_decode(qkv, self.rope_cs[pos], self.cache.k[li], self.cache.v[li],
                                                 pos, H, Hkv, self.scale, neox=cfg.rope == "neox")
            return self.out_proj(b, out)
        if self._rows_invariant and self.fused:
            # each row t attends to positions 0..pos+t exactly as its decode step would (attend_decode's bits; SDPA's
            # prefill kernel sums in another order, so its rows differ in the last bits), all rows in one call
            out = torch.ops.pinfer.attend_prompt(qkv.contiguous(), self.rope_cs, self.cache.k[li], self.cache.v[li],
                                                 pos, H, Hkv, self.scale, neox=cfg.rope == "neox")
            return self.out_proj(b, out)
        qk = qkv[:, :(H + Hkv) * D].view(T, H + Hkv, D)  # q and k rotated in one op
        if cfg.rope == "normal":
            qk = apply_rope(qk, self.freqs[pos:end])
        elif cfg.rope == "neox":
            qk = apply_rope_neox(qk, self.freqs[pos:end])
        self.cache.k[li][:, pos:end] = qk[:, H:].transpose(0, 1)
        self.cache.v[li][:, pos:end] = qkv[:, (H + Hkv) * D:].view(T, Hkv, D).transpose(0, 1)
        keys, values = self.cache.k[li][:, :end], self.cache.v[li][:, :end]  # (Hkv, end, D)
        if keys.dtype != torch.float32:  # an f16 cache: attention in f32 over the rounded keys and values
            keys, values = keys.float(), values.float()
        group = H // Hkv
        q = qk[:, :H].to(keys.dtype)
        if T == 1:
            # decode: query head h uses kv head h // group, so the `group` heads of a kv head form one batch row
            out = F.scaled_dot_product_attention(q.view(Hkv, group, D), keys, values, scale=self.scale)
            return self.out_proj(b, out.view(1, H * D))
        # prefill: (H, T, D) queries against (Hkv, end, D) keys, kv heads shared by SDPA's GQA broadcast
        if pos == 0:
            out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, is_causal=True, scale=self.scale,
                                                 enable_gqa=group > 1)
        else:  # a later chunk: query t (position pos + t) sees keys 0..pos+t
            mask = torch.arange(end)[None, :] <= torch.arange(pos, end)[:, None]
            out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask, scale=self.scale,
                                                 enable_gqa=group > 1)
        return self.out_proj(b, out.transpose(0, 1).reshape(T, H * D))

    @staticmethod
    def out_proj(b: BlockWeights, heads: torch.Tensor) -> torch.Tensor:
        y = b.wo(heads)
        return y if b.bo is None else y + b.bo
