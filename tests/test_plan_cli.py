"""pi-plan's command line: outputs, files written, and every bad input refused in one line with nothing written."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_plan_helpers import digest, fast_hw, gpu, leftovers, tiny_model
from typer.testing import CliRunner

from pinfer_llm.cli.plan import app, normalize_argv
from pinfer_llm.formats import constants as C
from pinfer_llm.formats.errors import PinferError
from pinfer_llm.formats.reader import open_gguf
from pinfer_llm.formats.update import rewrite_gguf
from pinfer_llm.planner.ilp import solve
from pinfer_llm.planner.problem import build_problem
from pinfer_llm.planner.skeleton import skeleton_from

CPU_OPTS = ["--cpu-cores", "4", "--cpu-bw", "20", "--host-ram", "64"]
runner = CliRunner()


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PINFER_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def model(tmp_path) -> Path:
    return tiny_model(tmp_path / "model.gguf", n_layer=3)


def plan(*args):
    return runner.invoke(app, ["plan", *map(str, args), *CPU_OPTS])


# A slow CPU and small fixed GPU costs (as test_plan_helpers.fast_hw): with a datasheet GPU's launch and sync costs,
# a tiny model runs fastest wholly on the CPU and a plan places no neuron at all.
FAST_HW = ("[cpu]\ncores = 4\nmem_bw_gbs = 2\nhost_ram_gib = 64\nop_us = 0.01\ntoken_us = 0\n"
           "[pcie]\nlatency_us = 0.05\n[engine]\ngpu_launch_us = 0.01\nsync_us = 0.05\n"
           "[host]\nsplit_layer_us = 0.03\ncall_us = 0.001\n")


def split_budget(model: Path, share: float = 0.5) -> str:
    """--vram-budget (GiB) for the GPU workspace, output head, predictors and `share` of the FFN neurons' bytes."""
    from pinfer_llm.planner.memory import account

    mb = account(open_gguf(model))
    fixed = mb.gpu_workspace + mb.output + sum(lb.pred for lb in mb.layers)
    return f"{(fixed + share * sum(lb.ffn for lb in mb.layers)) / (1 << 30):.12f}"


def plan_split(model: Path, tmp_path: Path, *args):
    """A plan that puts about half of the neurons on the GPU."""
    hw = tmp_path / "fast.toml"
    hw.write_text(FAST_HW)
    return runner.invoke(app, ["plan", str(model), "--hw", str(hw), "--vram-budget", split_budget(model),
                               *map(str, args)])


def one_line_error(result, *fragments):
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pi-plan: error: ")
    for frag in fragments:
        assert frag in lines[0], lines[0]
    return lines[0]


# --- what a plan writes ---------------------------------------------------------------------------------------------

def test_plan_writes_the_model_and_gpuidx(model, tmp_path):
    r = plan_split(model, tmp_path, "--gpu", "rtx4090", "--export-gpuidx", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert 0.2 <= d["plan"]["gpu_neuron_share"] <= 0.8  # a real share of the neurons: the masks below mean something
    assert d["written"] == str(model) and d["gpuidx"] == str(model) + ".generated.gpuidx"
    assert d["plan"]["status"] == "optimal" and set(d["baselines"]) == {"layers", "powerinfer", "cpu", "gpu"}
    f = open_gguf(model)
    assert f.get(C.PLAN_GPUS) == ["rtx4090"] and f.get(C.PLAN_OBJECTIVE) == "time"
    assert f.get(C.PLAN_STATUS) == "optimal" and f.get(C.PLAN_FINGERPRINT)
    assert f.value_types[C.PLAN_VRAM_BUDGET][0] == 10  # u64
    assert f.get(C.PLAN_TOKENS_PER_S) == pytest.approx(d["plan"]["tokens_per_s"], rel=1e-6)
    counts = [r_["gpu_neurons"] for r_ in d["plan"]["layers"]]
    assert list(f.get(C.PLAN_GPU_NEURONS)) == counts
    assert sum(counts) == pytest.approx(d["plan"]["gpu_neuron_share"] * 3 * 96)

    g = open_gguf(d["gpuidx"])
    assert g.magic == C.PWRI_MAGIC and g.version == 3
    assert g.architecture == C.GPU_INDEX_ARCH and g.get(C.GPU_INDEX_BLOCK_COUNT) == 3
    assert g.value_types[C.SPLIT_VRAM_CAPACITY][0] == 10  # u64, as PowerInfer reads it
    names = list(g.tensors)
    assert names == [C.tensor(t, b) for b in range(3) for t in (C.GPU_IDX, C.GPU_BUCKET)]  # PowerInfer's order
    checked = 0
    for b in range(3):
        mask, bucket = g.raw(C.tensor(C.GPU_IDX, b)), g.raw(C.tensor(C.GPU_BUCKET, b))
        assert mask.dtype == np.int32 and bucket.dtype == np.int32 and mask.shape == (96,)
        assert np.array_equal(np.flatnonzero(mask), bucket) and int(mask.sum()) == counts[b]
        assert np.array_equal(mask, f.raw(C.tensor(C.GPU_IDX, b)))
        # the GPU neurons are the most frequently active ones
        freq = np.asarray(f.raw(C.tensor(C.ACT_COUNTS, b)))
        if 0 < counts[b] < 96:
            assert freq[mask == 1].min() >= freq[mask == 0].max()
            checked += 1
    assert checked >= 1  # at least one layer is split, so the order was checked
    assert g.get(C.SPLIT_VRAM_CAPACITY) <= sum(d["plan"]["vram_used"])


def test_output_option_leaves_the_original(model, tmp_path):
    before = digest(model)
    out = tmp_path / "planned.gguf"
    r = plan(model, "--gpu", "t4", "-o", out)
    assert r.exit_code == 0, r.output
    assert digest(model) == before
    assert open_gguf(out).get(C.PLAN_GPUS) == ["t4"]


def test_dry_run_writes_nothing(model):
    before = digest(model)
    r = plan(model, "--gpu", "t4", "--dry-run")
    assert r.exit_code == 0 and digest(model) == before
    for text in ("GPU neurons", "predicted", "tokens/s", "layers", "powerinfer", "cpu", "solver", "VRAM used"):
        assert text in r.stdout


def test_replanning_replaces_the_plan(model):
    assert plan(model, "--gpu", "t4").exit_code == 0
    assert plan(model, "--gpu", "rtx2080ti", "--objective", "hot-mass").exit_code == 0
    f = open_gguf(model)
    assert f.get(C.PLAN_GPUS) == ["rtx2080ti"] and f.get(C.PLAN_OBJECTIVE) == "hot-mass"
    assert sum(1 for n in f.tensors if n.endswith("gpu_idx")) == 3


def test_default_command_is_plan():
    assert normalize_argv(["m.gguf", "--gpu", "t4"]) == ["plan", "m.gguf", "--gpu", "t4"]
    assert normalize_argv(["-m", "m.gguf", "--gpu", "t4"]) == ["plan", "-m", "m.gguf", "--gpu", "t4"]
    assert normalize_argv(["--gpu", "t4", "m.gguf"]) == ["plan", "--gpu", "t4", "m.gguf"]
    assert normalize_argv(["compare", "m.gguf"]) == ["compare", "m.gguf"]
    for own in ("--help", "-h", "--version"):
        assert normalize_argv([own]) == [own]


def pi_plan(argv, capsys) -> tuple[int, str]:
    from pinfer_llm.cli.plan import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code or 0, capsys.readouterr().out


def test_help_and_version_everywhere(capsys):
    """-h as --help on pi-plan and on each of its commands (the default one too); --version."""
    import pinfer_llm
    from pinfer_llm.cli.plan import COMMANDS

    code, out = pi_plan(["-h"], capsys)
    assert code == 0 and all(c in out for c in COMMANDS)
    for cmd in COMMANDS:
        code, out = pi_plan([cmd, "-h"], capsys)
        assert code == 0 and f"pi-plan {cmd} [OPTIONS]" in out, (cmd, out)
    code, out = pi_plan(["m.gguf", "-h"], capsys)
    assert code == 0 and "pi-plan plan [OPTIONS]" in out
    code, out = pi_plan(["--version"], capsys)
    assert code == 0 and out == f"pi-plan pinfer-llm {pinfer_llm.__version__}\n"


def test_model_as_an_option(model, tmp_path):
    """-m MODEL wherever a command takes MODEL; the model given twice is one line."""
    r = runner.invoke(app, ["plan", "-m", str(model), "--gpu", "t4", "--dry-run", "--json", *CPU_OPTS])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["model"]["path"] == str(model)
    r = runner.invoke(app, ["compare", "--model", str(model), "--gpu", "t4", "--json", *CPU_OPTS])
    assert r.exit_code == 0 and [row["gpu"] for row in json.loads(r.stdout)["rows"]] == ["t4"], r.output
    assert plan(model, "--gpu", "l4").exit_code == 0
    r = runner.invoke(app, ["show", "-m", str(model), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["meta"][C.PLAN_GPUS] == ["l4"]
    other = tmp_path / "other.gguf"
    other.write_bytes(model.read_bytes())
    r = runner.invoke(app, ["apply", "-m", str(other), "--from", str(model), "-o", str(tmp_path / "out.gguf")])
    assert r.exit_code == 0 and (tmp_path / "out.gguf").exists(), r.output
    r = runner.invoke(app, ["show", str(model), "-m", str(model)])
    assert r.exit_code == 1 and r.output.strip().startswith("pi-plan: error: the model is given twice"), r.output


def test_compare_one_row_per_gpu(model):
    r = runner.invoke(app, ["compare", str(model), "--gpu", "rtx4090", "--gpu", "t4", "--gpu", "rtx3090+rtx3090",
                            "--json", *CPU_OPTS])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert [row["gpu"] for row in d["rows"]] == ["rtx4090", "t4", "rtx3090+rtx3090"]
    for row in d["rows"]:
        assert row["tokens_per_s"] > 0 and row["speedup_layers"] >= 1 - 1e-9
        assert row["vram_used"] <= row["vram_budget"]
    r = runner.invoke(app, ["compare", str(model), "--gpu", "rtx4090", "--gpu", "t4", *CPU_OPTS])
    assert r.exit_code == 0 and "x powerinfer" in r.stdout and "t4" in r.stdout


def test_compare_reports_a_gpu_too_small_in_its_row(model):
    r = runner.invoke(app, ["compare", str(model), "--gpu", "t4", "--gpu", "rtx4090", "--vram-budget", "0.1",
                            "--json", *CPU_OPTS])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["rows"]
    assert all("mandatory" in row["error"] for row in rows)


def test_show_and_gpus(model):
    assert plan(model, "--gpu", "l4").exit_code == 0
    r = runner.invoke(app, ["show", str(model), "--json"])
    assert r.exit_code == 0
    d = json.loads(r.stdout)
    assert d["meta"][C.PLAN_GPUS] == ["l4"] and len(d["layers"]) == 3
    r = runner.invoke(app, ["gpus"])
    for name in ("rtx4090", "rtx4080", "rtx3090", "rtx3060-12g", "rtx2080ti", "a100-40g", "a100-80g", "h100-pcie",
                 "h200", "l4", "t4"):
        assert name in r.stdout


def test_skeleton_command(tmp_path):
    out = tmp_path / "s.gguf"
    r = runner.invoke(app, ["skeleton", "llama2-7b", "-o", str(out), "--quant", "f16"])
    assert r.exit_code == 0 and out.exists()
    assert open_gguf(out).get(C.SKELETON) is True
    r = runner.invoke(app, ["skeleton", "llama2-8b", "-o", str(tmp_path / "x.gguf")])
    one_line_error(r, "llama2-7b")
    assert not (tmp_path / "x.gguf").exists()


def test_powerinfer_activation_directory(tmp_path):
    path = tiny_model(tmp_path / "m.gguf", n_layer=12, stats=False)
    d = tmp_path / "activation"
    d.mkdir()
    rng = np.random.default_rng(0)
    counts = [rng.integers(0, 500, 96).astype(np.float32) for _ in range(12)]
    for b, c in enumerate(counts):
        torch.save(torch.from_numpy(c), d / f"activation_{b}.pt")
    p = build_problem(path, fast_hw([gpu()]), act_dir=d, act_tokens=500)
    for b in (2, 10):  # numeric order: activation_10 is layer 10, not layer 2 (PowerInfer bug #247)
        assert np.allclose(p.act.freq[b], counts[b] / 500)
    r = plan(path, "--gpu", "t4", "--activations", d, "--dry-run")
    assert r.exit_code == 0, r.output
    assert "largest count" in r.stdout  # no --act-tokens: normalised, and said so


# --- bad input: one line, nothing written -------------------------------------------------------------------------

@pytest.fixture
def unchanged(model):
    before = digest(model)
    yield model
    assert digest(model) == before
    assert leftovers(model.parent) == []
    assert not Path(str(model) + ".generated.gpuidx").exists()


def test_unknown_gpu_lists_close_names(unchanged):
    line = one_line_error(plan(unchanged, "--gpu", "rtx409"), "unknown GPU 'rtx409'")
    assert "rtx4090" in line


def test_budget_too_small_says_how_many_bytes(unchanged):
    line = one_line_error(plan(unchanged, "--gpu", "rtx4090", "--vram-budget", "0.1"), "mandatory", "bytes")
    assert any(ch.isdigit() for ch in line)


def test_no_activation_statistics(tmp_path):
    path = tiny_model(tmp_path / "bare.gguf", stats=False)
    before = digest(path)
    one_line_error(plan(path, "--gpu", "t4"), "pi-profile", "--activations")
    assert digest(path) == before


def test_statistics_that_do_not_match(tmp_path):
    path = tiny_model(tmp_path / "bad.gguf", counts_len=80)  # 80 counts for 96 neurons
    before = digest(path)
    one_line_error(plan(path, "--gpu", "t4"), "do not match")
    assert digest(path) == before


def test_activation_directory_that_does_not_match(unchanged, tmp_path):
    d = tmp_path / "activation"
    d.mkdir()
    for b in range(2):  # the model has 3 layers
        torch.save(torch.ones(96), d / f"activation_{b}.pt")
    one_line_error(plan(unchanged, "--gpu", "t4", "--activations", d), "do not match")
    torch.save(torch.ones(50), d / "activation_2.pt")  # wrong length
    one_line_error(plan(unchanged, "--gpu", "t4", "--activations", d), "do not match")


@pytest.mark.parametrize("text,fragment", [
    ("[cpu\ncores = 4", "malformed TOML"),
    ("[cpu]\ncores = 'many'", "integer"),
    ("[cpu]\nspeed = 3", "unknown key 'speed'"),
    ("[[gpu]]\nname = 'mystery'\nvram_gib = 8", "needs mem_bw_gbs"),
    ("[gpu]\nname = 't4'", "array of tables"),
    ("[cpu]\nmem_bw_gbs = -4", "positive"),
    ("[network]\nx = 1", "unknown section"),
])
def test_malformed_hw_file(unchanged, tmp_path, text, fragment):
    hw = tmp_path / "hw.toml"
    hw.write_text(text)
    one_line_error(runner.invoke(app, ["plan", str(unchanged), "--hw", str(hw)]), fragment)


def test_hw_file_describes_a_machine(model, tmp_path):
    hw = tmp_path / "hw.toml"
    hw.write_text("[cpu]\ncores = 24\nmem_bw_gbs = 90\nhost_ram_gib = 192\n[pcie]\nbw_gbs = 12\n"
                  "[[gpu]]\nname = 'rtx4090'\nvram_budget_gib = 20\n"
                  "[[gpu]]\nname = 'my-card'\nvram_gib = 48\nmem_bw_gbs = 960\npcie_gen = 4\npcie_lanes = 16\n"
                  "fp16_tflops = 91\n")
    r = runner.invoke(app, ["plan", str(model), "--hw", str(hw), "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert [g["name"] for g in d["hardware"]["gpus"]] == ["rtx4090", "my-card"]
    assert d["hardware"]["cpu"]["cores"] == 24 and d["hardware"]["pcie_bw_gbs"] == 12
    assert d["plan"]["vram_budget"][0] == 20 << 30


def test_infeasible_problem(unchanged):
    # VRAM and host RAM together hold less than the model
    m = open_gguf(unchanged)
    from pinfer_llm.planner.memory import account

    mb = account(m)
    host = (mb.host_fixed + mb.host_reserve + 1000) / (1 << 30)
    vram = (mb.gpu_workspace + 1000) / (1 << 30)
    r = runner.invoke(app, ["plan", str(unchanged), "--gpu", "t4", "--vram-budget", f"{vram:.12f}", "--host-ram",
                            f"{host:.12f}", "--cpu-cores", "2", "--cpu-bw", "10"])
    one_line_error(r, "infeasible", "bytes")


def test_infeasible_ilp_is_never_used(model):
    # the totals fit, but indivisible parts do not: the solver says infeasible and we say so
    p = build_problem(model, fast_hw([gpu()]))
    p.host_budget = 0
    p.budgets = [p.model.total - p.model.layers[0].attn // 2]
    with pytest.raises(PinferError, match="infeasible"):
        solve(p)


def test_solver_not_available(unchanged, monkeypatch):
    import pulp

    if hasattr(pulp, "HiGHS"):
        monkeypatch.setattr(pulp.HiGHS, "available", lambda self: False)
    one_line_error(plan(unchanged, "--gpu", "t4", "--solver", "highs"), "solver 'highs' is not available")
    one_line_error(plan(unchanged, "--gpu", "t4", "--solver", "gurobi"), "unknown --solver")


def test_unknown_objective(unchanged):
    one_line_error(plan(unchanged, "--gpu", "t4", "--objective", "speed"), "unknown --objective")


def test_no_gpu(unchanged):
    one_line_error(plan(unchanged), "--gpu")


def test_interrupted_rewrite_leaves_the_original(unchanged, monkeypatch):
    from pinfer_llm.formats import atomic

    def interrupt(point):
        if point == "section-written":
            raise KeyboardInterrupt  # as if ^C arrived after the plan's bytes, before the slot that commits them

    monkeypatch.setattr(atomic, "hook", interrupt)
    r = plan(unchanged, "--gpu", "t4")
    assert r.exit_code == 130
    assert "interrupted" in r.stderr


def test_plan_for_another_model_is_refused(tmp_path):
    a = tiny_model(tmp_path / "a.gguf", n_ff=96)
    b = tiny_model(tmp_path / "b.gguf", n_ff=128, seed=1)
    assert plan(a, "--gpu", "t4").exit_code == 0
    before = digest(b)
    one_line_error(runner.invoke(app, ["apply", str(b), "--from", str(a)]), "another model")
    assert digest(b) == before and leftovers(tmp_path) == []
    # a tampered fingerprint is refused too
    f = open_gguf(a)
    rewrite_gguf(f, tmp_path / "t.gguf", set_metadata={C.PLAN_FINGERPRINT: "0123456789abcdef"}, progress=False)
    one_line_error(runner.invoke(app, ["show", str(tmp_path / "t.gguf")]), "another model")


def test_plan_made_on_a_skeleton_applies_to_the_real_model(tmp_path):
    real = tiny_model(tmp_path / "real.gguf")
    skel = skeleton_from(real, tmp_path / "skel.gguf")
    r = plan_split(skel, tmp_path, "--gpu", "t4")
    assert r.exit_code == 0, r.output
    on_gpu = sum(int(np.asarray(open_gguf(skel).raw(C.tensor(C.GPU_IDX, b))).sum()) for b in range(3))
    assert 0.2 * 3 * 96 <= on_gpu <= 0.8 * 3 * 96  # a real share: equal masks below are not all zeros
    r = runner.invoke(app, ["apply", str(real), "--from", str(skel)])
    assert r.exit_code == 0, r.output
    f, s = open_gguf(real), open_gguf(skel)
    for b in range(3):
        assert np.array_equal(f.raw(C.tensor(C.GPU_IDX, b)), s.raw(C.tensor(C.GPU_IDX, b)))
    assert f.get(C.PLAN_FINGERPRINT) == s.get(C.PLAN_FINGERPRINT)


@pytest.mark.parametrize("ctx", ["0", "-5"])
def test_nonsense_context_size(unchanged, ctx):
    one_line_error(plan(unchanged, "--gpu", "t4", "--ctx-size", ctx), "--ctx-size", "at least 1", ctx)
    one_line_error(runner.invoke(app, ["compare", str(unchanged), "--gpu", "t4", "--ctx-size", ctx, *CPU_OPTS]),
                   "--ctx-size", ctx)


@pytest.mark.parametrize("spec", ["+", "t4+", "+t4", "t4++l4"])
def test_compare_gpu_with_an_empty_name(unchanged, spec):
    one_line_error(runner.invoke(app, ["compare", str(unchanged), "--gpu", spec, *CPU_OPTS]),
                   f"--gpu '{spec}'", "empty GPU name")


def test_unknown_gap_is_reported_as_unknown(tmp_path, monkeypatch):
    """A solve stopped by its time limit whose bound the solver does not give: null in JSON, "unknown" in the table
    and in `show`, no gap key in the file; never 0."""
    from pinfer_llm.planner import ilp

    model = tiny_model(tmp_path / "m12.gguf", n_layer=12)  # 3 layers: CBC's root LP is integral before any clock

    monkeypatch.setattr(ilp, "_relaxation_bound", lambda *a: None)
    r = plan_split(model, tmp_path, "--gpu", "rtx4090", "--time-limit", "1e-9", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)["plan"]
    assert d["status"] == "time limit" and d["gap"] is None
    assert open_gguf(model).get(C.PLAN_GAP) is None and open_gguf(model).get(C.PLAN_STATUS) == "time limit"
    r = plan_split(model, tmp_path, "--gpu", "rtx4090", "--time-limit", "1e-9", "--dry-run")
    assert "gap unknown" in r.stdout and "0.000%" not in r.stdout
    r = runner.invoke(app, ["show", str(model)])
    assert "gap: unknown" in r.stdout
    small = tiny_model(tmp_path / "m3.gguf", n_layer=3)
    r = plan_split(small, tmp_path, "--gpu", "rtx4090", "--json")  # a complete solve: CBC's tolerance bounds it
    d = json.loads(r.stdout)["plan"]
    assert d["status"] == "optimal" and 0 < d["gap"] <= 1e-3 + 1e-12
    assert open_gguf(small).get(C.PLAN_GAP) == pytest.approx(d["gap"], rel=1e-6)
