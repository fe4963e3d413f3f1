"""The synchronous client: :class:`Client`, its stream iterator :class:`GenerateStream` and the
step-by-step :class:`Session` helper. Requests are built by :mod:`ferrum_client.requests`."""

from __future__ import annotations

import itertools
import queue
import threading
import time
from typing import Iterator

import grpc

from . import messages as m
from . import requests as rq
from ._proto.ferrum.executor.v1 import executor_pb2 as pb
from .channel import MAX_MIGRATION_HOPS, READY_POLL_S, Connection, ready_polls
from .errors import FerrumRpcError


def _sync_unary(spec: rq.Unary):
    def method(self, *args, timeout=None, **kwargs):
        return spec.result(self.call(spec.rpc, spec.build(*args, **kwargs), timeout))
    return method


@rq.unary_methods(_sync_unary)
class Client(Connection):
    """Synchronous client. ``target`` is ``host:port``; pass ``token`` for bearer auth and
    ``root_certificates`` (+ ``private_key``/``certificate_chain`` for mutual TLS) for TLS.

    Besides the methods below it has one method per unary RPC (``info``, ``prefill``, ``decode``,
    ... — the table :data:`ferrum_client.requests.UNARY`), each taking ``timeout=`` (seconds).
    """

    channels = grpc

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel (and those opened to follow migrated streams)."""
        for c in self._siblings.values():
            c.close()
        self._siblings.clear()
        self.channel.close()

    def call(self, name: str, request, timeout: float | None = None):
        """Any unary RPC by its contract name with a request built by the caller (``timeout`` in
        seconds; default the client's): the response, or :class:`FerrumRpcError`."""
        try:
            return getattr(self.stub, name)(request, timeout=timeout or self.timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise FerrumRpcError.from_rpc_error(e) from None

    # ---- health ---------------------------------------------------------------------------------
    def health(self, service: str = "", timeout: float = 5.0) -> str:
        """``grpc.health.v1`` status name: SERVING, NOT_SERVING, SERVICE_UNKNOWN."""
        try:
            return rq.serving_status(self.health_stub.Check(rq.health(service), timeout=timeout))
        except grpc.RpcError as e:
            raise FerrumRpcError.from_rpc_error(e) from None

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until the channel connects and health says SERVING (``TimeoutError`` after
        ``timeout`` seconds)."""
        for _ in ready_polls(timeout):
            try:
                if self.health(timeout=2.0) == "SERVING":
                    return
            except FerrumRpcError:
                pass
            time.sleep(READY_POLL_S)

    # ---- streams --------------------------------------------------------------------------------
    def subscribe_kv_events(self, model_id: str = "", from_seq: int | None = None,
                            include_block_events: bool = False, timeout: float | None = None) -> GenerateStream:
        """Stream of ``SubscribeKvEventsResponse`` (iterate; ``.cancel()`` to stop);
        ``include_block_events`` adds the prefix cache's ``KvBlockEvent`` messages."""
        request = rq.kv_events(model_id, from_seq, include_block_events)
        return GenerateStream(self.stub.SubscribeKvEvents(request, timeout=timeout, metadata=self.metadata))

    def generate(self, model_id: str, *, timeout: float | None = None, follow_migrations: bool = True,
                 **kw) -> GenerateStream:
        """Stream a generation (see :func:`ferrum_client.messages.generate_request` for the
        arguments). Iterate the result for ``GenerateResponse`` events; ``.cancel()`` stops it.

        A stream the server moves to a peer (``GenerateMigrated``) is followed there with the same
        credentials and resumed by its token: the events go on as one stream (the server's
        ``migrated`` event and the peer's ``started`` event are not passed on; ``.migrations``
        lists the servers moved to). ``follow_migrations=False`` passes ``migrated`` on instead."""
        call = self.stub.Generate(m.generate_request(model_id, **kw), timeout=timeout, metadata=self.metadata)

        def follow(moved: pb.GenerateMigrated):
            peer = self._sibling(moved.target)
            return peer.stub.Generate(pb.GenerateRequest(model_id=model_id, resume_token=moved.resume_token),
                                      timeout=timeout, metadata=peer.metadata)

        return GenerateStream(call, follow if follow_migrations else None)

    def export_kv(self, model_id: str, cache_id: str, from_token: int = 0, to_token: int = 0,
                  max_chunk_bytes: int = 0, timeout: float | None = None) -> GenerateStream:
        """Stream of ``ExportKvResponse``: a header, then checksummed K/V chunks (iterate)."""
        return GenerateStream(self.stub.ExportKv(rq.export_kv(model_id, cache_id, from_token, to_token, max_chunk_bytes),
                                                 timeout=timeout, metadata=self.metadata))

    def import_kv(self, model_id: str, exported, *, reserve_tokens: int = 0, cache_salt: str = "",
                  timeout: float | None = None) -> pb.ImportKvResponse:
        """A new cache from ``ExportKvResponse`` messages (e.g. another server's ``export_kv``):
        the client relays the bytes. Prefer :meth:`pull_kv` (server to server)."""
        # The source's refusal (ExportKv's status: NOT_FOUND, UNIMPLEMENTED, ...) is raised here, as
        # itself; raised inside gRPC's request iterator it would end the import as UNKNOWN.
        exported = iter(exported)
        head = [m for m in [next(exported, None)] if m is not None]
        try:
            return self.stub.ImportKv(rq.import_stream(model_id, itertools.chain(head, exported),
                                                       reserve_tokens=reserve_tokens, cache_salt=cache_salt),
                                      timeout=timeout or self.timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise FerrumRpcError.from_rpc_error(e) from None

    def session(self) -> Session:
        """Open a ``Session`` stream: steps in, results out in order."""
        return Session(self)


class GenerateStream:
    """Iterator over a server-streaming call's messages (``Generate``, ``SubscribeKvEvents``)."""

    def __init__(self, call, follow=None) -> None:
        self.call = call
        self._follow = follow
        self.migrations: list[str] = []  # servers the stream moved to (followed)

    def __iter__(self) -> Iterator[pb.GenerateResponse]:
        try:
            if self._follow is None:  # another stream (exports, events), or migrations passed on
                yield from self.call
                return
            while True:
                moved = None
                for ev in self.call:
                    kind = ev.WhichOneof("event")
                    if kind == "migrated":
                        moved = ev.migrated
                        break
                    if kind == "started" and self.migrations:
                        continue  # the resumed stream's start: the caller saw the first one
                    yield ev
                if moved is None:
                    return
                if len(self.migrations) >= MAX_MIGRATION_HOPS:
                    raise FerrumRpcError(grpc.StatusCode.ABORTED,
                                         f"the stream moved more than {MAX_MIGRATION_HOPS} times")
                self.call.cancel()
                self.migrations.append(moved.target)
                self.call = self._follow(moved)
        except grpc.RpcError as e:
            raise FerrumRpcError.from_rpc_error(e) from None

    def tokens(self) -> list[int]:
        """Consume the stream; the generated token ids."""
        return [ev.token.token_id for ev in self if ev.WhichOneof("event") == "token"]

    def cancel(self) -> None:
        """Cancel the call (iteration then raises ``FerrumRpcError`` CANCELLED)."""
        self.call.cancel()


class Session:
    """A ``Session`` stream used step by step from synchronous code.

    ``step(request)`` sends one step (any of the step request messages) and waits for its result;
    a failed step raises :class:`FerrumRpcError` and the session goes on. ``close()`` ends the
    stream, which frees every cache created on it.
    """

    _END = object()

    def __init__(self, client: Client) -> None:
        self._q: queue.Queue = queue.Queue()
        self._next_id = 0
        self._lock = threading.Lock()
        self._responses = client.stub.Session(iter(self._q.get, self._END), metadata=client.metadata)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def send(self, request) -> int:
        """Queue a step without waiting; returns its step id (results come back in order)."""
        with self._lock:
            self._next_id += 1
            sid = self._next_id
        self._q.put(rq.session_request(sid, request))
        return sid

    def receive(self):
        """The next result in order (the step's response message)."""
        try:
            resp = next(self._responses)
        except grpc.RpcError as e:
            raise FerrumRpcError.from_rpc_error(e) from None
        return rq.step_result(resp)

    def step(self, request):
        """Send one step and wait for its result."""
        self.send(request)
        return self.receive()

    def cancel(self) -> None:
        """Cancel the stream."""
        self._responses.cancel()

    def close(self) -> None:
        """End the stream (the server frees the caches created on it) and drain what is left."""
        self._q.put(self._END)
        try:
            for _ in self._responses:
                pass
        except grpc.RpcError:
            pass
