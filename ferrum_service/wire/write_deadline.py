"""A write deadline for server streams whose client stops reading.

gRPC keeps a stream open while the client's core answers keepalive pings, even when its
application reads nothing: the server's next write then waits forever for flow-control window, and
whatever the stream holds (a Generate's reserved KV, an ExportKv's hold on its cache, a Session's
caches) stays held. :func:`send_stream` writes a stream's messages with ``context.write``, each
bounded by ``--stream-write-timeout``: a message its client has not made room for within that time
ends the stream. The stream's generator is closed first (its ``finally`` blocks release its caches
and holds, as for a cancellation), then the call ends with DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import grpc
import structlog

log = structlog.get_logger("ferrum_service.wire.write_deadline")


async def send_stream(rpc: str, messages: AsyncIterator[Any], context: grpc.aio.ServicerContext,
                      seconds: float) -> None:
    """Write every message of ``messages`` to the call, each within ``seconds`` (0 = no limit)."""
    try:
        async for msg in messages:
            if seconds <= 0:
                await context.write(msg)
                continue
            try:
                async with asyncio.timeout(seconds):
                    await context.write(msg)
            except TimeoutError:
                log.warning("stream ended: its client took no message for the write timeout", rpc=rpc,
                            timeout_s=seconds, peer=context.peer())
                await messages.aclose()  # release what the stream holds before the call ends
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"the client took no message for {seconds:g} s (the server's "
                                    "stream write timeout); the stream was ended")
    finally:
        await messages.aclose()


__all__ = ["send_stream"]
