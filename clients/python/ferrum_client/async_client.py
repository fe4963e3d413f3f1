"""The asyncio client: :class:`AsyncClient`, with every method of :class:`~ferrum_client.Client`
as a coroutine (server-streaming ones as async iterators), and the :class:`AsyncSession` helper.
Requests are built by :mod:`ferrum_client.requests`, as for the sync client."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import AsyncIterator

import grpc

from . import messages as m
from . import requests as rq
from ._proto.ferrum.executor.v1 import executor_pb2 as pb
from .channel import MAX_MIGRATION_HOPS, READY_POLL_S, Connection, ready_polls
from .errors import FerrumRpcError


def _async_unary(spec: rq.Unary):
    async def method(self, *args, timeout=None, **kwargs):
        return spec.result(await self.call(spec.rpc, spec.build(*args, **kwargs), timeout))
    return method


async def _messages(call) -> AsyncIterator:
    """A server-streaming call's messages; errors as :class:`FerrumRpcError`; the call is
    cancelled when the consumer stops early."""
    try:
        async for msg in call:
            yield msg
    except grpc.RpcError as e:
        raise FerrumRpcError.from_rpc_error(e) from None
    finally:
        call.cancel()


@rq.unary_methods(_async_unary)
class AsyncClient(Connection):
    """asyncio client; the same methods as :class:`~ferrum_client.Client`, as coroutines.

    The unary RPCs (``info``, ``prefill``, ``decode``, ... — the table
    :data:`ferrum_client.requests.UNARY`) are awaited and take ``timeout=`` (seconds);
    ``generate`` and ``subscribe_kv_events`` are async iterators (leave the ``async for`` to
    cancel); ``session()`` opens an :class:`AsyncSession`. Use it inside one event loop.
    """

    channels = grpc.aio

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel (and those opened to follow migrated streams)."""
        for c in self._siblings.values():
            await c.close()
        self._siblings.clear()
        await self.channel.close()

    async def call(self, name: str, request, timeout: float | None = None):
        """Any unary RPC by its contract name with a request built by the caller (``timeout`` in
        seconds; default the client's): the response, or :class:`FerrumRpcError`."""
        try:
            return await getattr(self.stub, name)(request, timeout=timeout or self.timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise FerrumRpcError.from_rpc_error(e) from None

    # ---- health ---------------------------------------------------------------------------------
    async def health(self, service: str = "", timeout: float = 5.0) -> str:
        """``grpc.health.v1`` status name: SERVING, NOT_SERVING, SERVICE_UNKNOWN."""
        try:
            return rq.serving_status(await self.health_stub.Check(rq.health(service), timeout=timeout))
        except grpc.RpcError as e:
            raise FerrumRpcError.from_rpc_error(e) from None

    async def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait until the channel connects and health says SERVING (``TimeoutError`` after
        ``timeout`` seconds)."""
        for _ in ready_polls(timeout):
            try:
                if await self.health(timeout=2.0) == "SERVING":
                    return
            except FerrumRpcError:
                pass
            await asyncio.sleep(READY_POLL_S)

    # ---- streams --------------------------------------------------------------------------------
    async def subscribe_kv_events(self, model_id: str = "", from_seq: int | None = None,
                                  include_block_events: bool = False, timeout: float | None = None) -> AsyncIterator[pb.SubscribeKvEventsResponse]:
        """Async iterator over ``SubscribeKvEventsResponse`` (break out of the loop to cancel);
        ``include_block_events`` adds the prefix cache's ``KvBlockEvent`` messages."""
        request = rq.kv_events(model_id, from_seq, include_block_events)
        call = self.stub.SubscribeKvEvents(request, timeout=timeout, metadata=self.metadata)
        async with aclosing(_messages(call)) as messages:
            async for msg in messages:
                yield msg

    async def export_kv(self, model_id: str, cache_id: str, from_token: int = 0, to_token: int = 0,
                        max_chunk_bytes: int = 0, timeout: float | None = None
                        ) -> AsyncIterator[pb.ExportKvResponse]:
        """Async iterator over ``ExportKvResponse``: a header, then checksummed K/V chunks."""
        call = self.stub.ExportKv(rq.export_kv(model_id, cache_id, from_token, to_token, max_chunk_bytes),
                                  timeout=timeout, metadata=self.metadata)
        async with aclosing(_messages(call)) as messages:
            async for msg in messages:
                yield msg

    async def import_kv(self, model_id: str, exported, *, reserve_tokens: int = 0, cache_salt: str = "",
                        timeout: float | None = None) -> pb.ImportKvResponse:
        """A new cache from ``ExportKvResponse`` messages (an iterable or async iterable, e.g.
        another server's ``export_kv``): the client relays the bytes. Prefer :meth:`pull_kv`."""
        async def messages():
            if hasattr(exported, "__aiter__"):
                async for msg in exported:
                    yield msg
            else:
                for msg in exported:
                    yield msg

        async def stream():
            first = True
            async for msg in messages():
                yield rq.import_request(model_id, msg, first, reserve_tokens=reserve_tokens, cache_salt=cache_salt)
                first = False
        try:
            return await self.stub.ImportKv(stream(), timeout=timeout or self.timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise FerrumRpcError.from_rpc_error(e) from None

    async def generate(self, model_id: str, *, timeout: float | None = None, follow_migrations: bool = True,
                       **kw) -> AsyncIterator[pb.GenerateResponse]:
        """Async iterator over a generation's events (see
        :func:`ferrum_client.messages.generate_request` for the arguments; break out of the loop
        to cancel it). A stream moved to a peer (``GenerateMigrated``) is followed there and
        resumed, as one stream (see :meth:`ferrum_client.Client.generate`);
        ``follow_migrations=False`` passes ``migrated`` on instead."""
        client: AsyncClient = self
        call = self.stub.Generate(m.generate_request(model_id, **kw), timeout=timeout, metadata=self.metadata)
        hops = 0
        while True:
            moved = None
            async with aclosing(_messages(call)) as events:
                async for ev in events:
                    kind = ev.WhichOneof("event")
                    if kind == "migrated" and follow_migrations:
                        moved = ev.migrated
                        break
                    if kind == "started" and hops:
                        continue  # the resumed stream's start: the caller saw the first one
                    yield ev
            if moved is None:
                return
            hops += 1
            if hops > MAX_MIGRATION_HOPS:
                raise FerrumRpcError(grpc.StatusCode.ABORTED, f"the stream moved more than {MAX_MIGRATION_HOPS} times")
            client = self._sibling(moved.target)
            call = client.stub.Generate(pb.GenerateRequest(model_id=model_id, resume_token=moved.resume_token),
                                        timeout=timeout, metadata=client.metadata)

    def session(self) -> AsyncSession:
        """Open a ``Session`` stream: an :class:`AsyncSession` (``async with``; steps in, results
        out in order)."""
        return AsyncSession(self)


class AsyncSession:
    """A ``Session`` stream used step by step from asyncio code, like the sync
    :class:`~ferrum_client.Session`.

    ``await step(request)`` sends one step (any of the step request messages) and waits for its
    result; a failed step raises :class:`FerrumRpcError` and the session goes on. ``send`` /
    ``receive`` pipeline steps (results come back in order). ``await close()`` (or leaving
    ``async with``) ends the stream, which frees every cache created on it.

    The underlying ``grpc.aio`` call is ``.call``; its own API (``write``, ``read``,
    ``done_writing``, ``code``, ...) is also reachable on the session for code that writes
    ``SessionRequest`` envelopes itself (do not mix the two on one session).
    """

    def __init__(self, client: AsyncClient) -> None:
        self.call = client.stub.Session(metadata=client.metadata)
        self._next_id = 0
        self._send_lock = asyncio.Lock()
        self._receive_lock = asyncio.Lock()

    def __getattr__(self, name: str):
        if name == "call":  # not set: __init__ failed
            raise AttributeError(name)
        return getattr(self.call, name)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def send(self, request) -> int:
        """Send a step without waiting for its result; returns its step id."""
        async with self._send_lock:
            self._next_id += 1
            sid = self._next_id
            try:
                await self.call.write(rq.session_request(sid, request))
            except grpc.RpcError as e:
                raise FerrumRpcError.from_rpc_error(e) from None
        return sid

    async def receive(self):
        """The next result in order (the step's response message); ``EOFError`` if the stream
        has ended."""
        async with self._receive_lock:
            try:
                resp = await self.call.read()
            except grpc.RpcError as e:
                raise FerrumRpcError.from_rpc_error(e) from None
        if resp is grpc.aio.EOF:
            raise EOFError("the Session stream has ended")
        return rq.step_result(resp)

    async def step(self, request):
        """Send one step and wait for its result."""
        await self.send(request)
        return await self.receive()

    def cancel(self) -> None:
        """Cancel the stream."""
        self.call.cancel()

    async def close(self) -> None:
        """End the stream (the server frees the caches created on it) and drain what is left."""
        try:
            await self.call.done_writing()
            while await self.call.read() is not grpc.aio.EOF:
                pass
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass
