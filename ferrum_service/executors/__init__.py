"""Executors behind the contract. The light ones are imported here; the heavy ones (transformers,
llama.cpp) are imported lazily by ``model_specs.build_executor`` when a spec names them."""

from .base import ModelExecutor
from .configurable import ConfigurableModelExecutor
from .stub import StubModelExecutor

__all__ = ["ModelExecutor", "ConfigurableModelExecutor", "StubModelExecutor"]
