"""A planning problem: one model's bytes and activation statistics, one machine, and the costs between them.

Everything the solver, the baselines and the reports need comes from here; building it reads only the GGUF header
and the activation counts, so a 70B model loads in well under a second.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGMLQuantizationType

from pinfer_llm.formats.errors import PinferError
from pinfer_llm.formats.header import GGUFFile
from pinfer_llm.formats.reader import open_gguf
from pinfer_llm.planner.activations import Activations, load_activations
from pinfer_llm.planner.costmodel import Costs, costs, min_gpu_neurons
from pinfer_llm.planner.hardware import GIB, Hardware
from pinfer_llm.planner.memory import ModelBytes, account

DEFAULT_GROUP = 64
# KV cache element types: llama.cpp and PowerInfer keep f16; pinfer's CPU runtime keeps its activation dtype (f32).
KV_TYPES = {"f16": GGMLQuantizationType.F16, "f32": GGMLQuantizationType.F32, "q8_0": GGMLQuantizationType.Q8_0}


@dataclass
class Problem:
    model: ModelBytes
    hw: Hardware
    act: Activations
    order: list[np.ndarray]  # per layer: model index of the i-th most frequently active neuron
    prefix: list[np.ndarray]  # per layer [n_ff + 1]: activation mass of the k hottest neurons (expected actives)
    costs: Costs
    c_min: np.ndarray  # [L, D] the paper's per-layer minimum GPU neurons, derived from the sync cost
    budgets: list[int]  # per GPU: VRAM bytes for model parts (the GPU's budget less its workspace)
    host_budget: int  # host bytes for model parts (RAM less host-only tensors and the process reserve)
    group: int
    bounds: list[np.ndarray] | None = None  # per layer: the ILP's prefix breakpoints, if not every `group` neurons

    def breakpoints(self, l: int) -> np.ndarray:  # noqa: E741
        """Neuron counts at which the ILP's prefix-mass curve bends: 0, group, 2*group, ..., n_ff."""
        if self.bounds is not None:
            return self.bounds[l]
        n_ff = len(self.prefix[l]) - 1
        return np.append(np.arange(0, n_ff, self.group), n_ff)

    @property
    def mass(self) -> np.ndarray:
        return np.array([p[-1] for p in self.prefix])

    @property
    def n_gpus(self) -> int:
        return len(self.hw.gpus)


def build_problem(model: str | os.PathLike | GGUFFile, hw: Hardware, *, ctx_size: int | None = None,
                  act_dir: str | os.PathLike | None = None, act_tokens: int | None = None,
                  group: int = DEFAULT_GROUP, activations: Activations | None = None,
                  kv_type: str = "f16") -> Problem:
    """The planning problem for `model` on `hw`; `activations` overrides the statistics (calibration uses it)."""
    f = model if isinstance(model, GGUFFile) else open_gguf(model)
    if group < 1:
        raise PinferError(f"--group must be at least 1, got {group}")
    if kv_type not in KV_TYPES:
        raise PinferError(f"unknown --kv-type '{kv_type}' (one of {', '.join(KV_TYPES)})")
    mb = account(f, ctx_size, KV_TYPES[kv_type])
    # a group of more neurons than a layer has is the whole layer (--group 10^20 made numpy's breakpoints objects)
    group = min(group, max(mb.n_ff, default=1))
    act = activations or load_activations(f, mb.n_ff, act_dir, act_tokens)
    order, prefix = [], []
    for freq in act.freq:
        idx = np.argsort(-freq)  # ties in any fixed order; a stable sort is 4x slower on 80 x 28672 neurons
        order.append(idx.astype(np.int64))
        prefix.append(np.concatenate([[0.0], np.cumsum(freq[idx])]))
    c = costs(mb, hw)
    budgets = []
    for g in hw.gpus:
        left = g.budget_bytes - mb.gpu_workspace
        if left < 0:
            raise PinferError(f"VRAM budget of {g.budget_bytes / GIB:.2f} GiB on {g.name} is too small for the "
                              f"mandatory parts: the GPU workspace alone needs {mb.gpu_workspace:,} bytes")
        budgets.append(left)
    host_ram = int(hw.cpu.host_ram_gib * GIB)
    host_budget = host_ram - mb.host_fixed - mb.host_reserve
    if host_budget < 0:
        raise PinferError(f"host RAM of {hw.cpu.host_ram_gib:.1f} GiB is too small for the mandatory parts: "
                          f"embeddings and the process need {mb.host_fixed + mb.host_reserve:,} bytes")
    if mb.total > sum(budgets) + host_budget:
        raise PinferError(f"infeasible: {Path(f.path).name} needs {mb.total:,} bytes (weights and KV cache for "
                          f"{mb.ctx_size} tokens) but the VRAM budgets ({sum(budgets):,}) and host RAM "
                          f"({host_budget:,} free for the model) hold less; add --host-ram, a GPU or a smaller "
                          f"--ctx-size")
    return Problem(mb, hw, act, order, prefix, c, min_gpu_neurons(c, prefix), budgets, host_budget, group)
