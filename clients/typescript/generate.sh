#!/usr/bin/env bash
# Regenerate clients/typescript/src/gen/ from protos/ with ts-proto (the version in package.json)
# through buf v1.50.0 (cached in ${FERRUM_CACHE_DIR:-~/.cache/ferrum-service}/bin; buf bundles the
# well-known types). The generated code is committed; ci.sh checks it is current.
#   ./generate.sh [DIR]   write DIR/src/gen instead (ci.sh uses a temp DIR)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bin=${FERRUM_CACHE_DIR:-$HOME/.cache/ferrum-service}/bin
if [ ! -x "$bin/buf" ] || ! "$bin/buf" --version 2>/dev/null | grep -q '^1\.50\.0$'; then
  echo "[ts] installing buf v1.50.0" >&2
  mkdir -p "$bin"
  GOBIN="$bin" go install github.com/bufbuild/buf/cmd/buf@v1.50.0
fi
[ -x "$here/node_modules/.bin/protoc-gen-ts_proto" ] || { echo "[ts] run npm ci first" >&2; exit 1; }
base=$(mkdir -p "${1:-$here}" && cd "${1:-$here}" && pwd)
rm -rf "$base/src/gen"
cd "$here"
PATH="$here/node_modules/.bin:$PATH" "$bin/buf" generate "$root/protos" --template buf.gen.yaml -o "$base" \
  --exclude-path "$root/protos/buf"
# protovalidate's annotations (protos/buf/validate, vendored) need no TypeScript code, but ts-proto
# emits every imported file: drop it, and the google.protobuf files only it imports (tsc would fail
# if anything still imported them).
rm -rf "$base/src/gen/buf"
for f in "$base"/src/gen/google/protobuf/*.ts; do
  name=$(basename "$f" .ts)
  grep -rqE "from \"[./]*google/protobuf/$name\"" "$base/src/gen" --include='*.ts' || rm -f "$f"
done
# ts-proto's forceLong=number throws on 64-bit values past 2^53, and int64 epoch nanoseconds
# (KvEvent.time_unix_ns, ...) are past it: convert with Number() instead (exact to 2^53, rounded beyond).
for f in $(grep -l 'Value is larger than Number.MAX_SAFE_INTEGER' -r "$base/src/gen"); do
  perl -0pi -e 's/\n  if \(num > globalThis\.Number\.MAX_SAFE_INTEGER\) \{\n    throw [^\n]*\n  \}\n  if \(num < globalThis\.Number\.MIN_SAFE_INTEGER\) \{\n    throw [^\n]*\n  \}//' "$f"
done
if grep -rq 'Value is larger than Number.MAX_SAFE_INTEGER' "$base/src/gen"; then
  echo "[ts] could not relax longToNumber in the generated code (ts-proto's output changed?)" >&2
  exit 1
fi
echo "[ts] generated $(find "$base/src/gen" -name '*.ts' | wc -l) files into $base/src/gen" >&2
