#!/usr/bin/env bash
# CI for the Rust client (clients/rust): toolchain check, build, the example scheduler, then
# `cargo test` (unit tests, trait-level tests, typed-client test and the conformance scenario,
# each against a fresh ferrum-service on loopback). cargo test's summary lines close the output.
# Exits non-zero on any failure.
#
# The server is $FERRUM_SERVER_CMD (without "serve"), else <repo>/.venv/bin/ferrum-service; when
# neither exists the venv is made with scripts/bootstrap.sh. The cargo target dir lives outside the
# clone (${FERRUM_CACHE_DIR:-~/.cache/ferrum-service}/cargo-target) so reruns only rebuild this crate.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$here"
log() { echo "[rust] $*"; }

# Toolchain: rustup's cargo when present, else Debian's (the crate needs rustc >= 1.85).
if ! command -v cargo >/dev/null && [ -f "$HOME/.cargo/env" ]; then
  # shellcheck disable=SC1091
  . "$HOME/.cargo/env"
fi
if ! command -v cargo >/dev/null; then
  log "cargo not found: installing Debian's cargo + rustc"
  if [ "$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq cargo rustc >/dev/null
fi
log "$(cargo --version), $(rustc --version)"

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-${FERRUM_CACHE_DIR:-$HOME/.cache/ferrum-service}/cargo-target}
export CARGO_TERM_COLOR=never HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$CARGO_TARGET_DIR"

# A server to test against.
if [ -z "${FERRUM_SERVER_CMD:-}" ] && [ ! -x "$root/.venv/bin/ferrum-service" ]; then
  log "no server: bootstrapping the Python venv (scripts/bootstrap.sh)"
  venv=$(bash "$root/scripts/bootstrap.sh")
  export FERRUM_SERVER_CMD="$venv/bin/ferrum-service" FERRUM_PYTHON="$venv/bin/python"
fi
log "server: ${FERRUM_SERVER_CMD:-$root/.venv/bin/ferrum-service}"

bash "$here/sync-protos.sh" --check  # build.rs compiles the crate's copy of protos/
log "build (protoc from the protoc-bin-vendored crate)"
cargo build --locked --all-targets

log "example scheduler"
cargo run --locked -q --example scheduler

log "cargo test"
cargo test --locked
