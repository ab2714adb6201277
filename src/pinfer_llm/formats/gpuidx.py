"""PowerInfer's placement file `<model>.generated.gpuidx`: written exactly as PowerInfer writes it, and read.

What PowerInfer's exporter (powerinfer-py/powerinfer/export_split.py, through its own gguf-py GGUFWriter) writes:
- the header of a GGUF v3 file whose magic is then overwritten with "PWRI"; alignment 32 (no general.alignment key);
- three keys, in this order: general.architecture (str) "generic.gpu_index", generic.gpu_index.block_count (u32),
  split.vram_capacity (u64, bytes);
- two tensors per layer, in this order: blk.N.gpu_idx, I32 (PowerInfer's type id 18) [n_ff], 1 where neuron i is
  on the GPU, else 0; then blk.N.gpu_bucket, I32 [k], the sorted indices of the neurons on the GPU (k may be 0);
- each tensor's data at an offset rounded up to 32 bytes, zero-padded.
What its loader (llama_gpu_split_loader in PowerInfer's llama.cpp; CUDA builds only) checks: the file loads as a
model file would (so every type id must be one PowerInfer's ggml knows: today's I32 id 26 kills it with SIGFPE),
split.vram_capacity exists and is u64 (else "key not found" / "wrong type"), the file has exactly 2 x n_layer
tensors, and it takes tensor 2l as layer l's gpu_idx and 2l+1 as its gpu_bucket, by position, not by name. A file
whose vram_capacity exceeds the VRAM left after the dense offload is ignored (and regenerated).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGMLQuantizationType

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.errors import PinferError, quote
from pinfer_llm.formats.reader import open_gguf
from pinfer_llm.formats.writer import write_gguf

_U32, _U64 = 4, 10  # GGUFValueType


@dataclass
class GpuIndex:
    """A placement: per layer the 0/1 mask of GPU neurons and their sorted indices, and the bytes it was made for."""

    gpu_idx: list[np.ndarray]  # int32 [n_ff] per layer
    gpu_bucket: list[np.ndarray]  # int32 [k] per layer
    vram_capacity: int

    @property
    def n_layer(self) -> int:
        return len(self.gpu_idx)

    @property
    def fingerprint(self) -> str:
        return placement_fingerprint(self.gpu_idx, self.vram_capacity)


def placement_fingerprint(gpu_idx: list[np.ndarray], vram_capacity: int) -> str:
    """What a .gpuidx says (every layer's mask and the bytes it was made for), hashed: the plan in a model records
    the one it was exported with, so that a sidecar left by an earlier run (a kill between the plan's commit and the
    sidecar's rename) is told apart."""
    h = hashlib.sha256(str(int(vram_capacity)).encode())
    for mask in gpu_idx:
        h.update(np.ascontiguousarray(mask, dtype=np.int32).tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


def gpuidx_path(model_path: str | os.PathLike) -> Path:
    return Path(str(model_path) + C.GPUIDX_SUFFIX)


def write_gpuidx(path: str | os.PathLike, gpu_idx: list[np.ndarray], gpu_bucket: list[np.ndarray] | None,
                 vram_capacity: int) -> Path:
    """Write a .gpuidx as PowerInfer's export_split does, byte for byte (atomically). gpu_bucket defaults to the
    indices of the ones in gpu_idx; given, it must be exactly those."""
    if gpu_bucket is None:
        gpu_bucket = [np.flatnonzero(np.asarray(m)) for m in gpu_idx]
    if len(gpu_bucket) != len(gpu_idx):
        raise ValueError(f"{len(gpu_idx)} gpu_idx but {len(gpu_bucket)} gpu_bucket layers")
    tensors = {}
    for b, (mask, bucket) in enumerate(zip(gpu_idx, gpu_bucket, strict=True)):
        mask = np.ascontiguousarray(mask, dtype=np.int32).reshape(-1)
        bucket = np.ascontiguousarray(bucket, dtype=np.int32).reshape(-1)
        if not np.array_equal(bucket, np.flatnonzero(mask)):
            raise ValueError(f"layer {b}: gpu_bucket is not the sorted indices of gpu_idx's ones")
        tensors[C.tensor(C.GPU_IDX, b)] = mask
        tensors[C.tensor(C.GPU_BUCKET, b)] = bucket
    meta = {C.ARCHITECTURE: C.GPU_INDEX_ARCH, C.GPU_INDEX_BLOCK_COUNT: len(gpu_idx),
            C.SPLIT_VRAM_CAPACITY: int(vram_capacity)}
    types = {C.GPU_INDEX_BLOCK_COUNT: (_U32, None), C.SPLIT_VRAM_CAPACITY: (_U64, None)}
    return write_gguf(path, meta, tensors, value_types=types, powerinfer=True)


def read_gpuidx(path: str | os.PathLike, n_layer: int | None = None,
                n_ff: int | list[int] | None = None) -> GpuIndex:
    """Read a .gpuidx (PowerInfer's own, or pinfer's) with the checks PowerInfer's loader makes, plus consistency:
    gpu_idx holds only 0 and 1 and gpu_bucket is exactly its sorted ones. n_layer / n_ff: the model it must fit."""
    f = open_gguf(path)
    where = f"{f.path}"
    if f.architecture != C.GPU_INDEX_ARCH:
        raise PinferError(f"{where}: not a GPU index (general.architecture is {quote(f.architecture)}, expected "
                          f"'{C.GPU_INDEX_ARCH}')")
    vt = f.value_types.get(C.SPLIT_VRAM_CAPACITY, (None, None))[0]
    if vt is None:
        raise PinferError(f"{where}: no {C.SPLIT_VRAM_CAPACITY}; PowerInfer refuses such a file")
    if vt != _U64:
        raise PinferError(f"{where}: {C.SPLIT_VRAM_CAPACITY} is not a u64; PowerInfer refuses such a file")
    names = list(f.header_tensors)
    if len(names) % 2:
        raise PinferError(f"{where}: {len(names)} tensors; a GPU index has two per layer")
    layers = len(names) // 2
    declared = f.get(C.GPU_INDEX_BLOCK_COUNT)
    if declared is not None and int(declared) != layers:
        raise PinferError(f"{where}: block_count says {int(declared)} layers but the file has {layers}")
    if n_layer is not None and layers != n_layer:
        raise PinferError(f"{where}: {layers} layers, the model has {n_layer}; it was made for another model")
    gpu_idx, gpu_bucket = [], []
    for b in range(layers):
        for name, want in ((names[2 * b], C.tensor(C.GPU_IDX, b)), (names[2 * b + 1], C.tensor(C.GPU_BUCKET, b))):
            t = f.header_tensors[name]
            if name != want:
                raise PinferError(f"{where}: tensor {names.index(name)} is {quote(name)}, expected '{want}' "
                                  f"(PowerInfer takes them by position)")
            if t.ggml_type != GGMLQuantizationType.I32 or len(t.ne) != 1:
                raise PinferError(f"{where}: {quote(name)} is {t.type_name} {list(t.ne)}, expected a 1-D I32 tensor")
        mask = np.array(f.raw(names[2 * b]), dtype=np.int32)
        bucket = np.array(f.raw(names[2 * b + 1]), dtype=np.int32)
        if mask.size and not np.isin(mask, (0, 1)).all():
            raise PinferError(f"{where}: layer {b}'s gpu_idx holds values other than 0 and 1")
        if not np.array_equal(bucket, np.flatnonzero(mask)):
            raise PinferError(f"{where}: layer {b}'s gpu_bucket is not the sorted indices of its GPU neurons")
        want_ff = n_ff[b] if isinstance(n_ff, (list, tuple)) else n_ff
        if want_ff is not None and mask.size != want_ff:
            raise PinferError(f"{where}: layer {b} has {mask.size} neurons, the model {want_ff}; it was made for "
                              f"another model")
        gpu_idx.append(mask)
        gpu_bucket.append(bucket)
    return GpuIndex(gpu_idx, gpu_bucket, int(f.get(C.SPLIT_VRAM_CAPACITY)))
