"""State snapshots on a real server (vLLM protocol ``SubscribeKvEvents`` on a real port, a tiny
random-weight model with its prefix cache on, ``--kv-event-replay-bytes`` shrunk so the relay's
log holds a few events): a late subscriber gets the live blocks (checked against the executor's
prefix index and against a subscriber that read every event), numbered up to the relay's last
number, then live events with no gap and no duplicate; removals during and after the snapshot; 0
while the log reaches 1 replays as before; a cursor from the future; a flood of late subscribers
under the subscriber caps."""

from __future__ import annotations

import threading

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from ferrum_client import Client

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.servers import InProcessServer
from .support.waits import wait_until

pytest.importorskip("transformers")

C = grpc.StatusCode
REPLAY_BYTES = 4096  # a stored event of 6 blocks is about 1.1 KB: the log holds a few events


def _executor(path):
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    # 1,024 tokens = 64 blocks of 16: the prompts below overflow it, so blocks are evicted
    return HfCausalLmExecutor.from_path(path, model_id="tiny", device="cpu", kv_budget_tokens=1024,
                                        prefix_cache=True)


def _prompt(i: int, n: int = 100) -> list[int]:
    return [(i * 37 + j * 7) % 400 + 1 for j in range(n)]


def _run_prompts(c: Client, ids) -> None:
    for i in ids:
        c.release_cache("tiny", c.prefill("tiny", _prompt(i)).output.cache.cache_id)


def _sub(eng, start: int):
    return eng.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(start_sequence_number=start), timeout=120)


def _next(stream) -> cpb.KvEventBatch:
    """The next event batch (load-only records skipped)."""
    while True:
        b = next(stream)
        if not b.load.load_only:
            return b


class Held:
    """What a subscriber holds after applying batches: hash -> (tokens, lora, salt), copies."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[tuple[int, ...], str, str]] = {}
        self.copies: dict[int, int] = {}
        self.last = 0

    def apply(self, b: cpb.KvEventBatch) -> None:
        for e in b.events:
            kind = e.WhichOneof("data")
            if kind == "cleared":
                self.blocks.clear()
                self.copies.clear()
            elif kind == "stored":
                for blk in e.stored.blocks:
                    self.blocks.setdefault(blk.block_hash, (tuple(blk.token_ids), e.stored.lora_name,
                                                            e.stored.cache_salt))
                    self.copies[blk.block_hash] = min(8, self.copies.get(blk.block_hash, 0) + 1)
            elif kind == "removed":
                for h in e.removed.block_hashes:
                    if h in self.copies:
                        self.copies[h] -= 1
                        if not self.copies[h]:
                            del self.copies[h], self.blocks[h]
        self.last = b.sequence_number


def _index(srv, ex) -> set[int]:
    """The executor's prefix index as protocol hashes, read on the server's loop (the worker is idle)."""
    from ferrum_service.wire.vllm_kv_events import block_hash

    async def read():
        return {block_hash(k) for k in ex.prefix.index}
    return srv.run(read())


def _settled(srv, ex) -> int:
    """The relay's last number once the hub has nothing more for it."""
    relay = srv.server.vllm.relay

    async def read():
        return relay.seq, len(ex.prefix.index)

    last = [None]

    def stable() -> bool:
        now = srv.run(read())
        ok = now == last[0]
        last[0] = now
        return ok
    assert wait_until(stable, timeout=10, interval=0.1)
    return last[0][0]


def _read_snapshot(stream, held: Held) -> list[cpb.KvEventBatch]:
    chunks = [_next(stream)]
    assert chunks[0].HasField("snapshot")
    held.apply(chunks[0])
    while chunks[-1].snapshot.index + 1 < chunks[-1].snapshot.count:
        chunks.append(_next(stream))
        held.apply(chunks[-1])
    return chunks


def _check_chunks(chunks: list[cpb.KvEventBatch], through: int) -> None:
    count = chunks[0].snapshot.count
    assert [c.snapshot.index for c in chunks] == list(range(count))
    assert all(c.snapshot.count == count and c.snapshot.blocks == chunks[0].snapshot.blocks for c in chunks)
    assert [c.sequence_number for c in chunks] == list(range(through - count + 1, through + 1))
    assert chunks[0].events[0].WhichOneof("data") == "cleared"
    assert all(e.event_id == 0 for c in chunks for e in c.events)
    seen: set[int] = set()
    for c in chunks:  # parents before children: a parent the snapshot lists comes first
        for e in c.events:
            if e.WhichOneof("data") != "stored":
                continue
            parent = e.stored.parent_block_hash if e.stored.HasField("parent_block_hash") else None
            listed = {b.block_hash for cc in chunks for ee in cc.events if ee.WhichOneof("data") == "stored"
                      for b in ee.stored.blocks}
            for b in e.stored.blocks:
                assert parent is None or parent not in listed or parent in seen, (parent, b.block_hash)
                seen.add(b.block_hash)
                parent = b.block_hash


def test_a_late_subscriber_gets_the_live_blocks_then_live_events(tiny_llama_dir, monkeypatch):  # noqa: F811
    from ferrum_service.wire import vllm_kv_snapshot

    monkeypatch.setattr(vllm_kv_snapshot, "CHUNK_BLOCKS", 8)  # several chunks of a small pool
    ex = _executor(tiny_llama_dir)
    with InProcessServer([ex], kv_event_replay_bytes=REPLAY_BYTES) as srv, \
            Client(srv.target) as c, grpc.insecure_channel(srv.target) as ch:
        eng = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        relay = srv.server.vllm.relay
        _run_prompts(c, [0])
        # from 0 while the log begins at 1: the log replayed, as before (and the relay starts)
        full_stream = _sub(eng, 0)
        first = _next(full_stream)
        assert first.sequence_number == 1 and not first.HasField("snapshot") and first.events[0].stored.blocks
        # a subscriber that reads every event, in a thread: the reference
        full, full_batches = Held(), [first]
        full.apply(first)

        def read_all():
            try:
                for b in full_stream:
                    if not b.load.load_only:
                        full_batches.append(b)
                        full.apply(b)
            except grpc.RpcError:
                pass
        reader = threading.Thread(target=read_all, daemon=True)
        reader.start()

        _run_prompts(c, range(1, 25))
        through = _settled(srv, ex)
        assert srv.run(_oldest(relay)) > 2, "the log still reaches back: shrink it"
        assert wait_until(lambda: full.last == through)
        live = _index(srv, ex)
        assert 0 < len(live) <= 64
        assert any(e.WhichOneof("data") == "removed" for b in full_batches for e in b.events), "no evictions"

        # a cursor older than the log: the snapshot, then live events
        late, held = _sub(eng, 1), Held()
        chunks = _read_snapshot(late, held)
        _check_chunks(chunks, through)
        assert chunks[0].snapshot.count > 1 and chunks[0].snapshot.unknown_before == 0
        assert chunks[0].snapshot.blocks == len(live) == sum(held.copies.values())
        assert set(held.blocks) == live
        assert held.blocks == {h: full.blocks[h] for h in live}, "the fields the original stores carried"
        # new prompts store and evict: live events from through + 1, no gap, no duplicate
        _run_prompts(c, range(100, 104))
        after = _settled(srv, ex)
        seqs = []
        while held.last < after:
            b = _next(late)
            assert not b.HasField("snapshot")
            seqs.append(b.sequence_number)
            held.apply(b)
        assert seqs == list(range(through + 1, after + 1))
        assert wait_until(lambda: full.last == after)
        assert set(held.blocks) == _index(srv, ex) == set(full.blocks)
        late.cancel()

        # 0 once the log no longer begins at 1: the snapshot too
        zero, held0 = _sub(eng, 0), Held()
        _check_chunks(_read_snapshot(zero, held0), after)
        assert set(held0.blocks) == _index(srv, ex)
        zero.cancel()

        # a removal during the snapshot: read chunk 0, then evict, then the rest and live events
        during, held2 = _sub(eng, 2), Held()
        c0 = _next(during)
        assert c0.snapshot.index == 0 and c0.snapshot.count > 1
        held2.apply(c0)
        _run_prompts(c, range(200, 204))
        end = _settled(srv, ex)
        while held2.last < end:
            b = _next(during)
            assert b.sequence_number == held2.last + 1 or b.snapshot.index == 0, (held2.last, b.sequence_number)
            held2.apply(b)
        assert set(held2.blocks) == _index(srv, ex)
        during.cancel()
        full_stream.cancel()
        reader.join(10)


async def _oldest(relay) -> int:
    return relay.oldest


def test_hostile_cursors_and_a_flood_of_late_subscribers(tiny_llama_dir):  # noqa: F811
    ex = _executor(tiny_llama_dir)
    with InProcessServer([ex], kv_event_replay_bytes=REPLAY_BYTES, max_kv_event_subscribers_per_caller=4) as srv, \
            Client(srv.target) as c, grpc.insecure_channel(srv.target) as ch:
        eng = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        relay = srv.server.vllm.relay
        _run_prompts(c, [0])
        s0 = _sub(eng, 0)
        _next(s0)
        s0.cancel()
        _run_prompts(c, range(1, 12))
        through = _settled(srv, ex)
        # a cursor from the future (another life of the worker): OUT_OF_RANGE, never a snapshot
        with pytest.raises(grpc.RpcError) as e:
            _next(_sub(eng, through + 1000))
        assert e.value.code() == C.OUT_OF_RANGE
        # a flood of late subscribers: the per-caller cap holds; those admitted share one snapshot
        before = srv.run(_snapshots(relay))
        subs, firsts, refused = [], [], 0
        for _ in range(12):
            s = _sub(eng, 1)
            try:
                firsts.append(_next(s))
                subs.append(s)
            except grpc.RpcError as err:
                assert err.code() == C.RESOURCE_EXHAUSTED
                refused += 1
        assert len(subs) == 4 and refused == 8
        assert srv.run(_snapshots(relay)) - before == 1
        live = _index(srv, ex)
        for b in firsts:  # one chunk each (a small pool), the whole live set, cut at the last number
            assert b.HasField("snapshot") and b.snapshot.count == 1 and b.sequence_number == through
            held = Held()
            held.apply(b)
            assert set(held.blocks) == live
        for s in subs:
            s.cancel()
        # once they are gone, seats are free again
        assert wait_until(lambda: _try_late(eng), timeout=10)


async def _snapshots(relay) -> int:
    return relay.snapshots


def _try_late(eng) -> bool:
    s = _sub(eng, 1)
    try:
        return _next(s).HasField("snapshot")
    except grpc.RpcError:
        return False
    finally:
        s.cancel()
