"""The Generate batcher keeps its joined steps within the model's per-step ceilings.

A prompt joins the running streams' decode steps in one forward only while the step's cost
(``executor.step_cost``: rows padded to the longest) stays within ``host.limits``; a prompt too
costly to join runs alone in the next step, and the streams' outputs are unchanged.
"""

from __future__ import annotations

import asyncio

import pytest

from ferrum_client import Client

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.servers import InProcessServer


@pytest.fixture
def tiny_executor(tiny_llama_dir):  # noqa: F811
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    return HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=4096)


def test_a_prompt_too_costly_to_join_the_decodes_runs_alone_next(tiny_executor):
    from ferrum_service.hosting.batcher import _Pending
    from ferrum_service.hosting.host import ModelHost
    from ferrum_service.core.types import DecodeInput, PrefillInput

    host = ModelHost("tiny", tiny_executor)
    host.limits.max_step_tokens = 40
    running = [tiny_executor.prefill(PrefillInput(token_ids=[1, 2, 3])).cache.cache_id for _ in range(3)]
    loop = asyncio.new_event_loop()
    try:
        b = host.batcher
        b._decode_queue += [_Pending(DecodeInput(cache_id=c, token_id=5), loop.create_future()) for c in running]
        short = _Pending(PrefillInput(token_ids=[7] * 10), loop.create_future())
        long = _Pending(PrefillInput(token_ids=[9] * 40), loop.create_future())
        b._prefill_queue += [short, long]
        # 3 decodes + the 10-token prompt: 13 positions <= 40; + the 40-token one: 53 > 40; 3 + 40 > 40 too
        prefills, decodes = b._next_batch()
        assert [p.inp.cache_id for p in decodes] == running
        assert prefills == [short]
        assert host.executor.step_cost([(10, 0), (1, 3), (1, 3), (1, 3)], 4).positions == 13
        b._decode_queue += [_Pending(DecodeInput(cache_id=c, token_id=5), loop.create_future()) for c in running]
        prefills, decodes = b._next_batch()
        assert prefills == [] and len(decodes) == 3  # the long prompt cannot join: decodes go on
        prefills, decodes = b._next_batch()
        assert prefills == [long] and decodes == []  # ... and it runs alone right after
        assert len(b._decode_queue) == 0
    finally:
        loop.close()
        for c in running:
            tiny_executor.release_cache(c)


def test_streams_stay_exact_when_prompts_are_split_from_the_decodes(tiny_llama_dir):  # noqa: F811
    """A small per-step ceiling forces the split; every stream still equals the same prompt alone."""
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    ex = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=8192,
                                      max_batch_tokens=64)
    prompts = [[3, 4, 5], [11] * 40, [6, 7], [13] * 30]
    with InProcessServer([ex]) as srv, Client(srv.target) as c:
        alone = [c.generate("tiny", token_ids=p, max_tokens=8, ignore_eos=True).tokens() for p in prompts]
        streams = [c.generate("tiny", token_ids=p, max_tokens=8, ignore_eos=True) for p in prompts]
        assert [s.tokens() for s in streams] == alone
        assert srv.live_caches()["tiny"] == 0


def test_a_long_prompt_joins_running_streams_a_chunk_at_a_time(tiny_llama_dir):  # noqa: F811
    """With a 16-token prefill budget per step, a 100-token prompt arriving while streams run is
    taken in chunks continuing its cache (each step: the decodes + at most 16 prompt tokens), and
    every stream — greedy and seeded — equals the same request run alone."""
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    # Prefix caching off: the reference runs below would otherwise leave every prompt cached, and
    # a cached prompt joins in one chunk (test_prefix_cache_rpcs covers that).
    ex = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=8192,
                                      prefix_cache=False)
    with InProcessServer([ex]) as srv, Client(srv.target) as c:
        host = srv.models.get("tiny")
        host.batcher.prefill_tokens_per_step = 16
        reqs = [dict(token_ids=[3, 4, 5], max_tokens=40), dict(token_ids=[6, 7], max_tokens=40),
                dict(token_ids=[(11 * i) % 500 + 1 for i in range(100)], max_tokens=6),
                dict(token_ids=[(7 * i) % 500 + 1 for i in range(70)], max_tokens=6, temperature=0.9, seed=5)]
        alone = [c.generate("tiny", ignore_eos=True, **r).tokens() for r in reqs]
        steps = []
        real_step = host.step_and_sample

        def spy(prefills, decodes):
            steps.append((sum(len(p.token_ids) for p in prefills), len(decodes)))
            return real_step(prefills, decodes)

        host.step_and_sample = spy
        streams = [c.generate("tiny", ignore_eos=True, **r) for r in reqs[:2]]
        first = [next(iter(s)) for s in streams]  # both running before the long prompts arrive
        assert all(ev.WhichOneof("event") == "started" for ev in first)
        late = [c.generate("tiny", ignore_eos=True, **r) for r in reqs[2:]]
        late_got = [s.tokens() for s in late]
        got = [[ev.token.token_id for ev in s if ev.WhichOneof("event") == "token"] for s in streams]
        assert got == alone[:2] and late_got == alone[2:]
        joined = [(t, d) for t, d in steps if t and d]
        assert joined and all(t <= 16 for t, _ in joined), steps  # prompts joined decodes in chunks
        assert srv.live_caches()["tiny"] == 0
