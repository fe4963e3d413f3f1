"""Test helpers: tiny random-weight models that load like real checkpoints (see :mod:`.tiny_models`).

``build_tiny_llama`` and ``build_tiny_bert`` are imported lazily, so that
``python -m ferrum_service.testing.tiny_models`` runs without a double import.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_tiny_bert", "build_tiny_llama"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import tiny_models

        return getattr(tiny_models, name)
    raise AttributeError(name)
