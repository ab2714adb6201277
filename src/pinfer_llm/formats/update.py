"""Storing what pinfer adds (statistics, predictors, plans) into a model: in place in seconds, or as a copy.

update_model(path, ...) changes only pinfer's section (formats/section.py), never the model's header or data, so
it costs what it stores, needs no free space beyond that, and PowerInfer and llama.cpp load the file as before.
The protocol, one writer per model at a time:
 1. Take the model's writer lock (formats/locks.py; a second writer waits). Re-read the header and the current
    section from the file itself, not from what the caller read earlier.
 2. Refuse when the model's tensors changed since the caller read it (`expect`): its work was computed for another
    model. A changed section is not a conflict: the new section is the current one plus this writer's changes, so
    pi-profile and pi-plan running side by side both keep their results (for one key, the last writer wins).
 3. Place the new section where neither the current section nor any reader's pinned bytes lie: the first gap after
    the directory that fits, else the end of the file. Large tensors the current section already holds stay where
    they are and are pointed at, so storing a plan next to GBs of predictors writes only the plan.
 4. Write the directory (first time only), fsync; write the section, fsync; write the slot with the older
    generation (32 bytes), fsync. Until that slot write lands, every reader sees the old section; after it, the new
    one; a torn slot fails its checksum and the other slot stays in charge.
 5. Free what no section uses any more, unless a reader still pins it: truncate the end of the file and punch holes
    (fallocate) in dead gaps. When the new section had to go after the old one, a small one (<= 64 MiB) is then
    written once more into the gap the old one left, so that the file ends where the model plus one section ends.
At every instant the file is a valid model whose pinfer content is either the old or the new. A kill leaves at most
unreferenced bytes after the directory, which the next write reuses or frees. A reader's pins last as long as its
GGUFFile (and any view of its map) lives: store(f, close=True) closes the caller's own file first, so that the
section it read is freed by this write rather than the next.

write_copy(src, dest, ...) writes a complete new file atomically (formats/writer.atomic_output): the model's bytes
(copied in the kernel), then a directory and one section. Where an earlier pinfer version put its tensors into the
header (which breaks PowerInfer and llama.cpp), the copy moves them into the section; a PowerInfer file without
predictors gets the section's predictors in its header, where PowerInfer needs them.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import hashlib
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

from pinfer_llm.formats import atomic as A
from pinfer_llm.formats import constants as C
from pinfer_llm.formats import encoder as E
from pinfer_llm.formats import locks
from pinfer_llm.formats import section as S
from pinfer_llm.formats.encoder import RawTensor, checkpoint, pwrite_all, write_array
from pinfer_llm.formats.errors import PinferError
from pinfer_llm.formats.header import GGUFFile
from pinfer_llm.formats.reader import parse_file


def header_fingerprint(f: GGUFFile) -> str:
    """What the model is: its header tensors' names, shapes, types and places. An in-place update never changes it."""
    h = hashlib.sha256(f.magic + str(f.data_offset).encode())
    for t in f.header_tensors.values():
        h.update(f"{t.name}|{','.join(map(str, t.ne))}|{t.ggml_type}|{t.offset}\n".encode())
    return h.hexdigest()[:16]


def pinfer_only(name: str, f: GGUFFile) -> bool:
    """A header tensor only pinfer reads, which makes other loaders refuse the file (see constants)."""
    if f.architecture == C.GPU_INDEX_ARCH or f.header_metadata.get(C.SKELETON):
        return False
    parts = name.split(".")
    if len(parts) >= 3 and parts[0] == "blk" and parts[1].isdigit():
        generic = "blk.{bid}." + ".".join(parts[2:])
        if generic in C.PINFER_ONLY_TENSORS:
            return True
        if not f.is_powerinfer and generic in (C.PRED_FC1, C.PRED_FC2):
            return True  # llama.cpp knows no predictors
    return False


def _new_tensor(name: str, t) -> S.NewTensor:
    if isinstance(t, S.NewTensor):
        return t
    data, ggml_type, ne = E.as_tensor(name, t)
    return S.NewTensor(data, ggml_type, ne)


def merged_content(header: GGUFFile, current: S.Section | None, *, set_metadata: dict[str, Any] | None = None,
                   set_tensors: dict[str, Any] | None = None, drop_keys=(), drop_tensors=(), drop_prefixes=(),
                   value_types: dict[str, tuple[int, int | None]] | None = None) -> S.Content:
    """The next section: the current one with these changes. Keys and tensors the header holds are hidden by
    tombstones when dropped, and overridden when set."""
    c = S.Content()
    if current is not None:
        c.metadata = dict(current.metadata)
        c.value_types = dict(current.value_types)
        c.tensors = dict(current.tensors)
        c.hidden_keys = set(current.hidden_keys)
        c.hidden_tensors = set(current.hidden_tensors)
    set_metadata, set_tensors, value_types = set_metadata or {}, set_tensors or {}, value_types or {}
    for k in set_metadata:
        if k in C.SECTION_KEYS:
            raise ValueError(f"{k} is reserved for the section's own bookkeeping")
    drop = set(drop_keys)
    if drop_prefixes:
        visible = (set(header.header_metadata) - c.hidden_keys) | set(c.metadata)
        drop |= {k for k in visible if k.startswith(tuple(drop_prefixes))}
    for k in drop - set(set_metadata):
        c.metadata.pop(k, None)
        c.value_types.pop(k, None)
        if k in header.header_metadata:
            c.hidden_keys.add(k)
    for name in set(drop_tensors) - set(set_tensors):
        c.tensors.pop(name, None)
        if name in header.header_tensors:
            c.hidden_tensors.add(name)
    for k, v in set_metadata.items():
        c.metadata[k] = v
        c.value_types[k] = value_types.get(k) or E.infer_vtype(v)
        c.hidden_keys.discard(k)
    for name, t in set_tensors.items():
        c.tensors[name] = _new_tensor(name, t)
        c.hidden_tensors.discard(name)
    c.hidden_keys &= set(header.header_metadata)
    c.hidden_tensors &= set(header.header_tensors)
    return c


def _empty(c: S.Content) -> bool:
    return not (c.metadata or c.tensors or c.hidden_keys or c.hidden_tensors)


# --- in place -----------------------------------------------------------------------------------------------------

def update_model(path: str | os.PathLike, *, set_metadata: dict[str, Any] | None = None,
                 set_tensors: dict[str, np.ndarray | RawTensor] | None = None, drop_keys=(), drop_tensors=(),
                 drop_prefixes=(), value_types: dict[str, tuple[int, int | None]] | None = None,
                 expect: GGUFFile | None = None, progress: bool = False) -> Path:
    """Store metadata and tensors into the model at `path` in place (see the module docstring), and drop keys and
    tensors (drop_prefixes: every key starting with one). `expect`: the GGUFFile the caller computed its changes
    from; the write is refused if the model's tensors changed since. Returns the path."""
    path = Path(path)
    A.refuse_installed(path)
    A.remove_stale_temporaries(path)
    changes = dict(set_metadata=set_metadata, set_tensors=set_tensors, drop_keys=drop_keys,
                   drop_tensors=drop_tensors, drop_prefixes=drop_prefixes, value_types=value_types)
    with A.terminate_as_interrupt():
        fd = _open_locked(path)
        try:
            return _update_locked(fd, path, expect, changes, progress)
        except OSError as e:
            raise A.os_error(e, path, "update") from None
        finally:
            os.close(fd)


def _open_locked(path: Path) -> int:
    """A read-write descriptor of the file now at `path`, holding its writer lock."""
    for _ in range(100):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise PinferError(f"{path}: no such file") from None
        except IsADirectoryError:
            raise PinferError(f"{path}: is a directory, expected a .gguf file") from None
        except OSError as e:
            raise PinferError(f"cannot update {path} in place: {A.os_reason(e)}; write a copy with -o OUT") from None
        try:
            locks.lock_writer(fd)
        except OSError as e:
            os.close(fd)
            raise PinferError(f"cannot lock {path} for writing ({e.strerror}); write a copy with -o OUT") from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # replaced while we waited for the lock: lock the new file
    raise PinferError(f"{path} keeps being replaced; try again")


def _update_locked(fd: int, path: Path, expect: GGUFFile | None, changes: dict, progress: bool) -> Path:
    size = os.fstat(fd).st_size
    if size < 24:
        raise PinferError(f"{path}: not a GGUF file ({size} bytes is too short for a header)")
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as buf:
        f0 = parse_file(buf, path, size, fd)
        if expect is not None and header_fingerprint(expect) != header_fingerprint(f0):
            raise PinferError(f"{path} was replaced by another model since it was read (its tensors differ); "
                              f"nothing was written: run the command again")
        if f0.trailing == "foreign":
            raise PinferError(f"{path} has {size - f0.data_end} bytes after its tensor data that pinfer did not "
                              f"write; it leaves them alone: write a copy with -o OUT")
        if f0.trailing == "unknown":
            raise PinferError(f"{path} has tensors of a type pinfer does not know, so it cannot tell where the "
                              f"model ends; write a copy with -o OUT")
        # a directory cut short (a truncated file) holds no slot to keep: it is written again, as on a first write
        have_dir = f0.trailing == "section" and S.directory_intact(size, f0.data_end)
        current, _ = S.current_section(buf, fd, path, size, f0.data_end) if have_dir else (None, [])
        raw_slots = S.read_slots(buf, S.dir_offset(f0.data_end)) if have_dir else [S.Slot(0, 0, 0, 0)] * 2
        content = merged_content(f0, current, **changes)
        _commit(fd, path, f0, size, have_dir, current, raw_slots, content, progress)
    # A new section goes where the current one is not; when that was after it, the file could not shrink. Now the
    # old one is free: if a lower gap holds the (small) new one, write it there too and let the end go.
    size = os.fstat(fd).st_size
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as buf:
        current, _ = S.current_section(buf, fd, path, size, f0.data_end)
        if current is not None and current.nbytes <= COMPACT_MAX:
            raw_slots = S.read_slots(buf, S.dir_offset(f0.data_end))
            _commit(fd, path, f0, size, True, current, raw_slots, merged_content(f0, current), False, only_lower=True)
    return path


def _commit(fd: int, path: Path, f0: GGUFFile, size: int, have_dir: bool, current: S.Section | None,
            raw_slots: list[S.Slot], content: S.Content, progress: bool, only_lower: bool = False) -> bool:
    """Write `content` as the next section and make it current; with only_lower, only if it can go below the
    current one (to let the file shrink). Returns whether it wrote."""
    d = S.dir_offset(f0.data_end)
    start = d + C.SECTION_DIR_SIZE
    nbytes = S.layout(content, start).nbytes
    live = current.ranges if current is not None else []
    offset, reserved = _place(fd, size, start, live, nbytes)
    if only_lower and (current is None or offset >= current.offset):
        locks.release(fd, reserved)
        return False
    lay = S.layout(content, offset)
    committed = False
    try:
        if not have_dir:
            pwrite_all(fd, S.directory_bytes(f0.data_end), d)
            checkpoint("directory-written")
            os.fsync(fd)
        pwrite_all(fd, lay.header.ljust(S.round_up(len(lay.header), C.DEFAULT_ALIGNMENT), b"\0"), offset)
        small = {}
        with _bar(progress, sum(src.nbytes for _, src in lay.writes), f"writing into {path.name}") as advance:
            for pos, src in lay.writes:
                if isinstance(src, S.NewTensor):
                    write_array(fd, src.data, pos, advance)
                else:  # a small tensor of the current section, carried into the new one
                    data = os.pread(fd, src.nbytes, src.offset)
                    small[id(src)] = data
                    pwrite_all(fd, data, pos)
        os.ftruncate(fd, max(os.fstat(fd).st_size, offset + lay.nbytes))
        checkpoint("section-written")
        os.fsync(fd)
        checkpoint("section-synced")
        which = 0 if current is None else 1 - current.slot
        if current is None and raw_slots[0].generation > raw_slots[1].generation:
            which = 1  # keep whatever the higher slot holds: it may be a valid section this writer could not read
        slot = S.Slot(max(s.generation for s in raw_slots) + 1, offset, lay.nbytes, 0)
        slot.checksum = S.checksum(slot, lay.header, S.small_data(lay, lambda t: small[id(t)]))
        packed = slot.pack()
        at = d + S.SLOT_OFFSETS[which]
        checkpoint("slot-start")
        pwrite_all(fd, packed[:16], at)
        checkpoint("slot-torn")
        pwrite_all(fd, packed[16:], at + 16)
        committed = True
        checkpoint("slot-written")
        os.fsync(fd)
        checkpoint("slot-synced")
    except BaseException:
        if not committed and offset >= size:
            with contextlib.suppress(OSError):  # nothing after the old end was ever visible: drop it again
                os.ftruncate(fd, size)
        raise
    finally:
        locks.release(fd, reserved)
    _reclaim(fd, start, lay.ranges)
    checkpoint("reclaimed")
    return True


COMPACT_MAX = 64 << 20  # a section up to this size is moved down once more when that lets the file shrink


def _place(fd: int, size: int, start: int, live: list[tuple[int, int]], nbytes: int):
    """(offset, reserved ranges) for a new section of nbytes: the first page-aligned free part after `start` that the
    current section does not use and no reader pins, else the end of the file. A gap is searched around the pins
    inside it (a reader holding an old section open kept every later write from reusing the dead bytes after it)."""
    page = C.SECTION_PAGE
    bounds = [start] + [x for r in live for x in r] + [None]
    for lo, hi in zip(bounds[0::2], bounds[1::2], strict=True):
        top = size if hi is None else hi
        for a, b in locks.free_parts(fd, lo, top):
            a = S.round_up(a, page)
            grows = hi is None and b == size  # the part reaches the end of the file, which may grow
            if (b - a >= nbytes or grows) and locks.reserve(fd, [(a, a + nbytes)]):
                return a, [(a, a + nbytes)]
    lo = S.round_up(max([size, start] + [r[1] for r in live]), page)
    return lo, [(lo, lo + nbytes)] if locks.reserve(fd, [(lo, lo + nbytes)]) else []


def _reclaim(fd: int, start: int, live: list[tuple[int, int]]) -> None:
    """Truncate the file after the last byte a section uses or a reader pins, and punch holes in every unused part
    of the gaps between, around what readers pin."""
    size = os.fstat(fd).st_size
    end = max([start] + [hi for _, hi in live])
    if size > end:
        tail = locks.free_parts(fd, end, size)
        if tail and tail[-1][1] == size and locks.reserve(fd, [tail[-1]]):
            try:
                os.ftruncate(fd, tail[-1][0])
            finally:
                locks.release(fd, [tail[-1]])
    page = C.SECTION_PAGE
    bounds = [start] + [x for r in live for x in r] + [end]
    gaps = [*zip(bounds[0::2], bounds[1::2], strict=True), (end, os.fstat(fd).st_size)]
    for glo, ghi in gaps:
        for lo, hi in locks.free_parts(fd, glo, ghi):
            lo, hi = S.round_up(lo, page), hi // page * page
            if hi - lo >= page and locks.reserve(fd, [(lo, hi)]):
                try:
                    _punch_hole(fd, lo, hi - lo)
                finally:
                    locks.release(fd, [(lo, hi)])


_libc = None


def _punch_hole(fd: int, offset: int, length: int) -> None:
    """Give a range's disk blocks back (fallocate PUNCH_HOLE | KEEP_SIZE); best effort."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.fallocate(fd, 0x02 | 0x01, offset, length)


@contextlib.contextmanager
def _bar(enabled: bool, total: int, label: str):
    with E.progress_bar(enabled and total > 256 << 20, total, label) as advance:
        yield advance


# --- copies -------------------------------------------------------------------------------------------------------

def write_copy(src: GGUFFile, dest: str | os.PathLike, *, set_metadata: dict[str, Any] | None = None,
               set_tensors: dict[str, np.ndarray | RawTensor] | None = None, drop_keys=(), drop_tensors=(),
               drop_prefixes=(), value_types: dict[str, tuple[int, int | None]] | None = None,
               progress: bool = False) -> Path:
    """Write `src` with these changes as a new file at `dest`, atomically: the model's bytes, then one section."""
    dest = Path(dest)
    if A.same_file(src.path, dest):
        return update_model(src.path, set_metadata=set_metadata, set_tensors=set_tensors, drop_keys=drop_keys,
                            drop_tensors=drop_tensors, drop_prefixes=drop_prefixes, value_types=value_types,
                            expect=src, progress=progress)
    if src.data_end is None:
        raise PinferError(f"{src.path} has tensors of a type pinfer does not know; it cannot copy it")
    content = merged_content(src, src.section, set_metadata=set_metadata, set_tensors=set_tensors,
                             drop_keys=drop_keys, drop_tensors=drop_tensors, drop_prefixes=drop_prefixes,
                             value_types=value_types)
    moved = [n for n in src.header_tensors if pinfer_only(n, src) and n not in content.hidden_tensors]
    promoted = promotable_predictors(src, content)
    src_fd = src.fileno()
    with A.atomic_output(dest) as fd:
        if moved or promoted or src.legacy_types:
            end = _write_header(fd, src, src_fd, content, moved, promoted, progress)
        else:
            with _bar(progress, src.data_end, f"copying {src.path.name}") as advance:
                E.copy_range(src_fd, fd, 0, 0, src.data_end)
                advance(src.data_end)
            end = src.data_end
        if not _empty(content):
            d = S.dir_offset(end)
            pwrite_all(fd, S.directory_bytes(end), d)
            lay = S.layout(content, d + C.SECTION_DIR_SIZE, keep_large=False)
            pwrite_all(fd, lay.header, lay.offset)
            for pos, s in lay.writes:
                if isinstance(s, S.NewTensor):
                    write_array(fd, s.data, pos)
                else:
                    E.copy_range(src_fd, fd, s.offset, pos, s.nbytes)
            os.ftruncate(fd, lay.offset + lay.nbytes)
            slot = S.Slot(1, lay.offset, lay.nbytes, 0)
            slot.checksum = S.checksum(slot, lay.header, S.small_data(lay, lambda t: src.mm[t.offset:t.offset
                                                                                             + t.nbytes]))
            pwrite_all(fd, slot.pack(), d + S.SLOT_OFFSETS[0])
        else:
            os.ftruncate(fd, end)
    return dest


def promotable_predictors(src: GGUFFile, content: S.Content) -> list[str]:
    """Predictor tensors a copy puts into the header: PowerInfer cannot load a PWRI file without fc1/fc2 for every
    layer, so when the source's header has none and the section holds a full set, the copy's header gets them
    (with powerinfer.sparse_threshold)."""
    if not src.is_powerinfer or any(".fc1." in n or ".fc2." in n for n in src.header_tensors):
        return []
    n_layer = src.header_metadata.get(f"{src.architecture}.block_count")
    if not isinstance(n_layer, (int, np.integer)) or isinstance(n_layer, bool) or n_layer <= 0:
        return []
    names = [C.tensor(t, b) for b in range(int(n_layer)) for t in (C.PRED_FC1, C.PRED_FC2)]
    ok = all(n in content.tensors and content.tensors[n].ggml_type in (0, 1) for n in names)  # F32 or F16
    return names if ok else []


def _write_header(fd: int, src: GGUFFile, src_fd: int, content: S.Content, moved: list[str], promoted: list[str],
                  progress: bool) -> int:
    """Write the model part of a copy with a rebuilt header: pinfer's tensors and hidden entries out (moved into
    `content`), `promoted` predictors in. Returns where the tensor data ends."""
    for name in moved:
        if name not in content.tensors:
            content.tensors[name] = src.header_tensors[name]
    hidden_keys, hidden_tensors = content.hidden_keys, content.hidden_tensors
    content.hidden_keys, content.hidden_tensors = set(), set()
    meta = {k: v for k, v in src.header_metadata.items() if k not in hidden_keys and k != C.ALIGNMENT}
    types = {k: v for k, v in src.header_value_types.items() if k in meta}
    keep = [(n, t) for n, t in src.header_tensors.items() if n not in moved and n not in hidden_tensors]
    keep += [(n, content.tensors.pop(n)) for n in promoted]
    if promoted and C.SPARSE_THRESHOLD in content.metadata:
        meta[C.SPARSE_THRESHOLD] = np.float32(content.metadata[C.SPARSE_THRESHOLD])
        types[C.SPARSE_THRESHOLD] = (6, None)
    align = src.alignment
    infos, pos = [], 0
    for name, t in keep:
        stored = E.powerinfer_type(name, t.ggml_type) if src.is_powerinfer else t.ggml_type
        infos.append((name, tuple(t.ne), stored, pos))
        pos += S.round_up(t.nbytes, align)
    head = E.encode_header(src.magic, meta, types, infos, align)
    data_offset = S.round_up(len(head), align)
    pwrite_all(fd, head.ljust(data_offset, b"\0"), 0)
    with _bar(progress, sum(t.nbytes for _, t in keep), f"copying {src.path.name}") as advance:
        for (_, t), (*_, rel) in zip(keep, infos, strict=True):
            if isinstance(t, S.NewTensor):
                write_array(fd, t.data, data_offset + rel)
            else:
                E.copy_range(src_fd, fd, t.offset, data_offset + rel, t.nbytes)
            advance(t.nbytes)
    end = data_offset + max((rel + t.nbytes for (_, t), (*_, rel) in zip(keep, infos, strict=True)), default=0)
    os.ftruncate(fd, data_offset + pos)
    return end


def check_writable(f: GGUFFile, out: str | os.PathLike | None = None) -> None:
    """Raise the PinferError a later store(f, out) would raise for where it writes, before a long computation."""
    if out is None or A.same_file(f.path, Path(out)):
        A.refuse_installed(f.path)
        if not os.access(f.path, os.W_OK):
            raise PinferError(f"cannot update {f.path} in place: permission denied; write a copy with -o OUT")
        if f.trailing == "foreign":
            raise PinferError(f"{f.path} has bytes after its tensor data that pinfer did not write; it leaves them "
                              f"alone: write a copy with -o OUT")
        if f.trailing == "unknown":
            raise PinferError(f"{f.path} has tensors of a type pinfer does not know; write a copy with -o OUT")
        return
    out = Path(out)
    if out.is_dir():
        raise PinferError(f"{out}: is a directory; give a file name to write")
    if not out.parent.is_dir():
        raise PinferError(f"cannot write {out}: no such directory {out.parent}")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise PinferError(f"cannot write {out}: permission denied (the directory {out.parent} is not writable)")
    if out.exists():
        A.refuse_installed(out)


def store(f: GGUFFile, out: str | os.PathLike | None = None, *, close: bool = False, **changes) -> Path:
    """Store changes into `f` in place (out None, or f's own file) or into a copy at `out`.

    close: the caller is done with `f`; in place, it is closed first, so that the section it read (pinned while it
    is open) can be freed by this very write instead of the next one."""
    if out is None or A.same_file(f.path, Path(out)):
        if close:
            f.close()
        return update_model(f.path, expect=f, **changes)
    return write_copy(f, out, **changes)


def rewrite_gguf(src: GGUFFile, dest: str | os.PathLike | None = None, *, set_metadata: dict[str, Any] | None = None,
                 set_tensors: dict[str, np.ndarray | RawTensor] | None = None, drop_keys=(), drop_tensors=(),
                 progress: bool = True) -> Path:
    """Store metadata and tensors into `src` in place (dest None or src itself: formats.update.update_model), or
    write a copy of it with them at `dest` (formats.update.write_copy). Kept for callers of the old name."""
    if dest is None or A.same_file(src.path, Path(dest)):
        return update_model(src.path, set_metadata=set_metadata, set_tensors=set_tensors, drop_keys=drop_keys,
                            drop_tensors=drop_tensors, expect=src, progress=progress)
    return write_copy(src, dest, set_metadata=set_metadata, set_tensors=set_tensors, drop_keys=drop_keys,
                      drop_tensors=drop_tensors, progress=progress)
