#!/usr/bin/env bash
# Build the CPU image (deploy/build-image.sh; cached layers make rebuilds quick) and run it the way
# the Helm chart does (deploy/image_check.py). Run by scripts/test.sh where podman can be installed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cache=${FERRUM_CACHE_DIR:-$HOME/.cache/ferrum-service}
export CONTAINERS_CONF="$cache/podman/containers.conf"
t0=$SECONDS
image=$(bash deploy/build-image.sh)
echo "[image] build step: $((SECONDS - t0)) s"
export PATH="$cache/bin:$PATH"
[ -x "$cache/bin/helm" ] || bash deploy/ci.sh >/dev/null  # helm comes with the deployment checks
bash scripts/grpc_tools.sh >/dev/null
py=${FERRUM_PYTHON:-$root/.venv/bin/python}
"$py" deploy/image_check.py "$image"
echo "[image] all checks passed in $((SECONDS - t0)) s"
