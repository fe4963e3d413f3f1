"""Tiny random LoRA adapters over the tiny llama (written by PEFT) and their merged references."""

from __future__ import annotations

import pytest

from ferrum_service.testing.tiny_adapters import build_lora_adapter, build_merged_model

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture


@pytest.fixture(scope="session")
def adapters(tiny_llama_dir, tmp_path_factory):
    """``{name: (adapter dir, merged model dir)}``: a1 (every linear layer, rank 4), a2 (q/v only,
    rank 8, rsLoRA), a3 (MLP only, rank 2)."""
    root = tmp_path_factory.mktemp("lora")
    specs = {
        "a1": dict(seed=1, rank=4, alpha=8.0),
        "a2": dict(seed=2, rank=8, alpha=4.0, targets=("q_proj", "v_proj"), use_rslora=True, scale=3.0),
        "a3": dict(seed=3, rank=2, alpha=2.0, targets=("gate_proj", "up_proj", "down_proj"), scale=2.0),
    }
    out = {}
    for name, kw in specs.items():
        ad = build_lora_adapter(tiny_llama_dir, root / name, **kw)
        out[name] = (ad, build_merged_model(tiny_llama_dir, ad, root / f"{name}-merged"))
    return out
