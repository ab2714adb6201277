"""`make gpu-check` end to end on the CPU stand-ins, so that its first run on a GPU cannot die on a typo:
benchmarks/gpu_check.py --device emulated runs the kernel checks and timings through CudaDevice over the CUDA
emulation (tests/cuda_emu) at tiny shapes, then benchmarks/gpu_e2e.py's placements, paired rounds, logits step by
step and cost-model fit on ReferenceDevice with a tiny planted model. The figures mean nothing; what is checked is
that every phase ran and wrote what the lead reads.

Plants (each made a test below fail, then restored):
- gpu_e2e.paired_rounds without the rotation (order = names): test_paired_rounds_rotate_the_order;
- gpu_e2e.forced_ids returning the prompt only: the same test (steps);
- gpu_check.fit_device's records without "fit" set on the gemv rows: the same test (device_fit.dense);
- Deadline.allows always True: test_deadline_records_what_did_not_run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import gpu_check, gpu_e2e
from pinfer_llm.planner.machine import resolve_hardware

# half of the tiny planted model fits beside the planner's GPU workspace: the placements differ
BUDGET_GIB = "0.2525"
ARGS = ["--device", "emulated", "--shape", "tiny", "--threads", "1", "--tokens", "4", "--rounds", "2", "--steps",
        "4", "--vram-budget", BUDGET_GIB]


@pytest.fixture
def env(tmp_path, monkeypatch):
    # pinfer's cache stays the suite's (conftest: the C++ kernels built once); plans there are keyed by the model
    monkeypatch.setenv("PINFER_COMMIT", "abc1234")
    return tmp_path


def test_gpu_check_runs_every_phase(env, capsys):
    out = env / "run.json"
    rc = gpu_check.main(ARGS + ["--model", str(env / "tiny.gguf"), "--out", str(out)])
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert rc == 0, printed
    assert res["commit"] == "abc1234" and res["not_run"] == []
    # 1. every kernel checked, Llama-3's RoPE among them
    kernels = {c["kernel"] for c in res["checks"]}
    assert {"matmul", "ffn_up", "ffn_down", "ffn_prefill", "predict", "rms_norm", "attention"} <= kernels
    assert res["checks_pass"] and len(res["checks"]) > 60
    assert any("base=500000 scale=2" in c["case"] for c in res["checks"])
    # 2. timings, and the device constants fitted from them
    fits = {(b["fit"], b["type"]) for b in res["bench"] if b["fit"]}
    assert {("latency", "f32")} | {(k, t) for k in ("gemv", "sparse_up", "sparse_down")
                                   for t in ("f16", "q4_0", "q8_0")} <= fits
    assert set(res["device_fit"]["dense"]) == set(res["device_fit"]["sparse"]) == {"f16", "q4_0", "q8_0"}
    assert res["sanitizer"] == {"not run": "emulated device"}
    # 4. every placement, in paired rounds, against the CPU path step by step
    e2e = res["e2e"]
    runs = e2e["runs"]
    assert list(runs) == [gpu_e2e.CPU_PATH, "plan", "layers", "powerinfer", "cpu"]
    assert e2e["rounds"]["rounds_run"] == 2
    for name, r in runs.items():
        assert len(r["decode_tokens_per_s_rounds"]) == 2 and r["decode_tokens_per_s"] > 0
        assert set(r["per_token"]) == {"cpu_ms", "gpu_wait_ms", "transfer_ms"} and r["host_ms_per_token"] > 0
        assert r["cpu_bytes_per_token"] > 0 and r["cpu_gbs"] > 0
        assert r["tokens_equal_cpu_path"], name
        if name == gpu_e2e.CPU_PATH:
            continue
        vs = r["against_cpu_path"]
        assert vs["steps"] == 5 and vs["argmax_equal"] and max(vs["max_abs_logit_diff"]) < 1e-3, (name, vs)
    assert runs["cpu"]["plan"]["n_gpu"] == [0, 0] and sum(runs["layers"]["plan"]["n_gpu"]) > 0
    assert {"gpu_compute_ms", "gpu_copy_ms"} <= set(runs["plan"]["timed"])  # the extra decode with CUDA events
    assert len(set(e2e["forced_tokens"])) == 4  # distinct tokens, one per decode step
    assert {"plan_over_layers", "plan_over_powerinfer"} <= set(e2e)
    # 5. before and after the fit, and the fitted constants as a --hw file pi-plan reads back
    cal = e2e["calibration"]
    assert "error" not in cal, cal
    assert set(cal["runs"]) == set(runs) and cal["fitted_on"][0] == gpu_e2e.CPU_PATH
    for c in cal["runs"].values():
        assert c["predicted_before"] > 0 and c["predicted_after"] > 0
    assert abs(cal["runs"][gpu_e2e.CPU_PATH]["error_after"]) < 1e-6  # fitted on it
    hw = env / "fitted.toml"
    hw.write_text(cal["hw_file"])
    fitted = resolve_hardware(["rtx4090"], hw_file=hw)
    assert fitted.cpu.mem_bw_gbs == pytest.approx(cal["cpu_bw_gbs"], rel=1e-2)
    assert fitted.gpu_launch_us == pytest.approx(res["device_fit"]["gpu_launch_us"], rel=1e-2)
    assert "the fitted constants, as a pi-plan --hw file" in printed and "PASS" in printed


def test_paired_rounds_rotate_the_order(env):
    """Each placement leads one round in turn, so a drift of the machine's speed falls on every one alike."""
    seen = []

    class Fake:
        def __init__(self, name):
            self.name = name

    def decode(m, ids, tokens):
        seen.append(m.name)
        return {"tokens": [1], "decode_tokens_per_s": 1.0, "per_token": {}}

    models = {n: Fake(n) for n in "abc"}
    real = gpu_e2e.decode_round
    gpu_e2e.decode_round = decode
    try:
        out = gpu_e2e.paired_rounds(models, [1], 1, 3, gpu_e2e.Deadline(None))
    finally:
        gpu_e2e.decode_round = real
    assert seen == list("abc") + list("bca") + list("cab") and out["rounds_run"] == 3


def test_deadline_records_what_did_not_run(env, capsys):
    """A deadline spent by the kernel checks: the later phases are listed as not run, and the JSON is written."""
    out = env / "late.json"
    rc = gpu_check.main(ARGS + ["--deadline", "0.01", "--model", str(env / "never.gguf"), "--out", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and res["checks_pass"]
    assert res["not_run"] == ["kernel speed (deadline)", "end to end (deadline)"]
    assert "not run: kernel speed (deadline), end to end (deadline)" in capsys.readouterr().out
    assert not (env / "never.gguf").exists()  # the model being made in the background is stopped and removed


def test_sanitizer_share_and_absence(env, monkeypatch, capfd):
    """Too little time left for the sanitizers: recorded as not run, nothing started. Time enough but no
    compute-sanitizer on the machine: one line says so and the run goes on."""
    import argparse
    import shutil

    args = argparse.Namespace(out=str(env / "r.json"))
    not_run: list = []
    assert gpu_check.sanitize(args, 30, not_run) == {"sanitizer": "not run", "why": "deadline"}
    assert not_run == ["compute-sanitizer (deadline)"]
    if shutil.which("compute-sanitizer") or list(Path("/usr/local").glob("cuda*/bin/compute-sanitizer")):
        pytest.skip("compute-sanitizer is installed here")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    res = gpu_check.sanitize(args, 300, not_run)
    assert res == {"sanitizer": None, "why": "compute-sanitizer not installed"} and len(not_run) == 1
    assert capfd.readouterr().out.splitlines() == [
        "gpu-check: compute-sanitizer is not installed: the kernels ran without racecheck, synccheck and memcheck"]
