"""The llama.cpp executor with one KV stream per sequence (``kv=streams``, issue 39): the executor,
fork and prefix-cache tests of the unified layout rerun on it (their test functions, with this
module's fixtures), plus what only this layout has: dense lowest-first ids, retired sequences moved
above the live ones, prefix hits and forks as state-byte copies (a partial ``llama_memory_seq_cp``
across streams would abort the process), and a sequence capped at its stream."""

from __future__ import annotations

import pytest

from ferrum_service.core import errors
from ferrum_service.core.types import DecodeInput, PrefillInput

from .support.llama import assert_no_leak
from .support.packaged import smollm2_gguf_path
from .support.prompts import SMOLLM2, prompt_ids

pytest.importorskip("llama_cpp")

# The unified layout's tests, collected here again with the fixtures below.
from .test_llama_cpp import (  # noqa: E402,F401
    ex,
    test_a_batch_equals_its_rows_alone,
    test_failed_decode_rolls_back_and_leaks_nothing,
    test_forward_equals_prefill_rows_and_keeps_nothing,
    test_greedy_generate_equals_llama_cpp_high_level_api,
    test_prefill_then_decodes_equals_one_prefill,
    test_truncate_then_decode_equals_a_fresh_prefill,
    test_verify_rows_equal_step_by_step_decodes,
)
from .test_llama_cpp_fork import test_forks_diverge_independently, test_generate_n_on_llama_cpp  # noqa: E402,F401
from .test_llama_cpp_prefix import (  # noqa: E402,F401
    test_a_reserved_empty_cache_takes_the_cached_prefix,
    test_hit_equals_no_hit,
    test_keys_and_events_follow_the_recipe,
    test_retired_sequences_give_way_to_new_ones,
    test_salt_and_bypass,
    test_truncating_a_source_shortens_later_hits,
    with_events,
)


def _streams(n_ctx: int, n_seq: int, model_id: str = "smollm2"):
    from ferrum_service.executors.llama_cpp import LlamaCppExecutor

    return LlamaCppExecutor(smollm2_gguf_path(), model_id=model_id, threads=2, n_ctx=n_ctx, n_seq=n_seq,
                            kv="streams")


@pytest.fixture
def shared():
    """A fresh executor per test (a server a test starts shuts its executor down at the end)."""
    return _streams(2048, 8)


@pytest.fixture
def llc(request, shared):
    """The executor for the executor and fork tests; a smaller one with events recorded
    (and the prefix test module's end checks) for the prefix tests."""
    if request.node.name.split("[")[0] not in _PREFIX_TESTS:
        yield shared
        return
    yield from with_events(_streams(1024, 4))


_PREFIX_TESTS = {"test_hit_equals_no_hit", "test_salt_and_bypass", "test_keys_and_events_follow_the_recipe",
                 "test_retired_sequences_give_way_to_new_ones", "test_a_reserved_empty_cache_takes_the_cached_prefix",
                 "test_truncating_a_source_shortens_later_hits"}


def test_streams_geometry(shared):
    info = shared.info()
    assert info.metadata["kv_layout"] == "llama.cpp streams"
    assert shared.seq_cells == 256 and shared.n_ctx == 8 * 256
    assert shared.max_sequence_length == 256 and shared.registry.per_request_tokens == 256


def test_ids_are_dense_and_retired_sequences_move_up(llc):
    """Lowest id first; a released sequence the prefix cache keeps moves to the highest free id,
    so the next new sequence takes the low id it left (no gap among the live ids)."""
    llc.clear_prefix_cache()
    outs = [llc.prefill(PrefillInput(prompt_ids(40, 30 + i, **SMOLLM2))) for i in range(3)]
    assert [llc.registry.get(o.cache.cache_id).payload for o in outs] == [0, 1, 2]
    llc.release_cache(outs[1].cache.cache_id)  # its 2 full blocks are cached: kept, moved to id 7
    assert list(llc.prefix.evictable) == [7]
    new = llc.prefill(PrefillInput(prompt_ids(40, 30 + 1, **SMOLLM2)))
    assert llc.registry.get(new.cache.cache_id).payload == 1 and new.cached_tokens == 32
    # the copy answers like the original: the next token of both equals a fresh computation
    fresh = llc.prefill(PrefillInput(prompt_ids(40, 31, **SMOLLM2) + [5], bypass_prefix_cache=True))
    got = llc.decode(DecodeInput(new.cache.cache_id, 5)).logits
    assert int(got.argmax()) == int(fresh.logits.argmax())
    for o in [outs[0], outs[2], new, fresh]:
        llc.release_cache(o.cache.cache_id)
    llc.clear_prefix_cache()
    assert_no_leak(llc)


def test_a_sequence_longer_than_its_stream_is_refused(shared):
    """A prompt past the stream's cells: INVALID_ARGUMENT naming the limit, nothing kept (llama.cpp
    would otherwise find no slot in the stream)."""
    with pytest.raises(errors.FerrumError) as ei:
        shared.prefill(PrefillInput(prompt_ids(300, 1, **SMOLLM2)))
    assert "256" in str(ei.value)
    ok = shared.prefill(PrefillInput(prompt_ids(200, 1, **SMOLLM2)))
    with pytest.raises(errors.FerrumError):  # growing past the stream is refused too
        shared.prefill(PrefillInput(prompt_ids(60, 2, **SMOLLM2), cache_id=ok.cache.cache_id))
    shared.release_cache(ok.cache.cache_id)
    shared.clear_prefix_cache()
    assert_no_leak(shared)


def test_unknown_layout_is_a_config_error():
    with pytest.raises(errors.FerrumError, match="kv='paged'"):
        from ferrum_service.executors.llama_cpp import LlamaCppExecutor

        LlamaCppExecutor(smollm2_gguf_path(), kv="paged")


def test_the_spec_option_picks_the_layout():
    """``kv=streams`` in a model spec reaches the executor; an unknown value is refused at load."""
    from ferrum_service.hosting.model_specs import build_executor, parse_spec

    path = smollm2_gguf_path()
    ex = build_executor(parse_spec(f"llama-cpp,id=s,path={path},n_ctx=1024,n_seq=4,kv=streams"), device="cpu")
    assert ex.info().metadata["kv_layout"] == "llama.cpp streams" and ex.seq_cells == 256
    ex.shutdown()
    with pytest.raises(errors.FerrumError, match="kv='x'"):
        build_executor(parse_spec(f"llama-cpp,id=s,path={path},kv=x"), device="cpu")
