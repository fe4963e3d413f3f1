"""Relay mode of stream migration (``MIGRATION_MODE_RELAY``; every ``VllmEngine.Generate`` stream):
after a stream's hand-off (``migration.py``) the moving server resumes it on the target itself and
sends the target's events on the caller's own stream. :class:`Relays` counts the streams one server
relays (a move past :data:`MAX_RELAYS` is refused before it starts) and runs one relay's call.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, AsyncIterator

import grpc
import structlog
from ferrum_client._proto.ferrum.executor.v1 import executor_pb2_grpc

from ..core import errors
from .convert import pb

if TYPE_CHECKING:
    from ..hosting.kv_peers import KvPeers

log = structlog.get_logger("ferrum_service.wire.migration")

#: Streams one server relays at once (``MIGRATION_MODE_RELAY``, every vLLM-protocol stream): each
#: holds a call to its target and a task here. A move past it is refused (RESOURCE_EXHAUSTED) and
#: the stream goes on here.
MAX_RELAYS = 256
#: Times one relayed stream may move on again (its target moved it on, and it followed) before
#: the relay gives up with UNAVAILABLE.
MAX_RELAY_HOPS = 8


class Relays:
    """The streams this server relays, and the relay of one."""

    def __init__(self, peers: "KvPeers", limit: int = MAX_RELAYS) -> None:
        self.peers = peers
        self.running = 0  # streams relayed now
        self.limit = limit

    def room(self) -> bool:
        """Whether one more stream may be relayed."""
        return self.running < self.limit

    def full(self) -> errors.FerrumError:
        """The refusal of a move past the cap (the stream goes on here)."""
        return errors.exhausted(f"this server already relays {self.limit} moved streams; the stream goes on "
                                "here", limit=self.limit)

    def take(self) -> None:
        """Count one more relayed stream (a move in relay mode, before its hand-off); the refusal
        past the cap."""
        if not self.room():
            raise self.full()
        self.running += 1

    def give_back(self) -> None:
        """A relay slot :meth:`take` counted ends (the hand-off failed, or the relay ended)."""
        self.running -= 1

    async def events(self, moved: pb.GenerateMigrated, model_id: str, state) -> AsyncIterator[pb.GenerateResponse]:
        """The moved stream's events from its target, for this server to send on the caller's
        stream as its own (relay mode): ``Generate{resume_token}`` on the target on the caller's
        behalf (``state.tenant``), with this server's peer token; the target's ``started`` is left
        out (the caller had this server's), a ``migrated`` from it is followed (the target moved
        the stream on). The stream's relay slot (taken by ``StreamMover.hand_off``) is given
        back at the end. Leaving the iteration (the caller cancelled, the stream was aborted)
        cancels the call, which ends the stream on the target and frees its cache there; the
        target's error ends the stream with its code."""
        hops = 0
        try:
            while True:
                t = await self.peers.check(moved.target)
                stub = executor_pb2_grpc.ModelExecutorStub(self.peers.channel(t, False))
                call = stub.Generate(pb.GenerateRequest(model_id=model_id, resume_token=moved.resume_token),
                                     metadata=self.peers.metadata(state.tenant))
                state.on_abort = call.cancel  # Abort here reaches the target at once
                nxt = None
                try:
                    state.check_aborted()
                    async for ev in call:
                        kind = ev.WhichOneof("event")
                        if kind == "migrated":
                            nxt = ev.migrated
                            break
                        if kind != "started":
                            yield ev
                except asyncio.CancelledError:
                    state.check_aborted()  # the call was cancelled by Abort: CANCELLED as a stream on A
                    raise
                except grpc.aio.AioRpcError as e:
                    state.check_aborted()
                    log.warning("relayed stream failed at its target", target=t, code=e.code().name,
                                details=e.details())
                    raise errors.FerrumError(
                        errors.ErrorKind.NETWORK, f"the stream moved to {t}, which failed it: {e.details()}",
                        code=e.code() if e.code() != grpc.StatusCode.OK else grpc.StatusCode.UNKNOWN) from None
                finally:
                    state.on_abort = None
                    call.cancel()
                if nxt is None:
                    return
                hops += 1
                if hops > MAX_RELAY_HOPS:
                    raise errors.unavailable(f"the relayed stream moved more than {MAX_RELAY_HOPS} times")
                moved = nxt
        finally:
            self.give_back()
