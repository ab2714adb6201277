"""The latency cost model: predicted seconds per decoded token for a plan on some hardware.

Decoding one token is memory-bound work, part by part:

    time(part on device) = max(bytes read / (bandwidth * efficiency), flops / throughput) + kernels * latency

On the CPU the efficiency is one share (calibrated by pi-run timings, calibration.py) and the latency a dispatch
cost per operator. On a GPU both are constants of the machine file (hardware.py): an efficiency per weight type
(F16, Q8_0, Q4_0, ...) for matrix-vector kernels and another for the sparse FFN's gathered rows, and a fixed
latency per kernel, times the kernels the executor launches for that part.

Per layer, attention and the predictor run in turn on their devices; then the FFN's GPU neurons and CPU neurons run
at the same time, so the FFN costs max(GPU part, CPU part). A neuron costs its "dense" bytes on every token (the
projection that finds the active neurons when there is no predictor) and its "sparse" bytes on the tokens where it
fires, so a part's expected bytes are sum(dense) + sum(frequency * sparse) over its neurons.

A layer that uses both the CPU and a GPU is split, and pays twice:
- sync: the hidden state goes across PCIe and the partial result comes back (two small transfers), and the two
  sides wait for each other (a fixed join cost);
- host: one host thread both queues the GPU's work (CuPy calls and pinfer's Python around them, staging copies)
  and computes the CPU's neurons, so the CPU's neurons start only after that work. A split FFN costs
  max(GPU part, host + CPU part): the GPU's half runs while the host works. A layer that is split but whose FFN is
  whole on one side pays the host's time in series.
A layer wholly on one device pays neither; a hand-over between two such layers on different devices (one transfer,
~10 us per token) is left out, and so are a whole-GPU layer's launches, which the host queues ahead of the device.

Everything the model knows about the hardware is in `Costs`; `evaluate` is the exact reference the ILP's answers,
the baselines and the tests are all measured with.
"""
# ruff: noqa: E741 - l is a layer index, as in the formulation (sum over layers l)

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.header import type_name
from pinfer_llm.planner.hardware import Hardware
from pinfer_llm.planner.memory import ModelBytes, run_bytes
from pinfer_llm.planner.plan import CPU, Plan

# Operators per part on the CPU, each paying one dispatch.
ATTN_OPS = 12  # norm, q, k, v, two rope, two cache writes, scores, softmax, weighted sum, output, residual add
PRED_OPS = 3  # fc1, relu, fc2 (the threshold is folded into the consumer)
FFN_OPS = 5  # norm, gate, up, activation * up, down (and the add of the partial results)
OUTPUT_OPS = 3  # norm, matmul, logits copy
# Kernels per part on a GPU, each paying the fixed latency: what the executor launches in a decode step
# (tests/test_hybrid.py pins the list): norm, QKV, rope + KV store, attention's partial and combine, output;
# fc1, fc2, the CPU's active ids; the FFN norm, the sparse up and down; the head's norm and matmul.
GPU_ATTN_KERNELS = 6
GPU_PRED_KERNELS = 3
GPU_FFN_KERNELS = 3
GPU_OUTPUT_KERNELS = 2
_BLOCK = re.compile(r"^blk\.(\d+)\.")


@dataclass
class Speed:
    name: str
    bw: float  # bytes/s: the CPU's effective bandwidth; a GPU's datasheet bandwidth (its efficiencies apply per part)
    flops: float  # flop/s
    op: float  # seconds per operator dispatch or kernel

    def time(self, nbytes, flops, ops=0.0, efficiency=1.0):
        return np.maximum(np.asarray(nbytes) / (self.bw * efficiency), np.asarray(flops) / self.flops) + ops * self.op


def speeds(hw: Hardware) -> list[Speed]:
    """Device 0 is the CPU, device k GPU k."""
    c = hw.cpu
    out = [Speed("cpu", c.mem_bw_gbs * 1e9 * c.bw_efficiency, c.cores * c.gflops_per_core * 1e9, c.op_us * 1e-6)]
    for g in hw.gpus:
        out.append(Speed(g.name, g.mem_bw_gbs * 1e9, g.fp16_tflops * 1e12, hw.gpu_launch_us * 1e-6))
    return out


@dataclass
class Costs:
    """Seconds per token of each part on each device: column 0 the CPU, column k GPU k."""

    attn: np.ndarray  # [L, D] attention with its KV cache reads
    pred: np.ndarray  # [L, D] predictor (0 where the layer has none)
    dense: np.ndarray  # [L, D] per neuron held on the device
    sparse: np.ndarray  # [L, D] per unit of activation mass held on the device
    ffn_dispatch: np.ndarray  # [D] operators of one FFN part
    output: np.ndarray  # [D] output head
    sync: np.ndarray  # [L, D] a layer split between the CPU and GPU k: transfers and the join (column 0 unused)
    token: float  # per token, outside the layers (embedding row, sampling)
    speeds: list[Speed] = field(default_factory=list)
    host: np.ndarray | None = None  # [L, D] the host thread's work in a layer split with GPU k (column 0 unused)

    def __post_init__(self):
        if self.host is None:
            self.host = np.zeros_like(self.sync)


def _types(model: ModelBytes) -> tuple[list[dict[str, dict[str, float]]], dict[str, float]]:
    """Bytes by weight type of each layer's attention, predictor and FFN rows, and of the output head, from the
    tensor table in one pass; without one (a hand-made ModelBytes), the FFN's row types stand for every part."""
    layers: list[dict[str, dict[str, float]]] = [{"attn": {}, "pred": {}, "ffn": {}} for _ in model.layers]
    ffn = {getattr(C, n).format(bid="") for n in ("FFN_GATE", "FFN_UP", "FFN_DOWN_T", "FFN_UP_B", "FFN_DOWN")}
    pred = {getattr(C, n).format(bid="") for n in ("PRED_FC1", "PRED_FC2")}
    skip = {getattr(C, n).format(bid="") for n in ("GPU_IDX", "GPU_BUCKET", "ACT_COUNTS", "ACT_PEAK")}
    head: dict[str, float] = {}
    head_names = [n for n in (C.OUTPUT, C.OUTPUT_NORM) if n in model.table] or (
        [C.TOKEN_EMBD] if C.TOKEN_EMBD in model.table else [])
    for name, t in model.table.items():
        key = type_name(t.ggml_type)
        if name in head_names:
            head[key] = head.get(key, 0.0) + run_bytes(t)
        m = _BLOCK.match(name)
        if not m or int(m.group(1)) >= len(layers):
            continue
        rest = "blk.." + name[m.end():]
        if rest in skip:
            continue
        part = "ffn" if rest in ffn else "pred" if rest in pred else "attn"
        by = layers[int(m.group(1))][part]
        by[key] = by.get(key, 0.0) + run_bytes(t)
    for lb, parts in zip(model.layers, layers, strict=True):
        if not parts["ffn"]:
            parts["ffn"] = {type_name(ty): 1.0 for ty in lb.row_types.values()} or {"F16": 1.0}
        for part in ("attn", "pred"):
            parts[part] = parts[part] or parts["ffn"]
    return layers, head or (layers[0]["ffn"] if layers else {"F16": 1.0})


def _efficiency(hw: Hardware, by_type: dict[str, float], sparse: bool = False) -> float:
    """The one efficiency that reads these bytes in the same time as each type at its own: bytes / sum(bytes / e)."""
    total = sum(by_type.values())
    if total <= 0:
        return hw.gpu_efficiency("", sparse)
    return total / sum(b / hw.gpu_efficiency(ty, sparse) for ty, b in by_type.items())


def costs(model: ModelBytes, hw: Hardware) -> Costs:
    sp = speeds(hw)
    L, D = model.n_layer, len(sp)
    attn, pred, dense, sparse, sync, host = (np.zeros((L, D)) for _ in range(6))
    kv = {"F16": 1.0}  # the GPU's KV cache is f16, read by the attention kernel
    types, head_types = _types(model) if hw.gpus else ([], {})
    for l, lb in enumerate(model.layers):
        ty = types[l] if hw.gpus else {}
        for d, s in enumerate(sp):
            if d == CPU:
                attn[l, d] = s.time(lb.attn + lb.kv_read, lb.attn_flops + lb.kv_flops, ATTN_OPS)
                pred[l, d] = s.time(lb.pred, lb.pred_flops, PRED_OPS) if lb.has_predictor else 0.0
                dense[l, d] = s.time(lb.dense_per_neuron, lb.dense_flops_per_neuron)
                sparse[l, d] = s.time(lb.sparse_per_neuron, lb.sparse_flops_per_neuron)
                continue
            e_attn, e_kv = _efficiency(hw, ty["attn"]), _efficiency(hw, kv)
            # time of the weights at their efficiency plus the cache at its own, as one efficiency over the sum
            e_part = (lb.attn + lb.kv_read) / max(lb.attn / e_attn + lb.kv_read / e_kv, 1e-30)
            attn[l, d] = s.time(lb.attn + lb.kv_read, lb.attn_flops + lb.kv_flops, GPU_ATTN_KERNELS, e_part)
            pred[l, d] = (s.time(lb.pred, lb.pred_flops, GPU_PRED_KERNELS, _efficiency(hw, ty["pred"]))
                          if lb.has_predictor else 0.0)
            dense[l, d] = s.time(lb.dense_per_neuron, lb.dense_flops_per_neuron, 0, _efficiency(hw, ty["ffn"]))
            sparse[l, d] = s.time(lb.sparse_per_neuron, lb.sparse_flops_per_neuron, 0,
                                  _efficiency(hw, ty["ffn"], sparse=True))
    for k, g in enumerate(hw.gpus, start=1):
        hidden = 4 * model.n_embd  # f32 hidden state, each way
        sync[:, k] = 2 * (hw.pcie_latency_us * 1e-6 + hidden / (hw.pcie_gbs(g) * 1e9)) + hw.sync_us * 1e-6
        host[:, k] = hw.host_split_us * 1e-6
    out_eff = _efficiency(hw, head_types) if hw.gpus else 1.0
    output = np.array([s.time(model.output, model.output_flops, OUTPUT_OPS) if d == CPU else
                       s.time(model.output, model.output_flops, GPU_OUTPUT_KERNELS, out_eff)
                       for d, s in enumerate(sp)])
    token = hw.cpu.token_us * 1e-6 + sp[0].time(model.n_embd * 4, 0)
    ffn_dispatch = np.array([FFN_OPS * s.op if d == CPU else GPU_FFN_KERNELS * s.op for d, s in enumerate(sp)])
    return Costs(attn, pred, dense, sparse, ffn_dispatch, output, sync, token, sp, host)


def min_gpu_neurons(c: Costs, prefix: list[np.ndarray]) -> np.ndarray:
    """The paper's per-layer minimum C_l, derived from the costs of a split: [L, D] (column 0 unused).

    If a layer's attention and predictor are on the CPU, putting k of its neurons on GPU k makes it split. Moving
    those neurons back adds at most k * dense + mass(k hottest) * sparse of CPU time and saves the sync cost and
    the host's work (which the CPU's part waits for), so any k whose hottest-k CPU time is within sync + host is
    never better than k = 0: C_l is the first k past that.
    The ILP uses it as a valid cut (it removes no optimum) and the table reports it.
    """
    L, D = c.sync.shape
    out = np.zeros((L, D), dtype=np.int64)
    for l, pre in enumerate(prefix):
        n = len(pre) - 1
        cpu_time = np.arange(n + 1) * c.dense[l, CPU] + pre * c.sparse[l, CPU]
        for d in range(1, D):
            out[l, d] = min(int(np.searchsorted(cpu_time, c.sync[l, d] + c.host[l, d], side="right")), n)
    return out


@dataclass
class Evaluation:
    time: float  # seconds per token
    layer_time: np.ndarray  # [L]
    split: np.ndarray  # bool [L]
    vram: np.ndarray  # int64 [n_gpus] bytes, workspace included
    host: int  # bytes of host memory, fixed parts and reserve included
    gpu_neurons: float  # share of all neurons on a GPU
    hot_mass: float  # share of all activation mass on a GPU
    fits: bool
    problems: list[str]

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.time


def ffn_times(problem, l: int, a: int, pr: int, g: int, ks: np.ndarray) -> np.ndarray:
    """Exact FFN-plus-sync-plus-host time of layer l for each GPU-neuron count in ks, with attention on device a,
    the predictor on pr and the GPU neurons on GPU g: per layer, the rule `evaluate` applies (for the heuristics that
    search k)."""
    c, lb = problem.costs, problem.model.layers[l]
    N, pre = lb.n_ff, problem.prefix[l]
    mass = pre[ks]
    gpu = np.where(ks > 0, c.ffn_dispatch[g] + ks * c.dense[l, g] + mass * c.sparse[l, g], 0.0)
    cpu = np.where(ks < N, c.ffn_dispatch[CPU] + (N - ks) * c.dense[l, CPU] + (pre[-1] - mass) * c.sparse[l, CPU],
                   0.0)
    dense = {int(a)} | ({int(pr)} if lb.has_predictor else set())
    split_ffn = (ks > 0) & (ks < N)
    # the host's work for a split layer delays the CPU's neurons; the GPU's half runs meanwhile
    out = np.maximum(gpu, cpu + np.where(split_ffn, c.host[l, g], 0.0))
    for has_gpu, has_cpu, where in ((False, True, ks == 0), (True, True, split_ffn), (True, False, ks == N)):
        used = dense | ({g} if has_gpu else set()) | ({CPU} if has_cpu else set())
        if len(used) > 1:
            out[where] += c.sync[l, max(used)] + (0.0 if has_gpu and has_cpu else c.host[l, max(used)])
    return out


def evaluate(problem, plan: Plan) -> Evaluation:
    """Exact predicted time and memory of `plan` (a planner.problem.Problem gives the model, costs and budgets)."""
    m, c = problem.model, problem.costs
    L, J = m.n_layer, len(problem.hw.gpus)
    if plan.n_layer != L:
        raise ValueError(f"plan has {plan.n_layer} layers, model {L}")
    rows = np.arange(L)
    n_ff = np.array(m.n_ff)
    k = plan.n_gpu
    if (k < 0).any() or (k > n_ff).any() or (max(plan.attn.max(), plan.pred.max(), plan.ffn_gpu.max()) > J):
        raise ValueError(f"plan '{plan.name}' has devices or neuron counts out of range")
    mass_gpu = np.array([problem.prefix[l][k[l]] for l in range(L)])
    mass = problem.mass
    j = plan.ffn_gpu
    gpu_ffn = np.where(k > 0, c.ffn_dispatch[j] + k * c.dense[rows, j] + mass_gpu * c.sparse[rows, j], 0.0)
    cpu_ffn = np.where(k < n_ff, c.ffn_dispatch[CPU] + (n_ff - k) * c.dense[:, CPU]
                       + (mass - mass_gpu) * c.sparse[:, CPU], 0.0)
    has_pred = np.array([lb.has_predictor for lb in m.layers])
    split = np.zeros(L, dtype=bool)
    sync = np.zeros(L)
    host_cpu = np.zeros(L)  # the host's work before the CPU's neurons (split FFNs)
    for l in range(L):
        used = {int(plan.attn[l])}
        if has_pred[l]:
            used.add(int(plan.pred[l]))
        if k[l] > 0:
            used.add(int(j[l]))
        if k[l] < n_ff[l]:
            used.add(CPU)
        if len(used) > 1:
            split[l] = True
            sync[l] = c.sync[l, max(used)]
            if 0 < k[l] < n_ff[l]:
                host_cpu[l] = c.host[l, max(used)]
            else:  # the FFN whole on one side: nothing runs beside the host's work
                sync[l] += c.host[l, max(used)]
    layer_time = (c.attn[rows, plan.attn] + c.pred[rows, plan.pred] + np.maximum(gpu_ffn, cpu_ffn + host_cpu)
                  + sync)
    time = float(layer_time.sum() + c.output[plan.output] + c.token)

    neuron_bytes = np.array([int(lb.neuron_bytes(kk)) for lb, kk in zip(m.layers, k, strict=True)])
    attn_b = np.array([lb.attn + lb.kv for lb in m.layers])
    pred_b = np.array([lb.pred for lb in m.layers])
    ffn_b = np.array([lb.ffn for lb in m.layers])
    vram = np.zeros(J, dtype=np.int64)
    for g in range(1, J + 1):
        vram[g - 1] = (attn_b[plan.attn == g].sum() + pred_b[plan.pred == g].sum()
                       + neuron_bytes[j == g].sum() + (m.output if plan.output == g else 0))
    vram += np.int64(m.gpu_workspace) * (vram > 0)
    host = int(attn_b[plan.attn == CPU].sum() + pred_b[plan.pred == CPU].sum() + (ffn_b - neuron_bytes).sum()
               + (m.output if plan.output == CPU else 0) + m.host_fixed + m.host_reserve)
    problems = []
    for g, gpu in enumerate(problem.hw.gpus):
        if vram[g] > gpu.budget_bytes:
            problems.append(f"needs {vram[g]:,} bytes of VRAM on {gpu.name}, budget {gpu.budget_bytes:,}")
    host_ram = int(problem.hw.cpu.host_ram_gib * (1 << 30))
    if host > host_ram:
        problems.append(f"needs {host:,} bytes of host RAM, the host has {host_ram:,}")
    return Evaluation(time, layer_time, split, vram, host, float(k.sum() / n_ff.sum()),
                      float(mass_gpu.sum() / max(mass.sum(), 1e-30)), not problems, problems)


def cpu_work(problem, plan: Plan) -> tuple[float, float]:
    """(bytes read, operators dispatched) per token on the CPU under `plan`: the features a calibration fits."""
    m = problem.model
    nbytes, ops = 0.0, 0.0
    for l, lb in enumerate(m.layers):
        if plan.attn[l] == CPU:
            nbytes += lb.attn + lb.kv_read
            ops += ATTN_OPS
        if lb.has_predictor and plan.pred[l] == CPU:
            nbytes += lb.pred
            ops += PRED_OPS
        k, n = int(plan.n_gpu[l]), lb.n_ff
        if k < n:
            mass_cpu = problem.prefix[l][-1] - problem.prefix[l][k]
            nbytes += (n - k) * lb.dense_per_neuron + mass_cpu * lb.sparse_per_neuron
            ops += FFN_OPS
    if plan.output == CPU:
        nbytes += m.output
        ops += OUTPUT_OPS
    return nbytes, ops
