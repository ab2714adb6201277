"""Write a model (plain GGUF or PowerInfer PWRI) from numpy weights and a ModelConfig: llama-layout tensors, or
falcon/opt ones under their own names (formats.constants); the metadata keys follow the architecture.

Used by tests and generators that need real model files. Weight names follow formats.constants; a tensor may be a
float array (written as F32/F16 by its dtype) or a RawTensor already in a quantised ggml type.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.config import ModelConfig
from pinfer_llm.formats.encoder import RawTensor
from pinfer_llm.formats.writer import write_gguf


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def byte_vocab(n_vocab: int) -> dict[str, Any]:
    """A gpt2-style byte-level tokenizer of exactly n_vocab tokens (>= 259): 3 control tokens, the 256 bytes, and
    merged pairs of common letters to fill the rest. Enough to encode any text."""
    if n_vocab < 259:
        raise ValueError("a byte-level vocabulary needs at least 259 tokens")
    b2u = bytes_to_unicode()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [b2u[b] for b in range(256)]
    types = [C.TOKEN_TYPE_CONTROL] * 3 + [C.TOKEN_TYPE_NORMAL] * 256
    merges = []
    letters = "etaoinshrdlucmfwygpbvk "
    for a in letters:
        for b in letters:
            if len(tokens) >= n_vocab:
                break
            ua, ub = b2u[ord(a)], b2u[ord(b)]
            tokens.append(ua + ub)
            types.append(C.TOKEN_TYPE_NORMAL)
            merges.append(f"{ua} {ub}")
    i = 0
    while len(tokens) < n_vocab:  # pad with unreachable tokens
        tokens.append(f"<unused{i}>")
        types.append(C.TOKEN_TYPE_UNUSED)
        i += 1
    return {
        C.TOKENIZER_MODEL: "gpt2",
        C.TOKENIZER_PRE: "gpt-2",
        C.TOKENIZER_TOKENS: tokens,
        C.TOKENIZER_TOKEN_TYPE: np.array(types, dtype=np.int32),
        C.TOKENIZER_MERGES: merges,
        C.TOKENIZER_BOS_ID: 1,
        C.TOKENIZER_EOS_ID: 2,
        C.TOKENIZER_ADD_BOS: False,
    }


def llama_metadata(cfg: ModelConfig) -> dict[str, Any]:
    a = cfg.arch
    k = lambda t: t.format(arch=a)  # noqa: E731
    meta: dict[str, Any] = {
        C.ARCHITECTURE: a,
        C.NAME: cfg.name or "pinfer-model",
        k(C.CONTEXT_LENGTH): cfg.n_ctx_train,
        k(C.EMBEDDING_LENGTH): cfg.n_embd,
        k(C.BLOCK_COUNT): cfg.n_layer,
        k(C.FEED_FORWARD_LENGTH): cfg.n_ff,
        k(C.HEAD_COUNT): cfg.n_head,
        k(C.HEAD_COUNT_KV): cfg.n_head_kv,
        k(C.LAYER_NORM_EPS if cfg.layer_norm else C.RMS_EPS): float(cfg.norm_eps),
        k(C.VOCAB_SIZE): cfg.vocab_size,
    }
    if cfg.rope != "none":
        meta[k(C.ROPE_FREQ_BASE)] = float(cfg.rope_base)
        meta[k(C.ROPE_DIMENSION_COUNT)] = cfg.head_dim
    if cfg.head_dim != cfg.n_embd // cfg.n_head:
        meta[k(C.KEY_LENGTH)] = cfg.head_dim
    if cfg.rope_scale != 1.0:
        meta[k(C.ROPE_SCALING_TYPE)] = "linear"
        meta[k(C.ROPE_SCALING_FACTOR)] = float(cfg.rope_scale)
    return meta


def write_llama(path: str | os.PathLike, cfg: ModelConfig, tensors: dict[str, np.ndarray | RawTensor], *,
                tokenizer: dict[str, Any] | None = None, powerinfer: bool = False,
                extra_metadata: dict[str, Any] | None = None, write_activation: bool = True) -> None:
    """tensors maps GGUF names (C.TOKEN_EMBD, C.tensor(C.ATTN_Q, i), ...) to numpy-order arrays."""
    meta = llama_metadata(cfg)
    meta.update(tokenizer if tokenizer is not None else byte_vocab(cfg.vocab_size))
    if write_activation and cfg.ffn_act != "silu":
        meta[C.FFN_ACTIVATION] = cfg.ffn_act
    meta.update(extra_metadata or {})
    write_gguf(path, meta, tensors, powerinfer=powerinfer)
