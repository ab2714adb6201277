"""Build a Transformer from a GGUF file: one place maps GGUF tensor names to runtime weights.

No weight is copied: every matrix is a QWeight over the file's read-only memory map (runtime/weights.py), so loading
is parsing the header plus these views, and a model needs about its file size in memory. Two exceptions, both
reported in Load.notices: the types only dot products read (Q5_0, Q5_1, the K-quants, IQ4) are re-encoded once as
Q4_1 or Q8_0 where they would be neuron rows, which axpy reads (without the kernels, everything runs on float32 copies
made on first use), and sparse mode over a file without PowerInfer's neuron-major ffn_down_t transposes ffn_down once,
in memory, in the file's own encoding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from gguf.constants import GGMLQuantizationType as T

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.config import ModelConfig
from pinfer_llm.formats.errors import PinferError, quote
from pinfer_llm.formats.header import GGUFFile
from pinfer_llm.formats.reader import check_mappable
from pinfer_llm.runtime.cpu import kernels as cpu_kernels
from pinfer_llm.runtime.cpu import qops
from pinfer_llm.runtime.ffn.dense import DenseFFN
from pinfer_llm.runtime.ffn.ops import FFNRows
from pinfer_llm.runtime.ffn.predictor import load_predictors
from pinfer_llm.runtime.ffn.sparse import (
    CatsOracleMasker,
    PredictorMasker,
    ReluOracleMasker,
    SparseFFN,
    outlier_neurons,
)
from pinfer_llm.runtime.linear import Embedding, Linear
from pinfer_llm.runtime.model import BlockWeights, Norm, Transformer
from pinfer_llm.runtime.weights import (
    ROW_TYPES,
    QWeight,
    has_nonfinite,
    quantize_like,
    qweight,
    rows_runnable,
    runnable,
    vector,
)


@dataclass
class Load:
    """What loading decided that the user should hear about (pi-run prints these on stderr)."""

    notices: list[str] = field(default_factory=list)
    float_copies: dict[str, int] = field(default_factory=dict)  # type name -> bytes of float32 copies
    requantised: dict[tuple[str, str], int] = field(default_factory=dict)  # (type, its re-encoding) -> bytes
    requantised_s: float = 0.0
    requantised_rows: set[str] = field(default_factory=set)  # types re-encoded only as neuron rows (dot-only types)
    transposed_bytes: int = 0
    transposed_s: float = 0.0


def expected_shapes(f: GGUFFile, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the forward pass reads, with the shape the metadata implies: the required ones, and the optional
    ones (biases, falcon's attn_norm_2, an untied output) where the file has them."""
    d, ff, hd = cfg.n_embd, cfg.n_ff, cfg.head_dim
    q, kv = cfg.n_head * hd, cfg.n_head_kv * hd
    expect = {C.TOKEN_EMBD: (cfg.vocab_size, d), C.OUTPUT_NORM: (d,)}
    optional = {C.OUTPUT_NORM_B: (d,)}
    if not cfg.tied_embeddings:
        expect[C.OUTPUT] = (cfg.vocab_size, d)
    if cfg.arch == "opt":
        expect[C.POS_EMBD] = (cfg.n_ctx_train + C.OPT_POS_OFFSET, d)
    for i in range(cfg.n_layer):
        t = lambda template, i=i: C.tensor(template, i)  # noqa: E731
        expect.update({t(C.ATTN_NORM): (d,), t(C.ATTN_OUT): (d, q), t(C.FFN_UP): (ff, d)})
        optional.update({t(C.ATTN_NORM_B): (d,), t(C.ATTN_OUT_B): (d,), t(C.FFN_UP_B): (ff,), t(C.FFN_DOWN_B): (d,),
                         t(C.FFN_DOWN_T_B): (d,)})
        if cfg.arch == "falcon":
            expect[t(C.ATTN_QKV)] = (q + 2 * kv, d)
            optional.update({t(C.ATTN_QKV_B): (q + 2 * kv,), t(C.ATTN_NORM_2): (d,), t(C.ATTN_NORM_2_B): (d,)})
        else:
            expect.update({t(C.ATTN_Q): (q, d), t(C.ATTN_K): (kv, d), t(C.ATTN_V): (kv, d), t(C.FFN_NORM): (d,)})
            optional.update({t(C.ATTN_Q_B): (q,), t(C.ATTN_K_B): (kv,), t(C.ATTN_V_B): (kv,), t(C.FFN_NORM_B): (d,)})
        if cfg.gated:
            expect[t(C.FFN_GATE)] = (ff, d)
        if cfg.down_transposed:
            expect[t(C.FFN_DOWN_T)] = (ff, d)
        else:
            expect[t(C.FFN_DOWN)] = (d, ff)
    return expect | {name: shape for name, shape in optional.items() if f.has(name)}


def check_shapes(f: GGUFFile, cfg: ModelConfig) -> None:
    """Every tensor the forward pass needs exists and has the shape the metadata implies."""
    for name, shape in expected_shapes(f, cfg).items():
        got = f.info(name).shape  # raises "missing tensor" with the file name
        if tuple(got) != shape:
            raise PinferError(f"{f.path}: tensor {quote(name)} has shape {list(got)}, the metadata implies "
                              f"{list(shape)}; the file is inconsistent")


FFN_MODES = ("dense", "sparse", "oracle")


def transposed(w: QWeight) -> QWeight:
    """W^T in anonymous memory: ffn_down [d, n_ff] -> neuron-major [n_ff, d] rows, for sparse mode over a file without
    ffn_down_t. Float types stay as they are (exact). Block types must be requantised, since a neuron's column
    shares its blocks with 31 others; they become Q8_0: requantising SmolLM2's Q4_1 down projection as Q4_1 cost
    +6.1% held-out perplexity, as Q8_0 +0.02% (benchmarks/down_t_cost.py), for 1.7x the bytes of those rows."""
    target = w.qtype if w.qtype in (T.F32, T.F16, T.BF16, T.Q8_0) else T.Q8_0
    return quantize_like(qops.rows(w, 0, w.rows).T.contiguous(), target, w.name.replace("ffn_down", "ffn_down_t"))


def matrix(f: GGUFFile, name: str, load: Load, rows: bool = False) -> QWeight:
    """A weight the layers multiply by, read in place when a C++ kernel reads its type. Other types are re-encoded
    once into one the kernels read (none today; a float32 copy would cost 3.8x the memory and the bandwidth of every
    token). Q5_0, Q5_1, the K-quants of llama.cpp's Q4_K_M / Q5_K_M files (Q4_K or Q5_K for most matrices, Q6_K for
    attn_v, half the ffn_down and the output head of its Q4_0 files) and IQ4_NL / IQ4_XS are read in place by the dot
    products; rows=True: neuron rows that axpy adds up (ffn_down_t), which it does not read, so Q4_K as Q4_1 (its
    sub-blocks up to an f16 rounding of their scales, 1.1x the bytes) and the others as Q8_0 (Q5_0 exactly)."""
    w = qweight(f, name)
    if not qops.available() or (w.in_kernel and (not rows or w.qtype in ROW_TYPES)):
        return w
    t0 = time.perf_counter()
    q = rows_runnable(w) if w.in_kernel else runnable(w)
    if w.in_kernel:
        load.requantised_rows.add(w.type_name)
    load.requantised_s += time.perf_counter() - t0
    key = (w.type_name, q.type_name)
    load.requantised[key] = load.requantised.get(key, 0) + q.nbytes
    return q


def ffn_rows(f: GGUFFile, cfg: ModelConfig, i: int, sparse: bool, load: Load) -> tuple[FFNRows, Linear | None]:
    """The layer's FFN rows and, for files that store ffn_down, the dense down projection. Sparse execution needs
    neuron-major down rows: the file's ffn_down_t, or ffn_down transposed once in memory."""
    t = lambda template: C.tensor(template, i)  # noqa: E731
    gate = matrix(f, t(C.FFN_GATE), load) if cfg.gated else None
    up = matrix(f, t(C.FFN_UP), load)
    down, down_t = None, None
    if cfg.down_transposed:
        down_t = matrix(f, t(C.FFN_DOWN_T), load, rows=True)
    else:
        w = matrix(f, t(C.FFN_DOWN), load)
        down = Linear([w])
        if sparse and f.has(t(C.FFN_DOWN_T)):  # stored beside ffn_down by `pi-profile --store-down-t`
            down_t = matrix(f, t(C.FFN_DOWN_T), load, rows=True)
        elif sparse:
            t0 = time.perf_counter()
            down_t = transposed(w)
            load.transposed_s += time.perf_counter() - t0
            load.transposed_bytes += down_t.nbytes
    return FFNRows(gate, up, down_t, cfg.ffn_act, optional_vector(f, t(C.FFN_UP_B))), down


def maskers(f: GGUFFile, cfg: ModelConfig, mode: str) -> list:
    """One masker per layer for the sparse modes (see runtime/ffn/sparse.py)."""
    if mode == "sparse":
        check_predictors(f, cfg)
        peaks = [vector(f, C.tensor(C.ACT_PEAK, i)) if f.has(C.tensor(C.ACT_PEAK, i)) else None
                 for i in range(cfg.n_layer)]
        return [PredictorMasker(p, outlier_neurons(pk))
                for p, pk in zip(load_predictors(f, cfg.n_layer, fc2_t=True), peaks, strict=True)]
    if cfg.is_relu:
        return [ReluOracleMasker() for _ in range(cfg.n_layer)]
    if not cfg.gated:
        raise PinferError(f"{f.path}: this {cfg.arch} model's FFN is {cfg.ffn_act.upper()}, which is never exactly "
                          f"zero, so it has no exact masks; run it with --dense (ReluFalcon and OPT are ReLU)")
    thresholds = f.get(C.CATS_THRESHOLD)
    if thresholds is None or len(thresholds) != cfg.n_layer:
        raise PinferError(f"{f.path}: exact masks for a SwiGLU model need CATS thresholds; run "
                          f"`pi-profile {f.path.name} --sparsity 0.3` first, or run with --dense")
    return [CatsOracleMasker(float(thr)) for thr in thresholds]


def check_predictors(f: GGUFFile, cfg: ModelConfig) -> None:
    """Each layer's predictor fits its layer (fc1 [r, n_embd], fc2 [n_ff, r]) and holds finite values: a NaN
    predictor silently changed which neurons ran (the thresholds are checked where the file is read, formats/schema).
    Predictors are a few percent of the FFN, so every value is checked."""
    for i in range(cfg.n_layer):
        n1, n2 = C.tensor(C.PRED_FC1, i), C.tensor(C.PRED_FC2, i)
        if not (f.has(n1) and f.has(n2)):
            continue  # load_predictors says which layer has none
        s1, s2 = f.info(n1).shape, f.info(n2).shape
        if len(s1) != 2 or len(s2) != 2 or s1[1] != cfg.n_embd or s2 != (cfg.n_ff, s1[0]):
            raise PinferError(f"{f.path}: the predictor of layer {i} has fc1 {list(s1)} and fc2 {list(s2)}, but the "
                              f"layer needs fc1 [r, {cfg.n_embd}] and fc2 [{cfg.n_ff}, r]; retrain it with "
                              f"pi-profile --train-predictors")
        for name in (n1, n2):
            if has_nonfinite(qweight(f, name)):
                raise PinferError(f"{f.path}: predictor tensor {quote(name)} holds values that are not finite (NaN "
                                  f"or inf); retrain it with pi-profile --train-predictors")


def optional_vector(f: GGUFFile, name: str):
    return vector(f, name) if f.has(name) else None


def norm(f: GGUFFile, cfg: ModelConfig, weight: str, bias: str) -> Norm:
    return Norm(vector(f, weight), optional_vector(f, bias), cfg.norm_eps, cfg.layer_norm)


def qkv_bias(f: GGUFFile, cfg: ModelConfig, i: int):
    """q, k and v biases side by side as the fused projection's output is laid out (zeros for a missing one), or
    None when the layer has none."""
    templates = (C.ATTN_QKV_B,) if cfg.arch == "falcon" else (C.ATTN_Q_B, C.ATTN_K_B, C.ATTN_V_B)
    names = [C.tensor(t, i) for t in templates]
    if not any(f.has(n) for n in names):
        return None
    return torch.cat([vector(f, n) if f.has(n) else torch.zeros(f.info(n.replace(".bias", ".weight")).shape[0])
                      for n in names])


def load_block(f: GGUFFile, cfg: ModelConfig, i: int, masker, load: Load) -> BlockWeights:
    t = lambda template: C.tensor(template, i)  # noqa: E731
    rows, down = ffn_rows(f, cfg, i, masker is not None, load)
    if cfg.arch == "falcon":  # one attn_norm feeds both branches (7B), or attn_norm_2 feeds attention (40B layout)
        ffn_norm = norm(f, cfg, t(C.ATTN_NORM), t(C.ATTN_NORM_B))
        attn_norm = norm(f, cfg, t(C.ATTN_NORM_2), t(C.ATTN_NORM_2_B)) if f.has(t(C.ATTN_NORM_2)) else ffn_norm
        wqkv = Linear([matrix(f, t(C.ATTN_QKV), load)])  # already [all q | all k | all v] (llama.cpp's converter)
    else:
        attn_norm = norm(f, cfg, t(C.ATTN_NORM), t(C.ATTN_NORM_B))
        ffn_norm = norm(f, cfg, t(C.FFN_NORM), t(C.FFN_NORM_B))
        wqkv = Linear([matrix(f, t(tmpl), load) for tmpl in (C.ATTN_Q, C.ATTN_K, C.ATTN_V)])
    return BlockWeights(
        attn_norm=attn_norm,
        wqkv=wqkv,
        wo=Linear([matrix(f, t(C.ATTN_OUT), load)]),
        ffn_norm=ffn_norm,
        ffn=DenseFFN(rows, down) if masker is None else SparseFFN(rows, masker),
        bqkv=qkv_bias(f, cfg, i),
        bo=optional_vector(f, t(C.ATTN_OUT_B)),
        ffn_bias=optional_vector(f, t(C.FFN_DOWN_B) if f.has(t(C.FFN_DOWN_B)) else t(C.FFN_DOWN_T_B)),
        parallel=cfg.parallel,
    )


def _matrices(tr: Transformer) -> list[QWeight]:
    """The weights the layers multiply by (the token embedding only decodes the rows it is asked for)."""
    return [*tr.output.ws, *_block_matrices(tr.blocks)]


def _block_matrices(blocks: list[BlockWeights]) -> list[QWeight]:
    out = []
    for b in blocks:
        out += [*b.wqkv.ws, *b.wo.ws]
        rows = b.ffn.rows if isinstance(b.ffn, DenseFFN) else b.ffn.w
        out += [w for w in (rows.gate, rows.up, rows.down_t) if w is not None]
        if isinstance(b.ffn, DenseFFN) and b.ffn.down is not None:
            out += b.ffn.down.ws
    return out


CHECK_BYTES = 256 << 20  # weights up to this are checked for NaN/inf in full at load; more: every k-th row


def check_finite(f: GGUFFile, weights: list[QWeight]) -> None:
    """Refuse weights holding NaN or inf where they enter, not as garbage tokens later: NaN in five Q4_1 scales of a
    gate gave finite logits and "thelessthelessthe...". Reads every row (every block scale) of models up to
    CHECK_BYTES, rows at a stride beyond (a sampled check: ~50 ms for SmolLM2's 98 MB here, warm; a model 8x the
    budget reads one row in 8)."""
    unique = list({id(w.data): w for w in weights}.values())  # a tied output head is the embedding itself
    total = sum(w.nbytes for w in unique)
    stride = max(1, -(-total // CHECK_BYTES))
    for w in unique:
        if has_nonfinite(w, stride):
            raise PinferError(f"{f.path}: tensor {quote(w.name)} holds values that are not "
                              f"finite (NaN or inf): the model's weights are corrupt; download or convert it again")


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
    if load.requantised:
        # two reasons: a type no kernel reads, or a dot-only type as neuron rows (ffn_down_t), which axpy cannot read
        why = []
        for rows in (False, True):
            types = sorted({t for t, _ in load.requantised if (t in load.requantised_rows) == rows})
            if types:
                why.append(f"{', '.join(types)} neuron rows (ffn_down_t) are read by no axpy kernel" if rows
                           else f"pinfer has no kernel for {', '.join(types)}")
        how = ", ".join(f"{t} as {q}" for t, q in sorted(load.requantised))
        load.notices.append(f"{'; '.join(why)}: those weights were re-encoded at load ({how}; "
                            f"{sum(load.requantised.values()) / 1e9:.2f} GB of memory, {load.requantised_s:.1f} s); "
                            f"requantise the file to Q4_0, Q8_0 or F16 to avoid it")
    if load.transposed_bytes:
        load.notices.append(f"sparse mode: the file has no ffn_down_t, so ffn_down was transposed in memory "
                            f"({load.transposed_bytes / 1e9:.2f} GB, {load.transposed_s:.1f} s); "
                            f"`pi-profile MODEL --store-down-t` stores it in the file once")


KV_TYPES = {"f16": torch.float16, "f32": torch.float32}


def context_bytes(cfg: ModelConfig, ctx: int, kv_type: str) -> int:
    """What a context of `ctx` tokens allocates at load: the KV cache (K and V per layer) and the RoPE table (built
    in float64 and complex128 before it is kept as complex64: 20 bytes per token and head dimension at its peak)."""
    kv = 2 * cfg.n_layer * cfg.n_head_kv * cfg.head_dim * KV_TYPES[kv_type].itemsize
    return ctx * (kv + 20 * cfg.head_dim)


def check_context_memory(cfg: ModelConfig, ctx: int, kv_type: str) -> None:
    """A context the machine's memory cannot hold is one line before anything is allocated (-c 1000000000 failed
    after 36 s with "can't allocate 64 GB")."""
    from pinfer_llm.runtime.profiling.counting import available_ram_bytes

    avail = available_ram_bytes()
    need = context_bytes(cfg, ctx, kv_type)
    if avail is not None and need > avail:
        fits = max(avail // context_bytes(cfg, 1, kv_type), 0)
        raise PinferError(f"a context of {ctx} tokens needs {need / 2**30:.1f} GiB (KV cache and RoPE table), more "
                          f"than the {avail / 2**30:.1f} GiB of memory available; use a context of at most {fits} "
                          f"tokens")


def load_transformer(f: GGUFFile, cfg: ModelConfig, max_ctx: int = 4096, ffn_mode: str = "dense",
                     progress=None, kv_type: str = "f16") -> tuple[Transformer, Load]:
    """ffn_mode: "dense"; "sparse" (predictors decide each token's neurons); "oracle" (exact masks).
    kv_type: the KV cache's type, "f16" (llama.cpp's default) or "f32"."""
    if ffn_mode not in FFN_MODES:
        raise PinferError(f"unknown FFN mode '{ffn_mode}' (choose {', '.join(FFN_MODES)})")
    if kv_type not in KV_TYPES:
        raise PinferError(f"unknown --kv-type '{kv_type}' (one of {', '.join(KV_TYPES)})")
    check_context_memory(cfg, max_ctx, kv_type)
    check_mappable(f)
    check_shapes(f, cfg)
    masks = maskers(f, cfg, ffn_mode) if ffn_mode != "dense" else [None] * cfg.n_layer
    load = Load()
    blocks = []
    for i in range(cfg.n_layer):
        blocks.append(load_block(f, cfg, i, masks[i], load))
        if progress:
            progress(i + 1, cfg.n_layer)
    out_name = C.TOKEN_EMBD if cfg.tied_embeddings else C.OUTPUT
    pos = Embedding(qweight(f, C.POS_EMBD)) if cfg.arch == "opt" else None
    embed, output = Embedding(qweight(f, C.TOKEN_EMBD)), Linear([matrix(f, out_name, load)])
    check_finite(f, [*output.ws, embed.w, *_block_matrices(blocks)] + ([pos.w] if pos is not None else []))
    tr = Transformer(cfg, blocks, embed, norm(f, cfg, C.OUTPUT_NORM, C.OUTPUT_NORM_B), output, max_ctx, pos,
                     KV_TYPES[kv_type])
    _report(tr, load)
    return tr, load
