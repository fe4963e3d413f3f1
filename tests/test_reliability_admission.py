"""Admission control and backpressure: a full KV budget or a full model queue is answered
RESOURCE_EXHAUSTED at once with RetryInfo (the client sees ``retry_after_s``), nothing is
allocated past the budget, and the server recovers as caches are released. Refusals are counted
(``ferrum_admission_refusals_total``) and logged with structured fields."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest

from ferrum_client import AsyncClient, Client, FerrumRpcError, messages as m, pb

from ferrum_service.executors import ConfigurableModelExecutor

from .conftest_models import tiny_llama_dir  # noqa: F401
from .support.servers import InProcessServer, ServerProcess
from .support.waits import wait_until

X = grpc.StatusCode.RESOURCE_EXHAUSTED


def _refused(fn, *a, **kw) -> tuple[FerrumRpcError, float]:
    t0 = time.perf_counter()
    with pytest.raises(FerrumRpcError) as e:
        fn(*a, **kw)
    return e.value, time.perf_counter() - t0


def test_batch_decode_admits_the_batch_total_all_or_nothing():
    """Each input of a BatchDecode fits the free budget alone but their total does not: the batch is
    refused with RESOURCE_EXHAUSTED before any work, and no cache grows."""
    ex = ConfigurableModelExecutor.with_token_sequence(1000, [7], model_id="mock", kv_budget_tokens=64)
    with InProcessServer([ex]) as srv, Client(srv.target) as c:
        ids = [c.prefill("mock", list(range(1, n + 1))).output.cache.cache_id for n in (20, 21, 21)]  # 62 of 64
        reg = srv.models.get("mock").executor.registry
        assert reg.free_tokens == 2
        for cid in ids:  # each alone would be admitted: it needs 1 of the 2 free tokens
            assert reg.growth(reg.get(cid), reg.get(cid).num_tokens + 1) == 1
        before = {cid: reg.get(cid).num_tokens for cid in ids}
        decodes = ex.decode_count
        err, secs = _refused(c.batch_decode, "mock", [(cid, 5) for cid in ids])
        assert err.code == X, err
        assert err.retry_after_s and err.retry_after_s > 0
        assert "needs 3 KV tokens but only 2" in err.message, err.message
        assert secs < 0.5
        assert {cid: reg.get(cid).num_tokens for cid in ids} == before, "a cache changed in a refused batch"
        assert ex.decode_count == decodes and reg.free_tokens == 2 and reg.used_tokens == 62
        # a batch whose total fits is admitted
        r = c.batch_decode("mock", [(cid, 5) for cid in ids[:2]])
        assert [o.cache.num_tokens for o in r.outputs] == [21, 22]
        assert reg.free_tokens == 0


def test_full_kv_budget_is_refused_at_once_with_retry_info_and_recovers():
    ex = ConfigurableModelExecutor.with_token_sequence(1000, [7], model_id="mock", kv_budget_tokens=64)
    with InProcessServer([ex]) as srv, Client(srv.target) as c:
        ids = [c.prefill("mock", list(range(1, 17))).output.cache.cache_id for _ in range(4)]  # 4 x 16 = 64
        assert c.kv_capacity("mock").used_tokens == 64
        for call in (lambda: c.prefill("mock", [1]),
                     lambda: c.prefill("mock", [1], reserve_tokens=10),
                     lambda: c.decode("mock", ids[0], 1),
                     lambda: c.forward_verify("mock", ids[0], [1, 2]),
                     lambda: c.generate("mock", token_ids=[1], max_tokens=4).tokens()):
            err, secs = _refused(call)
            assert err.code == X, err
            assert err.kind == "RESOURCE_EXHAUSTED"
            assert err.retry_after_s and err.retry_after_s > 0, "RetryInfo missing"
            assert secs < 0.5, f"refusal took {secs:.3f}s"
            assert "free" in err.message
        # on a Session the refusal is an in-band StepError with the same retry information
        with c.session() as s:
            with pytest.raises(FerrumRpcError) as e:
                s.step(pb.PrefillRequest(model_id="mock", input=m.prefill_input([1])))
            assert e.value.code == X and e.value.retry_after_s
            # the session goes on: a truncate frees budget and the same step now succeeds
            assert c.truncate_kv("mock", ids[0], 8).removed_tokens == 8
            assert s.step(pb.PrefillRequest(model_id="mock", input=m.prefill_input([1]))).output.cache.num_tokens == 1
        # nothing was allocated past the budget, and releases bring admission back
        # the session's own cache died with it; what is held is exactly 3 x 16 + 8 tokens
        reg = srv.models.get("mock").executor.registry
        wait_until(lambda: len(reg) == 4, interval=0.01)  # the session's release runs as its stream ends
        assert sorted(e.cache_id for e in reg.entries()) == sorted(ids)
        assert (reg.used_tokens, reg.reserved_tokens, reg.free_tokens) == (56, 0, 8)
        assert reg.recount() == (56, 56)
        for cid in ids:
            assert c.release_cache("mock", cid).released
        assert c.prefill("mock", list(range(1, 65))).output.cache.num_tokens == 64
        assert srv.server.metrics.value("ferrum_admission_refusals_total") == 6


class SlowModel(ConfigurableModelExecutor):
    inline = False

    def decode(self, inp):
        time.sleep(0.3)
        return super().decode(inp)


def test_full_model_queue_is_refused_at_once_and_releases_still_pass():
    with InProcessServer([SlowModel(1000, [7], model_id="slow")], max_queue=2) as srv, Client(srv.target) as c:
        ids = [c.prefill("slow", [1]).output.cache.cache_id for _ in range(7)]

        async def burst():
            async with AsyncClient(srv.target) as ac:
                async def one(cid):
                    t0 = time.perf_counter()
                    try:
                        await ac.decode("slow", cid, 1)
                        return "ok", time.perf_counter() - t0, None
                    except FerrumRpcError as e:
                        return e.code.name, time.perf_counter() - t0, e

                tasks = []
                for cid in ids[:6]:  # one runs, two wait, three are refused
                    tasks.append(asyncio.ensure_future(one(cid)))
                    await asyncio.sleep(0.02)
                # while the queue is full a release is still admitted
                rel = await ac.release_cache("slow", ids[6])
                return await asyncio.gather(*tasks), rel

        results, rel = asyncio.run(burst())
        assert rel.released
        codes = [r[0] for r in results]
        assert codes == ["ok"] * 3 + ["RESOURCE_EXHAUSTED"] * 3, codes
        for code, secs, err in results[3:]:
            assert secs < 0.2, f"queue refusal took {secs:.3f}s"
            assert err.retry_after_s and "queue limit is 2" in err.message
            assert err.metadata["model_id"] == "slow"
        assert srv.server.metrics.value("ferrum_admission_refusals_total") == 3
        # drained: new work is admitted again
        assert c.decode("slow", ids[3], 1).output.cache.num_tokens == 2
        for cid in ids[:6]:
            c.release_cache("slow", cid)
        assert srv.live_caches()["slow"] == 0


def test_real_model_under_kv_pressure_refuses_instead_of_allocating(tiny_llama_dir):  # noqa: F811
    """The tiny Llama with a 4-block (64-token) paged pool: prompts beyond it are refused, the
    pool never grows, and it is whole again after the releases."""
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    ex = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=64)
    with InProcessServer([ex]) as srv, Client(srv.target) as c:
        held, refusals = [], 0
        for i in range(12):
            try:
                held.append(c.prefill("tiny", list(range(5, 5 + 20))).output.cache.cache_id)
            except FerrumRpcError as e:
                assert e.code == X and e.retry_after_s, e
                refusals += 1
        assert len(held) >= 2 and refusals >= 8
        assert ex.prefix.used_blocks <= ex.pool.num_blocks == 4
        assert c.kv_capacity("tiny").used_tokens <= 64
        for cid in held:
            assert c.release_cache("tiny", cid).released
        assert ex.prefix.used_blocks == 0
        assert c.prefill("tiny", list(range(5, 69))).output.cache.num_tokens == 64


def test_refusals_are_logged_with_structured_fields():
    with ServerProcess("--model", "configurable,id=mock,vocab_size=1000,token_sequence=7,kv_budget_tokens=16") as srv, \
            Client(srv.target) as c:
        c.prefill("mock", list(range(1, 17)))
        with pytest.raises(FerrumRpcError) as e:
            c.prefill("mock", [1])
        assert e.value.code == X
        wait_until(lambda: '"request refused"' in srv.log(), timeout=5, interval=0.05)
        lines = [json.loads(ln) for ln in srv.log().splitlines() if '"request refused"' in ln]
    assert lines, "no structured refusal log line"
    rec = lines[-1]
    assert rec["rpc"] == "Prefill" and rec["code"] == "RESOURCE_EXHAUSTED" and rec["kind"] == "RESOURCE_EXHAUSTED"
    assert rec["field"] == "input" and rec["level"] == "warning" and "free" in rec["message"]
