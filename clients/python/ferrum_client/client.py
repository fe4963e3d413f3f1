"""Typed clients for ``ferrum.executor.v1.ModelExecutor``: :class:`Client` (sync) and
:class:`AsyncClient` (asyncio), with the same methods.

Both return the contract's response messages (see ``protos/``); failures raise
:class:`FerrumRpcError` with the gRPC code, ferrum's error kind and the offending field. Every call
takes ``timeout`` (seconds; the call's deadline).

    with Client("localhost:50051") as c:
        out = c.prefill("tiny", [1, 2, 3]).output
        step = c.decode("tiny", out.cache.cache_id, out.output.token_id)

    async with AsyncClient("localhost:50051") as c:
        out = (await c.prefill("tiny", [1, 2, 3])).output

The pieces live in small modules: ``requests`` (one request builder per RPC and the table of
unary methods, shared by both clients), ``channel`` (channel options, TLS, token),
``sync_client`` and ``async_client``; this module gathers them.
"""

from __future__ import annotations

from .async_client import AsyncClient, AsyncSession
from .channel import DEFAULT_OPTIONS
from .errors import FerrumRpcError
from .sync_client import Client, GenerateStream, Session

__all__ = ["AsyncClient", "AsyncSession", "Client", "DEFAULT_OPTIONS", "FerrumRpcError", "GenerateStream", "Session"]
