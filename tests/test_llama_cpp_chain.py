"""A lone Generate stream's decode steps chained on the worker (``batcher.ContinuousBatcher._chain``)
on the llama.cpp executor: the worker runs the stream's next step (the token it just sampled) without
a return to the event loop, at most one step ahead of the stream's asking for it. Output equals the
unchained loop, a step run ahead that the stream does not take is undone (``settle``) or freed with
the cache, and other work stops the chain."""

from __future__ import annotations

import asyncio

import pytest

from ferrum_client import Client
from ferrum_service.core.types import LogitsPolicy, PrefillInput
from ferrum_service.hosting.batcher import HeldDecode

from .support.llama import assert_no_leak, executor
from .support.prompts import SMOLLM2, prompt_ids
from .support.servers import InProcessServer

pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def srv():
    ex = executor("chain")
    ex.warmup()
    with InProcessServer([ex], cache_ttl=0) as s:
        yield s, ex


@pytest.fixture
def counted(srv):
    """The server, its executor and a list of the rows of each step it runs (worker side)."""
    s, ex = srv
    steps: list[int] = []
    orig = ex._step

    def counting(items, field, **kw):
        steps.append(len(items))
        return orig(items, field, **kw)

    ex._step = counting
    try:
        yield s, ex, steps
    finally:
        del ex._step
        ex.chains_decodes = True
        assert s.live_caches()["chain"] == 0
        ex.clear_prefix_cache()
        assert_no_leak(ex)


def _generate(s, n: int, **kw) -> list[int]:
    with Client(s.target) as c:
        ev = list(c.generate("chain", token_ids=prompt_ids(20, 5, **SMOLLM2), max_tokens=n, ignore_eos=True, **kw))
    return [e.token.token_id for e in ev if e.WhichOneof("event") == "token"]


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "seed": 7}])
def test_chained_stream_equals_the_unchained_loop(counted, sampling):
    s, ex, steps = counted
    ex.chains_decodes = False
    ref = _generate(s, 24, **sampling)
    plain = len(steps)
    ex.chains_decodes = True
    steps.clear()
    got = _generate(s, 24, **sampling)
    assert got == ref
    # the prompt and 23 decodes: the step that makes the stream's last token (max_tokens) runs
    # none ahead after it
    assert plain == 24 and len(steps) == 24


def _held(entry, token: int, policy: LogitsPolicy) -> HeldDecode:
    return HeldDecode(cache_id=entry.cache_id, token_id=token, policy=policy, entry=entry, chain=True)


def test_a_step_run_ahead_is_claimed_or_undone(counted):
    """Driven on the batcher: after a chained step the worker runs the next one ahead; asking for
    it takes that row (no new step), and ``settle`` takes an unasked one out of the cache."""
    s, ex, steps = counted
    host = s.models.get("chain")
    b = host.batcher
    greedy = LogitsPolicy()
    prompt = prompt_ids(16, 9, **SMOLLM2)

    async def reference() -> list[int]:
        ex.chains_decodes = False
        out, row = await b.prefill(PrefillInput(token_ids=prompt, policy=greedy, bypass_prefix_cache=True))
        entry = ex.registry.get(out.cache.cache_id)
        toks = [row.token_id]
        for _ in range(4):
            toks.append((await b.decode(_held(entry, toks[-1], greedy))).token_id)
        host.release_soon(entry.cache_id)
        await host.drain_releases()
        ex.chains_decodes = True
        return toks

    async def stopped(cache_id: str) -> None:
        for _ in range(500):  # the step run ahead finishes unasked: the chain stops
            if not b._chains[cache_id].running:
                return
            await asyncio.sleep(0.02)
        raise AssertionError("the chain did not stop")

    async def chained():
        out, row = await b.prefill(PrefillInput(token_ids=prompt, policy=greedy, bypass_prefix_cache=True))
        entry = ex.registry.get(out.cache.cache_id)
        cid = entry.cache_id
        toks = [row.token_id]
        toks.append((await b.decode(_held(entry, toks[-1], greedy))).token_id)  # runs ahead, feeding toks[1]
        await stopped(cid)
        ahead = entry.num_tokens
        n = len(steps)
        toks.append((await b.decode(_held(entry, toks[-1], greedy))).token_id)  # the row made ahead
        taken_without_a_step = len(steps) == n and cid not in b._chains
        toks.append((await b.decode(_held(entry, toks[-1], greedy))).token_id)  # runs ahead, feeding toks[3]
        await stopped(cid)
        before = entry.num_tokens
        await b.settle(cid)  # undone: the cache holds what was fed
        after = entry.num_tokens
        toks.append((await b.decode(_held(entry, toks[-1], greedy))).token_id)  # computed again, same token
        host.release_soon(cid)
        await host.drain_releases()
        return toks, ahead, taken_without_a_step, before, after

    ref = s.run(reference(), timeout=120)
    toks, ahead, taken, before, after = s.run(chained(), timeout=120)
    assert toks == ref
    assert ahead == len(prompt) + 2  # the prompt, toks[0], and toks[1] fed by the step run ahead
    assert taken
    assert (before, after) == (len(prompt) + 4, len(prompt) + 3)


def test_other_work_stops_the_chain(counted):
    """A second stream arriving while one stream's steps are chained joins it in batched steps."""
    s, ex, steps = counted

    async def two():
        from ferrum_client import AsyncClient

        async with AsyncClient(s.target) as c:
            chained = asyncio.Event()  # the first stream is well into its chained steps

            async def one(n, wait=None):
                if wait is not None:
                    await wait.wait()
                out = []
                async for e in c.generate("chain", token_ids=prompt_ids(12, 2, **SMOLLM2), max_tokens=n,
                                          ignore_eos=True):
                    if e.WhichOneof("event") == "token":
                        out.append(e.token.token_id)
                        if len(out) == 5:
                            chained.set()
                return out
            return await asyncio.gather(one(60), one(8, chained))

    a, b = asyncio.run(two())
    assert len(a) == 60 and len(b) == 8
    assert max(steps) == 2  # the two streams shared steps: the chain gave way
