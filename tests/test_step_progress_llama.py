"""The ``StepProgress`` detail on the llama.cpp executor (issue 40): a step refused mid-batch runs
no row and leaves every cache as it was (packaged SmolLM2 GGUF, a real server)."""

from __future__ import annotations

import grpc
import pytest

from ferrum_client import Client, messages as m, pb, step_progress, tpb

from .support.packaged import smollm2_gguf_path
from .support.prompts import prompt_ids
from .support.servers import InProcessServer

pytest.importorskip("llama_cpp")

M = "llc"
NOT_RUN = tpb.ITEM_STATE_NOT_RUN


def _states(err: grpc.RpcError) -> list[tuple[int, int, int, str]]:
    return [(i.index, i.state, i.tokens_ran, i.reason) for i in step_progress(err).items]


def test_a_failed_unified_step_on_llama_cpp_runs_no_row():
    from ferrum_service.executors.llama_cpp import LlamaCppExecutor

    ex = LlamaCppExecutor(smollm2_gguf_path(), model_id=M, threads=2, n_ctx=512, n_seq=4)
    with InProcessServer([ex]) as s, Client(s.target) as c:
        a = c.stub.Prefill(pb.PrefillRequest(model_id=M, input=m.prefill_input(prompt_ids(10, 1), policy=m.greedy())))
        cid = a.output.cache.cache_id
        items = [m.unified_item([7], cache_id=cid, pos_offset=10, policy=m.greedy()),
                 m.unified_item([7], cache_id="llc-released-or-never", pos_offset=3, policy=m.greedy()),
                 m.unified_item(prompt_ids(5, 2), policy=m.greedy())]
        with pytest.raises(grpc.RpcError) as e:
            c.stub.UnifiedDecode(pb.UnifiedDecodeRequest(model_id=M, items=items))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert _states(e.value) == [(0, NOT_RUN, 0, "STEP_FAILED"), (1, NOT_RUN, 0, "NOT_FOUND"),
                                    (2, NOT_RUN, 0, "STEP_FAILED")]
        assert len(ex.registry) == 1  # the new prompt's cache was not created
        # a batch whose second prompt cannot fit the context: refused, nothing kept
        with pytest.raises(grpc.RpcError) as e:
            c.stub.BatchPrefill(pb.BatchPrefillRequest(model_id=M, inputs=[
                m.prefill_input(prompt_ids(20, 3), policy=m.greedy()),
                m.prefill_input(prompt_ids(4000, 4), policy=m.greedy())]))
        assert [x[:3] for x in _states(e.value)] == [(0, NOT_RUN, 0), (1, NOT_RUN, 0)]
        assert len(ex.registry) == 1
        ok = c.stub.UnifiedDecode(pb.UnifiedDecodeRequest(model_id=M, items=items[:1]))
        assert ok.results[0].cache.num_tokens == 11
