"""The CLIs' writes: refused before any work where they could not happen, with one line that says what to do."""

import hashlib
import time

from typer.testing import CliRunner

from pinfer_llm.cli.profile import app
from pinfer_llm.runtime.engine import resolve_model_path

runner = CliRunner()


def test_pi_profile_refuses_to_rewrite_the_demo_model_before_profiling():
    demo = resolve_model_path("smollm2")
    before = hashlib.sha256(demo.read_bytes()).hexdigest()
    t0 = time.perf_counter()
    r = runner.invoke(app, ["smollm2", "--sparsity", "0.3"])
    assert r.exit_code == 1
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "inside an installed package" in lines[0] and "write a copy with -o OUT" in lines[0]
    assert time.perf_counter() - t0 < 30  # refused before minutes of profiling
    assert hashlib.sha256(demo.read_bytes()).hexdigest() == before


def test_pi_profile_names_an_unwritable_output_before_profiling(tmp_path):
    r = runner.invoke(app, ["smollm2", "--sparsity", "0.3", "-o", str(tmp_path / "missing" / "out.gguf")])
    assert r.exit_code == 1
    assert r.output.strip() == f"pi-profile: error: cannot write {tmp_path / 'missing' / 'out.gguf'}: no such " \
                               f"directory {tmp_path / 'missing'}"
