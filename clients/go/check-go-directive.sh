#!/usr/bin/env bash
# The module builds with the oldest Go its `go` directive admits: go.mod is tidy (no requirement
# would raise the directive), and build + vet (which type-checks the tests too) pass with exactly
# that release
# (fetched once through the Go proxy as a toolchain module into the module cache, then offline).
#
# Why 1.23.0: the client ranges over iterators (package `iter`, range-over-func: Go 1.23), and
# grpc-go is required at v1.74.3, the newest line whose own go.mod still says go 1.23.0 (v1.76
# says 1.24.0, v1.85 1.26.0). A user's newer grpc-go wins under minimal version selection.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"
export GOFLAGS=${GOFLAGS:--buildvcs=false}
directive=$(awk '$1 == "go" {print $2; exit}' go.mod)
[ -n "$directive" ] || { echo "[go] go.mod has no go directive" >&2; exit 1; }
echo "[go] go directive $directive; tidy with $(go version | awk '{print $3}')"
go mod tidy -diff
toolchain="go$directive"
echo "[go] build and vet (tests included) with $toolchain"
GOTOOLCHAIN=$toolchain go version
GOTOOLCHAIN=$toolchain go build ./...
GOTOOLCHAIN=$toolchain go vet ./...
echo "[go] the module builds with $toolchain"
