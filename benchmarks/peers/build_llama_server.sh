#!/usr/bin/env bash
# Builds llama.cpp's own server (llama-server) as a benchmark peer, from the
# llama.cpp sources vendored in the llama-cpp-python sdist of the version that
# is installed, so both sides of a llama-server row run the same llama.cpp.
# The result is cached under ~/.cache/ferrum-service/llama-server-<version>/
# (the binary with its shared libraries beside it) and rebuilt only when it is
# missing. Prints the binary's path on its last line.
#
#   usage: benchmarks/peers/build_llama_server.sh [python]   (default: the venv's)
set -euo pipefail

PY="${1:-${PYTHON:-python3}}"
JOBS="${LLAMA_SERVER_JOBS:-2}"
VERSION="$("$PY" -c 'import llama_cpp; print(llama_cpp.__version__)')"
CACHE="${FERRUM_CACHE:-$HOME/.cache/ferrum-service}/llama-server-$VERSION"
BIN="$CACHE/llama-server"

if [[ -x "$BIN" ]] && "$BIN" --version >/dev/null 2>&1; then
    echo "$BIN"
    exit 0
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/llama-server-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
echo "building llama-server for llama-cpp-python $VERSION in $WORK" >&2

"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary llama-cpp-python \
    "llama-cpp-python==$VERSION" -d "$WORK/sdist" >&2
tar -xzf "$WORK"/sdist/llama_cpp_python-*.tar.gz -C "$WORK"
SRC="$(echo "$WORK"/llama_cpp_python-*/vendor/llama.cpp)"
[[ -f "$SRC/CMakeLists.txt" ]] || { echo "no vendored llama.cpp in the sdist" >&2; exit 1; }

start=$(date +%s)
nice -n 10 cmake -S "$SRC" -B "$WORK/build" \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_BUILD_RPATH='$ORIGIN' >&2
nice -n 10 cmake --build "$WORK/build" --target llama-server -j "$JOBS" >&2
echo "llama-server built in $(( $(date +%s) - start )) s" >&2

# The binary finds its shared libraries through its $ORIGIN rpath (set above)
# when they sit beside it; copy both, then move the folder into place at once.
STAGE="$CACHE.tmp.$$"
rm -rf "$STAGE" && mkdir -p "$STAGE"
cp "$WORK/build/bin/llama-server" "$STAGE/"
find "$WORK/build" -name '*.so*' \( -type f -o -type l \) -exec cp -P {} "$STAGE/" \;
rm -rf "$CACHE" && mkdir -p "$(dirname "$CACHE")" && mv "$STAGE" "$CACHE"
"$BIN" --version >&2
echo "$BIN"
