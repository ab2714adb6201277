"""What pi-profile stores in a model file: activation statistics and predictors, as metadata and tensors."""

from __future__ import annotations

import numpy as np
import torch

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.config import ModelConfig
from pinfer_llm.formats.errors import PinferError
from pinfer_llm.formats.header import GGUFFile
from pinfer_llm.runtime.ffn.predictor import Predictor
from pinfer_llm.runtime.profiling.counting import Profile

PROFILE_KEYS = (C.ACT_TOKENS, C.ACT_CORPUS, C.ACT_DATE, C.ACT_RULE, C.CATS_THRESHOLD, C.CATS_SPARSITY)
PREDICTOR_KEYS = (C.SPARSE_THRESHOLD, C.PRED_THRESHOLDS, C.PRED_RECALL, C.PRED_PRECISION, C.PRED_RECALL_TARGET,
                  C.PRED_SOURCE)


def profile_entries(prof: Profile, n_layer: int) -> tuple[dict, dict, list]:
    """(metadata to set, tensors to set, keys to drop) for a profile."""
    meta = {C.ACT_TOKENS: np.uint64(prof.tokens), C.ACT_CORPUS: prof.corpus, C.ACT_DATE: prof.date,
            C.ACT_RULE: prof.rule.name, C.FFN_ACTIVATION: prof.rule.act}
    drop = []
    if prof.rule.thresholds is not None:
        meta[C.CATS_THRESHOLD] = np.asarray(prof.rule.thresholds, dtype=np.float32)
        meta[C.CATS_SPARSITY] = np.float32(prof.cats_sparsity)
    else:
        drop += [C.CATS_THRESHOLD, C.CATS_SPARSITY]
    tensors = {C.tensor(C.ACT_COUNTS, i): prof.counts[i].astype(np.float32) for i in range(n_layer)}
    if prof.peak is not None:
        tensors.update({C.tensor(C.ACT_PEAK, i): prof.peak[i].astype(np.float32) for i in range(n_layer)})
    return meta, tensors, drop


def predictor_entries(preds: list[Predictor], threshold: float | None, act: str, source: str,
                      recall_target: float | None = None) -> tuple[dict, dict, list]:
    """(metadata, tensors, keys to drop) for predictors: fc1/fc2 per layer, the global threshold (or per-layer ones
    when they cannot be folded into one), and the test statistics when known."""
    tensors = {}
    for i, p in enumerate(preds):
        tensors[C.tensor(C.PRED_FC1, i)] = p.fc1.to(torch.float16).contiguous().numpy()
        tensors[C.tensor(C.PRED_FC2, i)] = p.fc2.to(torch.float16).contiguous().numpy()
    ts = np.array([p.threshold for p in preds], dtype=np.float32)
    # a predictor in a llama file would otherwise make config.detect_ffn_activation read the file as ReLU
    meta = {C.PRED_SOURCE: source, C.FFN_ACTIVATION: act}
    drop = []
    if threshold is not None:
        meta[C.SPARSE_THRESHOLD] = np.float32(threshold)
        drop.append(C.PRED_THRESHOLDS)
    else:
        meta[C.SPARSE_THRESHOLD] = np.float32(np.median(ts))
        meta[C.PRED_THRESHOLDS] = ts
    stats = np.array([[p.recall, p.precision] for p in preds], dtype=np.float32)
    if recall_target is not None and np.isfinite(stats).all():
        meta[C.PRED_RECALL] = stats[:, 0].copy()
        meta[C.PRED_PRECISION] = stats[:, 1].copy()
        meta[C.PRED_RECALL_TARGET] = np.float32(recall_target)
    else:
        drop += [C.PRED_RECALL, C.PRED_PRECISION, C.PRED_RECALL_TARGET]
    return meta, tensors, drop


def stored_counts(f: GGUFFile, cfg: ModelConfig) -> tuple[np.ndarray, int]:
    """([n_layer, n_ff] counts, tokens) of the statistics stored in a file."""
    if not f.has(C.tensor(C.ACT_COUNTS, 0)) or C.ACT_TOKENS not in f.metadata:
        raise PinferError(f"{f.path}: no activation statistics; run pi-profile on it first")
    counts = np.stack([np.asarray(f.raw(C.tensor(C.ACT_COUNTS, i)), dtype=np.float64) for i in range(cfg.n_layer)])
    return counts, int(f.get(C.ACT_TOKENS))


def ffn_tensors(cfg: ModelConfig) -> tuple[str, ...]:
    """The FFN's weight templates: gate (llama, bamboo; Falcon and OPT have none), up, and down or PowerInfer's
    down_t."""
    down = C.FFN_DOWN_T if cfg.down_transposed else C.FFN_DOWN
    return (C.FFN_GATE, C.FFN_UP, down) if cfg.gated else (C.FFN_UP, down)


def check_ffn_tensors(f: GGUFFile, cfg: ModelConfig) -> None:
    """Profiling needs the FFN's weights in every layer: gate (gated archs), up and down (or PowerInfer's down_t)."""
    for i in range(cfg.n_layer):
        for t in ffn_tensors(cfg):
            if not f.has(C.tensor(t, i)):
                raise PinferError(f"{f.path}: layer {i} has no {C.tensor(t, i)}; pi-profile understands only "
                                  f"{'gate, up and down' if cfg.gated else 'up and down'} FFNs there")


def transposed_down(f: GGUFFile, cfg: ModelConfig, progress=None) -> dict:
    """ffn_down of every layer transposed to PowerInfer's neuron-major ffn_down_t, in the file's own encoding, as
    tensors to store beside ffn_down (`pi-profile --store-down-t`): sparse runs then read neuron rows in place
    instead of transposing ffn_down at every load. Exact for F32/F16/BF16; block types are requantised as Q8_0,
    because a neuron's column of ffn_down shares its blocks with 31 other neurons (see runtime.loader.transposed)."""
    from pinfer_llm.formats.encoder import RawTensor
    from pinfer_llm.runtime.loader import transposed
    from pinfer_llm.runtime.weights import qweight

    if cfg.down_transposed:
        raise PinferError(f"{f.path}: the model already stores ffn_down_t (PowerInfer's layout); nothing to do")
    out = {}
    for i in range(cfg.n_layer):
        w = transposed(qweight(f, C.tensor(C.FFN_DOWN, i)))
        out[C.tensor(C.FFN_DOWN_T, i)] = RawTensor(w.data.numpy(), int(w.qtype), (w.rows, w.cols))
        if progress:
            progress(i + 1, cfg.n_layer)
    return out
