"""`make cpu-check`: every CPU speed target of issues #26 and #28 on this machine's CPU, in one run, into one JSON.

    python benchmarks/cpu_check.py --powerinfer-git GITDIR         # builds the references, then measures (~20-30 min)
    python benchmarks/cpu_check.py --powerinfer MAIN --quantize Q --llama-cpp DIR --only smollm2,serve

The targets hold "on every build machine you get, AVX2-only ones included", and an AVX-512 figure has not predicted
an AVX2-only one (docs/results.md), so a session that lands on a CPU kind not measured yet should spend its time
measuring, not assembling commands. This is the CPU's counterpart of `make gpu-check`: references built from their
sources, each figure by the benchmark that owns it (each in its own process, its --json kept whole), the targets
judged at the end, all in benchmarks/cpu_runs/DATE-CPU-KIND.json with the CPU, its instruction sets and the commit.

1. The machine: the CPU's model and family, its instruction sets (AVX2, AVX-512, VNNI, AMX), cores, caches, the ISA
   pinfer's kernels were built for, the streaming bandwidth of --threads threads.
2. References, built here, never vendored (the build directories stay under build/ref, ignored by git):
   - llama.cpp: --llama-cpp SNAPSHOT_DIR, or llama-cpp-python's sdist (pip download from PyPI) whose vendor/llama.cpp
     is such a snapshot; built by benchmarks/build_llamacpp.sh (llama-bench, llama-server, llama-quantize).
     llama-cpp-python itself (decode.py's in-Python baseline) is installed from the same sdist when it is missing.
   - PowerInfer: --powerinfer-git GITDIR (a git directory, such as the session's fetch tool leaves under
     /work/.mirror: its HEAD's tree written out under build/ref, blobs the mirror lacks skipped) or
     --powerinfer-src SNAPSHOT_DIR, built with cmake (main, quantize); or its binaries given with --powerinfer MAIN
     --quantize QUANTIZE. Its source is on GitHub only, which the project's machines cannot reach. Without it the
     PowerInfer phase is skipped and says so.
3. The figures (phases; --only picks some):
   smollm2     decode.py --model smollm2 --tokens 128 --rounds 7 --llama-bench       #26: >= 1.3x llama.cpp
   hybrid      hybrid_overhead.py, 5 runs, the median                                #26: cpu_path_us_per_layer <= 25
   powerinfer  vs_powerinfer.py, PowerInfer's layout at --sparsity 0.96 (~6-7% active), F16 and its Q4_0
                                                       #26: F16 >= 1.2x, Q4_0 >= 1.5x, each >= 85% of the bytes bound
   dense1b     a planted 1B llama (llama.cpp's layout) quantised to Q4_0 by llama-quantize,
               decode.py --tokens 64 --prefill 512 --rounds 3 --llama-bench         #26: decode >= 1.0x, prefill >= 1.2x
   serve       serve_load.py --targets --max-tokens 128 --rounds 5 --llama-server  #28: its six targets
4. The targets, each with its figure and met or not, as a table and under "targets" in the JSON.

A phase that fails keeps its error in the JSON and the run goes on; the exit status is 0 when every phase ran,
1 otherwise. Run it on an idle machine: every figure is a paired ratio, but a busy neighbour still widens them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # the checkout, without an install

LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python (and vendored llama.cpp) the project's figures were measured with
PHASES = ("smollm2", "hybrid", "powerinfer", "dense1b", "serve")
CPUINFO = Path("/proc/cpuinfo")
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_tile", "amx_int8")


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------- machine

def machine(threads: int, probe: bool = True) -> dict:
    """What the figures ran on: /proc/cpuinfo's model and flags, lscpu's caches, the kernels' ISA, the bandwidth."""
    info: dict = {"threads": threads, "cores": os.cpu_count(), "python": platform.python_version()}
    try:
        text = CPUINFO.read_text()
    except OSError:
        text = ""
    first = text.split("\n\n", 1)[0]
    field = lambda k: (re.search(rf"^{k}\s*:\s*(.*)$", first, re.M) or [None, None])[1]  # noqa: E731
    flags = set((field("flags") or "").split())
    info |= {"cpu": field("model name") or platform.processor() or platform.machine(), "vendor": field("vendor_id"),
             "family": field("cpu family"), "model": field("model"),
             "isa": {f: f in flags for f in ISA_FLAGS}}
    info["kind"] = ("AVX-512" + (" + VNNI" if "avx512_vnni" in flags else "")
                    + (" + AMX" if "amx_int8" in flags else "")
                    if "avx512f" in flags else "AVX2-only" if "avx2" in flags else "no AVX2")
    try:
        caches = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        info["caches"] = {m[1]: m[2].strip() for m in re.finditer(r"^(L[1-3]d?) cache:\s*(.*)$", caches, re.M)}
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import torch

        from pinfer_llm.runtime.cpu import kernels

        info["kernels_isa"] = torch.ops.pinfer.isa() if kernels.available() else f"none: {kernels.status()}"
    except Exception as e:  # noqa: BLE001  (a machine fact that could not be read is reported, not fatal)
        info["kernels_isa"] = f"unknown: {e}"
    if probe:
        from pinfer_llm.planner.hardware import measure_cpu_bandwidth

        info["bandwidth_gbs"] = round(measure_cpu_bandwidth(threads), 1)
    return info


def commit() -> dict:
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    # dirty: tracked code that differs from the commit (the kernels and the benchmarks; not the records in cpu_runs/)
    return {"commit": git("rev-parse", "HEAD") or None,
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no", "--", "src", "benchmarks/*.py"))}


# ------------------------------------------------------------------------------------------------------- references

def run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout, **kw)


def tail(text: str, n: int = 400) -> str:
    """The end of a failed command's output, on one line: what the JSON keeps of it."""
    return " ".join(text.strip().split())[-n:]


def amx_off_args(isa: dict) -> list[str]:
    """llama.cpp's CMake options for this CPU's instruction sets less AMX: on the project's Xeon VMs the native build
    (ggml's AMX kernels) dies in any prompt (SIGSEGV / SIGILL) though the kernel grants AMX to processes."""
    on = lambda flag, opt: [f"-D{opt}={'ON' if isa.get(flag) else 'OFF'}"]  # noqa: E731
    return ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", *on("avx2", "GGML_AVX2"), *on("fma", "GGML_FMA"),
            *on("f16c", "GGML_F16C"), *on("avx512f", "GGML_AVX512"), *on("avx512_vnni", "GGML_AVX512_VNNI"),
            *on("avx_vnni", "GGML_AVX_VNNI"), "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def died(r: subprocess.CompletedProcess) -> str | None:
    """None when a smoke run worked, else how it ended (a signal, or the end of its output)."""
    if r.returncode < 0:
        return f"died of {signal.Signals(-r.returncode).name}"
    return f"exit {r.returncode}: {tail(r.stderr or r.stdout, 200)}" if r.returncode else None


def smoke_bench(binary: Path, model: str, threads: int) -> dict:
    """llama-bench on SmolLM2: a 32-token prompt, then 4 generated tokens, each run alone (the prompt is what an AMX
    build dies in); None where it worked."""
    out = {}
    for what, flags in (("prompt", ["-p", "32", "-n", "0"]), ("generation", ["-p", "0", "-n", "4"])):
        r = run([str(binary), "-m", model, *flags, "-r", "1", "-t", str(threads), "-o", "json"], 300)
        out[what] = died(r) or (None if '"avg_ts"' in r.stdout else f"no result: {tail(r.stdout + r.stderr, 200)}")
    return out


def smoke_python(model: str, threads: int) -> str | None:
    """decode.py's own llama-cpp-python worker, 8 tokens (a call of the Python API of another shape ran where this
    one died)."""
    return died(run([sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--worker", "llamacpp", "--model", model,
                     "--tokens", "8", "--threads", str(threads)], 300, cwd=ROOT))


def llama_cpp(args, refs: Path, isa: dict) -> dict:
    """llama.cpp's binaries (a snapshot built by build_llamacpp.sh) and llama-cpp-python (installed from the same
    sdist when missing), each tried on SmolLM2 first. Where the native build dies and the CPU has AMX, a build
    without AMX stands in where it must: llama-cpp-python, and llama-bench for prompts (its generation stays native,
    the stronger reference: AMX-repacked weights)."""
    from pinfer_llm.runtime.engine import resolve_model_path

    model, t = str(resolve_model_path("smollm2")), args.threads
    out: dict = {}

    def sdist() -> Path:  # llama-cpp-python's sdist, downloaded once into refs
        found = sorted(refs.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"))
        if not found:
            say(f"llama.cpp: downloading llama-cpp-python {LLAMA_CPP_PYTHON}'s sdist from PyPI")
            r = run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                     "-d", str(refs), f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], 600)
            found = sorted(refs.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"))
            if r.returncode or not found:
                raise RuntimeError(f"pip download llama-cpp-python: {tail(r.stderr)}")
        return found[0]

    src = Path(args.llama_cpp) if args.llama_cpp else None
    if src is None:
        src = refs / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
        if not (src / "CMakeLists.txt").exists():
            try:
                with tarfile.open(sdist()) as tf:
                    tf.extractall(refs, filter="data")
            except (RuntimeError, OSError, tarfile.TarError) as e:
                return {"error": str(e)}
    out["llama_cpp_src"] = str(src)
    names = ("llama-bench", "llama-server", "llama-quantize")

    def build(where: Path, *cmake: str) -> str | None:
        if all((where / "bin" / b).exists() for b in names):
            return None
        say(f"llama.cpp: building {where} ({', '.join(names)}; ~5-10 min on 2 cores)")
        r = run(["bash", str(ROOT / "benchmarks" / "build_llamacpp.sh"), str(src), str(os.cpu_count() or 2),
                 str(where), *cmake], 3600)
        return f"build_llamacpp.sh: {tail(r.stdout + r.stderr)}" if r.returncode else None

    if err := build(src / "build"):
        return out | {"error": err}
    native = src / "build" / "bin"
    out |= {b.replace("-", "_"): str(native / b) for b in names}
    out["llama_bench_prefill"] = out["llama_bench"]
    out["smoke_native"] = smoke = smoke_bench(native / "llama-bench", model, t)
    amx = isa.get("amx_tile") or isa.get("amx_int8")
    if smoke["prompt"] and amx:
        noamx = src / "build-noamx"
        if err := build(noamx, *amx_off_args(isa)):
            out["error_noamx"] = err
        else:
            out["smoke_noamx"] = smoke_bench(noamx / "bin" / "llama-bench", model, t)
            if not out["smoke_noamx"]["prompt"]:
                out["llama_bench_prefill"] = str(noamx / "bin" / "llama-bench")
                out["why_noamx"] = f"the native llama-bench {smoke['prompt']} in a prompt: prompts against AMX off"
    if smoke["generation"]:
        out["error"] = f"the native llama-bench {smoke['generation']} generating"
    try:
        if llama_python_features() is None:
            say(f"llama-cpp-python {LLAMA_CPP_PYTHON}: installing from its sdist (compiles llama.cpp again: ~5 min)")
            r = run([sys.executable, "-m", "pip", "install", "-q", str(sdist()), "psutil>=5"], 3600)
            if r.returncode:
                out["llama_cpp_python"] = f"not installed: {tail(r.stderr)}"
        if llama_python_features() is not None:
            out["llama_cpp_python"] = LLAMA_CPP_PYTHON
            why = smoke_python(model, t)
            if why and amx:
                say(f"llama-cpp-python {why}: installing it again with AMX off (~5 min)")
                r = run([sys.executable, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps",
                         str(sdist())], 3600, env=os.environ | {"CMAKE_ARGS": " ".join(amx_off_args(isa))})
                why2 = f"reinstall: {tail(r.stderr)}" if r.returncode else smoke_python(model, t)
                out["llama_cpp_python"] += f": {why2}" if why2 else f", AMX off (the native build {why})"
            elif why:
                out["llama_cpp_python"] += f": {why}"
    except RuntimeError as e:  # the sdist could not be had
        out["llama_cpp_python"] = f"not installed: {e}"
    out.setdefault("llama_cpp_python", "not installed")
    if features := llama_python_features():  # the installed build's, after any reinstall ("AMX_INT8 = 1" where on)
        out["llama_cpp_python_features"] = features
    return out


def llama_python_features() -> str | None:
    """What the installed llama-cpp-python was compiled with (llama.cpp's system info), None where it does not
    import (not installed, or built for instructions this CPU lacks)."""
    r = run([sys.executable, "-c", "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"], 60)
    return " ".join(r.stdout.split()) if r.returncode == 0 else None


def tree_from_git(gitdir: Path, out: Path) -> dict:
    """HEAD's tree of a (bare, possibly partial) git directory written out under out: a snapshot as the session's
    fetch tool leaves it, where some large blobs may be absent (skipped, and counted)."""
    git = ["git", f"--git-dir={gitdir}"]
    head = run([*git, "rev-parse", "HEAD"], 60).stdout.strip()
    ls = run([*git, "ls-tree", "-r", "-z", "HEAD"], 300)
    if ls.returncode or not head:
        raise RuntimeError(f"{gitdir}: not a git directory with a HEAD ({tail(ls.stderr)})")
    entries = []
    for rec in ls.stdout.split("\0"):
        if rec:
            meta, path = rec.split("\t", 1)
            mode, kind, sha = meta.split()
            if kind == "blob":
                entries.append((mode, sha, path))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    missing = 0
    with subprocess.Popen([*git, "cat-file", "--batch"], stdin=subprocess.PIPE, stdout=subprocess.PIPE) as cat:
        for mode, sha, path in entries:
            cat.stdin.write(sha.encode() + b"\n")
            cat.stdin.flush()
            header = cat.stdout.readline().split()
            if len(header) < 3 or header[1] != b"blob":  # "<sha> missing"
                missing += 1
                continue
            data = cat.stdout.read(int(header[2]))
            cat.stdout.read(1)  # the newline after the object
            dst = tmp / path
            dst.parent.mkdir(parents=True, exist_ok=True)
            if mode == "120000":
                dst.symlink_to(data.decode())
            else:
                dst.write_bytes(data)
                if mode == "100755":
                    dst.chmod(0o755)
        cat.stdin.close()
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return {"commit": head, "files": len(entries) - missing, "missing_blobs": missing}


def powerinfer(args) -> dict:
    """PowerInfer's main and quantize: given, or built from --powerinfer-src (its CPU build), or from the tree of
    --powerinfer-git written out first."""
    if args.powerinfer:
        return {"main": args.powerinfer, "quantize": args.quantize}
    snapshot = None
    if args.powerinfer_git:
        head = run(["git", f"--git-dir={args.powerinfer_git}", "rev-parse", "--short", "HEAD"], 60).stdout.strip()
        args.powerinfer_src = str(ROOT / "build" / "ref" / f"PowerInfer-{head or 'unknown'}")
        if not (Path(args.powerinfer_src) / "CMakeLists.txt").exists():
            say(f"PowerInfer: writing out the tree of {args.powerinfer_git} into {args.powerinfer_src}")
            try:
                snapshot = tree_from_git(Path(args.powerinfer_git), Path(args.powerinfer_src))
            except (RuntimeError, OSError) as e:
                return {"error": f"--powerinfer-git: {e}"}
    if not args.powerinfer_src:
        return {"error": "no PowerInfer: pass --powerinfer-git GITDIR or --powerinfer-src SNAPSHOT_DIR (its source "
                         "is on GitHub only; fetch a snapshot where GitHub is reachable) or --powerinfer MAIN "
                         "--quantize Q"}
    src = Path(args.powerinfer_src)
    if not (src / "CMakeLists.txt").exists():
        return {"error": f"--powerinfer-src {src}: no CMakeLists.txt; pass the root of a PowerInfer snapshot"}
    main, quant = src / "build" / "bin" / "main", src / "build" / "bin" / "quantize"
    if not (main.exists() and quant.exists()):
        say(f"PowerInfer: building {src} (main, quantize; ~2 min)")
        for cmd in (["cmake", "-S", str(src), "-B", str(src / "build"), "-DCMAKE_BUILD_TYPE=Release"],
                    ["cmake", "--build", str(src / "build"), "--config", "Release", "-j", str(os.cpu_count() or 2),
                     "--target", "main", "quantize"]):
            r = run(cmd, 1800)
            if r.returncode:
                return {"error": f"PowerInfer build ({cmd[1]}): {tail(r.stdout + r.stderr)}"}
    return {"main": str(main), "quantize": str(quant), "src": str(src), **({"snapshot": snapshot} if snapshot else {})}


# ----------------------------------------------------------------------------------------------------------- phases

def bench(script: str, *argv: str, timeout: float) -> dict:
    """One benchmark in its own process with --json; its JSON, or the error it ended with."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), *argv, "--json"]
    shown = "python " + " ".join(str(Path(c).relative_to(ROOT)) if c.startswith(str(ROOT) + "/") else c
                                 for c in cmd[1:])
    t0 = time.monotonic()
    try:
        r = run(cmd, timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "command": shown}
    took = round(time.monotonic() - t0, 1)
    if r.returncode:
        return {"error": tail(r.stderr or r.stdout), "command": shown, "wall_s": took}
    out = r.stdout.strip()
    try:  # the JSON is the whole stdout (decode.py, vs_powerinfer.py, serve_load.py) or its last line
        res = json.loads(out)
    except json.JSONDecodeError:
        res = json.loads(out.splitlines()[-1])
    return {"result": res, "command": shown, "wall_s": took}


def errors(ph: dict) -> dict[str, str]:
    """Each phase's error, and its prefill run's (dense1b), by phase."""
    out = {}
    for name, p in ph.items():
        for key, q in ((name, p), (name + " prefill", p.get("prefill_run") or {})):
            if "error" in q:
                out[key] = q["error"]
    return out


def dense_1b_file(work: Path, quantize: str) -> Path:
    """The planted 1B llama (22 x 2048 x 5632, GQA 32/4, 32k vocab) as llama.cpp's converter lays it out (synth's
    file, then e2e_sparse.dense_twin: ffn_down, no predictors, the GGUF magic), quantised to Q4_0 by llama-quantize
    (which keeps the head as Q6_K, as llama.cpp's Q4_0 files do): the dense files of docs/results.md."""
    from benchmarks.e2e_sparse import dense_twin

    pwri, f16, q4 = work / "dense-1b-pwri.gguf", work / "dense-1b-f16.gguf", work / "dense-1b-q4_0.gguf"
    if q4.exists():
        return q4
    if not f16.exists():
        say("dense1b: writing the planted 1B llama (F16, ~2 GB), then its llama.cpp layout")
        r = run([sys.executable, "-m", "pinfer_llm.synth", str(pwri), "--preset", "1b", "--dtype", "f16"], 3600,
                cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT / "src")})
        if r.returncode:
            raise RuntimeError(f"pinfer_llm.synth: {tail(r.stderr or r.stdout)}")
        dense_twin(pwri, f16)
        pwri.unlink()
    r = run([quantize, str(f16), str(q4) + ".tmp", "q4_0"], 1800)
    if r.returncode:
        raise RuntimeError(f"llama-quantize: {tail(r.stderr or r.stdout)}")
    os.replace(str(q4) + ".tmp", q4)
    f16.unlink()  # 2 GB no longer needed
    return q4


def dense_1b(lc: dict, work: Path, threads: str) -> dict:
    """The dense1b phase: decode against llama-bench, and prefill 512 in the same run where the native llama-bench
    takes prompts, else apart against the AMX-less one (prefill_run)."""
    if "llama_quantize" not in lc:
        return {"error": f"no llama-quantize: {lc.get('error')}"}
    q4 = str(dense_1b_file(work, lc["llama_quantize"]))
    same = lc["llama_bench_prefill"] == lc["llama_bench"]
    out = bench("decode.py", "--model", q4, "--tokens", "64", "--rounds", "3", "--threads", threads,
                *(["--prefill", "512"] if same else []), "--llama-bench", lc["llama_bench"], timeout=3600)
    if not same:
        out["prefill_run"] = bench("decode.py", "--model", q4, "--tokens", "16", "--prefill", "512", "--rounds", "3",
                                   "--threads", threads, "--llama-bench", lc["llama_bench_prefill"], timeout=3600)
    return out


def phases(args, refs: dict, work: Path) -> dict:
    out: dict = {}
    lc, pi = refs["llama_cpp"], refs["powerinfer"]
    lb = ["--llama-bench", lc["llama_bench"]] if "llama_bench" in lc else []
    t = str(args.threads)
    for name in args.only:
        say(f"phase {name}")
        t0 = time.monotonic()
        try:
            if name == "smollm2":
                out[name] = bench("decode.py", "--model", "smollm2", "--tokens", "128", "--rounds", "7",
                                  "--threads", t, *lb, timeout=3600)
            elif name == "hybrid":  # 3 s a run, and one run in a noisy second read 22.7 against 16: the median of 5
                runs = [bench("hybrid_overhead.py", timeout=1200) for _ in range(5)]
                ok = sorted((r for r in runs if "result" in r), key=lambda r: r["result"]["cpu_path_us_per_layer"])
                out[name] = ok[len(ok) // 2] if ok else runs[0]
                out[name]["runs_cpu_path_us_per_layer"] = [r["result"]["cpu_path_us_per_layer"] for r in ok]
            elif name == "powerinfer":
                out[name] = {"error": pi["error"]} if "error" in pi else bench(
                    "vs_powerinfer.py", "--powerinfer", pi["main"], "--quantize", pi["quantize"], "--dir", str(work),
                    "--sparsity", "0.96", "--rounds", "5", "--threads", t, timeout=3600)
            elif name == "dense1b":
                out[name] = dense_1b(lc, work, t)
            elif name == "serve":
                out[name] = bench("serve_load.py", "--targets", "--max-tokens", "128", "--rounds", "5", "--threads", t,
                                  "--llama-server", lc.get("llama_server", "none"), timeout=3600)
        except Exception as e:  # noqa: BLE001  (a phase's failure is recorded and the run goes on)
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        out[name]["phase_s"] = round(time.monotonic() - t0, 1)
        say(f"phase {name}: {'error: ' + out[name]['error'] if 'error' in out[name] else 'done'} "
            f"({out[name]['phase_s']:.0f} s)")
    return out


# ---------------------------------------------------------------------------------------------------------- targets

def _get(d: dict | None, *path):
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def judge(ph: dict) -> list[dict]:
    """Each target of #26 and #28 this run could measure: its figure, the bar, met or not (None: not measured)."""
    rows: list[dict] = []

    def row(issue: int, what: str, figure, bar: float, higher: bool = True):
        met = None if figure is None else (figure >= bar if higher else figure <= bar)
        rows.append({"issue": issue, "target": what, "figure": figure, "bar": (">= " if higher else "<= ") + f"{bar:g}",
                     "met": met})

    sm = _get(ph.get("smollm2"), "result", "paired_decode_ratio")
    row(26, "SmolLM2 Q4_1 decode / llama-cpp-python", _get(sm, "llamacpp", "median"), 1.3)
    row(26, "SmolLM2 Q4_1 decode / llama-bench", _get(sm, "llama-bench", "median"), 1.3)
    row(26, "cpu_path_us_per_layer", _get(ph.get("hybrid"), "result", "cpu_path_us_per_layer"), 25, higher=False)
    by_kind = {("Q4_0" if "q4_0" in Path(r["model"]).name.lower() else "F16"): r
               for r in _get(ph.get("powerinfer"), "result") or []}
    for kind, bar in (("F16", 1.2), ("Q4_0", 1.5)):
        r = by_kind.get(kind)
        active = f", {r['pinfer_active_fraction']:.1%} active" if r and r.get("pinfer_active_fraction") else ""
        row(26, f"PowerInfer's layout {kind}{active} / PowerInfer", _get(r, "paired_ratio_median"), bar)
        row(26, f"PowerInfer's layout {kind}: share of the bytes bound", _get(r, "bound", "pinfer_share_paired"), 0.85)
    d1 = _get(ph.get("dense1b"), "result")
    pre = _get(ph.get("dense1b"), "prefill_run", "result") or d1  # prefill measured apart (an AMX-less llama-bench)
    for e, name in (("llamacpp", "llama-cpp-python"), ("llama-bench", "llama-bench")):
        row(26, f"1B Q4_0 dense decode / {name}", _get(d1, "paired_decode_ratio", e, "median"), 1.0)
        row(26, f"1B Q4_0 prefill 512 / {name}", _get(pre, "paired_prefill_ratio", e, "median"), 1.2)
    s = _get(ph.get("serve"), "result")
    row(28, "SmolLM2, 4 streaming clients / one", _get(s, "pinfer_all_over_one"), 2.5)
    row(28, "4th client's first token, s", _get(s, "pinfer_last_ttft_s"), 1.5, higher=False)
    eq, n = _get(s, "answers_equal_pi_run"), _get(s, "answers")
    row(28, "greedy answers equal to pi-run's (share)", None if not n else round(eq / n, 3), 1.0)
    row(28, "aggregate / llama-server -np 4", _get(s, "pinfer_over_llama_all"), 1.0)
    row(28, "4th first token / llama-server's", _get(s, "ttft_last_pinfer_over_llama"), 1.0, higher=False)
    row(28, "planted ReLU, 4 clients / one", _get(s, "planted_relu", "all_over_one"), 2.0)
    row(28, "RSS after 1000 requests / after 10, growth", _get(s, "rss", "growth"), 0.10, higher=False)
    return rows


def render(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    m = res["machine"]
    t = Table(title=f"{m['cpu']} ({m['kind']}; kernels {m.get('kernels_isa')}), {m['threads']} threads, "
                    f"{m.get('bandwidth_gbs', '?')} GB/s, commit {str(res['commit']['commit'])[:10]}")
    for c in ("issue", "target", "figure", "bar", "met"):
        t.add_column(c, justify="right" if c in ("issue", "figure") else "left")
    for r in res["targets"]:
        met = "-" if r["met"] is None else "yes" if r["met"] else "NO"
        t.add_row(f"#{r['issue']}", r["target"], "not measured" if r["figure"] is None else f"{r['figure']:g}",
                  r["bar"], met)
    Console(stderr=True, width=max(100, shutil.get_terminal_size().columns)).print(t)
    for name, err in errors(res["phases"]).items():
        print(f"{name}: {err}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--powerinfer-src", metavar="DIR", help="a PowerInfer snapshot to build (main, quantize)")
    ap.add_argument("--powerinfer-git", metavar="GITDIR", help="a git directory of PowerInfer (the fetch tool's "
                    "mirror): its HEAD written out under build/ref, then built as --powerinfer-src")
    ap.add_argument("--powerinfer", metavar="MAIN", help="PowerInfer's main, built already (with --quantize)")
    ap.add_argument("--quantize", metavar="PATH", help="PowerInfer's quantize, with --powerinfer")
    ap.add_argument("--llama-cpp", metavar="DIR", help="a llama.cpp snapshot (built here when it is not already); "
                    f"default: llama-cpp-python {LLAMA_CPP_PYTHON}'s sdist from PyPI, under build/ref")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default=",".join(PHASES), help=f"comma list of phases: {', '.join(PHASES)}")
    ap.add_argument("--work", default=str(ROOT / "build" / "cpu-check"), help="the made models (~3 GB)")
    ap.add_argument("--out", help="the JSON (default benchmarks/cpu_runs/DATE-CPU-KIND.json)")
    args = ap.parse_args()
    args.only = [p.strip() for p in args.only.split(",") if p.strip()]
    if bad := [p for p in args.only if p not in PHASES]:
        raise SystemExit(f"--only: unknown phase '{bad[0]}' (one of {', '.join(PHASES)})")
    if args.powerinfer and not args.quantize:
        raise SystemExit("--powerinfer needs --quantize (PowerInfer's own, to make the Q4_0 file)")
    for flag, path in (("--powerinfer", args.powerinfer), ("--quantize", args.quantize)):
        if path and not (Path(path).is_file() and os.access(path, os.X_OK)):
            raise SystemExit(f"{flag} {path}: not an executable file")
    if shutil.which("cmake") is None:
        raise SystemExit("cmake is not installed: it builds the references (apt-get install cmake)")
    work, refdir = Path(args.work), ROOT / "build" / "ref"
    work.mkdir(parents=True, exist_ok=True)
    refdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    res: dict = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                 "commit": commit(), "machine": machine(args.threads)}
    say(f"{res['machine']['cpu']} ({res['machine']['kind']}), kernels {res['machine']['kernels_isa']}, "
        f"{res['machine']['bandwidth_gbs']} GB/s on {args.threads} threads")
    need_llama = any(p in args.only for p in ("smollm2", "dense1b", "serve"))
    res["references"] = {"llama_cpp": (llama_cpp(args, refdir, res["machine"]["isa"]) if need_llama
                                       else {"error": "not needed"}),
                         "powerinfer": powerinfer(args) if "powerinfer" in args.only else {"error": "not needed"}}
    res["phases"] = phases(args, res["references"], work)
    res["targets"] = judge(res["phases"])
    res["wall_s"] = round(time.monotonic() - t0, 1)
    slug = re.sub(r"[^a-z0-9]+", "-", f"{res['machine']['cpu']} {res['machine']['kind']}".lower()).strip("-")[:60]
    out = Path(args.out) if args.out else (ROOT / "benchmarks" / "cpu_runs" /
                                           f"{datetime.date.today().isoformat()}-{slug}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    os.replace(tmp, out)
    render(res)
    print(f"wrote {out}", file=sys.stderr)
    sys.exit(1 if errors(res["phases"]) else 0)


if __name__ == "__main__":
    main()
