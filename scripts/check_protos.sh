#!/usr/bin/env bash
# Contract checks: buf lint, buf breaking against the last released contract, and the committed
# Python gencode being exactly what scripts/gen_protos.sh produces.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bin=${FERRUM_CACHE_DIR:-$HOME/.cache/ferrum-service}/bin
buf_version=v1.50.0
if [ ! -x "$bin/buf" ] || ! "$bin/buf" --version 2>/dev/null | grep -q "${buf_version#v}"; then
  echo "[protos] installing buf $buf_version" >&2
  GOBIN="$bin" go install "github.com/bufbuild/buf/cmd/buf@$buf_version"
fi
echo "[protos] buf lint"
"$bin/buf" lint protos
latest=$(ls protos/releases/*.binpb 2>/dev/null | sort -V | tail -n 1 || true)
if [ -n "$latest" ]; then
  echo "[protos] buf breaking against ${latest#protos/}"
  "$bin/buf" breaking protos --against "$latest"
else
  echo "[protos] no released contract yet: breaking check skipped"
fi
echo "[protos] generated Python code is up to date"
tmp=$(mktemp -d)
cp -r clients/python/ferrum_client/_proto "$tmp/before"
bash scripts/gen_protos.sh >/dev/null
if ! diff -r "$tmp/before" clients/python/ferrum_client/_proto >/dev/null; then
  echo "[protos] clients/python/ferrum_client/_proto is stale: run scripts/gen_protos.sh and commit" >&2
  diff -r "$tmp/before" clients/python/ferrum_client/_proto | head -20 >&2
  rm -rf "$tmp"
  exit 1
fi
rm -rf "$tmp"
echo "[protos] ok"
