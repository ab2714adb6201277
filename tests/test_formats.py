"""GGUF/PWRI reading and writing: round trips, PowerInfer's type ids, what other readers see."""

import os
import struct

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType as T

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.config import config_from_gguf
from pinfer_llm.formats.encoder import RawTensor
from pinfer_llm.formats.errors import PinferError
from pinfer_llm.formats.reader import open_gguf
from pinfer_llm.formats.update import rewrite_gguf
from pinfer_llm.formats.writer import write_gguf
from tests.tiny import write_tiny


def stored_type_ids(path) -> dict[str, int]:
    """Tensor name -> type id as stored in the file, parsed independently of formats.reader."""
    data = open(path, "rb").read()
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string():
        nonlocal pos
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n
        return data[pos - n:pos].decode()

    def skip_value(vt):
        nonlocal pos
        sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
        if vt in sizes:
            pos += sizes[vt]
        elif vt == 8:
            string()
        else:
            sub, n = struct.unpack_from("<IQ", data, pos)
            pos += 12
            for _ in range(n):
                skip_value(sub)

    for _ in range(n_kv):
        string()
        (vt,) = struct.unpack_from("<I", data, pos)
        pos += 4
        skip_value(vt)
    out = {}
    for _ in range(n_tensors):
        name = string()
        (nd,) = struct.unpack_from("<I", data, pos)
        pos += 4 + 8 * nd
        out[name], _ = struct.unpack_from("<IQ", data, pos)
        pos += 12
    return out


def test_roundtrip_metadata_and_tensors(tmp_path):
    meta = {C.ARCHITECTURE: "llama", "x.u32": 7, "x.f32": 1.5, "x.str": "héllo", "x.strs": ["a", "b", "ç"],
            "x.i32s": np.arange(4, dtype=np.int32), "x.u64": np.uint64(2**40), "x.bool": True,
            "x.nested": [np.arange(2, dtype=np.uint8), ["s"]]}
    w = np.random.default_rng(0).standard_normal((8, 32)).astype(np.float32)
    write_gguf(tmp_path / "a.gguf", meta, {"w": w, "h": w.astype(np.float16), "i": np.arange(5, dtype=np.int32)})
    f = open_gguf(tmp_path / "a.gguf")
    assert f.magic == b"GGUF" and f.version == 3 and f.section is None and f.trailing == "none"
    assert f.metadata["x.strs"] == ["a", "b", "ç"] and f.metadata["x.str"] == "héllo"
    assert f.metadata["x.u64"] == 2**40 and f.metadata["x.bool"] is True
    assert list(f.metadata["x.i32s"]) == [0, 1, 2, 3]
    assert list(f.metadata["x.nested"][0]) == [0, 1] and f.metadata["x.nested"][1] == ["s"]
    assert np.array_equal(f.raw("w"), w) and f.raw("h").dtype == np.float16
    assert f.info("w").shape == (8, 32) and f.info("w").ne == (32, 8)
    # zero-copy views of a read-only shared map (a copy-on-write map of a file larger than RAM is refused)
    assert np.shares_memory(f.raw("w"), f.mm) and not f.raw("w").flags.writeable
    # standard tools read what we write
    r = GGUFReader(tmp_path / "a.gguf")
    assert {t.name for t in r.tensors} == {"w", "h", "i"}
    assert r.fields["x.str"].contents() == "héllo"
    assert stored_type_ids(tmp_path / "a.gguf")["i"] == T.I32 == 26


def test_pwri_magic_is_read_in_place(tmp_path):
    write_tiny(tmp_path / "m.gguf", powerinfer=True)
    f = open_gguf(tmp_path / "m.gguf")
    assert f.is_powerinfer and f.has(C.tensor(C.FFN_DOWN_T, 0)) and f.has(C.tensor(C.PRED_FC1, 1))
    with pytest.raises(ValueError):  # stock readers refuse it: that is why we parse it ourselves
        GGUFReader(tmp_path / "m.gguf")
    # a copy keeps the magic and the model's bytes; what pinfer adds goes into its section, not the header
    rewrite_gguf(f, tmp_path / "copy.gguf", set_metadata={"x.k": "v"}, progress=False)
    g = open_gguf(tmp_path / "copy.gguf")
    assert g.is_powerinfer and g.get("x.k") == "v" and g.part("x.k") == "section" and "x.k" not in g.header_metadata
    assert (tmp_path / "copy.gguf").read_bytes()[:f.data_end] == (tmp_path / "m.gguf").read_bytes()[:f.data_end]
    write_tiny(tmp_path / "plain.gguf")
    rewrite_gguf(open_gguf(tmp_path / "plain.gguf"), tmp_path / "plain2.gguf", set_metadata={"x.k": "v"},
                 progress=False)
    r = GGUFReader(tmp_path / "plain2.gguf")  # standard tools read the copy, and see the model as it was
    assert "x.k" not in r.fields
    assert {t.name for t in r.tensors} == set(open_gguf(tmp_path / "plain.gguf").tensors)
    assert open_gguf(tmp_path / "plain2.gguf").get("x.k") == "v"


def test_gguf_v2_is_read(tmp_path):
    write_tiny(tmp_path / "m.gguf")
    data = bytearray((tmp_path / "m.gguf").read_bytes())
    data[4:8] = (2).to_bytes(4, "little")  # v2 and v3 share this layout (v3 added big-endian files)
    (tmp_path / "v2.gguf").write_bytes(bytes(data))
    f = open_gguf(tmp_path / "v2.gguf")
    assert f.version == 2 and config_from_gguf(f).n_layer == 2


def test_unsupported_version(tmp_path):
    write_tiny(tmp_path / "m.gguf")
    data = bytearray((tmp_path / "m.gguf").read_bytes())
    data[4:8] = (1).to_bytes(4, "little")
    (tmp_path / "v1.gguf").write_bytes(bytes(data))
    with pytest.raises(PinferError, match="version 1"):
        open_gguf(tmp_path / "v1.gguf")


def test_updates_preserve_quantised_tensors_and_types(tmp_path):
    from gguf import quants

    a = np.random.default_rng(2).standard_normal((16, 64)).astype(np.float32)
    q = quants.quantize(a, T.Q5_1)
    write_gguf(tmp_path / "a.gguf", {C.ARCHITECTURE: "llama", "k.u8": np.uint8(3)},
               {"q": RawTensor(q, T.Q5_1, a.shape)})
    f = open_gguf(tmp_path / "a.gguf")
    rewrite_gguf(f, set_tensors={"new": np.ones(3, np.float32)}, drop_keys={"k.u8"}, progress=False)
    g = open_gguf(tmp_path / "a.gguf")
    assert "k.u8" not in g.metadata and list(g.tensors) == ["q", "new"]
    assert "k.u8" in g.header_metadata and g.section.hidden_keys == ["k.u8"]  # hidden, not rewritten
    assert np.array_equal(g.raw("q"), q) and g.info("q").ggml_type == T.Q5_1


def test_interrupted_update_leaves_original_byte_identical(tmp_path, monkeypatch):
    from pinfer_llm.formats import atomic

    write_tiny(tmp_path / "m.gguf")
    before = (tmp_path / "m.gguf").read_bytes()
    for point in ("directory-written", "data", "section-written", "section-synced", "slot-start"):
        def failing(name, point=point):
            if name == point:
                raise KeyboardInterrupt  # as if the user pressed Ctrl-C there
        monkeypatch.setattr(atomic, "hook", failing)
        with pytest.raises(KeyboardInterrupt):
            rewrite_gguf(open_gguf(tmp_path / "m.gguf"), set_metadata={"x": 1},
                         set_tensors={"t": np.ones(4, np.float32)}, progress=False)
        assert (tmp_path / "m.gguf").read_bytes() == before, point
        assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]  # no temporary file left behind


def test_new_files_get_normal_permissions(tmp_path):
    write_gguf(tmp_path / "n.gguf", {C.ARCHITECTURE: "llama"}, {"a": np.zeros(2, np.float32)})
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "n.gguf").stat().st_mode & 0o777 == 0o666 & ~umask


# --- PowerInfer's type ids ----------------------------------------------------------------------------------------

def test_pwri_files_store_powerinfers_integer_type_ids(tmp_path):
    """PowerInfer's ggml numbers I8/I16/I32 16/17/18 (today's ggml: 24/25/26, and 16-18 are IQ2_XXS..IQ3_XXS)."""
    ints = {"i8": np.arange(32, dtype=np.int8), "i16": np.arange(16, dtype=np.int16),
            "i32": np.arange(8, dtype=np.int32), "f": np.ones(8, np.float32)}
    write_gguf(tmp_path / "p.gguf", {C.ARCHITECTURE: "llama"}, ints, powerinfer=True)
    write_gguf(tmp_path / "g.gguf", {C.ARCHITECTURE: "llama"}, ints)
    assert stored_type_ids(tmp_path / "p.gguf") == {"i8": 16, "i16": 17, "i32": 18, "f": 0}
    assert stored_type_ids(tmp_path / "g.gguf") == {"i8": 24, "i16": 25, "i32": 26, "f": 0}
    for name in ("p.gguf", "g.gguf"):  # both read back as what they mean
        f = open_gguf(tmp_path / name)
        assert {n: f.info(n).ggml_type for n in ints} == {"i8": T.I8, "i16": T.I16, "i32": T.I32, "f": T.F32}
        for n, a in ints.items():
            assert np.array_equal(f.raw(n), a)


def patch_type_id(path, tensor: str, new_id: int):
    data = bytearray(open(path, "rb").read())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (nd,) = struct.unpack_from("<I", data, at)
    data[at + 4 + 8 * nd:at + 8 + 8 * nd] = struct.pack("<I", new_id)
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("bad", [4, 5, 19, 24, 26, 30, 1000])
def test_pwri_ids_powerinfer_does_not_define_are_refused(tmp_path, bad):
    write_gguf(tmp_path / "p.gguf", {C.ARCHITECTURE: "llama"}, {"blk.0.x": np.zeros(64, np.float32)},
               powerinfer=True)
    patch_type_id(tmp_path / "p.gguf", "blk.0.x", bad)
    with pytest.raises(PinferError, match=f"type id {bad}, which PowerInfer's ggml does not define") as e:
        open_gguf(tmp_path / "p.gguf")
    assert "\n" not in str(e.value)


def test_plan_tensors_of_earlier_pinfer_versions_still_read(tmp_path):
    """Earlier pinfer versions wrote gpu_idx/gpu_bucket into PWRI files with today's I32 id (26), which kills
    PowerInfer's loader: such files read, with a warning, and a copy repairs them."""
    mask = np.array([1, 0, 1, 0] * 8, np.int32)
    write_gguf(tmp_path / "old.gguf", {C.ARCHITECTURE: "llama", "llama.block_count": 1},
               {"w": np.ones(32, np.float32), "blk.0.gpu_idx": mask, "blk.0.gpu_bucket": np.flatnonzero(mask)
                .astype(np.int32)}, powerinfer=True)
    for n in ("blk.0.gpu_idx", "blk.0.gpu_bucket"):
        patch_type_id(tmp_path / "old.gguf", n, 26)
    f = open_gguf(tmp_path / "old.gguf")
    assert f.legacy_types == ["blk.0.gpu_idx", "blk.0.gpu_bucket"] and "PowerInfer cannot load" in f.warnings[0]
    assert np.array_equal(f.raw("blk.0.gpu_idx"), mask)
    rewrite_gguf(f, tmp_path / "fixed.gguf", progress=False)
    g = open_gguf(tmp_path / "fixed.gguf")
    assert list(g.header_tensors) == ["w"] and g.part("blk.0.gpu_idx") == "section" and not g.warnings
    assert np.array_equal(g.raw("blk.0.gpu_idx"), mask) and stored_type_ids(tmp_path / "fixed.gguf") == {"w": 0}


def test_pwri_writer_refuses_what_powerinfer_cannot_load(tmp_path):
    with pytest.raises(PinferError, match="BF16, which PowerInfer's ggml does not have"):
        write_gguf(tmp_path / "b.gguf", {C.ARCHITECTURE: "llama"},
                   {"w": RawTensor(np.zeros(8, np.uint16), T.BF16, (8,))}, powerinfer=True)
    with pytest.raises(PinferError, match="array of arrays"):
        write_gguf(tmp_path / "n.gguf", {C.ARCHITECTURE: "llama", "x": [[1, 2], [3]]}, {}, powerinfer=True)
    assert list(tmp_path.iterdir()) == []
