"""Byte accounting: what each part of a model costs in memory, from tensor shapes and types alone.

Nothing here reads tensor data. Real files and skeletons go through `tensor_table`, the one place that knows the
difference, so a skeleton of Llama2-70B and the real Q4_0 file account to the same bytes.

Each block N splits into three parts the planner places separately:
- neurons: rows i of ffn_gate/ffn_up/ffn_down_t (column i of ffn_down), and entry i of ffn_up.bias (OPT). Gate-less
  FFNs (Falcon, OPT) have two rows per neuron instead of three. One neuron costs the same in every layer of a model,
  so a prefix of k neurons costs k * neuron_bytes.
- the predictor: fc1 + fc2 (PowerInfer files only).
- attention: every other blk.N tensor (q/k/v/o or falcon's fused qkv, norms, attn_norm_2, biases, ffn_norm, the
  down projection's bias, which is added once per token whatever neurons fire), plus the layer's KV cache, which
  must live where attention runs.
Outside the blocks: the output head (output + output_norm; with tied embeddings a GPU copy of token_embd) is placed
as one part; token_embd itself, and OPT's position_embd, are read one row per token and stay in host memory, as
llama.cpp keeps them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.errors import PinferError
from pinfer_llm.formats.header import GGUFFile, TensorInfo, tensor_nbytes, type_name

MIB = 1 << 20
GPU_WORKSPACE_FIXED = 256 * MIB  # cuBLAS workspace and compute-graph buffers of a CUDA engine
# What pinfer's GPU runtime promises to stay within beyond the placed weights and KV caches (runtime/hybrid/executor.py,
# runtime/gpu/cuda.py use these): prompts run GPU_CHUNK tokens per forward pass, prefill GEMMs read weights
# dequantised in tiles of at most DEQUANT_TILE_BYTES, and attention splits a context into chunks of ATTN_CHUNK
# positions, at most ATTN_MAX_CHUNKS of them (longer ones past that). gpu_scratch_bytes bounds the device memory
# that leaves for activations.
GPU_CHUNK = 128
DEQUANT_TILE_BYTES = 64 * MIB
ATTN_CHUNK = 256
ATTN_MAX_CHUNKS = 64
HOST_RESERVE = 1 << 30  # the process itself: interpreter, torch, tokenizer, buffers
KV_FILL = 0.5  # decode reads the KV cache of the tokens so far: on average half of a full context

_FFN_ROWS = (C.FFN_GATE, C.FFN_UP, C.FFN_DOWN_T, C.FFN_UP_B)  # neuron i is row i (entry i of the up bias)
_FFN_COLS = (C.FFN_DOWN,)  # neuron i is column i
_PREDICTOR = (C.PRED_FC1, C.PRED_FC2)
_NOT_MODEL = (C.GPU_IDX, C.GPU_BUCKET, C.ACT_COUNTS, C.ACT_PEAK)  # plans and statistics: not part of what is placed
_BLOCK = re.compile(r"^blk\.(\d+)\.")
# Matrix types the GPU's kernels do not read: the runtime copies them into one they do (runtime/weights.py
# rows_runnable: Q4_K as Q4_1, 20 bytes per 32 values; the others as Q8_0, 34), so that is what they cost in VRAM; a
# test keeps this table equal to the runtime's choice. On the CPU they are read in place (17 to 26.25 bytes per 32
# values), which one count per tensor cannot say: the plan charges them the copy everywhere, over-counting host RAM
# and the CPU's bytes per token for such layers (safe for memory; it leans them towards the GPU) rather than
# under-counting VRAM. Row-read tables (token_embd) stay as stored.
RUN_AS = {GGMLQuantizationType.Q4_K: 20, GGMLQuantizationType.Q5_0: 34, GGMLQuantizationType.Q5_1: 34,
          GGMLQuantizationType.Q5_K: 34, GGMLQuantizationType.Q6_K: 34, GGMLQuantizationType.IQ4_NL: 34,
          GGMLQuantizationType.IQ4_XS: 34}  # bytes per 32 values as run


def run_bytes(t: TensorInfo) -> int:
    """Bytes of tensor t as pinfer's GPU runs it: as stored, or re-encoded (RUN_AS) for the matrix types it converts."""
    if len(t.shape) == 2 and t.ggml_type in RUN_AS:
        return t.n_elements // 32 * RUN_AS[t.ggml_type]
    return t.nbytes
NO_DATA = -1  # the offset of a tensor a skeleton only declares: it has no data in the file


def tensor_table(f: GGUFFile) -> dict[str, TensorInfo]:
    """Every tensor of the model with its shape, type and bytes: from the tensor infos, and for a skeleton also from
    the declarations in its metadata (see formats/constants.py SKELETON_*)."""
    table = dict(f.tensors)
    if f.get(C.SKELETON):
        names = f.get(C.SKELETON_TENSOR_NAMES)
        types, n_dims, ne = (f.get(C.SKELETON_TENSOR_TYPES), f.get(C.SKELETON_TENSOR_N_DIMS),
                             f.get(C.SKELETON_TENSOR_NE))
        if names is None or types is None or n_dims is None or ne is None or not (
                len(names) == len(types) == len(n_dims) == len(ne) // 4):
            raise PinferError(f"{f.path}: corrupt skeleton (tensor declarations missing or of different lengths); "
                              f"make it again with pi-plan skeleton")
        for i, name in enumerate(names):
            dims = tuple(int(d) for d in ne[4 * i:4 * i + int(n_dims[i])])
            nbytes = tensor_nbytes(dims, int(types[i]))
            if nbytes is None:
                raise PinferError(f"{f.path}: skeleton tensor '{name}' has unknown type {int(types[i])}")
            table.setdefault(name, TensorInfo(name, dims, int(types[i]), NO_DATA, nbytes))
    return table


def model_tensors(table: dict[str, TensorInfo]) -> list[TensorInfo]:
    """The tensors that make the model (plans and statistics left out): what a fingerprint covers."""
    skip = re.compile("|".join(re.escape(t).replace(r"\{bid\}", r"\d+") + "$" for t in _NOT_MODEL))
    return [t for t in table.values() if not skip.match(t.name)]


@dataclass
class LayerBytes:
    n_ff: int
    attn: int  # attention weights, norms, biases (everything of the block that is not neurons or predictor)
    kv: int  # KV cache at the planned context size
    pred: int  # predictor fc1 + fc2 (0 without one)
    ffn: int  # all neurons: gate + up + down
    attn_flops: float  # per token
    kv_read: float  # bytes of KV cache read per token, on average over a context
    kv_flops: float
    pred_flops: float
    dense_per_neuron: float  # bytes read for every neuron on every token (the projection that finds active ones)
    sparse_per_neuron: float  # bytes read for a neuron on the tokens where it is active
    dense_flops_per_neuron: float
    sparse_flops_per_neuron: float
    row_types: dict[str, int] = field(default_factory=dict)  # ffn tensor -> ggml type, for reports

    @property
    def neuron(self) -> float:
        """VRAM of one neuron: its gate, up and down rows."""
        return self.ffn / self.n_ff

    def neuron_bytes(self, k) -> np.ndarray:
        """Bytes of k neurons: exact for whole rows, a proportional share of a quantised ffn_down's columns."""
        return np.ceil(np.asarray(k, dtype=np.float64) * self.ffn / self.n_ff).astype(np.int64)

    @property
    def has_predictor(self) -> bool:
        return self.pred > 0


@dataclass
class ModelBytes:
    path: Path
    name: str
    arch: str
    quant: str  # the FFN's ggml type(s), for reports
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    vocab: int
    ctx_size: int
    layers: list[LayerBytes]
    output: int  # output head on a GPU
    output_flops: float
    host_fixed: int  # token_embd and other global tensors: host memory whatever the plan
    gpu_workspace: int  # compute buffers on each GPU
    host_reserve: int
    skeleton: bool
    table: dict[str, TensorInfo] = field(repr=False, default_factory=dict)

    @property
    def n_ff(self) -> list[int]:
        return [lb.n_ff for lb in self.layers]

    @property
    def total(self) -> int:
        """Bytes of everything placed, KV cache included (not the host-only tensors)."""
        return sum(lb.attn + lb.kv + lb.pred + lb.ffn for lb in self.layers) + self.output


def _arch_int(f: GGUFFile, template: str, default=None):
    v = f.arch_get(template, default)
    if v is None:
        return None
    return int(v[0] if hasattr(v, "__len__") else v)


def check_ctx_size(ctx_size: int | None) -> None:
    if ctx_size is not None and ctx_size < 1:
        raise PinferError(f"--ctx-size must be at least 1 token, got {ctx_size}")


def account(f: GGUFFile, ctx_size: int | None = None, kv_type: int = GGMLQuantizationType.F16) -> ModelBytes:
    """Bytes of every placeable part of the model in `f`, with its KV cache sized for `ctx_size` tokens."""
    table = tensor_table(f)
    arch = f.architecture
    if not arch:
        raise PinferError(f"{f.path}: no general.architecture in metadata; not a model file")
    n_layer = _arch_int(f, C.BLOCK_COUNT)
    n_embd = _arch_int(f, C.EMBEDDING_LENGTH)
    n_head = _arch_int(f, C.HEAD_COUNT)
    if not n_layer or not n_embd or not n_head:
        raise PinferError(f"{f.path}: missing {arch}.block_count, embedding_length or attention.head_count; "
                          f"the file is incomplete")
    n_head_kv = _arch_int(f, C.HEAD_COUNT_KV, n_head) or n_head
    head_dim = _arch_int(f, C.KEY_LENGTH, n_embd // n_head)
    check_ctx_size(ctx_size)
    ctx = int(ctx_size if ctx_size is not None else _arch_int(f, C.CONTEXT_LENGTH, 4096) or 4096)
    vocab = _arch_int(f, C.VOCAB_SIZE)
    if vocab is None:
        emb = table.get(C.TOKEN_EMBD)
        vocab = emb.shape[0] if emb else 0

    per_layer: dict[int, list[TensorInfo]] = {}
    globals_: list[TensorInfo] = []
    for t in model_tensors(table):
        m = _BLOCK.match(t.name)
        if m:
            per_layer.setdefault(int(m.group(1)), []).append(t)
        else:
            globals_.append(t)
    if sorted(per_layer) != list(range(n_layer)):
        raise PinferError(f"{f.path}: tensors for blocks {_ranges(per_layer)} but {arch}.block_count is {n_layer}; "
                          f"the file is incomplete")

    kv_elem = GGML_QUANT_SIZES[GGMLQuantizationType(kv_type)]
    kv_per_token = 2 * n_head_kv * head_dim  # K and V elements per token per layer
    kv_bytes = int(kv_per_token * ctx * kv_elem[1] // kv_elem[0])
    pos = ctx * KV_FILL
    layers = []
    ffn_types: set[str] = set()
    for bid in range(n_layer):
        tensors = {t.name: t for t in per_layer[bid]}
        rows = [tensors[C.tensor(tp, bid)] for tp in _FFN_ROWS if C.tensor(tp, bid) in tensors]
        cols = [tensors[C.tensor(tp, bid)] for tp in _FFN_COLS if C.tensor(tp, bid) in tensors]
        if not rows:
            raise PinferError(f"{f.path}: block {bid} has no {C.tensor(C.FFN_UP, bid)}; not a model pinfer can plan")
        n_ff_set = {t.shape[0] for t in rows} | {t.shape[-1] for t in cols}
        if len(n_ff_set) != 1:
            raise PinferError(f"{f.path}: block {bid}'s FFN tensors disagree on the neuron count ({sorted(n_ff_set)})")
        n_ff = n_ff_set.pop()
        ffn = rows + cols
        pred = [tensors[C.tensor(tp, bid)] for tp in _PREDICTOR if C.tensor(tp, bid) in tensors]
        ffn_names = {t.name for t in ffn} | {t.name for t in pred}
        attn = [t for t in tensors.values() if t.name not in ffn_names]
        # Without a predictor the engine finds the active neurons by computing one projection for all of them (the
        # gate, or up where there is no gate), so those rows are read on every token. With one, nothing is.
        dense_name = None
        if not pred:
            gate, up = C.tensor(C.FFN_GATE, bid), C.tensor(C.FFN_UP, bid)
            dense_name = gate if gate in tensors else up
        dense = [t for t in ffn if t.name == dense_name]
        sparse = [t for t in ffn if t.name != dense_name]
        matrices = [t for t in ffn if len(t.shape) == 2]  # the up bias is one float per neuron, whatever the quant
        ffn_types |= {type_name(t.ggml_type) for t in matrices}
        layers.append(LayerBytes(
            n_ff=n_ff,
            attn=sum(run_bytes(t) for t in attn),
            kv=kv_bytes,
            pred=sum(run_bytes(t) for t in pred),
            ffn=sum(run_bytes(t) for t in ffn),
            attn_flops=2.0 * sum(t.n_elements for t in attn),
            kv_read=kv_per_token * pos * kv_elem[1] / kv_elem[0],
            kv_flops=4.0 * n_head * head_dim * pos,
            pred_flops=2.0 * sum(t.n_elements for t in pred),
            dense_per_neuron=sum(run_bytes(t) for t in dense) / n_ff,
            sparse_per_neuron=sum(run_bytes(t) for t in sparse) / n_ff,
            dense_flops_per_neuron=2.0 * sum(t.n_elements for t in dense) / n_ff,
            sparse_flops_per_neuron=2.0 * sum(t.n_elements for t in sparse) / n_ff,
            row_types={t.name.split(".")[2]: t.ggml_type for t in matrices},
        ))

    by_name = {t.name: t for t in globals_}
    head = [t for t in globals_ if t.name == C.OUTPUT or t.name.startswith("output_norm.")]
    if C.OUTPUT not in by_name and C.TOKEN_EMBD in by_name:
        head.append(by_name[C.TOKEN_EMBD])  # tied: the GPU needs its own copy of the embedding matrix
    host = [t for t in globals_ if t.name == C.TOKEN_EMBD or t not in head]
    workspace = GPU_WORKSPACE_FIXED + gpu_scratch_bytes(n_embd, max(lb.n_ff for lb in layers), n_head, n_head_kv,
                                                        head_dim, vocab, ctx)
    return ModelBytes(
        path=Path(f.path), name=str(f.get(C.NAME) or Path(f.path).stem), arch=arch,
        quant="+".join(sorted(ffn_types)), n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, vocab=vocab, ctx_size=ctx, layers=layers,
        output=sum(run_bytes(t) for t in head), output_flops=2.0 * sum(t.n_elements for t in head),
        host_fixed=sum(t.nbytes for t in host), gpu_workspace=int(workspace), host_reserve=HOST_RESERVE,
        skeleton=bool(f.get(C.SKELETON)), table=table)


def gpu_scratch_bytes(n_embd: int, n_ff: int, n_head: int, n_head_kv: int, head_dim: int, vocab: int,
                      ctx: int) -> int:
    """The most device memory pinfer's hybrid runtime holds for one forward pass of up to GPU_CHUNK tokens, beyond
    the placed weights and KV caches, whatever the placement (every term at its worst case):
    - held between passes, one set for all layers (runtime/hybrid/executor.py Bus.link): the staging buffers of what
      crosses the bus, one per crossing point: the residual up and down, the host's share up, a device layer's FFN
      input and residual down, a host layer's FFN input up with a host predictor's mask for the device's rows
      [T, n_ff], the CPU's active ids [n_ff + 1] (two points), the device's FFN sum down, the head's logits
      [T, vocab]; twice that, since a buffer that must grow doubles;
    - within a pass, one layer at a time: one tile of dequantised weights for a prefill GEMM, the Q/K/V projections
      and their per-head copies, attention's partial sums [T, n_head, chunks of ctx, head_dim + 2], gate, up and
      activations of the FFN rows [T, n_ff] each, the predictor's scores [T, n_ff] and hidden units, logits."""
    T, f32, align = GPU_CHUNK, 4, 256
    qkv = (n_head + 2 * n_head_kv) * head_dim
    links = 2 * (f32 * (T * (7 * n_embd + n_ff + vocab) + 2 * (n_ff + 1)) + 12 * align)
    largest = f32 * n_embd * max(3 * n_ff, vocab, qkv, n_head * head_dim)  # a tile never exceeds its matrices
    chunks = min(ATTN_MAX_CHUNKS, -(-ctx // ATTN_CHUNK))
    per_pass = min(DEQUANT_TILE_BYTES, largest) + f32 * T * (2 * qkv + n_head * chunks * (head_dim + 2)
                                                               + n_head * head_dim + 5 * n_ff + 2 * n_embd + vocab)
    return links + per_pass


def _ranges(d) -> str:
    keys = sorted(d)
    return f"{keys[0]}..{keys[-1]}" if keys else "none"
