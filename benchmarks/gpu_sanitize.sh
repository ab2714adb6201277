#!/usr/bin/env bash
# The GPU kernels' correctness checks (benchmarks/gpu_check.py --quick --checks-only) under compute-sanitizer's
# racecheck, synccheck and memcheck: what the CPU emulation's race detector cannot see (the memory model, the
# hardware's own scheduling). Part of `make gpu-check`. Where compute-sanitizer is not installed it says so in one
# line and exits 0, so that the rest of gpu-check still runs. Usage: gpu_sanitize.sh PYTHON OUT_JSON [SECONDS]
# (SECONDS per tool, default 100; benchmarks/gpu_check.py passes its share of the time left)
set -u
PY=${1:-python3}
OUT=${2:-benchmarks/results/gpu_sanitize.json}
PER_TOOL=${3:-100}
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
mkdir -p "$(dirname "$OUT")"
if [ -z "$CS" ]; then
  echo "gpu-check: compute-sanitizer is not installed: the kernels ran without racecheck, synccheck and memcheck"
  printf '{"sanitizer": null, "why": "compute-sanitizer not installed"}\n' > "$OUT"
  exit 0
fi
results=""
status=0
for tool in racecheck synccheck memcheck; do
  log=$(mktemp)
  start=$(date +%s)
  # the sanitizers slow kernels 10-100x, and gpu-check has 5 minutes in all
  timeout "$PER_TOOL" "$CS" --tool "$tool" --error-exitcode 3 "$PY" benchmarks/gpu_check.py --quick --checks-only \
    --out "$(dirname "$OUT")/sanitize-$tool.json" > "$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  case $rc in
    0) verdict=clean ;;
    3) verdict=errors; status=1 ;;
    124) verdict="timed out" ;;
    *) verdict="failed (rc $rc)"; status=1 ;;
  esac
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard" "$log" | tail -1 | tr -d '"\\')
  echo "gpu-check: compute-sanitizer $tool: $verdict in ${secs} s${summary:+ ($summary)}"
  [ "$verdict" = clean ] || tail -20 "$log"
  results="$results${results:+, }\"$tool\": {\"verdict\": \"$verdict\", \"seconds\": $secs, \"summary\": \"$summary\"}"
  rm -f "$log"
done
printf '{"sanitizer": "%s", %s}\n' "$CS" "$results" > "$OUT"
exit $status
