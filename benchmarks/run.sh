#!/usr/bin/env bash
# Run the benchmark suite with the project venv (created or reused by scripts/bootstrap.sh).
# Benchmark-only dependencies (matplotlib for the PNGs, llama-cpp-python for the llama.cpp peer)
# are installed into that venv if missing; llama-cpp-python has no wheel on the registry and is
# built from source (10+ minutes on 2 cores) unless FERRUM_BENCH_NO_LLAMA_CPP=1.
# Usage: bash benchmarks/run.sh [--quick] [--skip-variants] [--skip-llama-cpp] [--threads N]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
if [ -x .venv/bin/python ]; then py=.venv/bin/python; else bash scripts/bootstrap.sh >/dev/null; py=.venv/bin/python; fi
"$py" -c "import matplotlib" 2>/dev/null || "$py" -m pip install -q "matplotlib==3.11.2"
if [ "${FERRUM_BENCH_NO_LLAMA_CPP:-0}" != 1 ]; then
  "$py" -c "import llama_cpp" 2>/dev/null || CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
    "$py" -m pip install -q "llama-cpp-python==0.3.36" || echo "[bench] llama-cpp-python unavailable; that row is reported as not available" >&2
fi
export HF_HUB_OFFLINE=1
exec "$py" -m benchmarks.run "$@"
