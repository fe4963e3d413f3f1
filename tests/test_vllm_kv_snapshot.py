"""The relay's record of the live blocks and the state snapshots cut from it
(``wire/vllm_kv_snapshot.py``): the record against an index applying the same stream, parents
before children, a block announced again, chunk numbering and size, ``unknown_before``, the cost on the event loop, and
the relay serving snapshots (a flood of late subscribers shares one)."""

from __future__ import annotations

import asyncio
import random
import time

from smg_grpc_proto.generated import common_pb2 as cpb

from ferrum_service.core.modes import BlockEvent
from ferrum_service.hosting.kv_events import KvEventHub, KvEventRecord
from ferrum_service.wire import vllm_kv_snapshot as snapmod
from ferrum_service.wire.vllm_kv_events import BlockEventRelay
from ferrum_service.wire.vllm_kv_snapshot import CHUNK_BLOCKS, LiveState, block_hash, build

BS = 4


def _key(i: int) -> bytes:
    return i.to_bytes(8, "little", signed=True) + b"k" * 24


def _stored(keys: list[int], parent: int | None, adapter: str = "", namespace: str = "") -> dict:
    return {"block_hashes": [_key(k) for k in keys], "parent_block_hash": _key(parent) if parent is not None else b"",
            "token_ids": [t for k in keys for t in [k] * BS], "block_size": BS, "adapter": adapter,
            "namespace": namespace}


def _ev(kind: BlockEvent, data: dict, seq: int = 1) -> KvEventRecord:
    return KvEventRecord(seq, 0, "m", "", 0, 0, kind, data)


def _apply(state: LiveState, *events: tuple[BlockEvent, dict]) -> None:
    for kind, data in events:
        state.apply(_ev(kind, data))


def _blocks(chunks: list[cpb.KvEventBatch]) -> list[tuple[int, int | None, str, str]]:
    """(hash, parent, lora_name, cache_salt) of every stored block in order."""
    out = []
    for c in chunks:
        for e in c.events:
            if e.WhichOneof("data") != "stored":
                continue
            st = e.stored
            parent = st.parent_block_hash if st.HasField("parent_block_hash") else None
            for b in st.blocks:
                out.append((b.block_hash, parent, st.lora_name, st.cache_salt))
                parent = b.block_hash
    return out


def _replayed(chunks: list[cpb.KvEventBatch]) -> dict[int, int]:
    """What a subscriber holds after applying the chunks: hash -> copies."""
    held: dict[int, int] = {}
    for c in chunks:
        for e in c.events:
            if e.WhichOneof("data") == "cleared":
                held.clear()
            elif e.WhichOneof("data") == "stored":
                for b in e.stored.blocks:
                    held[b.block_hash] = held.get(b.block_hash, 0) + 1
    return held


def test_the_snapshot_lists_the_live_blocks_parents_first_with_their_fields():
    s = LiveState()
    _apply(s, (BlockEvent.STORED, _stored([1, 2, 3], None, adapter="ad")),
           (BlockEvent.REMOVED, {"block_hashes": [_key(1)]}),
           (BlockEvent.STORED, _stored([4], 3, namespace="00ff")),
           (BlockEvent.STORED, _stored([1], None, adapter="ad")),  # the parent again, after its children
           (BlockEvent.STORED, _stored([5], 4, namespace="00ff")))
    chunks = list(build(s.cut(5)).chunks())
    assert len(chunks) == 1 and chunks[0].sequence_number == 5
    assert chunks[0].events[0].WhichOneof("data") == "cleared" and chunks[0].events[0].event_id == 0
    assert all(e.event_id == 0 for e in chunks[0].events)
    got = _blocks(chunks)
    pos = {h: i for i, (h, *_rest) in enumerate(got)}
    assert sorted(pos) == [block_hash(_key(i)) for i in range(1, 6)]
    for h, parent, *_ in got:
        if parent is not None and parent in pos:
            assert pos[parent] < pos[h], got
    assert got[0][0] == block_hash(_key(1)) and got[0][1] is None and got[0][2] == "ad"
    assert dict((h, (lora, salt)) for h, _, lora, salt in got)[block_hash(_key(5))] == ("", "ferrum-ns:00ff")
    # a run chaining one from the other under the same fields goes out as one event: 1 (stored
    # again) then 2, 3 which name it; 4, 5 under their namespace
    st = [e.stored for e in chunks[0].events if e.WhichOneof("data") == "stored"]
    assert [[b.block_hash for b in x.blocks] for x in st] == [
        [block_hash(_key(i)) for i in (1, 2, 3)], [block_hash(_key(i)) for i in (4, 5)]]
    assert not st[0].HasField("parent_block_hash") and st[1].parent_block_hash == block_hash(_key(3))
    assert all(s_.tier == cpb.KV_CACHE_TIER_DEVICE and s_.locality == cpb.KV_CACHE_LOCALITY_LOCAL for s_ in st)
    assert [list(b.token_ids) for b in st[0].blocks] == [[1] * BS, [2] * BS, [3] * BS]
    assert chunks[0].snapshot.blocks == 5 and chunks[0].snapshot.unknown_before == 0


def test_a_block_announced_again_is_one_block():
    """llama.cpp re-announces keys another sequence holds; its index drops such a key once (when
    the holder goes): the record keeps one block, so that one removal takes it away (a subscriber
    counting the re-announcement as a copy would keep a phantom)."""
    s = LiveState()
    _apply(s, (BlockEvent.STORED, _stored([7, 8], None)), (BlockEvent.STORED, _stored([7, 8, 9], None)))
    chunks = list(build(s.cut(2)).chunks())
    assert _replayed(chunks) == {block_hash(_key(k)): 1 for k in (7, 8, 9)}
    assert chunks[0].snapshot.blocks == 3
    _apply(s, (BlockEvent.REMOVED, {"block_hashes": [_key(7), _key(8)]}))
    assert _replayed(list(build(s.cut(3)).chunks())) == {block_hash(_key(9)): 1}


def test_chunks_are_bounded_and_numbered_up_to_the_cut():
    s = LiveState()
    n = 2 * CHUNK_BLOCKS + 10
    _apply(s, (BlockEvent.STORED, _stored(list(range(1, n + 1)), None)))
    chunks = list(build(s.cut(1000)).chunks())
    assert len(chunks) == 3
    assert [c.sequence_number for c in chunks] == [998, 999, 1000]
    assert [(c.snapshot.index, c.snapshot.count, c.snapshot.blocks) for c in chunks] == [
        (i, 3, n) for i in range(3)]
    assert all(sum(len(e.stored.blocks) for e in c.events) <= CHUNK_BLOCKS for c in chunks)
    assert [e.WhichOneof("data") for e in chunks[0].events][0] == "cleared"
    assert not any(e.WhichOneof("data") == "cleared" for c in chunks[1:] for e in c.events)
    # the run split across chunks keeps chaining: the next chunk names the previous block as parent
    assert chunks[1].events[0].stored.parent_block_hash == chunks[0].events[-1].stored.blocks[-1].block_hash
    assert len(_replayed(chunks)) == n
    # fewer numbers behind the cut than default chunks: larger chunks, never a number below 1
    small = list(build(s.cut(2)).chunks())
    assert [c.sequence_number for c in small] == [1, 2] and len(_replayed(small)) == n


def test_an_empty_record_is_one_chunk_with_the_clear():
    chunks = list(build(LiveState().cut(9)).chunks())
    assert len(chunks) == 1 and chunks[0].sequence_number == 9
    assert [e.WhichOneof("data") for e in chunks[0].events] == ["cleared"]
    assert (chunks[0].snapshot.count, chunks[0].snapshot.blocks) == (1, 0)


def test_the_record_matches_a_replay_of_a_random_stream():
    """Random stores (chains, repeats), removals and clears: the snapshot applied by a subscriber
    holds each block once and equals an index applying the same events, and parents come first."""
    rng = random.Random(7)
    s = LiveState()
    mirror: dict[int, int] = {}
    parents: dict[int, int | None] = {}
    for _ in range(3000):
        r = rng.random()
        if r < 0.6:
            start = rng.randrange(1, 400)
            keys = list(range(start, start + rng.randrange(1, 6)))
            parent = start - 1 if start > 1 and rng.random() < 0.7 else None
            _apply(s, (BlockEvent.STORED, _stored(keys, parent)))
            for k in keys:
                h = block_hash(_key(k))
                if h not in mirror:
                    parents[h] = block_hash(_key(parent)) if parent is not None else None
                mirror[h] = 1  # the engine's index: one block per key
                parent = k
        elif r < 0.98:
            keys = rng.sample(range(1, 400), rng.randrange(1, 5))
            _apply(s, (BlockEvent.REMOVED, {"block_hashes": [_key(k) for k in keys]}))
            for k in keys:
                h = block_hash(_key(k))
                mirror.pop(h, None)
        else:
            _apply(s, (BlockEvent.CLEARED, {}))
            mirror.clear()
    chunks = list(build(s.cut(3000)).chunks())
    assert _replayed(chunks) == mirror
    assert chunks[0].snapshot.blocks == len(mirror)
    got = _blocks(chunks)
    first = {}
    for i, (h, _, _, _) in enumerate(got):
        first.setdefault(h, i)
    for h, i in first.items():
        p = parents.get(h)
        if p is not None and p in mirror and p != h:
            assert first[p] < i


def test_a_partial_record_says_so_until_a_clear():
    """Block events of the model the hub dropped before the relay's first subscription are
    ``unknown_before``; a clear makes the record whole again."""
    async def main():
        hub = KvEventHub(replay=4)
        for i in range(10):  # 6 of them leave the hub's buffer before anybody relays
            hub.publish_block("stored", "m", _stored([i + 1], i if i else None))
        hub.publish("created", "m", "c", 4)  # not a block event: not counted
        relay = BlockEventRelay(hub, "m", replay=2)
        relay.start()
        await asyncio.sleep(0.05)
        assert relay.state.unknown_before == 7  # 11 events, the hub keeps 4: 7 block events went
        snap, _ = await relay.snapshot()
        first = next(snap.chunks())
        assert first.snapshot.unknown_before == 7
        hub.publish_block("cleared", "m", {})
        await asyncio.sleep(0.05)
        snap, _ = await relay.snapshot()
        assert next(snap.chunks()).snapshot.unknown_before == 0
        await relay.close()

    asyncio.run(main())


def test_a_flood_of_late_subscribers_shares_one_snapshot():
    async def main():
        hub = KvEventHub()
        relay = BlockEventRelay(hub, "m", replay=2)
        relay.start()
        for i in range(50):
            hub.publish_block("stored", "m", _stored([i + 1], i if i else None))
        await asyncio.sleep(0.05)

        async def late():
            agen = relay.batches(relay.cursor(1))
            b = await agen.__anext__()
            await agen.aclose()
            return b

        got = await asyncio.gather(*(late() for _ in range(200)))
        assert all(b.sequence_number == 50 and b.snapshot.blocks == 50 for b in got)
        assert relay.snapshots == 1
        await relay.close()

    asyncio.run(main())


def test_a_snapshot_of_20k_blocks_does_not_stall_the_loop():
    """20,000 live blocks (block size 16): the cut on the loop is a copy of two dicts; ordering
    runs in a thread; each chunk (512 blocks) is encoded as it is sent. The longest the loop goes
    without running another task stays small (the GIL's switch interval plus one chunk)."""
    n, bs = 20_000, 16

    async def main():
        hub = KvEventHub(replay_bytes=1 << 20)
        relay = BlockEventRelay(hub, "m", replay=4)
        relay.start()
        for c in range(n // 100):  # chains of 100 blocks
            keys = [(c * 100 + i + 1).to_bytes(8, "little") * 4 for i in range(100)]
            hub.publish_block("stored", "m", {"block_hashes": keys, "parent_block_hash": b"r" * 32,
                                              "token_ids": list(range(100 * bs)), "block_size": bs})
            if c % 20 == 19:
                await asyncio.sleep(0)
        await asyncio.sleep(0.1)
        assert len(relay.state.blocks) == n

        stall, stop = [0.0], asyncio.Event()

        async def ticker():
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0)
                now = time.perf_counter()
                stall[0] = max(stall[0], now - last)
                last = now

        t = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        cut_t0 = time.perf_counter()
        relay.state.cut(relay.seq)
        cut_s = time.perf_counter() - cut_t0
        agen = relay.batches(relay.cursor(0))
        chunks = []
        async for b in agen:
            chunks.append(b)
            await asyncio.sleep(0)  # the stream's write
            if b.snapshot.index == b.snapshot.count - 1:
                break
        total = time.perf_counter() - t0
        stop.set()
        await t
        await agen.aclose()
        await relay.close()
        return chunks, total, stall[0], cut_s

    chunks, total, stall, cut_s = asyncio.run(main())
    assert len(chunks) == -(-n // CHUNK_BLOCKS) and chunks[0].snapshot.blocks == n
    assert len(_replayed(chunks)) == n
    print(f"\nsnapshot of {n} blocks: {total * 1e3:.0f} ms in all, {len(chunks)} chunks, cut {cut_s * 1e3:.2f} ms, "
          f"longest loop stall {stall * 1e3:.1f} ms")
    assert cut_s < 0.05 and stall < 0.1, (cut_s, stall)


def test_the_record_is_dropped_past_its_bound(monkeypatch):
    monkeypatch.setattr(snapmod, "MAX_LIVE_BLOCKS", 10)
    s = LiveState()
    _apply(s, (BlockEvent.STORED, _stored(list(range(1, 12)), None)))
    assert not s.consistent and not s.blocks
    _apply(s, (BlockEvent.STORED, _stored([1], None)))
    assert not s.blocks  # nothing recorded until a clear
    _apply(s, (BlockEvent.CLEARED, {}), (BlockEvent.STORED, _stored([1], None)))
    assert s.consistent and len(s.blocks) == 1


def test_the_record_of_llama_cpp_block_events_is_its_index():
    """llama.cpp's real block events (shared prefixes, retired sequences evicted for new ones):
    the record, and a snapshot cut from it, equal the executor's prefix index."""
    import pytest

    pytest.importorskip("llama_cpp")
    from ferrum_service.core.types import PrefillInput
    from ferrum_service.executors.llama_cpp import LlamaCppExecutor

    from .support.packaged import smollm2_gguf_path
    from .support.prompts import SMOLLM2, prompt_ids

    ex = LlamaCppExecutor(smollm2_gguf_path(), model_id="smollm2", threads=2, n_ctx=512, n_seq=3)
    state, kinds = LiveState(), []

    def sink(kind, data):
        kinds.append(kind)
        state.apply(_ev(kind, {k: v for k, v in data.items() if k != "cache_id"}))
    ex.prefix.on_event = sink
    try:
        base = prompt_ids(48, 3, **SMOLLM2)
        for i in range(7):  # a shared 48-token prefix with different tails; 3 sequences: evictions
            tail = prompt_ids(16 + 8 * (i % 3), 40 + i, **SMOLLM2)
            out = ex.prefill(PrefillInput(base + tail))
            if i != 3:  # one held live while the others are retired and evicted
                ex.release_cache(out.cache.cache_id)
        index = {block_hash(k) for k in ex.prefix.index}
        assert BlockEvent.REMOVED in kinds, kinds
        assert index and set(state.blocks) == index
        chunks = list(build(state.cut(50)).chunks())
        assert set(_replayed(chunks)) == index
        got = _blocks(chunks)
        pos = {h: i for i, (h, *_r) in enumerate(got)}
        assert all(p is None or p not in pos or pos[p] < pos[h] for h, p, *_r in got)
    finally:
        for e in ex.registry.entries():
            ex.release_cache(e.cache_id)
        ex.shutdown()
