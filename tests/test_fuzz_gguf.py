"""Mutated files: every one either opens (and then its config and every tensor read) or fails with one PinferError
line; never another exception, never a hang. Deterministic: fixed seeds, a fixed number of mutations."""

import signal
import struct

import numpy as np
import pytest

from pinfer_llm.formats import constants as C
from pinfer_llm.formats import section as S
from pinfer_llm.formats.config import config_from_gguf
from pinfer_llm.formats.errors import PinferError
from pinfer_llm.formats.gpuidx import read_gpuidx, write_gpuidx
from pinfer_llm.formats.reader import open_gguf
from pinfer_llm.formats.update import update_model
from tests.tiny import write_tiny

N_MUTATIONS = 100  # per base file


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang()


def probe(path) -> str:
    """Everything a user's first command does with a file; returns "ok" or the PinferError's message."""
    try:
        f = open_gguf(path)
        for name in f.tensors:
            np.asarray(f.raw(name)).view(np.uint8).sum()  # touch every byte: never past the end of the file
        if f.architecture == C.GPU_INDEX_ARCH:
            read_gpuidx(path)
        elif f.architecture:
            config_from_gguf(f)
        return "ok"
    except PinferError as e:
        assert "\n" not in str(e)
        return str(e)


FUZZ_KINDS = ("flip", "extreme", "truncate", "shift", "scatter", "section")


def mutation(kind: int, i: int, data: bytes, rng: np.random.Generator, header_end: int, section_at: int | None):
    """One mutation of `data` (description, mutated bytes) of kind FUZZ_KINDS[kind]: flipped header bytes, an extreme
    integer in the header, a truncation, bytes inserted or removed in the header, random bytes anywhere, damage after
    the model (its section's directory, slots and blob). benchmarks/hostile_pass.py runs these through the CLIs."""
    extremes = [0, 1, 2**31, 2**32 - 1, 2**32, 2**63, 2**64 - 1, len(data), len(data) * 8, 17]
    b = bytearray(data)
    if kind == 0:  # flipped bytes in the header
        for _ in range(int(rng.integers(1, 8))):
            b[int(rng.integers(0, header_end))] ^= int(rng.integers(1, 256))
        return f"flip header #{i}", bytes(b)
    if kind == 1:  # an extreme u64 or u32 somewhere in the header
        at = int(rng.integers(4, header_end - 8))
        v = extremes[int(rng.integers(0, len(extremes)))]
        if rng.random() < 0.5:
            b[at:at + 8] = struct.pack("<Q", v % 2**64)
        else:
            b[at:at + 4] = struct.pack("<I", v % 2**32)
        return f"integer {v} at {at} #{i}", bytes(b)
    if kind == 2:  # truncated
        cut = int(rng.integers(0, len(data)))
        return f"truncated at {cut} #{i}", bytes(b[:cut])
    if kind == 3:  # bytes inserted or removed inside the header
        at = int(rng.integers(0, header_end))
        n = int(rng.integers(1, 16))
        if rng.random() < 0.5:
            return f"insert {n} at {at} #{i}", bytes(b[:at] + rng.bytes(n) + b[at:])
        return f"remove {n} at {at} #{i}", bytes(b[:at] + b[at + n:])
    if kind == 4:  # random bytes anywhere
        for _ in range(int(rng.integers(1, 32))):
            b[int(rng.integers(0, len(b)))] = int(rng.integers(0, 256))
        return f"scatter #{i}", bytes(b)
    # the section: its directory, slots and blob
    if section_at is None:
        at = int(rng.integers(header_end, len(b)))
    else:
        at = int(rng.integers(section_at, len(b)))
    if rng.random() < 0.5:
        b[at] ^= int(rng.integers(1, 256))
    else:
        at = min(at, len(b) - 8)
        b[at:at + 8] = struct.pack("<Q", extremes[int(rng.integers(0, len(extremes)))] % 2**64)
    return f"section byte {at} #{i}", bytes(b)


def mutations(data: bytes, rng: np.random.Generator, header_end: int, section_at: int | None):
    """N_MUTATIONS (description, mutated bytes), the kinds in turn."""
    for i in range(N_MUTATIONS):
        yield mutation(i % len(FUZZ_KINDS), i, data, rng, header_end, section_at)


def base_files(tmp_path):
    plain = tmp_path / "plain.gguf"
    write_tiny(plain)
    update_model(plain, set_metadata={"pinfer.activation.tokens": np.uint64(10), "pinfer.x": ["a", "b"]},
                 set_tensors={"blk.0.act_counts": np.arange(64, dtype=np.float32)}, drop_keys=["general.name"])
    pwri = tmp_path / "pwri.gguf"
    write_tiny(pwri, powerinfer=True)
    gpuidx = tmp_path / "m.gpuidx"
    write_gpuidx(gpuidx, [np.array([1, 0] * 32, np.int32), np.zeros(64, np.int32)], None, 12345)
    return [plain, pwri, gpuidx]


@pytest.mark.parametrize("which", [0, 1, 2])
def test_mutated_files_open_or_fail_cleanly(tmp_path, which):
    path = base_files(tmp_path)[which]
    data = path.read_bytes()
    f = open_gguf(path)
    header_end = min(f.data_offset, len(data))
    section_at = S.dir_offset(f.data_end) if f.trailing == "section" else None
    del f
    rng = np.random.default_rng(1234 + which)
    outcomes = {"ok": 0, "error": 0}
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for desc, mutated in mutations(data, rng, header_end, section_at):
            target = tmp_path / "mut.gguf"
            target.write_bytes(mutated)
            signal.alarm(10)
            try:
                result = probe(target)
            except Hang:
                pytest.fail(f"{desc}: no answer in 10 s")
            except Exception as e:  # noqa: BLE001 - the point of the test
                pytest.fail(f"{desc}: {type(e).__name__}: {e}")
            finally:
                signal.alarm(0)
            outcomes["ok" if result == "ok" else "error"] += 1
    finally:
        signal.signal(signal.SIGALRM, old)
    assert outcomes["ok"] + outcomes["error"] == N_MUTATIONS
    assert outcomes["error"] > N_MUTATIONS // 4  # the mutations do damage


def test_extreme_slot_fields_are_ignored_or_refused(tmp_path):
    """Every field of both directory slots set to boundary values: the file opens (the slot is ignored) or fails
    with a PinferError; a slot is never followed outside the file."""
    path = base_files(tmp_path)[0]
    data = path.read_bytes()
    d = S.dir_offset(open_gguf(path).data_end)
    values = [0, 1, 4096, 2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1, len(data), d, d + C.SECTION_DIR_SIZE]
    for slot in S.SLOT_OFFSETS:
        for field in range(4):
            for v in values:
                b = bytearray(data)
                at = d + slot + 8 * field
                b[at:at + 8] = struct.pack("<Q", v)
                (tmp_path / "mut.gguf").write_bytes(bytes(b))
                probe(tmp_path / "mut.gguf")
