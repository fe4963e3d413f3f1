"""The block-event relay's record of the engine's live blocks, and the state snapshot
(``KvEventBatch.snapshot``, ``KvSnapshotChunk``) it serves a ``SubscribeKvEvents`` subscriber that
its replay log no longer reaches.

**The record** (:class:`LiveState`) is a function of the relayed stream alone: a stored event adds
each of its blocks with what sending it again takes (its parent, tokens, block size, ``lora_name``
and ``cache_salt``), a removed event takes them away, a cleared event empties it. Our engines hold
one physical copy per block key (the prefix index maps a key to one block), so a key stored again
while live is the same block, not a second copy (llama.cpp re-announces keys another sequence
holds; its index drops such a key once, when the holder goes): the record is the engine's index,
where a subscriber counting re-announcements as copies would keep a phantom after the one removal.
A stored event the relay sends without blocks (token ids stripped under per-caller auth) adds
nothing. Memory: one entry per live block (about 250 bytes at block size 16), so the record is
bounded by the blocks the engine's prefix index holds, which its pool bounds; past
:data:`MAX_LIVE_BLOCKS` (a relay that missed removals) the record is dropped and marked
inconsistent. Nothing is kept per relayed event.

**Verifiable or not.** The record is *inconsistent* once the relay lost events mid-life (the hub
dropped some before the relay read them: a missed removal would leave a block the engine no longer
holds in every later snapshot) or overflowed; a cleared event makes it exact again (nothing before
a clear matters). ``unknown_before`` counts this model's block events the hub had dropped before
the relay's first subscription (the relay starts with the first subscriber): 0 when the record
covers the engine's whole life; a clear resets it to 0 too.

**A snapshot** is cut at the relay's current number S on the event loop (a dict copy:
sub-millisecond for tens of thousands of blocks; the record's entries are immutable, so the copy
is the state at S), ordered off the loop (a worker thread: parents before children, store order
otherwise, an ancestor stored again after its child hoisted ahead of it), and encoded one chunk at a
time as the subscriber's stream is written. Chunks hold at most :data:`CHUNK_BLOCKS` blocks
(chunk 0 also the clear: at most ``CHUNK_BLOCKS + 1`` events), merged into one Stored event per run
of blocks chaining one from the other under the same fields, as the engine stored them (each block
once: our engines hold one physical copy per key). The ``count`` chunks are numbered S - count + 1
.. S (never below 1: the chunks grow past :data:`CHUNK_BLOCKS` only when S is smaller than the
default count), so live events go on from S + 1 with no gap and no duplicate. Synthesized events
have ``event_id`` 0.
"""

from __future__ import annotations

import array
import time
from dataclasses import dataclass
from typing import Iterator

from smg_grpc_proto.generated import common_pb2 as cpb

from ..core.modes import BlockEvent
from ..hosting.kv_events import KvEventRecord

#: Blocks per snapshot chunk (chunk 0 adds the AllBlocksCleared), unless the chunks must be
#: fewer than that makes (fewer sequence numbers behind the cut than chunks).
CHUNK_BLOCKS = 512
#: Live blocks past which the record is dropped (it no longer mirrors a bounded index).
MAX_LIVE_BLOCKS = 1 << 20
#: Start of a stored event's ``cache_salt``: the blocks' key space, not the salt itself.
NAMESPACE_PREFIX = "ferrum-ns:"


def block_hash(key: bytes) -> int:
    """A block key as the protocol's int64 ``block_hash``."""
    return int.from_bytes(bytes(key[:8]).ljust(8, b"\0"), "little", signed=True)


def stored_fields(d: dict) -> tuple[int, list[bytes], object] | None:
    """(block_size, keys, token ids) of a stored event the relay sends with blocks, else None (a
    block without its tokens would look to SMG like every other one)."""
    bs = int(d.get("block_size") or 0)
    keys = list(d.get("block_hashes") or [])
    tokens = d.get("token_ids") or ()
    if bs and keys and len(tokens) >= bs * len(keys):
        return bs, keys, tokens
    return None


def stored_tail(d: dict) -> tuple[str, str]:
    """(lora_name, cache_salt) of a stored event, as it is sent."""
    return (d.get("adapter") or "", NAMESPACE_PREFIX + d["namespace"] if d.get("namespace") else "")


class LiveBlock:
    """One live block as the relay can send it again (immutable once recorded)."""

    __slots__ = ("hash", "parent", "tokens", "block_size", "tail")

    def __init__(self, hash_: int, parent: int | None, tokens: array.array, block_size: int,
                 tail: tuple[str, str]) -> None:
        self.hash = hash_
        self.parent = parent  # the block it chains from (None: the first of a chain, no parent sent)
        self.tokens = tokens
        self.block_size = block_size
        self.tail = tail


@dataclass
class Cut:
    """The record at relay number ``through``: a copy of its map (the entries are shared)."""

    through: int
    blocks: dict[int, LiveBlock]
    unknown_before: int
    time: float


class LiveState:
    """The engine's live blocks as the relayed stream describes them."""

    def __init__(self) -> None:
        self.blocks: dict[int, LiveBlock] = {}  # hash -> block, in store order (dicts keep it)
        self.unknown_before = 0
        self.consistent = True
        self.removed_unknown = 0  # removals of a hash the record did not hold

    def apply(self, ev: KvEventRecord) -> None:
        """Fold one relayed block event in."""
        kind, d = ev.block_kind, ev.block or {}
        if kind == BlockEvent.STORED:
            f = stored_fields(d)
            if f is None or not self.consistent:
                return
            bs, keys, tokens = f
            tail = stored_tail(d)
            parent = block_hash(d["parent_block_hash"]) if d.get("parent_block_hash") else None
            blocks = self.blocks
            for i, k in enumerate(keys):
                h = block_hash(k)
                if h not in blocks:  # else the same block announced again: the record keeps the first
                    toks = tokens[i * bs:(i + 1) * bs]
                    blocks[h] = LiveBlock(h, parent, toks if isinstance(toks, array.array)
                                          else array.array("i", toks), bs, tail)
                parent = h
            if len(blocks) > MAX_LIVE_BLOCKS:
                self.lose()
        elif kind == BlockEvent.REMOVED:
            if not self.consistent:
                return
            for k in d.get("block_hashes") or ():
                if self.blocks.pop(block_hash(k), None) is None:
                    self.removed_unknown += 1
        else:  # cleared: the record is the engine's exact state again, whatever went before
            self.blocks = {}
            self.unknown_before = 0
            self.consistent = True

    def lose(self) -> None:
        """The record can no longer be verified (events lost, or it overflowed): drop it until the
        next clear."""
        self.blocks = {}
        self.consistent = False

    def cut(self, through: int) -> Cut:
        """The record as it stands (at relay number ``through``): O(blocks) at C speed."""
        return Cut(through, self.blocks.copy(), self.unknown_before, time.time())


def order_blocks(blocks: dict[int, LiveBlock]) -> list[LiveBlock]:
    """The live blocks parents first: store order, with a live ancestor stored after its
    descendant (evicted and stored again) hoisted ahead of it. Safe on a cut from any thread."""
    out: list[LiveBlock] = []
    done: set[int] = set()
    for h, b in blocks.items():
        if h in done:
            continue
        done.add(h)
        path = []
        p = b.parent
        while p is not None and p not in done:
            up = blocks.get(p)
            if up is None:  # not live: SMG starts a chain there, as when the parent left first
                break
            done.add(p)
            path.append(up)
            p = up.parent
        out.extend(reversed(path))
        out.append(b)
    return out


class Snapshot:
    """A cut, ordered, as the ``count`` chunks a subscriber receives (encoded lazily)."""

    def __init__(self, cut: Cut, ordered: list[LiveBlock]) -> None:
        self.through = cut.through
        units = len(cut.blocks)
        self.blocks = units
        self.unknown_before = cut.unknown_before
        self.time = cut.time
        self.ordered = ordered
        per = CHUNK_BLOCKS
        if -(-units // per) > cut.through:  # fewer numbers behind the cut than default chunks
            per = -(-units // max(1, cut.through))
        self.per_chunk = per
        self.count = max(1, -(-units // per))

    def chunks(self) -> Iterator[cpb.KvEventBatch]:
        """The chunks in order, each built when asked for."""
        index, run = 0, []
        for b in self.ordered:
            run.append(b)
            if len(run) == self.per_chunk:
                yield self._chunk(index, run)
                index, run = index + 1, []
        if run or index == 0:
            yield self._chunk(index, run)

    def _chunk(self, index: int, units: list[LiveBlock]) -> cpb.KvEventBatch:
        batch = cpb.KvEventBatch(sequence_number=self.through - self.count + 1 + index, timestamp=self.time,
                                 snapshot=cpb.KvSnapshotChunk(index=index, count=self.count, blocks=self.blocks,
                                                              unknown_before=self.unknown_before))
        if index == 0:
            batch.events.add(event_id=0, cleared=cpb.KvCacheCleared())
        i = 0
        while i < len(units):
            first = units[i]
            end = i + 1
            while (end < len(units) and units[end].parent == units[end - 1].hash  # a run chaining on
                   and units[end].tail == first.tail and units[end].block_size == first.block_size):
                end += 1
            stored = cpb.KvBlocksStored(
                blocks=[cpb.KvBlock(block_hash=u.hash, token_ids=u.tokens, block_size=u.block_size)
                        for u in units[i:end]],
                tier=cpb.KV_CACHE_TIER_DEVICE, locality=cpb.KV_CACHE_LOCALITY_LOCAL)
            if first.parent is not None:
                stored.parent_block_hash = first.parent
            if first.tail[0]:
                stored.lora_name = first.tail[0]
            if first.tail[1]:
                stored.cache_salt = first.tail[1]
            batch.events.add(event_id=0, stored=stored)
            i = end
        return batch


def build(cut: Cut) -> Snapshot:
    """Order a cut (run it off the event loop: O(blocks) in Python)."""
    return Snapshot(cut, order_blocks(cut.blocks))


__all__ = ["CHUNK_BLOCKS", "Cut", "LiveState", "MAX_LIVE_BLOCKS", "Snapshot", "block_hash", "build",
           "order_blocks"]
