"""A lone Generate stream's decode steps chained on the worker on the transformers executor (the
plan-ahead a GPU needs: the next step starts without a round trip through the event loop). The
output equals the unchained loop, each chained step hands its row to the loop as the next forward
starts (``StepPlan.on_forward``), the step that makes a stream's last token by ``max_tokens``
runs none after it, and nothing is left in the cache pool."""

from __future__ import annotations

import pytest

from ferrum_client import Client

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.servers import InProcessServer


@pytest.fixture(scope="module")
def counted(tiny_llama_dir):  # noqa: F811 - fixture
    """The server, its executor and per step run on the worker (rows, whether it had an
    ``on_forward`` hook)."""
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    ex = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=4096)
    steps: list[tuple[int, bool]] = []
    orig = ex._step

    def counting(items, field, on_forward=None):
        steps.append((len(items), on_forward is not None))
        return orig(items, field, on_forward)

    ex._step = counting
    with InProcessServer([ex], cache_ttl=0) as s:
        yield s, ex, steps


def _generate(s, n: int, **kw) -> list[int]:
    with Client(s.target) as c:
        ev = list(c.generate("tiny", token_ids=list(range(3, 23)), max_tokens=n, ignore_eos=True, **kw))
    return [e.token.token_id for e in ev if e.WhichOneof("event") == "token"]


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "seed": 7}])
def test_chained_stream_equals_the_unchained_loop(counted, sampling):
    s, ex, steps = counted
    assert type(ex).chains_decodes
    try:
        ex.chains_decodes = False
        steps.clear()
        ref = _generate(s, 16, **sampling)
        assert len(steps) == 16 and not any(hooked for _, hooked in steps)
        ex.chains_decodes = True
        steps.clear()
        got = _generate(s, 16, **sampling)
    finally:
        ex.chains_decodes = True
    assert got == ref
    # the prompt and 15 decodes, none run after the last token's step
    assert len(steps) == 16 and all(rows == 1 for rows, _ in steps)
    # the chained steps after the first hand the previous row to the loop as they start
    assert sum(hooked for _, hooked in steps) >= 1
    assert s.live_caches()["tiny"] == 0
    assert len(ex.registry) == 0


def test_a_stream_that_stops_early_frees_the_step_run_ahead(counted):
    """A stop string ends the stream before max_tokens: the one step the worker ran ahead goes
    with the stream's cache."""
    s, ex, steps = counted
    ref = _generate(s, 12, temperature=0.0)
    with Client(s.target) as c:
        ev = list(c.generate("tiny", token_ids=list(range(3, 23)), max_tokens=12, ignore_eos=True,
                             stop_token_ids=[ref[5]], temperature=0.0))
    toks = [e.token.token_id for e in ev if e.WhichOneof("event") == "token"]
    assert toks == ref[:len(toks)] and len(toks) < 12
    assert s.live_caches()["tiny"] == 0
    assert len(ex.registry) == 0
