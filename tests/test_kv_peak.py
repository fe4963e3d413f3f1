"""``ModelStats.memory_usage.peak_bytes`` of the executors that use the base ``status()``: the most
KV live caches held at once (kept by the registry), not the bytes used now."""

from __future__ import annotations

from ferrum_service.executors.base import ModelExecutor
from ferrum_service.core.kv_registry import CacheRegistry


class _Books(ModelExecutor):
    """Only the registry and the base status (no model: the abstract steps are never called)."""

    def __init__(self) -> None:
        super().__init__()
        self.registry = CacheRegistry("m", total_tokens=1000, bytes_per_token=10)

    def info(self):
        raise NotImplementedError

    def capabilities(self):
        raise NotImplementedError

    def prefill(self, inp):
        raise NotImplementedError

    def decode(self, inp):
        raise NotImplementedError


def test_peak_is_the_most_tokens_held_at_once():
    ex = _Books()
    reg = ex.registry
    assert ex.status().memory_usage.peak_bytes == 0
    a = reg.create(list(range(30)), field="t")
    b = reg.create(list(range(20)), field="t")
    reg.extend(a, [1] * 10)  # 60 tokens live
    reg.truncate(b, 5)  # 45
    assert reg.used_tokens == 45 and reg.peak_tokens == 60
    mu = ex.status().memory_usage
    assert mu.used_bytes == 450 and mu.peak_bytes == 600
    reg.release(a.cache_id)
    reg.release(b.cache_id)
    mu = ex.status().memory_usage
    assert mu.used_bytes == 0 and mu.peak_bytes == 600
    reg.create(list(range(70)), field="t")
    assert ex.status().memory_usage.peak_bytes == 700
