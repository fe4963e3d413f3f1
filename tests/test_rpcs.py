"""Every RPC of the contract through a real channel (configurable / stub executors)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ferrum_client import Client, FerrumRpcError, messages as m, pb, tpb

from .conftest import contract_executors
from .support.servers import InProcessServer
from .support.waits import wait_no_live_caches


def test_info_lists_every_model(client):
    info = client.info()
    assert [x.model_id for x in info.models] == ["mock", "eos", "perseq", "stub"]
    assert info.contract_version == "ferrum.executor.v1" and info.server_version
    one = client.info("mock").models
    assert len(one) == 1 and one[0].vocab_size == 1000 and one[0].max_sequence_length == 4096
    assert one[0].version == "configurable-1.0" and one[0].model_type == tpb.MODEL_TYPE_CUSTOM


def test_capabilities_and_status(client):
    caps = client.capabilities("mock")
    assert caps.max_batch_size == 256 and caps.supports_continuous_batching and caps.supports_generation
    cid = client.prefill("mock", [1]).output.cache.cache_id
    client.decode("mock", cid, 1)
    st = client.status("mock")
    assert st.status.state == tpb.EXECUTOR_STATE_READY and st.status.is_ready
    assert st.status.decode_operations == 1 and st.status.prefill_operations == 1
    assert st.status.active_caches == 1 and st.metrics.total_operations == 2
    assert st.status.HasField("ns_since_last_operation")


def test_kv_capacity_tracks_caches(client):
    before = client.kv_capacity("mock")
    cid = client.prefill("mock", [1, 2, 3], reserve_tokens=10).output.cache.cache_id
    during = client.kv_capacity("mock")
    assert during.used_tokens == before.used_tokens + 3
    assert during.reserved_tokens == before.reserved_tokens + 7
    assert during.free_tokens == before.free_tokens - 10
    client.release_cache("mock", cid)
    assert client.kv_capacity("mock").free_tokens == before.free_tokens


def test_admission_and_slot_rpcs_report_none_for_contract_executors(client):
    assert not client.admission_limits("mock").HasField("limits")
    assert not client.kv_slot_capacity("mock").HasField("snapshot")
    cid = client.prefill("mock", [1]).output.cache.cache_id
    r = client.reserve_kv_slots("mock", [tpb.KvSlotRequest(cache_id=cid, target_len=2)])
    assert not r.HasField("reservation")
    # A new sequence on an executor without paged admission: nothing is created (ferrum's Ok(None)).
    live = client.kv_capacity("mock").used_tokens, len(client.list_caches("mock").caches)
    r = client.reserve_kv_slots("mock", [tpb.KvSlotRequest(cache_id="engine-1", target_len=2, new_sequence=True)])
    assert not r.HasField("reservation")
    assert (client.kv_capacity("mock").used_tokens, len(client.list_caches("mock").caches)) == live
    assert not client.cache_metrics("mock").HasField("metrics")
    assert not client.lora_metrics("mock").HasField("metrics")


def test_batch_prefill_one_output_per_input(client):
    out = client.batch_prefill("mock", [[1], [2, 3], [4, 5, 6]]).outputs
    assert [o.cache.num_tokens for o in out] == [1, 2, 3]
    assert len({o.cache.cache_id for o in out}) == 3
    assert all(o.output.token_id == 10 for o in out)


def test_chunked_prefill_continues_a_cache(client):
    first = client.prefill("mock", [1, 2]).output
    second = client.prefill("mock", [3, 4, 5], cache_id=first.cache.cache_id).output
    assert second.cache.cache_id == first.cache.cache_id and second.cache.num_tokens == 5


def test_all_positions_returns_a_row_per_prompt_token(client):
    out = client.prefill("mock", [1, 2, 3], all_positions=True).output
    assert len(out.positions) == 3 and all(p.token_id == 10 for p in out.positions)


def test_forward_unimplemented_on_contract_executors(client):
    with pytest.raises(FerrumRpcError) as e:
        client.forward("mock", np.array([[1, 2]]))
    assert e.value.code == grpc.StatusCode.UNIMPLEMENTED and e.value.kind == "UNSUPPORTED"


def test_tokenization_needs_a_tokenizer(client):
    for call in (lambda: client.tokenize("mock", "hi"), lambda: client.detokenize("mock", [1]),
                 lambda: client.apply_chat_template("mock", [("user", "hi")])):
        with pytest.raises(FerrumRpcError) as e:
            call()
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and e.value.field == "model_id"


def test_admin_rpcs_are_refused_unless_opened():
    """Without admin tokens and without --open-admin-rpcs, Warmup and Shutdown are PERMISSION_DENIED
    and the model keeps serving."""
    with InProcessServer(contract_executors()) as srv, Client(srv.target) as c:
        for call in (lambda: c.warmup("mock"), lambda: c.shutdown("stub"), lambda: c.shutdown()):
            with pytest.raises(FerrumRpcError) as e:
                call()
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED and "--open-admin-rpcs" in e.value.message
        assert c.status("stub").status.state == tpb.EXECUTOR_STATE_READY
        assert c.prefill("mock", [1]).output.output.token_id == 10


def test_warmup_and_shutdown(fresh_server, client):
    assert list(client.warmup("mock").model_ids) == ["mock"]
    cid = client.prefill("stub", [1]).output.cache.cache_id
    r = client.shutdown("stub")
    assert cid and list(r.model_ids) == ["stub"] and r.released_caches == 1
    assert client.status("stub").status.state == tpb.EXECUTOR_STATE_SHUTDOWN
    with pytest.raises(FerrumRpcError) as e:
        client.prefill("stub", [1])
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    # other models keep serving; the stopped one's health is NOT_SERVING
    assert client.prefill("mock", [1]).output.output.token_id == 10
    assert client.health("stub") == "NOT_SERVING" and client.health("mock") == "SERVING"


def test_a_step_on_a_cache_of_a_shut_down_model_is_unavailable(fresh_server, client):
    cid = client.prefill("stub", [1]).output.cache.cache_id
    assert client.shutdown("stub").released_caches == 1
    with pytest.raises(FerrumRpcError) as e:
        client.decode("stub", cid, 1)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE, e.value


def test_health_per_model_and_reflection(fresh_server):
    ch = grpc.insecure_channel(fresh_server.target)
    h = health_pb2_grpc.HealthStub(ch)
    for svc in ("", "mock", "stub", "ferrum.executor.v1.ModelExecutor"):
        assert h.Check(health_pb2.HealthCheckRequest(service=svc)).status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as e:
        h.Check(health_pb2.HealthCheckRequest(service="nope"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    r = reflection_pb2_grpc.ServerReflectionStub(ch)
    resp = next(r.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"ferrum.executor.v1.ModelExecutor", "grpc.health.v1.Health"} <= names
    ch.close()


def test_reflection_can_be_turned_off():
    from ferrum_service.executors import StubModelExecutor

    with InProcessServer([StubModelExecutor("stub", 10)], reflection=False) as srv:
        ch = grpc.insecure_channel(srv.target)
        r = reflection_pb2_grpc.ServerReflectionStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            next(r.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        ch.close()


def test_sole_model_may_be_unnamed():
    from ferrum_service.executors import ConfigurableModelExecutor

    with InProcessServer([ConfigurableModelExecutor.with_token_sequence(50, [7])]) as srv, Client(srv.target) as c:
        assert c.prefill("", [1]).output.output.token_id == 7


def test_generate_cancel_frees_cache(fresh_server, client):
    stream = client.generate("mock", token_ids=[1, 2, 3], max_tokens=4000)
    it = iter(stream)
    assert next(it).WhichOneof("event") == "started"
    for _ in range(3):
        assert next(it).WhichOneof("event") == "token"
    stream.cancel()
    with pytest.raises(FerrumRpcError) as e:
        list(it)
    assert e.value.code == grpc.StatusCode.CANCELLED
    assert wait_no_live_caches(fresh_server, timeout=5)["mock"] == 0


def test_generate_keep_cache_then_continue(client):
    events = list(client.generate("mock", token_ids=[1, 2], max_tokens=3, keep_cache=True))
    fin = events[-1].finished
    toks = [e.token.token_id for e in events if e.WhichOneof("event") == "token"]
    assert fin.cache.cache_id and fin.cache.num_tokens == 2 + 2  # prompt + fed tokens (last not fed)
    more = client.generate("mock", cache_id=fin.cache.cache_id, last_token_id=toks[-1], max_tokens=2).tokens()
    assert len(more) == 2
    assert client.release_cache("mock", fin.cache.cache_id).released


def test_session_end_releases_its_caches(fresh_server, client):
    with client.session() as s:
        for i in range(3):
            s.step(pb.PrefillRequest(model_id="mock", input=m.prefill_input([i + 1])))
        assert fresh_server.live_caches()["mock"] == 3
    assert wait_no_live_caches(fresh_server, timeout=5)["mock"] == 0
