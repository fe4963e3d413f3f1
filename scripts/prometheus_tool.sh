#!/usr/bin/env bash
# Print the path of a Prometheus server binary for tests/test_monitoring_prometheus.py, installing
# Debian's `prometheus` package first when none is on PATH (as root, or with passwordless sudo).
# Exits non-zero, saying why on stderr, when there is none and it cannot be installed.
set -euo pipefail
if p=$(command -v prometheus); then echo "$p"; exit 0; fi
if ! command -v apt-get >/dev/null; then echo "[prometheus] no prometheus on PATH and no apt-get" >&2; exit 1; fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if sudo -n true 2>/dev/null; then sudo="sudo -n"; else echo "[prometheus] not root: cannot apt-get install" >&2; exit 1; fi
fi
echo "[prometheus] apt-get install prometheus (first run only)" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q >&2
$sudo apt-get install -y -q --no-install-recommends prometheus >&2
command -v prometheus
