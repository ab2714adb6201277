"""Helpers for the pi-plan tests: tiny GGUFs with real quantised tensors, and small hand-made hardware.

(Named test_plan_* so it lives with the planner's tests; its one test checks the tiny model itself.)
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import quantize

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.encoder import RawTensor
from pinfer_llm.formats.writer import write_gguf
from pinfer_llm.planner.hardware import CPU, GPU, Hardware

GIB = 1 << 30


def _tensor(rng, shape, qtype):
    data = rng.standard_normal(shape).astype(np.float32) * 0.05
    if qtype == T.F32:
        return data
    if qtype == T.F16:
        return data.astype(np.float16)
    return RawTensor(quantize(data, qtype), int(qtype), shape)


def tiny_model(path: Path, *, n_layer: int = 3, n_embd: int = 64, n_ff: int = 96, n_head: int = 4,
               n_head_kv: int = 2, vocab: int = 128, qtype=T.Q4_0, predictor: bool = True, stats: bool = True,
               tied: bool = False, seed: int = 0, counts_len: int | None = None, freqs=None) -> Path:
    """A llama-layout GGUF with real quantised weights (PowerInfer layout when predictor=True)."""
    rng = np.random.default_rng(seed)
    hd = n_embd // n_head
    kv = n_head_kv * hd
    tensors = {C.TOKEN_EMBD: _tensor(rng, (vocab, n_embd), T.Q8_0),
               C.OUTPUT_NORM: np.ones(n_embd, np.float32)}
    if not tied:
        tensors[C.OUTPUT] = _tensor(rng, (vocab, n_embd), T.Q8_0)
    tokens = 1000
    for b in range(n_layer):
        t = lambda tp, b=b: C.tensor(tp, b)  # noqa: E731
        tensors[t(C.ATTN_NORM)] = np.ones(n_embd, np.float32)
        tensors[t(C.ATTN_Q)] = _tensor(rng, (n_embd, n_embd), qtype)
        tensors[t(C.ATTN_K)] = _tensor(rng, (kv, n_embd), qtype)
        tensors[t(C.ATTN_V)] = _tensor(rng, (kv, n_embd), qtype)
        tensors[t(C.ATTN_OUT)] = _tensor(rng, (n_embd, n_embd), qtype)
        tensors[t(C.FFN_NORM)] = np.ones(n_embd, np.float32)
        tensors[t(C.FFN_GATE)] = _tensor(rng, (n_ff, n_embd), qtype)
        tensors[t(C.FFN_UP)] = _tensor(rng, (n_ff, n_embd), qtype)
        if predictor:
            tensors[t(C.FFN_DOWN_T)] = _tensor(rng, (n_ff, n_embd), qtype)
            tensors[t(C.PRED_FC1)] = _tensor(rng, (16, n_embd), T.F16)
            tensors[t(C.PRED_FC2)] = _tensor(rng, (n_ff, 16), T.F16)
        else:
            tensors[t(C.FFN_DOWN)] = _tensor(rng, (n_embd, n_ff), T.F16 if n_ff % 32 else qtype)
        if stats:
            f = freqs[b] if freqs is not None else np.sort(rng.uniform(0.01, 1.0, counts_len or n_ff))[::-1] ** 3
            tensors[t(C.ACT_COUNTS)] = rng.permutation(np.round(np.asarray(f) * tokens)).astype(np.float32)
    meta = {C.ARCHITECTURE: "llama", C.NAME: "tiny", "llama.block_count": np.uint32(n_layer),
            "llama.context_length": np.uint32(256), "llama.embedding_length": np.uint32(n_embd),
            "llama.feed_forward_length": np.uint32(n_ff), "llama.attention.head_count": np.uint32(n_head),
            "llama.attention.head_count_kv": np.uint32(n_head_kv), "llama.vocab_size": np.uint32(vocab),
            C.FFN_ACTIVATION: "relu"}
    if stats:
        meta[C.ACT_TOKENS] = np.uint64(tokens)
    return write_gguf(path, meta, tensors)


def cpu(cores: int = 8, bw: float = 40.0, ram: float = 64.0, **kw) -> CPU:
    return CPU("test-cpu", cores, bw, ram, **kw)


def gpu(name: str = "testgpu", budget_bytes: int | None = None, model: Path | None = None, **kw) -> GPU:
    """A GPU whose budget for model parts (after `model`'s GPU workspace) is budget_bytes."""
    spec = dict(vram_gib=80.0, mem_bw_gbs=800.0, pcie_gen=4, pcie_lanes=16, fp16_tflops=50.0)
    spec.update(kw)
    g = GPU(name, **spec)
    if budget_bytes is not None:
        g.vram_budget_gib = (budget_bytes + workspace_bytes(model) + 0.5) / GIB
    return g


def workspace_bytes(model: Path) -> int:
    from pinfer_llm.formats.reader import open_gguf
    from pinfer_llm.planner.memory import account

    return account(open_gguf(model)).gpu_workspace


def fast_hw(gpus, **kw) -> Hardware:
    """Hardware with small fixed costs, so that tiny models have interesting trade-offs."""
    defaults = dict(pcie_latency_us=0.05, gpu_launch_us=0.01, sync_us=0.05, host_split_layer_us=0.03,
                    host_call_us=0.001)
    defaults.update(kw)
    return Hardware(cpu(op_us=0.01, token_us=0.0, bw=2.0), list(gpus), **defaults)


def digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def leftovers(directory: Path) -> list[str]:
    return [p.name for p in Path(directory).iterdir() if p.name.endswith(".tmp")]


def test_tiny_model_opens(tmp_path):
    from pinfer_llm.formats.reader import open_gguf

    f = open_gguf(tiny_model(tmp_path / "m.gguf"))
    assert f.tensors[C.tensor(C.FFN_UP, 0)].shape == (96, 64)
    assert f.tensors[C.tensor(C.ACT_COUNTS, 2)].shape == (96,)
