"""The GGUF encoder: metadata values and headers as bytes, and tensor data written into a file descriptor. Shared by
the whole-file writer (formats/writer.py), the in-place updater (formats/update.py) and the section
(formats/section.py); it knows nothing of files as a whole.
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGUFValueType
from gguf.constants import GGMLQuantizationType

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.atomic import checkpoint
from pinfer_llm.formats.errors import PinferError
from pinfer_llm.formats.header import tensor_nbytes

_STRING, _ARRAY = 8, 9

_NP_TO_VTYPE = {
    np.dtype(np.uint8): GGUFValueType.UINT8, np.dtype(np.int8): GGUFValueType.INT8,
    np.dtype(np.uint16): GGUFValueType.UINT16, np.dtype(np.int16): GGUFValueType.INT16,
    np.dtype(np.uint32): GGUFValueType.UINT32, np.dtype(np.int32): GGUFValueType.INT32,
    np.dtype(np.float32): GGUFValueType.FLOAT32, np.dtype(np.bool_): GGUFValueType.BOOL,
    np.dtype(np.uint64): GGUFValueType.UINT64, np.dtype(np.int64): GGUFValueType.INT64,
    np.dtype(np.float64): GGUFValueType.FLOAT64,
}


_VTYPE_TO_NP = {int(v): k.newbyteorder("<") for k, v in _NP_TO_VTYPE.items()}


_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


_DTYPE_TO_GGML = {np.dtype(np.float32): GGMLQuantizationType.F32, np.dtype(np.float16): GGMLQuantizationType.F16,
                  np.dtype(np.float64): GGMLQuantizationType.F64, np.dtype(np.int8): GGMLQuantizationType.I8,
                  np.dtype(np.int16): GGMLQuantizationType.I16, np.dtype(np.int32): GGMLQuantizationType.I32,
                  np.dtype(np.int64): GGMLQuantizationType.I64}


CHUNK = 64 << 20


@dataclass
class RawTensor:
    """Tensor bytes already in a ggml type: `data` is uint8 [..., row_bytes] (as GGUFFile.raw gives for quantised
    types) or a plain typed array; `shape` is the numpy-order element shape."""

    data: np.ndarray
    ggml_type: int
    shape: tuple[int, ...]


def as_tensor(name: str, t: np.ndarray | RawTensor) -> tuple[np.ndarray, int, tuple[int, ...]]:
    """(contiguous data, ggml type in gguf's numbering, ggml ne) of a tensor to write; ValueError if inconsistent."""
    if isinstance(t, RawTensor):
        data = np.ascontiguousarray(t.data)
        ne = tuple(int(d) for d in reversed(t.shape))
        expected = tensor_nbytes(ne, t.ggml_type)
        if expected is None or data.nbytes != expected:
            raise ValueError(f"{name}: {data.nbytes} bytes given, type {t.ggml_type} {list(t.shape)} needs {expected}")
        return data, int(t.ggml_type), ne
    data = np.ascontiguousarray(t)
    if data.dtype not in _DTYPE_TO_GGML:
        raise ValueError(f"{name}: cannot store a {data.dtype} array as a tensor (use a RawTensor)")
    return data, int(_DTYPE_TO_GGML[data.dtype]), tuple(int(d) for d in reversed(data.shape))


def infer_vtype(value: Any) -> tuple[int, int | None]:
    if isinstance(value, (bool, np.bool_)):
        return int(GGUFValueType.BOOL), None
    if isinstance(value, str):
        return int(GGUFValueType.STRING), None
    if isinstance(value, np.generic):
        return int(_NP_TO_VTYPE[value.dtype]), None
    if isinstance(value, int):
        return int(GGUFValueType.UINT32 if 0 <= value < 2**32 else GGUFValueType.INT64), None
    if isinstance(value, float):
        return int(GGUFValueType.FLOAT32), None
    if isinstance(value, np.ndarray):
        return _ARRAY, int(_NP_TO_VTYPE[value.dtype])
    if isinstance(value, (list, tuple)):
        if not value:
            return _ARRAY, int(GGUFValueType.INT32)
        return _ARRAY, infer_vtype(value[0])[0]
    raise TypeError(f"cannot store {type(value).__name__} in GGUF metadata")


def _str(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(b)) + b


def encode_value(vt: int, sub: int | None, value: Any) -> bytes:
    """The bytes of one metadata value of GGUF type vt (array element type sub), without the type itself."""
    if vt in _SCALAR_FMT:
        if isinstance(value, np.ndarray) and value.size == 1:
            value = value.reshape(-1)[0]
        v = bool(value) if vt == 7 else (float(value) if vt in (6, 12) else int(value))
        try:
            return struct.pack(_SCALAR_FMT[vt], v)
        except struct.error:
            raise ValueError(f"{value!r} does not fit GGUF value type {vt}") from None
    if vt == _STRING:
        return _str(value)
    if vt == _ARRAY:
        if sub is None:
            sub = infer_vtype(value)[1]
        n = len(value)
        head = struct.pack("<IQ", sub, n)
        if sub in _SCALAR_FMT:
            if sub in (6, 12):
                arr = np.asarray(value, dtype=_VTYPE_TO_NP[sub])
            elif sub == 7:
                arr = np.asarray(value, dtype=np.bool_)
            else:
                src = np.asarray(value)
                arr = src.astype(_VTYPE_TO_NP[sub])
                if src.size and not np.array_equal(arr.astype(np.float64), src.astype(np.float64)):
                    raise ValueError(f"array values do not fit GGUF value type {sub}")
            return head + arr.tobytes()
        if sub == _STRING:
            return head + b"".join(_str(s) for s in value)
        if sub == _ARRAY:
            return head + b"".join(encode_value(_ARRAY, None, v) for v in value)
        raise ValueError(f"unknown GGUF array element type {sub}")
    raise ValueError(f"unknown GGUF value type {vt}")


def encode_header(magic: bytes, metadata: dict[str, Any], value_types: dict[str, tuple[int, int | None]],
                  infos: list[tuple[str, tuple[int, ...], int, int]], alignment: int) -> bytes:
    """A GGUF v3 header (unpadded): metadata in dict order, then tensor infos (name, ne, type id as stored, offset
    relative to the data). general.alignment is written when alignment is not the default."""
    kv = []
    meta = dict(metadata)
    if alignment != C.DEFAULT_ALIGNMENT:
        meta[C.ALIGNMENT] = np.uint32(alignment)
    for key, value in meta.items():
        vt, sub = value_types.get(key) or infer_vtype(value)
        if key == C.ALIGNMENT:
            vt, sub = int(GGUFValueType.UINT32), None
        kv.append(_str(key) + struct.pack("<I", vt) + encode_value(vt, sub, value))
    ti = []
    for name, ne, ggml_type, offset in infos:
        ti.append(_str(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
                  + struct.pack("<IQ", ggml_type, offset))
    return (magic + struct.pack("<IQQ", 3, len(infos), len(meta)) + b"".join(kv) + b"".join(ti))


def pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def write_array(fd: int, data: np.ndarray, offset: int, advance=None) -> None:
    """pwrite an array's bytes in chunks (a memory-mapped source is read as it goes, never held whole)."""
    flat = data.reshape(-1).view(np.uint8) if data.size else np.zeros(0, np.uint8)
    for i in range(0, flat.nbytes, CHUNK):
        part = flat[i:i + CHUNK]
        pwrite_all(fd, part, offset + i)
        if advance:
            advance(part.nbytes)
        checkpoint("data")


def data_segments(fd: int, start: int, end: int) -> list[tuple[int, int]]:
    """The parts of [start, end) that hold data (SEEK_DATA / SEEK_HOLE): holes read as zeros and need no copy. The
    whole range where the filesystem cannot tell."""
    out, pos = [], start
    while pos < end:
        try:
            lo = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # nothing but a hole from here to the end of the file
                break
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):
                return [(start, end)]
            raise
        if lo >= end:
            break
        hi = min(os.lseek(fd, lo, os.SEEK_HOLE), end)
        out.append((lo, hi))
        pos = hi
    return out


def copy_range(src_fd: int, dst_fd: int, src_off: int, dst_off: int, n: int) -> None:
    """Copy bytes from one file into a new one, keeping holes: only the source's data segments are copied, each in
    the kernel (copy_file_range, which reflinks where the filesystem can; a read/write loop where unsupported), and
    the destination ends at least at dst_off + n, so its holes read as zeros. A 45 GB skeleton of 52 KB on disk was
    copied as 42 GB of zeros in 64 s."""
    for lo, hi in data_segments(src_fd, src_off, src_off + n):
        _copy(src_fd, dst_fd, lo, dst_off + lo - src_off, hi - lo)
    if os.fstat(dst_fd).st_size < dst_off + n:
        os.ftruncate(dst_fd, dst_off + n)


def _copy(src_fd: int, dst_fd: int, src_off: int, dst_off: int, n: int) -> None:
    done = 0
    while done < n:
        step = min(n - done, 1 << 30)
        try:
            k = os.copy_file_range(src_fd, dst_fd, step, src_off + done, dst_off + done)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            k = 0
        if k <= 0:
            buf = os.pread(src_fd, min(step, CHUNK), src_off + done)
            if not buf:
                raise OSError(errno.EIO, "source ended early")
            pwrite_all(dst_fd, buf, dst_off + done)
            k = len(buf)
        done += k
        checkpoint("data")


@contextlib.contextmanager
def progress_bar(enabled: bool, total: int, label: str):
    if not enabled:
        yield lambda n: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)






_TO_POWERINFER = {v: k for k, v in C.POWERINFER_TYPE_IDS.items()}


def powerinfer_type(name: str, ggml_type: int) -> int:
    """The id PowerInfer's ggml gives a type; PinferError if it has none."""
    if ggml_type not in _TO_POWERINFER:
        try:
            tname = GGMLQuantizationType(ggml_type).name
        except ValueError:
            tname = f"type {ggml_type}"
        raise PinferError(f"tensor '{name}' is {tname}, which PowerInfer's ggml does not have; a PowerInfer file "
                          f"can hold F32, F16, Q4_0-Q8_1, K-quants and I8/I16/I32")
    return _TO_POWERINFER[ggml_type]


def check_powerinfer_metadata(metadata: dict[str, Any], value_types: dict[str, tuple[int, int | None]]) -> None:
    """PowerInfer's gguf reader aborts on arrays of arrays (GGML_ASSERT "invalid type"): keep them out of PWRI
    headers."""
    for key, value in metadata.items():
        vt, sub = value_types.get(key) or infer_vtype(value)
        if vt == _ARRAY and sub == _ARRAY:
            raise PinferError(f"metadata key '{key}' is an array of arrays, which PowerInfer's loader cannot read")
