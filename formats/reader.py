"""Memory-mapped reader for GGUF v2/v3 files and PowerInfer's PWRI variant.

Why not gguf.GGUFReader: it rejects the PWRI magic and builds a numpy view per metadata string, which takes several
seconds for a 49k-token vocabulary. This parser walks the header once with struct (tens of milliseconds) and hands
out zero-copy numpy views of tensor data. Type sizes and quantisation come from the `gguf` package.

Layout (all little-endian): magic u32 | version u32 | n_tensors u64 | n_kv u64 | n_kv × (key str, type u32, value) |
n_tensors × (name str, n_dims u32, ne u64[n_dims], type u32, offset u64) | padding to alignment | tensor data.
A str is a u64 length and UTF-8 bytes. ggml's ne lists the fastest-varying dimension first; numpy shapes are the
reverse, and that reversal happens only in TensorInfo.shape.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from . import constants as C
from .errors import PinferError

# GGUFValueType codes -> (struct format, size)
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NP_SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
               7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9

# Tensor types whose data is a plain numpy array rather than quantised blocks.
PLAIN_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


def type_name(ggml_type: int) -> str:
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type#{ggml_type}"


@dataclass
class TensorInfo:
    name: str
    ne: tuple[int, ...]  # ggml order: fastest-varying first
    ggml_type: int
    offset: int  # absolute offset of the data in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order (slowest-varying first)."""
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.ne, dtype=np.int64)) if self.ne else 1

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)


def tensor_nbytes(ne: tuple[int, ...], ggml_type: int) -> int | None:
    """Bytes of a tensor of this ggml shape and type, or None for a type the gguf package does not know."""
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return None
    n = int(np.prod(ne, dtype=np.int64)) if ne else 1
    return n // block * size


@dataclass
class GGUFFile:
    """An open GGUF/PWRI file: metadata as Python values, tensors as zero-copy views of a memory map."""

    path: Path
    magic: bytes
    version: int
    metadata: dict[str, Any]
    value_types: dict[str, tuple[int, int | None]]  # key -> (GGUFValueType, array element type); kept on rewrite
    tensors: dict[str, TensorInfo]
    alignment: int
    data_offset: int
    file_size: int
    _mm: np.memmap | None = field(default=None, repr=False)

    @property
    def is_powerinfer(self) -> bool:
        return self.magic == C.PWRI_MAGIC

    @property
    def architecture(self) -> str:
        return str(self.metadata.get(C.ARCHITECTURE, ""))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_get(self, template: str, default: Any = None) -> Any:
        return self.metadata.get(template.format(arch=self.architecture), default)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise PinferError(f"{self.path}: missing tensor '{name}'; the file is incomplete or not a model of "
                              f"this architecture") from None

    @property
    def mm(self) -> np.memmap:
        if self._mm is None:
            # 'c' (copy-on-write) keeps the map zero-copy and shareable while giving torch a writable buffer.
            self._mm = np.memmap(self.path, mode="c", dtype=np.uint8)
        return self._mm

    def raw(self, name: str) -> np.ndarray:
        """Zero-copy view of a tensor's bytes: typed and shaped for plain types, uint8 [rows, row_bytes] otherwise."""
        t = self.info(name)
        buf = self.mm[t.offset:t.offset + t.nbytes]
        try:
            qtype = GGMLQuantizationType(t.ggml_type)
        except ValueError:
            raise PinferError(f"{self.path}: tensor '{name}' has unknown type {t.ggml_type}; "
                              f"convert the model with a current llama.cpp") from None
        if qtype in PLAIN_DTYPES:
            return buf.view(PLAIN_DTYPES[qtype]).reshape(t.shape)
        if qtype == GGMLQuantizationType.BF16:
            return buf.view(np.uint16).reshape(t.shape)
        row_bytes = tensor_nbytes(t.ne[:1], t.ggml_type)
        return buf.reshape(*t.shape[:-1], row_bytes)

    def close(self) -> None:
        self._mm = None


class _Cursor:
    """Sequential reads over a bytes-like object with a clear error on truncation."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise PinferError(f"{self.path}: truncated GGUF header (needs {self.pos + n} bytes, file has "
                              f"{len(self.buf)}); download or convert the file again")

    def unpack(self, fmt: str, size: int):
        self.need(size)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return v

    def string(self) -> str:
        n = self.unpack("<Q", 8)
        self.need(n)
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(*_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            sub = self.unpack("<I", 4)
            n = self.unpack("<Q", 8)
            if sub in _NP_SCALARS:
                dt = np.dtype(_NP_SCALARS[sub]).newbyteorder("<")
                self.need(n * dt.itemsize)
                arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos).copy()
                self.pos += n * dt.itemsize
                return arr
            if sub == _STRING:
                return self._strings(n)
            if sub == _ARRAY:
                return [self.value(_ARRAY) for _ in range(n)]
            raise PinferError(f"{self.path}: corrupt GGUF metadata (array of unknown type {sub})")
        raise PinferError(f"{self.path}: corrupt GGUF metadata (unknown value type {vtype} at byte {self.pos})")

    def _strings(self, n: int) -> list[str]:
        # The hot loop of header parsing (vocabularies hold 32k-256k strings): keep it to locals.
        buf, pos, out, unpack = self.buf, self.pos, [], struct.unpack_from
        end = len(buf)
        for _ in range(n):
            if pos + 8 > end:
                self.pos = pos
                self.need(8)
            (ln,) = unpack("<Q", buf, pos)
            pos += 8
            if pos + ln > end:
                self.pos = pos
                self.need(ln)
            out.append(str(buf[pos:pos + ln], "utf-8", "replace"))
            pos += ln
        self.pos = pos
        return out


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse a GGUF or PWRI file's header. Tensor data stays on disk until a view of it is touched."""
    path = Path(path)
    if not path.exists():
        raise PinferError(f"{path}: no such file")
    if path.is_dir():
        raise PinferError(f"{path}: is a directory, expected a .gguf file")
    size = path.stat().st_size
    if size < 24:
        raise PinferError(f"{path}: not a GGUF file ({size} bytes is too short for a header)")
    with open(path, "rb") as f:
        import mmap

        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(buf, path, size)
    finally:
        buf.close()


def _parse(buf, path: Path, size: int) -> GGUFFile:
    magic = bytes(buf[:4])
    if magic not in (C.GGUF_MAGIC, C.PWRI_MAGIC):
        raise PinferError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF' or b'PWRI')")
    cur = _Cursor(buf, path)
    cur.pos = 4
    version = cur.unpack("<I", 4)
    if version not in C.SUPPORTED_VERSIONS:
        raise PinferError(f"{path}: GGUF version {version} is not supported (only 2 and 3); "
                          f"reconvert it with a current llama.cpp")
    n_tensors = cur.unpack("<Q", 8)
    n_kv = cur.unpack("<Q", 8)
    if n_tensors > size or n_kv > size:
        raise PinferError(f"{path}: corrupt GGUF header (claims {n_tensors} tensors and {n_kv} keys)")

    metadata: dict[str, Any] = {}
    value_types: dict[str, tuple[int, int | None]] = {}
    for _ in range(n_kv):
        key = cur.string()
        vtype = cur.unpack("<I", 4)
        sub = None
        if vtype == _ARRAY:
            cur.need(4)
            sub = struct.unpack_from("<I", buf, cur.pos)[0]
        metadata[key] = cur.value(vtype)
        value_types[key] = (vtype, sub)

    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("<I", 4)
        if n_dims > 8:
            raise PinferError(f"{path}: corrupt tensor info for '{name}' ({n_dims} dimensions)")
        ne = tuple(cur.unpack("<Q", 8) for _ in range(n_dims))
        ggml_type = cur.unpack("<I", 4)
        offset = cur.unpack("<Q", 8)
        infos.append((name, ne, ggml_type, offset))

    alignment = int(metadata.get(C.ALIGNMENT, C.DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise PinferError(f"{path}: corrupt GGUF header (alignment {alignment} is not a power of two)")
    data_offset = -(-cur.pos // alignment) * alignment

    tensors: dict[str, TensorInfo] = {}
    for name, ne, ggml_type, offset in infos:
        nbytes = tensor_nbytes(ne, ggml_type)
        if nbytes is None:
            nbytes = 0  # unknown type: kept so that the error names the tensor when it is used
        t = TensorInfo(name, ne, ggml_type, data_offset + offset, nbytes)
        if t.offset + nbytes > size:
            raise PinferError(f"{path}: truncated file: tensor '{name}' ends at byte {t.offset + nbytes} but the "
                              f"file has {size}; download or convert it again")
        tensors[name] = t
    return GGUFFile(path, magic, version, metadata, value_types, tensors, alignment, data_offset, size)
