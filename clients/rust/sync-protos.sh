#!/usr/bin/env bash
# Copy the repository's protos/ tree (every .proto file) into this crate's proto/, so the crate is
# self-contained: build.rs compiles from proto/, and `cargo package` ships it.
#   ./sync-protos.sh           copy (run after changing protos/, and commit proto/)
#   ./sync-protos.sh --check   exit 1 when proto/ differs from protos/ (CI: scripts/check_packages.sh)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src="$here/../../protos"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/proto" && (cd "$src" && find . -name '*.proto' -print0 | tar --null -cf - -T -) | tar -xf - -C "$tmp/proto"
if [ "${1:-}" = "--check" ]; then
  if ! diff -r "$tmp/proto" "$here/proto" >/dev/null 2>&1; then
    echo "[rust] clients/rust/proto differs from protos/: run clients/rust/sync-protos.sh and commit" >&2
    diff -r "$tmp/proto" "$here/proto" | head -20 >&2
    exit 1
  fi
  echo "[rust] clients/rust/proto matches protos/ ($(find "$here/proto" -name '*.proto' | wc -l) files)"
  exit 0
fi
rm -rf "$here/proto"
mv "$tmp/proto" "$here/proto"
echo "[rust] copied $(find "$here/proto" -name '*.proto' | wc -l) .proto files into clients/rust/proto"
