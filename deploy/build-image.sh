#!/usr/bin/env bash
# Build the CPU image with podman, on a machine without a Docker engine or a reachable registry.
#
#   deploy/build-image.sh                 build ferrum-service:cpu (prints its size and build time)
#   FERRUM_IMAGE=name:tag deploy/build-image.sh
#
# The image is torch-free and its llama.cpp runs on any x86-64 CPU: the llama-cpp-python wheel comes
# from deploy/portable-llama-wheel.sh (built once per machine and cached; long on 2 cores).
#
# The Dockerfile's usual base is the official python:3.11 slim image. Where no container registry
# can be reached, this script makes an equivalent base from Debian's own packages once (debootstrap
# minbase + python3, python3-venv; ~80 s) and imports it with podman as
# localhost/ferrum-base:bookworm-py3, then builds deploy/docker/Dockerfile.cpu with that base as the
# PYTHON_IMAGE build argument. Set FERRUM_BASE_IMAGE to use another base you already have.
#
# podman runs here with the runc runtime, the cgroupfs cgroup manager and no default ulimits
# (a containers.conf written into the cache directory, exported as CONTAINERS_CONF); builds use the
# host network and the docker image format (the OCI format drops SHELL and HEALTHCHECK). The host's
# pip cache is mounted into the build, so wheels the host has are not fetched again.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cache=${FERRUM_CACHE_DIR:-$HOME/.cache/ferrum-service}
image=${FERRUM_IMAGE:-localhost/ferrum-service:cpu}
base=${FERRUM_BASE_IMAGE:-localhost/ferrum-base:bookworm-py3}
log() { echo "[image] $*" >&2; }

if ! command -v podman >/dev/null || ! command -v debootstrap >/dev/null; then
  log "installing podman, runc and debootstrap (Debian packages)"
  if [ "$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq podman runc debootstrap >/dev/null
fi
mkdir -p "$cache/podman"
export CONTAINERS_CONF="$cache/podman/containers.conf"
cat >"$CONTAINERS_CONF" <<'EOF'
[containers]
default_ulimits = []

[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
EOF

if ! podman image exists "$base"; then
  [ -z "${FERRUM_BASE_IMAGE:-}" ] || { log "base image $base not found"; exit 1; }
  rootfs="$cache/podman/rootfs-bookworm"
  log "making the base image from Debian packages (debootstrap minbase, once)"
  t0=$SECONDS
  rm -rf "$rootfs"
  # The machine's own Debian mirror (from its apt sources) when it names one, else debootstrap's.
  mirror=$(sed -n 's/^URIs: *\(\S*\/debian\)$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,passwd \
    bookworm "$rootfs" ${mirror:+"$mirror"} >"$cache/podman/debootstrap.log" 2>&1 \
    || { tail -20 "$cache/podman/debootstrap.log" >&2; exit 1; }
  ln -sf python3 "$rootfs/usr/bin/python"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | podman import --change 'CMD ["python3"]' - "$base" >/dev/null
  rm -rf "$rootfs"
  log "base $base made in $((SECONDS - t0)) s"
fi

mkdir -p "$HOME/.cache/pip"
# Where package downloads go through a TLS proxy, the build trusts what this machine trusts.
ca_args=()
ca=${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
if [ -f "$ca" ]; then
  ca_args=(-v "$ca:/run/build-ca.crt:ro" --build-arg PIP_CERT=/run/build-ca.crt)
fi
# The portable llama-cpp-python wheel (built once, cached under its key) is handed to the image's
# pip at a path that ends in its key: a new wheel changes the build argument and so rebuilds the
# layer that installs it (a mounted folder's contents are not part of the layer cache's key).
t0=$SECONDS
wheels=$(bash deploy/portable-llama-wheel.sh)
log "llama-cpp-python wheel: $wheels ($((SECONDS - t0)) s)"
key=$(basename "$wheels")
wheel_args=(-v "$wheels:/llama-wheels/$key:ro" --build-arg "LLAMA_WHEELS=/llama-wheels/$key")
log "building $image from deploy/docker/Dockerfile.cpu (base $base)"
t0=$SECONDS
build() {
  podman build --network host --layers --format docker \
    -f deploy/docker/Dockerfile.cpu \
    --build-arg PYTHON_IMAGE="$base" \
    --build-arg PIP_CACHE_DIR=/pip-cache \
    -v "$HOME/.cache/pip:/pip-cache" "${ca_args[@]}" "${wheel_args[@]}" "$@" . >&2
}
# The dependency stage gets a tag of its own, so the prune below keeps it (it is this build's cache)
# and drops what earlier builds left: each venv layer is gigabytes, and the disk is finite.
build --target build -t "$image-build"
build -t "$image"
podman image prune -f >/dev/null
size=$(podman image inspect "$image" --format '{{.Size}}')
log "built $image in $((SECONDS - t0)) s; size $((size / 1024 / 1024)) MiB"
echo "$image"
