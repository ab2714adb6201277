"""Skeleton GGUFs: real-sized models without weights, for planning benchmarks and demos.

A skeleton holds a model's metadata, declares every weight tensor (name, ggml shape, type) in metadata keys
(formats/constants.py SKELETON_*), and stores only the activation statistics as real tensors (blk.N.act_counts), so a
Llama2-70B skeleton is ~10 MB and any GGUF reader opens it. planner.memory.tensor_table reads the declarations, so
the planner accounts a skeleton and the real file to the same bytes.

Statistics are synthetic: per layer, sorted frequencies follow f(u) = min(1, a * u^-alpha) over the neuron rank
u in (0, 1]. alpha is set so that the hottest `hot_share` of neurons carry 80% of the activations and a so that the
mean frequency is 1 - sparsity (both from the PowerInfer paper), with per-layer jitter and lognormal noise,
and the neurons shuffled so that hot ones are not simply the first indices.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.errors import PinferError
from pinfer_llm.formats.writer import write_gguf


@dataclass(frozen=True)
class Shape:
    title: str
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    vocab: int
    n_ctx: int
    ffn_act: str  # relu (ReGLU / plain ReLU), drelu (Bamboo), silu (SwiGLU)
    sparsity: float  # mean share of neurons inactive per token
    hot_share: float  # share of neurons that carry 80% of the activations
    gate: bool = True
    predictor_rank: int = 1024  # 0: no predictor (dense, or CATS thresholds for SwiGLU)
    falcon: bool = False  # fused qkv, LayerNorm with biases, two norms per block
    tied: bool = False
    opt: bool = False  # LayerNorm and biases everywhere, learned positions


# Sparsity and hot shares from the PowerInfer paper; predictor sizes near its 5-9% of parameters.
SHAPES = {
    "llama2-7b": Shape("ReluLLaMA-7B", "llama", 32, 4096, 11008, 32, 32, 32000, 4096, "relu", 0.70, 0.30),
    "llama2-13b": Shape("ReluLLaMA-13B", "llama", 40, 5120, 13824, 40, 40, 32000, 4096, "relu", 0.78, 0.32),
    "llama2-70b": Shape("ReluLLaMA-70B", "llama", 80, 8192, 28672, 64, 8, 32000, 4096, "relu", 0.82, 0.43,
                        predictor_rank=1536),
    "falcon-40b": Shape("ReluFalcon-40B", "falcon", 60, 8192, 32768, 128, 8, 65024, 2048, "relu", 0.95, 0.30,
                        gate=False, falcon=True),
    "opt-30b": Shape("OPT-30B", "opt", 48, 7168, 28672, 56, 56, 50272, 2048, "relu", 0.97, 0.26, gate=False,
                     tied=True, opt=True),
    "bamboo-7b": Shape("Bamboo-7B", "bamboo", 32, 4096, 14336, 32, 8, 32000, 4096, "drelu", 0.90, 0.30),
    "smollm2-135m": Shape("SmolLM2-135M", "llama", 30, 576, 1536, 9, 3, 49152, 8192, "silu", 0.50, 0.45,
                          predictor_rank=0, tied=True),
}

QUANTS = {  # name -> (block weights, output head, token embeddings)
    "f16": (T.F16, T.F16, T.F16),
    "q8_0": (T.Q8_0, T.Q8_0, T.Q8_0),
    "q4_0": (T.Q4_0, T.Q6_K, T.Q4_0),  # llama.cpp keeps the output head at Q6_K
    "q4_k": (T.Q4_K, T.Q6_K, T.Q4_K),
}


def _fits(ne0: int, qtype: T) -> T:
    """llama.cpp falls back to Q8_0 (then F16) where a row is not a whole number of quant blocks."""
    for t in (qtype, T.Q8_0, T.F16):
        if ne0 % GGML_QUANT_SIZES[t][0] == 0:
            return t
    return T.F32


def tensor_specs(s: Shape, quant: str) -> list[tuple[str, tuple[int, ...], T]]:
    """(name, numpy shape, type) for every weight tensor of the shape."""
    wq, out_q, emb_q = QUANTS[quant]
    e, ff, hd = s.n_embd, s.n_ff, s.n_embd // s.n_head
    kv = s.n_head_kv * hd
    specs = [(C.TOKEN_EMBD, (s.vocab, e), _fits(e, emb_q)), ("output_norm.weight", (e,), T.F32)]
    if s.falcon or s.opt:
        specs.append((C.OUTPUT_NORM_B, (e,), T.F32))
    if s.opt:
        specs.append((C.POS_EMBD, (s.n_ctx + C.OPT_POS_OFFSET, e), _fits(e, emb_q)))
    if not s.tied:
        specs.append((C.OUTPUT, (s.vocab, e), _fits(e, out_q)))
    for b in range(s.n_layer):
        t = lambda template, b=b: C.tensor(template, b)  # noqa: E731
        if s.falcon:
            specs += [(t(C.ATTN_NORM), (e,), T.F32), (f"blk.{b}.attn_norm.bias", (e,), T.F32),
                      (f"blk.{b}.attn_norm_2.weight", (e,), T.F32), (f"blk.{b}.attn_norm_2.bias", (e,), T.F32),
                      (f"blk.{b}.attn_qkv.weight", (e + 2 * kv, e), _fits(e, wq))]
        else:
            specs += [(t(C.ATTN_NORM), (e,), T.F32), (t(C.ATTN_Q), (e, e), _fits(e, wq)),
                      (t(C.ATTN_K), (kv, e), _fits(e, wq)), (t(C.ATTN_V), (kv, e), _fits(e, wq)),
                      (t(C.FFN_NORM), (e,), T.F32)]
        if s.opt:
            specs += [(t(name), (n,), T.F32) for name, n in ((C.ATTN_NORM_B, e), (C.ATTN_Q_B, e), (C.ATTN_K_B, kv),
                                                              (C.ATTN_V_B, kv), (C.ATTN_OUT_B, e), (C.FFN_NORM_B, e),
                                                              (C.FFN_UP_B, ff))]
        specs.append((t(C.ATTN_OUT), (e, e), _fits(e, wq)))
        if s.gate:
            specs.append((t(C.FFN_GATE), (ff, e), _fits(e, wq)))
        specs.append((t(C.FFN_UP), (ff, e), _fits(e, wq)))
        if s.predictor_rank:  # PowerInfer layout: down transposed, so one index list slices all three
            specs += [(t(C.FFN_DOWN_T), (ff, e), _fits(e, wq)),
                      (t(C.PRED_FC1), (s.predictor_rank, e), T.F16), (t(C.PRED_FC2), (ff, s.predictor_rank), T.F16)]
            if s.opt:  # PowerInfer's converter renames the down bias with its weight
                specs.append((t(C.FFN_DOWN_T_B), (e,), T.F32))
        else:
            specs.append((t(C.FFN_DOWN), (e, ff), _fits(ff, wq)))
            if s.opt:
                specs.append((t(C.FFN_DOWN_B), (e,), T.F32))
    return specs


def power_law_frequencies(n_ff: int, sparsity: float, hot_share: float, rng: np.random.Generator,
                          noise: float = 0.1) -> np.ndarray:
    """Sorted-descending frequencies with mean 1 - sparsity and 80% of the mass in the top hot_share."""
    alpha = 1.0 - math.log(0.8) / math.log(hot_share)
    u = (np.arange(n_ff) + 0.5) / n_ff
    target = 1.0 - sparsity
    lo, hi = 0.0, 1.0
    for _ in range(60):  # the cap at 1 lowers the mean: find a by bisection
        a = (lo + hi) / 2
        if np.minimum(1.0, a * u ** -alpha).mean() < target:
            lo = a
        else:
            hi = a
    f = np.minimum(1.0, lo * u ** -alpha) * np.exp(noise * rng.standard_normal(n_ff))
    return np.sort(np.clip(f, 0.0, 1.0))[::-1]


def synthetic_counts(n_layer: int, n_ff: int, sparsity: float, hot_share: float, tokens: int,
                     seed: int = 0) -> list[np.ndarray]:
    """Per-layer F32 activation counts in shuffled neuron order."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_layer):
        s = float(np.clip(sparsity + rng.uniform(-0.05, 0.05), 0.0, 0.99))
        h = float(np.clip(hot_share * rng.uniform(0.85, 1.15), 0.05, 0.95))
        f = power_law_frequencies(n_ff, s, h, rng)
        out.append(np.round(rng.permutation(f) * tokens).astype(np.float32))
    return out


def make_skeleton(shape: str, path: str | os.PathLike, *, quant: str = "q4_0", predictors: bool | None = None,
                  seed: int = 0, tokens: int = 1_000_000, sparsity: float | None = None,
                  hot_share: float | None = None, n_layer: int | None = None) -> Path:
    """Write a skeleton GGUF of a known shape with synthetic statistics; returns its path.

    n_layer keeps only the first layers (tests plan scaled-down models quickly)."""
    key = shape.lower()
    if key not in SHAPES:
        import difflib

        close = difflib.get_close_matches(key, SHAPES, n=3, cutoff=0.4)
        raise PinferError(f"unknown shape '{shape}'; known: {', '.join(SHAPES)}"
                          + (f" (close: {', '.join(close)})" if close else ""))
    if quant not in QUANTS:
        raise PinferError(f"unknown --quant '{quant}' (one of {', '.join(QUANTS)})")
    s = SHAPES[key]
    if predictors is False:
        s = replace(s, predictor_rank=0)
    elif predictors and not s.predictor_rank:
        s = replace(s, predictor_rank=max(256, s.n_embd // 4))
    if sparsity is not None:
        if not 0 <= sparsity < 1:
            raise PinferError(f"--sparsity is a fraction in [0, 1), got {sparsity}")
        s = replace(s, sparsity=sparsity)
    if n_layer is not None:
        if not 1 <= n_layer <= s.n_layer:
            raise PinferError(f"n_layer must be in 1..{s.n_layer} for {key}, got {n_layer}")
        s = replace(s, n_layer=n_layer)
    if hot_share is not None:
        if not 0 < hot_share < 1:
            raise PinferError(f"--hot-share is a fraction in (0, 1), got {hot_share}")
        s = replace(s, hot_share=hot_share)
    specs = tensor_specs(s, quant)
    a = s.arch
    meta = {
        C.ARCHITECTURE: a,
        C.NAME: f"{s.title} {quant.upper()} (skeleton)",
        C.arch_key(C.BLOCK_COUNT, a): np.uint32(s.n_layer),
        C.arch_key(C.CONTEXT_LENGTH, a): np.uint32(s.n_ctx),
        C.arch_key(C.EMBEDDING_LENGTH, a): np.uint32(s.n_embd),
        C.arch_key(C.FEED_FORWARD_LENGTH, a): np.uint32(s.n_ff),
        C.arch_key(C.HEAD_COUNT, a): np.uint32(s.n_head),
        C.arch_key(C.HEAD_COUNT_KV, a): np.uint32(s.n_head_kv),
        C.arch_key(C.VOCAB_SIZE, a): np.uint32(s.vocab),
        C.FFN_ACTIVATION: s.ffn_act,
        C.SKELETON: True,
        C.SKELETON_SHAPE: key,
        C.SKELETON_TENSOR_NAMES: [n for n, _, _ in specs],
        C.SKELETON_TENSOR_TYPES: np.array([int(t) for _, _, t in specs], dtype=np.uint32),
        C.SKELETON_TENSOR_N_DIMS: np.array([len(sh) for _, sh, _ in specs], dtype=np.uint32),
        C.SKELETON_TENSOR_NE: np.array([d for _, sh, _ in specs for d in (tuple(reversed(sh)) + (1,) * 4)[:4]],
                                       dtype=np.uint64),
        C.ACT_TOKENS: np.uint64(tokens),
        C.ACT_CORPUS: f"synthetic power law (seed {seed}, sparsity {s.sparsity:g}, hot share {s.hot_share:g})",
        C.ACT_RULE: "synthetic",
    }
    if s.falcon:  # as llama.cpp's converter writes them
        meta[C.arch_key(C.LAYER_NORM_EPS, a)] = np.float32(1e-5)
        meta[C.arch_key(C.TENSOR_DATA_LAYOUT, a)] = "jploski"
    elif not s.opt:  # PowerInfer writes no epsilon for OPT
        meta[C.arch_key(C.RMS_EPS, a)] = np.float32(1e-5)
    if s.opt:  # the position table's rows, as PowerInfer writes it
        meta[C.arch_key(C.CONTEXT_LENGTH, a)] = np.uint32(s.n_ctx + C.OPT_POS_OFFSET)
    counts = synthetic_counts(s.n_layer, s.n_ff, s.sparsity, s.hot_share, tokens, seed)
    tensors = {C.tensor(C.ACT_COUNTS, b): c for b, c in enumerate(counts)}
    return write_gguf(path, meta, tensors)


def skeleton_from(model: str | os.PathLike, path: str | os.PathLike) -> Path:
    """A skeleton of an existing model: its metadata, its tensors declared, and only its statistics stored."""
    from pinfer_llm.formats.reader import open_gguf
    from pinfer_llm.planner.memory import model_tensors, tensor_table

    f = open_gguf(model)
    declared = model_tensors(tensor_table(f))
    meta = {k: v for k, v in f.metadata.items() if not k.startswith("pinfer.skeleton.")}
    meta.update({
        C.SKELETON: True,
        C.SKELETON_SHAPE: Path(model).name,
        C.SKELETON_TENSOR_NAMES: [t.name for t in declared],
        C.SKELETON_TENSOR_TYPES: np.array([t.ggml_type for t in declared], dtype=np.uint32),
        C.SKELETON_TENSOR_N_DIMS: np.array([len(t.ne) for t in declared], dtype=np.uint32),
        C.SKELETON_TENSOR_NE: np.array([d for t in declared for d in (tuple(t.ne) + (1,) * 4)[:4]], dtype=np.uint64),
    })
    types = {k: v for k, v in f.value_types.items() if k in meta}
    kept = {n: np.array(f.raw(n)) for n in f.tensors if n not in {t.name for t in declared}}
    return write_gguf(path, meta, kept, value_types=types)
