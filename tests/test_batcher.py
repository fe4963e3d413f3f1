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
    from ferrum_service.executors.hf_causal_lm import HfCausalLmExecutor

    return HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=4096)


def test_a_prompt_too_costly_to_join_the_decodes_runs_alone_next(tiny_executor):
    from ferrum_service.batcher import _Pending
    from ferrum_service.host import ModelHost
    from ferrum_service.types import DecodeInput, PrefillInput

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
    from ferrum_service.executors.hf_causal_lm import HfCausalLmExecutor

    ex = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=8192,
                                      max_batch_tokens=64)
    prompts = [[3, 4, 5], [11] * 40, [6, 7], [13] * 30]
    with InProcessServer([ex]) as srv, Client(srv.target) as c:
        alone = [c.generate("tiny", token_ids=p, max_tokens=8, ignore_eos=True).tokens() for p in prompts]
        streams = [c.generate("tiny", token_ids=p, max_tokens=8, ignore_eos=True) for p in prompts]
        assert [s.tokens() for s in streams] == alone
        assert srv.live_caches()["tiny"] == 0
