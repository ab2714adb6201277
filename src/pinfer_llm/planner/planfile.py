"""Plans in GGUF files: written into the model, read back, checked against the model, exported for PowerInfer.

In the model file a plan is (formats/constants.py):
- per layer, PowerInfer's tensors blk.N.gpu_idx (I32 [n_ff], 1 = neuron on a GPU) and blk.N.gpu_bucket (sorted I32
  indices of those neurons), so PowerInfer's engine and ours read the same placement;
- pinfer.plan.* metadata: GPUs, budget, context size, objective, predicted tokens/s, solver status and gap, the
  device of every dense part, and a fingerprint of the model's tensors. A plan whose fingerprint differs from the
  file's own tensors was made for another model and is refused.
All of it goes into pinfer's section of the model (formats/section.py), where PowerInfer and llama.cpp do not look:
written in place in seconds whatever the model's size (formats/update.py), or as a copy with -o. PowerInfer's own
engine reads a placement from `<model>.generated.gpuidx`, which export_gpuidx writes exactly as PowerInfer does.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.config import bounded_layers
from pinfer_llm.formats.errors import PinferError, quote
from pinfer_llm.formats.gpuidx import gpuidx_path, read_gpuidx, write_gpuidx
from pinfer_llm.formats.header import GGUFFile
from pinfer_llm.formats.reader import open_gguf
from pinfer_llm.formats.update import store
from pinfer_llm.planner.costmodel import evaluate
from pinfer_llm.planner.memory import model_tensors, tensor_table
from pinfer_llm.planner.plan import Plan
from pinfer_llm.planner.problem import Problem

PLAN_LAYOUT_VERSION = 1


def fingerprint(f: GGUFFile) -> str:
    """Hash of the model's tensor names, shapes and types (not of plans or statistics, which a plan may change)."""
    h = hashlib.sha256()
    for t in sorted(model_tensors(tensor_table(f)), key=lambda t: t.name):
        h.update(f"{t.name}|{','.join(map(str, t.ne))}|{t.ggml_type}\n".encode())
    return h.hexdigest()[:16]


@dataclass
class StoredPlan:
    plan: Plan
    masks: list[np.ndarray]  # gpu_idx per layer
    buckets: list[np.ndarray]  # gpu_bucket per layer
    meta: dict  # the pinfer.plan.* keys


def plan_metadata(p: Problem, plan: Plan, *, objective: str, status: str, gap: float | None, solver: str,
                  solve_s: float, tokens_per_s: float, vram_used: np.ndarray, fp: str,
                  baselines: dict[str, float | None]) -> dict:
    """The pinfer.plan.* keys; `gap` (an upper bound on the ILP's relative optimality gap) is left out when unknown."""
    split = np.zeros(plan.n_layer, dtype=np.uint8)
    split[evaluate(p, plan).split] = 1
    meta = {
        C.PLAN_VERSION: np.uint32(PLAN_LAYOUT_VERSION),
        C.PLAN_GPUS: [g.name for g in p.hw.gpus],
        C.PLAN_VRAM_BUDGET: np.uint64(sum(g.budget_bytes for g in p.hw.gpus)),
        C.PLAN_VRAM_USED: np.asarray(vram_used, dtype=np.uint64),
        C.PLAN_CTX: np.uint32(p.model.ctx_size),
        C.PLAN_OBJECTIVE: objective,
        C.PLAN_TOKENS_PER_S: np.float32(tokens_per_s),
        C.PLAN_STATUS: status,
        C.PLAN_SOLVER: solver,
        C.PLAN_SOLVE_SECONDS: np.float32(solve_s),
        C.PLAN_GROUP: np.uint32(p.group),
        C.PLAN_FINGERPRINT: fp,
        C.PLAN_ATTN_GPU: plan.attn.astype(np.uint8),
        C.PLAN_PRED_GPU: plan.pred.astype(np.uint8),
        C.PLAN_FFN_GPU: plan.ffn_gpu.astype(np.uint8),
        C.PLAN_GPU_NEURONS: plan.n_gpu.astype(np.uint32),
        C.PLAN_SPLIT: split,
        C.PLAN_OUTPUT_GPU: np.uint8(plan.output),
        C.PLAN_HARDWARE: p.hw.to_json(),
        C.PLAN_BASELINES: json.dumps(baselines, sort_keys=True),
    }
    if gap is not None:
        meta[C.PLAN_GAP] = np.float32(gap)
    return meta


def _plan_tensors(masks: list[np.ndarray], buckets: list[np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for bid, (mask, bucket) in enumerate(zip(masks, buckets, strict=True)):
        out[C.tensor(C.GPU_IDX, bid)] = np.asarray(mask, dtype=np.int32)
        out[C.tensor(C.GPU_BUCKET, bid)] = np.asarray(bucket, dtype=np.int32)
    return out


def write_plan(f: GGUFFile, masks: list[np.ndarray], buckets: list[np.ndarray], meta: dict,
               dest: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Store the plan's tensors and keys into `f` in place (or into a copy at `dest`), replacing any earlier plan.
    In place, `f` is closed first (its section can then be freed by this write): the caller is done with it."""
    return store(f, dest, set_metadata=meta, set_tensors=_plan_tensors(masks, buckets),
                 drop_prefixes=(C.PLAN_PREFIX,), progress=progress, close=True)


def read_plan(f: GGUFFile, model: GGUFFile | None = None) -> StoredPlan:
    """The plan stored in `f`, checked against `model`'s tensors (default: `f`'s own)."""
    meta = {k: v for k, v in f.metadata.items() if k.startswith(C.PLAN_PREFIX)}
    n_layer = _n_layer(f)
    names = [C.tensor(C.GPU_IDX, b) for b in range(n_layer)]
    if not meta and not all(f.has(n) for n in names):
        raise PinferError(f"{f.path}: no placement plan; run pi-plan on it first")
    target = model or f
    want = fingerprint(target)
    have = meta.get(C.PLAN_FINGERPRINT)
    if have is not None and str(have) != want:
        raise PinferError(f"{f.path}: the plan was made for another model (fingerprint {have}, "
                          f"{Path(target.path).name} has {want}); run pi-plan on this model")
    target_layers = _n_layer(target)
    if n_layer != target_layers:
        raise PinferError(f"{f.path}: the plan has {n_layer} layers, {Path(target.path).name} has {target_layers}")
    masks, buckets = [], []
    for b in range(n_layer):
        mask = np.asarray(f.raw(C.tensor(C.GPU_IDX, b)), dtype=np.int32).copy()
        bucket = (np.asarray(f.raw(C.tensor(C.GPU_BUCKET, b)), dtype=np.int32).copy()
                  if f.has(C.tensor(C.GPU_BUCKET, b)) else np.flatnonzero(mask).astype(np.int32))
        masks.append(mask)
        buckets.append(bucket)
    shapes = tensor_table(target)
    for b in range(n_layer):
        name = C.tensor(C.FFN_UP, b)
        if name in shapes and shapes[name].shape[0] != len(masks[b]):
            raise PinferError(f"{f.path}: the plan's layer {b} has {len(masks[b])} neurons, the model "
                              f"{shapes[name].shape[0]}; it was made for another model")
    L = n_layer
    n_gpu = np.array([int(m.sum()) for m in masks])
    check_consistent(f, masks, buckets, meta, n_gpu)

    def arr(key, default):
        v = meta.get(key)
        return np.asarray(v, dtype=np.int64) if v is not None else default

    ones = (n_gpu > 0).astype(np.int64)
    plan = Plan(str(meta.get(C.PLAN_OBJECTIVE, "stored")), arr(C.PLAN_ATTN_GPU, np.zeros(L, np.int64)),
                arr(C.PLAN_PRED_GPU, np.zeros(L, np.int64)), arr(C.PLAN_FFN_GPU, ones), n_gpu,
                int(meta.get(C.PLAN_OUTPUT_GPU, 0)))
    return StoredPlan(plan, masks, buckets, meta)


def check_consistent(f: GGUFFile, masks: list[np.ndarray], buckets: list[np.ndarray], meta: dict,
                     n_gpu: np.ndarray) -> None:
    """A stored plan says one thing throughout: 0/1 masks, buckets that are their ones, per-layer keys of one entry
    per layer, device codes of the GPUs it names. Read unchecked, an inconsistent one ran on wrong neurons or failed
    inside the hybrid executor (3 of 11 hand-made ones under --gpu reference)."""
    def bad(why: str):
        raise PinferError(f"{f.path}: the stored plan is inconsistent ({why}); run pi-plan on the model again")

    L = len(masks)
    for b, (mask, bucket) in enumerate(zip(masks, buckets, strict=True)):
        if mask.ndim != 1 or (mask.size and not np.isin(mask, (0, 1)).all()):
            bad(f"layer {b}'s gpu_idx holds values other than 0 and 1")
        if not np.array_equal(bucket, np.flatnonzero(mask)):
            bad(f"layer {b}'s gpu_bucket is not the sorted indices of its GPU neurons")
    n_gpus = max(len(meta.get(C.PLAN_GPUS, []) or []), 1)
    for key in (C.PLAN_ATTN_GPU, C.PLAN_PRED_GPU, C.PLAN_FFN_GPU, C.PLAN_GPU_NEURONS, C.PLAN_SPLIT):
        v = meta.get(key)
        if v is None:
            continue
        if len(v) != L:
            bad(f"{key} has {len(v)} entries for {L} layers")
        if key in (C.PLAN_ATTN_GPU, C.PLAN_PRED_GPU, C.PLAN_FFN_GPU) and int(np.max(v, initial=0)) > n_gpus:
            bad(f"{key} names GPU {int(np.max(v))} of {n_gpus}")
    if C.PLAN_GPU_NEURONS in meta and not np.array_equal(np.asarray(meta[C.PLAN_GPU_NEURONS], np.int64), n_gpu):
        bad(f"{C.PLAN_GPU_NEURONS} does not count the neurons its gpu_idx puts on the GPU")
    if int(meta.get(C.PLAN_OUTPUT_GPU, 0)) > n_gpus:
        bad(f"{C.PLAN_OUTPUT_GPU} names GPU {int(meta[C.PLAN_OUTPUT_GPU])} of {n_gpus}")


def _n_layer(f: GGUFFile) -> int:
    if f.architecture == C.GPU_INDEX_ARCH:
        key, n = C.GPU_INDEX_BLOCK_COUNT, f.get(C.GPU_INDEX_BLOCK_COUNT, 0)
    else:
        key, n = f"{f.architecture}.block_count", f.arch_get(C.BLOCK_COUNT)
        if n is None:
            raise PinferError(f"{f.path}: no {key}; not a model or plan file")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise PinferError(f"{f.path}: metadata '{key}' is {quote(n, 40)}, expected a layer count; the file is corrupt")
    return bounded_layers(f, int(n), key)


def sidecar_problem(f: GGUFFile) -> str | None:
    """Why `f`'s <model>.generated.gpuidx is not the placement of the plan in `f`, or None (no sidecar, no plan, or
    they agree): the plan records the sidecar it was exported with; without that record, their masks are compared."""
    path = gpuidx_path(f.path)
    if not path.is_file():
        return None
    try:
        idx = read_gpuidx(path)
    except PinferError as e:
        return f"{path.name} cannot be read ({e}); PowerInfer would refuse it: run pi-plan --export-gpuidx again"
    want = f.get(C.PLAN_GPUIDX)
    if want is not None:
        if idx.fingerprint == want:
            return None
    else:
        masks = [f.raw(C.tensor(C.GPU_IDX, b)) for b in range(idx.n_layer) if f.has(C.tensor(C.GPU_IDX, b))]
        if len(masks) < idx.n_layer or all(np.array_equal(a, b) for a, b in zip(masks, idx.gpu_idx, strict=True)):
            return None
    return (f"{path.name} is stale: it is not the placement of the plan stored in {Path(f.path).name} (a pi-plan run "
            f"was interrupted between writing the two, or a later plan was made without --export-gpuidx); PowerInfer "
            f"reads the sidecar: run pi-plan {Path(f.path).name} --export-gpuidx again")


def copy_plan(src: str | os.PathLike, model: GGUFFile, dest: str | os.PathLike | None = None) -> Path:
    """Put the plan stored in `src` (a planned model, skeleton or .gpuidx) into `model`, if it was made for it. The
    model's own sidecar is refused when it is stale: applying it would bring back a plan the model replaced."""
    if Path(src).resolve() == gpuidx_path(model.path).resolve():
        stale = sidecar_problem(model)
        if stale:
            raise PinferError(stale)
    s = open_gguf(src)
    stored = read_plan(s, model)
    meta = dict(stored.meta)
    meta[C.PLAN_FINGERPRINT] = fingerprint(model)
    return write_plan(model, stored.masks, stored.buckets, meta, dest)


def export_gpuidx(path: str | os.PathLike, masks: list[np.ndarray], buckets: list[np.ndarray], vram_capacity: int,
                  fp: str | None = None) -> Path:
    """PowerInfer's <model>.generated.gpuidx (formats/gpuidx.py), exactly as its exporter writes it.

    split.vram_capacity holds the bytes the plan's GPU neurons need (PowerInfer ignores the file when less VRAM is
    left after its own dense offload). The file has room for nothing else, so it carries no fingerprint: a .gpuidx is
    checked against a model by its layer and neuron counts."""
    return write_gpuidx(path, masks, buckets, vram_capacity)


__all__ = ["StoredPlan", "copy_plan", "export_gpuidx", "fingerprint", "gpuidx_path", "plan_metadata", "read_plan",
           "sidecar_problem", "write_plan"]
