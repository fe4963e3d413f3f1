#!/usr/bin/env bash
# Build the portable llama-cpp-python wheel for the CPU image once, and print its folder.
#
#   deploy/portable-llama-wheel.sh            -> ~/.cache/ferrum-service/wheels/<key> (holds the .whl)
#   deploy/portable-llama-wheel.sh --cached   the same folder if the wheel is built, else exit 1
#
# Unlike scripts/bootstrap.sh's wheel (compiled for this machine's CPU, -DGGML_NATIVE=ON), this one
# runs on any x86-64 node: ggml's CPU backend is built as one shared library per instruction-set
# level (GGML_BACKEND_DL + GGML_CPU_ALL_VARIANTS: x64, sse42, sandybridge, haswell, skylakex, zen4,
# alderlake, sapphirerapids, ...) and the best one the node supports is picked when the first model
# loads (ferrum_service/executors/llama_cpp/backends.py). The flags are the CPU Dockerfile's
# LLAMA_CMAKE_ARGS (one source); the version is pyproject.toml's pin. The folder is keyed by both
# and differs from bootstrap.sh's, whose native wheel is never touched. The build runs under `nice`
# (it compiles ggml's CPU backend once per variant: ~14x the native build's CPU work).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
base=${FERRUM_CACHE_DIR:-$HOME/.cache/ferrum-service}
log() { echo "[llama-wheel] $*" >&2; }
pin=$(grep -o '"llama-cpp-python==[^"]*"' pyproject.toml | tr -d '"')
flags=$(sed -n 's/^ARG LLAMA_CMAKE_ARGS="\(.*\)"$/\1/p' deploy/docker/Dockerfile.cpu)
[ -n "$pin" ] && [ -n "$flags" ] || { log "no llama-cpp-python pin or LLAMA_CMAKE_ARGS found"; exit 1; }
key=$(printf 'portable\n%s\n%s\n' "$pin" "$flags" | sha256sum | cut -c1-16)
wheels="$base/wheels/$key"
if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  [ "${1:-}" != --cached ] || exit 1
  py=${PYTHON:-python3}
  log "building $pin for any x86-64 CPU (CMAKE_ARGS: $flags) into $wheels; once, long on 2 cores"
  t0=$SECONDS
  tmp=$(mktemp -d "$base/wheels/.portable-XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  "$py" -m venv "$tmp/venv"
  "$tmp/venv/bin/pip" install -q --disable-pip-version-check "pip==26.3" >&2
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} CMAKE_ARGS="$flags" \
    nice -n 10 "$tmp/venv/bin/pip" wheel --no-deps --no-cache-dir --progress-bar off \
    -w "$tmp/out" "$pin" >"$tmp/build.log" 2>&1 || { tail -40 "$tmp/build.log" >&2; exit 1; }
  whl=$(ls "$tmp"/out/llama_cpp_python-*.whl)
  # The wheel must carry the per-variant CPU backends next to libggml.so, or nothing can load them.
  unzip -l "$whl" | grep -q 'llama_cpp/lib/libggml-cpu-x64\.so' \
    || { log "the wheel has no llama_cpp/lib/libggml-cpu-x64.so"; unzip -l "$whl" >&2; exit 1; }
  mkdir -p "$wheels"
  mv "$whl" "$wheels/"
  log "built in $((SECONDS - t0)) s"
fi
echo "$wheels"
