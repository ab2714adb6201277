"""Text files a user names on the command line (pi-run -f and --perplexity, pi-profile --corpus, pi-plan --hw), read
in one checked step, so that every kind of path gives one line rather than a hang, an exhausted memory or a message
that names the wrong problem:

- a directory, a missing or unreadable path: one line each;
- a FIFO is opened without waiting for a writer (a plain open() waits forever when there is none, as the model's
  FIFO once did): one with a writer, such as bash's `<(command)`, is then read to its end as usual; one that nobody
  writes to reads as empty, and says so;
- a device or another stream (/dev/zero, /dev/urandom, `<(yes)`) is read to at most STREAM_LIMIT bytes, and a
  regular file to its size: bounded by what it holds;
- NUL bytes (a binary file, /dev/zero) are refused as soon as the chunk holding one is read, not after the whole
  file: `-f model.gguf` fails at its first MiB;
- bytes that are not UTF-8 are refused with the offset of the first one (or replaced, when not strict).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from pinfer_llm.formats.errors import PinferError

CHUNK = 1 << 20
STREAM_LIMIT = 256 << 20  # of a pipe or device: more than any prompt, corpus file or machine file needs


def read_text(path: str | os.PathLike, what: str, *, strict: bool = True) -> str:
    """The text of the file at `path`, or a PinferError naming the problem; `what` names the file in messages
    ("prompt file", "corpus file", "--hw file")."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise PinferError(f"{path}: no such {what}") from None
    except IsADirectoryError:
        raise PinferError(f"{path}: is a directory, not a {what}") from None
    except PermissionError:
        raise PinferError(f"{path}: permission denied (cannot read the {what})") from None
    except OSError as e:
        raise PinferError(f"{path}: cannot open the {what} ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise PinferError(f"{path}: is a directory, not a {what}")
        if stat.S_ISBLK(st.st_mode):
            raise PinferError(f"{path}: is a block device, not a {what}")
        regular = stat.S_ISREG(st.st_mode) and st.st_size > 0  # /proc's files say 0 bytes: read as streams
        os.set_blocking(fd, True)  # opened: now wait for a FIFO's writer's data as any read does
        data = _read(fd, path, what, st.st_size if regular else STREAM_LIMIT, regular)
    finally:
        os.close(fd)
    if not data and stat.S_ISFIFO(st.st_mode):
        raise PinferError(f"{path}: is a FIFO and nothing was written to it (no process had it open for writing); "
                          f"start the writer first, or give a regular {what}")
    try:
        return data.decode("utf-8", errors="strict" if strict else "replace")
    except UnicodeDecodeError as e:
        raise PinferError(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); save the "
                          f"{what} as UTF-8") from None


def _read(fd: int, path: Path, what: str, limit: int, regular: bool) -> bytes:
    parts, n = [], 0
    while True:
        try:
            chunk = os.read(fd, CHUNK)
        except OSError as e:
            if e.errno == errno.EISDIR:
                raise PinferError(f"{path}: is a directory, not a {what}") from None
            raise PinferError(f"{path}: cannot read the {what} ({e.strerror})") from None
        if not chunk:
            return b"".join(parts)
        if b"\0" in chunk:
            raise PinferError(f"{path}: a binary file (it holds NUL bytes), not text; give a {what} in UTF-8")
        parts.append(chunk)
        n += len(chunk)
        if n > limit:
            if regular:  # it grew while being read: what it held when opened is what is read
                return b"".join(parts)[:limit]
            raise PinferError(f"{path}: more than {STREAM_LIMIT >> 20} MiB from a pipe or device, without an end; "
                              f"give a regular {what}")
