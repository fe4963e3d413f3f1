"""Block events on ZeroMQ in vLLM's format (``wire/zmq_kv_events.py``), for llm-d's precise scorer.

A real server (tiny random-weight Llama, paged prefix cache of 16-token blocks) publishes on a real
ZMQ socket; a SUB socket reads the three frames vLLM's publisher sends (topic, 8-byte sequence,
msgpack) and decodes the payload with vLLM's own event schema (``msgspec`` structs as in vLLM's
``kv_events_subscriber.py`` example); a DEALER asks the replay socket as vLLM's subscriber does.
"""

from __future__ import annotations

import time

import grpc
import msgspec
import pytest
import zmq
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from ferrum_client import Client, pb
from ferrum_client.prefix_keys import block_keys, chain_root
from ferrum_service.executors import StubModelExecutor
from ferrum_service.executors.transformers import HfCausalLmExecutor
from ferrum_service.server import Server, ServerConfig, host_models
from ferrum_service.wire.vllm_kv_events import block_hash
from ferrum_service.wire.zmq_kv_events import END_SEQ, event_of

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.prompts import prompt_ids
from .support.servers import InProcessServer

pytestmark = pytest.mark.timeout(120)
BS = 16


# ---- vLLM's event schema (vllm/distributed/kv_events.py), as its subscriber example declares it ----
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODE = msgspec.msgpack.Decoder(KVEventBatch).decode


def _u64(key: bytes) -> int:
    return block_hash(key) & 0xFFFF_FFFF_FFFF_FFFF


@pytest.fixture
def srv(tiny_llama_dir):
    ex = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=64 * BS)
    with InProcessServer([ex], kv_events_zmq_endpoint="tcp://127.0.0.1:*", open_admin_rpcs=True,
                         kv_events_zmq_topic="kv@10.1.2.3@{model}",
                         kv_events_zmq_replay_endpoint="tcp://127.0.0.1:*") as s:
        yield s


def _recv(sock, timeout_s: float = 10.0) -> list[bytes]:
    assert sock.poll(int(timeout_s * 1000)), "no ZMQ message within the timeout"
    return sock.recv_multipart()


def _prefill_release(target: str, tokens: list[int]) -> None:
    with Client(target) as c:
        out = c.stub.Prefill(pb.PrefillRequest(model_id="tiny", input=pb.PrefillInput(
            token_ids=tokens, cache_salt="t1"))).output
        c.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id="tiny", cache_id=out.cache.cache_id))


def test_stored_and_cleared_blocks_in_vllms_format_then_replayed(srv):
    pub = srv.server.zmq_events
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(pub.bound)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    time.sleep(0.5)  # a PUB socket drops what it sends before the subscription reached it
    try:
        p = prompt_ids(40)
        _prefill_release(srv.target, p)
        topic, seq, payload = _recv(sub)
        assert topic == b"kv@10.1.2.3@tiny" and int.from_bytes(seq, "big") == 0
        batch = DECODE(payload)
        assert abs(batch.ts - time.time()) < 60 and len(batch.events) == 1
        stored = batch.events[0]
        assert isinstance(stored, BlockStored)
        assert stored.block_hashes == [_u64(k) for k in block_keys(p, BS, model_id="tiny", cache_salt="t1")]
        assert stored.parent_block_hash == _u64(chain_root("tiny", "t1"))
        assert stored.token_ids == p[:32] and stored.block_size == BS

        with grpc.insecure_channel(srv.target) as ch:
            assert vllm_engine_pb2_grpc.VllmEngineStub(ch).FlushCache(cpb.FlushCacheRequest(), timeout=30).success
        topic, seq, payload = _recv(sub)
        assert int.from_bytes(seq, "big") == 1 and isinstance(DECODE(payload).events[0], AllBlocksCleared)

        # replay from 0, as vLLM's subscriber asks after a gap: every batch, then the end marker
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_bound)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        got = []
        while True:
            _, s, data = _recv(dealer)
            if s == END_SEQ:
                assert data == b""
                break
            got.append((int.from_bytes(s, "big"), type(DECODE(data).events[0]).__name__))
        assert got == [(0, "BlockStored"), (1, "AllBlocksCleared")]
        # a malformed request is ignored, and the socket still answers
        dealer.send_multipart((b"", b"xx"))
        dealer.send_multipart((b"", (1).to_bytes(8, "big")))
        _, s, _ = _recv(dealer)
        assert int.from_bytes(s, "big") == 1
        dealer.close(0)
    finally:
        sub.close(0)
        ctx.term()


def test_refused_when_callers_are_told_apart():
    cfg = ServerConfig(host="127.0.0.1", port=0, metrics_port=0, auth_tokens=["secret"],
                       kv_events_zmq_endpoint="tcp://127.0.0.1:*")
    with pytest.raises(ValueError, match="no authentication"):
        Server(host_models([StubModelExecutor(model_id="stub")], 8), cfg)


def test_blocks_without_their_tokens_are_not_published():
    from ferrum_service.core.modes import BlockEvent
    from ferrum_service.hosting.kv_events import KvEventRecord

    keys = [b"k" * 16, b"l" * 16]
    ev = KvEventRecord(1, 0, "m", "", 0, 0, BlockEvent.STORED,
                       {"block_hashes": keys, "token_ids": (), "block_size": 16})
    assert event_of(ev) is None
    ev = KvEventRecord(1, 0, "m", "", 0, 0, BlockEvent.STORED,
                       {"block_hashes": keys[:1], "token_ids": list(range(16)), "block_size": 16, "adapter": "a1"})
    out = event_of(ev)
    assert out[0] == "BlockStored" and out[-1] == "a1"  # vLLM's newer trailing lora_name
    decoded = msgspec.msgpack.Decoder(KVEventBatch).decode(msgspec.msgpack.encode([0.0, [out]]))
    assert decoded.events[0].token_ids == list(range(16))  # an older schema ignores the extra field
