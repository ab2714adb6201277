"""PowerInfer's <model>.generated.gpuidx: pinfer writes it byte for byte as PowerInfer's export_split does, reads
PowerInfer's own, and refuses what PowerInfer's loader would refuse.

The golden bytes are built here from the documented format (formats/gpuidx.py), independently of pinfer's writer.
"""

import struct

import numpy as np
import pytest

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.errors import PinferError
from pinfer_llm.formats.gpuidx import read_gpuidx, write_gpuidx
from pinfer_llm.formats.reader import open_gguf

VRAM = 123_456_789_012


def _s(text: str) -> bytes:
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def golden(masks: list[np.ndarray], vram: int, *, vram_type: int = 10, i32_id: int = 18,
           order=None) -> bytes:
    """A .gpuidx as export_split writes it: PWRI v3, three keys, gpu_idx/gpu_bucket per layer, 32-byte alignment."""
    kv = _s("general.architecture") + struct.pack("<I", 8) + _s("generic.gpu_index")
    kv += _s("generic.gpu_index.block_count") + struct.pack("<II", 4, len(masks))
    kv += _s("split.vram_capacity") + (struct.pack("<IQ", 10, vram) if vram_type == 10 else struct.pack("<II", 4, vram))
    tensors = []
    for b, m in enumerate(masks):
        tensors.append((f"blk.{b}.gpu_idx", np.asarray(m, "<i4")))
        tensors.append((f"blk.{b}.gpu_bucket", np.flatnonzero(m).astype("<i4")))
    if order is not None:
        tensors = [tensors[i] for i in order]
    ti, data = b"", b""
    for name, a in tensors:
        ti += _s(name) + struct.pack("<IQ", 1, len(a)) + struct.pack("<IQ", i32_id, len(data))
        data += a.tobytes() + b"\0" * (-a.nbytes % 32)
    head = b"PWRI" + struct.pack("<IQQ", 3, len(tensors), 3) + kv + ti
    return head + b"\0" * (-len(head) % 32) + data


MASKS = [np.array([1, 0, 0, 1] * 24, np.int32), np.zeros(96, np.int32), np.array([1, 1, 0] * 32, np.int32)]


def test_written_bytes_equal_powerinfers_layout(tmp_path):
    write_gpuidx(tmp_path / "m.gguf.generated.gpuidx", MASKS, None, VRAM)
    assert (tmp_path / "m.gguf.generated.gpuidx").read_bytes() == golden(MASKS, VRAM)


def test_powerinfers_own_file_is_read(tmp_path):
    (tmp_path / "p.gpuidx").write_bytes(golden(MASKS, VRAM))
    g = read_gpuidx(tmp_path / "p.gpuidx", n_layer=3, n_ff=96)
    assert g.vram_capacity == VRAM and g.n_layer == 3
    for m, idx, bucket in zip(MASKS, g.gpu_idx, g.gpu_bucket, strict=True):
        assert idx.dtype == np.int32 and np.array_equal(idx, m) and np.array_equal(bucket, np.flatnonzero(m))
    f = open_gguf(tmp_path / "p.gpuidx")  # type 18 is I32 in a PWRI file (gguf-py would read IQ3_XXS)
    assert f.info("blk.0.gpu_idx").type_name == "I32" and f.is_powerinfer


@pytest.mark.parametrize("case, match", [
    ("vram_u32", "not a u64"),
    ("order", "PowerInfer takes them by position"),
    ("layers", "3 layers, the model has 4"),
    ("n_ff", "96 neurons, the model 128"),
    ("values", "values other than 0 and 1"),
    ("bucket", "not the sorted indices"),
    ("type", "type id 19, which PowerInfer's ggml does not define"),
])
def test_what_powerinfers_loader_would_refuse_is_refused(tmp_path, case, match):
    masks, kwargs, check = MASKS, {}, {}
    if case == "vram_u32":
        kwargs["vram_type"] = 4
    elif case == "order":
        kwargs["order"] = [1, 0, 2, 3, 4, 5]
    elif case == "layers":
        check["n_layer"] = 4
    elif case == "n_ff":
        check["n_ff"] = 128
    elif case == "values":
        masks = [m * 2 for m in MASKS]
    elif case == "type":
        kwargs["i32_id"] = 19
    data = golden(masks, 1000 if case == "vram_u32" else VRAM, **kwargs)
    if case == "bucket":  # the last layer's bucket names neuron 2, which is not on the GPU, instead of neuron 0
        bucket = np.flatnonzero(MASKS[2]).astype("<i4").tobytes()
        at = data.rindex(bucket)
        data = data[:at] + struct.pack("<i", 2) + data[at + 4:]
    (tmp_path / "x.gpuidx").write_bytes(data)
    with pytest.raises(PinferError, match=match) as e:
        read_gpuidx(tmp_path / "x.gpuidx", **check)
    assert "\n" not in str(e.value)


def test_files_of_earlier_pinfer_versions_are_read(tmp_path):
    """pinfer before 0.2 wrote I32 with today's id (26), which PowerInfer's loader dies on; pinfer still reads them."""
    (tmp_path / "old.gpuidx").write_bytes(golden(MASKS, VRAM, i32_id=26))
    g = read_gpuidx(tmp_path / "old.gpuidx")
    assert np.array_equal(g.gpu_idx[2], MASKS[2])
    assert "PowerInfer cannot load" in open_gguf(tmp_path / "old.gpuidx").warnings[0]


def test_pi_plan_exports_powerinfers_layout(tmp_path):
    from test_plan_helpers import tiny_model
    from typer.testing import CliRunner

    from pinfer_llm.cli.plan import app

    model = tiny_model(tmp_path / "m.gguf", n_ff=96)
    r = CliRunner().invoke(app, ["plan", str(model), "--gpu", "t4", "--export-gpuidx"])
    assert r.exit_code == 0, r.output
    path = tmp_path / "m.gguf.generated.gpuidx"
    g = read_gpuidx(path, n_layer=3, n_ff=96)
    assert path.read_bytes() == golden(g.gpu_idx, g.vram_capacity)
    f = open_gguf(path)
    assert list(f.metadata) == [C.ARCHITECTURE, C.GPU_INDEX_BLOCK_COUNT, C.SPLIT_VRAM_CAPACITY]
    # and the plan stored in the model itself went into pinfer's section, out of PowerInfer's sight
    m = open_gguf(model)
    assert m.part(C.tensor(C.GPU_IDX, 0)) == "section" and C.tensor(C.GPU_IDX, 0) not in m.header_tensors
    assert np.array_equal(m.raw(C.tensor(C.GPU_IDX, 1)), g.gpu_idx[1])


def test_a_sidecar_left_by_an_interrupted_plan_is_flagged(tmp_path, monkeypatch, capsys):
    """A kill after the plan's commit and before the .gpuidx rename left the new plan beside the old sidecar (33 of
    60 --export-gpuidx trials); nothing flagged it and `pi-plan apply --from` took it back. The plan records the
    sidecar it was exported with: show and pi-run warn, apply refuses the stale one."""
    from types import SimpleNamespace

    from test_plan_cli import plan_split, split_budget
    from test_plan_helpers import tiny_model
    from typer.testing import CliRunner

    from pinfer_llm.cli import plan as plan_cli
    from pinfer_llm.cli.options import warn_stale_sidecar

    monkeypatch.setenv("PINFER_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_model(tmp_path / "m.gguf", n_layer=3)
    sidecar = tmp_path / "m.gguf.generated.gpuidx"
    assert plan_split(model, tmp_path, "--gpu", "rtx4090", "--export-gpuidx").exit_code == 0
    first = read_gpuidx(sidecar)
    assert open_gguf(model).get(C.PLAN_GPUIDX) == first.fingerprint

    def killed(*a, **kw):  # the process dies after the plan's commit, before the sidecar is renamed into place
        raise KeyboardInterrupt

    monkeypatch.setattr(plan_cli, "export_gpuidx", killed)
    r = plan_split(model, tmp_path, "--gpu", "rtx4090", "--export-gpuidx", "--vram-budget",
                   split_budget(model, 0.2))  # a smaller budget: another plan
    assert r.exit_code == 130, r.output
    monkeypatch.undo()
    monkeypatch.setenv("PINFER_CACHE_DIR", str(tmp_path / "cache"))
    assert open_gguf(model).get(C.PLAN_GPUIDX) != first.fingerprint  # the new plan, the old sidecar
    r = CliRunner().invoke(plan_cli.app, ["show", str(model)])
    assert r.exit_code == 0 and r.stderr.startswith("pi-plan: warning: m.gguf.generated.gpuidx is stale"), r.stderr
    r = CliRunner().invoke(plan_cli.app, ["apply", "--from", str(sidecar), str(model)])
    assert r.exit_code == 1 and r.stderr.startswith("pi-plan: error: m.gguf.generated.gpuidx is stale"), r.stderr
    warn_stale_sidecar(SimpleNamespace(file=open_gguf(model)), "pi-run")  # what pi-run says after the load
    assert capsys.readouterr().err.startswith("pi-run: warning: m.gguf.generated.gpuidx is stale")
    assert plan_split(model, tmp_path, "--gpu", "rtx4090", "--export-gpuidx").exit_code == 0  # a whole run: agreed
    r = CliRunner().invoke(plan_cli.app, ["show", str(model)])
    assert r.exit_code == 0 and "stale" not in r.stderr, r.stderr
