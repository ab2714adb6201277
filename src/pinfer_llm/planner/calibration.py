"""Calibrating the cost model's CPU side against measured pi-run decode times on this machine.

The model predicts a CPU-only token as

    seconds = cpu_bytes / bandwidth + cpu_ops * op_cost + token_cost

where cpu_bytes and cpu_ops come from the cost model for the model and plan that ran (costmodel.cpu_work). Given
measured seconds per token for a few runs (different models, sparsities, contexts), `fit` finds the three constants
by non-negative least squares. machine.py stores a calibration in the cache under the CPU's key and
machine.resolve_hardware applies it whenever it plans for this machine's own, undetailed CPU.
benchmarks/plan_calibration.py measures and fits.

On a machine with a GPU, `fit_device` turns the kernels' measured times (benchmarks/gpu_check.py) into the GPU's
constants (efficiency per weight type for dense and sparse kernels, latency per kernel), and `calibrate_hybrid` fits
the two the hybrid executor's runs pin down (the CPU's effective bandwidth on pi-run's threads, from a CPU-only run,
and the host thread's time per split layer, from a run with split layers), then predicts the other runs out of
sample; `HybridFit.hw_lines` writes all of them as a `--hw` file. make gpu-check runs both.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

import numpy as np

from pinfer_llm.planner.costmodel import cpu_work


@dataclass
class Sample:
    label: str
    cpu_bytes: float  # per token, from the cost model
    cpu_ops: float  # per token, from the cost model
    seconds: float  # measured per token


@dataclass
class Calibration:
    cpu_key: str
    bw_gbs: float  # effective bandwidth of the engine's CPU kernels
    op_us: float
    token_us: float
    measured_bw_gbs: float  # the streaming bandwidth measured when this was fitted
    date: str
    samples: list[dict] = field(default_factory=list)

    def predict(self, s: Sample) -> float:
        return s.cpu_bytes / (self.bw_gbs * 1e9) + s.cpu_ops * self.op_us * 1e-6 + self.token_us * 1e-6

    def to_dict(self) -> dict:
        return asdict(self)


def sample(problem, plan, label: str, seconds: float) -> Sample:
    nbytes, ops = cpu_work(problem, plan)
    return Sample(label, nbytes, ops, seconds)


def fit(samples: list[Sample]) -> tuple[float, float, float]:
    """(seconds per byte, seconds per operator, seconds per token) >= 0 minimising the squared relative error.

    Non-negative least squares by trying every subset of the three terms (there are seven): with two or three
    samples the terms are nearly collinear, and a negative cost per operator would predict nonsense elsewhere.
    """
    if not samples:
        raise ValueError("no samples to fit")
    X = np.array([[s.cpu_bytes, s.cpu_ops, 1.0] for s in samples])
    y = np.array([s.seconds for s in samples])
    w = 1.0 / y  # relative errors: a 10 ms token and a 1 s token count the same
    best, best_err = None, np.inf
    for r in range(1, 4):
        for cols in itertools.combinations(range(3), r):
            if 0 not in cols:
                continue  # bandwidth always matters: the model is memory-bound
            A = X[:, cols] * w[:, None]
            coef, *_ = np.linalg.lstsq(A, y * w, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(3)
            full[list(cols)] = coef
            err = float(np.sum(((X @ full) - y) ** 2 * w ** 2))
            if err < best_err * (1 - 1e-9):  # fewer terms come first and win ties
                best, best_err = full, err
    return float(best[0]), float(best[1]), float(best[2])


def calibrate(cpu_key: str, measured_bw_gbs: float, samples: list[Sample]) -> Calibration:
    """Fit `samples`; machine.save_calibration stores the result for resolve_hardware to apply."""
    per_byte, per_op, per_token = fit(samples)
    return Calibration(cpu_key, 1e-9 / per_byte if per_byte > 0 else measured_bw_gbs, per_op * 1e6, per_token * 1e6,
                       measured_bw_gbs, datetime.now(UTC).isoformat(timespec="seconds"), [asdict(s) for s in samples])


@dataclass
class DeviceFit:
    """The GPU's constants from timed kernels: efficiency per weight type (share of the datasheet bandwidth) for the
    matrix-vector and the sparse FFN kernels, and the fixed latency per kernel; `kernels` says what each came from."""

    gpu_launch_us: float | None
    dense: dict[str, float]
    sparse: dict[str, float]
    kernels: dict[str, str] = field(default_factory=dict)


def fit_device(records: list[dict], datasheet_gbs: float) -> DeviceFit:
    """records: {"kernel": "gemv" | "sparse_up" | "sparse_down" | "latency", "type": "f16", "us": time per call,
    "touched_bytes": bytes read and written} for one-token calls. The latency is the median of the "latency"
    records (a kernel that moves almost nothing); each type's efficiency is its bytes over its time less that
    latency, against the datasheet, the sparse one over the up and down kernels together (the FFN's two launches)."""
    lat = [r["us"] for r in records if r["kernel"] == "latency"]
    launch = float(np.median(lat)) if lat else None
    base = launch or 0.0
    dense, sparse, src = {}, {}, {}
    by: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        if r["kernel"] != "latency" and r.get("us", 0) > 0:
            by.setdefault(("sparse" if r["kernel"].startswith("sparse") else "dense", r["type"].lower()), []).append(r)
    for (kind, ty), rs in sorted(by.items()):
        nbytes = sum(r["touched_bytes"] for r in rs)
        secs = sum(max(r["us"] - base, 0.05 * r["us"]) for r in rs) * 1e-6  # a kernel is never all latency
        eff = min(max(nbytes / secs / (datasheet_gbs * 1e9), 1e-6), 1.0)  # (0, 1], as a machine file takes it
        (sparse if kind == "sparse" else dense)[ty] = float(f"{eff:.3g}")
        src[f"{kind} {ty}"] = " + ".join(f"{r['kernel']} {r['us']:.1f} us" for r in rs)
    return DeviceFit(launch, dense, sparse, src)


@dataclass
class HybridFit:
    """The cost model's constants on a GPU machine, the two that runs pin down each fitted from the one run it
    dominates: cpu_bw_gbs, the CPU's effective bandwidth on pi-run's threads (from a run with nothing on the GPU),
    and host_split_layer_us, the host thread's time per split layer beyond its CuPy calls (from a run with split
    layers); `device` the GPU's constants from the kernels (None: the machine file's). predicted / measured: tokens/s
    per run with all of them; before: the prediction with the constants the planner had; fitted_on: the runs the
    constants came from (the others are predictions out of sample)."""

    cpu_bw_gbs: float
    host_split_layer_us: float
    predicted: dict[str, float]
    measured: dict[str, float]
    fitted_on: list[str]
    before: dict[str, float] = field(default_factory=dict)
    device: DeviceFit | None = None
    # The CPU's operator and token costs (op_us, token_us) as fitted: None where they kept the machine's values
    cpu_fixed_us: tuple[float, float] | None = None

    def errors(self) -> dict[str, float]:
        """Relative error of each prediction: predicted / measured - 1."""
        return {k: self.predicted[k] / self.measured[k] - 1 for k in self.measured}

    def errors_before(self) -> dict[str, float]:
        return {k: self.before[k] / self.measured[k] - 1 for k in self.measured if k in self.before}

    def hw_lines(self) -> str:
        """The fitted constants as a `pi-plan --hw` file (TOML)."""
        lines = ["[cpu]", f"mem_bw_gbs = {self.cpu_bw_gbs:.2f}", "bw_efficiency = 1.0"]
        if self.cpu_fixed_us is not None:
            lines += [f"op_us = {self.cpu_fixed_us[0]:.3f}", f"token_us = {self.cpu_fixed_us[1]:.2f}"]
        d = self.device
        if d is not None and (d.gpu_launch_us is not None or d.dense or d.sparse):
            lines.append("[engine]")
            if d.gpu_launch_us is not None:
                lines.append(f"gpu_launch_us = {d.gpu_launch_us:.2f}")
            for key, table in (("gpu_dense_efficiency", d.dense), ("gpu_sparse_efficiency", d.sparse)):
                if table:
                    lines.append(f"{key} = {{ " + ", ".join(f"{k} = {v:.3g}" for k, v in table.items()) + " }")
        lines += ["[host]", f"split_layer_us = {self.host_split_layer_us:.1f}"]
        return "\n".join(lines) + "\n"


def with_device(hw, device: DeviceFit | None):
    """hw with the GPU constants of `device` in place (types it did not measure keep theirs)."""
    from dataclasses import replace

    if device is None:
        return hw
    kw = {"gpu_dense_efficiency": hw.gpu_dense_efficiency | device.dense,
          "gpu_sparse_efficiency": hw.gpu_sparse_efficiency | device.sparse}
    if device.gpu_launch_us is not None:
        kw["gpu_launch_us"] = device.gpu_launch_us
    return replace(hw, **kw)


def calibrate_hybrid(problem, runs: dict, cpu_run: str = "cpu", split_run: str = "plan",
                     device: DeviceFit | None = None) -> HybridFit:
    """Fit HybridFit's constants to measured runs. runs: label -> (planner.plan.Plan, measured seconds per token);
    `cpu_run` must keep everything on the CPU, `split_run` must have a split layer whose time depends on the host.
    The CPU's operator and token costs keep their values (one run cannot separate them from its bandwidth) unless
    the CPU-only run beat them alone; then they are scaled down together at the machine's bandwidth (cpu_fixed_us).
    The host's CuPy calls keep theirs (the fit is the rest of its time). Raises ValueError when the runs cannot pin a
    constant down."""
    from dataclasses import replace

    from pinfer_llm.planner.costmodel import costs, evaluate

    hw0 = with_device(problem.hw, device)

    def solved(bw_gbs: float, split_us: float, fixed_scale: float = 1.0):
        c = hw0.cpu
        cpu = replace(c, mem_bw_gbs=bw_gbs, bw_efficiency=1.0, op_us=c.op_us * fixed_scale,
                      token_us=c.token_us * fixed_scale)
        h = replace(hw0, cpu=cpu, host_split_layer_us=split_us)
        return replace(problem, hw=h, costs=costs(problem.model, h))

    def bisect(f, lo: float, hi: float, target: float, geometric: bool) -> float:
        """x in [lo, hi] with f(x) = target, f monotone (decreasing when geometric: bandwidth; else increasing)."""
        for _ in range(60):
            mid = (lo * hi) ** 0.5 if geometric else (lo + hi) / 2
            above = f(mid) > target
            lo, hi = (mid, hi) if above == geometric else (lo, mid)
        return (lo * hi) ** 0.5 if geometric else (lo + hi) / 2

    # The bandwidth at which the cost model's time of the CPU-only run is the measured one (it falls as the
    # bandwidth grows, not quite as 1/bandwidth: the embedding read and compute-bound parts).
    plan, seconds = runs[cpu_run]
    split_us0 = hw0.host_split_layer_us
    fixed = None
    if evaluate(solved(1e5, split_us0), plan).time >= seconds:
        # The run beat the CPU's operator and token costs alone (they date from a runtime with Python per operator;
        # the fused decode step calls C++ once per layer): hold the bandwidth at the machine's and fit the fixed
        # costs as one scale of both instead, or, where even no fixed cost is too slow at that bandwidth, fit the
        # bandwidth with none.
        bw0 = hw0.cpu.mem_bw_gbs * hw0.cpu.bw_efficiency

        def scaled(f: float) -> float:
            return evaluate(solved(bw0, split_us0, f), plan).time

        f = bisect(scaled, 0.0, 1.0, seconds, geometric=False) if scaled(0.0) < seconds else 0.0
        fixed = (hw0.cpu.op_us * f, hw0.cpu.token_us * f)
        hw0 = replace(hw0, cpu=replace(hw0.cpu, op_us=fixed[0], token_us=fixed[1]))
        if evaluate(solved(1e5, split_us0), plan).time >= seconds:
            raise ValueError(f"run '{cpu_run}' took {seconds * 1e3:.3f} ms per token, less than its bytes at any "
                             f"bandwidth: nothing to fit")
    bw = bisect(lambda b: evaluate(solved(b, split_us0), plan).time, 1e-3, 1e5, seconds, geometric=True)

    # The host's time per split layer at which the split run's time is the measured one: the time grows with it
    # (in series, or past the point where the CPU's half with the host outlasts the GPU's half).
    plan, seconds = runs[split_run]
    if not evaluate(solved(bw, 0.0), plan).split.any():
        raise ValueError(f"run '{split_run}' has no split layer: it cannot tell what a split layer costs")
    t0, t1 = evaluate(solved(bw, 0.0), plan).time, evaluate(solved(bw, 1e5), plan).time
    if t1 <= t0:
        raise ValueError(f"run '{split_run}': no split layer waits on the host, so its time cannot tell the host's")
    if seconds <= t0:
        split_us = 0.0
    else:
        split_us = bisect(lambda u: evaluate(solved(bw, u), plan).time, 0.0, 1e5, seconds, geometric=False)
    fitted = solved(bw, split_us)
    before = replace(problem, hw=problem.hw, costs=costs(problem.model, problem.hw))
    predicted = {k: evaluate(fitted, p).tokens_per_s for k, (p, _) in runs.items()}
    measured = {k: 1.0 / s for k, (_, s) in runs.items()}
    prior = {k: evaluate(before, p).tokens_per_s for k, (p, _) in runs.items()}
    return HybridFit(bw, split_us, predicted, measured, [cpu_run, split_run], prior, device, fixed)
