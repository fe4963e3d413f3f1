#!/usr/bin/env bash
# Install (once) the gRPC command-line tools the tests drive the server with, and print their
# directory: grpcurl (reflection client), ghz (load generator), grpc-health-probe (the Kubernetes
# probe's tool). Go modules, built with `go install` into ${FERRUM_CACHE_DIR:-~/.cache/ferrum-service}/bin.
set -euo pipefail
bin=${FERRUM_CACHE_DIR:-$HOME/.cache/ferrum-service}/bin
mkdir -p "$bin"
tools=(
  "grpcurl github.com/fullstorydev/grpcurl/cmd/grpcurl@v1.9.3"
  "ghz github.com/bojand/ghz/cmd/ghz@v0.120.0"
  "grpc-health-probe github.com/grpc-ecosystem/grpc-health-probe@v0.4.63"
)
for t in "${tools[@]}"; do
  name=${t%% *} mod=${t#* }
  stamp="$bin/.$name-${mod##*@}"
  if [ ! -x "$bin/$name" ] || [ ! -f "$stamp" ]; then
    echo "[grpc-tools] go install $mod (first run only)" >&2
    (cd "$bin" && GOBIN="$bin" GOFLAGS=-mod=mod go install "$mod") >&2
    rm -f "$bin/.$name-"*
    touch "$stamp"
  fi
done
echo "$bin"
