"""Calibrating the cost model's CPU side against measured pi-run decode times on this machine.

The model predicts a CPU-only token as

    seconds = cpu_bytes / bandwidth + cpu_ops * op_cost + token_cost

where cpu_bytes and cpu_ops come from the cost model for the model and plan that ran (costmodel.cpu_work). Given
measured seconds per token for a few runs (different models, sparsities, contexts), `fit` finds the three constants
by non-negative least squares. machine.py stores a calibration in the cache under the CPU's key and
machine.resolve_hardware applies it whenever it plans for this machine's own, undetailed CPU.
benchmarks/plan_calibration.py measures and fits.

On a machine with a GPU, `calibrate_hybrid` fits the two constants the hybrid executor's measurements pin down (the
CPU's effective bandwidth on pi-run's threads, and what a split layer costs beyond its parts) from a CPU-only run and
a run with split layers, and predicts the other runs out of sample; benchmarks/gpu_e2e.py (make gpu-check) runs it.
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
class HybridFit:
    """The cost model's two unknowns on a GPU machine, each fitted from the one run it dominates:
    cpu_bw_gbs, the CPU's effective bandwidth on pi-run's threads (from a run with nothing on the GPU), and sync_us,
    what a split layer costs beyond its parts (copies, waits, the host's launches; from a run with split layers).
    predicted / measured: tokens/s per run with both constants; fitted_on: the runs the constants came from (the
    others are predictions out of sample)."""

    cpu_bw_gbs: float
    sync_us: float
    predicted: dict[str, float]
    measured: dict[str, float]
    fitted_on: list[str]

    def errors(self) -> dict[str, float]:
        """Relative error of each prediction: predicted / measured - 1."""
        return {k: self.predicted[k] / self.measured[k] - 1 for k in self.measured}


def calibrate_hybrid(problem, runs: dict, cpu_run: str = "cpu", split_run: str = "plan") -> HybridFit:
    """Fit HybridFit's constants to measured runs. runs: label -> (planner.plan.Plan, measured seconds per token);
    `cpu_run` must keep everything on the CPU, `split_run` must have a split layer. The CPU's operator and token
    costs keep their values (one run cannot separate them from its bandwidth). Raises ValueError when the runs cannot
    pin a constant down."""
    from dataclasses import replace

    from pinfer_llm.planner.costmodel import costs, evaluate

    def solved(bw_gbs: float, sync_us: float):
        h = replace(problem.hw, cpu=replace(problem.hw.cpu, mem_bw_gbs=bw_gbs, bw_efficiency=1.0), sync_us=sync_us)
        return replace(problem, hw=h, costs=costs(problem.model, h))

    # The bandwidth at which the cost model's time of the CPU-only run is the measured one (it falls as the
    # bandwidth grows; bisection, since the embedding read and compute-bound parts make it not quite 1/bandwidth).
    plan, seconds = runs[cpu_run]
    lo, hi = 1e-3, 1e5  # GB/s
    if evaluate(solved(hi, 0.0), plan).time >= seconds:
        raise ValueError(f"run '{cpu_run}' took {seconds * 1e3:.2f} ms per token, no more than the CPU's operator "
                         f"and token costs alone: nothing left to fit a bandwidth to")
    for _ in range(100):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if evaluate(solved(mid, 0.0), plan).time > seconds else (lo, mid)
    bw = (lo * hi) ** 0.5

    plan, seconds = runs[split_run]
    ev = evaluate(solved(bw, 0.0), plan)  # the time is linear in sync_us: n_split of them
    n_split = int(ev.split.sum())
    if n_split == 0:
        raise ValueError(f"run '{split_run}' has no split layer: it cannot tell what a split layer costs")
    sync_us = max(0.0, (seconds - ev.time) / n_split * 1e6)
    fitted = solved(bw, sync_us)
    predicted = {k: evaluate(fitted, p).tokens_per_s for k, (p, _) in runs.items()}
    measured = {k: 1.0 / s for k, (_, s) in runs.items()}
    return HybridFit(bw, sync_us, predicted, measured, [cpu_run, split_run])
