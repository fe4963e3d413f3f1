"""``StubModelExecutor``: ferrum's pipeline-test executor (all-zero logits, no model).

Mirrors ``crates/ferrum-models/src/executor/stub_executor.rs``: prefill and decode return zero
logits, ``info``/``capabilities`` carry ferrum's fixed figures, every other method keeps the trait
default. It is a feature of the contract (for testing a scheduler's plumbing), never a stand-in
for a real model.

Note on greedy ties: ferrum's engine-side greedy sampler picks the *last* maximal index, so on
all-zero logits it samples ``vocab_size - 1``; this service's server-side greedy picks the first
(like torch/transformers), i.e. token 0. Ask for ``OUTPUT_MODE_FULL_LOGITS`` to sample yourself.
"""

from __future__ import annotations

import numpy as np

from ..core.kv_registry import CacheRegistry
from ..core.types import (
    CacheHandle,
    DecodeInput,
    DecodeOutput,
    ExecutorCapabilities,
    ExecutorStatus,
    KvCapacity,
    MemoryRequirements,
    ModelInfo,
    PrefillInput,
    PrefillOutput,
)
from .base import ModelExecutor
from .ferrum_fixed import ferrum_fixed_info

MIB = 1024 * 1024


class StubModelExecutor(ModelExecutor):
    """ferrum's ``StubModelExecutor::new(model_id, vocab_size, _)``."""

    kind = "stub"
    inline = True

    def __init__(self, model_id: str = "stub", vocab_size: int = 32000, *, kv_budget_tokens: int = 1 << 20) -> None:
        super().__init__()
        if vocab_size <= 0:
            raise ValueError("vocab_size must be positive")
        self._info = ferrum_fixed_info(
            model_id, vocab_size, executor=self.kind, model_type_detail="stub", max_sequence_length=2048,
            dtype="fp16", version="mvp-stub", license="Apache-2.0",
        )
        self.registry = CacheRegistry(
            model_id, total_tokens=kv_budget_tokens, block_size=16, per_request_tokens=2048, id_prefix="stub"
        )
        self._zeros = np.zeros(vocab_size, dtype=np.float32)

    def info(self) -> ModelInfo:
        return self._info

    def capabilities(self) -> ExecutorCapabilities:
        return ExecutorCapabilities(
            max_batch_size=32,
            max_sequence_length=2048,
            attention_mechanisms=["multi_head"],
            supported_dtypes=["fp32", "fp16"],
            supported_devices=["cpu"],
            memory_requirements=MemoryRequirements(4 * MIB, 1024, 512, 1 * MIB),
            kv_block_size=16,
        )

    def status(self) -> ExecutorStatus:
        st = super().status()
        # ferrum's stub reports fixed memory figures.
        st.memory_usage.allocated_bytes = 1 * MIB
        st.memory_usage.used_bytes = 512 * 1024
        st.memory_usage.peak_bytes = 1 * MIB
        st.memory_usage.utilization_percent = 50.0
        return st

    def kv_capacity(self) -> KvCapacity:
        return super().kv_capacity()

    def _handle(self, entry) -> CacheHandle:
        h = self.handle(entry)
        h.memory_bytes = 1024  # ferrum's StubKvCache stats: 1024 B, 1 block
        return h

    def prefill(self, inp: PrefillInput) -> PrefillOutput:
        if inp.cache_id:
            entry = self.registry.get(inp.cache_id)
            self.registry.extend(entry, inp.token_ids)
        else:
            entry = self.registry.create(inp.token_ids, reserve_tokens=inp.reserve_tokens)
        all_logits = np.broadcast_to(self._zeros, (len(inp.token_ids), self._zeros.size)) if inp.all_positions else None
        return PrefillOutput(cache=self._handle(entry), logits=self._zeros, all_logits=all_logits)

    def decode(self, inp: DecodeInput) -> DecodeOutput:
        entry = self.registry.get(inp.cache_id)
        self.registry.extend(entry, [inp.token_id])
        return DecodeOutput(cache=self._handle(entry), logits=self._zeros)
