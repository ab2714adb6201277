"""Per-neuron activation frequencies: from the model file (pi-profile's act_counts) or a PowerInfer activation/ dir.

A frequency is the share of profiled tokens on which a neuron was active: counts / tokens. Only these small tensors
are read, never weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.errors import PinferError
from pinfer_llm.formats.header import GGUFFile

_ACT_FILE = re.compile(re.escape(C.ACTIVATION_FILE).replace(r"\{bid\}", r"(\d+)") + "$")


@dataclass
class Activations:
    freq: list[np.ndarray]  # per layer, float64 [n_ff] in the model's neuron order
    tokens: float
    source: str
    note: str = ""


def load_activations(f: GGUFFile, n_ff: list[int], act_dir: str | Path | None = None,
                     act_tokens: int | None = None) -> Activations:
    """Frequencies for every layer, checked against the model's shapes."""
    if act_dir is not None:
        return _from_dir(Path(act_dir), n_ff, act_tokens)
    names = [C.tensor(C.ACT_COUNTS, bid) for bid in range(len(n_ff))]
    present = [n for n in names if f.has(n)]
    if not present:
        raise PinferError(f"{f.path}: no activation statistics; run `pi-profile {f.path.name}` or pass "
                          f"--activations DIR (PowerInfer's activation/ directory)")
    if len(present) != len(names):
        missing = [n for n in names if not f.has(n)]
        raise PinferError(f"{f.path}: activation statistics do not match the model: {len(missing)} of {len(names)} "
                          f"layers have none (first: {missing[0]}); profile the model again")
    tokens = act_tokens or f.get(C.ACT_TOKENS)
    if not tokens or float(tokens) <= 0:
        raise PinferError(f"{f.path}: activation counts without {C.ACT_TOKENS}; profile again with pi-profile or give "
                          f"--act-tokens N")
    counts = []
    for bid, name in enumerate(names):
        t = f.info(name)
        if t.shape != (n_ff[bid],):
            raise PinferError(f"{f.path}: activation statistics do not match the model: {name} has shape "
                              f"{list(t.shape)}, block {bid} has {n_ff[bid]} neurons")
        counts.append(np.asarray(f.raw(name), dtype=np.float64))
    return Activations(_checked(counts, float(tokens), str(f.path)), float(tokens), "gguf")


def _from_dir(d: Path, n_ff: list[int], act_tokens: int | None) -> Activations:
    if not d.is_dir():
        raise PinferError(f"{d}: --activations needs a directory of activation_N.pt files")
    found = {}
    for p in d.iterdir():
        m = _ACT_FILE.match(p.name)
        if m:
            found[int(m.group(1))] = p
    if not found:
        raise PinferError(f"{d}: no activation_N.pt files; run `pi-profile` or point --activations at PowerInfer's "
                          f"activation/ directory")
    # Numeric order (PowerInfer bug #247 sorted these names as text: activation_10 before activation_2).
    if sorted(found) != list(range(len(n_ff))):
        raise PinferError(f"{d}: activation statistics do not match the model: files for layers "
                          f"{_span(sorted(found))}, the model has {len(n_ff)} layers")
    import torch

    counts = []
    for bid in range(len(n_ff)):
        try:
            t = torch.load(found[bid], map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises many types for a bad file
            raise PinferError(f"{found[bid]}: cannot load activation counts ({type(exc).__name__}: {exc})") from None
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != n_ff[bid]:
            shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise PinferError(f"{found[bid]}: activation statistics do not match the model: shape {shape}, block "
                              f"{bid} has {n_ff[bid]} neurons")
        counts.append(t.double().numpy())
    note = ""
    if act_tokens:
        tokens = float(act_tokens)
    else:
        # PowerInfer's files hold counts without the number of tokens profiled: take the busiest neuron as active on
        # every token. Hot mass and the plan's shape are unaffected; absolute times are estimates.
        tokens = max(float(c.max()) for c in counts) or 1.0
        note = "frequencies normalised by the largest count (give --act-tokens for exact times)"
    return Activations(_checked(counts, tokens, str(d)), tokens, str(d), note)


def _checked(counts: list[np.ndarray], tokens: float, where: str) -> list[np.ndarray]:
    out = []
    for bid, c in enumerate(counts):
        if not np.all(np.isfinite(c)) or (c < 0).any():
            raise PinferError(f"{where}: activation counts of block {bid} are negative or not finite; profile again")
        if c.max(initial=0) > tokens * 1.0001:
            raise PinferError(f"{where}: activation counts of block {bid} exceed the {tokens:g} tokens profiled; the "
                              f"statistics do not match (give --act-tokens N)")
        out.append(np.minimum(c / tokens, 1.0))
    return out


def _span(keys: list[int]) -> str:
    return f"{keys[0]}..{keys[-1]} ({len(keys)} files)" if keys else "none"
