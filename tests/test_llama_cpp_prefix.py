"""Prefix reuse on the llama.cpp executor (:mod:`ferrum_service.executors.llama_cpp.prefix`): a new
prompt copies (``llama_memory_seq_cp``) the cached full blocks another sequence holds, released
sequences stay cached until their id or cells are needed, keys and events follow the contract's
recipe. Results are compared with the same executor computing everything (bypass)."""

from __future__ import annotations

import pytest

from ferrum_client import Client, pb
from ferrum_client.prefix_keys import block_keys
from ferrum_service.core.types import DecodeInput, PrefillInput

from .support.prompts import SMOLLM2, prompt_ids
from .support.servers import InProcessServer
from .support.llama import TOL, maxdiff
from .support.packaged import smollm2_gguf_path
from .test_prefix_cache import _mirror

pytest.importorskip("llama_cpp")


@pytest.fixture
def llc():
    from ferrum_service.executors.llama_cpp import LlamaCppExecutor

    yield from with_events(LlamaCppExecutor(smollm2_gguf_path(), model_id="smollm2", threads=2, n_ctx=512, n_seq=4))


def with_events(ex):
    """Yield ``ex`` recording its block events (``ex.events``); after the test: nothing leaked,
    the events replayed give the cached set, nothing left after shutdown."""
    events: list[tuple[str, dict]] = []
    ex.prefix.on_event = lambda kind, data: events.append((kind, data))
    ex.events = events
    yield ex
    for e in ex.registry.entries():
        ex.release_cache(e.cache_id)
    assert ex.live_sequences() == 0 and ex.kv_cells_used() == 0
    assert _mirror(events) == set(ex.prefix.index)  # block events replayed give the cached set
    ex.shutdown()
    assert len(ex._free_seq) == ex.n_seq and not ex.prefix.index


def _fresh(ex, tokens):
    out = ex.prefill(PrefillInput(tokens, bypass_prefix_cache=True))
    ex.release_cache(out.cache.cache_id)
    return out.logits


def _same(a, b) -> None:
    # The same argmax, unless the reference's top two are within llama.cpp's batch noise (TOL):
    # then the token chosen must be one of those near-ties of the reference.
    if int(a.argmax()) != int(b.argmax()):
        assert float(b.max() - b[int(a.argmax())]) < TOL / 4
    assert maxdiff(a, b) < TOL * 3


@pytest.mark.parametrize("shared,expect", [(0, 0), (10, 0), (32, 32), (60, 48), (64, 63)])
def test_hit_equals_no_hit(llc, shared, expect):
    first = prompt_ids(64, 1, **SMOLLM2)
    second = first[:shared] + prompt_ids(64 - shared, 2, **SMOLLM2)
    a = llc.prefill(PrefillInput(first))
    llc.release_cache(a.cache.cache_id)  # retired: its blocks stay cached
    b = llc.prefill(PrefillInput(second))
    assert b.cached_tokens == expect
    _same(b.logits, _fresh(llc, second))
    _same(llc.decode(DecodeInput(b.cache.cache_id, 5)).logits, _fresh(llc, second + [5]))


def test_salt_and_bypass(llc):
    p = prompt_ids(40, 3, **SMOLLM2)
    llc.prefill(PrefillInput(p, cache_salt="a"))
    assert llc.prefill(PrefillInput(p, cache_salt="b")).cached_tokens == 0
    assert llc.prefill(PrefillInput(p, cache_salt="a", bypass_prefix_cache=True)).cached_tokens == 0
    assert llc.prefill(PrefillInput(p, cache_salt="a")).cached_tokens == 32


def test_keys_and_events_follow_the_recipe(llc):
    p = prompt_ids(40, 4, **SMOLLM2)
    llc.prefill(PrefillInput(p))
    (kind, data), = [(k, d) for k, d in llc.events if k == "stored"]
    assert data["block_hashes"] == block_keys(p, 16, model_id="smollm2")
    assert data["token_ids"] == p[:32]
    assert llc.info().prefix_cache["block_size"] == 16 and llc.capabilities().supports_prefix_caching


def test_retired_sequences_give_way_to_new_ones(llc):
    outs = [llc.prefill(PrefillInput(prompt_ids(40, 10 + i, **SMOLLM2))) for i in range(4)]  # every sequence id
    for o in outs:
        llc.release_cache(o.cache.cache_id)
    assert len(llc.prefix.evictable) == 4 and llc.live_sequences() == 0
    # four new prompts need the four ids: the retired sequences are evicted, oldest first
    news = [llc.prefill(PrefillInput(prompt_ids(40, 20 + i, **SMOLLM2))) for i in range(4)]
    assert not llc.prefix.evictable and llc.prefix.stats.evicted_blocks == 8
    removed = {k for kind, d in llc.events if kind == "removed" for k in d["block_hashes"]}
    assert block_keys(prompt_ids(40, 10, **SMOLLM2), 16, model_id="smollm2")[0] in removed
    for o in news:
        llc.release_cache(o.cache.cache_id)


def test_retired_cells_give_way_to_a_long_prompt(llc):
    a = llc.prefill(PrefillInput(prompt_ids(300, 5, **SMOLLM2)))
    llc.release_cache(a.cache.cache_id)
    b = llc.prefill(PrefillInput(prompt_ids(400, 6, **SMOLLM2)))  # 300 + 400 > 512 cells: the retired one goes
    assert b.cached_tokens == 0 and not llc.prefix.evictable
    llc.release_cache(b.cache.cache_id)
    _same(b.logits, _fresh(llc, prompt_ids(400, 6, **SMOLLM2)))  # computed on clean cells, and again after eviction


def test_a_reserved_empty_cache_takes_the_cached_prefix(llc):
    """Issue 30: ferrum's engine reserves a new sequence (an empty cache, ``ReserveKvSlots``) before
    its first unified step; that first chunk takes the prompt's cached blocks like a new cache,
    under its own salt, with the same logits as computing everything; a failed first step leaves
    the cache empty (no copied cells, its old root)."""
    from ferrum_service.core.types import KvSlotRequest, UnifiedItem

    p = prompt_ids(40, 8, **SMOLLM2)
    llc.release_cache(llc.prefill(PrefillInput(p)).cache.cache_id)  # retired: blocks 0-1 cached

    def reserved(name, salt=""):
        (a,) = llc.reserve_kv_slots([KvSlotRequest(cache_id=name, target_len=48, new_sequence=True, salt=salt)]).allocations
        return a.created_cache_id

    c = reserved("engine-a")
    (u,) = llc.unified_decode([UnifiedItem(seq_id="engine-a", q_tokens=p, cache_id=c)])
    assert u.cached_tokens == 32 and u.cache.num_tokens == 40
    _same(u.logits, _fresh(llc, p))
    (d,) = llc.unified_decode([UnifiedItem(seq_id="engine-a", q_tokens=[5], cache_id=c, pos_offset=40)])
    _same(d.logits, _fresh(llc, p + [5]))
    # another salt (another key space): no hit; bypass: no hit
    other = reserved("engine-b")
    (u2,) = llc.unified_decode([UnifiedItem(seq_id="engine-b", q_tokens=p, cache_id=other, cache_salt="x")])
    assert u2.cached_tokens == 0
    byp = reserved("engine-c")
    (u3,) = llc.unified_decode([UnifiedItem(seq_id="engine-c", q_tokens=p, cache_id=byp, bypass_prefix_cache=True)])
    assert u3.cached_tokens == 0
    for x in (c, other, byp):
        llc.release_cache(x)
    # a first step that fails (a token llama.cpp refuses) leaves the empty cache as it was
    e = reserved("engine-d")
    seq = llc.registry.get(e).payload
    cells = llc.kv_cells_used()
    with pytest.raises(Exception):
        llc.unified_decode([UnifiedItem(seq_id="engine-d", q_tokens=p[:-1] + [10**6], cache_id=e)])
    assert llc.registry.get(e).num_tokens == 0 and llc.kv_cells_used() == cells and not llc.prefix.keys.get(seq)
    assert llc._L.llama_memory_seq_pos_max(llc._mem, seq) == -1  # the copied cells are not its any more
    (u4,) = llc.unified_decode([UnifiedItem(seq_id="engine-d", q_tokens=p, cache_id=e)])
    assert u4.cached_tokens == 32
    _same(u4.logits, _fresh(llc, p))
    llc.release_cache(e)


def test_truncating_a_source_shortens_later_hits(llc):
    p = prompt_ids(64, 7, **SMOLLM2)
    a = llc.prefill(PrefillInput(p))
    llc.truncate_kv(a.cache.cache_id, 20)
    b = llc.prefill(PrefillInput(p))
    assert b.cached_tokens == 16
    _same(b.logits, _fresh(llc, p))


def test_generate_reuses_a_repeated_prompt_over_the_wire(llc):
    with InProcessServer([llc]) as srv, Client(srv.target) as c:
        req = pb.GenerateRequest(model_id="smollm2", text="The history of the printing press " * 8,
                                 stop=pb.StopConditions(max_tokens=3, ignore_eos=True))
        first = list(c.stub.Generate(req))
        second = list(c.stub.Generate(req))
        assert first[0].started.cached_tokens == 0 and second[0].started.cached_tokens >= 32
        assert [e.token.token_id for e in first if e.WhichOneof("event") == "token"] == \
               [e.token.token_id for e in second if e.WhichOneof("event") == "token"]
        (load,) = c.stub.Loads(pb.LoadsRequest(model_id="smollm2")).loads
        assert load.prefix_hit_tokens == second[0].started.cached_tokens
        assert srv.live_caches()["smollm2"] == 0  # the streams' caches are released (and retired)
        m = srv.server.metrics
        assert m.value("ferrum_prefix_cached_blocks", {"model": "smollm2"}) >= 2
        assert m.value("ferrum_prefix_hit_tokens_total", {"model": "smollm2"}) == load.prefix_hit_tokens
        assert m.value("ferrum_kv_used_bytes", {"model": "smollm2"}) == 0


def test_loads_counts_the_cached_blocks(llc):
    """``Loads.cached_blocks`` (``KvCapacity.cached_blocks``) is the prefix cache's keyed blocks on
    llama.cpp too: it read 0 while the block events said 2 (the conformance step
    prefix.mirror.matches_server found it)."""
    assert llc.kv_capacity().cached_blocks == 0
    out = llc.prefill(PrefillInput(prompt_ids(40, 7, **SMOLLM2)))
    assert llc.kv_capacity().cached_blocks == llc.prefix.cached_blocks == 2  # what Loads reports
    llc.release_cache(out.cache.cache_id)
    assert llc.kv_capacity().cached_blocks == 2  # retired, still keyed
