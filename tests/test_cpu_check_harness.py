"""`make cpu-check` (benchmarks/cpu_check.py) without its references: what it says the CPU is, how it judges the
targets from the benchmarks' JSON, and that a benchmark that fails is recorded rather than ending the run. The
figures themselves come from the benchmarks it runs (each with its own tests); a whole run takes ~40 minutes.

Plants (each made a test below fail, then restored):
- machine()'s kind without the avx512f check (every AVX2 CPU called AVX-512): test_an_avx2_only_cpu_is_named_so;
- judge()'s row() comparing every figure as higher-is-better: test_targets_are_judged_from_the_benchmarks_json
  (cpu_path_us_per_layer, the first token and the RSS growth are lower-is-better);
- the F16 / Q4_0 rows told apart by "Q4_0" in the file's name, case-sensitively (the made files' names are lower
  case: every row F16): the same test;
- bench() returning json.loads of a failed run's stdout: test_a_failing_benchmark_is_recorded.
"""

from __future__ import annotations

import pytest

from benchmarks import cpu_check

XEON = """processor	: 0
vendor_id	: GenuineIntel
cpu family	: 6
model		: 143
model name	: Intel(R) Xeon(R) Platinum 8480+
flags		: fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512_vnni amx_tile amx_int8

processor	: 1
"""
ZEN3 = XEON.replace("GenuineIntel", "AuthenticAMD").replace("Intel(R) Xeon(R) Platinum 8480+", "AMD EPYC 7763") \
    .replace(" avx512f avx512bw avx512_vnni amx_tile amx_int8", "")


@pytest.mark.parametrize("text, kind", [(XEON, "AVX-512 + VNNI + AMX"), (ZEN3, "AVX2-only")])
def test_an_avx2_only_cpu_is_named_so(tmp_path, monkeypatch, text, kind):
    f = tmp_path / "cpuinfo"
    f.write_text(text)
    monkeypatch.setattr(cpu_check, "CPUINFO", f)
    m = cpu_check.machine(threads=2, probe=False)
    assert m["kind"] == kind
    assert m["isa"]["avx2"] and m["isa"]["avx512f"] == (kind != "AVX2-only")
    assert m["cpu"] in text and m["vendor"] in text
    assert m["kernels_isa"]  # the ISA the kernels were built for, or why there are none


def _phases(**over):
    """Each phase's result in the shape its benchmark's --json prints (the keys judge() reads), figures made up."""
    ph = {
        "smollm2": {"result": {"paired_decode_ratio": {"llamacpp": {"median": 1.29}, "llama-bench": {"median": 1.31}}}},
        "hybrid": {"result": {"cpu_path_us_per_layer": 26.0}},
        "powerinfer": {"result": [
            {"model": "/w/pi-1b-s0.96-f16.gguf", "paired_ratio_median": 1.25, "pinfer_active_fraction": 0.069,
             "bound": {"pinfer_share_paired": 0.91}},
            {"model": "/w/pi-1b-s0.96-q4_0.gguf", "paired_ratio_median": 1.45, "pinfer_active_fraction": 0.069,
             "bound": {"pinfer_share_paired": 0.84}}]},
        "dense1b": {"error": "llama-quantize: out of disk"},
        "serve": {"result": {"pinfer_all_over_one": 2.6, "pinfer_last_ttft_s": 1.6, "answers_equal_pi_run": 20,
                             "answers": 20, "pinfer_over_llama_all": 4.2, "ttft_last_pinfer_over_llama": 0.25,
                             "planted_relu": {"all_over_one": 1.99}, "rss": {"growth": 0.05}}},
    }
    return ph | over


def test_targets_are_judged_from_the_benchmarks_json():
    rows = {r["target"]: r for r in cpu_check.judge(_phases())}
    met = {k: r["met"] for k, r in rows.items()}
    assert met["SmolLM2 Q4_1 decode / llama-cpp-python"] is False  # 1.29 < 1.3
    assert met["SmolLM2 Q4_1 decode / llama-bench"] is True
    assert met["cpu_path_us_per_layer"] is False  # 26 > 25: lower is better
    assert met["PowerInfer's layout F16, 6.9% active / PowerInfer"] is True  # 1.25 >= 1.2
    assert met["PowerInfer's layout Q4_0, 6.9% active / PowerInfer"] is False  # 1.45 < 1.5 (Q4_0's bar)
    assert met["PowerInfer's layout F16: share of the bytes bound"] is True
    assert met["PowerInfer's layout Q4_0: share of the bytes bound"] is False
    # a phase that failed is "not measured", never met or missed
    assert all(r["figure"] is None and r["met"] is None for k, r in rows.items() if k.startswith("1B Q4_0"))
    assert len([k for k in rows if k.startswith("1B Q4_0")]) == 4
    assert met["4th client's first token, s"] is False  # 1.6 s > 1.5: lower is better
    assert met["4th first token / llama-server's"] is True
    assert met["RSS after 1000 requests / after 10, growth"] is True
    assert met["planted ReLU, 4 clients / one"] is False
    assert rows["greedy answers equal to pi-run's (share)"]["figure"] == 1.0
    # every row names its issue and its bar
    assert {r["issue"] for r in rows.values()} == {26, 28} and all(r["bar"][:2] in (">=", "<=") for r in rows.values())


def test_prefill_measured_apart_is_read_from_its_own_run():
    # where the native llama-bench dies in a prompt, dense1b's decode is against it and its prefill a second run
    dense = {"result": {"paired_decode_ratio": {"llama-bench": {"median": 1.5}}, "paired_prefill_ratio": {}},
             "prefill_run": {"result": {"paired_prefill_ratio": {"llama-bench": {"median": 1.77}}}}}
    rows = {r["target"]: r for r in cpu_check.judge(_phases(dense1b=dense))}
    assert rows["1B Q4_0 dense decode / llama-bench"]["figure"] == 1.5
    assert rows["1B Q4_0 prefill 512 / llama-bench"]["figure"] == 1.77
    assert cpu_check.errors(_phases(dense1b=dense)) == {}
    dense["prefill_run"] = {"error": "llama-bench worker died of SIGSEGV"}
    assert cpu_check.errors(_phases(dense1b=dense)) == {"dense1b prefill": "llama-bench worker died of SIGSEGV"}
    assert cpu_check.errors(_phases()) == {"dense1b": "llama-quantize: out of disk"}


def test_a_phase_not_run_is_not_measured():
    rows = cpu_check.judge({})
    assert rows and all(r["figure"] is None and r["met"] is None for r in rows)
    # the PowerInfer rows are there even without a PowerInfer (said "not measured", not left out)
    assert sum("PowerInfer" in r["target"] for r in rows) == 4


def test_a_failing_benchmark_is_recorded():
    bad = cpu_check.bench("decode.py", "--rounds", "many", timeout=120)
    assert "error" in bad and "result" not in bad
    assert "--rounds" in bad["error"] and "decode.py" in bad["command"]
    good = cpu_check.bench("hybrid_overhead.py", "--layers", "2", "--steps", "20", timeout=300)
    assert "error" not in good, good
    assert good["result"]["cpu_path_us_per_layer"] > 0
    assert good["command"].startswith("python benchmarks/hybrid_overhead.py")


def test_a_snapshot_is_written_out_from_a_git_directory(tmp_path):
    """--powerinfer-git: HEAD's tree of a bare repository written out (modes and links kept), a missing blob skipped
    and counted, as the fetch tool's partial mirrors need."""
    import os
    import subprocess

    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "CMakeLists.txt").write_text("project(x)\n")
    (src / "run.sh").write_text("#!/bin/sh\n")
    (src / "run.sh").chmod(0o755)
    (src / "sub" / "big.bin").write_bytes(bytes(range(256)) * 64)
    os.symlink("../CMakeLists.txt", src / "sub" / "link")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "x"]):
        subprocess.run([*git, "-C", str(src), *cmd], check=True)
    bare = tmp_path / "repo.git"
    subprocess.run([*git, "clone", "-q", "--bare", str(src), str(bare)], check=True)
    out = tmp_path / "tree"
    got = cpu_check.tree_from_git(bare, out)
    assert got["missing_blobs"] == 0 and got["files"] == 4
    assert (out / "CMakeLists.txt").read_text() == "project(x)\n"
    assert os.access(out / "run.sh", os.X_OK) and not os.access(out / "CMakeLists.txt", os.X_OK)
    assert (out / "sub" / "big.bin").read_bytes() == bytes(range(256)) * 64
    assert os.readlink(out / "sub" / "link") == "../CMakeLists.txt"
    # a blob the mirror lacks (its loose object removed): skipped, counted, the rest written
    sha = subprocess.run(["git", f"--git-dir={bare}", "rev-parse", "HEAD:sub/big.bin"], capture_output=True,
                         text=True, check=True).stdout.strip()
    (bare / "objects" / sha[:2] / sha[2:]).unlink()
    got = cpu_check.tree_from_git(bare, out)
    assert got == {"commit": got["commit"], "files": 3, "missing_blobs": 1}
    assert not (out / "sub" / "big.bin").exists() and (out / "run.sh").exists()
