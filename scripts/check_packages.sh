#!/usr/bin/env bash
# CI for the packages: what a user installs from a built artifact, outside this checkout.
#
#   license     LICENSE (Apache-2.0) is the one licence: each client ships the same file, and every
#               manifest (pyproject x2, Cargo.toml, package.json) declares Apache-2.0
#   python      the server and the Python client as wheels, installed into a NEW venv (dependencies
#               from PyPI; ferrum-client==0.1.0 from the built client wheel via --find-links): no
#               torch in it, `ferrum-service serve --model stub` answers a gRPC call made with the
#               installed client; py.typed and LICENSE in both wheels
#   npm         `npm pack` of clients/typescript installed into a scratch project, which imports it
#               as ESM, requires it as CommonJS and type-checks against its exported types
#   rust        the crate's protos match protos/ (clients/rust/sync-protos.sh), `cargo package`
#               builds the packaged crate on its own, the `tls` feature compiles
#   go          the module builds with the Go release its `go` directive names (clients/go/ci.sh
#               does the rest)
#
#   scripts/check_packages.sh                every part
#   FERRUM_PACKAGES="python npm" scripts/...  some parts
# Scratch files go to a temp dir (removed at exit); caches (pip, npm, cargo target) are reused.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
parts=${FERRUM_PACKAGES:-license python npm rust go}
cache=${FERRUM_CACHE_DIR:-$HOME/.cache/ferrum-service}
tmp=$(mktemp -d)
server_pid=
cleanup() {
  [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
log() { echo "[packages] $*"; }
failed=()

check_license() {
  local rc=0 f
  head -3 LICENSE | grep -q "Apache License" || { log "LICENSE is not the Apache License 2.0"; rc=1; }
  for f in clients/python/LICENSE clients/rust/LICENSE clients/typescript/LICENSE clients/go/LICENSE; do
    cmp -s LICENSE "$f" || { log "$f differs from LICENSE (copy it: cp LICENSE $f)"; rc=1; }
  done
  grep -q '^license = "Apache-2.0"' pyproject.toml || { log "pyproject.toml: license is not Apache-2.0"; rc=1; }
  grep -q '^license = "Apache-2.0"' clients/python/pyproject.toml || { log "clients/python: license is not Apache-2.0"; rc=1; }
  grep -q '^license = "Apache-2.0"' clients/rust/Cargo.toml || { log "Cargo.toml: license is not Apache-2.0"; rc=1; }
  grep -q '"license": "Apache-2.0"' clients/typescript/package.json || { log "package.json: license is not Apache-2.0"; rc=1; }
  return $rc
}

check_python() {
  local py=${PYTHON:-python3} venv="$tmp/venv" dist="$tmp/dist"
  "$py" -m venv "$venv" || return 1
  "$venv/bin/pip" install -q --upgrade pip || return 1
  log "building wheels (server, client)"
  # from copies of the sources, so setuptools' build/ and *.egg-info stay out of the checkout
  mkdir -p "$tmp/src/server" && cp -r pyproject.toml README.md LICENSE ferrum_service "$tmp/src/server/" || return 1
  cp -r clients/python "$tmp/src/client" && rm -rf "$tmp/src/client/build" || return 1
  find "$tmp/src" -name __pycache__ -prune -exec rm -rf {} +
  "$venv/bin/pip" wheel -q --no-deps -w "$dist" "$tmp/src/server" "$tmp/src/client" || return 1
  "$venv/bin/python" - "$dist" <<'EOF' || return 1
import sys, zipfile, pathlib
dist = pathlib.Path(sys.argv[1])
need = {"ferrum_service": ["ferrum_service/py.typed", "ferrum_service/executors/transformers/cpu_paged_attention.cpp"],
        "ferrum_client": ["ferrum_client/py.typed", "ferrum_client/_proto/ferrum/executor/v1/executor_pb2.py"]}
for name, files in need.items():
    (whl,) = dist.glob(f"{name}-0.1.0-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    missing = [f for f in files if f not in names]
    missing += [] if any(n.endswith(".dist-info/licenses/LICENSE") for n in names) else ["dist-info/licenses/LICENSE"]
    if missing:
        sys.exit(f"{whl.name} lacks {missing}")
    print(f"[packages] {whl.name}: {len(names)} files, py.typed and LICENSE in it")
EOF
  log "installing the server wheel into a new venv (ferrum-client from the built wheel)"
  "$venv/bin/pip" install -q --find-links "$dist" "$dist"/ferrum_service-0.1.0-*.whl || return 1
  # the client that came in is the one built here (same generated code), not another index's
  cmp -s clients/python/ferrum_client/_proto/ferrum/executor/v1/executor_pb2.py \
    "$("$venv/bin/python" -c 'import ferrum_client, os; print(os.path.dirname(ferrum_client.__file__))')/_proto/ferrum/executor/v1/executor_pb2.py" \
    || { log "the installed ferrum_client is not the one built from clients/python"; return 1; }
  if "$venv/bin/python" -c "import torch" 2>/dev/null; then
    log "torch is installed by the base wheel: it belongs to the models extra only"; return 1
  fi
  log "ferrum-service serve --model stub from the installed wheel (outside the checkout)"
  local port
  port=$("$venv/bin/python" -c 'from ferrum_service.testing.server_process import free_port; print(free_port())')
  (cd "$tmp" && exec "$venv/bin/ferrum-service" serve --model stub --host 127.0.0.1 --port "$port" \
      --metrics-port 0 >"$tmp/server.log" 2>&1) &
  server_pid=$!
  (cd "$tmp" && "$venv/bin/python" - "127.0.0.1:$port" <<'EOF')
import sys, time
import ferrum_service, ferrum_client
from ferrum_client import Client
for mod in (ferrum_service, ferrum_client):
    assert "site-packages" in mod.__file__, f"{mod.__name__} imported from {mod.__file__}, not the venv"
target = sys.argv[1]
with Client(target) as c:
    c.wait_ready(timeout=60)
    out = c.prefill("stub", [1, 2, 3]).output
    assert out.cache.num_tokens == 3 and out.output.token_id == 0, out
    c.release_cache("stub", out.cache.cache_id)
    print(f"[packages] wheel server at {target}: Prefill -> token {out.output.token_id}, "
          f"{out.cache.num_tokens} tokens cached; {ferrum_service.__file__}")
EOF
  local rc=$?
  kill "$server_pid" 2>/dev/null; wait "$server_pid" 2>/dev/null; server_pid=
  [ $rc -eq 0 ] || { log "server log:"; tail -20 "$tmp/server.log"; }
  return $rc
}

check_npm() {
  local pkg="$root/clients/typescript" scratch="$tmp/npm-scratch"
  command -v node >/dev/null || { log "node is not installed"; return 1; }
  export npm_config_cache="$cache/npm"
  (cd "$pkg" && npm ci --prefer-offline --no-audit --no-fund --loglevel=warn) || return 1
  log "npm pack (prepack builds dist/)"
  local tgz
  tgz=$(cd "$pkg" && npm pack --silent --pack-destination "$tmp" | tail -1) || return 1
  tar -tzf "$tmp/$tgz" >"$tmp/npm-files" || return 1
  for f in package/LICENSE package/README.md package/dist/esm/index.mjs package/dist/esm/index.d.mts \
      package/dist/src/index.js package/dist/src/index.d.ts; do
    grep -qx "$f" "$tmp/npm-files" || { log "$tgz has no $f"; return 1; }
  done
  node -e '
    const p = require(process.argv[1]);
    const e = p.exports && p.exports["."];
    if (p.private) throw new Error("package.json is private: npm publish would refuse it");
    for (const c of ["import", "require"]) {
      if (!e || !e[c] || !e[c].types || !e[c].default) throw new Error(`exports["."].${c} needs types and default`);
    }' "$pkg/package.json" || return 1
  mkdir -p "$scratch" && cd "$scratch" || return 1
  printf '{"name": "scratch", "version": "1.0.0", "private": true}\n' >package.json
  npm install --prefer-offline --no-audit --no-fund --loglevel=warn "$tmp/$tgz" \
    "typescript@$(node -p "require('$pkg/package.json').devDependencies.typescript")" \
    "@types/node@$(node -p "require('$pkg/package.json').devDependencies['@types/node']")" || return 1
  node --input-type=module -e '
    import { FerrumClient, tokenOf, pb } from "@ferrum-service/client";
    import { createRequire } from "node:module";
    if (typeof FerrumClient !== "function" || typeof tokenOf !== "function") throw new Error("ESM exports missing");
    if (typeof pb.PrefillRequest?.encode !== "function") throw new Error("ESM pb export missing");
    const cjs = createRequire(import.meta.url)("@ferrum-service/client");
    if (cjs.FerrumClient !== FerrumClient) throw new Error("ESM and CJS load two copies of the client");
    console.log("[packages] ESM import: FerrumClient, tokenOf, pb (the CJS instance)");' || return 1
  node -e '
    const { FerrumClient, tokenOf, pb } = require("@ferrum-service/client");
    if (typeof FerrumClient !== "function" || typeof tokenOf !== "function") throw new Error("CJS exports missing");
    if (typeof pb.PrefillRequest.encode !== "function") throw new Error("CJS pb export missing");
    console.log("[packages] CJS require: FerrumClient, tokenOf, pb");' || return 1
  cat >check.mts <<'EOF'
import { FerrumClient, pb } from "@ferrum-service/client";
const c: FerrumClient = new FerrumClient("127.0.0.1:1");
const req: pb.PrefillRequest = pb.PrefillRequest.fromPartial({ modelId: "m" });
c.close();
export { req };
EOF
  cat >check.cts <<'EOF'
import client = require("@ferrum-service/client");
const c: client.FerrumClient = new client.FerrumClient("127.0.0.1:1");
c.close();
EOF
  npx tsc --noEmit --strict --module node16 --moduleResolution node16 --types node check.mts check.cts || return 1
  log "types resolve through the exports map (node16, ESM and CJS)"
}

check_rust() {
  local here="$root/clients/rust"
  bash "$here/sync-protos.sh" --check || return 1
  if ! command -v cargo >/dev/null && [ -f "$HOME/.cargo/env" ]; then
    # shellcheck disable=SC1091
    . "$HOME/.cargo/env"
  fi
  command -v cargo >/dev/null || { log "cargo is not installed (clients/rust/ci.sh installs it)"; return 1; }
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$cache/cargo-target} CARGO_TERM_COLOR=never
  log "cargo package (builds the packaged crate from its own files)"
  # --allow-dirty: CI may run on a tree with uncommitted changes; the check is what the package holds
  (cd "$here" && cargo package --locked --allow-dirty 2>&1 | tail -5; exit "${PIPESTATUS[0]}") || return 1
  (cd "$here" && cargo package --locked --allow-dirty --list) >"$tmp/crate-files" || return 1
  grep -qx "proto/ferrum/executor/v1/executor.proto" "$tmp/crate-files" \
    || { log "the packaged crate has no proto/ tree"; return 1; }
  log "the tls feature builds (Client::connect_tls)"
  (cd "$here" && cargo check --locked --lib --features tls 2>&1 | tail -2; exit "${PIPESTATUS[0]}") || return 1
}

check_go() {
  bash "$root/clients/go/check-go-directive.sh"
}

for part in $parts; do
  log "=== $part"
  if ! "check_$part"; then
    failed+=("$part")
    log "$part: FAILED"
  fi
  cd "$root"
done
if [ ${#failed[@]} -gt 0 ]; then
  log "FAILED: ${failed[*]}"
  exit 1
fi
log "all package checks passed ($parts)"
