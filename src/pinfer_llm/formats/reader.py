"""Opening a GGUF or PWRI file: map it, parse its header (formats/header.py) and attach pinfer's section
(formats/section.py) when one follows the tensor data. The one entry point every reader of a model file goes through.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat
import weakref
from pathlib import Path

from pinfer_llm.formats import constants as C
from pinfer_llm.formats import schema
from pinfer_llm.formats import section as S
from pinfer_llm.formats.errors import PinferError
from pinfer_llm.formats.header import GGUFFile, data_end, parse_header, tensor_infos


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse a GGUF or PWRI file's header and pinfer's section. Tensor data stays on disk until a view is touched.

    The returned object keeps the file open (one descriptor, closed by close() or when the object is collected):
    its map is made from that descriptor, and through it the object pins the section's bytes (formats/locks.py)."""
    path = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever (it is refused below)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise PinferError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise PinferError(f"{path}: is a directory, expected a .gguf file") from None
    except PermissionError:
        raise PinferError(f"{path}: permission denied (cannot read it)") from None
    except OSError as e:
        raise PinferError(f"{path}: cannot open it ({e.strerror})") from None
    f = None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise PinferError(f"{path}: is a directory, expected a .gguf file")
        if not stat.S_ISREG(st.st_mode):
            kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device"
            raise PinferError(f"{path}: is {kind}, not a file: give the path of a .gguf file (models are mapped, "
                              f"not streamed)")
        size = st.st_size
        if size < 24:
            raise PinferError(f"{path}: not a GGUF file ({size} bytes is too short for a header)")
        try:
            buf = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EPERM):
                raise PinferError(f"{path}: permission denied (cannot read it)") from None
            raise PinferError(f"{path}: cannot map it ({e.strerror})") from None
        try:
            f = parse_file(buf, path, size, fd)
            f._fd = fd
            f._closer = weakref.finalize(f, os.close, fd)
            if f.trailing == "section":
                S.attach_section(f, buf, fd)
        finally:
            buf.close()
    except BaseException:
        if f is not None and f._closer is not None:
            f._closer()
        else:
            os.close(fd)
        raise
    return f


def parse_file(buf, path: Path, size: int, fd: int | None = None) -> GGUFFile:
    """The header alone: metadata, tensor infos, where the data ends and what follows it (read with pread through
    `fd` when given: it is often a hole)."""
    h = parse_header(buf, path, 0, size)
    bad = schema.problems(h.metadata)
    if bad:
        raise PinferError(f"{path}: {bad[0]}; the file is corrupt")
    legacy: list[str] = []
    powerinfer = h.magic == C.PWRI_MAGIC
    tensors = tensor_infos(h, path, powerinfer, legacy, size)
    end = data_end(h, tensors)
    f = GGUFFile(path, h.magic, h.version, dict(h.metadata), dict(h.value_types), dict(tensors), h.alignment,
                 h.data_offset, size, h.metadata, h.value_types, tensors, end)
    f.legacy_types = legacy
    if legacy:
        f.warnings.append(f"{path}: {len(legacy)} plan tensors use today's ggml type ids in a PWRI file (written by "
                          f"an earlier pinfer); PowerInfer cannot load it: write a copy with pi-plan -o")
    f.trailing = S.classify_trailing(buf, size, end, fd)
    return f


TMPFS_MAGIC = 0x01021994


def _fs_type(fd: int) -> int | None:
    """statfs's f_type (the first field of struct statfs on Linux), or None where it cannot be read."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)
        if libc.fstatfs(fd, buf) != 0:
            return None
        return ctypes.c_long.from_buffer(buf).value
    except (OSError, AttributeError):
        return None


def check_mappable(f: GGUFFile) -> None:
    """Refuse a file whose tensor data the memory map cannot read: on a tmpfs, a read fault in a hole (a sparse copy,
    `cp --sparse=always`) must allocate a page, and on a full tmpfs that is a SIGBUS (rc 135) no Python code can
    catch. Elsewhere a hole maps the zero page, so only tmpfs is checked: its holes against its free space."""
    fd = f.fileno()
    if _fs_type(fd) != TMPFS_MAGIC:
        return
    from pinfer_llm.formats.encoder import data_segments

    mapped = [(f.data_offset, f.data_end if f.data_end is not None else f.file_size)]
    mapped += [(t.offset, t.offset + t.nbytes) for t in f.tensors.values()
               if t.part == "section" and t.nbytes >= C.SECTION_SMALL_TENSOR]  # smaller ones are read with pread
    holes = sum(hi - lo - sum(b - a for a, b in data_segments(fd, lo, hi)) for lo, hi in mapped)
    free = os.fstatvfs(fd).f_bavail * os.fstatvfs(fd).f_frsize
    if holes > free:
        raise PinferError(f"{f.path}: {holes / 2**20:.1f} MiB of its tensor data are holes on a tmpfs with "
                          f"{free / 2**20:.1f} MiB free: reading them through the memory map would crash (SIGBUS); "
                          f"free space there, or copy the file without holes (cp --sparse=never)")

