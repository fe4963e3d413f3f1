"""``ConfigurableModelExecutor``: ferrum's scripted executor, with its exact semantics.

Mirrors ``crates/ferrum-testkit/src/configurable_executor.rs``:

* ``with_token_sequence(vocab_size, tokens)`` cycles through ``tokens``;
  ``with_eos_after(vocab_size, n, eos_token)`` emits 42, then EOS after ``n`` decode steps.
* Logits put ``10.0`` at the chosen token and ``0.0`` everywhere else (no normalisation); a token
  at or past the vocabulary leaves the row all zero.
* Prefill biases ``token_sequence[0]`` at every position and does not touch the step counter.
* Decode uses **one step counter shared by every sequence of the instance**: decode number ``k``
  (since the executor was created) biases ``token_sequence[k % len]`` (or EOS once ``k >= n``).
  So one request on a fresh instance yields ``[a, a, b, c, a, b, ...]`` for ``[a, b, c]``.
* ``forward_verify`` is the trait default: N+1 serial decodes (the counter advances N+1 times);
  ``unified_decode`` is unsupported; ``truncate_kv`` only moves the cache's length.

``counter="per_sequence"`` is ferrum 0.18's rule (testkit 0.18.4 restarts the script per
sequence): the step is the number of tokens decoded into that cache after its whole prompt (every
prefill chunk counts as prompt), so truncating a cache rewinds its script.
"""

from __future__ import annotations

import itertools

import numpy as np

from ..core.kv_registry import CacheRegistry
from ..core.types import (
    DecodeInput,
    DecodeOutput,
    ExecutorCapabilities,
    ExecutorStatus,
    ModelInfo,
    PrefillInput,
    PrefillOutput,
)
from .base import ModelExecutor
from .ferrum_fixed import ferrum_fixed_info


class ConfigurableModelExecutor(ModelExecutor):
    """Scripted logits. Build it with :meth:`with_token_sequence` or :meth:`with_eos_after`."""

    kind = "configurable"
    inline = True

    def __init__(
        self,
        vocab_size: int,
        token_sequence: list[int],
        *,
        eos_after: int | None = None,
        eos_token: int = 2,
        model_id: str = "configurable-mock",
        counter: str = "shared",
        kv_budget_tokens: int = 1 << 20,
    ) -> None:
        super().__init__()
        if vocab_size <= 0:
            raise ValueError("vocab_size must be positive")
        if not token_sequence:
            # ferrum panics here (index [0] and % 0); refuse at construction instead.
            raise ValueError("token_sequence must not be empty")
        if counter not in ("shared", "per_sequence"):
            raise ValueError("counter must be 'shared' or 'per_sequence'")
        self.vocab_size = vocab_size
        self.token_sequence = list(token_sequence)
        self.eos_after = eos_after
        self.eos_token = eos_token
        self.counter = counter
        self._decode_count = itertools.count()
        self.decode_count = 0
        self._info = ferrum_fixed_info(
            model_id, vocab_size, executor=self.kind, model_type_detail="mock", max_sequence_length=4096,
            dtype="fp32", version="configurable-1.0", eos_token_ids=[eos_token] if eos_after is not None else [],
        )
        self.registry = CacheRegistry(model_id, total_tokens=kv_budget_tokens, block_size=16, id_prefix="mock")

    @classmethod
    def with_token_sequence(cls, vocab_size: int, tokens: list[int], **kw) -> "ConfigurableModelExecutor":
        """ferrum's ``with_token_sequence``: cycles through ``tokens`` (EOS token 2, unused)."""
        return cls(vocab_size, tokens, **kw)

    @classmethod
    def with_eos_after(cls, vocab_size: int, n: int, eos_token: int, **kw) -> "ConfigurableModelExecutor":
        """ferrum's ``with_eos_after``: token 42, then ``eos_token`` from decode step ``n`` on."""
        return cls(vocab_size, [42], eos_after=n, eos_token=eos_token, **kw)

    def _row(self, token: int) -> np.ndarray:
        row = np.zeros(self.vocab_size, dtype=np.float32)
        if 0 <= token < self.vocab_size:
            row[token] = 10.0
        return row

    def scripted_token(self, step: int) -> int:
        """The token decode step ``step`` biases."""
        if self.eos_after is not None and step >= self.eos_after:
            return self.eos_token
        return self.token_sequence[step % len(self.token_sequence)]

    def info(self) -> ModelInfo:
        return self._info

    def capabilities(self) -> ExecutorCapabilities:
        return ExecutorCapabilities(
            max_batch_size=256,
            max_sequence_length=4096,
            attention_mechanisms=["multi_head"],
            supports_dynamic_batching=True,
            supports_continuous_batching=True,
            supported_dtypes=["fp32"],
            supported_devices=["cpu"],
            kv_block_size=16,
        )

    def status(self) -> ExecutorStatus:
        st = super().status()
        st.decode_operations = self.decode_count
        return st

    def prefill(self, inp: PrefillInput) -> PrefillOutput:
        if inp.cache_id:
            entry = self.registry.get(inp.cache_id)
            self.registry.extend(entry, inp.token_ids)
            # A later prompt chunk: its tokens are prompt, not decoded (the per-sequence script).
            entry.payload = {"prompt_len": entry.num_tokens}
        else:
            entry = self.registry.create(inp.token_ids, reserve_tokens=inp.reserve_tokens)
            entry.payload = {"prompt_len": len(inp.token_ids)}
        row = self._row(self.token_sequence[0])
        all_logits = np.broadcast_to(row, (len(inp.token_ids), row.size)) if inp.all_positions else None
        return PrefillOutput(cache=self.handle(entry), logits=row, all_logits=all_logits)

    def decode(self, inp: DecodeInput) -> DecodeOutput:
        entry = self.registry.get(inp.cache_id)
        if self.counter == "shared":
            step = next(self._decode_count)
        else:
            prompt_len = (entry.payload or {}).get("prompt_len", 0)
            step = max(0, entry.num_tokens - prompt_len)
        self.decode_count += 1
        self.registry.extend(entry, [inp.token_id])
        return DecodeOutput(cache=self.handle(entry), logits=self._row(self.scripted_token(step)))
