"""What the planner knows about a machine: GPUs from the built-in table (gpus.toml), the CPU detected or given, and
the constants of the engine that runs on them.

Precedence, lowest first: built-in table and detection < a `--hw` TOML file < command-line flags; machine.py puts
them together (resolve_hardware) and caches what is measured here (the CPU's memory bandwidth, by streaming a 256 MiB
buffer through all cores), so planning never waits on it twice.

A `--hw` file (every section and key optional; unknown keys are errors, so typos do not pass silently):

    [cpu]
    name = "i9-13900K"
    cores = 24
    mem_bw_gbs = 89.6          # streaming read bandwidth of all cores, GB/s
    host_ram_gib = 192
    bw_efficiency = 0.85       # share of mem_bw_gbs the engine's matrix-vector kernels reach
    gflops_per_core = 40.0
    op_us = 2.0                # dispatch cost per operator (thread wake-up and barrier)
    token_us = 50.0            # fixed cost per token outside the layers (sampling, bookkeeping)

    [pcie]
    bw_gbs = 25.0              # effective host<->device bandwidth; default from each GPU's generation and lanes
    latency_us = 10.0          # one small transfer, end to end

    [engine]                   # the GPU's kernels
    gpu_launch_us = 3.0        # fixed latency of one kernel on the device (launch to first byte, tail)
    gpu_bw_efficiency = 0.8    # share of the datasheet bandwidth a kernel reaches, for types not listed below
    gpu_dense_efficiency = { f16 = 0.87, q8_0 = 0.45, q4_0 = 0.30 }    # matrix-vector kernels, per weight type
    gpu_sparse_efficiency = { f16 = 0.39, q8_0 = 0.23, q4_0 = 0.12 }   # the sparse FFN's gathered rows
    sync_us = 10.0             # fixed cost of joining the CPU and GPU halves of a split layer (event wait)

    [host]                     # the one thread that queues the GPU's work and then computes the CPU's neurons
    split_layer_us = 16.3      # pinfer's Python per split layer and decode step (executor, device wrappers, staging)
    call_us = 5.0              # one CuPy driver call (launch, copy, event) on the host thread
    calls_per_split_layer = 2  # driver calls per split layer and decode step

    [[gpu]]                    # repeat for several GPUs in one host
    name = "rtx4090"           # a table name; the keys below override the table
    vram_budget_gib = 22.0
    [[gpu]]
    name = "my-card"           # not in the table: give vram_gib, mem_bw_gbs, pcie_gen, pcie_lanes, fp16_tflops
    vram_gib = 48
    mem_bw_gbs = 960
    pcie_gen = 4
    pcie_lanes = 16
    fp16_tflops = 91

A `--hw` file may also be the JSON that `benchmarks/hybrid_overhead.py --json` prints (the file name ends in .json):
its with_cuda_wrappers_us_per_layer becomes [host] split_layer_us and its cupy_calls_per_split_layer, where present,
calls_per_split_layer; everything else stays as the table, detection and flags give it.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import platform
import time
import tomllib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from pinfer_llm.formats.errors import PinferError

GIB = 1 << 30
PCIE_LANE_GBS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}  # per lane, after line coding
PCIE_EFFICIENCY = 0.8  # share of the link a cudaMemcpy of a few KB to MB reaches (packet and DMA overheads)
CUDA_RESERVE_GIB = 0.5  # CUDA context, driver and allocator slack kept out of the default budget

GPU_REQUIRED = ("vram_gib", "mem_bw_gbs", "pcie_gen", "pcie_lanes", "fp16_tflops")


@dataclass
class GPU:
    name: str
    vram_gib: float
    mem_bw_gbs: float
    pcie_gen: int
    pcie_lanes: int
    fp16_tflops: float
    vram_budget_gib: float | None = None  # None: vram_gib less CUDA_RESERVE_GIB

    @property
    def budget_bytes(self) -> int:
        gib = self.vram_budget_gib if self.vram_budget_gib is not None else max(self.vram_gib - CUDA_RESERVE_GIB, 0)
        return int(gib * GIB)

    @property
    def pcie_gbs(self) -> float:
        """Effective host<->device bandwidth of this card's link."""
        return PCIE_LANE_GBS[self.pcie_gen] * self.pcie_lanes * PCIE_EFFICIENCY


@dataclass
class CPU:
    name: str
    cores: int
    mem_bw_gbs: float
    host_ram_gib: float
    bw_efficiency: float = 0.85
    gflops_per_core: float = 40.0
    op_us: float = 2.0
    token_us: float = 50.0
    calibrated: bool = False  # op_us/token_us/bw_efficiency come from a pi-run calibration on this machine

    @property
    def key(self) -> str:
        """Identifies a machine's CPU for the bandwidth and calibration caches."""
        return f"{self.name}|{self.cores}"


# The GPU's kernel efficiencies by weight type, as shares of the datasheet bandwidth, from the one H200 run
# (2026-11-30, docs/gpu.md: copy 4.25 TB/s = 0.885 of the 4.8 datasheet; per kernel at 13824 x 5120, one token, the
# share of copy bandwidth with GPU_KERNEL_US taken off its time): dense GEMV F16 90%, Q8_0 47%, Q4_0 31%; the sparse
# FFN at 10% active (gate+up 19 us, down 9.6 us at F16) F16 35%, Q8_0 20%, Q4_0 11%. `make gpu-check` refits them.
# Types it did not measure take the value of the kernel they share a layout with (GPU_TYPE_LIKE).
GPU_KERNEL_US = 3.0
GPU_DENSE_EFFICIENCY = {"f16": 0.87, "q8_0": 0.45, "q4_0": 0.30}
GPU_SPARSE_EFFICIENCY = {"f16": 0.39, "q8_0": 0.23, "q4_0": 0.12}
GPU_TYPE_LIKE = {"bf16": "f16", "f32": "f16", "q4_1": "q4_0", "q4_k": "q4_0", "q5_0": "q8_0", "q5_1": "q8_0",
                 "q5_k": "q8_0", "q6_k": "q8_0", "iq4_nl": "q8_0", "iq4_xs": "q8_0"}  # the GPU's copies
# (runtime/weights.py rows_runnable, memory.RUN_AS): Q4_K as Q4_1, Q5_*, Q6_K and the IQ4 types as Q8_0
# The host thread per split layer and decode step. HOST_SPLIT_LAYER_US: pinfer's own Python around the device calls
# (executor, CudaDevice's wrappers, staging): `python benchmarks/hybrid_overhead.py --json --steps 400`,
# with_cuda_wrappers_us_per_layer, the median of 3 runs (16.3, 16.3, 16.6) on 2026-12-04 with each split layer's
# decode step replayed as a CUDA graph, Intel Xeon (Sapphire Rapids), 2 cores, idle (84.3 before the graphs; 155.1
# on an AVX2 EPYC after 2026-12-02). HOST_CALL_US: CuPy's own cost per driver call from Python, an estimate (5-10
# us; not measured: no GPU here). HOST_CALLS_PER_SPLIT_LAYER: a graph launch and an event wait (the same run counts
# 2.2 per split layer with the first steps' eager ones; ~20 queued one by one). `make gpu-check` refits the host's
# time on the device's host.
HOST_SPLIT_LAYER_US = 16.3
HOST_CALL_US = 5.0
HOST_CALLS_PER_SPLIT_LAYER = 2


@dataclass
class Hardware:
    cpu: CPU
    gpus: list[GPU] = field(default_factory=list)
    pcie_bw_gbs: float | None = None  # overrides every GPU's link
    pcie_latency_us: float = 10.0
    gpu_launch_us: float = GPU_KERNEL_US  # fixed latency of one kernel on the device
    gpu_bw_efficiency: float = 0.8  # types in neither table below
    gpu_dense_efficiency: dict[str, float] = field(default_factory=lambda: dict(GPU_DENSE_EFFICIENCY))
    gpu_sparse_efficiency: dict[str, float] = field(default_factory=lambda: dict(GPU_SPARSE_EFFICIENCY))
    sync_us: float = 10.0
    host_split_layer_us: float = HOST_SPLIT_LAYER_US
    host_call_us: float = HOST_CALL_US
    host_calls_per_split_layer: float = HOST_CALLS_PER_SPLIT_LAYER

    def pcie_gbs(self, gpu: GPU) -> float:
        return self.pcie_bw_gbs if self.pcie_bw_gbs is not None else gpu.pcie_gbs

    def gpu_efficiency(self, type_name: str, sparse: bool = False) -> float:
        """Share of a GPU's datasheet bandwidth the kernels reach on weights of `type_name` (a ggml type name, any
        case): the sparse FFN's gathered rows, or a matrix-vector kernel."""
        table = self.gpu_sparse_efficiency if sparse else self.gpu_dense_efficiency
        key = type_name.lower()
        for k in (key, GPU_TYPE_LIKE.get(key)):
            if k in table:
                return table[k]
        return self.gpu_bw_efficiency

    @property
    def host_split_us(self) -> float:
        """The host thread's time per split layer and decode step, before the CPU's neurons can start."""
        return self.host_split_layer_us + self.host_calls_per_split_layer * self.host_call_us

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


# --- the GPU table ------------------------------------------------------------------------------------------------

@cache
def gpu_table() -> dict[str, dict]:
    with open(Path(__file__).with_name("gpus.toml"), "rb") as fh:
        return tomllib.load(fh)


def lookup_gpu(name: str) -> GPU:
    table = gpu_table()
    key = name.strip().lower()
    if key not in table:
        close = difflib.get_close_matches(key, table, n=4, cutoff=0.5)
        hint = f"close names: {', '.join(close)}" if close else f"known: {', '.join(table)}"
        raise PinferError(f"unknown GPU '{name}'; {hint} (pi-plan gpus lists the table, --hw describes other cards)")
    return GPU(name=key, **table[key])


# --- the CPU ------------------------------------------------------------------------------------------------------

def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def detect_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def host_ram_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError, AttributeError):
        return 16.0


def measure_cpu_bandwidth(cores: int, mib: int = 256, repeats: int = 5) -> float:
    """Streaming read bandwidth of `cores` threads in GB/s: the best of a few sums over a buffer larger than cache."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(cores)
    try:
        x = torch.ones(mib << 18, dtype=torch.float32)
        x.sum()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t0)
        return x.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(threads)


# --- the --hw file ------------------------------------------------------------------------------------------------

_CPU_KEYS = {"name": str, "cores": int, "mem_bw_gbs": float, "host_ram_gib": float, "bw_efficiency": float,
             "gflops_per_core": float, "op_us": float, "token_us": float}
_PCIE_KEYS = {"bw_gbs": float, "latency_us": float}
_ENGINE_KEYS = {"gpu_launch_us": float, "gpu_bw_efficiency": float, "gpu_dense_efficiency": dict,
                "gpu_sparse_efficiency": dict, "sync_us": float}
_HOST_KEYS = {"split_layer_us": float, "call_us": float, "calls_per_split_layer": float}
_ZERO_OK_HOST = {"split_layer_us", "call_us", "calls_per_split_layer"}
# hybrid_overhead.py --json key -> [host] key
OVERHEAD_JSON_KEYS = {"with_cuda_wrappers_us_per_layer": "split_layer_us",
                      "cupy_calls_per_split_layer": "calls_per_split_layer"}
_GPU_KEYS = {"name": str, "vram_gib": float, "mem_bw_gbs": float, "pcie_gen": int, "pcie_lanes": int,
             "fp16_tflops": float, "vram_budget_gib": float}
_ZERO_OK = {"op_us", "token_us", "latency_us", "gpu_launch_us", "sync_us"} | _ZERO_OK_HOST


# What a number of a machine (in a --hw file or a flag) may be: finite, and within what a machine can have. Beyond
# these a value is a typo, and the cost model's products overflow: NaN reached the solver ("internal error:
# PulpError: Cannot multiply variables with NaN/inf values"), 1e300 GiB of RAM became int(inf) ("OverflowError"), and
# 1e-300 GB/s, or 1e300 us per operator, made every plan "infeasible: no placement fits the VRAM budget(s) and host
# RAM", which is not what was wrong. Microseconds and counts not named here: from 0 (or above 0) to US_MAX.
RANGES = {"cores": (1, 4096), "pcie_gen": (1, 8), "pcie_lanes": (1, 64), "mem_bw_gbs": (1e-3, 1e7),
          "bw_gbs": (1e-3, 1e7), "gflops_per_core": (1e-3, 1e7), "fp16_tflops": (1e-3, 1e7),
          "host_ram_gib": (0, 2**30), "vram_gib": (0, 2**30), "vram_budget_gib": (0, 2**30),
          "bw_efficiency": (1e-9, 1), "gpu_bw_efficiency": (1e-9, 1)}
# of a bandwidth: below, again "infeasible" (1e-20 is); the GPU emulation's fitted efficiencies are ~1e-6
SHARE_MIN = 1e-9
US_MAX = 1e6
UNITS = {"gbs": " GB/s", "gib": " GiB", "us": " us", "tflops": " TFLOPS"}


def check_range(name: str, key: str, value: float) -> None:
    """`value` of the machine quantity `key` (named `name` in the message: a flag or a file's key) is finite and in
    RANGES; a PinferError saying which bounds otherwise. A bound of 0 is exclusive (zero is refused by the callers,
    where it is not allowed)."""
    lo, hi = RANGES.get(key, (0, US_MAX))
    unit = UNITS.get(key.rsplit("_", 1)[-1], "")
    if not (math.isfinite(value) and lo <= value <= hi):
        shown = [f"{int(b):,}" if float(b).is_integer() else f"{b:g}" for b in (lo, hi)]
        raise PinferError(f"{name} must be a finite number from {shown[0]} to {shown[1]}{unit}, got {value!r}")


def _checked(path: Path, section: str, table, schema: dict) -> dict:
    if not isinstance(table, dict):
        raise PinferError(f"{path}: [{section}] must be a table")
    out = {}
    for key, value in table.items():
        if key not in schema:
            raise PinferError(f"{path}: unknown key '{key}' in [{section}] (known: {', '.join(schema)})")
        want = schema[key]
        if want is dict:  # efficiency by weight type: { f16 = 0.87, q4_0 = 0.30 }
            if not isinstance(value, dict) or not value:
                raise PinferError(f"{path}: [{section}] {key} must be a table of weight types, e.g. "
                                  f"{{ f16 = 0.87, q4_0 = 0.30 }}")
            out[key] = {}
            for ty, share in value.items():
                if isinstance(share, bool) or not isinstance(share, (int, float)) or not SHARE_MIN <= share <= 1:
                    raise PinferError(f"{path}: [{section}] {key}.{ty} is a share of the bandwidth, in "
                                      f"[{SHARE_MIN:g}, 1]; got {share!r}")
                out[key][ty.lower()] = float(share)
            continue
        if want is str:
            if not isinstance(value, str) or not value:
                raise PinferError(f"{path}: [{section}] {key} must be a non-empty string")
        else:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (want is int and value != int(value)):
                raise PinferError(f"{path}: [{section}] {key} must be {'an integer' if want is int else 'a number'}, "
                                  f"got {value!r}")
            if value < 0 or (value == 0 and key not in _ZERO_OK):
                raise PinferError(f"{path}: [{section}] {key} must be positive, got {value!r}")
            check_range(f"{path}: [{section}] {key}", key, value)  # TOML and JSON both read nan and inf
            value = want(value)
        out[key] = value
    return out


def load_hw_file(path: str | os.PathLike) -> dict:
    """Parse and validate a --hw file into {'cpu': {...}, 'pcie': {...}, 'engine': {...}, 'host': {...},
    'gpus': [GPU, ...]}: a TOML machine file, or the JSON of benchmarks/hybrid_overhead.py --json (host constants)."""
    from pinfer_llm.formats.textfile import read_text

    path = Path(path)
    text = read_text(path, "--hw file")  # a FIFO, a device, a binary file: one line each
    if path.suffix.lower() == ".json":
        return _overhead_json(path, text)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PinferError(f"{path}: malformed TOML in --hw file: {exc}") from None
    unknown = set(raw) - {"cpu", "pcie", "engine", "host", "gpu"}
    if unknown:
        raise PinferError(f"{path}: unknown section(s) {', '.join(sorted(unknown))} (known: cpu, pcie, engine, host, "
                          f"gpu)")
    spec = {"cpu": _checked(path, "cpu", raw.get("cpu", {}), _CPU_KEYS),
            "pcie": _checked(path, "pcie", raw.get("pcie", {}), _PCIE_KEYS),
            "engine": _checked(path, "engine", raw.get("engine", {}), _ENGINE_KEYS),
            "host": _checked(path, "host", raw.get("host", {}), _HOST_KEYS), "gpus": []}
    if "bw_efficiency" in spec["cpu"] and spec["cpu"]["bw_efficiency"] > 1:
        raise PinferError(f"{path}: [cpu] bw_efficiency is a share of the bandwidth and must be at most 1")
    gpus = raw.get("gpu", [])
    if not isinstance(gpus, list):
        raise PinferError(f"{path}: GPUs are written [[gpu]] (an array of tables)")
    for i, entry in enumerate(gpus):
        g = _checked(path, f"gpu #{i + 1}", entry, _GPU_KEYS)
        if "name" not in g:
            raise PinferError(f"{path}: [[gpu]] #{i + 1} needs a name")
        if g["name"].lower() in gpu_table():
            base = dataclasses.asdict(lookup_gpu(g["name"]))
        else:
            missing = [k for k in GPU_REQUIRED if k not in g]
            if missing:
                raise PinferError(f"{path}: GPU '{g['name']}' is not in the built-in table, so it needs "
                                  f"{', '.join(missing)}")
            base = {}
        base.update(g)
        if base["pcie_gen"] not in PCIE_LANE_GBS:
            raise PinferError(f"{path}: GPU '{g['name']}' pcie_gen must be one of {sorted(PCIE_LANE_GBS)}")
        spec["gpus"].append(GPU(**base))
    return spec


def _overhead_json(path: Path, text: str) -> dict:
    """The host constants from benchmarks/hybrid_overhead.py --json, as a --hw file's [host] section."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise PinferError(f"{path}: malformed JSON in --hw file: {exc}") from None
    if not isinstance(data, dict) or "with_cuda_wrappers_us_per_layer" not in data:
        raise PinferError(f"{path}: a JSON --hw file is the output of benchmarks/hybrid_overhead.py --json (it has "
                          f"with_cuda_wrappers_us_per_layer); machine files are TOML")
    host = _checked(path, "host", {OVERHEAD_JSON_KEYS[k]: v for k, v in data.items() if k in OVERHEAD_JSON_KEYS},
                    _HOST_KEYS)
    return {"cpu": {}, "pcie": {}, "engine": {}, "host": host, "gpus": []}
