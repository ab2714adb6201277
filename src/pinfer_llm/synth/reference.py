"""A compact float32 decoder forward over a synth model's weights: the golden reference for the runtime.

The same functions drive the generator's layer-by-layer calibration (synth/generator.py), so a synth model is
calibrated by exactly the arithmetic its golden test checks. Llama family: RMSNorm, "normal" RoPE on adjacent pairs
as in GGUF files, GQA attention, ReGLU/dReLU. Falcon: LayerNorm, NeoX RoPE (half-split pairs), the parallel block,
relu(up x). OPT: LayerNorm, learned positions, biases on every projection, relu(up x + b).
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.errors import PinferError
from pinfer_llm.formats.header import GGUFFile
from pinfer_llm.formats.reader import open_gguf

# --- a compact decoder forward (shared by calibration and the golden reference) -------------------------------------

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float) -> torch.Tensor:
    c = x - x.mean(-1, keepdim=True)
    y = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps) * w
    return y if b is None else y + b


def norm(x: torch.Tensor, p: tuple, eps: float) -> torch.Tensor:
    """p: (weight,) for RMSNorm or (weight, bias) for LayerNorm (bias may be None)."""
    return rms_norm(x, p[0], eps) if len(p) == 1 else layer_norm(x, p[0], p[1], eps)


def rope(x: torch.Tensor, pos: torch.Tensor, base: float, kind: str = "normal") -> torch.Tensor:
    """Rotary embedding as llama.cpp applies it to GGUF weights: mode 0 ("normal") rotates adjacent pairs (2i, 2i+1),
    NeoX mode ("neox", Falcon) the halves (i, i + hd/2); "none" (OPT) leaves x as it is.

    x: (B, S, H, hd); pos: (S,)."""
    if kind == "none":
        return x
    hd = x.shape[-1]
    inv = base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)  # (hd/2,)
    ang = pos.to(torch.float64)[:, None] * inv[None, :]  # (S, hd/2)
    cos, sin = ang.cos().to(x.dtype)[:, None, :], ang.sin().to(x.dtype)[:, None, :]  # (S, 1, hd/2)
    if kind == "neox":
        x0, x1 = x[..., :hd // 2], x[..., hd // 2:]
        return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


def attention_heads(xn: torch.Tensor, wq, wk, wv, n_head: int, n_head_kv: int, base: float, rope_kind: str = "normal",
                    bias: tuple | None = None) -> torch.Tensor:
    """Causal GQA self-attention over whole sequences, before the output projection: (B, S, n_head * hd).
    xn: (B, S, d) normalised input; weights in GGUF numpy shape; bias: (bq, bk, bv) or None."""
    B, S, _ = xn.shape
    hd = wq.shape[0] // n_head
    pos = torch.arange(S)
    bq, bk, bv = bias or (0.0, 0.0, 0.0)
    q = rope((xn @ wq.T + bq).view(B, S, n_head, hd), pos, base, rope_kind).transpose(1, 2)  # (B, nh, S, hd)
    k = rope((xn @ wk.T + bk).view(B, S, n_head_kv, hd), pos, base, rope_kind).transpose(1, 2)  # (B, nkv, S, hd)
    v = (xn @ wv.T + bv).view(B, S, n_head_kv, hd).transpose(1, 2)
    if n_head != n_head_kv:  # query head h reads kv head h // (n_head / n_head_kv)
        k = k.repeat_interleave(n_head // n_head_kv, dim=1)
        v = v.repeat_interleave(n_head // n_head_kv, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, S, hd)
    return o.transpose(1, 2).reshape(B, S, n_head * hd)


def ffn_hidden(xn: torch.Tensor, gate: torch.Tensor | None, up: torch.Tensor, act: str,
               up_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The FFN's hidden activations h (..., n_ff); the FFN output is h @ down_t. gate None: act(up x + b)."""
    u = xn @ up.T if up_bias is None else xn @ up.T + up_bias
    if gate is None:
        return F.relu(u) if act == "relu" else F.gelu(u)
    return activate(xn @ gate.T, u, act)


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
    return torch.from_numpy(np.array(a, dtype=np.float32))  # a copy: F32 tensors would be read-only map views


def _opt(f: GGUFFile, name: str) -> torch.Tensor | None:
    return _w(f, name) if f.has(name) else None


@torch.no_grad()
def reference_forward(f: GGUFFile | str | os.PathLike, ids, *, collect_activity: bool = False):
    """Logits (T, vocab) as float32 numpy for one sequence of token ids, computed in float32 from the file's
    weights. With collect_activity, also returns a bool tensor (n_layer, T, n_ff): which neurons fired."""
    from pinfer_llm.formats.config import config_from_gguf

    f = f if isinstance(f, GGUFFile) else open_gguf(f)
    cfg = config_from_gguf(f)
    ids = torch.as_tensor(np.asarray(ids, dtype=np.int64)).view(1, -1)
    x = _w(f, C.TOKEN_EMBD)[ids]  # (1, T, d)
    if cfg.arch == "opt":
        x = x + _w(f, C.POS_EMBD)[torch.arange(ids.shape[1]) + C.OPT_POS_OFFSET]
    nrm = lambda wname, bname: (_w(f, wname), _opt(f, bname)) if cfg.layer_norm else (_w(f, wname),)  # noqa: E731
    q_rows, kv_rows = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    active = []
    for bid in range(cfg.n_layer):
        t = lambda tpl: C.tensor(tpl, bid)  # noqa: B023, E731
        if cfg.arch == "falcon":
            ffn_n = nrm(t(C.ATTN_NORM), t(C.ATTN_NORM_B))
            attn_n = nrm(t(C.ATTN_NORM_2), t(C.ATTN_NORM_2_B)) if f.has(t(C.ATTN_NORM_2)) else ffn_n
            wq, wk, wv = torch.split(_w(f, t(C.ATTN_QKV)), [q_rows, kv_rows, kv_rows])
            bias = None
        else:
            attn_n, ffn_n = nrm(t(C.ATTN_NORM), t(C.ATTN_NORM_B)), nrm(t(C.FFN_NORM), t(C.FFN_NORM_B))
            wq, wk, wv = _w(f, t(C.ATTN_Q)), _w(f, t(C.ATTN_K)), _w(f, t(C.ATTN_V))
            bias = (_w(f, t(C.ATTN_Q_B)), _w(f, t(C.ATTN_K_B)), _w(f, t(C.ATTN_V_B))) if f.has(t(C.ATTN_Q_B)) else None
        heads = attention_heads(norm(x, attn_n, cfg.norm_eps), wq, wk, wv, cfg.n_head, cfg.n_head_kv, cfg.rope_base,
                                cfg.rope, bias)
        a = heads @ _w(f, t(C.ATTN_OUT)).T
        bo = _opt(f, t(C.ATTN_OUT_B))
        a = a if bo is None else a + bo
        if cfg.parallel:  # Falcon: the FFN reads the layer input, both branches add to it
            xn, x = norm(x, ffn_n, cfg.norm_eps), x + a
        else:
            x = x + a
            xn = norm(x, ffn_n, cfg.norm_eps)
        gate = _w(f, t(C.FFN_GATE)) if cfg.gated else None
        h = ffn_hidden(xn, gate, _w(f, t(C.FFN_UP)), cfg.ffn_act, _opt(f, t(C.FFN_UP_B)))
        if collect_activity:
            active.append(h[0] != 0)
        down_t = _w(f, t(C.FFN_DOWN_T)) if cfg.down_transposed else _w(f, t(C.FFN_DOWN)).T
        x = x + h @ down_t
        b_down = _opt(f, t(C.FFN_DOWN_T_B)) if cfg.down_transposed else _opt(f, t(C.FFN_DOWN_B))
        if b_down is not None:
            x = x + b_down
    out = _w(f, C.OUTPUT) if f.has(C.OUTPUT) else _w(f, C.TOKEN_EMBD)
    logits = (norm(x, nrm(C.OUTPUT_NORM, C.OUTPUT_NORM_B), cfg.norm_eps) @ out.T)[0].numpy()
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
