"""A compact float32 Llama forward over a synth model's weights: the golden reference for the runtime.

The same functions drive the generator's layer-by-layer calibration (synth/generator.py), so a synth model is
calibrated by exactly the arithmetic its golden test checks. RMSNorm, "normal" RoPE on adjacent pairs as in GGUF
files, GQA attention, ReGLU/dReLU.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

from formats import constants as C
from formats.errors import PinferError
from formats.reader import GGUFFile, open_gguf

# --- a compact Llama forward (shared by calibration and the golden reference) ---------------------------------------

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary embedding as llama.cpp's mode 0 applies it to GGUF weights: pairs are adjacent elements (2i, 2i+1).

    x: (B, S, H, hd); pos: (S,)."""
    hd = x.shape[-1]
    inv = base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)  # (hd/2,)
    ang = pos.to(torch.float64)[:, None] * inv[None, :]  # (S, hd/2)
    cos, sin = ang.cos().to(x.dtype)[:, None, :], ang.sin().to(x.dtype)[:, None, :]  # (S, 1, hd/2)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


def attention_heads(xn: torch.Tensor, wq, wk, wv, n_head: int, n_head_kv: int, base: float) -> torch.Tensor:
    """Causal GQA self-attention over whole sequences, before the output projection: (B, S, n_head * hd).
    xn: (B, S, d) normalised input; weights in GGUF numpy shape."""
    B, S, _ = xn.shape
    hd = wq.shape[0] // n_head
    pos = torch.arange(S)
    q = rope((xn @ wq.T).view(B, S, n_head, hd), pos, base).transpose(1, 2)  # (B, nh, S, hd)
    k = rope((xn @ wk.T).view(B, S, n_head_kv, hd), pos, base).transpose(1, 2)  # (B, nkv, S, hd)
    v = (xn @ wv.T).view(B, S, n_head_kv, hd).transpose(1, 2)
    if n_head != n_head_kv:  # query head h reads kv head h // (n_head / n_head_kv)
        k = k.repeat_interleave(n_head // n_head_kv, dim=1)
        v = v.repeat_interleave(n_head // n_head_kv, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, S, hd)
    return o.transpose(1, 2).reshape(B, S, n_head * hd)


def attention(xn: torch.Tensor, wq, wk, wv, wo, n_head: int, n_head_kv: int, base: float) -> torch.Tensor:
    return attention_heads(xn, wq, wk, wv, n_head, n_head_kv, base) @ wo.T


def ffn_hidden(xn: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """The FFN's hidden activations h (..., n_ff); the FFN output is h @ down_t."""
    return activate(xn @ gate.T, xn @ up.T, act)


def activate(g: torch.Tensor, u: torch.Tensor, act: str) -> torch.Tensor:
    if act == "relu":
        return F.relu(g) * u
    if act == "drelu":
        return F.relu(g) * F.relu(u)
    return F.silu(g) * u


# --- reading a synth model back: the golden reference forward -------------------------------------------------------

def target_frequencies(f: GGUFFile) -> np.ndarray:
    """[n_layer, n_ff] planted frequencies stored in a synth model's metadata."""
    n_layer = int(f.arch_get(C.BLOCK_COUNT))
    key = C.tensor(C.SYNTH_TARGET_FREQ, 0)
    if key not in f.metadata:
        raise PinferError(f"{f.path}: no planted frequencies ({key}); not a model written by synth")
    return np.stack([np.asarray(f.metadata[C.tensor(C.SYNTH_TARGET_FREQ, i)], dtype=np.float32)
                     for i in range(n_layer)])


def _w(f: GGUFFile, name: str) -> torch.Tensor:
    a = f.raw(name)
    if a.dtype not in (np.float32, np.float16):
        raise PinferError(f"{f.path}: tensor '{name}' is {f.info(name).type_name}; the reference forward reads "
                          f"F32/F16 only")
    return torch.from_numpy(np.asarray(a, dtype=np.float32))


@torch.no_grad()
def reference_forward(f: GGUFFile | str | os.PathLike, ids, *, collect_activity: bool = False):
    """Logits (T, vocab) as float32 numpy for one sequence of token ids, computed in float32 from the file's
    weights. With collect_activity, also returns a bool tensor (n_layer, T, n_ff): which neurons fired."""
    from formats.config import config_from_gguf

    f = f if isinstance(f, GGUFFile) else open_gguf(f)
    cfg = config_from_gguf(f)
    ids = torch.as_tensor(np.asarray(ids, dtype=np.int64)).view(1, -1)
    x = _w(f, C.TOKEN_EMBD)[ids]  # (1, T, d)
    active = []
    for bid in range(cfg.n_layer):
        w = lambda tpl: _w(f, C.tensor(tpl, bid))  # noqa: B023, E731
        xn = rms_norm(x, w(C.ATTN_NORM), cfg.norm_eps)
        x = x + attention(xn, w(C.ATTN_Q), w(C.ATTN_K), w(C.ATTN_V), w(C.ATTN_OUT), cfg.n_head, cfg.n_head_kv,
                          cfg.rope_base)
        xn = rms_norm(x, w(C.FFN_NORM), cfg.norm_eps)
        h = ffn_hidden(xn, w(C.FFN_GATE), w(C.FFN_UP), cfg.ffn_act)
        if collect_activity:
            active.append(h[0] != 0)
        down_t = w(C.FFN_DOWN_T) if cfg.down_transposed else w(C.FFN_DOWN).T
        x = x + h @ down_t
    out = _w(f, C.OUTPUT) if f.has(C.OUTPUT) else _w(f, C.TOKEN_EMBD)
    logits = (rms_norm(x, _w(f, C.OUTPUT_NORM), cfg.norm_eps) @ out.T)[0].numpy()
    return (logits, torch.stack(active)) if collect_activity else logits


def measure_frequencies(f: GGUFFile | str | os.PathLike, n_tokens: int = 4096, seq_len: int = 128,
                        seed: int = 12345) -> np.ndarray:
    """[n_layer, n_ff] activation frequencies of the reference forward over fresh random token sequences."""
    f = f if isinstance(f, GGUFFile) else open_gguf(f)
    V = len(f.metadata[C.TOKENIZER_TOKENS])
    g = torch.Generator().manual_seed(seed)
    counts, total = None, 0
    for _ in range(max(1, n_tokens // seq_len)):
        ids = torch.randint(0, V, (seq_len,), generator=g)
        _, act = reference_forward(f, ids, collect_activity=True)
        c = act.sum(1).double()
        counts = c if counts is None else counts + c
        total += seq_len
    return (counts / total).float().numpy()
