"""PowerInfer's profiling directories: activation/activation_N.pt counts and model_N.pt predictors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.config import ModelConfig
from pinfer_llm.formats.errors import PinferError
from pinfer_llm.runtime.ffn.predictor import Predictor

_ACT_RE = re.compile(r"activation_(\d+)\.pt")
_PRED_RE = re.compile(r"model_(\d+)\.pt")


def _numbered(directory: Path, pattern: re.Pattern, n_layer: int, what: str) -> list[Path]:
    """Files N = 0..n_layer-1 of a PowerInfer directory, by the number in the name (not by text order: PowerInfer
    bug #247 put activation_10 before activation_2)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise PinferError(f"{directory}: no such directory")
    found: dict[int, Path] = {}
    for p in directory.iterdir():
        m = pattern.fullmatch(p.name)
        if m:
            found[int(m.group(1))] = p
    if sorted(found) != list(range(n_layer)):
        have = f"{len(found)} files" + (f" numbered {min(found)}..{max(found)}" if found else "")
        raise PinferError(f"{directory}: expected {what} files 0..{n_layer - 1} for a model with {n_layer} layers, "
                          f"found {have}; is this the directory for this model?")
    return [found[i] for i in range(n_layer)]


def _load_pt(path: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the user's input problem
        raise PinferError(f"{path}: not a readable torch file ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
                          ) from None


def import_activations(directory: Path, cfg: ModelConfig) -> np.ndarray:
    """[n_layer, n_ff] counts from PowerInfer's activation/activation_N.pt files (1-D tensors [n_ff])."""
    rows = []
    for i, p in enumerate(_numbered(directory, _ACT_RE, cfg.n_layer, "activation_N.pt")):
        t = _load_pt(p)
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != cfg.n_ff:
            shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise PinferError(f"{p}: layer {i} has {shape} counts, the model has {cfg.n_ff} neurons per layer; "
                              f"is this the directory for this model?")
        rows.append(t.double().numpy())
    counts = np.stack(rows)
    if not np.isfinite(counts).all() or (counts < 0).any():
        raise PinferError(f"{directory}: activation counts must be finite and non-negative")
    return counts


def export_activations(counts: np.ndarray, directory: Path) -> None:
    """Write activation_N.pt (int64 counts [n_ff]) for every layer, as PowerInfer's solver reads them.

    All files are written to a new sibling directory first and then renamed into place, so the directory either
    holds the complete new set or is untouched. An existing directory may hold only activation_N.pt files."""
    import shutil
    import tempfile

    directory = Path(directory)
    if directory.exists():
        if not directory.is_dir():
            raise PinferError(f"{directory}: exists and is not a directory")
        other = [p.name for p in directory.iterdir() if not _ACT_RE.fullmatch(p.name)]
        if other:
            raise PinferError(f"{directory}: holds other files ({other[0]}, ...); export into a new or empty "
                              f"directory")
    if not directory.parent.exists():
        raise PinferError(f"{directory.parent}: no such directory")
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        for i, c in enumerate(counts):
            torch.save(torch.from_numpy(np.rint(c).astype(np.int64)), tmp / C.ACTIVATION_FILE.format(bid=i))
        old = None
        if directory.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old.", dir=directory.parent))
            old.rmdir()
            directory.rename(old)
        tmp.rename(directory)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def import_predictors(directory: Path, cfg: ModelConfig) -> tuple[list[Predictor], float]:
    """PowerInfer predictor directory: model_N.pt state dicts with fc1.weight [r, d] and fc2.weight [n_ff, r], and
    an optional config.json {"sparse_threshold": t}."""
    directory = Path(directory)
    files = _numbered(directory, _PRED_RE, cfg.n_layer, "model_N.pt")
    threshold = 0.0
    cfg_file = directory / "config.json"
    if cfg_file.exists():
        try:
            threshold = float(json.loads(cfg_file.read_text()).get("sparse_threshold", 0.0))
        except (ValueError, TypeError, AttributeError):
            raise PinferError(f"{cfg_file}: not a JSON object with a numeric sparse_threshold") from None
    preds = []
    for i, p in enumerate(files):
        sd = _load_pt(p)
        if not isinstance(sd, dict) or "fc1.weight" not in sd or "fc2.weight" not in sd:
            raise PinferError(f"{p}: expected a state dict with fc1.weight and fc2.weight")
        fc1, fc2 = sd["fc1.weight"], sd["fc2.weight"]
        if fc1.dim() != 2 or fc2.dim() != 2 or fc1.shape[1] != cfg.n_embd or fc2.shape[0] != cfg.n_ff \
                or fc1.shape[0] != fc2.shape[1]:
            raise PinferError(f"{p}: layer {i} predictor has fc1 {list(fc1.shape)} and fc2 {list(fc2.shape)}; "
                              f"this model needs fc1 [r, {cfg.n_embd}] and fc2 [{cfg.n_ff}, r]")
        preds.append(Predictor(fc1.to(torch.float16), fc2.to(torch.float16), threshold))
    return preds, threshold
