"""Prefix caching seen from the client (issue 20), against real ``ferrum-service serve`` processes
hosting a tiny random-weight Llama on the transformers executor:

* the block keys a replica puts in its ``KvBlockStored`` events are exactly those
  ``ferrum_client.prefix_keys`` computes from the token ids, its advertised recipe and the salt
  (chain order, parents, tokens, block size);
* two replicas behind ``StickyRouter(prefix_aware=True)``: a repeated prefix goes to the replica
  that holds it even when that replica has more sessions, it is really served from the cache
  there (``cached_tokens``), a cold prompt and another tenant's salt go by the fewest sessions.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from ferrum_client import Client, pb
from ferrum_client import prefix_keys as pk
from ferrum_client.prefix_mirror import PrefixMirror, wait_until
from ferrum_client.routing import StickyRouter

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.prompts import prompt_ids
from .support.servers import ServerProcess

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"
STEP_TIMEOUT = 30.0


def _spec(path) -> str:
    return f"hf-causal-lm,id={MODEL},path={path},device=cpu"


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir):  # noqa: F811 - fixture
    servers = [ServerProcess("--model", _spec(tiny_llama_dir), "--grace-period", "1", ready_timeout=180)
               for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:  # start both at once: each imports torch
        started = list(pool.map(lambda s: s.start(), servers))
    try:
        yield started
    finally:
        for s in started:
            s.stop()


def _recipe(c: Client):
    info = next(m for m in c.info().models if m.model_id == MODEL)
    assert info.HasField("prefix_cache"), "the transformers executor advertises no prefix-cache recipe"
    return info.prefix_cache


def test_block_events_carry_the_keys_prefix_keys_computes(replicas):
    target = replicas[0].target
    with Client(target, timeout=STEP_TIMEOUT) as c:
        recipe = _recipe(c)
        assert recipe.enabled and recipe.algorithm == pk.ALGORITHM and recipe.seed == pk.SEED
        assert tuple(recipe.extra_keys) == pk.EXTRA_KEYS and recipe.block_size > 0
        bs = recipe.block_size
        caps = c.capabilities(MODEL)
        assert caps.supports_prefix_caching and caps.supports_fork and caps.kv_block_size == bs

        cases = [("", prompt_ids(3 * bs + 5, 1, lo=5, hi=505)), ("tenant-a", prompt_ids(3 * bs + 5, 1, lo=5, hi=505)),
                 ("", prompt_ids(2 * bs, 2, lo=5, hi=505))]
        for salt, prompt in cases:
            out = c.prefill(MODEL, prompt, cache_salt=salt).output
            c.release_cache(MODEL, out.cache.cache_id)
        # replay from the start of the buffer: no race with the steps above
        got: list[pb.KvBlockEvent] = []
        stream = c.subscribe_kv_events(MODEL, from_seq=1, include_block_events=True)

        def follow():
            try:
                for msg in stream:
                    assert msg.WhichOneof("message") != "resync_required"
                    if msg.WhichOneof("message") == "block_event":
                        got.append(msg.block_event)
            except Exception:  # noqa: BLE001 - cancelled at the end
                pass

        t = threading.Thread(target=follow, daemon=True)
        t.start()
        want = [pk.block_keys(prompt, bs, model_id=MODEL, cache_salt=salt) for salt, prompt in cases]
        all_keys = {k for keys in want for k in keys}
        assert wait_until(lambda: all_keys <= {h for e in got if e.HasField("stored")
                                               for h in e.stored.block_hashes}, timeout=20), (
            "the replica's stored events do not carry the keys prefix_keys computes")
        stream.cancel()
        t.join(5)

    # every stored event is a valid piece of a chain: parent -> keys over its tokens
    for e in got:
        if not e.HasField("stored"):
            continue
        s = e.stored
        assert e.model_id == MODEL and s.block_size == bs
        assert len(s.token_ids) == bs * len(s.block_hashes)
        parent = s.parent_block_hash
        for i, h in enumerate(s.block_hashes):
            assert h == pk.block_key(parent, s.token_ids[i * bs:(i + 1) * bs])
            parent = h
    # the salted prompt shares no key with the unsalted one; a mirror of the events holds them all
    assert not set(want[0]) & set(want[1])
    mir = PrefixMirror()
    mir.recipes[MODEL] = recipe
    mir.apply_all(got)
    for salt, prompt in cases:
        assert mir.cached_tokens(MODEL, prompt, salt) == (len(prompt) // bs) * bs


def test_router_sends_a_repeated_prefix_to_the_replica_that_holds_it(replicas):
    a, b = (s.target for s in replicas)
    with Client(a, timeout=STEP_TIMEOUT) as c:
        bs = _recipe(c).block_size
    shared = prompt_ids(4 * bs, 7, lo=5, hi=505)  # a "system prompt" of four full blocks
    with StickyRouter([a, b], prefix_aware=True, step_timeout=STEP_TIMEOUT) as router:
        assert router.wait_following(20)
        # 1. a cold prompt: nobody holds it, the fewest-sessions rule places it
        first = router.new_session(prompt_tokens=shared + [9, 9, 9], model_id=MODEL)
        assert first.expected_cached_tokens == 0
        holder = first.target
        other = b if holder == a else a
        out = first.prefill(MODEL, shared + [9, 9, 9]).output
        first.release_cache(MODEL, out.cache.cache_id)
        first.close()
        assert wait_until(lambda: router.prefix_matches(shared, MODEL)[holder] == 4 * bs, timeout=20)
        assert router.prefix_matches(shared, MODEL)[other] == 0

        # 2. one more open session on the holder than on the other replica
        x, y = router.new_session(), router.new_session()  # least sessions: one on each
        assert {x.target, y.target} == {a, b}
        busy = x if x.target == holder else y
        (y if busy is x else x).close()

        # 3. repeated prefix, new question: the holder, despite its sessions; served from its cache
        for k in range(3):
            prompt = shared + prompt_ids(bs // 2 + 3, 100 + k, lo=5, hi=505)
            with router.new_session(prompt_tokens=prompt, model_id=MODEL) as s:
                assert s.target == holder and s.expected_cached_tokens == 4 * bs
                out = s.prefill(MODEL, prompt).output
                assert out.cached_tokens == 4 * bs
                s.release_cache(MODEL, out.cache.cache_id)

        # 4. a cold prompt and another tenant's salt go to the less loaded replica, computed in full
        for prompt, salt in ((prompt_ids(3 * bs, 55, lo=5, hi=505), ""), (shared + [1, 2], "tenant-b")):
            with router.new_session(prompt_tokens=prompt, model_id=MODEL, cache_salt=salt) as s:
                assert s.target == other and s.expected_cached_tokens == 0
                out = s.prefill(MODEL, prompt, cache_salt=salt).output
                assert out.cached_tokens == 0
                s.release_cache(MODEL, out.cache.cache_id)
        busy.close()


def test_fork_cache_as_a_session_step_sync_and_async(replicas):
    import asyncio

    from ferrum_client import AsyncClient, messages as m
    from ferrum_client import requests as rq

    target = replicas[1].target
    with Client(target, timeout=STEP_TIMEOUT) as c:
        bs = _recipe(c).block_size
    prompt = prompt_ids(2 * bs + 3, 11, lo=5, hi=505)

    pre = pb.PrefillRequest(model_id=MODEL, input=m.prefill_input(prompt, cache_salt="s"))

    def fork(cid: str) -> pb.ForkCacheRequest:
        return rq.fork_cache(MODEL, cid, keep_tokens=2 * bs, reserve_tokens=4 * bs)

    with Client(target, timeout=STEP_TIMEOUT) as c, c.session() as s:
        p = s.step(pre).output
        f = s.step(fork(p.cache.cache_id))
        sync = (f.cache.num_tokens, f.shared_blocks)

    async def run():
        async with AsyncClient(target, timeout=STEP_TIMEOUT) as ac, ac.session() as s:
            p = (await s.step(pre)).output
            f = await s.step(fork(p.cache.cache_id))
            return (f.cache.num_tokens, f.shared_blocks), p.cached_tokens

    got, cached = asyncio.run(run())
    assert sync == got == (2 * bs, 2)
    assert cached == 2 * bs  # the second prefill of the same salted prompt took its two full blocks
