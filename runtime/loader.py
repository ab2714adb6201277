"""Build a Transformer from a GGUF file: one place maps GGUF tensor names to runtime weights.

No weight is copied: every matrix is a QWeight over the file's read-only memory map (runtime/weights.py), so loading
is parsing the header plus these views, and a model needs about its file size in memory. Two exceptions, both
reported in Load.notices: types without a C++ kernel (and everything when the kernels are unavailable) run on float32
copies made on first use, and sparse mode over a file without PowerInfer's neuron-major ffn_down_t transposes
ffn_down once, in memory, in the file's own encoding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gguf.constants import GGMLQuantizationType as T

from formats import constants as C
from formats.config import ModelConfig
from formats.errors import PinferError
from formats.reader import GGUFFile

from . import cpu_kernels, qops
from .ffn_dense import DenseFFN
from .ffn_sparse import CatsOracleMasker, PredictorMasker, ReluOracleMasker, SparseFFN, outlier_neurons
from .linear import Embedding, Linear
from .model import BlockWeights, Transformer
from .predictor import load_predictors
from .sparse_ops import FFNRows
from .weights import QWeight, quantize_like, qweight, vector


@dataclass
class Load:
    """What loading decided that the user should hear about (pi-run prints these on stderr)."""

    notices: list[str] = field(default_factory=list)
    float_copies: dict[str, int] = field(default_factory=dict)  # type name -> bytes of float32 copies
    transposed_bytes: int = 0
    transposed_s: float = 0.0


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


def transposed(w: QWeight) -> QWeight:
    """W^T in anonymous memory: ffn_down [d, n_ff] -> neuron-major [n_ff, d] rows, for sparse mode over a file without
    ffn_down_t. Float types stay as they are (exact). Block types must be requantised, since a neuron's column
    shares its blocks with 31 others; they become Q8_0: requantising SmolLM2's Q4_1 down projection as Q4_1 cost
    +6.1% held-out perplexity, as Q8_0 +0.02% (benchmarks/down_t_cost.py), for 1.7x the bytes of those rows."""
    target = w.qtype if w.qtype in (T.F32, T.F16, T.BF16, T.Q8_0) else T.Q8_0
    return quantize_like(qops.rows(w, 0, w.rows).T.contiguous(), target, w.name.replace("ffn_down", "ffn_down_t"))


def ffn_rows(f: GGUFFile, cfg: ModelConfig, i: int, sparse: bool, load: Load) -> tuple[FFNRows, Linear | None]:
    """The layer's FFN rows and, for files that store ffn_down, the dense down projection. Sparse execution needs
    neuron-major down rows: the file's ffn_down_t, or ffn_down transposed once in memory."""
    t = lambda template: C.tensor(template, i)  # noqa: E731
    gate, up = qweight(f, t(C.FFN_GATE)), qweight(f, t(C.FFN_UP))
    down, down_t = None, None
    if cfg.down_transposed:
        down_t = qweight(f, t(C.FFN_DOWN_T))
    else:
        w = qweight(f, t(C.FFN_DOWN))
        down = Linear([w])
        if sparse and f.has(t(C.FFN_DOWN_T)):  # stored beside ffn_down by `pi-profile --store-down-t`
            down_t = qweight(f, t(C.FFN_DOWN_T))
        elif sparse:
            t0 = time.perf_counter()
            down_t = transposed(w)
            load.transposed_s += time.perf_counter() - t0
            load.transposed_bytes += down_t.nbytes
    return FFNRows(gate, up, down_t, cfg.ffn_act), down


def maskers(f: GGUFFile, cfg: ModelConfig, mode: str) -> list:
    """One masker per layer for the sparse modes (see runtime/ffn_sparse.py)."""
    if mode == "sparse":
        peaks = [vector(f, C.tensor(C.ACT_PEAK, i)) if f.has(C.tensor(C.ACT_PEAK, i)) else None
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


def load_block(f: GGUFFile, cfg: ModelConfig, i: int, masker, load: Load) -> BlockWeights:
    t = lambda template: C.tensor(template, i)  # noqa: E731
    rows, down = ffn_rows(f, cfg, i, masker is not None, load)
    return BlockWeights(
        attn_norm=vector(f, t(C.ATTN_NORM)),
        wqkv=Linear([qweight(f, t(C.ATTN_Q)), qweight(f, t(C.ATTN_K)), qweight(f, t(C.ATTN_V))]),
        wo=Linear([qweight(f, t(C.ATTN_OUT))]),
        ffn_norm=vector(f, t(C.FFN_NORM)),
        ffn=DenseFFN(rows, down) if masker is None else SparseFFN(rows, masker),
    )


def _matrices(tr: Transformer) -> list[QWeight]:
    """The weights the layers multiply by (the token embedding only decodes the rows it is asked for)."""
    out = [*tr.output.ws]
    for b in tr.blocks:
        out += [*b.wqkv.ws, *b.wo.ws]
        rows = b.ffn.rows if isinstance(b.ffn, DenseFFN) else b.ffn.w
        out += [w for w in (rows.gate, rows.up, rows.down_t) if w is not None]
        if isinstance(b.ffn, DenseFFN) and b.ffn.down is not None:
            out += b.ffn.down.ws
    return out


def _report(tr: Transformer, load: Load) -> None:
    """The costs loading could not avoid, one line each."""
    kernels = qops.available()
    for w in _matrices(tr):
        if (kernels and w.in_kernel) or w.qtype == T.F32:
            continue  # read in place (torch reads F32 rows as they are mapped)
        load.float_copies[w.type_name] = load.float_copies.get(w.type_name, 0) + w.rows * w.cols * 4
    if load.float_copies:
        gb = sum(load.float_copies.values()) / 1e9
        types = ", ".join(sorted(load.float_copies))
        why = (f"the C++ kernels are unavailable ({cpu_kernels.status()})" if not kernels
               else f"pinfer has no kernel for {types}")
        load.notices.append(f"{why}: those weights run on float32 copies made on first use ({gb:.2f} GB more "
                            f"memory; requantise to Q4_0, Q8_0 or F16 to avoid it)")
    if load.transposed_bytes:
        load.notices.append(f"sparse mode: the file has no ffn_down_t, so ffn_down was transposed in memory "
                            f"({load.transposed_bytes / 1e9:.2f} GB, {load.transposed_s:.1f} s); "
                            f"`pi-profile MODEL --store-down-t` stores it in the file once")


def load_transformer(f: GGUFFile, cfg: ModelConfig, max_ctx: int = 4096, ffn_mode: str = "dense",
                     progress=None) -> tuple[Transformer, Load]:
    """ffn_mode: "dense"; "sparse" (predictors decide each token's neurons); "oracle" (exact masks)."""
    if ffn_mode not in FFN_MODES:
        raise PinferError(f"unknown FFN mode '{ffn_mode}' (choose {', '.join(FFN_MODES)})")
    check_shapes(f, cfg)
    masks = maskers(f, cfg, ffn_mode) if ffn_mode != "dense" else [None] * cfg.n_layer
    load = Load()
    blocks = []
    for i in range(cfg.n_layer):
        blocks.append(load_block(f, cfg, i, masks[i], load))
        if progress:
            progress(i + 1, cfg.n_layer)
    out_name = C.TOKEN_EMBD if cfg.tied_embeddings else C.OUTPUT
    tr = Transformer(cfg, blocks, Embedding(qweight(f, C.TOKEN_EMBD)), vector(f, C.OUTPUT_NORM),
                     Linear([qweight(f, out_name)]), max_ctx)
    _report(tr, load)
    return tr, load
