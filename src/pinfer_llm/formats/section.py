"""pinfer's section: what pinfer adds to a model, stored after the model's tensor data where no other loader looks.

llama.cpp, PowerInfer and gguf-py read a model's header and the tensors it lists, and ignore bytes after the last
tensor's data. Changing the header would shift every tensor (a full copy of the model); adding a tensor to it breaks
both engines ("wrong number of tensors"; PowerInfer: "basic_string: construction from null"). So pinfer leaves the
model's bytes alone and appends:

    [model: header | tensor data]                             never changed in place
    zeros up to the next 4096-byte boundary (dir_offset)
    directory, 4096 bytes:
        0  magic "PINFERSD"      8  u32 layout version (1)     12  u32 0
        16 u64 data_end (where the model's tensor data ends; must match the header)      24  u64 0
        32 slot 0, 64 slot 1: u64 generation | u64 offset | u64 nbytes | u64 checksum     (generation 0: empty)
        zeros to 4096
    sections, each on a page boundary after the directory

A section is a GGUF v3 blob of its own (magic GGUF, today's type ids, offsets of its own): pinfer's metadata and
tensors, plus
    pinfer.section.version         u32 1
    pinfer.section.hidden_keys     [str]  header keys the section deletes
    pinfer.section.hidden_tensors  [str]  header tensors the section deletes
    pinfer.section.tensor_offsets  [u64]  absolute file offset of each tensor's data, in tensor-info order
Tensors under 1 MiB (statistics, plans, thresholds) always lie inside their blob. A larger one (predictors, a
neuron-major ffn_down_t) is written once, inside the blob of the update that set it, and later sections point at
it where it is, so an update copies only what it changes.

The current section is the valid slot with the higher generation. A slot is valid when its blob lies after the
directory inside the file, parses, every tensor lies inside the file, and its checksum matches: blake2b-64 over the
slot's generation, offset and nbytes, the blob's header, and the data of its tensors under 1 MiB (large tensors are
fsynced before a slot points at them). An invalid slot is ignored: a torn slot write leaves the other, older slot in
charge. formats/update.py writes sections; readers pin the byte ranges they use (formats/locks.py).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pinfer_llm.formats import constants as C
from pinfer_llm.formats import locks, schema
from pinfer_llm.formats.encoder import encode_header
from pinfer_llm.formats.errors import PinferError, quote
from pinfer_llm.formats.header import GGUFFile, TensorInfo, parse_header, tensor_nbytes

SMALL_TENSOR = C.SECTION_SMALL_TENSOR  # below: copied into every new section, checksummed, read with pread
_SLOT = struct.Struct("<QQQQ")
_DIR_HEAD = struct.Struct("<8sIIQQ")
SLOT_OFFSETS = (32, 64)


def round_up(x: int, n: int) -> int:
    return -(-x // n) * n


def dir_offset(data_end: int) -> int:
    return round_up(data_end, C.SECTION_PAGE)


def tail_start(data_end: int) -> int:
    """The first byte a section may use."""
    return dir_offset(data_end) + C.SECTION_DIR_SIZE


@dataclass
class Slot:
    generation: int
    offset: int
    nbytes: int
    checksum: int

    def pack(self) -> bytes:
        return _SLOT.pack(self.generation, self.offset, self.nbytes, self.checksum)


@dataclass
class Section:
    """The current section of a file, as parsed and checked."""

    slot: int  # 0 or 1
    generation: int
    offset: int
    nbytes: int
    metadata: dict[str, Any]  # pinfer's keys, without the pinfer.section.* bookkeeping
    value_types: dict[str, tuple[int, int | None]]
    tensors: dict[str, TensorInfo]  # absolute offsets, part="section"
    hidden_keys: list[str] = field(default_factory=list)
    hidden_tensors: list[str] = field(default_factory=list)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """Byte ranges the section uses: its blob and the large tensors it points at outside the blob."""
        out = [(self.offset, self.offset + self.nbytes)]
        for t in self.tensors.values():
            if not (self.offset <= t.offset and t.offset + t.nbytes <= self.offset + self.nbytes) and t.nbytes:
                out.append((t.offset, t.offset + t.nbytes))
        return merge_ranges(out)


def merge_ranges(ranges) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def checksum(slot: Slot, header: bytes | memoryview, small: list) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<QQQ", slot.generation, slot.offset, slot.nbytes))
    h.update(header)
    for data in small:
        h.update(data)
    return int.from_bytes(h.digest(), "little")


# --- the directory ------------------------------------------------------------------------------------------------

def directory_bytes(data_end: int) -> bytes:
    head = _DIR_HEAD.pack(C.SECTION_DIR_MAGIC, C.SECTION_DIR_VERSION, 0, data_end, 0)
    return head.ljust(C.SECTION_DIR_SIZE, b"\0")


def classify_trailing(buf, size: int, data_end: int | None, fd: int | None = None) -> str:
    """What follows the model's tensor data: "none" (nothing, or zeros), "section" (pinfer's directory), "foreign"
    (bytes pinfer did not write: it leaves such a file alone), or "unknown" (a tensor of unknown size)."""
    if data_end is None:
        return "unknown"
    if size <= data_end:
        return "none"
    d = dir_offset(data_end)
    if size >= d + _DIR_HEAD.size:
        magic, version, _, end, _ = _DIR_HEAD.unpack_from(buf, d)
        if magic == C.SECTION_DIR_MAGIC:
            return "section" if version == C.SECTION_DIR_VERSION and end == data_end else "foreign"
    # zeros up to the end of where a directory would be: padding, or a first write that died before its directory
    # landed (a directory is written before any section)
    stop = min(size, d + C.SECTION_DIR_SIZE)
    gap = os.pread(fd, stop - data_end, data_end) if fd is not None else bytes(buf[data_end:stop])  # often a hole
    return "none" if not any(gap) else "foreign"


def read_slots(buf, d: int) -> list[Slot]:
    return [Slot(*_SLOT.unpack_from(buf, d + off)) for off in SLOT_OFFSETS]


def directory_intact(size: int, data_end: int) -> bool:
    """Whether the whole directory is inside the file (a file cut inside it has a magic but no slots to read)."""
    return size >= dir_offset(data_end) + C.SECTION_DIR_SIZE


def ignored(path, why: str, newer: bool = False) -> str:
    """The one line a reader gives when pinfer's section cannot be used: the model loads without it."""
    what = "the newest pinfer section" if newer else "pinfer's section (statistics, predictors, plan)"
    rest = "an older one is used" if newer else "the model itself is intact and loads without it"
    return f"{path}: {what} was ignored ({why}); {rest}"


# --- reading a section --------------------------------------------------------------------------------------------

class InvalidSection(Exception):
    """A slot that does not point at a valid section (the reason is the message)."""


def pread_exact(fd: int, offset: int, n: int) -> bytes:
    """n bytes at offset, read with pread rather than through a map: a page of a hole on a full tmpfs cannot be
    mapped in (the read is a SIGBUS, rc 135, that no Python code can catch), while pread returns its zeros."""
    parts, done = [], 0
    while done < n:
        chunk = os.pread(fd, min(n - done, 1 << 30), offset + done)
        if not chunk:
            raise InvalidSection(f"cut short at byte {offset + done}")
        parts.append(chunk)
        done += len(chunk)
    return b"".join(parts)


def _read_header(fd: int, path: Path, slot: Slot):
    """The blob's GGUF header, read with pread from its start: 64 KiB first, twice as much while it does not parse
    (a blob can hold GBs of predictors after a header of a few KiB). Positions in it are relative to the blob."""
    n = min(slot.nbytes, 1 << 16)
    while True:
        head = pread_exact(fd, slot.offset, n)
        try:
            return head, parse_header(head, path, 0, n, what="pinfer section")
        except PinferError as e:
            if n == slot.nbytes:
                raise InvalidSection(str(e).removeprefix(f"{path}: ")) from None
            n = min(slot.nbytes, 2 * n)


def load_section(fd: int, path: Path, size: int, start: int, index: int, slot: Slot) -> Section:
    """Parse and check the section a slot points at; InvalidSection when it is not valid. `size` bounds every byte
    read (the caller pinned the blob and checked the file's current size). The blob is read with pread (see
    pread_exact): the section follows the model's data, where copies and pinfer's own reclaiming leave holes."""
    if slot.generation == 0:
        raise InvalidSection("empty slot")
    if (slot.offset < start or slot.offset % C.SECTION_PAGE or slot.nbytes < 24
            or slot.offset + slot.nbytes > size):
        raise InvalidSection(f"slot {index} points outside the file ({slot.offset}+{slot.nbytes}, file {size})")
    end = slot.offset + slot.nbytes
    try:
        head, h = _read_header(fd, path, slot)
    except OSError as e:
        raise InvalidSection(f"slot {index}: cannot read it ({e.strerror})") from None
    if h.magic != C.GGUF_MAGIC or h.version != 3:
        raise InvalidSection("not a GGUF v3 blob")
    offsets = h.metadata.get(C.SECTION_TENSOR_OFFSETS, np.zeros(0, np.uint64))
    hidden_keys = h.metadata.get(C.SECTION_HIDDEN_KEYS, [])
    hidden_tensors = h.metadata.get(C.SECTION_HIDDEN_TENSORS, [])
    if (not isinstance(offsets, np.ndarray) or len(offsets) != len(h.infos)
            or not all(isinstance(x, list) and all(isinstance(s, str) for s in x)
                       for x in (hidden_keys, hidden_tensors))):
        raise InvalidSection("corrupt bookkeeping keys")
    tensors: dict[str, TensorInfo] = {}
    small = []
    for (name, ne, ggml_type, _), off in zip(h.infos, offsets.tolist(), strict=True):
        nbytes = tensor_nbytes(ne, ggml_type)
        if nbytes is None:
            raise InvalidSection(f"tensor {quote(name)} has unknown type {ggml_type}")
        if off < start or off + nbytes > size:
            raise InvalidSection(f"tensor {quote(name)} lies outside the file")
        if nbytes < SMALL_TENSOR:
            if off < slot.offset + h.data_offset or off + nbytes > end:
                raise InvalidSection(f"small tensor {quote(name)} lies outside its section")
            try:
                small.append(pread_exact(fd, off, nbytes))
            except OSError as e:
                raise InvalidSection(f"tensor {quote(name)}: cannot read it ({e.strerror})") from None
        tensors[name] = TensorInfo(name, ne, ggml_type, off, nbytes, "section")
    if checksum(slot, head[:h.end], small) != slot.checksum:
        raise InvalidSection(f"slot {index}: checksum mismatch")
    meta = {k: v for k, v in h.metadata.items() if k not in C.SECTION_KEYS}
    bad = schema.problems(meta)
    if bad:  # a valid checksum over a value no pinfer writer makes (a hand-edited file): none of it is trusted
        raise InvalidSection(bad[0])
    types = {k: v for k, v in h.value_types.items() if k not in C.SECTION_KEYS}
    return Section(index, slot.generation, slot.offset, slot.nbytes, meta, types, tensors, list(hidden_keys),
                   list(hidden_tensors))


def current_section(buf, fd: int, path: Path, size: int, data_end: int) -> tuple[Section | None, list[str]]:
    """The current section of an unchanging file (a writer holding the writer lock reads it so), and the reasons
    any non-empty slot was rejected."""
    d = dir_offset(data_end)
    slots = read_slots(buf, d)
    problems = []
    for i in sorted(range(2), key=lambda i: -slots[i].generation):
        if slots[i].generation == 0:
            continue
        try:
            return load_section(fd, path, size, d + C.SECTION_DIR_SIZE, i, slots[i]), problems
        except InvalidSection as e:
            problems.append(str(e))
    return None, problems


def attach_section(f: GGUFFile, buf, fd: int) -> None:
    """Find the current section of an open file, pin its bytes through `fd` and merge it into `f`.

    Writers may commit a new section and free the old one's bytes at any moment, so a reader pins a blob before
    reading it, then checks that the directory still names it: a section is freed only after a newer one superseded
    it, and never while pinned. Every read is bounded by the file's size after pinning (a mapped byte past the end
    of the file would kill the process). A slot past the end of `buf` but inside the file as it is now was committed
    after `buf` was mapped (a writer grew the file): the file is mapped again, rather than taking an older section,
    or none, as if the newest were broken."""
    d = dir_offset(f.data_end)
    start = d + C.SECTION_DIR_SIZE
    if not directory_intact(len(buf), f.data_end):
        f.warnings.append(ignored(f.path, f"its directory is cut short: {len(buf) - d} of {C.SECTION_DIR_SIZE} "
                                          f"bytes, the file was truncated"))
        return
    own = None  # the map made here when the file grew after `buf` was mapped

    def slots_raw() -> bytes:
        return bytes(buf[d + SLOT_OFFSETS[0]:d + SLOT_OFFSETS[1] + _SLOT.size])

    try:
        for attempt in range(1000):
            raw = slots_raw()
            slots = read_slots(buf, d)
            retry = grown = False
            problems = []
            for i in sorted(range(2), key=lambda i: -slots[i].generation):
                s = slots[i]
                if s.generation == 0:
                    continue
                if not start <= s.offset <= s.offset + s.nbytes <= len(buf):
                    if start <= s.offset and s.offset + s.nbytes <= os.fstat(fd).st_size:
                        grown = True
                        break
                    problems.append(f"slot {i} points outside the file ({s.offset}+{s.nbytes}, file {len(buf)})")
                    continue
                blob = locks.pin(fd, [(s.offset, s.offset + s.nbytes)])
                if blob is None or slots_raw() != raw:  # superseded and being freed, or a new commit
                    retry = True
                    locks.release(fd, blob or [])
                    break
                size = min(os.fstat(fd).st_size, len(buf))
                try:
                    sec = load_section(fd, f.path, size, start, i, s)
                except InvalidSection as e:
                    locks.release(fd, blob)
                    problems.append(str(e))
                    continue
                outside = [r for r in sec.ranges if r != (s.offset, s.offset + s.nbytes)]
                more = locks.pin(fd, outside)
                if more is None or slots_raw() != raw:
                    locks.release(fd, blob + (more or []))
                    retry = True
                    break
                _merge(f, sec)
                f.pinned = blob + more
                if problems:
                    f.warnings.append(ignored(f.path, "; ".join(problems), newer=True))
                return
            if grown:
                if own is not None:
                    own.close()
                own = buf = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
                continue
            if not retry:
                if problems:
                    f.warnings.append(ignored(f.path, "; ".join(problems)))
                return
            time.sleep(min(0.001 * attempt, 0.05))
        raise PinferError(f"{f.path}: the file's pinfer section keeps changing while it is read; try again")
    finally:
        if own is not None:
            own.close()


def _merge(f: GGUFFile, sec: Section) -> None:
    f.section = sec
    for k in sec.hidden_keys:
        f.metadata.pop(k, None)
        f.value_types.pop(k, None)
    for name in sec.hidden_tensors:
        f.tensors.pop(name, None)
    f.metadata.update(sec.metadata)
    f.value_types.update(sec.value_types)
    f.tensors.update(sec.tensors)


# --- writing a section --------------------------------------------------------------------------------------------

@dataclass
class NewTensor:
    """Tensor data to store: contiguous bytes of `ggml_type` (gguf numbering) and ggml shape `ne`."""

    data: np.ndarray  # any dtype, C-contiguous; its bytes are written as they are
    ggml_type: int
    ne: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


@dataclass
class Content:
    """What a section holds, before it is laid out: kept tensors are TensorInfos of the file being updated."""

    metadata: dict[str, Any] = field(default_factory=dict)
    value_types: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    tensors: dict[str, NewTensor | TensorInfo] = field(default_factory=dict)
    hidden_keys: set[str] = field(default_factory=set)
    hidden_tensors: set[str] = field(default_factory=set)


@dataclass
class Layout:
    """A section placed at `offset`: its header bytes and where each tensor's data goes."""

    offset: int
    header: bytes
    nbytes: int
    writes: list[tuple[int, NewTensor | TensorInfo]]  # (absolute offset, source) for data inside the blob
    external: list[TensorInfo]  # large tensors left where they are

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return merge_ranges([(self.offset, self.offset + self.nbytes)]
                            + [(t.offset, t.offset + t.nbytes) for t in self.external])


def layout(content: Content, offset: int, keep_large: bool = True) -> Layout:
    """Lay a section out at `offset`. Kept tensors of 1 MiB or more stay where they are unless keep_large is False
    (a copy into another file). The header's size does not depend on `offset`, so a caller can size a section at
    offset 0 and place it after."""
    names = list(content.tensors)
    inside, external = [], []
    for name in names:
        t = content.tensors[name]
        if isinstance(t, TensorInfo) and keep_large and t.nbytes >= SMALL_TENSOR:
            external.append(name)
        else:
            inside.append(name)
    align = C.DEFAULT_ALIGNMENT
    rel, pos = {}, 0
    for name in inside:
        rel[name] = pos
        pos += round_up(content.tensors[name].nbytes, align)
    data_size = pos

    def infos(abs_of):
        out = []
        for name in names:
            t = content.tensors[name]
            out.append((name, tuple(t.ne), int(t.ggml_type), rel.get(name, 0)))
        return out, np.array([abs_of(n) for n in names], dtype=np.uint64)

    meta = {C.SECTION_VERSION: 1, C.SECTION_HIDDEN_KEYS: sorted(content.hidden_keys),
            C.SECTION_HIDDEN_TENSORS: sorted(content.hidden_tensors)}
    types = {C.SECTION_VERSION: (4, None), C.SECTION_HIDDEN_KEYS: (9, 8), C.SECTION_HIDDEN_TENSORS: (9, 8),
             C.SECTION_TENSOR_OFFSETS: (9, 10)}
    ti, offs = infos(lambda n: 0)
    meta[C.SECTION_TENSOR_OFFSETS] = offs
    for k, v in content.metadata.items():
        if k in C.SECTION_KEYS:
            raise ValueError(f"{k} is reserved for the section's own bookkeeping")
        meta[k] = v
        if k in content.value_types:
            types[k] = content.value_types[k]
    head = encode_header(C.GGUF_MAGIC, meta, types, ti, align)
    data_offset = round_up(len(head), align)

    def absolute(name):
        t = content.tensors[name]
        return offset + data_offset + rel[name] if name in rel else t.offset

    ti, offs = infos(absolute)
    meta[C.SECTION_TENSOR_OFFSETS] = offs
    head = encode_header(C.GGUF_MAGIC, meta, types, ti, align)
    assert round_up(len(head), align) == data_offset
    writes = [(offset + data_offset + rel[n], content.tensors[n]) for n in inside]
    return Layout(offset, head, data_offset + data_size, writes, [content.tensors[n] for n in external])


def small_data(lay: Layout, read) -> list:
    """The data the checksum covers, in tensor-info order (read(info) gives a kept tensor's bytes)."""
    out = []
    for _, src in lay.writes:
        if src.nbytes < SMALL_TENSOR:
            out.append(memoryview(np.ascontiguousarray(src.data)).cast("B") if isinstance(src, NewTensor)
                       else read(src))
    return out
