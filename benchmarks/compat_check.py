"""Do PowerInfer's engine and llama.cpp still load and run files after pinfer wrote into them? Same greedy output?

    python benchmarks/compat_check.py --powerinfer PATH/TO/PowerInfer/build/bin/main \\
        --llama PATH/TO/llama.cpp/build/bin/llama-simple [--pwri MODEL.gguf] [--gguf MODEL.gguf] \\
        [--powerinfer-src PATH/TO/PowerInfer] [--llama-python PYTHON] [--workdir DIR] [-n 24] [--json]

The engines are given, never built here. On copies of the models (the originals are not touched):
Each engine's output is compared twice: greedy text (identical), and every chunk's perplexity over a held-out text
(PowerInfer's `perplexity`, llama.cpp's `llama-perplexity`, found beside the given binaries), which depends on all
logits; PowerInfer's vary a little between runs of one unchanged file, so they must agree within that spread.
- PWRI model (default: `python -m pinfer_llm.synth --preset tiny --dtype f16`, a ReluLLaMA-shaped PowerInfer file
  (its sparse kernels take F16 and Q4_0 only), with predictors from
  `pi-profile --train-predictors -o`, which puts them into the copy's header where PowerInfer looks; a given file
  whose header holds an earlier pinfer's tensors is first copied with formats.update.write_copy): PowerInfer's `main`
  generates greedily from the untouched file, then after `pi-profile` (in place), `pi-profile --train-predictors`
  (in place) and `pi-plan --gpu rtx4090 --export-gpuidx` (in place); each output must equal the first. The model's
  own bytes (header and tensor data) must be unchanged after every step. The .gpuidx is checked three ways: PowerInfer's
  loader parses it (`main -m FILE.gpuidx` must stop at the unknown architecture `generic.gpu_index`, not before:
  a type id it does not know kills it with SIGFPE), pinfer's reader replays the checks of its
  llama_gpu_split_loader (CUDA builds only) against the model, and, with --powerinfer-src, PowerInfer's own
  export_split.py (run with its own gguf-py) writes the same placement and the bytes must be identical.
- GGUF model (default: the demo SmolLM2): llama.cpp (`llama-simple`, or `llama-cli -no-cnv`) and, if installed,
  llama-cpp-python generate greedily from the untouched file, after `pi-profile --sparsity 0.3 --train-predictors`
  and after `pi-plan --gpu rtx4090` (both in place); outputs must be equal and gguf-py's GGUFReader must see the
  same tensors and keys as before.
Exit status 0 when every check passed. `--json` prints every step's outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_TREE = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_TREE), str(_TREE / "src")]  # the checkout, without an install

BIN = Path(sys.executable).parent


def run(cmd: list, timeout: float = 1800, env: dict | None = None, cwd: str | None = None) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, errors="replace", timeout=timeout,
                       env=env, cwd=cwd)
    return {"cmd": " ".join(map(str, cmd)), "rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr,
            "seconds": round(time.perf_counter() - t0, 2)}


def last_error(r: dict) -> str:
    lines = [ln for ln in (r["stderr"] + r["stdout"]).splitlines() if ln.strip()]
    keys = ("error", "GGML_ASSERT", "terminate", "what()", "invalid", "wrong")
    hits = [ln for ln in lines if any(k in ln for k in keys)]
    return (hits or lines or [""])[-1][:200]


class Engines:
    def __init__(self, args):
        self.args = args
        self.powerinfer = Path(args.powerinfer) if args.powerinfer else None
        self.llama = Path(args.llama) if args.llama else None
        self.python = args.llama_python or sys.executable  # an interpreter that can import llama_cpp
        self.llama_cpp_python = run([self.python, "-c", "import llama_cpp"])["rc"] == 0

    def powerinfer_generate(self, model: Path) -> dict:
        r = run([self.powerinfer, "-m", model, "-p", self.args.prompt, "-n", self.args.n, "-t", self.args.threads,
                 "--temp", 0, "--seed", 0], cwd=str(model.parent))
        r["text"] = r["stdout"] if r["rc"] == 0 else None
        return r

    def llama_generate(self, model: Path) -> dict:
        if "cli" in self.llama.name:
            cmd = [self.llama, "-m", model, "-p", self.args.prompt, "-n", self.args.n, "-t", self.args.threads,
                   "--temp", 0, "--seed", 0, "-no-cnv", "--no-warmup"]
        else:
            cmd = [self.llama, "-m", model, "-n", self.args.n, self.args.prompt]
        r = run(cmd, cwd=str(model.parent))
        r["text"] = r["stdout"] if r["rc"] == 0 else None
        return r

    def perplexity(self, binary: Path, model: Path) -> dict:
        """Every chunk's perplexity as the engine prints it ("[1]12.3456,[2]..."): a check on all logits, where
        greedy text from a small synthetic model can be the same token over and over."""
        text = model.parent / "ppl.txt"
        if not text.exists():
            corpus = Path(__file__).resolve().parent.parent / "src/pinfer_llm/runtime/profiling/corpus/heldout.txt"
            text.write_text(corpus.read_text(encoding="utf-8")[:6000], encoding="utf-8")
        r = run([binary, "-m", model, "-f", text, "-c", 128, "-b", 128, "-t", self.args.threads],
                cwd=str(model.parent))
        values = re.findall(r"\[(\d+)\]\s*([0-9.]+|nan|inf)", r["stdout"] + r["stderr"])
        r["text"] = " ".join(f"[{i}]{v}" for i, v in values) if r["rc"] == 0 and values else None
        return r

    def generators(self, kind: str) -> list:
        out = []
        if kind == "pwri" and self.powerinfer:
            out.append(("powerinfer", self.powerinfer_generate))
            ppl = self.powerinfer.parent / "perplexity"
            if ppl.exists():
                out.append(("powerinfer perplexity", lambda m, b=ppl: self.perplexity(b, m)))
        if kind == "gguf" and self.llama:
            out.append(("llama.cpp", self.llama_generate))
            ppl = self.llama.parent / "llama-perplexity"
            if ppl.exists():
                out.append(("llama.cpp perplexity", lambda m, b=ppl: self.perplexity(b, m)))
        if kind == "gguf" and self.llama_cpp_python:
            out.append(("llama-cpp-python", self.llama_cpp_python_generate))
        return out

    def llama_cpp_python_generate(self, model: Path) -> dict:
        code = ("import json, sys, llama_cpp\n"
                "m = llama_cpp.Llama(sys.argv[1], n_ctx=256, n_threads=int(sys.argv[4]), verbose=False, seed=0)\n"
                "out = m.create_completion(sys.argv[2], max_tokens=int(sys.argv[3]), temperature=0.0)\n"
                "print(json.dumps(out['choices'][0]['text']))\n")
        r = run([self.python, "-c", code, model, self.args.prompt, self.args.n, self.args.threads])
        r["text"] = json.loads(r["stdout"]) if r["rc"] == 0 else None
        return r


def model_bytes_digest(path: Path) -> str:
    """sha256 of the model's own bytes: header and tensor data (what other engines read)."""
    import hashlib

    from pinfer_llm.formats.reader import open_gguf

    f = open_gguf(path)
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        left = f.data_end
        while left:
            chunk = fh.read(min(left, 1 << 24))
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def gguf_py_view(path: Path):
    try:
        from gguf import GGUFReader

        r = GGUFReader(path)
        return sorted(t.name for t in r.tensors), sorted(k for k in r.fields if not k.startswith("GGUF."))
    except Exception as e:  # noqa: BLE001 - reported as the check's result
        return f"{type(e).__name__}: {e}"


class Report:
    def __init__(self):
        self.rows: list[dict] = []

    def add(self, model: str, step: str, check: str, ok: bool, detail: str = "", **extra):
        self.rows.append({"model": model, "step": step, "check": check, "ok": bool(ok), "detail": detail, **extra})
        mark = "ok  " if ok else "FAIL"
        print(f"[{mark}] {model:5s} {step:28s} {check:34s} {detail}", flush=True)

    @property
    def ok(self) -> bool:
        return all(r["ok"] for r in self.rows)


def ppl_values(text: str) -> list[float]:
    return [float(v.split("]")[1]) for v in text.split()]


def max_rel_diff(a: str, b: str) -> float:
    x, y = ppl_values(a), ppl_values(b)
    if len(x) != len(y):
        return float("inf")
    return max((abs(p - q) / max(abs(p), abs(q), 1e-30) for p, q in zip(x, y, strict=True)), default=0.0)


def check_engines(rep: Report, eng: Engines, kind: str, step: str, model: Path, base: dict, generators) -> None:
    """Greedy text must be identical. PowerInfer's perplexities vary between runs of one unchanged file (its sparse
    CPU kernels accumulate in a varying order), so those must agree within the spread the untouched file shows
    across runs (measured at the start), with a floor of 1e-4."""
    for name, gen in generators:
        r = gen(model)
        if step == "untouched":
            base[name] = r
            ok = r["text"] is not None
            detail = repr((r["text"] or last_error(r))[-70:])
            if ok and "perplexity" in name:
                again = gen(model)
                spread = max_rel_diff(r["text"], again["text"]) if again["text"] else float("inf")
                base[name]["spread"] = spread
                detail = f"untouched vs itself: max relative difference {spread:.1e}; {detail}"
            rep.add(kind, step, f"{name} runs", ok, detail, output=r["text"], rc=r["rc"])
            continue
        if base[name]["text"] is None:
            rep.add(kind, step, f"{name} runs", False, "the untouched file did not run either")
            continue
        if "perplexity" in name and r["text"] is not None:
            diff = max_rel_diff(r["text"], base[name]["text"])
            tol = max(2 * base[name]["spread"], 1e-4)
            same = diff <= tol
            rep.add(kind, step, f"{name}: same as untouched", same,
                    f"max relative difference {diff:.1e} (tolerance {tol:.1e})", output=r["text"], rc=r["rc"])
            continue
        same = r["text"] == base[name]["text"]
        why = last_error(r) if r["text"] is None else repr(r["text"][-70:])
        rep.add(kind, step, f"{name}: same output as untouched", same, "identical" if same else f"rc={r['rc']} {why}",
                output=r["text"], rc=r["rc"])


def run_steps(rep: Report, eng: Engines, kind: str, steps: list, model: Path, digest0: str, base: dict, generators,
              also=None) -> None:
    """Each pinfer command writes into `model` in place; then its bytes must still have the untouched file's digest
    (`also` adds checks) and the engines must give the untouched file's output."""
    for step, cmd in steps:
        r = pinfer(*cmd)
        rep.add(kind, step, "pinfer wrote in place", r["rc"] == 0, f"{r['seconds']} s" if r["rc"] == 0
                else last_error(r))
        if r["rc"]:
            continue
        rep.add(kind, step, "model bytes unchanged", model_bytes_digest(model) == digest0)
        if also:
            also(step)
        check_engines(rep, eng, kind, step, model, base, generators)


def pinfer(tool: str, *args) -> dict:
    return run([BIN / tool, *args])


def check_pwri(rep: Report, eng: Engines, args, work: Path) -> None:
    from pinfer_llm.formats.gpuidx import read_gpuidx
    from pinfer_llm.formats.reader import open_gguf
    from pinfer_llm.formats.update import pinfer_only, write_copy

    model = work / "pwri.gguf"
    if args.pwri:
        src = open_gguf(args.pwri)
        legacy = [n for n in src.header_tensors if pinfer_only(n, src)] or src.legacy_types
        if legacy:  # an earlier pinfer put its tensors into the header: PowerInfer cannot load that; a copy can
            write_copy(src, model)
            rep.add("pwri", "make model", "copy moves pinfer's header tensors", not open_gguf(model).legacy_types
                    and not any(pinfer_only(n, src) for n in open_gguf(model).header_tensors), ", ".join(legacy[:3]))
        else:
            shutil.copyfile(args.pwri, model)
        del src
    else:  # a synthetic ReluLLaMA with predictors pinfer trains; the copy puts them where PowerInfer looks
        synth = work / "synth.gguf"
        r = run([sys.executable, "-m", "pinfer_llm.synth", synth, "--preset", "tiny", "--dtype", "f16"])
        if r["rc"] == 0:
            r = pinfer("pi-profile", synth, "--train-predictors", "--tokens", args.train_tokens, "-o", model, "--json")
        rep.add("pwri", "make model", "synth tiny + pi-profile -tp -o", r["rc"] == 0, last_error(r) if r["rc"] else "")
        if r["rc"]:
            return
    digest0 = model_bytes_digest(model)
    gens = eng.generators("pwri")
    base: dict = {}
    check_engines(rep, eng, "pwri", "untouched", model, base, gens)
    f = open_gguf(model)
    cfg_layers = int(f.arch_get("{arch}.block_count"))
    n_ff = int(f.arch_get("{arch}.feed_forward_length"))
    del f
    steps = [("pi-profile", ["pi-profile", model, "--tokens", args.tokens, "--json"]),
             ("pi-profile --train-predictors", ["pi-profile", model, "--train-predictors", "--tokens",
                                                 args.train_tokens, "--json"]),
             ("pi-plan --export-gpuidx", ["pi-plan", model, "--gpu", "rtx4090", "--export-gpuidx", "--json"])]
    run_steps(rep, eng, "pwri", steps, model, digest0, base, gens)
    gpuidx = Path(str(model) + ".generated.gpuidx")
    if not gpuidx.exists():
        rep.add("pwri", "gpuidx", "pi-plan wrote .generated.gpuidx", False)
        return
    try:
        g = read_gpuidx(gpuidx, n_layer=cfg_layers, n_ff=n_ff)
        rep.add("pwri", "gpuidx", "split-loader checks (pinfer)", True,
                f"{g.n_layer} layers, {sum(int(m.sum()) for m in g.gpu_idx)} GPU neurons, vram {g.vram_capacity}")
    except Exception as e:  # noqa: BLE001
        rep.add("pwri", "gpuidx", "split-loader checks (pinfer)", False, str(e))
    r = run([eng.powerinfer, "-m", gpuidx, "-p", "x", "-n", 1], cwd=str(work))
    text = r["stdout"] + r["stderr"]
    parsed = "unknown model architecture" in text and "generic.gpu_index" in text
    rep.add("pwri", "gpuidx", "PowerInfer's loader parses it", parsed and r["rc"] in (0, 1),
            f"rc={r['rc']}: {last_error(r)}")
    if args.powerinfer_src:
        check_export_split(rep, Path(args.powerinfer_src), model, gpuidx, work)


def check_export_split(rep: Report, src: Path, model: Path, ours: Path, work: Path) -> None:
    """PowerInfer's own exporter (its gguf-py) writes a .gpuidx; pinfer writes the same placement: same bytes?"""
    from pinfer_llm.formats.gpuidx import read_gpuidx, write_gpuidx

    act = work / "activation"
    r = pinfer("pi-profile", model, "--export-activations", act)
    if r["rc"]:
        rep.add("pwri", "export_split", "pi-profile --export-activations", False, last_error(r))
        return
    counts = [int(m.sum()) for m in read_gpuidx(ours).gpu_idx]
    theirs = work / "powerinfer.gpuidx"
    code = ("import sys\n"
            "from powerinfer.export_split import export_split\n"
            "export_split(sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3].split(',')], int(sys.argv[4]))\n")
    env = dict(os.environ, PYTHONPATH=f"{src / 'gguf-py'}:{src / 'powerinfer-py'}", NO_LOCAL_GGUF="1")
    r = run([sys.executable, "-c", code, act, theirs, ",".join(map(str, counts)), 123456789], env=env)
    if r["rc"]:
        rep.add("pwri", "export_split", "PowerInfer's export_split ran", False, last_error(r))
        return
    g = read_gpuidx(theirs)
    mine = work / "pinfer.gpuidx"
    write_gpuidx(mine, g.gpu_idx, g.gpu_bucket, g.vram_capacity)
    same = mine.read_bytes() == theirs.read_bytes()
    rep.add("pwri", "export_split", "pinfer's bytes == PowerInfer's", same,
            f"{theirs.stat().st_size} bytes, {len(counts)} layers")


def check_gguf(rep: Report, eng: Engines, args, work: Path) -> None:
    from pinfer_llm.runtime.engine import resolve_model_path

    model = work / "model.gguf"
    shutil.copyfile(resolve_model_path(args.gguf), model)
    digest0 = model_bytes_digest(model)
    view0 = gguf_py_view(model)
    gens = eng.generators("gguf")
    base: dict = {}
    check_engines(rep, eng, "gguf", "untouched", model, base, gens)
    steps = [("pi-profile --sparsity 0.3 -tp", ["pi-profile", model, "--sparsity", "0.3", "--train-predictors",
                                                 "--tokens", args.train_tokens, "--json"]),
             ("pi-plan", ["pi-plan", model, "--gpu", "rtx4090", "--json"])]
    run_steps(rep, eng, "gguf", steps, model, digest0, base, gens,
              also=lambda step: rep.add("gguf", step, "gguf-py sees the same file", gguf_py_view(model) == view0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--powerinfer", help="PowerInfer's main binary")
    ap.add_argument("--llama", help="llama.cpp's llama-simple or llama-cli binary")
    ap.add_argument("--llama-python", help="a Python with llama-cpp-python installed (default: this one, if it has it)")
    ap.add_argument("--pwri", help="PWRI model to check (default: python -m pinfer_llm.synth --preset tiny)")
    ap.add_argument("--gguf", default="smollm2", help="standard GGUF model to check (default: smollm2)")
    ap.add_argument("--powerinfer-src", help="PowerInfer's source tree: compare with its export_split.py")
    ap.add_argument("--workdir", help="where the copies go (default: a temporary directory, removed)")
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("-n", type=int, default=24, help="tokens to generate")
    ap.add_argument("--threads", type=int, default=1, help="engine threads (default 1: PowerInfer's multithreaded "
                    "sparse kernels are not deterministic; with 2 threads an untouched tiny model's greedy tokens and "
                    "perplexities vary between runs, by 2e-2 once)")
    ap.add_argument("--tokens", type=int, default=2000, help="tokens pi-profile profiles")
    ap.add_argument("--train-tokens", type=int, default=4000, help="tokens pi-profile profiles to train predictors")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not (args.powerinfer or args.llama):
        ap.error("give --powerinfer and/or --llama (the binaries are not built by this script)")
    eng = Engines(args)
    rep = Report()
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="pinfer-compat-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        if eng.powerinfer:
            (work / "pwri").mkdir(exist_ok=True)
            check_pwri(rep, eng, args, work / "pwri")
        if eng.llama or eng.llama_cpp_python:
            (work / "gguf").mkdir(exist_ok=True)
            check_gguf(rep, eng, args, work / "gguf")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(rep.rows, indent=1))
    print(f"{sum(r['ok'] for r in rep.rows)}/{len(rep.rows)} checks passed")
    sys.exit(0 if rep.ok else 1)


if __name__ == "__main__":
    main()
