"""The GGUF v2/v3 header, and PowerInfer's PWRI variant: parsed into GGUFFile (formats/reader.py opens files).

Why not gguf.GGUFReader: it rejects the PWRI magic, reads PowerInfer's type ids as today's ggml ones (PowerInfer's
I32 = 18 is IQ3_XXS there), and builds a numpy view per metadata string, which takes seconds for a 49k-token
vocabulary. This parser walks the header once with struct (tens of milliseconds) and hands out zero-copy views of
a read-only map: a file larger than RAM opens (a copy-on-write map of it is refused by the kernel).

Layout (all little-endian): magic u32 | version u32 | n_tensors u64 | n_kv u64 | n_kv x (key str, type u32, value) |
n_tensors x (name str, n_dims u32, ne u64[n_dims], type u32, offset u64) | padding to alignment | tensor data.
A str is a u64 length and UTF-8 bytes. ggml's ne lists the fastest-varying dimension first; numpy shapes are the
reverse, and that reversal happens only in TensorInfo.shape. After the tensor data a file may hold pinfer's section
(formats/section.py): GGUFFile merges it over the header (section keys and tensors win; its tombstones hide header
entries) and says where each came from.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.errors import PinferError, quote

# GGUFValueType codes -> (struct format, size)
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NP_SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
               7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_MAX_NESTING = 8  # arrays of arrays: deeper nesting is corruption (and would exhaust the stack)
_MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 64  # GGML_MAX_NAME: ggml refuses a tensor name of this many bytes or more
# The fewest bytes a key/value pair (key length, type, a 1-byte value) and a tensor info (name length, n_dims, type,
# offset) can take: a count beyond what the bytes left can hold is refused before anything loops over it.
_MIN_KV, _MIN_INFO = 8 + 4 + 1, 8 + 4 + 4 + 8

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
    ggml_type: int  # in the gguf package's numbering, whatever the file's own ids (see constants.POWERINFER_TYPE_IDS)
    offset: int  # absolute offset of the data in the file
    nbytes: int
    part: str = "header"  # "header" or "section": where the tensor is stored

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
    """Bytes of a tensor of this ggml shape and type, or None for a type the gguf package does not know or a shape
    that is not whole blocks."""
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return None
    n = 1
    for d in ne:
        n *= int(d)
    if ne and int(ne[0]) % block:
        return None
    return n // block * size


@dataclass
class Header:
    """One parsed GGUF header (a file's, or a section blob's). Offsets are absolute in the file."""

    magic: bytes
    version: int
    metadata: dict[str, Any]
    value_types: dict[str, tuple[int, int | None]]
    infos: list[tuple[str, tuple[int, ...], int, int]]  # (name, ne, type id as stored, offset relative to data)
    alignment: int
    end: int  # end of the tensor infos
    data_offset: int  # start of the tensor data: end rounded up to the alignment


@dataclass
class GGUFFile:
    """An open GGUF/PWRI file: metadata as Python values, tensors as zero-copy views of a read-only memory map.

    metadata, value_types and tensors are the merged view pinfer uses: the header's entries, less those the section
    hides, with the section's on top. header_* hold the header alone; `section` is the section (or None)."""

    path: Path
    magic: bytes
    version: int
    metadata: dict[str, Any]
    value_types: dict[str, tuple[int, int | None]]  # key -> (GGUFValueType, array element type); kept on rewrite
    tensors: dict[str, TensorInfo]
    alignment: int
    data_offset: int
    file_size: int
    header_metadata: dict[str, Any] = field(default_factory=dict)
    header_value_types: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    header_tensors: dict[str, TensorInfo] = field(default_factory=dict)
    data_end: int | None = None  # end of the header tensors' data (None: a tensor of unknown size)
    section: Any = None  # formats.section.Section
    trailing: str = "none"  # what follows the tensor data: "none", "section" (pinfer's directory) or "foreign"
    warnings: list[str] = field(default_factory=list)
    legacy_types: list[str] = field(default_factory=list)  # PWRI tensors stored with today's ggml ids (old pinfer)
    pinned: list[tuple[int, int]] = field(default_factory=list)  # byte ranges of the section this file pins
    _mm: np.ndarray | None = field(default=None, repr=False)
    _fd: int = field(default=-1, repr=False)
    _closer: Any = field(default=None, repr=False)

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

    def part(self, name: str) -> str | None:
        """Where a tensor or metadata key comes from: "header", "section", or None when absent."""
        if name in self.tensors:
            return self.tensors[name].part
        if name in self.metadata:
            return "section" if self.section is not None and name in self.section.metadata else "header"
        return None

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise PinferError(f"{self.path}: missing tensor {quote(name)}; the file is incomplete or not a model of "
                              f"this architecture") from None

    @property
    def mm(self) -> np.ndarray:
        """The whole file as a read-only uint8 array, mapped shared from the descriptor the file was opened with
        (not re-opened by name: a file renamed over this path since does not change what this object reads).
        Nothing is committed for the map, so a model larger than RAM maps; views are not writable."""
        if self._mm is None:
            if self._fd < 0:
                raise PinferError(f"{self.path}: the file was closed")
            try:
                m = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                raise PinferError(f"{self.path}: cannot map the file ({e})") from None
            self._mm = np.frombuffer(m, dtype=np.uint8)
        return self._mm

    def fileno(self) -> int:
        if self._fd < 0:
            raise PinferError(f"{self.path}: the file was closed")
        return self._fd

    def raw(self, name: str) -> np.ndarray:
        """Zero-copy view of a tensor's bytes: typed and shaped for plain types, uint8 [rows, row_bytes] otherwise."""
        t = self.info(name)
        try:
            qtype = GGMLQuantizationType(t.ggml_type)
        except ValueError:
            raise PinferError(f"{self.path}: tensor {quote(name)} has unknown type {t.ggml_type}; "
                              f"convert the model with a current llama.cpp") from None
        if t.part == "section" and t.nbytes < C.SECTION_SMALL_TENSOR:
            buf = self._pread(t)  # see section.pread_exact: where copies leave holes, pread reads them safely
        else:
            buf = self.mm[t.offset:t.offset + t.nbytes]
        if qtype in PLAIN_DTYPES:
            return buf.view(PLAIN_DTYPES[qtype]).reshape(t.shape)
        if qtype == GGMLQuantizationType.BF16:
            return buf.view(np.uint16).reshape(t.shape)
        row_bytes = tensor_nbytes(t.ne[:1], t.ggml_type)
        return buf.reshape(*t.shape[:-1], row_bytes)

    def _pread(self, t: TensorInfo) -> np.ndarray:
        data = os.pread(self.fileno(), t.nbytes, t.offset)
        if len(data) != t.nbytes:
            raise PinferError(f"{self.path}: tensor {quote(t.name)} is cut short; the file was truncated")
        return np.frombuffer(data, dtype=np.uint8)

    def close(self) -> None:
        """Drop the map and the descriptor (and with it the pins that keep pinfer writers off the section's bytes).
        Views handed out earlier keep their map alive."""
        self._mm = None
        if self._closer is not None:
            self._closer()
        self._fd = -1


class _Cursor:
    """Sequential reads over a bytes-like object, bounded by `end`, with a clear error on truncation."""

    def __init__(self, buf, path: Path, pos: int = 0, end: int | None = None, what: str = "GGUF header"):
        self.buf, self.pos, self.path, self.what = buf, pos, path, what
        self.end = len(buf) if end is None else end

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.end:
            raise PinferError(f"{self.path}: truncated {self.what} (needs {self.pos + n} bytes, has "
                              f"{self.end}); download or convert the file again")

    def unpack(self, fmt: str, size: int):
        self.need(size)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return v

    def string(self, limit: int | None = None, what: str = "") -> str:
        n = self.unpack("<Q", 8)
        if limit is not None and n >= limit:
            raise PinferError(f"{self.path}: corrupt {self.what} ({what} of {n} bytes at byte {self.pos - 8}; ggml "
                              f"takes at most {limit - 1})")
        self.need(n)
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.unpack(*_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            if depth >= _MAX_NESTING:
                raise PinferError(f"{self.path}: corrupt {self.what} (arrays nested {depth} deep)")
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
                self.need(n * 12)  # each element holds at least its type and count
                return [self.value(_ARRAY, depth + 1) for _ in range(n)]
            raise PinferError(f"{self.path}: corrupt {self.what} (array of unknown type {sub})")
        raise PinferError(f"{self.path}: corrupt {self.what} (unknown value type {vtype} at byte {self.pos})")

    def _strings(self, n: int) -> list[str]:
        # The hot loop of header parsing (vocabularies hold 32k-256k strings): keep it to locals.
        buf, pos, out, unpack = self.buf, self.pos, [], struct.unpack_from
        end = self.end
        self.need(min(n, end) * 8)  # every string holds at least its length
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


def parse_header(buf, path: Path, start: int = 0, end: int | None = None, what: str = "GGUF header") -> Header:
    """Parse the GGUF header at buf[start:end]. Tensor offsets are left relative; types are the stored ids."""
    end = len(buf) if end is None else end
    cur = _Cursor(buf, path, start, end, what)
    cur.need(24)
    magic = bytes(buf[start:start + 4])
    if magic not in (C.GGUF_MAGIC, C.PWRI_MAGIC):
        raise PinferError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF' or b'PWRI')")
    cur.pos += 4
    version = cur.unpack("<I", 4)
    if version not in C.SUPPORTED_VERSIONS:
        raise PinferError(f"{path}: GGUF version {version} is not supported (only 2 and 3); "
                          f"reconvert it with a current llama.cpp")
    n_tensors = cur.unpack("<Q", 8)
    n_kv = cur.unpack("<Q", 8)
    if n_tensors * _MIN_INFO + n_kv * _MIN_KV > end - cur.pos:
        raise PinferError(f"{path}: corrupt {what} (claims {n_tensors} tensors and {n_kv} keys, more than its "
                          f"{end - start} bytes can hold)")

    metadata: dict[str, Any] = {}
    value_types: dict[str, tuple[int, int | None]] = {}
    for _ in range(n_kv):
        key = cur.string()
        vtype = cur.unpack("<I", 4)
        sub = None
        if vtype == _ARRAY:
            cur.need(4)
            sub = struct.unpack_from("<I", buf, cur.pos)[0]
        value = cur.value(vtype)
        if key not in metadata:  # ggml's gguf_find_key takes the first of duplicated keys
            metadata[key] = value
            value_types[key] = (vtype, sub)

    infos = []
    seen = set()
    for _ in range(n_tensors):
        name = cur.string(MAX_NAME, "a tensor name")
        n_dims = cur.unpack("<I", 4)
        if n_dims > _MAX_DIMS:
            raise PinferError(f"{path}: corrupt tensor info for {quote(name)} ({n_dims} dimensions)")
        ne = tuple(cur.unpack("<Q", 8) for _ in range(n_dims))
        ggml_type = cur.unpack("<I", 4)
        offset = cur.unpack("<Q", 8)
        if name in seen:
            raise PinferError(f"{path}: corrupt {what} (tensor {quote(name)} appears twice)")
        seen.add(name)
        infos.append((name, ne, ggml_type, offset))

    alignment = metadata.get(C.ALIGNMENT, C.DEFAULT_ALIGNMENT)
    if (not isinstance(alignment, (int, np.integer)) or isinstance(alignment, bool) or alignment <= 0
            or alignment & (alignment - 1) or alignment > 1 << 30):
        raise PinferError(f"{path}: corrupt {what} (alignment {alignment!r} is not a power of two)")
    alignment = int(alignment)
    data_offset = start + -(-(cur.pos - start) // alignment) * alignment
    return Header(magic, version, metadata, value_types, infos, alignment, cur.pos, data_offset)


def resolve_type(stored: int, powerinfer: bool, name: str, path: Path, legacy: list[str]) -> int:
    """A stored type id in the gguf package's numbering. PWRI files number types as PowerInfer's ggml does; ids that
    mean nothing there are refused, except the I8/I16/I32 ids of today's ggml on plan tensors, which earlier pinfer
    versions wrote (recorded in `legacy`)."""
    if not powerinfer:
        return stored
    if stored in C.POWERINFER_TYPE_IDS:
        return C.POWERINFER_TYPE_IDS[stored]
    plan = name.endswith((".gpu_idx", ".gpu_bucket"))
    if plan and stored in (GGMLQuantizationType.I8, GGMLQuantizationType.I16, GGMLQuantizationType.I32):
        legacy.append(name)
        return stored
    raise PinferError(f"{path}: tensor {quote(name)} has type id {stored}, which PowerInfer's ggml does not define (it "
                      f"knows 0-3 and 6-18); the file is corrupt or was written with today's ggml type numbers")


def tensor_infos(h: Header, path: Path, powerinfer: bool, legacy: list[str], size: int,
                 part: str = "header") -> dict[str, TensorInfo]:
    """Header tensor infos with absolute offsets and sizes, each checked against the file's size and laid out as
    ggml's loader takes them: in order, each tensor's data right after the one before, padded to the alignment.
    Overlapping or swapped data (an offset set to 0) was read as another tensor's bytes."""
    tensors: dict[str, TensorInfo] = {}
    expected: int | None = 0  # where the next tensor's data must start (None after one of unknown size)
    for name, ne, stored, offset in h.infos:
        ggml_type = resolve_type(stored, powerinfer, name, path, legacy)
        nbytes = tensor_nbytes(ne, ggml_type)
        if nbytes is None:
            try:
                GGMLQuantizationType(ggml_type)
            except ValueError:
                nbytes = 0  # unknown type: kept so that the error names the tensor when it is used
            else:
                raise PinferError(f"{path}: corrupt tensor info for {quote(name)} (rows of {ne[0] if ne else 0} "
                                  f"elements are not whole {type_name(ggml_type)} blocks)")
        if offset % h.alignment:
            raise PinferError(f"{path}: corrupt tensor info for {quote(name)} (offset {offset} is not a multiple of "
                              f"the alignment {h.alignment})")
        if expected is not None and offset != expected:
            raise PinferError(f"{path}: corrupt tensor info for {quote(name)} (its data is at offset {offset}, where "
                              f"the tensors before it end at {expected}: ggml takes tensor data only in order, each "
                              f"padded to the alignment {h.alignment})")
        if tensor_nbytes(ne, ggml_type) is None:
            expected = None  # a type of unknown size: where the next tensor starts cannot be told
        elif expected is not None:
            expected += -(-nbytes // h.alignment) * h.alignment
        t = TensorInfo(name, ne, ggml_type, h.data_offset + offset, nbytes, part)
        if t.offset + nbytes > size:
            raise PinferError(f"{path}: truncated file: tensor {quote(name)} ends at byte {t.offset + nbytes} but the "
                              f"file has {size}; download or convert it again")
        tensors[name] = t
    return tensors


def data_end(h: Header, tensors: dict[str, TensorInfo]) -> int | None:
    """Where the header's tensor data ends, or None when a tensor's size is unknown."""
    end = h.data_offset
    for t in tensors.values():
        if t.nbytes == 0 and tensor_nbytes(t.ne, t.ggml_type) is None:
            return None
        end = max(end, t.offset + t.nbytes)
    return end
