"""Prefix-cache block events on ZeroMQ in vLLM's format, for llm-d's precise prefix scorer.

llm-d's KV-cache indexer reads only vLLM's ZMQ KV events (shared/notes/anchors-2026-12-05.md §3).
With ``--kv-events-zmq-endpoint tcp://*:5557`` the server publishes the block events of every
served model there, as ``vllm/distributed/kv_events.py``'s ``ZmqEventPublisher`` does:

* a PUB socket; each message is three frames: the topic (``kv@<pod>@<model>`` by default, the
  form llm-d subscribes to), the batch's sequence number (8 bytes, big-endian, from 0) and the
  batch as msgpack;
* a batch is ``[ts, [event, ...]]`` (vLLM's ``KVEventBatch``, ``array_like``); an event is
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``
  (plus ``lora_name`` when an adapter computed the blocks), ``["BlockRemoved", block_hashes,
  medium]`` or ``["AllBlocksCleared"]``; one event per batch;
* optionally a ROUTER socket for replay (``--kv-events-zmq-replay-endpoint``): a request
  ``[b"", start_seq (8 bytes)]`` is answered with every retained ``[seq, payload]`` from
  ``start_seq`` on, then ``[-1 (8 bytes, signed), b""]``.

Block hashes are those of the vLLM gRPC protocol (``vllm_kv_events.block_hash``: the first 8 bytes
of the contract's chained block key), as unsigned 64-bit integers; ``medium`` is left unset (the
executor's one KV pool). ZeroMQ has no authentication here, and block events name every caller's
blocks and carry their prompt tokens: the server refuses this publisher when callers are told
apart (bearer tokens or mutual TLS), and the port must be fenced like the workers' gRPC port.
"""

from __future__ import annotations

import asyncio
import collections
import socket

import structlog

from ..core.modes import BlockEvent
from ..hosting.kv_events import KvEventHub, KvEventRecord, SubscriberDropped
from .vllm_kv_events import block_hash

log = structlog.get_logger("ferrum_service.wire.zmq_kv_events")

#: The replay's end marker (vLLM's ``END_SEQ``).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: Batches kept for replay (vLLM's default ``buffer_steps``), within the hub's replay bytes.
REPLAY_BATCHES = 10_000


def default_topic(model_id: str) -> str:
    """``kv@<host name>@<model>`` (in a pod, set ``--kv-events-zmq-topic 'kv@$(POD_IP)@{model}'``:
    llm-d names a worker by its pod address)."""
    return f"kv@{socket.gethostname()}@{model_id}"


def event_of(ev: KvEventRecord) -> list | None:
    """One hub block event as vLLM's tagged, array-like event (None: nothing to publish)."""
    d = ev.block or {}
    if ev.block_kind == BlockEvent.STORED:
        bs = int(d.get("block_size") or 0)
        keys = list(d.get("block_hashes") or [])
        tokens = [int(t) for t in (d.get("token_ids") or [])]
        if not (bs and keys and len(tokens) >= bs * len(keys)):
            return None  # blocks without their tokens would look to an indexer like every other one
        parent = d.get("parent_block_hash")
        out = ["BlockStored", [_unsigned(k) for k in keys], _unsigned(parent) if parent else None,
               tokens[:bs * len(keys)], bs, None, None]
        if d.get("adapter"):
            out.append(str(d["adapter"]))  # vLLM's newer trailing ``lora_name``
        return out
    if ev.block_kind == BlockEvent.REMOVED:
        return ["BlockRemoved", [_unsigned(k) for k in d.get("block_hashes") or []], None]
    return ["AllBlocksCleared"]


def _unsigned(key: bytes) -> int:
    return block_hash(key) & 0xFFFF_FFFF_FFFF_FFFF


class ZmqKvEventPublisher:
    """Publishes the hub's block events of every model on ``endpoint`` (see the module's doc)."""

    def __init__(self, hub: KvEventHub, endpoint: str, replay_endpoint: str = "",
                 topic: str = "") -> None:
        import msgpack  # the ``llm-d`` extra (with pyzmq): only a server that publishes needs them
        import zmq
        import zmq.asyncio

        self.hub, self.endpoint, self.replay_endpoint = hub, endpoint, replay_endpoint
        self.topic = topic  # "" = default_topic(model); may hold {model}
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)  # a slow subscriber loses batches (it sees the gap), not us
        self._pub.bind(endpoint)
        self._router = None
        if replay_endpoint:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(replay_endpoint)
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=REPLAY_BATCHES)
        self.buffer_bytes = 0
        self.seq = -1  # the last number sent
        self._tasks: list[asyncio.Task] = []
        self._zmq = zmq

    @property
    def bound(self) -> str:
        """The PUB socket's address (with the port the OS chose for ``tcp://host:*``)."""
        return self._pub.getsockopt_string(self._zmq.LAST_ENDPOINT)

    @property
    def replay_bound(self) -> str:
        return self._router.getsockopt_string(self._zmq.LAST_ENDPOINT) if self._router is not None else ""

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._pump()))
        if self._router is not None:
            self._tasks.append(loop.create_task(self._serve_replay()))
        log.info("publishing KV block events on ZeroMQ", endpoint=self.bound, replay=self.replay_bound or None)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        self._pub.close(0)
        if self._router is not None:
            self._router.close(0)
        self._ctx.term()

    def _topic_of(self, model_id: str) -> bytes:
        return (self.topic.replace("{model}", model_id) if self.topic else default_topic(model_id)).encode()

    async def _pump(self) -> None:
        from_seq = None  # live events from now on
        while True:
            sub, gone, _ = self.hub.subscribe("", from_seq, blocks=True, capped=False, cache_events=False)
            try:
                if gone is not None:
                    from_seq = gone
                    continue
                while True:
                    ev = await sub.next()
                    from_seq = ev.seq + 1
                    event = event_of(ev) if ev.block_kind else None
                    if event is not None:
                        await self._send(ev.model_id, [ev.time_unix_ns / 1e9, [event]])
            except SubscriberDropped as d:  # it fell behind the hub: go on from what the hub still has
                log.warning("ZMQ KV-event publisher fell behind; events were skipped", resume_from=d.resume_from_seq)
                from_seq = d.resume_from_seq
            finally:
                sub.close()

    async def _send(self, model_id: str, batch: list) -> None:
        payload = self._pack(batch)
        self.seq += 1
        await self._pub.send_multipart((self._topic_of(model_id), self.seq.to_bytes(8, "big"), payload))
        buf, limit = self.buffer, self.hub.replay_bytes
        while buf and (len(buf) >= (buf.maxlen or 0) or (limit and self.buffer_bytes + len(payload) > limit)):
            self.buffer_bytes -= len(buf.popleft()[1])
        buf.append((self.seq, payload))
        self.buffer_bytes += len(payload)

    async def _serve_replay(self) -> None:
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("malformed ZMQ KV-event replay request ignored", frames=len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= start_seq:
                    await self._router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            await self._router.send_multipart((client, b"", END_SEQ, b""))


__all__ = ["END_SEQ", "REPLAY_BATCHES", "ZmqKvEventPublisher", "default_topic", "event_of"]
