"""What the two sentence encoders share (the transformers :mod:`.bert` one and the llama.cpp
:mod:`.llama_cpp.embedder` one): a cache records a prompt with no KV behind it, and the model's
tokenizer is the encoder's own."""

from __future__ import annotations

from typing import Any

from ..core.kv_registry import CacheEntry
from ..core.types import CacheHandle


class EncoderCaches:
    """Mixed in before :class:`~.base.ModelExecutor`: zero-byte cache handles and the tokenizer
    the encoder loaded (``self._tokenizer``)."""

    _tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def handle(self, entry: CacheEntry) -> CacheHandle:
        """A zero-byte handle: the entry records the prompt, no KV exists behind it."""
        h = self.registry.handle(entry, memory_bytes=0)  # type: ignore[attr-defined]
        h.num_blocks = 0
        return h
