"""Test helpers: tiny random-weight models that load like real checkpoints (see :mod:`.tiny_models`)."""

from .tiny_models import build_tiny_bert, build_tiny_llama

__all__ = ["build_tiny_bert", "build_tiny_llama"]
