#!/usr/bin/env bash
# CI for clients/rust-execution (ferrum-execution 0.18.4's ModelExecutor over the contract): build,
# then `cargo test`: tests/mapping.rs (the protocol against live servers), tests/engine.rs (ferrum's
# 0.18 engine on a real model) and tests/upstream_*.rs
# (ferrum-engine 0.18.4's own integration tests, their executors served remotely). Each upstream
# test binary prints "[upstream-shim] 0 caches left ..." at exit, or fails naming the test.
#
# Same toolchain, server and cargo target dir as clients/rust/ci.sh (which installs cargo when
# missing): ${FERRUM_CACHE_DIR:-~/.cache/ferrum-service}/cargo-target, outside the clone, so the
# second run rebuilds only this crate. Exits non-zero on any failure.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$here"
log() { echo "[rust-execution] $*"; }

if ! command -v cargo >/dev/null && [ -f "$HOME/.cargo/env" ]; then
  # shellcheck disable=SC1091
  . "$HOME/.cargo/env"
fi
command -v cargo >/dev/null || { log "cargo not found (clients/rust/ci.sh installs it)"; exit 1; }
log "$(cargo --version), $(rustc --version)"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-${FERRUM_CACHE_DIR:-$HOME/.cache/ferrum-service}/cargo-target}
export CARGO_TERM_COLOR=never HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$CARGO_TARGET_DIR"
if [ -z "${FERRUM_SERVER_CMD:-}" ] && [ ! -x "$root/.venv/bin/ferrum-service" ]; then
  log "no server: set FERRUM_SERVER_CMD or run scripts/bootstrap.sh"
  exit 1
fi

t0=$SECONDS
log "build (ferrum-engine 0.18.4 and its tree on the first run)"
cargo build --locked --all-targets
log "build: $((SECONDS - t0)) s"
t1=$SECONDS
# mapping.rs starts a server per test (two load torch): one at a time on small machines.
cargo test --locked --test mapping -- --test-threads=1
# engine.rs: ferrum's 0.18 engine on a tiny real llama, tokens equal to Generate.
cargo test --locked --test engine
cargo test --locked --test 'upstream_*'
log "tests: $((SECONDS - t1)) s"
