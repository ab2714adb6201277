"""GGUF/PWRI reading and writing."""

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType as T

from formats import constants as C
from formats.config import config_from_gguf
from formats.errors import PinferError
from formats.reader import open_gguf
from formats.writer import RawTensor, rewrite_gguf, write_gguf
from tests.tiny import write_tiny


def test_roundtrip_metadata_and_tensors(tmp_path):
    meta = {C.ARCHITECTURE: "llama", "x.u32": 7, "x.f32": 1.5, "x.str": "héllo", "x.strs": ["a", "b", "ç"],
            "x.i32s": np.arange(4, dtype=np.int32), "x.u64": np.uint64(2**40), "x.bool": True}
    w = np.random.default_rng(0).standard_normal((8, 32)).astype(np.float32)
    write_gguf(tmp_path / "a.gguf", meta, {"w": w, "h": w.astype(np.float16), "i": np.arange(5, dtype=np.int32)})
    f = open_gguf(tmp_path / "a.gguf")
    assert f.magic == b"GGUF" and f.version == 3
    assert f.metadata["x.strs"] == ["a", "b", "ç"] and f.metadata["x.str"] == "héllo"
    assert f.metadata["x.u64"] == 2**40 and f.metadata["x.bool"] is True
    assert list(f.metadata["x.i32s"]) == [0, 1, 2, 3]
    assert np.array_equal(f.raw("w"), w) and f.raw("h").dtype == np.float16
    assert f.info("w").shape == (8, 32) and f.info("w").ne == (32, 8)
    # zero-copy: the tensor is a view of the file mapping
    assert np.shares_memory(f.raw("w"), f.mm)
    # standard tools read what we write
    r = GGUFReader(tmp_path / "a.gguf")
    assert {t.name for t in r.tensors} == {"w", "h", "i"}
    assert r.fields["x.str"].contents() == "héllo"


def test_pwri_magic_is_read_in_place(tmp_path):
    write_tiny(tmp_path / "m.gguf", powerinfer=True)
    f = open_gguf(tmp_path / "m.gguf")
    assert f.is_powerinfer and f.has(C.tensor(C.FFN_DOWN_T, 0)) and f.has(C.tensor(C.PRED_FC1, 1))
    with pytest.raises(ValueError):  # stock readers refuse it: that is why we parse it ourselves
        GGUFReader(tmp_path / "m.gguf")
    # rewriting keeps the magic; a plain GGUF source stays plain (readable by standard tools)
    rewrite_gguf(f, tmp_path / "copy.gguf", set_metadata={"x.k": "v"}, progress=False)
    assert open_gguf(tmp_path / "copy.gguf").is_powerinfer
    write_tiny(tmp_path / "plain.gguf")
    rewrite_gguf(open_gguf(tmp_path / "plain.gguf"), tmp_path / "plain2.gguf", set_metadata={"x.k": "v"},
                 progress=False)
    assert GGUFReader(tmp_path / "plain2.gguf").fields["x.k"].contents() == "v"


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


def test_rewrite_preserves_quantised_tensors_and_types(tmp_path):
    from gguf import quants

    a = np.random.default_rng(2).standard_normal((16, 64)).astype(np.float32)
    q = quants.quantize(a, T.Q5_1)
    write_gguf(tmp_path / "a.gguf", {C.ARCHITECTURE: "llama", "k.u8": np.uint8(3)},
               {"q": RawTensor(q, T.Q5_1, a.shape)})
    f = open_gguf(tmp_path / "a.gguf")
    rewrite_gguf(f, set_tensors={"new": np.ones(3, np.float32)}, drop_keys={"k.u8"}, progress=False)
    g = open_gguf(tmp_path / "a.gguf")
    assert "k.u8" not in g.metadata and list(g.tensors) == ["q", "new"]
    assert np.array_equal(g.raw("q"), q) and g.info("q").ggml_type == T.Q5_1


def test_interrupted_rewrite_leaves_original_byte_identical(tmp_path, monkeypatch):
    write_tiny(tmp_path / "m.gguf")
    before = (tmp_path / "m.gguf").read_bytes()
    f = open_gguf(tmp_path / "m.gguf")
    import gguf

    calls = {"n": 0}
    orig = gguf.GGUFWriter.write_tensor_data

    def failing(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-write
        return orig(self, *a, **k)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", failing)
    with pytest.raises(KeyboardInterrupt):
        rewrite_gguf(f, set_metadata={"x": 1}, progress=False)
    assert (tmp_path / "m.gguf").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]  # no temporary file left behind


def test_new_files_get_normal_permissions(tmp_path):
    import os

    write_gguf(tmp_path / "n.gguf", {C.ARCHITECTURE: "llama"}, {"a": np.zeros(2, np.float32)})
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "n.gguf").stat().st_mode & 0o777 == 0o666 & ~umask
