"""What pinfer's own metadata keys (and PowerInfer's sparse_threshold) must hold, checked once where a file is read.

A section with a valid checksum can still hold a value no writer of pinfer's makes (a hand-edited or fuzzed file):
a threshold that is a string or NaN, a token count that is negative, a plan for no GPU. Read unchecked, such a value
surfaced far away as an internal error (`float('abc')` in the predictor loader) or, for NaN and inf, silently changed
every token. A section holding one is ignored as a whole (formats/section.py: the model loads without it, with one
line saying why); the same value in a model's header is an error, since the header is the model's own.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.errors import quote

_INT_TYPES = (int, np.integer)


def _count(v: Any) -> str | None:
    if isinstance(v, bool) or not isinstance(v, _INT_TYPES) or v < 0:
        return "a non-negative integer"
    return None


def _finite(v: Any) -> str | None:
    if isinstance(v, bool) or not isinstance(v, (*_INT_TYPES, float, np.floating)) or not math.isfinite(v):
        return "a finite number"
    return None


def _fraction(v: Any) -> str | None:
    return _finite(v) or (None if 0 <= v <= 1 else "a number in [0, 1]")


def _text(v: Any) -> str | None:
    return None if isinstance(v, str) else "a string"


def _array(kind: str, finite: bool):
    def check(v: Any) -> str | None:
        want = f"an array of {'finite numbers' if finite and kind == 'f' else 'numbers' if kind == 'f' else 'counts'}"
        if not isinstance(v, np.ndarray) or v.ndim != 1 or v.dtype.kind not in ("f", "i", "u") or (
                kind != "f" and v.dtype.kind == "f"):
            return want
        if kind != "f" and v.size and v.min() < 0:
            return want
        if finite and not np.isfinite(v).all():
            return want
        return None
    return check


def _names(v: Any) -> str | None:
    if not isinstance(v, list) or not v or not all(isinstance(s, str) and s for s in v):
        return "a non-empty list of names"
    return None


KEYS = {
    C.FFN_ACTIVATION: _text,
    C.ACT_TOKENS: _count, C.ACT_CORPUS: _text, C.ACT_DATE: _text, C.ACT_RULE: _text,
    C.CATS_THRESHOLD: _array("f", finite=True), C.CATS_SPARSITY: _fraction,
    C.SPARSE_THRESHOLD: _finite, C.PRED_THRESHOLDS: _array("f", finite=True),
    C.PRED_RECALL: _array("f", finite=False), C.PRED_PRECISION: _array("f", finite=False),  # nan: not measured
    C.PRED_RECALL_TARGET: _fraction, C.PRED_SOURCE: _text,
    C.PLAN_VERSION: _count, C.PLAN_GPUS: _names, C.PLAN_VRAM_BUDGET: _count, C.PLAN_VRAM_USED: _array("u", False),
    C.PLAN_CTX: _count, C.PLAN_OBJECTIVE: _text, C.PLAN_TOKENS_PER_S: _finite, C.PLAN_STATUS: _text,
    C.PLAN_SOLVER: _text, C.PLAN_SOLVE_SECONDS: _finite, C.PLAN_GROUP: _count, C.PLAN_FINGERPRINT: _text,
    C.PLAN_ATTN_GPU: _array("u", False), C.PLAN_PRED_GPU: _array("u", False), C.PLAN_FFN_GPU: _array("u", False),
    C.PLAN_GPU_NEURONS: _array("u", False), C.PLAN_SPLIT: _array("u", False), C.PLAN_OUTPUT_GPU: _count,
    C.PLAN_HARDWARE: _text, C.PLAN_BASELINES: _text, C.PLAN_GAP: _finite, C.PLAN_GPUIDX: _text,
}


def describe(v: Any) -> str:
    """A value as a message shows it: its kind, and the value itself when short."""
    if isinstance(v, np.ndarray):
        return f"an array of {v.size} {v.dtype}"
    if isinstance(v, list):
        return f"a list of {len(v)}"
    return f"{type(v).__name__} {quote(v, 40)}"


def problems(metadata: dict[str, Any]) -> list[str]:
    """'key is X, expected Y' for every known key whose value no pinfer writer makes."""
    out = []
    for key, check in KEYS.items():
        if key in metadata:
            want = check(metadata[key])
            if want is not None:
                out.append(f"metadata '{key}' is {describe(metadata[key])}, expected {want}")
    return out
