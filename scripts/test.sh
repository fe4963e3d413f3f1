#!/usr/bin/env bash
# Run every test of the project: the contract checks, the Python suite (server, executors, real
# models), then each client's and the deployment's own checks against live servers.
#
#   scripts/test.sh              everything
#   scripts/test.sh -k decode    extra arguments go to pytest (the other suites still run)
#   FERRUM_SKIP="rust go"        skip some of: protos python go typescript rust rust-execution
#                                packages deploy image
#
# First run on a fresh machine: installs the venv (torch, transformers, ...) into
# ~/.cache/ferrum-service; later runs reuse it while pyproject.toml is unchanged.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=$(bash scripts/bootstrap.sh) || { echo "bootstrap failed" >&2; exit 1; }
export PATH="$venv/bin:$PATH" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export FERRUM_SERVER_CMD="$venv/bin/ferrum-service"
skip=" ${FERRUM_SKIP:-} "
failed=()
run() {  # run NAME COMMAND...
  local name=$1; shift
  if [[ "$skip" == *" $name "* ]]; then echo "=== $name: skipped (FERRUM_SKIP)"; return; fi
  echo "=== $name"
  local t0=$SECONDS
  "$@"
  local rc=$?
  echo "=== $name: rc=$rc ($((SECONDS - t0)) s)"
  [ $rc -eq 0 ] || failed+=("$name")
}
pytest_suite() {
  python -m pytest -q -ra "$@"
  local rc=$?
  if [ $rc -eq 5 ]; then echo "pytest collected no tests" >&2; return 1; fi
  return $rc
}
# grpcurl, ghz and grpc-health-probe (Go modules, installed once) for the reflection/probe tests.
if tools=$(bash scripts/grpc_tools.sh); then export PATH="$tools:$PATH"; fi
# A Prometheus server (Debian's package, installed once) for tests/test_monitoring_prometheus.py.
if prom=$(bash scripts/prometheus_tool.sh); then export FERRUM_PROMETHEUS="$prom"; fi
# The SMG gateway in its own venv, for tests/test_smg_gateway.py (it skips, saying why, without one).
if gw=$(bash scripts/gateway_venv.sh); then export FERRUM_SMG_VENV="$gw"; fi
run protos bash scripts/check_protos.sh
run python pytest_suite "$@"
for part in go typescript rust rust-execution; do
  [ -f "clients/$part/ci.sh" ] && run "$part" bash "clients/$part/ci.sh"
done
# What users install: wheels in a new venv, the npm tarball, `cargo package`, the Go directive.
run packages bash scripts/check_packages.sh
[ -f deploy/ci.sh ] && run deploy bash deploy/ci.sh
# The CPU image, built with podman and run as the Helm chart runs it (needs root for apt/podman).
run image bash deploy/image-check.sh
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "all suites passed"
