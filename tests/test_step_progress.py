"""The ``StepProgress`` detail of a failed step (issue 40): which items ran, which did not and why.

Real servers on loopback ports, the tiny random-weight llama, two authenticated callers. Steps run
all or nothing, so a step refused or failed before its forward committed reports every item
NOT_RUN — and the caches really are as before (checked by stepping them afterwards); the detail
names items by index only, never another caller's cache id or length."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from ferrum_client import Client, FerrumRpcError, messages as m, pb, step_progress, tpb
from ferrum_service.executors.transformers import HfCausalLmExecutor

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.prompts import prompt_ids
from .support.servers import InProcessServer

M = "tiny"
ALICE, BOB = "tok-alice", "tok-bob"
NOT_RUN, RAN = tpb.ITEM_STATE_NOT_RUN, tpb.ITEM_STATE_RAN


def _executor(path, budget_tokens: int = 1024) -> HfCausalLmExecutor:
    return HfCausalLmExecutor.from_path(path, model_id=M, device="cpu", kv_budget_tokens=budget_tokens)


def _prefill(c: Client, tokens) -> pb.PrefillOutput:
    return c.stub.Prefill(pb.PrefillRequest(model_id=M, input=pb.PrefillInput(
        token_ids=tokens, logits=m.greedy())), metadata=c.metadata).output


def _batch_decode(c: Client, caches: list[str]) -> pb.BatchDecodeResponse:
    return c.stub.BatchDecode(pb.BatchDecodeRequest(model_id=M, inputs=[
        m.decode_input(cid, 5, m.greedy()) for cid in caches]), metadata=c.metadata)


def _failure(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value


def _states(err: grpc.RpcError) -> list[tuple[int, int, int, str]]:
    p = step_progress(err)
    assert p is not None, "a failed step carries StepProgress"
    return [(i.index, i.state, i.tokens_ran, i.reason) for i in p.items]


def _status_bytes(err: grpc.RpcError) -> bytes:
    """Everything the caller receives about the failure: message and every detail."""
    st = rpc_status.from_call(err)
    return st.SerializeToString() + (err.details() or "").encode()


def test_another_callers_cache_in_a_batch_runs_no_row_and_leaks_nothing(tiny_llama_dir):
    ex = _executor(tiny_llama_dir)
    with InProcessServer([ex], auth_tokens=[ALICE, BOB]) as s, Client(s.target, token=ALICE) as alice, \
            Client(s.target, token=BOB) as bob:
        theirs = _prefill(alice, prompt_ids(37, 1)).cache
        mine = _prefill(bob, prompt_ids(20, 2)).cache
        err = _failure(lambda: _batch_decode(bob, [mine.cache_id, theirs.cache_id]))
        assert err.code() == grpc.StatusCode.NOT_FOUND
        assert _states(err) == [(0, NOT_RUN, 0, "STEP_FAILED"), (1, NOT_RUN, 0, "NOT_FOUND")]
        raw = _status_bytes(err)
        # alice's cache reads exactly as an id that never existed (the id echoed is bob's own
        # input): no length, no owner, nothing that tells it exists
        fake = "hf-" + "0" * (len(theirs.cache_id) - 3)
        other = _failure(lambda: _batch_decode(bob, [mine.cache_id, fake]))
        assert raw.replace(theirs.cache_id.encode(), fake.encode()) == _status_bytes(other)
        # truthful: bob's row did not run (his cache still ends at 20), alice's neither (37)
        assert _batch_decode(bob, [mine.cache_id]).outputs[0].cache.num_tokens == 21
        assert _batch_decode(alice, [theirs.cache_id]).outputs[0].cache.num_tokens == 38
        # the client's error carries it too
        with pytest.raises(FerrumRpcError) as e:
            bob.batch_decode(M, [m.decode_input(mine.cache_id, 5, m.greedy()),
                                 m.decode_input(theirs.cache_id, 5, m.greedy())])
        assert [i.state for i in e.value.progress.items] == [NOT_RUN, NOT_RUN]


def test_released_cache_stepped_again_runs_no_row(tiny_llama_dir):
    ex = _executor(tiny_llama_dir)
    with InProcessServer([ex], auth_tokens=[ALICE]) as s, Client(s.target, token=ALICE) as alice:
        live = _prefill(alice, prompt_ids(16, 3)).cache
        gone = _prefill(alice, prompt_ids(16, 4)).cache
        alice.release_cache(M, gone.cache_id)
        err = _failure(lambda: _batch_decode(alice, [gone.cache_id, live.cache_id]))
        assert err.code() == grpc.StatusCode.NOT_FOUND
        assert _states(err) == [(0, NOT_RUN, 0, "NOT_FOUND"), (1, NOT_RUN, 0, "STEP_FAILED")]
        assert _batch_decode(alice, [live.cache_id]).outputs[0].cache.num_tokens == 17


def test_stale_frontier_in_a_unified_step_runs_no_row(tiny_llama_dir):
    ex = _executor(tiny_llama_dir)
    with InProcessServer([ex], auth_tokens=[ALICE]) as s, Client(s.target, token=ALICE) as alice:
        a = _prefill(alice, prompt_ids(12, 5)).cache
        b = _prefill(alice, prompt_ids(9, 6)).cache
        items = [m.unified_item([7], cache_id=a.cache_id, pos_offset=12, policy=m.greedy()),
                 m.unified_item([7], cache_id=b.cache_id, pos_offset=8, policy=m.greedy()),  # stale: b holds 9
                 m.unified_item(prompt_ids(6, 7), policy=m.greedy())]
        err = _failure(lambda: alice.stub.UnifiedDecode(pb.UnifiedDecodeRequest(model_id=M, items=items),
                                                        metadata=alice.metadata))
        states = _states(err)
        assert [x[:3] for x in states] == [(0, NOT_RUN, 0), (1, NOT_RUN, 0), (2, NOT_RUN, 0)]
        assert states[1][3] not in ("", "STEP_FAILED") and states[0][3] == states[2][3] == "STEP_FAILED"
        assert len(ex.registry) == 2  # the new prompt's cache was not created
        ok = alice.stub.UnifiedDecode(pb.UnifiedDecodeRequest(model_id=M, items=items[:1]), metadata=alice.metadata)
        assert ok.results[0].cache.num_tokens == 13


def test_kv_budget_exhausted_mid_batch_runs_no_row(tiny_llama_dir):
    ex = _executor(tiny_llama_dir, budget_tokens=256)
    with InProcessServer([ex], auth_tokens=[ALICE]) as s, Client(s.target, token=ALICE) as alice:
        err = _failure(lambda: alice.stub.BatchPrefill(pb.BatchPrefillRequest(model_id=M, inputs=[
            m.prefill_input(prompt_ids(100, 8), policy=m.greedy()),
            m.prefill_input(prompt_ids(200, 9), policy=m.greedy())]), metadata=alice.metadata))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert [x[:3] for x in _states(err)] == [(0, NOT_RUN, 0), (1, NOT_RUN, 0)]
        assert len(ex.registry) == 0  # nothing of the batch was kept
        st = rpc_status.from_call(err)
        assert any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in st.details)  # still there


def test_a_successful_step_and_a_non_step_error_carry_no_progress(tiny_llama_dir):
    ex = _executor(tiny_llama_dir)
    with InProcessServer([ex], auth_tokens=[ALICE]) as s, Client(s.target, token=ALICE) as alice:
        err = _failure(lambda: alice.stub.TruncateKv(pb.TruncateKvRequest(model_id=M, cache_id="nope", new_len=1),
                                                     metadata=alice.metadata))
        assert err.code() == grpc.StatusCode.NOT_FOUND and step_progress(err) is None
        with pytest.raises(FerrumRpcError) as e:
            alice.truncate_kv(M, "nope", 1)
        assert e.value.progress is None


def test_a_failed_step_on_a_session_carries_its_progress_in_band(tiny_llama_dir):
    ex = _executor(tiny_llama_dir)
    with InProcessServer([ex], auth_tokens=[ALICE, BOB]) as s, Client(s.target, token=ALICE) as alice, \
            Client(s.target, token=BOB) as bob:
        theirs = _prefill(alice, prompt_ids(10, 10)).cache
        with bob.session() as sess:
            mine = sess.step(pb.PrefillRequest(model_id=M, input=m.prefill_input(prompt_ids(8, 11), policy=m.greedy())))
            cid = mine.output.cache.cache_id
            with pytest.raises(FerrumRpcError) as e:
                sess.step(pb.BatchDecodeRequest(model_id=M, inputs=[m.decode_input(theirs.cache_id, 5, m.greedy()),
                                                                    m.decode_input(cid, 5, m.greedy())]))
            assert e.value.code == grpc.StatusCode.NOT_FOUND
            assert [(i.index, i.state, i.tokens_ran, i.reason) for i in e.value.progress.items] == [
                (0, NOT_RUN, 0, "NOT_FOUND"), (1, NOT_RUN, 0, "STEP_FAILED")]
            # the session goes on, and bob's cache did not move
            ok = sess.step(pb.BatchDecodeRequest(model_id=M, inputs=[m.decode_input(cid, 5, m.greedy())]))
            assert ok.outputs[0].cache.num_tokens == 9


def test_a_step_refused_after_its_forward_reports_every_item_ran(tiny_llama_dir):
    """A decode whose fed token the cache's constraint refuses is refused after the forward
    committed: the detail says RAN (1 token), and the cache does hold it."""
    import numpy as np

    ex = _executor(tiny_llama_dir)
    with InProcessServer([ex], auth_tokens=[ALICE]) as s, Client(s.target, token=ALICE) as alice:
        pol = m.full_logits()
        pol.sampling.constraint.CopyFrom(tpb.OutputConstraint(regex="[0-9]+"))
        out = alice.stub.Prefill(pb.PrefillRequest(model_id=M, input=pb.PrefillInput(
            token_ids=prompt_ids(12, 12), logits=pol)), metadata=alice.metadata).output
        refused = int(np.flatnonzero(~np.isfinite(m.logits_array(out.output)))[0])
        cid = out.cache.cache_id
        greedy = m.greedy()
        greedy.sampling.constraint.CopyFrom(pol.sampling.constraint)
        err = _failure(lambda: alice.stub.BatchDecode(pb.BatchDecodeRequest(model_id=M, inputs=[
            m.decode_input(cid, refused, greedy)]), metadata=alice.metadata))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert _states(err) == [(0, RAN, 1, "")]
        assert next(c for c in alice.list_caches(M).caches if c.cache_id == cid).num_tokens == 13
