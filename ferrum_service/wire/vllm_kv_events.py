"""Prefix-cache block events in the vLLM engine protocol's common format (``KvEventBatch``), for
the ``SubscribeKvEvents`` of :mod:`.vllm_engine`.

**Numbering.** A gateway (SMG) takes a batch numbered more than one past the last it applied for
a gap and reconnects with ``start_sequence_number`` = the last one it applied. The server's event
hub numbers every cache event (one per decode step) and every block event of every model in one
sequence, so :class:`BlockEventRelay` re-numbers the block events of the served model 1, 2, ...
(one event per batch) and keeps the last ``replay`` of them to replay from, within the hub's
``replay_bytes`` (``--kv-event-replay-bytes``) too: without per-caller auth a stored event keeps its
token ids, so the relay's log is bounded like the hub's own. The relay starts with the first
subscription (a server nobody reads through this protocol keeps no copy). A cursor older than
that, or newer than the relay's last (the worker restarted) is OUT_OF_RANGE; a subscriber that
fell behind the log is DATA_LOSS. SMG answers both by forgetting the worker's blocks and
subscribing again from 0, which replays every retained event.

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

log = structlog.get_logger("ferrum_service.wire.vllm_kv_events")

_DATA_LOSS = grpc.StatusCode.DATA_LOSS
#: Start of a stored event's ``cache_salt``: the blocks' key space, not the salt itself.
NAMESPACE_PREFIX = "ferrum-ns:"


def block_hash(key: bytes) -> int:
    """A block key as the protocol's int64 ``block_hash``."""
    return int.from_bytes(bytes(key[:8]).ljust(8, b"\0"), "little", signed=True)


def batch_pb(seq: int, ev: KvEventRecord) -> cpb.KvEventBatch:
    """One block event as a ``KvEventBatch`` numbered ``seq``."""
    batch = cpb.KvEventBatch(sequence_number=seq, timestamp=ev.time_unix_ns / 1e9)
    d = ev.block or {}
    if ev.block_kind == BlockEvent.STORED:
        bs = int(d.get("block_size") or 0)
        keys = list(d.get("block_hashes") or [])
        tokens = list(d.get("token_ids") or [])
        if bs and keys and len(tokens) >= bs * len(keys):
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
    """The block events of one model, renumbered from 1, with a bounded replay log."""

    def __init__(self, hub: KvEventHub, model_id: str, replay: int = 65536) -> None:
        self.hub = hub
        self.model_id = model_id
        self.log: collections.deque[tuple[int, KvEventRecord]] = collections.deque(maxlen=replay)
        self.replay_bytes = hub.replay_bytes  # bound on the log's estimated bytes (0 = events only)
        self.held_bytes = 0  # the log's estimated bytes
        self.seq = 0  # the last number given
        self.epoch = 0  # bumped when the relay itself lost events (its subscribers must resync)
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
                        self._notify()
                    from_seq = gone
                    continue
                while True:
                    ev = await sub.next()
                    from_seq = ev.seq + 1
                    if ev.block_kind:
                        self.seq += 1
                        self._append(ev)
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

    def cursor(self, start: int) -> int:
        """The first number to send a subscriber whose last applied batch is ``start`` (0: none,
        every retained batch); OUT_OF_RANGE for a cursor the relay cannot continue."""
        oldest = self.log[0][0] if self.log else self.seq + 1
        if start > self.seq:
            raise errors.out_of_range(f"start_sequence_number {start} is past this worker's last KV event "
                                      f"{self.seq} (the worker restarted?); subscribe from 0",
                                      field="start_sequence_number")
        nxt = oldest if start == 0 else start + 1
        if nxt < oldest:
            raise errors.out_of_range(f"KV events after {start} are no longer retained (oldest is {oldest}); "
                                      "subscribe from 0", field="start_sequence_number")
        return nxt

    async def batches(self, nxt: int, tick: float | None = None) -> AsyncIterator[cpb.KvEventBatch | None]:
        """Batches from number ``nxt`` on (see :meth:`cursor`), then live ones, until cancelled;
        DATA_LOSS when the subscriber fell behind the log. With ``tick``, None after every
        ``tick`` seconds without a new event (the caller's moment to send its load record)."""
        epoch = self.epoch
        while True:
            while nxt <= self.seq:
                if self.epoch != epoch or nxt < self.log[0][0]:
                    raise errors.FerrumError(errors.ErrorKind.INTERNAL, "KV event subscriber fell behind the "
                                             "replay log; subscribe from 0", code=_DATA_LOSS)
                seq, ev = self.log[nxt - self.log[0][0]]
                yield batch_pb(seq, ev)
                nxt += 1
            if self.epoch != epoch:
                raise errors.FerrumError(errors.ErrorKind.INTERNAL, "KV events were lost; subscribe from 0",
                                         code=_DATA_LOSS)
            if tick is None:
                await self._wake.wait()
                continue
            try:
                await asyncio.wait_for(self._wake.wait(), tick)
            except asyncio.TimeoutError:
                yield None


__all__ = ["BlockEventRelay", "batch_pb", "block_hash"]
