"""``ModelInfo`` with ferrum's fixed test-executor shape.

ferrum's stub and configurable executors report the same made-up model: a "custom" model of
1,000,000 parameters, hidden size 768, 12 layers, 12 attention heads (12 KV heads, head size 64),
on the CPU. They differ only in the figures passed here.
"""

from __future__ import annotations

from typing import Iterable

from ..core.types import ModelInfo


def ferrum_fixed_info(
    model_id: str,
    vocab_size: int,
    *,
    executor: str,
    model_type_detail: str,
    max_sequence_length: int,
    dtype: str,
    version: str,
    license: str = "",
    eos_token_ids: Iterable[int] = (),
) -> ModelInfo:
    """The ``ModelInfo`` of one of ferrum's test executors (its fixed 768/12/12 shape)."""
    return ModelInfo(
        model_id=model_id,
        model_type="custom",
        model_type_detail=model_type_detail,
        num_parameters=1_000_000,
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        num_kv_heads=12,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        dtype=dtype,
        device="cpu",
        version=version,
        license=license,
        head_dim=64,
        executor=executor,
        eos_token_ids=list(eos_token_ids),
    )
