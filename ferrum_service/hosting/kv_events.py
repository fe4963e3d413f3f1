"""KV cache events: a server-wide sequence, a bounded replay buffer, and subscribers.

Registries call :meth:`KvEventHub.publish` (from the event loop or a model's worker thread) after
each change. Events carry the cache's absolute length, so a mirror that applies an event twice,
or applies events on top of a snapshot that already contains them, stays correct.

Prefix-cache block events (``stored`` / ``removed`` / ``cleared``, see
``executors/transformers/prefix_cache.py``) share the sequence and the replay buffer; only subscribers that
asked for them (``include_block_events``) receive them.

Subscribers get a bounded queue each: compute never waits for them. A subscriber whose queue
overflows is dropped and told where to resume; one that asks for a sequence number older than
the replay buffer is told to resync from a snapshot. The replay buffer is bounded by events and by
bytes (``replay_bytes``, an estimate); the number of subscribers is capped, in all and per caller
(RESOURCE_EXHAUSTED past either).

**Who sees what.** When callers are told apart (``per_caller``: bearer tokens or mutual TLS), every
event has an :class:`Owner`: the caller whose cache it concerns. A cache event belongs to the
cache's tenant; a ``stored`` block event to the tenant of the cache whose step put the blocks in the
index, and its ``removed`` event to the same tenant (the hub remembers the owner of every indexed
key); ``cleared`` concerns everybody. A subscriber gets only its own events (the rule of
``ListCaches``), and block events carry no token ids. A new cache's first events are published on
the model's worker before the request path records its tenant (``RequestChecks.adopt`` →
:meth:`KvEventHub.adopt`): their owner is pending until then, and a subscriber holds such an event
until it is known (at most :data:`PENDING_OWNER_S`; a cache nobody adopts is nobody's). Without
per-caller auth every subscriber sees every event, token ids included (kept as 4-byte ints in the
replay copy, not the cache's own int objects).
"""

from __future__ import annotations

import array
import asyncio
import collections
import threading
import time
from dataclasses import dataclass

from ..core import errors
from ..core.modes import BlockEvent, CacheEvent
from ..core.settings import default

#: A cache event's number in the contract's ``KvEventKind``.
KINDS = {CacheEvent.CREATED: 1, CacheEvent.EXTENDED: 2, CacheEvent.TRUNCATED: 3, CacheEvent.RELEASED: 4,
         CacheEvent.RECLAIMED: 5, CacheEvent.EVICTED: 6, CacheEvent.FORKED: 7}


#: Cache events that end a cache.
TERMINAL = frozenset(e for e in CacheEvent if e.ends_cache)

#: Longest a subscriber holds an event whose owner is not known yet (seconds).
PENDING_OWNER_S = 2.0


class Owner:
    """The caller an event belongs to: ``tenant`` (a caller identity, ``callers.py``); None while
    the cache's tenant is not recorded yet; "" for nobody (a cache no request adopted)."""

    __slots__ = ("tenant",)

    def __init__(self, tenant: str | None) -> None:
        self.tenant = tenant


@dataclass(frozen=True)
class KvEventRecord:
    seq: int
    kind: int
    model_id: str
    cache_id: str
    num_tokens: int
    time_unix_ns: int
    block_kind: BlockEvent | str = ""  # for a block event ("" = a cache event)
    block: dict | None = None  # the block event's fields (KvBlockStored / KvBlockRemoved)
    owner: Owner | None = None  # whose event it is (None: everybody's)

    def nbytes(self) -> int:
        """About how many bytes this event keeps alive in the replay buffer."""
        n = 240 + len(self.cache_id) + len(self.model_id)
        if self.block:
            n += 4 * len(self.block.get("token_ids") or ()) + 80 * len(self.block.get("block_hashes") or ())
        return n


class SubscriberDropped(Exception):
    """The subscriber's buffer overflowed; resume from ``resume_from_seq``."""

    def __init__(self, resume_from_seq: int, limit: int) -> None:
        super().__init__(f"subscriber fell behind: more than {limit} events buffered; resume from seq "
                         f"{resume_from_seq}")
        self.resume_from_seq = resume_from_seq


class Subscription:
    """One subscriber's bounded queue of events."""

    def __init__(self, hub: "KvEventHub", model_id: str, limit: int, blocks: bool = False, caller: str = "",
                 key: str = "") -> None:
        self.hub = hub
        self.model_id = model_id
        self.blocks = blocks
        self.cache_events = True  # cache events too (the block-event relay takes block events only)
        self.capped = True  # counted against the subscriber caps (the server's own relay is not)
        self.caller = caller  # whose events it gets (when the hub tells callers apart)
        self.key = key  # what the per-caller subscriber cap counts it under
        self.limit = limit
        self.owner_known = asyncio.Event()  # set by the hub when a pending owner is recorded
        self.waiting_owner = False  # its next event's owner is pending (the hub wakes only those)
        self.queue: collections.deque[KvEventRecord] = collections.deque()
        self.wakeup = asyncio.Event()
        self.dropped_at: int | None = None
        self.loop = asyncio.get_running_loop()
        # Replayed events are read lazily from the hub's replay buffer (so a long backlog does not
        # count against the live buffer): seqs [replay_next, live_from) come from there.
        self.replay_next = 0
        self.live_from = 0

    def _offer(self, ev: KvEventRecord) -> None:  # on the subscriber's loop
        if self.dropped_at is not None or not self.wants(ev):
            return
        owner = ev.owner.tenant if self.hub.per_caller and ev.owner is not None else None
        if owner is not None and owner != self.caller:  # known to be another caller's: not even queued
            return
        if len(self.queue) >= self.limit:
            self.dropped_at = self.queue[0].seq if self.queue else ev.seq
        else:
            self.queue.append(ev)
        self.wakeup.set()

    def _replayed(self) -> KvEventRecord | None:
        if self.replay_next >= self.live_from:
            return None
        with self.hub._lock:
            buf = self.hub.replay
            oldest = buf[0].seq if buf else self.live_from
            if self.replay_next < oldest:  # overwritten while we were reading: we fell behind
                self.dropped_at = self.replay_next
                return None
            ev = buf[self.replay_next - oldest]
        self.replay_next += 1
        return ev

    async def next(self) -> KvEventRecord:
        """The next event this subscriber may see (replayed first, then live); raises SubscriberDropped."""
        while True:
            ev = await self._candidate()
            if await self._visible(ev):
                return ev

    async def _candidate(self) -> KvEventRecord:
        while True:
            while self.replay_next < self.live_from and self.dropped_at is None:
                ev = self._replayed()
                if ev is not None and self.wants(ev):
                    return ev
            if self.dropped_at is not None:
                raise SubscriberDropped(self.dropped_at, self.limit)
            if self.queue:
                return self.queue.popleft()
            self.wakeup.clear()
            await self.wakeup.wait()

    async def _visible(self, ev: KvEventRecord) -> bool:
        """Whether ``ev`` is this subscriber's to see; waits while its owner is pending."""
        if not self.hub.per_caller or ev.owner is None:
            return True
        deadline = self.loop.time() + PENDING_OWNER_S
        try:
            while ev.owner.tenant is None:
                self.owner_known.clear()
                self.waiting_owner = True
                left = deadline - self.loop.time()
                if left <= 0:
                    self.hub.settle(ev.owner)
                    break
                try:
                    await asyncio.wait_for(self.owner_known.wait(), left)
                except asyncio.TimeoutError:
                    pass
        finally:
            self.waiting_owner = False
        return ev.owner.tenant == self.caller

    def wants(self, ev: KvEventRecord) -> bool:
        """Whether the event is of the kind and model subscribed to (read on the publishing thread:
        fixed at subscription)."""
        return (not self.model_id or ev.model_id == self.model_id) and (
            self.blocks if ev.block_kind else self.cache_events)

    def close(self) -> None:
        with self.hub._lock:
            self.hub._subs.discard(self)


class KvEventHub:
    """Sequence numbers, the replay buffer and the live subscribers."""

    def __init__(self, replay: int = 65536, subscriber_buffer: int = 8192, *, per_caller: bool = False,
                 replay_bytes: int = default("kv_event_replay_bytes"),
                 max_subscribers: int = default("max_kv_event_subscribers"),
                 max_subscribers_per_caller: int = default("max_kv_event_subscribers_per_caller")) -> None:
        """``per_caller``: callers are told apart (bearer tokens or mutual TLS): each subscriber
        sees only its own events, and block events carry no token ids. ``replay_bytes``: bound on
        the replay buffer's estimated bytes (0 = events only); ``max_subscribers`` /
        ``max_subscribers_per_caller``: caps on live subscriptions (0 = none)."""
        self._lock = threading.Lock()
        self._seq = 0
        self.replay: collections.deque[KvEventRecord] = collections.deque(maxlen=replay)
        self.replay_bytes = replay_bytes
        self._replay_held = 0  # estimated bytes in the replay buffer
        self._evicted_blocks: dict[str, int] = {}  # model -> its block events dropped from the buffer
        self.subscriber_buffer = subscriber_buffer
        self.per_caller = per_caller
        self.max_subscribers = max_subscribers
        self.max_subscribers_per_caller = max_subscribers_per_caller
        self._subs: set[Subscription] = set()
        # per_caller only: the owner of each live cache, and of each key in a prefix index
        self._owners: dict[tuple[str, str], Owner] = {}
        self._key_owner: dict[tuple[str, bytes], Owner] = {}

    @property
    def seq(self) -> int:
        """The last sequence number assigned."""
        return self._seq

    def publish(self, kind: CacheEvent, model_id: str, cache_id: str, num_tokens: int, tenant: str = "") -> None:
        """A cache event (``kind``: a key of :data:`KINDS`; ``tenant``: the cache's, "" if not
        recorded yet)."""
        with self._lock:
            owner = None
            if self.per_caller:
                owner = self._owner(model_id, cache_id, tenant)
                if kind in TERMINAL:
                    self._owners.pop((model_id, cache_id), None)
                    if owner.tenant is None:  # never adopted (an orphaned step's cache): nobody's
                        owner.tenant = ""
            self._append(KvEventRecord(self._seq + 1, KINDS[kind], model_id, cache_id, num_tokens, time.time_ns(),
                                       owner=owner))

    def publish_block(self, kind: BlockEvent, model_id: str, data: dict) -> None:
        """A prefix-cache block event (``kind``: stored | removed | cleared). ``data["cache_id"]``
        (stored): the cache whose step stored the blocks (not sent to subscribers)."""
        data = dict(data)
        storer = data.pop("cache_id", "")
        with self._lock:
            if not self.per_caller:
                if data.get("token_ids"):
                    data["token_ids"] = array.array("i", data["token_ids"])
                self._append(KvEventRecord(self._seq + 1, 0, model_id, "", 0, time.time_ns(), kind, data))
                return
            if "token_ids" in data:
                data["token_ids"] = ()
            if kind == BlockEvent.STORED:
                owner = self._owners.get((model_id, storer)) or Owner("")
                for k in data.get("block_hashes") or ():
                    self._key_owner[(model_id, k)] = owner
                self._append(KvEventRecord(self._seq + 1, 0, model_id, "", 0, time.time_ns(), kind, data, owner))
            elif kind == BlockEvent.REMOVED:
                groups: dict[int, tuple[Owner, list[bytes]]] = {}
                for k in data.get("block_hashes") or ():
                    o = self._key_owner.pop((model_id, k), None) or Owner("")
                    groups.setdefault(id(o), (o, []))[1].append(k)
                for o, keys in groups.values():  # one event per owner: nobody sees another's keys
                    self._append(KvEventRecord(self._seq + 1, 0, model_id, "", 0, time.time_ns(), kind,
                                               {"block_hashes": keys}, o))
            else:  # cleared: the whole index of the model went
                for k in [k for k in self._key_owner if k[0] == model_id]:
                    del self._key_owner[k]
                self._append(KvEventRecord(self._seq + 1, 0, model_id, "", 0, time.time_ns(), kind, data))

    def adopt(self, model_id: str, cache_id: str, tenant: str) -> None:
        """The request path recorded ``cache_id``'s tenant: its pending events get their owner."""
        if not self.per_caller:
            return
        with self._lock:
            owner = self._owners.get((model_id, cache_id))
            if owner is None or owner.tenant is not None:
                return
            owner.tenant = tenant
            subs = [s for s in self._subs if s.waiting_owner]
        for sub in subs:
            try:
                sub.loop.call_soon_threadsafe(sub.owner_known.set)
            except RuntimeError:  # the subscriber's loop is closed
                pass

    def settle(self, owner: Owner) -> None:
        """An owner still pending after :data:`PENDING_OWNER_S`: nobody's."""
        with self._lock:
            if owner.tenant is None:
                owner.tenant = ""

    def _owner(self, model_id: str, cache_id: str, tenant: str) -> Owner:  # under the lock
        owner = self._owners.get((model_id, cache_id))
        if owner is None:
            owner = self._owners[(model_id, cache_id)] = Owner(tenant or None)
        elif owner.tenant is None and tenant:
            owner.tenant = tenant
        return owner

    def _append(self, ev: KvEventRecord) -> None:  # under the lock
        self._seq = ev.seq
        buf = self.replay
        size = ev.nbytes()
        while buf and ((buf.maxlen is not None and len(buf) >= buf.maxlen)
                       or (self.replay_bytes and self._replay_held + size > self.replay_bytes)):
            old = buf.popleft()
            self._replay_held = max(0, self._replay_held - old.nbytes())
            if old.block_kind:
                self._evicted_blocks[old.model_id] = self._evicted_blocks.get(old.model_id, 0) + 1
        buf.append(ev)
        self._replay_held += size
        for sub in list(self._subs):
            if not sub.wants(ev):  # filtered here: no wake-up of its loop per decode step for nothing
                continue
            try:
                sub.loop.call_soon_threadsafe(sub._offer, ev)
            except RuntimeError:  # the subscriber's loop is closed
                self._subs.discard(sub)

    def evicted_block_events(self, model_id: str) -> int:
        """How many of ``model_id``'s block events have left the replay buffer."""
        with self._lock:
            return self._evicted_blocks.get(model_id, 0)

    @property
    def replay_held_bytes(self) -> int:
        """The replay buffer's estimated bytes."""
        return self._replay_held

    def seat(self, caller: str, key: str) -> "Subscription":
        """A place among the capped subscriptions for one fed elsewhere (the vLLM protocol's, from
        its relay): counted in both caps like :meth:`subscribe`'s (RESOURCE_EXHAUSTED past one),
        it receives no event; ``close()`` gives it back."""
        return self.subscribe("", None, blocks=False, caller=caller, key=key, cache_events=False)[0]

    def subscribe(self, model_id: str, from_seq: int | None, blocks: bool = False, caller: str = "",
                  key: str | None = None, capped: bool = True, cache_events: bool = True
                  ) -> tuple[Subscription, int | None, int]:
        """A new subscription (``blocks``: with block events; ``caller``: whose events it gets when
        the hub tells callers apart; ``key``: what the per-caller cap counts, default ``caller``;
        ``capped=False``: the server's own, e.g. the vLLM-protocol relay, outside the caps;
        ``cache_events=False``: block events only).
        Returns (subscription, oldest available seq if ``from_seq`` is gone else None, next seq).
        Replayed events are queued before live ones, in order. RESOURCE_EXHAUSTED past a
        subscriber cap."""
        key = caller if key is None else key
        sub = Subscription(self, model_id, self.subscriber_buffer, blocks, caller, key)
        sub.capped = capped
        sub.cache_events = cache_events
        with self._lock:
            callers = [s for s in self._subs if s.capped]
            if capped and self.max_subscribers and len(callers) >= self.max_subscribers:
                raise errors.exhausted(
                    f"{len(callers)} KV-event subscriptions are open; this server's limit is "
                    f"{self.max_subscribers}", retry_after_ms=1000, limit=self.max_subscribers)
            mine = sum(1 for s in callers if s.key == key) if capped else 0
            if self.max_subscribers_per_caller and mine >= self.max_subscribers_per_caller:
                raise errors.exhausted(
                    f"this caller has {mine} KV-event subscriptions open; the limit per caller is "
                    f"{self.max_subscribers_per_caller}", retry_after_ms=1000,
                    limit=self.max_subscribers_per_caller)
            gone = None
            sub.live_from = sub.replay_next = self._seq + 1
            if from_seq is not None:
                oldest = self.replay[0].seq if self.replay else self._seq + 1
                if from_seq < oldest and from_seq <= self._seq:
                    gone = oldest
                else:
                    sub.replay_next = min(from_seq, sub.live_from)
            self._subs.add(sub)
            return sub, gone, self._seq + 1
