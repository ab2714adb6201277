"""Bad values on the command line (issue #27 item 7): every numeric option finite and in range, prompt files that
are directories or binary, prompts that are not UTF-8, contexts beyond memory: one line each, before any work."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pinfer_llm.cli import plan as plan_cli
from pinfer_llm.cli import profile as profile_cli
from pinfer_llm.cli import run as run_cli
from pinfer_llm.cli import serve as serve_cli
from tests.tiny import write_tiny

runner = CliRunner()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("values")
    write_tiny(d / "m.gguf")
    (d / "bin.txt").write_bytes(bytes(range(256)) * 4)
    (d / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    return d


@pytest.fixture(autouse=True)
def _sixteen_gib(monkeypatch):
    """The context checks read MemAvailable: the same 16 GiB on every machine that runs the suite."""
    from pinfer_llm.runtime.profiling import counting

    monkeypatch.setattr(counting, "available_ram_bytes", lambda: 16 << 30)


def one_line(app, argv, prog, *needles):
    res = runner.invoke(app, [str(a) for a in argv])
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and "other processes keep" not in ln]
    assert res.exit_code == 1 and len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), res.output
    for n in needles:
        assert n in lines[0], lines[0]


RUN = [
    (["--repeat-penalty", "1e-300"], "--repeat-penalty must be from 0.001 to 1000 (1: off), got 1e-300"),
    (["--repeat-penalty", "1e300"], "--repeat-penalty must be from 0.001 to 1000"),
    (["-c", "1000000000"], "a context of 1000000000 tokens needs 536.4 GiB (KV cache and RoPE table), more than the "
                           "16.0 GiB of memory available; use a context of at most 29826161 tokens"),
    (["-f", "DIR"], "is a directory, not a prompt file"),
    (["-f", "DIR/bin.txt"], "a binary file (it holds NUL bytes), not text"),
    (["-f", "DIR/latin1.txt"], "not UTF-8 text (byte 0xe9 at offset 3)"),
    (["-p", "\udcff"], "-p is not valid UTF-8 (byte 0xff at character 0)"),
    (["-p", "hi", "-sys", "x\udce9"], "-sys is not valid UTF-8 (byte 0xe9 at character 1)"),
    (["--perplexity", "DIR"], "is a directory, not a text file for --perplexity"),
    (["--perplexity", "DIR/bin.txt"], "a binary file (it holds NUL bytes)"),
]


@pytest.mark.parametrize("args,want", RUN, ids=[" ".join(a) for a, _ in RUN])
def test_pi_run_values(model, args, want):
    args = [a.replace("DIR", str(model)) for a in args]
    prompt = [] if any(a in args for a in ("-f", "-p", "--perplexity")) else ["-p", "hi"]
    one_line(run_cli.app, [model / "m.gguf", *prompt, "-n", "2", *args], "pi-run", want)


def test_pi_run_reads_stdin_that_is_not_utf8_as_one_line(model):
    res = runner.invoke(run_cli.app, [str(model / "m.gguf"), "-n", "2"], input=b"\xff\xfe hello")
    assert res.exit_code == 1 and res.stderr.strip().endswith("stdin is not UTF-8 text (byte 0xff at offset 0); "
                                                               "pipe UTF-8 text"), res.output


PROFILE = [
    (["-t", "-1"], "-t/--threads must be at least 1, got -1"),
    (["--seed", "-1"], "--seed must be from 0 to 4294967295, got -1"),
    (["--steps", "-5"], "--steps must be at least 0, got -5"),
    (["--sample-tokens", "-5"], "--sample-tokens must be at least 1, got -5"),
    (["--ctx", "1000000000"], "a context of 1000000000 tokens needs"),
]


@pytest.mark.parametrize("args,want", PROFILE, ids=[" ".join(a) for a, _ in PROFILE])
def test_pi_profile_values(model, tmp_path, args, want):
    one_line(profile_cli.app, [model / "m.gguf", "--sparsity", "0.3", "--tokens", "30", "-o", tmp_path / "o.gguf",
                               *args], "pi-profile", want)


def test_pi_profile_export_into_a_directory_it_cannot_write(model, tmp_path, monkeypatch):
    """--export-activations into a read-only directory was an internal error (PermissionError from mkdtemp). The
    suite runs as root, for whom every directory is writable: the refusal is simulated at the two places it comes
    from."""
    import os

    ro = tmp_path / "ro"
    ro.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(ro) else real_access(p, mode))
    one_line(profile_cli.app, [model / "m.gguf", "--export-activations", ro / "act"], "pi-profile",
             f"cannot export into {ro / 'act'}: the directory {ro} is not writable")
    monkeypatch.setattr(os, "access", real_access)
    import tempfile

    def read_only(*a, **kw):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    import numpy as np

    from pinfer_llm.formats import constants as C
    from pinfer_llm.formats.update import update_model

    update_model(model / "m.gguf", set_metadata={C.ACT_TOKENS: np.uint64(10)},
                 set_tensors={C.tensor(C.ACT_COUNTS, i): np.ones(160, np.float32) for i in range(2)})
    one_line(profile_cli.app, [model / "m.gguf", "--export-activations", ro / "act"], "pi-profile",
             f"cannot export into {ro / 'act'}: Read-only file system")


HOST = ["--cpu-cores", "2", "--cpu-bw", "20", "--host-ram", "16"]
PLAN = [
    (["--vram-budget", "nan"], "--vram-budget must be a finite number above 0, got nan"),
    (["--host-ram", "nan"], "--host-ram must be a finite number above 0, got nan"),
    (["--pcie-bw", "nan"], "--pcie-bw must be a finite number above 0, got nan"),
    (["--cpu-bw", "nan"], "--cpu-bw must be a finite number above 0, got nan"),
    (["--pcie-bw", "inf"], "--pcie-bw must be a finite number above 0, got inf"),
    (["--cpu-bw", "inf"], "--cpu-bw must be a finite number above 0, got inf"),
    (["--time-limit", "nan"], "--time-limit must be a finite number above 0, got nan"),
    (["--cpu-cores", "1000000000"], "--cpu-cores must be from 1 to 4096, got 1000000000"),
    (["--act-tokens", "-5"], "--act-tokens must be at least 1, got -5"),
]


@pytest.mark.parametrize("cmd", ["plan", "compare"])
@pytest.mark.parametrize("args,want", PLAN, ids=[" ".join(a) for a, _ in PLAN])
def test_pi_plan_values(model, cmd, args, want):
    names = {a for a in args if a.startswith("--")}
    host = [x for i, x in enumerate(HOST) if HOST[i - (i % 2)] not in names]
    one_line(plan_cli.app, [cmd, model / "m.gguf", "--gpu", "rtx4090", *host, *args]
             + (["--dry-run"] if cmd == "plan" else []), "pi-plan", want)


@pytest.mark.parametrize("args,want", [(["--seed", "-1"], "--seed must be from 0 to 4294967295, got -1"),
                                       (["--tokens", "-1"], "--tokens must be from 1 to 18446744073709551615, got -1")])
def test_pi_plan_skeleton_values(tmp_path, args, want):
    one_line(plan_cli.app, ["skeleton", "llama2-7b", "-o", tmp_path / "s.gguf", *args], "pi-plan", want)
    assert not (tmp_path / "s.gguf").exists()


def test_a_context_beyond_memory_is_refused_before_anything_is_allocated(monkeypatch):
    """-c 1000000000 failed after 36 s with "can't allocate 64 GB" (pi-run, pi-profile --ctx, pi-serve -c): the
    KV cache and RoPE table are sized from the config before either exists. Here with 1 MiB "available", so that
    the load the check stops would allocate only ~57 MB if the check were gone."""
    from pinfer_llm.formats.errors import PinferError
    from pinfer_llm.formats.reader import open_gguf
    from pinfer_llm.runtime.loader import context_bytes, load_transformer
    from pinfer_llm.runtime.profiling import counting
    from tests.tiny import tiny_config

    cfg = tiny_config()
    assert context_bytes(cfg, 1, "f16") == 2 * 2 * 2 * 16 * 2 + 20 * 16  # K and V, 2 layers x 2 heads x 16 dims
    monkeypatch.setattr(counting, "available_ram_bytes", lambda: 1 << 20)
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        write_tiny(Path(d) / "m.gguf")
        f = open_gguf(Path(d) / "m.gguf")
        with pytest.raises(PinferError, match="a context of 100000 tokens needs 0.1 GiB .* more than the 0.0 GiB of "
                                              "memory available; use a context of at most 1820 tokens"):
            load_transformer(f, cfg, max_ctx=100_000)
        load_transformer(f, cfg, max_ctx=1000)


def test_pi_serve_context_beyond_memory(model):
    one_line(serve_cli.app, [model / "m.gguf", "-c", "1000000000", "--port", "0"], "pi-serve",
             "a context of 1000000000 tokens needs")


@pytest.mark.parametrize("prog,argv,want", [
    ("pi-run", ["MODEL", "-p", "hi", "-n", "nan"], "Invalid value for '-n' / '--n-predict'"),
    ("pi-run", ["MODEL", "-p", "hi", "--bogus-option"], "No such option: --bogus-option"),
    ("pi-profile", ["MODEL", "--tokens"], "Option '--tokens' requires an argument"),
    ("pi-plan", ["plan", "MODEL", "--gpu", "rtx4090", "--group", "nan"], "Invalid value for '--group'"),
    ("pi-plan", ["skeleton"], "Missing argument 'shape'"),
    ("pi-serve", ["MODEL", "--port", "nan"], "Invalid value for '--port'"),
])
def test_a_usage_error_is_one_line(model, capsys, prog, argv, want):
    """`-n nan`, an unknown option, a missing value: click printed its usage block (4 lines; pi-plan a 6-line rich
    box). Each command's main() runs its app through options.run_app: one line and exit status 2."""
    from pinfer_llm.cli.options import run_app

    app = {"pi-run": run_cli.app, "pi-profile": profile_cli.app, "pi-plan": plan_cli.app,
           "pi-serve": serve_cli.app}[prog]
    with pytest.raises(SystemExit) as e:
        run_app(app, prog, [str(model / "m.gguf") if a == "MODEL" else a for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith(f"{prog}: error: {want}"), err
    assert err.rstrip().endswith(" --help") and len(err) < 400, err


def test_run_app_keeps_help_version_and_exit_codes(model, capsys):
    from pinfer_llm.cli.options import run_app

    for argv, code in ((["--version"], 0), (["-h"], 0), ([str(model / "missing.gguf"), "-p", "hi"], 1)):
        with pytest.raises(SystemExit) as e:
            run_app(run_cli.app, "pi-run", argv)
        assert e.value.code == code, argv
    assert "no such file" in capsys.readouterr().err


@pytest.mark.parametrize("prog", ["pi-profile", "pi-serve"])
def test_threads_beyond_the_cores_are_capped_everywhere(model, tmp_path, monkeypatch, prog):
    """pi-profile and pi-serve passed -t to torch unchecked: 10^9 made libgomp abort allocating 216 GB for its pool
    (pi-profile) or hang (pi-serve), 10^20 was "internal error: Overflow when unpacking long long". They cap it as
    pi-run does, with the same warning. (10^20 here: the uncapped value fails in-process without killing the suite.)"""
    import os

    import torch

    cores = len(os.sched_getaffinity(0))
    try:
        if prog == "pi-serve":
            got = []
            monkeypatch.setattr(serve_cli, "run_uvicorn", lambda app_, sock, m, *rest: (sock.close(), got.append(m)))
            res = runner.invoke(serve_cli.app, [str(model / "m.gguf"), "--port", "0", "-t", str(10**20)])
            assert res.exit_code == 0 and got and got[0].threads == cores, res.output
        else:
            res = runner.invoke(profile_cli.app, [str(model / "m.gguf"), "--sparsity", "0.3", "--tokens", "30",
                                                  "--ctx", "20", "-t", str(10**20), "-o", str(tmp_path / "o.gguf")])
            assert res.exit_code == 0, res.output
        assert (f"{prog}: warning: -t {10**20} is more than the {cores} cores this process may use; using {cores}"
                in res.stderr.splitlines()), res.stderr
    finally:
        torch.set_num_threads(2)


def test_integers_beyond_what_is_stored_are_refused_or_fitted(model, tmp_path):
    """--tokens 10^20 cannot be stored in the u64 the file keeps (skeleton: "internal error: OverflowError"); a
    --group of 10^20 neurons (numpy made its breakpoints objects: "internal error: IndexError") is the whole layer."""
    one_line(plan_cli.app, ["skeleton", "smollm2-135m", "-o", tmp_path / "s.gguf", "--tokens", 10**20], "pi-plan",
             f"--tokens must be from 1 to 18446744073709551615, got {10**20}")
    one_line(profile_cli.app, [model / "m.gguf", "--tokens", 10**20, "-o", tmp_path / "o.gguf"], "pi-profile",
             "--tokens must be from 1 to 18446744073709551615")
    import numpy as np

    from pinfer_llm.formats import constants as C
    from pinfer_llm.formats.update import update_model

    write_tiny(tmp_path / "p.gguf")
    update_model(tmp_path / "p.gguf", set_metadata={C.ACT_TOKENS: np.uint64(40)},
                 set_tensors={C.tensor(C.ACT_COUNTS, i): np.arange(160, dtype=np.float32) % 40 for i in range(2)})
    plan = ["plan", str(tmp_path / "p.gguf"), "--gpu", "rtx4090", *HOST, "--dry-run", "--json", "--group"]
    want = runner.invoke(plan_cli.app, [*plan, "160"])
    got = runner.invoke(plan_cli.app, [*plan, str(10**20)])
    assert got.exit_code == 0 and want.exit_code == 0, got.output
    import json

    assert json.loads(got.stdout)["plan"]["layers"] == json.loads(want.stdout)["plan"]["layers"]


@pytest.mark.parametrize("args,want", [
    (["--host", "\udcff"], "--host is not valid UTF-8 (byte 0xff at character 0)"),
    (["--host", "a" * 300], "cannot listen on '" + "a" * 64 + "...' (300 characters):0: not a host name or address"),
    (["--api-key", ""], "--api-key is empty (an unset variable, or PINFER_API_KEY=''?)"),
    (["--api-key", " key"], "--api-key must be printable ASCII without spaces at its ends"),
    (["--api-key", "cl\u00e9"], "--api-key must be printable ASCII without spaces at its ends"),
    (["--api-key", "\udce9"], "--api-key is not valid UTF-8"),
    (["--cors", ""], "--cors is empty (an unset variable?)"),
    (["--vram-budget", "inf"], "--vram-budget must be a finite number above 0, got inf"),
])
def test_pi_serve_strings_and_budgets_refused_before_it_listens(model, monkeypatch, args, want):
    """--host $'\\xff' was "internal error: UnicodeError: encoding with 'idna' codec failed"; --api-key '' started
    a server that answers every request without a key; --vram-budget inf was taken (a warning, then the CPU). The
    server is not started if a check is missing: the test fails instead of serving."""
    monkeypatch.setattr(serve_cli, "run_uvicorn", lambda app_, sock, *rest: sock.close())
    res = runner.invoke(serve_cli.app, [str(model / "m.gguf"), "--port", "0", *args])
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 1 and len(lines) == 1 and lines[0].startswith("pi-serve: error: "), res.output
    assert want in lines[0] and len(lines[0]) < 400, lines[0]


def test_pi_run_vram_budget_inf(model):
    one_line(run_cli.app, [model / "m.gguf", "-p", "hi", "-n", "2", "--vram-budget", "inf"], "pi-run",
             "--vram-budget must be a finite number above 0, got inf")


@pytest.mark.parametrize("hw,want", [
    ("[cpu]\nmem_bw_gbs = nan\n", "[cpu] mem_bw_gbs must be a finite number from 0.001 to 10,000,000 GB/s, got nan"),
    ("[pcie]\nbw_gbs = inf\n", "[pcie] bw_gbs must be a finite number from 0.001 to 10,000,000 GB/s, got inf"),
    ("[pcie]\nbw_gbs = 1e-300\n", "[pcie] bw_gbs must be a finite number from 0.001"),
    ("[cpu]\nhost_ram_gib = inf\n", "[cpu] host_ram_gib must be a finite number from 0 to 1,073,741,824 GiB"),
    ("[cpu]\nbw_efficiency = nan\n", "[cpu] bw_efficiency must be a finite number from 1e-09 to 1, got nan"),
    ("[cpu]\nop_us = 1e300\n", "[cpu] op_us must be a finite number from 0 to 1,000,000 us"),
    ("[engine]\nsync_us = nan\n", "[engine] sync_us must be a finite number"),
    ("[engine]\ngpu_dense_efficiency = { f16 = 1e-300 }\n",
     "[engine] gpu_dense_efficiency.f16 is a share of the bandwidth, in [1e-09, 1]; got 1e-300"),
    ("[[gpu]]\nname = 'rtx4090'\nvram_budget_gib = nan\n", "[gpu #1] vram_budget_gib must be a finite number"),
    ('{"with_cuda_wrappers_us_per_layer": NaN}', "[host] split_layer_us must be a finite number"),
])
def test_machine_files_with_values_no_machine_has_are_one_line(model, tmp_path, hw, want):
    """TOML and JSON read nan and inf: a --hw file's NaN bandwidth reached the solver ("internal error: PulpError:
    Cannot multiply variables with NaN/inf values"), host_ram_gib = inf became int(inf) ("OverflowError"), and a
    bandwidth of 1e-300 made every plan "infeasible: no placement fits the VRAM budget(s) and host RAM", which was
    not what was wrong. Every number of a machine is checked against planner.hardware.RANGES."""
    path = tmp_path / ("m.json" if hw.startswith("{") else "m.toml")
    path.write_text(hw)
    one_line(plan_cli.app, ["plan", model / "m.gguf", "--gpu", "rtx4090", "--cpu-cores", "2", "--hw", path,
                            "--dry-run"], "pi-plan", f"{path}: {want}")


@pytest.mark.parametrize("args,want", [
    (["--pcie-bw", "1e-300"], "--pcie-bw must be a finite number from 0.001 to 10,000,000 GB/s, got 1e-300"),
    (["--cpu-bw", "1e300"], "--cpu-bw must be a finite number from 0.001 to 10,000,000 GB/s, got 1e+300"),
    (["--host-ram", "1e300"], "--host-ram must be a finite number from 0 to 1,073,741,824 GiB, got 1e+300"),
])
def test_machine_flags_beyond_any_machine(model, args, want):
    names = {a for a in args if a.startswith("--")}
    host = [x for i, x in enumerate(HOST) if HOST[i - (i % 2)] not in names]
    one_line(plan_cli.app, ["plan", model / "m.gguf", "--gpu", "rtx4090", *host, *args, "--dry-run"], "pi-plan", want)
