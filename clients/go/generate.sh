#!/usr/bin/env bash
# Regenerate clients/go/gen/ from protos/ (the committed code must equal what this writes).
#
# Tools, pinned, installed once into ${FERRUM_CACHE_DIR:-~/.cache/ferrum-service}/bin:
#   buf v1.50.0 (compiler; bundles the well-known types such as google/protobuf/struct.proto),
#   protoc-gen-go v1.36.12, protoc-gen-go-grpc v1.6.2.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bin=${FERRUM_CACHE_DIR:-$HOME/.cache/ferrum-service}/bin
mkdir -p "$bin"
install() {  # install BINARY MODULE@VERSION VERSION-STRING
  if [ ! -x "$bin/$1" ] || ! "$bin/$1" --version 2>&1 | grep -q -- "$3"; then
    echo "[go] installing $2" >&2
    GOBIN="$bin" go install "$2"
  fi
}
install buf github.com/bufbuild/buf/cmd/buf@v1.50.0 1.50.0
install protoc-gen-go google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12 v1.36.12
install protoc-gen-go-grpc google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.6.2 1.6.2
# ./generate.sh [DIR]: write DIR/gen (default: clients/go/gen); ci.sh uses a temp DIR to check.
base=$(mkdir -p "${1:-$here}" && cd "${1:-$here}" && pwd)
rm -rf "$base/gen"
cd "$here"
PATH="$bin:$PATH" "$bin/buf" generate "$root/protos" --template buf.gen.yaml -o "$base" \
  --exclude-path "$root/protos/buf"
echo "[go] generated $(find "$base/gen" -name '*.go' | wc -l) files into $base/gen" >&2
