#!/usr/bin/env bash
# Create (or reuse) the virtual environment of the SMG gateway (Shepherd Model Gateway, a Rust
# gateway with a Python launcher, published as wheels) and print its path.
#
# The gateway gets its own venv, never the service's: its pins are its own. The venv lives outside
# the clone, keyed by this script (which holds the pin), so an unchanged script reuses it.
set -euo pipefail
SMG_VERSION=1.13.0
py=${PYTHON:-python3}
key=$(sha256sum "$0" | cut -c1-16)
base=${FERRUM_CACHE_DIR:-$HOME/.cache/ferrum-service}
venv="$base/smg-$key"
if [ ! -f "$venv/.complete" ]; then
  echo "[gateway_venv] creating $venv (smg==$SMG_VERSION)" >&2
  rm -rf "$venv"
  mkdir -p "$base"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
  "$venv/bin/pip" install --progress-bar off "smg==$SMG_VERSION" >&2
  "$venv/bin/smg" --help >/dev/null  # the launcher starts
  touch "$venv/.complete"
fi
echo "$venv"
