#!/usr/bin/env bash
# CI for the Go client: tools, codegen check, build, vet, tests against live servers (each test
# package starts its own fresh ferrum-service; the conformance scenario gets a server of its own,
# twice: its top-level models, then profile llama-cpp with "tiny" on the llama.cpp executor),
# and the example scheduler. Exits non-zero on any failure.
#
# The server is $FERRUM_SERVER_CMD, else <repo>/.venv/bin/ferrum-service; without either the live
# tests skip (say so loudly) — except in CI (CI=true), where that fails. Go's module and build caches live outside the clone already; tools go
# to ${FERRUM_CACHE_DIR:-~/.cache/ferrum-service}/bin.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"
export GOFLAGS=${GOFLAGS:--buildvcs=false}
command -v go >/dev/null || { echo "[go] go is not installed" >&2; exit 1; }
echo "[go] $(go version)"

echo "[go] generated code is up to date"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
bash generate.sh "$tmp"
if ! diff -r "$tmp/gen" gen >/dev/null; then
  echo "[go] clients/go/gen is stale: run clients/go/generate.sh and commit" >&2
  diff -r "$tmp/gen" gen | head -20 >&2
  exit 1
fi

echo "[go] build + vet"
go build ./...
go vet ./...

if [ -z "${FERRUM_SERVER_CMD:-}" ] && [ ! -x "$here/../../.venv/bin/ferrum-service" ]; then
  if [ "${CI:-}" = "true" ]; then
    echo "[go] FAIL: CI=true but no server (FERRUM_SERVER_CMD unset, no .venv)" >&2
    exit 1
  fi
  echo "[go] WARNING: no server (FERRUM_SERVER_CMD unset, no .venv): live tests will SKIP" >&2
fi
echo "[go] go test"
rc=0
go test -count=1 -v -timeout 10m ./... 2>&1 | tee "$tmp/test.log" || rc=$?
echo "[go] summary: $(grep -c '^--- PASS' "$tmp/test.log" || true) tests passed," \
  "$(grep -c '^--- FAIL' "$tmp/test.log" || true) failed, $(grep -c '^--- SKIP' "$tmp/test.log" || true) skipped;" \
  "conformance (default, llama-cpp): $(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$tmp/test.log" | paste -sd '|' | sed 's/|/; /g')"
if [ "$rc" -ne 0 ]; then
  echo "[go] FAIL: go test exited $rc; failed: $(grep '^--- FAIL' "$tmp/test.log" | paste -sd ' ')" >&2
  exit "$rc"
fi

if [ -n "${FERRUM_SERVER_CMD:-}" ] || [ -x "$here/../../.venv/bin/ferrum-service" ]; then
  echo "[go] example scheduler"
  go run ./cmd/example-scheduler
fi
