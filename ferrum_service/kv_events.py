"""KV cache events: a server-wide sequence, a bounded replay buffer, and subscribers.

Registries call :meth:`KvEventHub.publish` (from the event loop or a model's worker thread) after
each change. Events carry the cache's absolute length, so a mirror that applies an event twice,
or applies events on top of a snapshot that already contains them, stays correct.

Prefix-cache block events (``stored`` / ``removed`` / ``cleared``, see
``executors/prefix_cache.py``) share the sequence and the replay buffer; only subscribers that
asked for them (``include_block_events``) receive them.

Subscribers get a bounded queue each: compute never waits for them. A subscriber whose queue
overflows is dropped and told where to resume; one that asks for a sequence number older than
the replay buffer is told to resync from a snapshot.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass

KINDS = {"created": 1, "extended": 2, "truncated": 3, "released": 4, "reclaimed": 5, "evicted": 6, "forked": 7}


@dataclass(frozen=True)
class KvEventRecord:
    seq: int
    kind: int
    model_id: str
    cache_id: str
    num_tokens: int
    time_unix_ns: int
    block_kind: str = ""  # "stored" | "removed" | "cleared" for a block event ("" = a cache event)
    block: dict | None = None  # the block event's fields (KvBlockStored / KvBlockRemoved)


class SubscriberDropped(Exception):
    """The subscriber's buffer overflowed; resume from ``resume_from_seq``."""

    def __init__(self, resume_from_seq: int, limit: int) -> None:
        super().__init__(f"subscriber fell behind: more than {limit} events buffered; resume from seq "
                         f"{resume_from_seq}")
        self.resume_from_seq = resume_from_seq


class Subscription:
    """One subscriber's bounded queue of events."""

    def __init__(self, hub: "KvEventHub", model_id: str, limit: int, blocks: bool = False) -> None:
        self.hub = hub
        self.model_id = model_id
        self.blocks = blocks
        self.limit = limit
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
        """The next event (replayed first, then live); raises SubscriberDropped."""
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

    def wants(self, ev: KvEventRecord) -> bool:
        return (not self.model_id or ev.model_id == self.model_id) and (self.blocks or not ev.block_kind)

    def close(self) -> None:
        self.hub._subs.discard(self)


class KvEventHub:
    """Sequence numbers, the replay buffer and the live subscribers."""

    def __init__(self, replay: int = 65536, subscriber_buffer: int = 8192) -> None:
        self._lock = threading.Lock()
        self._seq = 0
        self.replay: collections.deque[KvEventRecord] = collections.deque(maxlen=replay)
        self.subscriber_buffer = subscriber_buffer
        self._subs: set[Subscription] = set()

    @property
    def seq(self) -> int:
        """The last sequence number assigned."""
        return self._seq

    def publish(self, kind: str, model_id: str, cache_id: str, num_tokens: int) -> None:
        """A cache event (``kind``: a key of :data:`KINDS`)."""
        self._publish(lambda seq: KvEventRecord(seq, KINDS[kind], model_id, cache_id, num_tokens, time.time_ns()))

    def publish_block(self, kind: str, model_id: str, data: dict) -> None:
        """A prefix-cache block event (``kind``: stored | removed | cleared)."""
        self._publish(lambda seq: KvEventRecord(seq, 0, model_id, "", 0, time.time_ns(), kind, data))

    def _publish(self, make) -> None:
        with self._lock:
            self._seq += 1
            ev = make(self._seq)
            self.replay.append(ev)
            for sub in list(self._subs):
                try:
                    sub.loop.call_soon_threadsafe(sub._offer, ev)
                except RuntimeError:  # the subscriber's loop is closed
                    self._subs.discard(sub)

    def subscribe(self, model_id: str, from_seq: int | None, blocks: bool = False
                  ) -> tuple[Subscription, int | None, int]:
        """A new subscription (``blocks``: with block events). Returns (subscription, oldest
        available seq if ``from_seq`` is gone else None, next seq). Replayed events are queued
        before live ones, in order."""
        sub = Subscription(self, model_id, self.subscriber_buffer, blocks)
        with self._lock:
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
