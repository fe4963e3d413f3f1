"""Executors behind the contract. Import the heavy ones (transformers) lazily: see ``factory.py``."""

from .base import ModelExecutor
from .configurable import ConfigurableModelExecutor
from .stub import StubModelExecutor

__all__ = ["ModelExecutor", "ConfigurableModelExecutor", "StubModelExecutor"]
