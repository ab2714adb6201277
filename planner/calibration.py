"""Calibrating the cost model's CPU side against measured pi-run decode times on this machine.

The model predicts a CPU-only token as

    seconds = cpu_bytes / bandwidth + cpu_ops * op_cost + token_cost

where cpu_bytes and cpu_ops come from the cost model for the model and plan that ran (costmodel.cpu_work). Given
measured seconds per token for a few runs (different models, sparsities, contexts), `fit` finds the three constants
by non-negative least squares. machine.py stores a calibration in the cache under the CPU's key and
machine.resolve_hardware applies it whenever it plans for this machine's own, undetailed CPU.
benchmarks/plan_calibration.py measures and fits.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

import numpy as np

from .costmodel import cpu_work


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
