"""What the two sentence encoders share (the transformers :mod:`.bert` one and the llama.cpp
:mod:`.llama_cpp.embedder` one): a prompt is embedded whole (no cache to continue), its cache
records the prompt with no KV behind it (the least recently used ones reclaimed past
``max_retained_handles``), the tokenizer is the encoder's own, and generation is refused."""

from __future__ import annotations

from typing import Any

from ..core import errors
from ..core.kv_registry import CacheEntry
from ..core.modes import CacheEvent
from ..core.types import (
    CacheHandle,
    DecodeInput,
    DecodeOutput,
    LogitsPolicy,
    PrefillInput,
    PrefillOutput,
    UnifiedItem,
    UnifiedResult,
    VerifyOutput,
)

NO_GENERATION = "BERT is an encoder model and does not support token generation; use Prefill to get embeddings"


class SentenceEncoder:
    """Mixed in before :class:`~.base.ModelExecutor`. The encoder sets ``self._tokenizer``,
    ``self.max_batch_size`` and ``self.max_retained_handles``; ``registry`` and ``release_cache``
    come from the executor."""

    _tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def handle(self, entry: CacheEntry) -> CacheHandle:
        """A zero-byte handle: the entry records the prompt, no KV exists behind it."""
        h = self.registry.handle(entry, memory_bytes=0)  # type: ignore[attr-defined]
        h.num_blocks = 0
        return h

    def prefill(self, inp: PrefillInput) -> PrefillOutput:
        """The prompt's embedding in ``PrefillOutput.embedding``, with a zero-byte cache handle."""
        return self.batch_prefill([inp])[0]  # type: ignore[attr-defined]

    def check_inputs(self, inputs: list[PrefillInput]) -> None:
        """UNIMPLEMENTED for an input that continues a cache (no chunked prefill); RESOURCE_EXHAUSTED
        past ``max_batch_size`` prompts in one call."""
        for k, inp in enumerate(inputs):
            if inp.cache_id:
                raise errors.unsupported(
                    f"inputs[{k}].cache_id: an encoder cannot continue a cache (no chunked prefill); "
                    "send the whole prompt", field=f"inputs[{k}].cache_id")
        if len(inputs) > self.max_batch_size:  # type: ignore[attr-defined]
            raise errors.exhausted(f"inputs: {len(inputs)} prompts in one call; the limit is "
                                   f"{self.max_batch_size}", field="inputs")  # type: ignore[attr-defined]

    def new_handle(self, tokens: list[int]) -> CacheHandle:
        """A cache recording ``tokens``, the least recently used ones reclaimed to make room."""
        reg = self.registry  # type: ignore[attr-defined]
        while len(reg) >= self.max_retained_handles:  # type: ignore[attr-defined]
            oldest = min(reg.entries(), key=lambda e: e.last_access)
            self.release_cache(oldest.cache_id, reason=CacheEvent.RECLAIMED)  # type: ignore[attr-defined]
        return self.handle(reg.create(tokens, field="input"))

    def decode(self, inp: DecodeInput) -> DecodeOutput:
        raise errors.unsupported(NO_GENERATION)

    def batch_decode(self, inputs: list[DecodeInput]) -> list[DecodeOutput]:
        raise errors.unsupported(NO_GENERATION)

    def unified_decode(self, items: list[UnifiedItem]) -> list[UnifiedResult]:
        raise errors.unsupported(NO_GENERATION)

    def forward_verify(self, cache_id: str, token_ids: list[int], policy: LogitsPolicy) -> VerifyOutput:
        raise errors.unsupported(NO_GENERATION)
