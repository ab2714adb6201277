"""This machine as the planner sees it: the cache of what was measured on it (CPU bandwidth, pi-run calibrations) and
resolve_hardware, which puts the GPU table, a --hw file, detection and flags together.

It sits above hardware (the table, --hw files, detection), calibration (fitting) and costmodel: it imports them and
none of them imports it. The cache lives in $PINFER_CACHE_DIR, else $XDG_CACHE_HOME/pinfer, else ~/.cache/pinfer.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path

from pinfer_llm.formats.errors import PinferError
from pinfer_llm.planner.calibration import Calibration
from pinfer_llm.planner.hardware import (
    CPU,
    Hardware,
    check_range,
    cpu_name,
    detect_cores,
    host_ram_gib,
    load_hw_file,
    lookup_gpu,
    measure_cpu_bandwidth,
)

BANDWIDTH_CACHE = "cpu.json"
CALIBRATION_CACHE = "calibration.json"


# --- the cache ----------------------------------------------------------------------------------------------------

def cache_dir() -> Path:
    """$PINFER_CACHE_DIR, else $XDG_CACHE_HOME/pinfer, else ~/.cache/pinfer; an empty variable counts as unset (the
    XDG spec says so, and an empty root would put the cache in the working directory)."""
    if os.environ.get("PINFER_CACHE_DIR"):
        return Path(os.environ["PINFER_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base).expanduser() / "pinfer"


def read_cache(name: str) -> dict:
    try:
        data = json.loads((cache_dir() / name).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_cache(name: str, data: dict) -> None:
    """Best effort: a read-only home must not stop planning."""
    path = cache_dir() / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass


# --- what was measured here ---------------------------------------------------------------------------------------

def cpu_bandwidth(name: str, cores: int) -> float:
    """Measured once per CPU and core count, then read from the cache."""
    key = CPU(name, cores, 0.0, 0.0).key
    cached = read_cache(BANDWIDTH_CACHE)
    if key in cached:
        return float(cached[key]["mem_bw_gbs"])
    bw = measure_cpu_bandwidth(cores)
    cached[key] = {"mem_bw_gbs": round(bw, 2), "measured": datetime.now(UTC).isoformat(timespec="seconds")}
    write_cache(BANDWIDTH_CACHE, cached)
    return bw


def this_cpu_key() -> str:
    """The cache key of this machine's own CPU, as detected."""
    return CPU(cpu_name(), detect_cores(), 0.0, 0.0).key


def save_calibration(cal: Calibration) -> None:
    data = read_cache(CALIBRATION_CACHE)
    data[cal.cpu_key] = cal.to_dict()
    write_cache(CALIBRATION_CACHE, data)


def load_calibration(cpu_key: str) -> Calibration | None:
    d = read_cache(CALIBRATION_CACHE).get(cpu_key)
    if not d:
        return None
    try:
        return Calibration(**d)
    except TypeError:
        return None  # written by another layout: ignore it


def forget_calibration(cpu_key: str) -> None:
    data = read_cache(CALIBRATION_CACHE)
    if data.pop(cpu_key, None) is not None:
        write_cache(CALIBRATION_CACHE, data)


def apply_calibration(cpu: CPU) -> None:
    """Use the fitted constants for this CPU, if any (only called for this machine's own detected CPU)."""
    cal = load_calibration(cpu.key)
    if cal is None:
        return
    cpu.bw_efficiency = cal.bw_gbs / cpu.mem_bw_gbs
    cpu.op_us = cal.op_us
    cpu.token_us = cal.token_us
    cpu.calibrated = True


# --- putting it together ------------------------------------------------------------------------------------------

def resolve_hardware(gpus: list[str] | None = None, *, vram_budget_gib: float | None = None,
                     pcie_bw_gbs: float | None = None, cpu_cores: int | None = None, cpu_bw_gbs: float | None = None,
                     host_ram: float | None = None, hw_file: str | os.PathLike | None = None,
                     calibration: bool = True) -> Hardware:
    """Hardware from the table, an optional --hw file and flags (in that order of precedence)."""
    spec = load_hw_file(hw_file) if hw_file else {"cpu": {}, "pcie": {}, "engine": {}, "host": {}, "gpus": []}
    gpu_list = [lookup_gpu(n) for n in gpus] if gpus else list(spec["gpus"])
    for name, key, value in (("--vram-budget", "vram_budget_gib", vram_budget_gib),
                             ("--pcie-bw", "bw_gbs", pcie_bw_gbs), ("--cpu-cores", "cores", cpu_cores),
                             ("--cpu-bw", "mem_bw_gbs", cpu_bw_gbs), ("--host-ram", "host_ram_gib", host_ram)):
        if value is not None and value <= 0:
            raise PinferError(f"{name} must be positive, got {value}")
        if value is not None:
            check_range(name, key, value)  # the same bounds as a --hw file's
    if vram_budget_gib is not None:
        for g in gpu_list:
            g.vram_budget_gib = vram_budget_gib
    for g in gpu_list:
        if g.vram_budget_gib is not None and g.vram_budget_gib > g.vram_gib:
            raise PinferError(f"VRAM budget {g.vram_budget_gib:g} GiB exceeds the {g.vram_gib:g} GiB of {g.name}")

    c = dict(spec["cpu"])
    if cpu_cores is not None:
        c["cores"] = cpu_cores
    if cpu_bw_gbs is not None:
        c["mem_bw_gbs"] = cpu_bw_gbs
    if host_ram is not None:
        c["host_ram_gib"] = host_ram
    detected = not c  # nothing given: this machine's CPU, the only one a calibration can describe
    c.setdefault("name", cpu_name())
    c.setdefault("cores", detect_cores())
    if "mem_bw_gbs" not in c:
        c["mem_bw_gbs"] = cpu_bandwidth(c["name"], c["cores"])
    c.setdefault("host_ram_gib", host_ram_gib())
    cpu = CPU(**c)
    if detected and calibration:
        apply_calibration(cpu)

    hw = Hardware(cpu=cpu, gpus=gpu_list)
    if spec["pcie"].get("bw_gbs") is not None:
        hw.pcie_bw_gbs = spec["pcie"]["bw_gbs"]
    if pcie_bw_gbs is not None:
        hw.pcie_bw_gbs = pcie_bw_gbs
    if "latency_us" in spec["pcie"]:
        hw.pcie_latency_us = spec["pcie"]["latency_us"]
    for key, value in spec["engine"].items():
        if isinstance(value, dict):  # a file's efficiencies add to the defaults: types it does not name keep theirs
            value = getattr(hw, key) | value
        setattr(hw, key, value)
    for key, value in spec["host"].items():
        setattr(hw, f"host_{key}", value)
    return hw
