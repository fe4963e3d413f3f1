"""Prefix caching, copy-on-write forks and block events of the transformers executor (issue 20).

Every result with the cache is compared with an executor of the same weights that has prefix
caching off (``ref``): same greedy tokens, logits within float tolerance. After every test the
pool's invariants hold (refcounts zero once every cache is released; free + in use + evictable
blocks = total; the key index agrees with the blocks).
"""

from __future__ import annotations

import random

import grpc
import pytest
import torch

from ferrum_client.prefix_keys import block_keys, chain_root
from ferrum_service.core import errors
from ferrum_service.executors.transformers import HfCausalLmExecutor
from ferrum_service.core.types import DecodeInput, PrefillInput, UnifiedItem

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.prompts import prompt_ids

BS = 16
ATOL = 1e-4


@pytest.fixture(scope="module")
def ref(tiny_llama_dir):
    return HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=4096,
                                        prefix_cache=False)


@pytest.fixture
def ex(tiny_llama_dir):
    """A caching executor with a small pool (32 blocks), checked after the test."""
    e = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=32 * BS)
    events: list[tuple[str, dict]] = []
    e.prefix.on_event = lambda kind, data: events.append((kind, data))
    e.events = events
    yield e
    for entry in e.registry.entries():
        e.release_cache(entry.cache_id)
    e.prefix.check()
    assert not e.prefix.refs, "a block is still referenced after every cache was released"
    assert e.pool.free_blocks + len(e.prefix.evictable) == e.pool.num_blocks
    assert _mirror(events) == set(e.prefix.index), "block events replayed do not give the pool's cached set"


def _mirror(events) -> set[bytes]:
    keys: set[bytes] = set()
    for kind, data in events:
        if kind == "stored":
            keys.update(data["block_hashes"])
        elif kind == "removed":
            keys.difference_update(data["block_hashes"])
        else:
            keys.clear()
    return keys


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert int(a.argmax()) == int(b.argmax())
    assert torch.allclose(a, b, atol=ATOL), float((a - b).abs().max())


def _greedy(ex, out, steps: int) -> list[int]:
    toks, cache, logits = [], out.cache.cache_id, out.logits
    for _ in range(steps):
        t = int(logits.argmax())
        toks.append(t)
        logits = ex.decode(DecodeInput(cache, t)).logits
    return toks


@pytest.mark.parametrize("shared,total,expect_cached", [
    (0, 40, 0),            # nothing shared
    (8, 40, 0),            # part of one block: nothing reusable
    (32, 40, 32),          # exactly two blocks
    (40, 40, 32),          # everything: its two full blocks (the partial third is computed)
    (48, 48, 47),          # everything, whole blocks: all but the last token (recomputed into a copy)
])
def test_hit_equals_no_hit(ex, ref, shared, total, expect_cached):
    first = prompt_ids(total, 1)
    second = first[:shared] + prompt_ids(total - shared, 2)
    a = ex.prefill(PrefillInput(first))
    b = ex.prefill(PrefillInput(second))
    assert a.cached_tokens == 0
    assert b.cached_tokens == expect_cached
    r = ref.prefill(PrefillInput(second))
    _same(b.logits, r.logits)
    assert _greedy(ex, b, 6) == _greedy(ref, r, 6)
    ref.release_cache(r.cache.cache_id)
    # the first cache is untouched by the second's writes (copy-on-write of a shared last block)
    ra = ref.prefill(PrefillInput(first + [7]))
    _same(ex.decode(DecodeInput(a.cache.cache_id, 7)).logits, ra.logits)
    ref.release_cache(ra.cache.cache_id)


def test_released_prefix_stays_cached_and_is_reused(ex, ref):
    p = prompt_ids(64)
    a = ex.prefill(PrefillInput(p))
    ex.release_cache(a.cache.cache_id)
    assert len(ex.prefix.evictable) == 4 and ex.prefix.cached_blocks == 4
    assert ex.kv_capacity().free_tokens == 32 * BS  # evictable blocks count as free
    b = ex.prefill(PrefillInput(p + [3, 4]))
    assert b.cached_tokens == 64
    r = ref.prefill(PrefillInput(p + [3, 4]))
    _same(b.logits, r.logits)
    ref.release_cache(r.cache.cache_id)


def test_bypass_and_all_positions_compute_everything(ex):
    p = prompt_ids(40)
    ex.prefill(PrefillInput(p))
    assert ex.prefill(PrefillInput(p, bypass_prefix_cache=True)).cached_tokens == 0
    out = ex.prefill(PrefillInput(p, all_positions=True))
    assert out.cached_tokens == 0 and out.all_logits.shape[0] == 40


def test_cache_salt_keeps_tenants_apart(ex):
    p = prompt_ids(48)
    ex.prefill(PrefillInput(p, cache_salt="tenant-a"))
    assert ex.prefill(PrefillInput(p, cache_salt="tenant-b")).cached_tokens == 0
    assert ex.prefill(PrefillInput(p)).cached_tokens == 0
    assert ex.prefill(PrefillInput(p, cache_salt="tenant-a")).cached_tokens == 47


def test_unified_items_take_prefix_hits(ex, ref):
    p = prompt_ids(40)
    ex.prefill(PrefillInput(p))
    (res,) = ex.unified_decode([UnifiedItem("s", p + [9], is_final_chunk=True)])
    assert res.cached_tokens == 32
    r = ref.prefill(PrefillInput(p + [9]))
    _same(res.logits, r.logits)
    ref.release_cache(r.cache.cache_id)


def test_a_reserved_empty_cache_takes_the_cached_prefix(ex, ref):
    """Issue 30: ferrum's engine reserves each new sequence (an empty cache, ``ReserveKvSlots``)
    before its first unified step; that first chunk takes the prompt's cached blocks like a new
    cache (under the step's salt), with the logits of computing everything, and lets go of the
    private blocks the hits replace; a failed first step leaves the cache as it was."""
    from ferrum_service.core.types import KvSlotRequest

    p = prompt_ids(40, 5)
    ex.release_cache(ex.prefill(PrefillInput(p)).cache.cache_id)  # blocks 0-1 cached, evictable

    def reserved(name: str) -> str:
        (a,) = ex.reserve_kv_slots([KvSlotRequest(cache_id=name, target_len=64, new_sequence=True)]).allocations
        return a.created_cache_id

    r = ref.prefill(PrefillInput(p))
    c = reserved("engine-a")
    held = ex.pool.num_blocks - ex.prefix.available_blocks
    (u,) = ex.unified_decode([UnifiedItem("engine-a", p, cache_id=c, is_final_chunk=True)])
    assert u.cached_tokens == 32 and u.cache.num_tokens == 40
    _same(u.logits, r.logits)
    # its two hit blocks replaced two private ones: the same blocks held, not two more
    assert ex.pool.num_blocks - ex.prefix.available_blocks == held
    (d,) = ex.unified_decode([UnifiedItem("engine-a", [5], cache_id=c, pos_offset=40, is_final_chunk=True)])
    _same(d.logits, ref.decode(DecodeInput(r.cache.cache_id, 5)).logits)
    ref.release_cache(r.cache.cache_id)
    # another salt (another key space), or bypass: no hit
    (u2,) = ex.unified_decode([UnifiedItem("engine-b", p, cache_id=reserved("engine-b"), cache_salt="x",
                                           is_final_chunk=True)])
    (u3,) = ex.unified_decode([UnifiedItem("engine-c", p, cache_id=reserved("engine-c"), bypass_prefix_cache=True,
                                           is_final_chunk=True)])
    assert u2.cached_tokens == 0 and u3.cached_tokens == 0
    # a first step that fails (a token past the vocabulary) leaves the empty cache as it was
    e = reserved("engine-d")
    blocks = list(ex.registry.get(e).payload.blocks)
    free = ex.prefix.available_blocks
    with pytest.raises(Exception):
        ex.unified_decode([UnifiedItem("engine-d", p[:-1] + [10**6], cache_id=e, is_final_chunk=True)])
    seq = ex.registry.get(e).payload
    assert ex.registry.get(e).num_tokens == 0 and seq.blocks == blocks and not seq.keys
    assert ex.prefix.available_blocks == free
    (u4,) = ex.unified_decode([UnifiedItem("engine-d", p, cache_id=e, is_final_chunk=True)])
    assert u4.cached_tokens == 32
    _same(u4.logits, u.logits)


def test_fork_diverges_independently(ex, ref):
    p = prompt_ids(40)
    a = ex.prefill(PrefillInput(p))
    f, shared = ex.fork_cache(a.cache.cache_id, 36)
    assert shared == 3 and f.num_tokens == 36
    _same(ex.decode(DecodeInput(f.cache_id, 5)).logits, _ref_logits(ref, p[:36] + [5]))
    _same(ex.decode(DecodeInput(a.cache.cache_id, 6)).logits, _ref_logits(ref, p + [6]))
    # truncating or releasing one sharer leaves the other's next step unchanged
    ex.truncate_kv(a.cache.cache_id, 10)
    _same(ex.decode(DecodeInput(f.cache_id, 8)).logits, _ref_logits(ref, p[:36] + [5, 8]))
    _same(ex.decode(DecodeInput(a.cache.cache_id, 2)).logits, _ref_logits(ref, p[:10] + [2]))
    ex.release_cache(a.cache.cache_id)
    _same(ex.decode(DecodeInput(f.cache_id, 1)).logits, _ref_logits(ref, p[:36] + [5, 8, 1]))
    # a whole fork (every token) continues exactly as its source
    g, _ = ex.fork_cache(f.cache_id)
    _same(ex.decode(DecodeInput(g.cache_id, 4)).logits, _ref_logits(ref, p[:36] + [5, 8, 1, 4]))
    assert ex.prefix.stats.forks == 2


def test_fork_refusals(ex):
    a = ex.prefill(PrefillInput(prompt_ids(20)))
    with pytest.raises(errors.FerrumError) as e:
        ex.fork_cache(a.cache.cache_id, 0)
    assert e.value.code == grpc.StatusCode.OUT_OF_RANGE
    with pytest.raises(errors.FerrumError):
        ex.fork_cache(a.cache.cache_id, 21)
    with pytest.raises(errors.FerrumError):
        ex.fork_cache("hf-nope", 1)
    with pytest.raises(errors.FerrumError) as e:  # a reservation the pool cannot hold
        ex.fork_cache(a.cache.cache_id, 20, reserve_tokens=33 * BS)
    assert len(ex.registry) == 1


def _ref_logits(ref, tokens: list[int]) -> torch.Tensor:
    r = ref.prefill(PrefillInput(tokens))
    ref.release_cache(r.cache.cache_id)
    return r.logits


def test_small_pool_evicts_and_recomputes(ex, ref):
    a = prompt_ids(16 * BS, 3)  # half the pool
    out = ex.prefill(PrefillInput(a))
    ex.release_cache(out.cache.cache_id)
    assert len(ex.prefix.evictable) == 16
    # two more prompts of 12 blocks each: the second needs blocks the first prompt left cached
    keep = [ex.prefill(PrefillInput(prompt_ids(12 * BS, s))) for s in (4, 5)]
    assert ex.prefix.stats.evicted_blocks > 0
    removed = [k for kind, d in ex.events if kind == "removed" for k in d["block_hashes"]]
    assert removed, "eviction emitted no removed event"
    for k in keep:
        ex.release_cache(k.cache.cache_id)
    again = ex.prefill(PrefillInput(a + [1]))
    assert again.cached_tokens < 16 * BS  # part of it was evicted ...
    _same(again.logits, _ref_logits(ref, a + [1]))  # ... and recomputed correctly


def test_admission_counts_evictable_and_refuses_cleanly(ex):
    out = ex.prefill(PrefillInput(prompt_ids(30 * BS, 6)))
    ex.release_cache(out.cache.cache_id)
    big = ex.prefill(PrefillInput(prompt_ids(32 * BS - 1, 7)))  # needs every block: evicts them all
    assert big.cached_tokens == 0
    with pytest.raises(errors.FerrumError) as e:
        ex.prefill(PrefillInput(prompt_ids(20, 8)))
    assert e.value.kind == errors.ErrorKind.RESOURCE_EXHAUSTED
    assert len(ex.registry) == 1


def test_block_event_keys_follow_the_advertised_recipe(ex):
    p = prompt_ids(50)
    ex.prefill(PrefillInput(p, cache_salt="s"))
    (kind, data), = [(k, d) for k, d in ex.events if k == "stored"]
    assert data["block_hashes"] == block_keys(p, BS, model_id="tiny", cache_salt="s")
    assert data["parent_block_hash"] == chain_root("tiny", "s")
    assert data["token_ids"] == p[:48] and data["block_size"] == BS
    recipe = ex.info().prefix_cache
    assert recipe == {"enabled": True, "algorithm": "sha256-chain-v1", "block_size": BS,
                      "seed": "ferrum-prefix-v1", "extra_keys": ["model_id", "cache_salt", "adapter"]}


def test_disabled_prefix_cache_shares_nothing_but_still_forks(tiny_llama_dir):
    e = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=512,
                                     prefix_cache=False)
    p = prompt_ids(40)
    a = e.prefill(PrefillInput(p))
    assert e.prefill(PrefillInput(p)).cached_tokens == 0
    f, shared = e.fork_cache(a.cache.cache_id)
    assert shared == 3 and not e.prefix.index and not e.capabilities().supports_prefix_caching
    for entry in e.registry.entries():
        e.release_cache(entry.cache_id)
    e.prefix.check()
    assert e.pool.free_blocks == e.pool.num_blocks


def test_random_operations_mirror_a_cacheless_executor(ex, ref):
    """Random prefills (sharing prefixes), forks, decodes, truncations and releases: every step's
    logits equal the same token history run from scratch on ``ref``; invariants hold throughout."""
    rng = random.Random(11)
    base = prompt_ids(80, 12)
    live: dict[str, list[int]] = {}
    for step in range(60):
        op = rng.choice(["prefill", "prefill", "fork", "decode", "decode", "truncate", "release"])
        try:
            if op == "prefill" or not live:
                toks = base[: rng.randrange(1, 80)] + prompt_ids(rng.randrange(0, 20), 100 + step)
                out = ex.prefill(PrefillInput(toks, bypass_prefix_cache=rng.random() < 0.1))
                live[out.cache.cache_id] = toks
                got = out.logits
            elif op == "fork":
                cid = rng.choice(list(live))
                keep = rng.randrange(1, len(live[cid]) + 1)
                entry, _ = ex.fork_cache(cid, keep)
                live[entry.cache_id] = live[cid][:keep]
                continue
            elif op == "decode":
                cid = rng.choice(list(live))
                t = rng.randrange(1, 500)
                got = ex.decode(DecodeInput(cid, t)).logits
                live[cid] = live[cid] + [t]
                toks = live[cid]
            elif op == "truncate":
                cid = rng.choice(list(live))
                n = rng.randrange(1, len(live[cid]) + 1)
                ex.truncate_kv(cid, n)
                live[cid] = live[cid][:n]
                continue
            else:
                cid = rng.choice(list(live))
                ex.release_cache(cid)
                del live[cid]
                continue
        except errors.FerrumError as e:  # the small pool may refuse; nothing may change then
            assert "KV blocks" in str(e) or "caches are active" in str(e), str(e)
            ex.prefix.check()
            continue
        finally:
            ex.prefix.check()
        _same(got, _ref_logits(ref, toks))
    assert {e.cache_id: e.tokens for e in ex.registry.entries()} == live
    assert ex.prefix.stats.hit_tokens > 0 and ex.prefix.stats.cow_copies > 0
