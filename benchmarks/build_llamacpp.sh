#!/usr/bin/env bash
# Build llama.cpp's reference binaries (llama-bench, llama-cli, llama-server, llama-quantize) from a
# snapshot directory the caller provides, for benchmarks/decode.py --llama-bench.
# Nothing is vendored: the source stays wherever the caller keeps it (for example the
# vendor/llama.cpp tree of the llama-cpp-python sdist, `pip download --no-binary :all:`).
# Usage: benchmarks/build_llamacpp.sh SNAPSHOT_DIR [JOBS [BUILD_DIR [CMAKE_ARG...]]]
# Binaries land in BUILD_DIR/bin (default SNAPSHOT_DIR/build); SNAPSHOT_DIR/READY is written once the default
# build's exist. CMAKE_ARGs come after the defaults and override them (benchmarks/cpu_check.py builds a second
# tree with AMX off this way, for CPUs where the native build dies in a prompt).
# Run it under the machine lock: flock /tmp/pinfer-machine.lock benchmarks/build_llamacpp.sh ...
set -euo pipefail
src=${1:?usage: build_llamacpp.sh SNAPSHOT_DIR [JOBS]}
jobs=${2:-2}
build=${3:-$src/build}
extra=("${@:4}")
if [ ! -f "$src/CMakeLists.txt" ]; then
  echo "error: $src has no CMakeLists.txt; pass the root of a llama.cpp snapshot" >&2
  exit 2
fi
# GGML_NATIVE so the reference uses this CPU's ISA, like pinfer's native build;
# no curl: the binaries only read local GGUF files. Ninja where installed (a build
# directory keeps the generator it was configured with).
gen=()
if command -v ninja >/dev/null && [ ! -f "$build/CMakeCache.txt" ]; then gen=(-G Ninja); fi
cmake -S "$src" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON "${extra[@]}"
cmake --build "$build" --config Release -j "$jobs" \
  --target llama-bench llama-cli llama-server llama-quantize
for b in llama-bench llama-cli llama-server llama-quantize; do
  test -x "$build/bin/$b" || { echo "error: $b was not built" >&2; exit 1; }
done
if [ "$build" = "$src/build" ]; then touch "$src/READY"; fi
echo "built: $build/bin/{llama-bench,llama-cli,llama-server,llama-quantize}"
