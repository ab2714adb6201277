#!/usr/bin/env bash
# The installable package, as a user gets it (`make wheel-check`, run by .ci/run after `make test`):
#  1. build the sdist and, from it, the wheel (python -m build), and an editable install with pip's newest release:
#     neither may print a warning (setuptools' included);
#  2. the wheel holds every module and data file of src/pinfer_llm (C++ and CUDA sources, the profiling corpus, the
#     GPU table), and so does the sdist;
#  3. a fresh venv gets torch==2.13.0 (the CPU build; an unpinned torch is a multi-GB CUDA build) and the wheel,
#     without a warning;
#  4. from a directory outside the checkout, the console scripts and python -m pinfer_llm.synth answer --help, and
#     a tiny planted model goes through all of them: synth makes it, pi-run decodes it (compiling the C++ kernels
#     from the wheel's sources into an empty cache), pi-profile trains its predictors on the packaged corpus,
#     pi-run --sparse uses them, pi-plan places it with the packaged GPU table; the CUDA sources load;
#  5. the install hints the tools print name extras that resolve (pip install --dry-run).
# Usage: .ci/wheel_check.sh [python3]. Keeps its venvs in a temporary directory (KEEP=1 keeps that, to look at).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${1:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/pinfer-wheel-check.XXXXXX")
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$WORK"' EXIT
T0=$SECONDS

say() { printf '== wheel-check [%3ds] %s\n' $((SECONDS - T0)) "$*"; }
fail() { echo "wheel-check: FAILED: $*" >&2; exit 1; }
# Everything pip and the build backend print goes to a log; a line saying "warning" fails the check, except this
# project's machines' pip configuration naming local index directories that may be absent (harmless), and pip
# retrying a download (the network, not the package).
no_warnings() {  # LOG WHAT
  local warned
  warned=$(grep -i 'warn' "$1" \
    | grep -v -E "^WARNING: Location 'file:///opt/pypi[^']*' is ignored: it is neither a file nor a directory\.$" \
    | grep -v -E "^WARNING: Retrying \(Retry\(total=" || true)
  [ -z "$warned" ] || { echo "$warned" >&2; fail "$(basename "$1" .log): warnings (above) from: $2"; }
}
logged() {  # LOG COMMAND...: run it, its output into LOG; it must succeed without a warning
  local log=$1; shift
  if ! "$@" >"$log" 2>&1; then cat "$log" >&2; fail "$* (log above)"; fi
  no_warnings "$log" "$*"
}

# Builds start from a copy of what a clone of this working tree holds (tracked and unignored files): a stale
# src/pinfer_llm.egg-info from an earlier install would otherwise feed its file list to the build (setuptools reads
# SOURCES.txt back), and a file dropped from package-data would still ship.
say "copy of the working tree, build venv, then the sdist and the wheel built from it"
TREE=$WORK/tree
mkdir -p "$TREE"
git -C "$ROOT" ls-files -z --cached --others --exclude-standard \
  | (cd "$ROOT" && tar --null -T - --ignore-failed-read -cf - 2>/dev/null) | tar -xf - -C "$TREE"
"$PY" -m venv "$WORK/build-venv"
BV=$WORK/build-venv/bin
logged "$WORK/pip-build.log" "$BV/python" -m pip install --upgrade pip build
# PYTHONDONTWRITEBYTECODE (set on this project's machines) makes setuptools warn that it skips byte-compiling
logged "$WORK/build.log" env -u PYTHONDONTWRITEBYTECODE "$BV/python" -m build --outdir "$WORK/dist" "$TREE"
WHEEL=$(ls "$WORK"/dist/pinfer_llm-*.whl)
SDIST=$(ls "$WORK"/dist/pinfer_llm-*.tar.gz)
say "editable install with $("$BV/pip" --version | cut -d' ' -f1-2) (-v: the backend's own output)"
logged "$WORK/editable.log" env -u PYTHONDONTWRITEBYTECODE "$BV/pip" install --no-deps -v -e "$TREE"

say "contents of $(basename "$WHEEL") and $(basename "$SDIST")"
"$BV/python" - "$ROOT" "$WHEEL" "$SDIST" <<'EOF'
import sys, tarfile, zipfile
from pathlib import Path

root, wheel, sdist = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
pkg = root / "src" / "pinfer_llm"
# the data files the runtime reads at run time, by the patterns pyproject.toml's package-data declares
data = {"runtime/cpu/csrc": ("*.cpp", "*.h"), "runtime/gpu/kernels": ("*.cu", "*.cuh"),
        "runtime/profiling/corpus": ("*.txt",), "planner": ("gpus.toml",)}
want = {f"pinfer_llm/{p.relative_to(pkg)}" for p in pkg.rglob("*.py") if "__pycache__" not in p.parts}
for d, pats in data.items():
    files = {f"pinfer_llm/{p.relative_to(pkg)}" for pat in pats for p in (pkg / d).glob(pat)}
    if not files:
        sys.exit(f"wheel-check: no {pats} files under src/pinfer_llm/{d} in the checkout")
    want |= files
have = set(zipfile.ZipFile(wheel).namelist())
missing = sorted(want - have)
if missing:
    sys.exit(f"wheel-check: the wheel lacks {len(missing)} files: {missing[:12]}")
stray = sorted(n for n in have if n.endswith((".so", ".pyc", ".o")) or n.startswith(("tests/", "benchmarks/")))
if stray:
    sys.exit(f"wheel-check: the wheel holds build products or non-package files: {stray[:12]}")
names = tarfile.open(sdist).getnames()
top = names[0].split("/")[0]
in_sdist = {n.removeprefix(f"{top}/src/") for n in names}
missing = sorted(want - in_sdist)
if missing:
    sys.exit(f"wheel-check: the sdist lacks {len(missing)} files: {missing[:12]}")
eps = zipfile.ZipFile(wheel).read(next(n for n in have if n.endswith(".dist-info/entry_points.txt"))).decode()
for script in ("pi-run", "pi-profile", "pi-plan", "pi-serve"):
    if f"{script} = " not in eps:
        sys.exit(f"wheel-check: the wheel declares no console script {script}")
print(f"  {len(want)} files of src/pinfer_llm in both, console scripts declared")
EOF

say "fresh venv: torch==2.13.0 (CPU), then the wheel"
"$PY" -m venv "$WORK/venv"
V=$WORK/venv/bin
logged "$WORK/pip-fresh.log" "$V/python" -m pip install --upgrade pip
if "$V/python" -m pip install torch==2.13.0 >"$WORK/torch.log" 2>&1; then
  no_warnings "$WORK/torch.log" "pip install torch==2.13.0"
else  # as make install: elsewhere, PyTorch's CPU index
  logged "$WORK/torch.log" "$V/python" -m pip install torch --index-url https://download.pytorch.org/whl/cpu
fi
logged "$WORK/install.log" "$V/python" -m pip install "$WHEEL"

say "from outside the checkout: --help of every tool"
OUT=$WORK/outside
mkdir -p "$OUT"
cd "$OUT"
export PATH="$V:$PATH" PINFER_CACHE_DIR="$WORK/cache" XDG_CACHE_HOME="$WORK/xdg"
unset PYTHONPATH
"$V/python" - "$ROOT" <<'EOF'
import sys
import pinfer_llm
from pathlib import Path
where = Path(pinfer_llm.__file__).resolve()
if Path(sys.argv[1]).resolve() in where.parents:
    sys.exit(f"wheel-check: pinfer_llm is imported from the checkout ({where}), not the installed wheel")
EOF
for tool in pi-run pi-profile pi-plan pi-serve "python -m pinfer_llm.synth"; do
  # shellcheck disable=SC2086 # "python -m ..." splits on purpose
  $tool --help >"$WORK/help.txt" 2>&1 || { cat "$WORK/help.txt" >&2; fail "$tool --help"; }
  grep -q "Usage" "$WORK/help.txt" || { cat "$WORK/help.txt" >&2; fail "$tool --help printed no usage"; }
done

say "a tiny planted model through synth, pi-run, pi-profile, pi-run --sparse, pi-plan"
python -m pinfer_llm.synth tiny.gguf --preset tiny --vocab bytes >"$WORK/synth.log" 2>&1 \
  || { cat "$WORK/synth.log" >&2; fail "python -m pinfer_llm.synth"; }
run_json() {  # pi-run ARGS... -> its JSON, checked: the asked tokens, and the C++ kernels built from the wheel
  pi-run tiny.gguf -p "Once upon a time" -n 8 -t 2 --temp 0 --json "$@" >"$WORK/run.json" 2>"$WORK/run.err" \
    || { cat "$WORK/run.err" >&2; fail "pi-run $*"; }
  python - "$WORK/run.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
assert len(r["tokens"]) == 8, r["tokens"]
assert r["cpu_kernels"].startswith("pinfer C++ kernels"), r["cpu_kernels"]
print(f"  pi-run --{r['ffn_mode']}: {r['timings']['decode_tokens_per_s']} tok/s, neurons computed "
      f"{r['ffn_active_fraction']}, {r['cpu_kernels']}")
if r["ffn_mode"] == "sparse":
    assert 0 < r["ffn_active_fraction"] < 0.5, r["ffn_active_fraction"]
EOF
}
run_json --dense
pi-profile tiny.gguf --train-predictors -t 2 --json >"$WORK/profile.json" 2>"$WORK/profile.err" \
  || { cat "$WORK/profile.err" >&2; fail "pi-profile --train-predictors"; }
python -c "import json, sys; s = json.load(open(sys.argv[1])); assert s['corpus'].startswith('built-in'), s['corpus']; \
print('  pi-profile:', s['corpus'])" "$WORK/profile.json"
run_json --sparse
pi-plan plan tiny.gguf --gpu rtx4090 --cpu-cores 2 --cpu-bw 20 --host-ram 16 >"$WORK/plan.txt" 2>&1 \
  || { cat "$WORK/plan.txt" >&2; fail "pi-plan plan"; }
pi-plan show tiny.gguf >"$WORK/show.txt" 2>&1 || { cat "$WORK/show.txt" >&2; fail "pi-plan show"; }
pi-plan gpus | grep -q rtx4090 || fail "pi-plan gpus does not list rtx4090"
python -c "from pinfer_llm.runtime.gpu import sources as s; n = sum(len(s.source(m)) for m in s.MODULES); \
assert n > 10000, n; print(f'  CUDA sources: {len(s.MODULES)} modules, {n} characters')"

say "the install hints' extras resolve"
for extra in gpu-cuda12 gpu-cuda13 solvers; do
  want=$(python - "$extra" <<'EOF'
import sys
from importlib.metadata import requires
reqs = [r for r in requires("pinfer-llm") if f'extra == "{sys.argv[1]}"' in r]
if not reqs:
    sys.exit(f"wheel-check: pinfer-llm has no extra {sys.argv[1]!r}")
print(reqs[0].split(";")[0].split(">")[0].split("=")[0].strip())
EOF
)
  logged "$WORK/extra-$extra.log" python -m pip install --dry-run "pinfer-llm[$extra]"
  grep -q -i "Would install.*${want}" "$WORK/extra-$extra.log" \
    || { cat "$WORK/extra-$extra.log" >&2; fail "pip install 'pinfer-llm[$extra]' would not install $want"; }
  echo "  pip install 'pinfer-llm[$extra]': would install $want"
done
say "passed"
