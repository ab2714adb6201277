"""Tiny random llama-family models for tests, written as real GGUF files."""

from __future__ import annotations

import numpy as np

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.config import ModelConfig
from pinfer_llm.formats.model_writer import write_llama


def tiny_config(**kw) -> ModelConfig:
    base = dict(arch="llama", n_layer=2, n_embd=64, n_ff=160, n_head=4, n_head_kv=2, vocab_size=300,
                n_ctx_train=256, norm_eps=1e-5, rope_base=10000.0)
    base.update(kw)
    return ModelConfig(**base)


def random_weights(cfg: ModelConfig, seed: int = 0, scale: float = 0.08) -> dict[str, np.ndarray]:
    """Numpy-order weights under GGUF names (Q/K already in GGUF's interleaved rope layout)."""
    rng = np.random.default_rng(seed)
    r = lambda *s: (rng.standard_normal(s) * scale).astype(np.float32)  # noqa: E731
    d, ff, hd = cfg.n_embd, cfg.n_ff, cfg.head_dim
    w = {C.TOKEN_EMBD: r(cfg.vocab_size, d) * 10, C.OUTPUT_NORM: 1 + r(d)}
    if not cfg.tied_embeddings:
        w[C.OUTPUT] = r(cfg.vocab_size, d)
    for i in range(cfg.n_layer):
        t = lambda name, i=i: C.tensor(name, i)  # noqa: E731
        w[t(C.ATTN_NORM)] = 1 + r(d)
        w[t(C.ATTN_Q)] = r(cfg.n_head * hd, d)
        w[t(C.ATTN_K)] = r(cfg.n_head_kv * hd, d)
        w[t(C.ATTN_V)] = r(cfg.n_head_kv * hd, d)
        w[t(C.ATTN_OUT)] = r(d, cfg.n_head * hd)
        w[t(C.FFN_NORM)] = 1 + r(d)
        w[t(C.FFN_GATE)] = r(ff, d)
        w[t(C.FFN_UP)] = r(ff, d)
        w[t(C.FFN_DOWN)] = r(d, ff)
    return w


def to_powerinfer_layout(cfg: ModelConfig, w: dict[str, np.ndarray], rank: int = 16, seed: int = 1) -> dict:
    """Same weights in PowerInfer's layout: ffn_down_t instead of ffn_down, plus predictor tensors."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, a in w.items():
        out[name] = a
    for i in range(cfg.n_layer):
        out[C.tensor(C.FFN_DOWN_T, i)] = np.ascontiguousarray(out.pop(C.tensor(C.FFN_DOWN, i)).T)
        out[C.tensor(C.PRED_FC1, i)] = (rng.standard_normal((rank, cfg.n_embd)) * 0.1).astype(np.float16)
        out[C.tensor(C.PRED_FC2, i)] = (rng.standard_normal((cfg.n_ff, rank)) * 0.1).astype(np.float16)
    return out


def write_tiny(path, cfg: ModelConfig | None = None, seed: int = 0, powerinfer: bool = False, **kw):
    cfg = cfg or tiny_config(**kw)
    w = random_weights(cfg, seed)
    if powerinfer:
        w = to_powerinfer_layout(cfg, w)
    write_llama(path, cfg, w, powerinfer=powerinfer)
    return cfg, w
