"""Every RPC checks its request against the declared size limits before any work.

The limits are declared once (``buf.validate`` annotations in the contract's ``.proto`` files; the
table of :mod:`.vllm_limits` for vLLM's protocol) and compiled into ``len()`` checks at start-up
(``core/request_limits.py``). :func:`guarded` wraps a servicer so that each method, unary or
streaming, checks each request message before its handler sees it; one over a bound ends the call
with INVALID_ARGUMENT naming the field path and its limit (a refused message of a request stream
ends the stream).
"""

from __future__ import annotations

import inspect
import time
from typing import Callable

from google.protobuf.descriptor import ServiceDescriptor
from grpc_status import rpc_status

from ..core import errors
from ..core.request_limits import Check, Table, compile_checks
from .convert import status_of


# ---- every RPC of a servicer ----------------------------------------------------------------------
Refused = Callable[[str, errors.FerrumError, float], None]


def guarded(servicer, service: ServiceDescriptor, table: Table = {}, *, rpc_prefix: str = "",  # noqa: B006
            on_refusal: Refused | None = None):
    """A stand-in for ``servicer`` to register with gRPC: each method of ``service`` checks its
    request (each message of a request stream) against the declared bounds (``table`` adds bounds
    the descriptors lack) before the handler runs, and ends the call with the check's
    INVALID_ARGUMENT status. ``on_refusal(rpc, error, seconds)`` counts and logs a refusal (the
    RPC's name is ``rpc_prefix`` + the method's)."""
    checks = compile_checks(service, table)
    methods = {}
    for method in service.methods:
        fn = getattr(servicer, method.name)
        check = checks.get(method.name)
        if check is not None:
            fn = _wrap(fn, check, rpc_prefix + method.name, method.client_streaming, method.server_streaming,
                       on_refusal)
        methods[method.name] = fn
    return type(f"Guarded{type(servicer).__name__}", (), {k: staticmethod(v) for k, v in methods.items()})()


async def _refuse(context, rpc: str, e: errors.FerrumError, t0: float, on_refusal: Refused | None) -> None:
    if on_refusal is not None:
        on_refusal(rpc, e, time.perf_counter() - t0)
    await context.abort_with_status(rpc_status.to_status(status_of(e)))


def _wrap(fn, check: Check, rpc: str, client_streaming: bool, server_streaming: bool,
          on_refusal: Refused | None):
    async def checked(request, context) -> None:
        """Return when ``request`` is within its bounds; else end the call (AbortError)."""
        t0 = time.perf_counter()
        try:
            check(request)
        except errors.FerrumError as e:
            await _refuse(context, rpc, e, t0, on_refusal)

    if client_streaming:
        async def checked_stream(requests, context):
            async for r in requests:
                await checked(r, context)
                yield r

        if server_streaming:
            async def stream_stream(requests, context):
                inner = fn(checked_stream(requests, context), context)
                try:
                    async for out in inner:
                        yield out
                finally:  # closed early (the client went away): the handler cleans up at once
                    await inner.aclose()
            return stream_stream

        async def stream_unary(requests, context):
            return await fn(checked_stream(requests, context), context)
        return stream_unary

    if server_streaming:
        async def unary_stream(request, context):
            await checked(request, context)
            inner = fn(request, context)
            try:
                async for out in inner:
                    yield out
            finally:  # as stream_stream
                await inner.aclose()
        return unary_stream

    if inspect.iscoroutinefunction(fn):
        async def unary_unary(request, context):
            await checked(request, context)
            return await fn(request, context)
        return unary_unary

    async def unary_unary_sync(request, context):  # a generated base method (UNIMPLEMENTED)
        await checked(request, context)
        return fn(request, context)
    return unary_unary_sync


__all__ = ["guarded"]
