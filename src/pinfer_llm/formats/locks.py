"""Locks that let pinfer's writers of one model exclude each other and leave its readers' bytes alone.

Linux open-file-description (OFD) byte-range locks, taken in a lock space above any real file offset (they guard
nothing by themselves; every pinfer reader and writer agrees on what they mean):
- the writer lock: one byte at WRITER_LOCK; every pinfer writer of a model holds it exclusively while it writes, so
  writers queue instead of overwriting each other's work.
- pins: a reader that uses pinfer's section holds shared locks on PIN_BASE + [each byte range the section uses],
  for as long as its GGUFFile is open. A writer reuses or frees bytes after the model's data (an old section's)
  only once it holds exclusive locks on exactly those ranges, which no pin overlaps.
OFD locks belong to an open file, not a process, so two GGUFFiles of one process pin independently and closing an
unrelated descriptor of the same file releases nothing (POSIX process locks would). Without OFD locks (not Linux),
writers exclude each other with flock() and never reuse bytes (sections are only appended).
Readers never wait: a pin is taken without blocking, and a reader that cannot pin a section re-reads which one is
current (see section.attach_section).
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct

PIN_BASE = 1 << 62  # lock space: PIN_BASE + file offset
WRITER_LOCK = PIN_BASE - 4096

_F_RDLCK, _F_WRLCK, _F_UNLCK = fcntl.F_RDLCK, fcntl.F_WRLCK, fcntl.F_UNLCK
_OFD = hasattr(fcntl, "F_OFD_SETLK")
_ofd_works: bool | None = None


def _flock(ltype: int, start: int, length: int) -> bytes:
    # struct flock on Linux (x86_64, aarch64): short l_type, short l_whence, off_t l_start, off_t l_len, pid_t l_pid
    # (0 for OFD locks), padded to 32 bytes.
    return struct.pack("hhqqi4x", ltype, os.SEEK_SET, start, length, 0)


def _ofd(fd: int, cmd: int, ltype: int, start: int, length: int) -> bool:
    """Apply one OFD lock command; False when another holder conflicts (non-blocking commands only)."""
    try:
        fcntl.fcntl(fd, cmd, _flock(ltype, start, length))
        return True
    except (BlockingIOError, PermissionError):
        return False


def ofd_available(fd: int) -> bool:
    """Whether OFD locks work here (the constants exist and the kernel accepts them), tested once per process."""
    global _ofd_works
    if _ofd_works is None:
        if not _OFD:
            _ofd_works = False
        else:
            try:
                fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(_F_RDLCK, WRITER_LOCK, 1))
                _ofd_works = True
            except OSError:
                _ofd_works = False
    return _ofd_works


def lock_writer(fd: int) -> None:
    """Block until this descriptor (opened for writing) holds the model's writer lock. OSError when the file system
    has no locks at all."""
    if ofd_available(fd):
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, _flock(_F_WRLCK, WRITER_LOCK, 1))
            return
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP):
                raise
    fcntl.flock(fd, fcntl.LOCK_EX)


def _lock_each(fd: int, ranges: list[tuple[int, int]], kind: int) -> list[tuple[int, int]] | None:
    """Locks of `kind` on the pin space of each non-empty range: the ranges locked, or None, holding nothing, when
    another descriptor holds a conflicting lock. OSError (no byte-range locks here) propagates, holding nothing."""
    taken: list[tuple[int, int]] = []
    try:
        for lo, hi in ranges:
            if hi <= lo:
                continue
            if not _ofd(fd, fcntl.F_OFD_SETLK, kind, PIN_BASE + lo, hi - lo):
                release(fd, taken)
                return None
            taken.append((lo, hi))
    except OSError:
        release(fd, taken)
        raise
    return taken


def reserve(fd: int, ranges: list[tuple[int, int]]) -> bool:
    """Exclusive locks on the pin space of these byte ranges: True when no reader pins any of them (they may then be
    overwritten or freed until release()). False, holding nothing, otherwise or without OFD locks."""
    if not ofd_available(fd):
        return False
    try:
        return _lock_each(fd, ranges, _F_WRLCK) is not None
    except OSError:  # a file system without byte-range locks: never reuse bytes there
        return False


def free_parts(fd: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of [lo, hi) that no other descriptor pins or reserves right now, in order (F_OFD_GETLK names one
    conflicting lock at a time: the range is split around each). Without OFD locks: none (bytes are never reused).
    A writer still reserves what it uses: a reader may pin a part after this answer."""
    if hi <= lo or not ofd_available(fd):
        return []
    held: list[tuple[int, int]] = []
    todo = [(lo, hi)]
    while todo:
        a, b = todo.pop()
        try:
            got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(_F_WRLCK, PIN_BASE + a, b - a))
        except OSError:
            return []
        ltype, _, start, length, _ = struct.unpack("hhqqi4x", got)
        if ltype == _F_UNLCK:
            continue
        c, d = max(start - PIN_BASE, a), b if length == 0 else min(start - PIN_BASE + length, b)
        held.append((c, d))
        todo += [(x, y) for x, y in ((a, c), (d, b)) if y > x]
    out, pos = [], lo
    for c, d in sorted(held):
        if c > pos:
            out.append((pos, c))
        pos = max(pos, d)
    if pos < hi:
        out.append((pos, hi))
    return out


def release(fd: int, ranges: list[tuple[int, int]]) -> None:
    if not ofd_available(fd):
        return
    for lo, hi in ranges:
        if hi > lo:
            try:
                fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(_F_UNLCK, PIN_BASE + lo, hi - lo))
            except OSError:
                pass


def pin(fd: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """Shared locks on these byte ranges through `fd`, held until released or the descriptor is closed: the ranges
    pinned (empty where locks are unavailable), or None when a writer is freeing one of them right now (the caller
    then re-reads which section is current)."""
    if not ofd_available(fd):
        return []
    try:
        return _lock_each(fd, ranges, _F_RDLCK)
    except OSError:  # no byte-range locks on this file system: writers there cannot reuse bytes either
        return []
