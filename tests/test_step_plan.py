"""A step as data (``core/steps.py``): one plan per forward, one cost check with one code, one
``run(executor, plan)`` for every path.

Real executors (a tiny random-weight Llama on the transformers executor, ferrum's configurable
executor) and a real server on a loopback port."""

from __future__ import annotations

import grpc
import pytest
import torch
from ferrum_client import Client
from ferrum_client import messages as m
from ferrum_client import pb

from ferrum_service.core import errors
from ferrum_service.core.steps import RowKind, StepLimits, StepPlan, StepRow, Want, run
from ferrum_service.core.types import DecodeInput, LogitsPolicy, OutputMode, PrefillInput, SamplingParams
from ferrum_service.executors.configurable import ConfigurableModelExecutor
from ferrum_service.executors.transformers import HfCausalLmExecutor

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.servers import InProcessServer


@pytest.fixture
def ex(tiny_llama_dir):  # noqa: F811
    return HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=4096,
                                        max_batch_size=4)


def _prompt(tokens, **kw) -> StepRow:
    return StepRow.prompt(PrefillInput(token_ids=list(tokens), **kw), None)


def test_rows_built_from_the_interface_inputs():
    p = _prompt([1, 2, 3], all_positions=True, reserve_tokens=10, cache_salt="s", adapter="a")
    assert (p.want, p.kind, p.reserve, p.salt, p.adapter, p.entry) == (Want.ALL, RowKind.PROMPT, 10, "s", "a", None)
    quiet = _prompt([1], policy=LogitsPolicy(mode=OutputMode.NONE))
    assert quiet.want is Want.NONE and quiet.logits_rows == 0


def test_a_decode_row_at_the_wrong_position_is_failed_precondition(ex):
    cache = ex.prefill(PrefillInput(token_ids=[1, 2, 3])).cache
    entry = ex.registry.get(cache.cache_id)
    with pytest.raises(errors.FerrumError) as e:
        StepRow.decode(DecodeInput(cache_id=cache.cache_id, token_id=4, position=2), entry, "input")
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and e.value.field == "input.position"
    drafted = StepRow.decode(DecodeInput(cache_id=cache.cache_id, token_id=4, draft=[5, 6]), entry, "input")
    assert (drafted.tokens, drafted.want, drafted.drafts) == ([4, 5, 6], Want.ALL, 2)
    ex.release_cache(cache.cache_id)


def test_one_check_one_code_for_every_ceiling(ex):
    """Rows, positions, working memory and response size: each ceiling is INVALID_ARGUMENT naming
    the field, and ``fits`` (the batcher's question) agrees with ``too_big`` on the step itself."""
    rows = [_prompt([1] * 8) for _ in range(5)]
    cases = [
        (StepLimits(max_rows=4), "sequences in one step"),
        (StepLimits(max_step_tokens=39), "token positions"),
        (StepLimits(max_step_bytes=1024), "bytes of working memory"),
    ]
    for limits, words in cases:
        plan = StepPlan(rows, "inputs")
        err = plan.too_big(limits, ex, ex.info().vocab_size)
        assert err is not None and err.code == grpc.StatusCode.INVALID_ARGUMENT and words in err.message
        assert err.field == "inputs"
        assert not plan.fits(limits, ex)
    full = LogitsPolicy(mode=OutputMode.FULL_LOGITS)
    big = StepPlan([_prompt([1] * 8, policy=full, all_positions=True)], "input")
    vocab = ex.info().vocab_size
    assert big.response_bytes(vocab) == 9 * vocab * 4  # the output row + one per position
    err = big.too_big(StepLimits(max_response_bytes=8 * vocab * 4), ex, vocab)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "bytes of logits" in err.message
    assert big.fits(StepLimits(max_response_bytes=8 * vocab * 4), ex)  # the batcher answers with tokens
    assert StepPlan(rows).too_big(StepLimits(max_rows=5, max_step_tokens=40), ex, vocab) is None


def test_run_samples_each_row_as_its_policy_asks(ex):
    """One plan mixing a new prompt, a continued cache's decode row and a quiet row: one forward
    (the executor's counters), each row's output exactly what the same row gives alone."""
    a = ex.prefill(PrefillInput(token_ids=[5, 6, 7])).cache.cache_id
    greedy = LogitsPolicy()
    seeded = LogitsPolicy(sampling=SamplingParams(temperature=0.9, seed=3))
    alone_prompt = run(ex, StepPlan([_prompt([9, 8, 7, 6], policy=seeded)]))
    alone_decode = run(ex, StepPlan([StepRow.decode(DecodeInput(cache_id=a, token_id=4), ex.registry.get(a), "i")]))
    ex.truncate_kv(a, 3)
    before = ex.stats.snapshot()
    plan = StepPlan([_prompt([9, 8, 7, 6], policy=seeded),
                     _prompt([3, 3], policy=LogitsPolicy(mode=OutputMode.NONE)),
                     StepRow.decode(DecodeInput(cache_id=a, token_id=4, policy=greedy), ex.registry.get(a), "i")])
    res = run(ex, plan)
    after = ex.stats.snapshot()
    assert after["prefill_ops"] == before["prefill_ops"] + 1 and after["decode_ops"] == before["decode_ops"] + 1
    assert res.rows[0].token_id == alone_prompt.rows[0].token_id
    assert res.rows[1] is None and res.outputs[1].logits is None
    assert res.rows[2].token_id == alone_decode.rows[0].token_id
    assert [o.cache.num_tokens for o in res.outputs] == [4, 2, 4]
    for c in [a, alone_prompt.outputs[0].cache.cache_id, res.outputs[0].cache.cache_id,
              res.outputs[1].cache.cache_id]:
        ex.release_cache(c)
    assert len(ex.registry) == 0


def test_run_refuses_a_cache_replaced_since_the_plan(ex):
    """A plan holds the entries it was built for: a cache released (and its id reused) in between
    is NOT_FOUND, never a write into someone else's blocks."""
    a = ex.prefill(PrefillInput(token_ids=[5, 6, 7])).cache.cache_id
    plan = StepPlan([StepRow.decode(DecodeInput(cache_id=a, token_id=4), ex.registry.get(a), "inputs")])
    ex.release_cache(a)
    with pytest.raises(errors.FerrumError) as e:
        run(ex, plan)
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    assert len(ex.registry) == 0


def test_the_default_execute_is_all_or_nothing():
    """ferrum's configurable executor runs a plan row by row; when a row fails, the rows before it
    are undone (the new cache released, the continued cache back to its length)."""
    ex = ConfigurableModelExecutor.with_token_sequence(100, [7, 8, 9], model_id="mix")
    old = ex.prefill(PrefillInput(token_ids=[1, 2])).cache.cache_id
    gone = ex.prefill(PrefillInput(token_ids=[3])).cache.cache_id
    gone_entry = ex.registry.get(gone)
    ex.release_cache(gone)
    plan = StepPlan([_prompt([4, 5]), StepRow.prompt(PrefillInput(token_ids=[6], cache_id=old), ex.registry.get(old)),
                     StepRow.decode(DecodeInput(cache_id=gone, token_id=1), gone_entry, "inputs")])
    with pytest.raises(errors.FerrumError):
        ex.execute(plan)
    assert ex.registry.get(old).num_tokens == 2
    assert [e.cache_id for e in ex.registry.entries()] == [old]


def test_batch_decode_over_the_row_limit_is_one_invalid_argument(tiny_llama_dir):  # noqa: F811
    """A unary step with more rows than the executor runs in one forward can never run: the same
    INVALID_ARGUMENT as any other ceiling (not RESOURCE_EXHAUSTED, which says "retry later")."""
    ex = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=4096,
                                      max_batch_size=2)
    with InProcessServer([ex]) as srv, Client(srv.target) as c:
        caches = [c.prefill("tiny", [1 + i, 2]).output.cache.cache_id for i in range(3)]
        with pytest.raises(grpc.RpcError) as e:
            c.stub.BatchDecode(pb.BatchDecodeRequest(model_id="tiny", inputs=[m.decode_input(x, 5) for x in caches]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sequences in one step" in e.value.details()
        assert all(ex.registry.get(x).num_tokens == 2 for x in caches)  # nothing ran
        for x in caches:
            c.release_cache("tiny", x)
        assert srv.live_caches()["tiny"] == 0


def test_verify_rows_are_read_with_the_history_up_to_each_position(ex):
    """ForwardVerify's row j is the output after token j: sampled with the cache's tokens up to
    and including it (the repetition penalty of position j sees exactly those)."""
    a = ex.prefill(PrefillInput(token_ids=[5, 6, 7])).cache.cache_id
    pol = LogitsPolicy(sampling=SamplingParams(repetition_penalty=1.5))
    res = run(ex, StepPlan([StepRow.verify(ex.registry.get(a), [8, 9], pol)], "token_ids"))
    assert len(res.positions[0]) == 2 and res.rows[0] is None
    ex.truncate_kv(a, 3)
    one = run(ex, StepPlan([StepRow.decode(DecodeInput(cache_id=a, token_id=8, policy=pol), ex.registry.get(a), "i")]))
    assert one.rows[0].token_id == res.positions[0][0].token_id
    assert torch.isfinite(torch.tensor(res.positions[0][1].logprob))
    ex.release_cache(a)
