"""Writing whole GGUF and PowerInfer (PWRI) files, atomically; the GGUF encoder the section writer shares.

A PowerInfer file is a GGUF v3 file whose first four bytes are b"PWRI" and whose tensor type ids are PowerInfer's
(constants.POWERINFER_TYPE_IDS: its I32 is 18, today's ggml's is 26). write_gguf maps types accordingly and refuses
what PowerInfer's loader cannot take (types it lacks, arrays of arrays).

A whole file is written into an unnamed temporary file in the destination directory (Linux O_TMPFILE), fsynced,
given a name (linkat through /proc/self/fd) and renamed over the destination. A kill -9 at any point leaves the
destination as it was and, before the link, nothing else: the unnamed file vanishes with the process. Between link
and rename, or where O_TMPFILE is unsupported (a named temporary `.NAME.pinfer.HOST.PID.RANDOM.tmp` is used
instead), a kill -9 leaves a temporary whose process is dead; the next write of that file removes it. SIGTERM is
turned into an exception for the duration of a write, so it cleans up as Ctrl-C does. Updating an existing model in
place (a few MB of statistics or a plan) does not come through here: see formats/update.py.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import signal
import socket
import struct
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType
from gguf.constants import GGMLQuantizationType

from . import constants as C
from .errors import PinferError, Terminated
from .reader import GGUFFile, tensor_nbytes

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
_STRING, _ARRAY = 8, 9
_DTYPE_TO_GGML = {np.dtype(np.float32): GGMLQuantizationType.F32, np.dtype(np.float16): GGMLQuantizationType.F16,
                  np.dtype(np.float64): GGMLQuantizationType.F64, np.dtype(np.int8): GGMLQuantizationType.I8,
                  np.dtype(np.int16): GGMLQuantizationType.I16, np.dtype(np.int32): GGMLQuantizationType.I32,
                  np.dtype(np.int64): GGMLQuantizationType.I64}
_TO_POWERINFER = {v: k for k, v in C.POWERINFER_TYPE_IDS.items()}
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


# --- the encoder --------------------------------------------------------------------------------------------------

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


# --- whole files --------------------------------------------------------------------------------------------------

def write_gguf(path: str | os.PathLike, metadata: dict[str, Any], tensors: dict[str, np.ndarray | RawTensor], *,
               value_types: dict[str, tuple[int, int | None]] | None = None, powerinfer: bool = False,
               alignment: int = C.DEFAULT_ALIGNMENT, progress: bool = False) -> Path:
    """Write a GGUF (or PWRI) file atomically.

    metadata must hold general.architecture (written first). Value types are inferred from Python/numpy types unless
    given in value_types (a rewrite passes the source file's types so that nothing changes type). Plain arrays are
    written as their dtype (float32 -> F32, float16 -> F16, int32 -> I32); RawTensor carries any ggml type through.
    """
    path = Path(path)
    arch = metadata.get(C.ARCHITECTURE)
    if not arch:
        raise ValueError("metadata needs general.architecture")
    value_types = dict(value_types or {})
    meta = {C.ARCHITECTURE: arch}
    meta.update((k, v) for k, v in metadata.items() if k not in (C.ARCHITECTURE, C.ALIGNMENT))
    value_types.pop(C.ALIGNMENT, None)
    if powerinfer:
        check_powerinfer_metadata(meta, value_types)
    items = []
    pos = 0
    for name, t in tensors.items():
        data, ggml_type, ne = as_tensor(name, t)
        stored = powerinfer_type(name, ggml_type) if powerinfer else ggml_type
        items.append((name, ne, stored, pos, data))
        pos += -(-data.nbytes // alignment) * alignment
    head = encode_header(C.PWRI_MAGIC if powerinfer else C.GGUF_MAGIC, meta, value_types,
                         [(n, ne, s, o) for n, ne, s, o, _ in items], alignment)
    data_offset = -(-len(head) // alignment) * alignment
    with atomic_output(path) as fd:
        pwrite_all(fd, head.ljust(data_offset, b"\0"), 0)
        total = sum(d.nbytes for *_, d in items)
        with progress_bar(progress and total > 256 << 20, total, f"writing {path.name}") as advance:
            for _, _, _, off, data in items:
                write_array(fd, data, data_offset + off, advance)
        os.ftruncate(fd, data_offset + pos)  # the last tensor's padding
    return path


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


def copy_range(src_fd: int, dst_fd: int, src_off: int, dst_off: int, n: int) -> None:
    """Copy bytes between files in the kernel (copy_file_range; a plain read/write loop where unsupported)."""
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


# --- failure points (tests install a hook that kills the process at a named point) -----------------------------

hook = None  # callable(name) or None


def checkpoint(name: str) -> None:
    if hook is not None:
        hook(name)


# --- atomic output ------------------------------------------------------------------------------------------------

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
    from . import locks

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


def rewrite_gguf(src: GGUFFile, dest: str | os.PathLike | None = None, *, set_metadata: dict[str, Any] | None = None,
                 set_tensors: dict[str, np.ndarray | RawTensor] | None = None, drop_keys=(), drop_tensors=(),
                 progress: bool = True) -> Path:
    """Store metadata and tensors into `src` in place (dest None or src itself: formats.update.update_model), or
    write a copy of it with them at `dest` (formats.update.write_copy). Kept for callers of the old name."""
    from .update import update_model, write_copy

    if dest is None or same_file(src.path, Path(dest)):
        return update_model(src.path, set_metadata=set_metadata, set_tensors=set_tensors, drop_keys=drop_keys,
                            drop_tensors=drop_tensors, expect=src, progress=progress)
    return write_copy(src, dest, set_metadata=set_metadata, set_tensors=set_tensors, drop_keys=drop_keys,
                      drop_tensors=drop_tensors, progress=progress)


def same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
