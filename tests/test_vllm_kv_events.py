"""The block-event relay behind the vLLM protocol's ``SubscribeKvEvents``: block events of one
model renumbered 1, 2, ... past the hub's cache events and other models' events, replay from a
cursor, the cursors it refuses, a subscriber that falls behind, and the common-format batches."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from ferrum_service.core import errors
from ferrum_service.hosting.kv_events import KvEventHub
from ferrum_service.wire.vllm_kv_events import BlockEventRelay, batch_pb, block_hash

BS = 4


def _stored(keys: list[bytes], parent: bytes, tokens: list[int], adapter: str = "") -> dict:
    return {"block_hashes": keys, "parent_block_hash": parent, "token_ids": tokens, "block_size": BS,
            "adapter": adapter}


async def _take(agen, n: int, timeout: float = 2.0) -> list:
    out = []
    async def run():
        async for b in agen:
            out.append(b)
            if len(out) == n:
                return
    await asyncio.wait_for(run(), timeout)
    return out


def test_block_hash_is_a_signed_int64_of_the_key():
    assert block_hash(b"\x01" + b"\0" * 31) == 1
    assert block_hash(b"\xff" * 32) == -1
    assert block_hash((2 ** 63).to_bytes(8, "little") + b"junk") == -(2 ** 63)


def test_relay_numbers_replays_and_refuses():
    async def main():
        hub = KvEventHub()
        relay = BlockEventRelay(hub, "m", replay=3)
        relay.start()
        hub.publish("created", "m", "c1", 8)  # a cache event: not relayed
        hub.publish_block("stored", "other", _stored([b"x" * 32], b"r" * 32, [1, 2, 3, 4]))  # another model
        hub.publish_block("stored", "m", _stored([b"a" * 32, b"b" * 32], b"r" * 32, list(range(8)), "ad"))
        hub.publish("extended", "m", "c1", 9)
        hub.publish_block("removed", "m", {"block_hashes": [b"a" * 32]})
        await asyncio.sleep(0.05)
        assert relay.seq == 2
        got = await _take(relay.batches(relay.cursor(0)), 2)
        assert [b.sequence_number for b in got] == [1, 2]
        st = got[0].events[0].stored
        assert [list(b.token_ids) for b in st.blocks] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert [b.block_hash for b in st.blocks] == [block_hash(b"a" * 32), block_hash(b"b" * 32)]
        assert st.parent_block_hash == block_hash(b"r" * 32) and st.lora_name == "ad"
        assert all(b.block_size == BS for b in st.blocks)
        assert list(got[1].events[0].removed.block_hashes) == [block_hash(b"a" * 32)]
        # resume after 1: only 2, then live ones
        agen = relay.batches(relay.cursor(1))
        first = await _take(agen, 1)
        assert [b.sequence_number for b in first] == [2]
        hub.publish_block("cleared", "m", {})
        live = await _take(agen, 1)
        assert live[0].sequence_number == 3 and live[0].events[0].WhichOneof("data") == "cleared"
        # past the last one (a restarted worker): OUT_OF_RANGE
        with pytest.raises(errors.FerrumError) as e:
            relay.cursor(10)
        assert e.value.code == grpc.StatusCode.OUT_OF_RANGE
        # older than the replay log (3 kept): a snapshot of the record (empty since the clear at 3,
        # the removals named blocks it did not hold) numbered 6, then live events; 0 likewise, as
        # the log no longer begins at 1
        for i in range(3):
            hub.publish_block("removed", "m", {"block_hashes": [bytes([i]) * 32]})
        await asyncio.sleep(0.05)
        assert relay.seq == 6
        for start in (1, 0):
            snap = await _take(relay.batches(relay.cursor(start)), 1)
            assert snap[0].sequence_number == 6 and snap[0].HasField("snapshot")
            assert [e.WhichOneof("data") for e in snap[0].events] == ["cleared"]
            assert (snap[0].snapshot.index, snap[0].snapshot.count, snap[0].snapshot.blocks) == (0, 1, 0)
        # a cursor the log still reaches replays from the log, no snapshot
        assert [b.sequence_number for b in await _take(relay.batches(relay.cursor(3)), 3)] == [4, 5, 6]
        await relay.close()

    asyncio.run(main())


def test_a_subscriber_that_falls_behind_gets_a_snapshot_then_live_events():
    async def main():
        hub = KvEventHub()
        relay = BlockEventRelay(hub, "m", replay=2)
        relay.start()
        hub.publish_block("stored", "m", _stored([b"a" * 32], b"r" * 32, [1, 2, 3, 4]))
        await asyncio.sleep(0.05)
        agen = relay.batches(relay.cursor(0))
        assert [b.sequence_number for b in await _take(agen, 1)] == [1]
        for i in range(5):  # the log keeps 2: the subscriber's next (2) is gone
            hub.publish_block("stored", "m", _stored([bytes([i]) * 32], b"a" * 32, [i] * 4))
        await asyncio.sleep(0.05)
        snap = await _take(agen, 1)
        assert snap[0].sequence_number == 6 and snap[0].snapshot.blocks == 6
        hub.publish_block("removed", "m", {"block_hashes": [b"a" * 32]})
        live = await _take(agen, 1)
        assert live[0].sequence_number == 7 and not live[0].HasField("snapshot")
        await relay.close()

    asyncio.run(main())


def test_a_subscriber_of_a_relay_that_lost_events_gets_data_loss():
    """The hub dropped events the relay had not read (its queue overflowed past the hub's
    buffer): a removal may be among them, so the record cannot be verified: a subscriber behind
    the log, or a cursor older than it, is DATA_LOSS; 0 replays what the log holds."""
    async def main():
        hub = KvEventHub(replay=3, subscriber_buffer=2)
        relay = BlockEventRelay(hub, "m", replay=2)
        relay.start()
        hub.publish_block("removed", "m", {"block_hashes": [b"a" * 32]})
        await asyncio.sleep(0.05)
        agen = relay.batches(relay.cursor(0))
        assert [b.sequence_number for b in await _take(agen, 1)] == [1]
        for i in range(10):  # no await: the relay's queue overflows, the hub keeps 3
            hub.publish_block("removed", "m", {"block_hashes": [bytes([i]) * 32]})
        await asyncio.sleep(0.1)
        assert relay.epoch >= 1 and not relay.state.consistent
        with pytest.raises(errors.FerrumError) as e:
            await _take(agen, 1)
        assert e.value.code == grpc.StatusCode.DATA_LOSS
        with pytest.raises(errors.FerrumError) as e:
            relay.cursor(1)
        assert e.value.code == grpc.StatusCode.DATA_LOSS
        got = await _take(relay.batches(relay.cursor(0)), 2)
        assert [b.sequence_number for b in got] == [relay.seq - 1, relay.seq]
        assert not any(b.HasField("snapshot") for b in got)
        # the engine's clear makes the record exact again: snapshots resume
        hub.publish_block("cleared", "m", {})
        hub.publish_block("removed", "m", {"block_hashes": [b"z" * 32]})
        hub.publish_block("removed", "m", {"block_hashes": [b"y" * 32]})
        await asyncio.sleep(0.05)
        assert relay.state.consistent
        snap = await _take(relay.batches(relay.cursor(1)), 1)
        assert snap[0].sequence_number == relay.seq and snap[0].snapshot.count == 1
        await relay.close()

    asyncio.run(main())


def test_stored_events_without_token_ids_carry_no_blocks():
    """With bearer tokens on, the server strips token ids from block events: a block without its
    tokens would hash like every other in SMG's index, so the batch goes out empty."""
    from ferrum_service.hosting.kv_events import KvEventRecord

    ev = KvEventRecord(7, 0, "m", "", 0, 0, "stored", _stored([b"a" * 32], b"r" * 32, []))
    b = batch_pb(7, ev)
    assert b.sequence_number == 7 and len(b.events) == 0
