"""Writing GGUF and PowerInfer (PWRI) files, always atomically.

The bytes are produced by gguf.GGUFWriter, so anything we write is a standard GGUF v3 file. A PowerInfer file is the
same file with its first four bytes set to b"PWRI" (that is all PowerInfer changes). Every write goes to a temporary
file in the destination directory, is fsynced, and is renamed over the destination: an interrupted run leaves the
original byte-identical.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType, GGUFWriter
from gguf.constants import GGMLQuantizationType

from . import constants as C
from .errors import PinferError
from .reader import GGUFFile, tensor_nbytes

_NP_TO_VTYPE = {
    np.dtype(np.uint8): GGUFValueType.UINT8, np.dtype(np.int8): GGUFValueType.INT8,
    np.dtype(np.uint16): GGUFValueType.UINT16, np.dtype(np.int16): GGUFValueType.INT16,
    np.dtype(np.uint32): GGUFValueType.UINT32, np.dtype(np.int32): GGUFValueType.INT32,
    np.dtype(np.float32): GGUFValueType.FLOAT32, np.dtype(np.bool_): GGUFValueType.BOOL,
    np.dtype(np.uint64): GGUFValueType.UINT64, np.dtype(np.int64): GGUFValueType.INT64,
    np.dtype(np.float64): GGUFValueType.FLOAT64,
}


@dataclass
class RawTensor:
    """Tensor bytes already in a ggml type: `data` is uint8 [..., row_bytes] (as GGUFFile.raw gives for quantised
    types) or a plain typed array; `shape` is the numpy-order element shape."""

    data: np.ndarray
    ggml_type: int
    shape: tuple[int, ...]


def raw_tensor(f: GGUFFile, name: str) -> RawTensor:
    """A zero-copy RawTensor for an existing tensor (used to carry tensors through a rewrite)."""
    t = f.info(name)
    return RawTensor(f.mm[t.offset:t.offset + t.nbytes], t.ggml_type, t.shape)


def _infer_vtype(value: Any) -> tuple[GGUFValueType, GGUFValueType | None]:
    if isinstance(value, (bool, np.bool_)):
        return GGUFValueType.BOOL, None
    if isinstance(value, str):
        return GGUFValueType.STRING, None
    if isinstance(value, np.generic):
        return _NP_TO_VTYPE[value.dtype], None
    if isinstance(value, int):
        return (GGUFValueType.UINT32 if 0 <= value < 2**32 else GGUFValueType.INT64), None
    if isinstance(value, float):
        return GGUFValueType.FLOAT32, None
    if isinstance(value, np.ndarray):
        return GGUFValueType.ARRAY, _NP_TO_VTYPE[value.dtype]
    if isinstance(value, (list, tuple)):
        if not value:
            return GGUFValueType.ARRAY, GGUFValueType.INT32
        return GGUFValueType.ARRAY, _infer_vtype(value[0])[0]
    raise TypeError(f"cannot store {type(value).__name__} in GGUF metadata")


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `dest`; on success fsync it and rename it over `dest`, else delete it."""
    dest = Path(dest)
    if dest.is_dir():
        raise PinferError(f"{dest}: is a directory; give a file name to write")
    if not dest.parent.exists():
        raise PinferError(f"{dest.parent}: no such directory")
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        if dest.exists():  # keep the original's permissions
            os.chmod(tmp, dest.stat().st_mode & 0o7777)
        else:  # mkstemp creates 0600; a new file gets the usual 0666 less the umask
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, dest)
        with contextlib.suppress(OSError):  # make the rename itself durable
            dfd = os.open(dest.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_gguf(path: str | os.PathLike, metadata: dict[str, Any], tensors: dict[str, np.ndarray | RawTensor], *,
               value_types: dict[str, tuple[int, int | None]] | None = None, powerinfer: bool = False,
               alignment: int = C.DEFAULT_ALIGNMENT, progress: bool = False) -> Path:
    """Write a GGUF (or PWRI) file atomically.

    metadata must hold general.architecture. Value types are inferred from Python/numpy types unless given in
    value_types (a rewrite passes the source file's types so that nothing changes type). Plain arrays are written as
    their dtype (float32 -> F32, float16 -> F16, int32 -> I32); RawTensor carries any ggml type through unchanged.
    """
    path = Path(path)
    arch = metadata.get(C.ARCHITECTURE)
    if not arch:
        raise ValueError("metadata needs general.architecture")
    value_types = value_types or {}
    with atomic_path(path) as tmp:
        w = GGUFWriter(tmp, arch)
        if alignment != C.DEFAULT_ALIGNMENT:
            w.add_custom_alignment(alignment)
        for key, value in metadata.items():
            if key in (C.ARCHITECTURE, C.ALIGNMENT):
                continue
            if key in value_types:
                vt, sub = value_types[key]
                vt, sub = GGUFValueType(vt), (GGUFValueType(sub) if sub is not None else None)
            else:
                vt, sub = _infer_vtype(value)
            if vt == GGUFValueType.ARRAY and isinstance(value, np.ndarray):
                value = value.tolist()
            w.add_key_value(key, value, vt, sub)
        sizes = {}
        for name, t in tensors.items():
            if isinstance(t, RawTensor):
                qtype = GGMLQuantizationType(t.ggml_type)
                data = np.ascontiguousarray(t.data)
                expected = tensor_nbytes(tuple(reversed(t.shape)), t.ggml_type)
                if data.nbytes != expected:
                    raise ValueError(f"{name}: {data.nbytes} bytes given, {qtype.name}{list(t.shape)} needs {expected}")
                # A non-uint8 dtype tells the writer the shape is already in elements, not bytes.
                w.add_tensor_info(name, t.shape, np.dtype(np.float32), data.nbytes, raw_dtype=qtype)
                tensors_data = data.view(np.uint8).reshape(-1)
            else:
                data = np.ascontiguousarray(t)
                w.add_tensor_info(name, data.shape, data.dtype, data.nbytes)
                tensors_data = data
            sizes[name] = tensors_data
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        total = sum(a.nbytes for a in sizes.values())
        with _progress(progress and total > 256 << 20, total, f"writing {path.name}") as advance:
            for data in sizes.values():
                w.write_tensor_data(data)
                advance(data.nbytes)
        w.close()
        if powerinfer:
            with open(tmp, "r+b") as fh:
                fh.write(C.PWRI_MAGIC)
    return path


@contextlib.contextmanager
def _progress(enabled: bool, total: int, label: str):
    if not enabled:
        yield lambda n: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def rewrite_gguf(src: GGUFFile, dest: str | os.PathLike | None = None, *, set_metadata: dict[str, Any] | None = None,
                 set_tensors: dict[str, np.ndarray | RawTensor] | None = None, drop_keys=(), drop_tensors=(),
                 powerinfer: bool | None = None, progress: bool = True) -> Path:
    """Copy `src` to `dest` (default: over itself, atomically) with metadata and tensors added, replaced or dropped.

    Existing tensors are streamed from the source's memory map, so a multi-GB file is never held in memory.
    Existing tensors keep their order; new ones are appended.
    """
    dest = Path(dest) if dest is not None else src.path
    drop_keys, drop_tensors = set(drop_keys), set(drop_tensors)
    set_metadata, set_tensors = set_metadata or {}, set_tensors or {}
    metadata = {k: v for k, v in src.metadata.items() if k not in drop_keys}
    types = {k: v for k, v in src.value_types.items() if k not in drop_keys and k not in set_metadata}
    metadata.update(set_metadata)
    tensors: dict[str, np.ndarray | RawTensor] = {}
    for name in src.tensors:
        if name in drop_tensors:
            continue
        tensors[name] = set_tensors[name] if name in set_tensors else raw_tensor(src, name)
    for name, t in set_tensors.items():
        tensors.setdefault(name, t)
    return write_gguf(dest, metadata, tensors, value_types=types,
                      powerinfer=src.is_powerinfer if powerinfer is None else powerinfer,
                      alignment=src.alignment, progress=progress)
