#!/usr/bin/env bash
# CI for the TypeScript client: npm ci (cache outside the clone), codegen check, tsc, then
# `node --test` against live servers (each test file starts its own fresh server through
# tests/conformance/harness.py, which uses $FERRUM_SERVER_CMD or <repo>/.venv). Exits non-zero on
# any failure.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"
cache=${FERRUM_CACHE_DIR:-$HOME/.cache/ferrum-service}
export npm_config_cache="$cache/npm"
command -v node >/dev/null || { echo "[ts] node is not installed" >&2; exit 1; }
echo "[ts] node $(node --version), npm $(npm --version)"
npm ci --prefer-offline --no-audit --no-fund --loglevel=warn

echo "[ts] generated code is up to date"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
bash generate.sh "$tmp"
if ! diff -r "$tmp/src/gen" src/gen >/dev/null; then
  echo "[ts] clients/typescript/src/gen is stale: run clients/typescript/generate.sh and commit" >&2
  diff -r "$tmp/src/gen" src/gen | head -20 >&2
  exit 1
fi

echo "[ts] tsc"
rm -rf dist
npx tsc -p tsconfig.json

if [ -z "${FERRUM_SERVER_CMD:-}" ] && [ ! -x "$here/../../.venv/bin/ferrum-service" ]; then
  if [ "${CI:-}" = "true" ]; then
    echo "[ts] FAIL: CI=true but no server (FERRUM_SERVER_CMD unset, no .venv)" >&2
    exit 1
  fi
  echo "[ts] WARNING: no server (FERRUM_SERVER_CMD unset, no .venv): live tests will SKIP" >&2
fi
echo "[ts] example scheduler (batching, a fork, a handoff to a decode server)"
if [ -n "${FERRUM_SERVER_CMD:-}" ] || [ -x "$here/../../.venv/bin/ferrum-service" ]; then
  node dist/examples/scheduler.js
fi
echo "[ts] node --test"
node --test --test-concurrency=1 dist/test/ 2>&1 | tee "$tmp/test.log"
echo "[ts] summary: $(grep -E '^# (pass|fail|skipped) ' "$tmp/test.log" | tr '\n' ' ');" \
  "conformance (default, llama-cpp): $(grep -E '^# [0-9]+ passed, [0-9]+ failed$' "$tmp/test.log" | sed 's/^# //' | paste -sd '|' | sed 's/|/; /g')"
