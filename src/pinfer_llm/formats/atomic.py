"""Files that are never left half-written: a write goes into a temporary file in the destination's directory and is
renamed over the destination only when complete (formats/writer.py, formats/update.py's copies, pi-plan's outputs).

A whole file is written into an unnamed temporary file in the destination directory (Linux O_TMPFILE), fsynced,
given a name (linkat through /proc/self/fd) and renamed over the destination. A kill -9 at any point leaves the
destination as it was and, before the link, nothing else: the unnamed file vanishes with the process. Between link
and rename, or where O_TMPFILE is unsupported (a named temporary `.NAME.pinfer.HOST.PID.RANDOM.tmp` is used
instead), a kill -9 leaves a temporary whose process is dead; the next write of that file removes it. SIGTERM is
turned into an exception for the duration of a write, so it cleans up as Ctrl-C does.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import signal
import socket
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from pinfer_llm.formats.errors import PinferError, Terminated

_HOST = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"


USE_O_TMPFILE = hasattr(os, "O_TMPFILE") and sys.platform.startswith("linux")


def temp_name(dest: Path) -> str:
    base = dest.name if len(dest.name) <= 160 else dest.name[:160]
    return f".{base}.pinfer.{_HOST}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(dest: Path, min_age_legacy: float = 3600.0) -> list[Path]:
    """Delete the temporaries earlier writes of `dest` left behind when killed: ours when their process (on this
    host) is gone, and those of pinfer versions before 0.2 (`.NAME.XXXXXXXX.tmp`, no process recorded) once they
    are an hour old. Returns what was removed."""
    base = re.escape(dest.name if len(dest.name) <= 160 else dest.name[:160])
    ours = re.compile(rf"^\.{base}\.pinfer\.([A-Za-z0-9]+)\.(\d+)\.[0-9a-f]+\.tmp$")
    legacy = re.compile(rf"^\.{re.escape(dest.name)}\.[A-Za-z0-9_]{{8}}\.tmp$")
    removed = []
    try:
        entries = list(os.scandir(dest.parent))
    except OSError:
        return removed
    uid = os.getuid()
    for e in entries:
        m = ours.match(e.name)
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid != uid or not e.is_file(follow_symlinks=False):
            continue
        stale = (m is not None and m.group(1) == _HOST and int(m.group(2)) != os.getpid()
                 and not _pid_alive(int(m.group(2))))
        stale = stale or (m is None and legacy.match(e.name) is not None and time.time() - st.st_mtime > min_age_legacy)
        if stale:
            with contextlib.suppress(OSError):
                os.unlink(e.path)
                removed.append(Path(e.path))
    return removed


def installed_package_dir(path: Path) -> Path | None:
    """The installed-packages directory (site-packages, dist-packages) `path` lies in, if any."""
    try:
        real = path.resolve()
    except OSError:
        return None
    roots = set()
    for key in ("purelib", "platlib"):
        with contextlib.suppress(KeyError, OSError):
            roots.add(Path(sysconfig.get_paths()[key]).resolve())
    for root in roots:
        if real.is_relative_to(root):
            return root
    for parent in real.parents:
        if parent.name in ("site-packages", "dist-packages"):
            return parent
    return None


def refuse_installed(path: Path) -> None:
    root = installed_package_dir(path)
    if root is not None:
        raise PinferError(f"{path} is inside an installed package ({root}); pinfer will not rewrite it: write a copy "
                          f"with -o OUT")


_REASONS = {errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
            errno.EROFS: "read-only file system", errno.ENOSPC: "no space left on the device",
            errno.EDQUOT: "disk quota exceeded", errno.ENOENT: "no such file or directory",
            errno.ENOTDIR: "a parent is not a directory", errno.ENAMETOOLONG: "file name too long",
            errno.EISDIR: "is a directory", errno.EFBIG: "file too large for the file system",
            errno.ETXTBSY: "the file is busy"}


def os_reason(e: OSError) -> str:
    return _REASONS.get(e.errno, e.strerror or str(e))


def os_error(e: OSError, path: Path, doing: str) -> PinferError:
    """A one-line error for a file-system failure the user can fix, naming the file they asked for (never a
    temporary)."""
    return PinferError(f"cannot {doing} {path}: {os_reason(e)}")


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises Terminated (a KeyboardInterrupt) instead of killing the process outright, so
    cleanup runs as it does for Ctrl-C. Only in the main thread, and only where SIGTERM has its default action."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def raise_terminated(signum, frame):
        raise Terminated()

    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _open_temp(dest: Path) -> tuple[int, Path | None]:
    """(fd, named path or None) of a new temporary file beside dest: unnamed (O_TMPFILE) where possible."""
    if USE_O_TMPFILE:
        try:
            return os.open(dest.parent, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600), None
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                raise
    tmp = dest.parent / temp_name(dest)
    return os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), tmp


def _fsync_dir(d: Path) -> None:
    with contextlib.suppress(OSError):
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


@contextlib.contextmanager
def atomic_output(dest: str | os.PathLike, *, lock: bool = True) -> Iterator[int]:
    """Yield a descriptor of a new file that replaces `dest` (with dest's permissions) only when the block succeeds.

    An existing dest is locked (its writer lock, formats/locks.py) for the whole write, so an in-place update of dest
    is never lost by racing the rename: it waits, then finds the new file. Stale temporaries of dest are removed
    first."""
    from pinfer_llm.formats import locks

    dest = Path(dest)
    if dest.is_dir():
        raise PinferError(f"{dest}: is a directory; give a file name to write")
    if not dest.parent.exists():
        raise PinferError(f"cannot write {dest}: no such directory {dest.parent}")
    if dest.exists():
        refuse_installed(dest)
    remove_stale_temporaries(dest)
    with terminate_as_interrupt():
        lock_fd = dir_fd = -1
        if lock and dest.exists():  # in-place writers of dest wait, then find the new file and merge into it
            with contextlib.suppress(OSError):
                lock_fd = os.open(dest, os.O_RDWR | os.O_CLOEXEC)
                locks.lock_writer(lock_fd)
        try:
            fd, tmp = _open_temp(dest)
        except OSError as e:
            if lock_fd >= 0:
                os.close(lock_fd)
            raise os_error(e, dest, "write") from None
        linked: Path | None = tmp
        try:
            checkpoint("temp-created")
            yield fd
            checkpoint("written")
            os.fsync(fd)
            os.fchmod(fd, _dest_mode(dest))
            checkpoint("synced")
            dir_fd = os.open(dest.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            if tmp is None:
                # linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N names the unnamed file (passing a dir_fd makes
                # Python call linkat rather than link, which would not follow the /proc link)
                linked = dest.parent / temp_name(dest)
                os.link(f"/proc/self/fd/{fd}", linked.name, dst_dir_fd=dir_fd, follow_symlinks=True)
                checkpoint("linked")
            os.replace(linked.name, dest.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            linked = None
            checkpoint("renamed")
            with contextlib.suppress(OSError):
                os.fsync(dir_fd)
        except OSError as e:
            raise os_error(e, dest, "write") from None
        finally:
            os.close(fd)
            for extra in (lock_fd, dir_fd):
                if extra >= 0:
                    os.close(extra)
            if linked is not None:
                with contextlib.suppress(OSError):
                    os.unlink(linked)


def _dest_mode(dest: Path) -> int:
    try:
        return dest.stat().st_mode & 0o7777  # keep the original's permissions
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask  # a new file gets the usual 0666 less the umask


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `dest` for code that writes by name; on success fsync it and rename it over
    `dest`, else delete it. (Prefer atomic_output, whose temporary has no name until it is complete.)"""
    dest = Path(dest)
    if dest.is_dir():
        raise PinferError(f"{dest}: is a directory; give a file name to write")
    if not dest.parent.exists():
        raise PinferError(f"cannot write {dest}: no such directory {dest.parent}")
    remove_stale_temporaries(dest)
    tmp = dest.parent / temp_name(dest)
    with terminate_as_interrupt():
        try:
            os.close(os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
        except OSError as e:
            raise os_error(e, dest, "write") from None
        try:
            yield tmp
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.chmod(tmp, _dest_mode(dest))
            os.replace(tmp, dest)
            _fsync_dir(dest.parent)
        except OSError as e:
            raise os_error(e, dest, "write") from None
        finally:
            tmp.unlink(missing_ok=True)


def same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


# Failure points: tests install a hook that kills the process at a named step of a write (tests/test_kill_writers.py).
hook = None  # callable(name) or None


def checkpoint(name: str) -> None:
    if hook is not None:
        hook(name)
