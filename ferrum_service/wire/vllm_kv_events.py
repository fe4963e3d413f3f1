"""Prefix-cache block events in the vLLM engine protocol's common format (``KvEventBatch``), for
the ``SubscribeKvEvents`` of :mod:`.vllm_engine`.

**Numbering.** A gateway (SMG) takes a batch numbered more than one past the last it applied for
a gap and reconnects with ``start_sequence_number`` = the last one it applied. The server's event
hub numbers every cache event (one per decode step) and every block event of every model in one
sequence, so :class:`BlockEventRelay` re-numbers the block events of the served model 1, 2, ...
(one event per batch) and keeps the last ``replay`` of them to replay from, within the hub's
``replay_bytes`` (``--kv-event-replay-bytes``) too: without per-caller auth a stored event keeps its
token ids, so the relay's log is bounded like the hub's own. The relay starts with the first
subscription (a server nobody reads through this protocol keeps no copy).

**Snapshots.** Beside the log the relay keeps its record of the live blocks
(:mod:`.vllm_kv_snapshot`). A subscriber the log no longer serves (``start_sequence_number`` 0 once
the log no longer begins at 1, a cursor older than the log, or a subscriber that fell behind it while
streaming) gets a state snapshot in band: chunks marked ``KvEventBatch.snapshot``, numbered up to
the relay's number at the cut, chunk 0 beginning with AllBlocksCleared, then live events from the
next number. 0 while the log still begins at 1 replays the log, as before. Where the record cannot
be verified (the relay lost events mid-life, until the engine's next clear) a stale cursor or a
fallen-behind subscriber is DATA_LOSS and 0 replays what the log holds. A cursor newer than the
relay's last (the worker restarted) is OUT_OF_RANGE. SMG answers both errors by forgetting the
worker's blocks and subscribing again from 0.

**Block hashes.** The worker's ``block_hash`` is an identity only: SMG keys its index on its own
content hash of each block's ``token_ids`` (XXH3-64, seed 1337, chained per position, see
``kv_index`` in SMG) and uses the worker's hash to find blocks again on ``removed`` and to
chain a stored batch to its ``parent_block_hash``. Ours is the first 8 bytes (little-endian, as a
signed int64) of the block's key from the contract's prefix-cache recipe (``PrefixCacheRecipe``:
a chained hash over the block's tokens, the previous key, the model and the cache salt), so it
names the block and its whole prefix like vLLM's. The first block of a chain names the chain
root (model + salt) as its parent: not a block SMG knows, so SMG starts a new chain there, as
vLLM's first blocks do. Blocks are ``block_size`` tokens: 16 on llama.cpp, the paged pool's block
on transformers; SMG learns it from the first stored block. With bearer-token authentication on,
the server strips token ids from block events (a subscriber must not read other tenants' prompts):
such stored events carry no blocks here (an empty batch keeps the numbering), as a block without
its tokens would look to SMG like every other one.

**Block fields.** Stored and removed events carry ``tier`` DEVICE and ``locality`` LOCAL (the
server's own pool); a stored event carries ``lora_name`` (the adapter of an adapter's chain) and,
for blocks of a salted key space (a request's ``cache_salt``; an unauthenticated vLLM request's
private space), ``cache_salt`` = ``ferrum-ns:`` + the first 8 bytes of the space's chain root in hex:
SMG folds it into its own content hash, so it no longer counts blocks no other request can reuse
as prefix hits; the salt itself is never sent. ``extra_keys``, ``medium`` and ``group_idx`` are left
unset (one full-attention group; the namespace fields carry what extra keys would).
"""

from __future__ import annotations

import asyncio
import collections
from typing import AsyncIterator

import grpc
import structlog
from smg_grpc_proto.generated import common_pb2 as cpb

from ..core import errors
from ..core.modes import BlockEvent
from ..hosting.kv_events import KvEventHub, KvEventRecord, SubscriberDropped
from .vllm_kv_snapshot import NAMESPACE_PREFIX, LiveState, Snapshot, block_hash, build, stored_fields

log = structlog.get_logger("ferrum_service.wire.vllm_kv_events")

_DATA_LOSS = grpc.StatusCode.DATA_LOSS


def batch_pb(seq: int, ev: KvEventRecord) -> cpb.KvEventBatch:
    """One block event as a ``KvEventBatch`` numbered ``seq``."""
    batch = cpb.KvEventBatch(sequence_number=seq, timestamp=ev.time_unix_ns / 1e9)
    d = ev.block or {}
    if ev.block_kind == BlockEvent.STORED:
        f = stored_fields(d)
        if f is not None:
            bs, keys, tokens = f
            stored = cpb.KvBlocksStored(
                blocks=[cpb.KvBlock(block_hash=block_hash(k), token_ids=tokens[i * bs:(i + 1) * bs], block_size=bs)
                        for i, k in enumerate(keys)],
                tier=cpb.KV_CACHE_TIER_DEVICE, locality=cpb.KV_CACHE_LOCALITY_LOCAL)
            if d.get("parent_block_hash"):
                stored.parent_block_hash = block_hash(d["parent_block_hash"])
            if d.get("adapter"):
                stored.lora_name = d["adapter"]
            if d.get("namespace"):  # a salted key space: SMG folds it in, so no unsalted lookup matches
                stored.cache_salt = NAMESPACE_PREFIX + d["namespace"]
            batch.events.add(event_id=seq, stored=stored)
    elif ev.block_kind == BlockEvent.REMOVED:
        batch.events.add(event_id=seq, removed=cpb.KvBlocksRemoved(
            block_hashes=[block_hash(k) for k in d.get("block_hashes") or []], tier=cpb.KV_CACHE_TIER_DEVICE,
            locality=cpb.KV_CACHE_LOCALITY_LOCAL))
    else:
        batch.events.add(event_id=seq, cleared=cpb.KvCacheCleared())
    return batch


class BlockEventRelay:
    """The block events of one model, renumbered from 1, with a bounded replay log and the record
    of the live blocks a snapshot is cut from."""

    def __init__(self, hub: KvEventHub, model_id: str, replay: int = 65536) -> None:
        self.hub = hub
        self.model_id = model_id
        self.log: collections.deque[tuple[int, KvEventRecord]] = collections.deque(maxlen=replay)
        self.replay_bytes = hub.replay_bytes  # bound on the log's estimated bytes (0 = events only)
        self.held_bytes = 0  # the log's estimated bytes
        self.seq = 0  # the last number given
        self.epoch = 0  # bumped when the relay itself lost events (its subscribers must resync)
        self.state = LiveState()  # the live blocks as numbered so far (up to self.seq)
        self.snapshots = 0  # snapshots built (one serves every subscriber cut at the same number)
        self._snap: tuple[tuple[int, int], asyncio.Future] | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start relaying (from the oldest event the hub still holds); later calls do nothing."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._pump())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _pump(self) -> None:
        from_seq = 1
        while True:
            sub, gone, _ = self.hub.subscribe(self.model_id, from_seq, blocks=True, capped=False,
                                                cache_events=False)
            try:
                if gone is not None:  # the hub no longer holds what we have not relayed yet
                    if self.seq:
                        log.warning("kv block events lost before relaying; subscribers must resync",
                                    model_id=self.model_id, from_seq=from_seq, oldest=gone)
                        self.epoch += 1
                        self.state.lose()
                        self._snap = None
                        self._notify()
                    else:  # before the first: the record starts partial (until a clear)
                        self.state.unknown_before = self.hub.evicted_block_events(self.model_id)
                    from_seq = gone
                    continue
                while True:
                    ev = await sub.next()
                    from_seq = ev.seq + 1
                    if ev.block_kind:
                        self.seq += 1
                        self._append(ev)
                        self.state.apply(ev)
                        self._snap = None
                        self._notify()
            except SubscriberDropped as d:
                from_seq = d.resume_from_seq
            finally:
                sub.close()

    def _append(self, ev: KvEventRecord) -> None:
        log_, size = self.log, ev.nbytes()
        while log_ and ((log_.maxlen is not None and len(log_) >= log_.maxlen)
                        or (self.replay_bytes and self.held_bytes + size > self.replay_bytes)):
            self.held_bytes = max(0, self.held_bytes - log_.popleft()[1].nbytes())
        log_.append((self.seq, ev))
        self.held_bytes += size

    def _notify(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    @property
    def oldest(self) -> int:
        """The first number the log still holds (``seq + 1`` when it holds none)."""
        return self.log[0][0] if self.log else self.seq + 1

    def cursor(self, start: int) -> int:
        """The first number a subscriber whose last applied batch is ``start`` needs (0: none).
        Below :attr:`oldest`, :meth:`batches` serves a snapshot first. OUT_OF_RANGE past the last
        number; DATA_LOSS for a cursor older than the log while the record cannot be verified
        (then 0 replays what the log holds, as a relay without a record would)."""
        if start > self.seq:
            raise errors.out_of_range(f"start_sequence_number {start} is past this worker's last KV event "
                                      f"{self.seq} (the worker restarted?); subscribe from 0",
                                      field="start_sequence_number")
        if self.state.consistent:
            return start + 1
        if start == 0:
            return self.oldest
        if start + 1 < self.oldest:
            raise _data_loss(f"KV events after {start} are no longer retained and this worker's block "
                             "record cannot be verified (events were lost); subscribe from 0")
        return start + 1

    async def snapshot(self) -> tuple[Snapshot, int]:
        """A snapshot of the record at the current number and the epoch it was cut in: cut now
        (on the loop), ordered in a worker thread; subscribers asking at the same number share one."""
        key = (self.seq, self.epoch)
        if self._snap is None or self._snap[0] != key:
            cut = self.state.cut(self.seq)
            self.snapshots += 1
            self._snap = (key, asyncio.ensure_future(asyncio.to_thread(build, cut)))
        fut = self._snap[1]
        return await asyncio.shield(fut), key[1]

    async def batches(self, nxt: int, tick: float | None = None) -> AsyncIterator[cpb.KvEventBatch | None]:
        """Batches from number ``nxt`` on (see :meth:`cursor`), then live ones, until cancelled; a
        snapshot first where the log no longer holds ``nxt``, DATA_LOSS where the record cannot be
        verified. With ``tick``, None after every ``tick`` seconds without a new event (the
        caller's moment to send its load record)."""
        epoch = self.epoch
        while True:
            while nxt <= self.seq:
                if self.epoch != epoch:
                    raise _data_loss("KV events were lost; subscribe from 0")
                if nxt < self.oldest:
                    if not self.state.consistent:
                        raise _data_loss("KV event subscriber fell behind the replay log and this worker's "
                                         "block record cannot be verified; subscribe from 0")
                    snap, epoch = await self.snapshot()
                    log.debug("kv block-event snapshot", model_id=self.model_id, asked=nxt, through=snap.through,
                              chunks=snap.count, blocks=snap.blocks, unknown_before=snap.unknown_before)
                    for chunk in snap.chunks():
                        yield chunk
                    nxt = snap.through + 1
                    continue
                seq, ev = self.log[nxt - self.oldest]
                yield batch_pb(seq, ev)
                nxt += 1
            if self.epoch != epoch:
                raise _data_loss("KV events were lost; subscribe from 0")
            if tick is None:
                await self._wake.wait()
                continue
            try:
                await asyncio.wait_for(self._wake.wait(), tick)
            except asyncio.TimeoutError:
                yield None


def _data_loss(msg: str) -> errors.FerrumError:
    return errors.FerrumError(errors.ErrorKind.INTERNAL, msg, code=_DATA_LOSS)


__all__ = ["BlockEventRelay", "NAMESPACE_PREFIX", "batch_pb", "block_hash"]
