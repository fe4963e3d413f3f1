"""The channel setup both clients share: options, TLS, bearer token, stubs, default deadline."""

from __future__ import annotations

import time
from typing import Any, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2_grpc

from ._proto.ferrum.executor.v1 import executor_pb2_grpc as pb_grpc

DEFAULT_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]

READY_POLL_S = 0.1


class Connection:
    """A channel to ``target`` (``host:port``) with the executor and health stubs.

    Pass ``token`` for bearer auth and ``root_certificates`` (+ ``private_key`` /
    ``certificate_chain`` for mutual TLS) for TLS; ``server_name`` overrides the name checked
    against the server's certificate. ``timeout`` is the default deadline of unary calls (seconds).
    Subclasses set ``channels`` to ``grpc`` (sync) or ``grpc.aio`` (asyncio).
    """

    channels: Any = grpc

    def __init__(self, target: str, *, token: str | None = None, root_certificates: bytes | None = None,
                 private_key: bytes | None = None, certificate_chain: bytes | None = None,
                 options: Sequence[tuple[str, Any]] = (), timeout: float | None = 60.0,
                 server_name: str | None = None) -> None:
        # kept to open the same kind of connection to another server (a migrated stream's new home)
        self._settings = dict(token=token, root_certificates=root_certificates, private_key=private_key,
                              certificate_chain=certificate_chain, options=options, timeout=timeout,
                              server_name=server_name)
        self._siblings: dict[str, Any] = {}
        opts = list(DEFAULT_OPTIONS) + list(options)
        if server_name:
            opts.append(("grpc.ssl_target_name_override", server_name))
        if root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)
            self.channel = self.channels.secure_channel(target, creds, options=opts)
        else:
            self.channel = self.channels.insecure_channel(target, options=opts)
        self.stub = pb_grpc.ModelExecutorStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.metadata = [("authorization", f"Bearer {token}")] if token else []
        self.timeout = timeout


    def _sibling(self, target: str):
        """A connection like this one (same credentials and options) to ``target``, kept open
        until this one closes (used to follow a stream that moved to another server)."""
        c = self._siblings.get(target)
        if c is None:
            c = self._siblings[target] = type(self)(target, **self._settings)
        return c


#: Servers a client follows one stream through at most (``GenerateMigrated`` events).
MAX_MIGRATION_HOPS = 16


def ready_polls(timeout: float) -> Iterator[None]:
    """The rounds of a ``wait_ready`` loop: the caller checks health, then (not yet SERVING)
    pauses ``READY_POLL_S`` and asks for the next round; past ``timeout`` seconds it raises
    :class:`TimeoutError`."""
    deadline = time.monotonic() + timeout
    while True:
        yield
        if time.monotonic() > deadline:
            raise TimeoutError(f"server not SERVING after {timeout}s")
