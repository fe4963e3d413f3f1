"""The vLLM engine protocol against another caller's reservations, the server's role and drain, and
the KV-event relay's memory (audit 2026-12-05: M3, M7, L4, L11), through real gRPC servers on the
tiny transformers Llama (and the real event hub for the relay's bound).

* M7: an unset ``max_tokens`` reserves the prompt + 128 tokens and grows; when another caller's
  reservation leaves it no room it ends with RESOURCE_EXHAUSTED naming how far it got, never a
  finish ``length`` that looks like the end of the context.
* L4: a ``--role prefill`` worker runs SMG's prefill legs only, as the contract's ``Generate``
  decodes nothing there; a ``--role decode`` worker keeps computing a prompt that comes without a
  usable handoff (SMG 1.13's PD mode sends it such requests: docs/operating.md).
* L11: a worker draining by migration answers ``HealthCheck`` unhealthy and ``is_paused``.
* M3: the relay's log is bounded by ``--kv-event-replay-bytes`` and exists only once someone
  subscribes through this protocol.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from ferrum_client import Client, pb

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.servers import InProcessServer
from .support.vllm_calls import auth as _auth
from .support.vllm_calls import gen_request as _req
from .support.vllm_calls import rpc_error as _rpc_error
from .support.waits import wait_no_live_caches, wait_until

pytest.importorskip("transformers")

C = grpc.StatusCode
ALICE, BOB, ADMIN = "tok-alice", "tok-bob", "tok-admin"
BS = 16


def _executor(path, budget: int = 4096, prefix_cache: bool = False):
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    return HfCausalLmExecutor.from_path(path, model_id="tiny", device="cpu", kv_budget_tokens=budget,
                                        prefix_cache=prefix_cache)


# ---- M7 ---------------------------------------------------------------------------------------------
def test_another_callers_reservation_never_silently_cuts_an_unset_max_tokens(tiny_llama_dir):  # noqa: F811
    """The audit's probe: bob reserves all but 10 blocks with Prefill{reserve_tokens}; alice's vLLM
    Generate without max_tokens (rest of the 1,024-token context) is admitted (prompt + 128 fit),
    grows, and when the KV runs out the stream ends RESOURCE_EXHAUSTED saying so. Before, it ended
    with finish "length" after ~150 tokens, indistinguishable from a normal end."""
    with InProcessServer([_executor(tiny_llama_dir, budget=1024)], auth_tokens=[ALICE, BOB]) as srv, \
            Client(srv.target, token=BOB) as bob, grpc.insecure_channel(srv.target) as ch:
        eng = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        total = srv.models.get("tiny").executor.registry.total_tokens
        held = bob.stub.Prefill(pb.PrefillRequest(model_id="tiny", input=pb.PrefillInput(
            token_ids=[5, 6], reserve_tokens=total - 10 * BS)), metadata=bob.metadata).output.cache.cache_id
        ids = list(range(20, 28))
        chunks, end = 0, None
        with pytest.raises(grpc.RpcError) as e:
            for o in eng.Generate(_req(ids, stream=True, ignore_eos=True, temperature=0.0), metadata=_auth(ALICE),
                                  timeout=120):
                if o.WhichOneof("response") == "chunk":
                    chunks += 1
                else:
                    end = o.complete.finish_reason
        assert end is None, f"finished {end!r} after {chunks} tokens of the context's {1024 - len(ids)}"
        assert e.value.code() == C.RESOURCE_EXHAUSTED, e.value
        assert "max_tokens" in e.value.details() and "could not grow past" in e.value.details(), e.value.details()
        assert 128 <= chunks < 10 * BS
        # bob's reservation is untouched; alice's cache is freed; with max_tokens given it is refused up front
        assert wait_until(lambda: len(srv.models.get("tiny").executor.registry) == 1)
        e2 = _rpc_error(lambda: list(eng.Generate(_req(ids, max_tokens=500), metadata=_auth(ALICE), timeout=30)))
        assert e2.code() == C.RESOURCE_EXHAUSTED
        bob.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id="tiny", cache_id=held), metadata=bob.metadata)
        assert wait_no_live_caches(srv) == {"tiny": 0}


# ---- L4 ---------------------------------------------------------------------------------------------
def test_roles_hold_on_the_vllm_protocol(tiny_llama_dir):  # noqa: F811
    """A prefill worker refuses anything but a prefill leg (max_tokens 1, one sample):
    FAILED_PRECONDITION naming the role, nothing left (before, it decoded whole outputs). A decode
    worker computes a prompt that comes without a handoff (the documented exception)."""
    with InProcessServer([_executor(tiny_llama_dir)], role="decode") as dec, \
            InProcessServer([_executor(tiny_llama_dir)], role="prefill") as pre, \
            grpc.insecure_channel(dec.target) as dc, grpc.insecure_channel(pre.target) as pc:
        deng, peng = vllm_engine_pb2_grpc.VllmEngineStub(dc), vllm_engine_pb2_grpc.VllmEngineStub(pc)
        ids = list(range(30, 60))
        out = list(deng.Generate(_req(ids, max_tokens=4, ignore_eos=True), timeout=30))
        assert out[-1].complete.completion_tokens == 4
        e = _rpc_error(lambda: list(peng.Generate(_req(ids, max_tokens=4), timeout=30)))
        assert e.code() == C.FAILED_PRECONDITION and "role prefill" in e.details(), e
        e = _rpc_error(lambda: list(peng.Generate(_req(ids, max_tokens=1, n=2), timeout=30)))
        assert e.code() == C.FAILED_PRECONDITION
        out = list(peng.Generate(_req(ids, max_tokens=1, temperature=0.0), timeout=30))  # SMG's prefill leg
        assert out[-1].complete.completion_tokens == 1 and out[-1].complete.kv_transfer_params_json
        assert wait_no_live_caches(dec) == {"tiny": 0}
        assert pre.live_caches() == {"tiny": 1} and pre.server.vllm.pd.offered == 1  # kept for the decode leg


# ---- L11 --------------------------------------------------------------------------------------------
def test_a_worker_draining_by_migration_is_unhealthy_on_the_vllm_protocol(tiny_llama_dir):  # noqa: F811
    """After MigrateStreams{drain} (admin), vLLM HealthCheck says unhealthy and GetServerInfo
    is_paused (both said healthy/not paused before while Generate answered UNAVAILABLE), so SMG
    stops routing here; the reads and Abort still answer."""
    with InProcessServer([_executor(tiny_llama_dir)], auth_tokens=[ALICE], admin_tokens=[ADMIN],
                         kv_peers=["127.0.0.1:9"]) as srv, Client(srv.target, token=ADMIN) as adm, \
            grpc.insecure_channel(srv.target) as ch:
        eng = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        a = _auth(ALICE)
        assert eng.HealthCheck(vpb.HealthCheckRequest(), metadata=a).healthy
        adm.stub.MigrateStreams(pb.MigrateStreamsRequest(target="127.0.0.1:9", drain=True), metadata=adm.metadata)
        h = eng.HealthCheck(vpb.HealthCheckRequest(), metadata=a)
        assert not h.healthy and "drain" in h.message, h
        assert eng.GetServerInfo(vpb.GetServerInfoRequest(), metadata=a).is_paused
        assert eng.GetLoads(vpb.GetLoadsRequest(), metadata=a).loads
        eng.Abort(vpb.AbortRequest(request_ids=["x"]), metadata=a)
        e = _rpc_error(lambda: list(eng.Generate(_req([5, 6], max_tokens=2), metadata=a, timeout=10)))
        assert e.code() == C.UNAVAILABLE


# ---- M3 ---------------------------------------------------------------------------------------------
def test_the_relay_is_bounded_by_the_replay_bytes():
    """Without per-caller auth stored events keep their token ids; 2,000 events of 1,000 tokens
    (about 8 MB) with --kv-event-replay-bytes 1 MiB: the relay's log stays within that bound, as
    the hub's does (before, the relay kept all of them: 65,536 events)."""
    from ferrum_service.hosting.kv_events import KvEventHub
    from ferrum_service.wire.vllm_kv_events import BlockEventRelay

    bound = 1 << 20

    async def main():
        hub = KvEventHub(replay_bytes=bound)
        relay = BlockEventRelay(hub, "m")
        relay.start()
        for i in range(2000):
            tokens = list(range(i, i + 1000))
            hub.publish_block("stored", "m", {"block_hashes": [i.to_bytes(4, "little") * 8 for _ in range(62)],
                                              "parent_block_hash": b"r" * 32, "token_ids": tokens, "block_size": 16})
            if i % 100 == 99:
                await asyncio.sleep(0)
        await asyncio.sleep(0.1)
        held = sum(ev.nbytes() for _, ev in relay.log)
        seq = relay.seq
        await relay.close()
        return held, len(relay.log), seq, hub.replay_held_bytes

    held, kept, seq, hub_held = asyncio.run(main())
    assert seq == 2000
    assert held <= bound and hub_held <= bound, (held, hub_held)
    assert 0 < kept < 2000


def test_the_relay_holds_nothing_until_someone_subscribes(tiny_llama_dir):  # noqa: F811
    """A no-auth server whose prompts store blocks keeps no relay copy while nobody uses the vLLM
    protocol's SubscribeKvEvents; the first subscriber starts it, from what the hub still holds."""
    with InProcessServer([_executor(tiny_llama_dir, prefix_cache=True)]) as srv, \
            Client(srv.target) as c, grpc.insecure_channel(srv.target) as ch:
        for k in range(4):
            c.stub.Prefill(pb.PrefillRequest(model_id="tiny", input=pb.PrefillInput(
                token_ids=list(range(100 + k, 140 + k)))))
        relay = srv.server.vllm.relay
        assert srv.run(_relay_state(relay)) == (0, 0)
        eng = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        sub = eng.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(start_sequence_number=0), timeout=30)
        first = next(sub)
        sub.cancel()
        assert first.sequence_number == 1 and first.events[0].stored.blocks
        assert srv.run(_relay_state(relay))[0] >= 4


async def _relay_state(relay) -> tuple[int, int]:
    return relay.seq, len(relay.log)
