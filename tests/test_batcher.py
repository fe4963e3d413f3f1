"""The Generate batcher keeps its joined steps within the model's per-step ceilings.

A prompt joins the running streams' decode steps in one forward only while the step's cost
(``executor.step_cost``: rows padded to the longest) stays within ``host.limits``; a prompt too
costly to join runs alone in the next step, and the streams' outputs are unchanged.
"""

from __future__ import annotations

import asyncio

import pytest
from ferrum_client import Client

from ferrum_service.core.steps import RowKind

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.servers import InProcessServer


@pytest.fixture
def tiny_executor(tiny_llama_dir):  # noqa: F811
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    return HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=4096)


def test_a_prompt_too_costly_to_join_the_decodes_runs_alone_next(tiny_executor):
    from ferrum_service.core.types import DecodeInput, PrefillInput
    from ferrum_service.hosting.batcher import ContinuousBatcher, _Pending
    from ferrum_service.hosting.host import ModelHost

    host = ModelHost("tiny", tiny_executor)
    ContinuousBatcher(host)
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
        batch = b._next_batch()
        assert [p.inp.cache_id for p in batch.decodes] == running
        assert batch.prompts == [short]
        assert host.executor.step_cost([(10, 0), (1, 3), (1, 3), (1, 3)], 4).positions == 13
        b._decode_queue += [_Pending(DecodeInput(cache_id=c, token_id=5), loop.create_future()) for c in running]
        batch = b._next_batch()
        assert batch.prompts == [] and len(batch.decodes) == 3  # the long prompt cannot join: decodes go on
        batch = b._next_batch()
        assert batch.prompts == [long] and batch.decodes == []  # ... and it runs alone right after
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
        real_step = host.step

        def spy(plan, **kw):
            steps.append((sum(len(r.tokens) for r in plan.rows if r.kind is RowKind.PROMPT),
                          sum(1 for r in plan.rows if r.kind is RowKind.DECODE)))
            return real_step(plan, **kw)

        host.step = spy
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


def test_the_prompt_budget_follows_the_measured_costs(tiny_executor):
    """While streams decode, a step takes the prompt tokens that keep it within
    ``tail_step_factor`` decode steps of that many rows (from the fitted costs), within [min,
    cap]; with no stream decoding, or before the costs are measured, the fixed cap."""
    from ferrum_service.hosting.batcher import ContinuousBatcher
    from ferrum_service.hosting.host import ModelHost

    b = ContinuousBatcher(ModelHost("tiny", tiny_executor))
    b.tail_step_factor = 2.0
    assert b.prompt_budget(8) == b.prefill_tokens_per_step  # nothing measured yet
    # steps of 20 ms + 2.5 ms per decode row + 2 ms per prompt token, at varied sizes
    for rows, tokens in [(0, 100), (4, 0), (8, 0), (16, 0), (8, 40), (2, 200), (32, 0), (0, 300), (16, 64)]:
        b.costs.add(rows, tokens, 0.020 + 0.0025 * rows + 0.002 * tokens)
    assert b.costs.fit() == pytest.approx((0.020, 0.0025, 0.002))
    assert b.prompt_budget(32) == 50  # (2 - 1) x (20 + 32 x 2.5) ms of prompt work at 2 ms a token
    assert b.prompt_budget(8) == 20  # fewer streams: a cheaper decode step, a smaller chunk
    assert b.prompt_budget(0) == b.prefill_tokens_per_step  # no stream to protect
    b.costs.set(0.1, 0.0, 0.05)
    assert b.prompt_budget(8) == b.min_prompt_tokens
    b.costs.set(0.1, 0.0, 1e-6)
    assert b.prompt_budget(8) == b.prefill_tokens_per_step
    b.tail_step_factor = 0  # fixed budget
    b.costs.set(0.1, 0.0, 0.05)
    assert b.prompt_budget(8) == b.prefill_tokens_per_step


def test_the_cost_fit_waits_for_varied_steps():
    from ferrum_service.hosting.step_costs import StepCostModel

    m = StepCostModel(min_steps=4)
    for _ in range(10):
        m.add(8, 0, 0.05)  # decode-only steps alone cannot tell a prompt token's cost
    assert m.fit() is None and m.token_s() is None
    m.add(8, 100, 0.25)
    assert m.token_s() == pytest.approx(0.002)
    for _ in range(70):  # the window holds decode steps only again: the last fit stays
        m.add(8, 0, 0.05)
    assert m.token_s() == pytest.approx(0.002)
    m = StepCostModel(min_steps=4)
    for rows in range(6):  # every step carries the same chunk: still no telling a token's cost
        m.add(rows, 512, 0.02 + 0.001 * rows + 0.002 * 512)
    assert m.fit() is None


def test_the_cost_fit_needs_no_decode_only_step():
    """A burst of arriving prompts: every step carries prompt tokens beside a growing number of
    running streams; the costs are fitted from those steps alone (no decode-only step yet)."""
    from ferrum_service.hosting.step_costs import StepCostModel

    m = StepCostModel(min_steps=4)
    for rows, tokens in [(0, 200), (0, 512), (1, 512), (3, 512), (6, 130), (8, 512)]:
        m.add(rows, tokens, 0.020 + 0.0025 * rows + 0.002 * tokens)
    assert m.fit() == pytest.approx((0.020, 0.0025, 0.002))


def test_adaptive_chunks_keep_every_stream_exact(tiny_llama_dir):  # noqa: F811
    """A prompt budget driven down to a few tokens per step by the costs: a 100-token prompt
    arriving while streams run joins them in chunks of that size, and every stream — greedy and
    seeded — equals the same request run alone. (On this tiny model a prompt token costs next to
    nothing, so the costs are set — and frozen — after the reference runs measured them.)"""
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    ex = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=8192,
                                      prefix_cache=False)
    with InProcessServer([ex]) as srv, Client(srv.target) as c:
        host = srv.models.get("tiny")
        b = host.batcher
        reqs = [dict(token_ids=[3, 4, 5], max_tokens=60), dict(token_ids=[6, 7], max_tokens=60),
                dict(token_ids=[(11 * i) % 500 + 1 for i in range(100)], max_tokens=6),
                dict(token_ids=[(7 * i) % 500 + 1 for i in range(50)], max_tokens=6, temperature=0.9, seed=5)]
        alone = [c.generate("tiny", ignore_eos=True, **r).tokens() for r in reqs]
        b.tail_step_factor, b.min_prompt_tokens = 2.0, 4
        b.costs.set(0.1, 0.0, 0.1)  # a prompt token costs a whole decode step: the minimum chunk, 4
        steps = []
        real_step = host.step

        def spy(plan, **kw):
            steps.append((sum(r.computed for r in plan.rows if r.kind is RowKind.PROMPT),
                          sum(1 for r in plan.rows if r.kind is RowKind.DECODE)))
            return real_step(plan, **kw)

        host.step = spy
        streams = [c.generate("tiny", ignore_eos=True, **r) for r in reqs[:2]]
        first = [next(iter(s)) for s in streams]
        assert all(ev.WhichOneof("event") == "started" for ev in first)
        late = [c.generate("tiny", ignore_eos=True, **r) for r in reqs[2:]]
        late_got = [s.tokens() for s in late]
        got = [[ev.token.token_id for ev in s if ev.WhichOneof("event") == "token"] for s in streams]
        assert got == alone[:2] and late_got == alone[2:]
        joined = [t for t, d in steps if t and d]
        assert joined and max(joined) <= 4, steps  # the prompts joined the decodes 4 tokens at a time
        assert srv.live_caches()["tiny"] == 0


def test_a_failure_while_planning_fails_the_streams_instead_of_stranding_them(tiny_llama_dir, monkeypatch):  # noqa: F811
    """An error raised while the batcher plans a step (here: the prefix lookup of a new prompt)
    ends the queued streams with an error; the batcher keeps serving the next ones."""
    import grpc

    from ferrum_service.executors.transformers import HfCausalLmExecutor

    ex = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=4096)
    with InProcessServer([ex]) as srv, Client(srv.target) as c:
        real = ex.cached_prefix

        def broken(inp):
            raise RuntimeError("lookup failed")

        monkeypatch.setattr(ex, "cached_prefix", broken)
        with pytest.raises(Exception) as e:
            c.generate("tiny", token_ids=[3, 4, 5], max_tokens=4, timeout=30).tokens()
        assert getattr(e.value, "code", None) == grpc.StatusCode.INTERNAL or "lookup failed" in str(e.value)
        monkeypatch.setattr(ex, "cached_prefix", real)
        assert len(c.generate("tiny", token_ids=[3, 4, 5], max_tokens=4, ignore_eos=True).tokens()) == 4
        assert srv.live_caches()["tiny"] == 0


def test_the_prefill_settings_reach_the_batcher_and_bad_values_are_refused(tiny_executor):
    from ferrum_service.server import Server, ServerConfig, host_models

    async def check() -> None:  # the server's grpc.aio parts are made on a running loop (port 0: any free one)
        srv = Server(host_models([tiny_executor]), ServerConfig(port=0, prefill_chunk_tokens=64, prefill_tail_factor=3.0))
        b = srv.models.get("tiny").batcher
        assert (b.prefill_tokens_per_step, b.tail_step_factor) == (64, 3.0)
        for bad in (dict(prefill_chunk_tokens=0), dict(prefill_tail_factor=0.5), dict(prefill_tail_factor=-1.0)):
            with pytest.raises(ValueError):
                Server(host_models([tiny_executor]), ServerConfig(port=0, **bad))

    asyncio.run(check())
