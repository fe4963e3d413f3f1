#!/usr/bin/env bash
# The one command of the prepared CUDA check, run on a lent GPU machine (benchmarks/README.md,
# "A CUDA check"): join the GGUF parts staged by scripts/stage_gpu_check.sh, check its digest,
# install the carried wheels into /tmp/site, then run benchmarks/gpu_check.py (the CUDA test file
# first, then the rows) with everything it writes under $OUT (default: ./gpu-out).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out" /tmp/smollm2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
cat .gpu-stage/smollm2.gguf.part* > /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 3
(cd /tmp/smollm2 && sed 's/smollm2.gguf/SmolLM2-135M-Instruct.Q4_1.gguf/' "$OLDPWD/.gpu-stage/smollm2.gguf.sha256" \
  | sha256sum -c -) || { echo "GGUF parts incomplete: carry every .gpu-stage part (README)"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 4
export PYTHONPATH=/tmp/site:$PWD:$PWD/clients/python HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
python3 -c 'import torch, triton, transformers, grpc; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__, "grpc", grpc.__version__)' | tee -a "$out/gpu.txt"
timeout 480 python3 -m benchmarks.gpu_check --gguf /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out "$out" "$@" \
  2>&1 | grep -v '\[debug' | tee "$out/gpu_check.log"
