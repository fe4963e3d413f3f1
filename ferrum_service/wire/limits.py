"""Every RPC checks its request against the declared size limits before any work.

The limits are declared once (``buf.validate`` annotations in the contract's ``.proto`` files; the
table of :mod:`.vllm_limits` for vLLM's protocol) and compiled into ``len()`` checks at start-up
(``core/request_limits.py``). :func:`add_guarded` registers a servicer so that each method,
unary or streaming, checks each request message before its handler sees it; one over a bound ends
the call with INVALID_ARGUMENT naming the field path and its limit (a refused message of a request
stream ends the stream). A request longer than the most its bounds allow is refused unparsed.
"""

from __future__ import annotations

import inspect
import time
from typing import Callable

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass
from grpc_status import rpc_status

from ..core import errors
from ..core.request_limits import Check, Table, compile_checks, max_encoded_bytes
from ..core.wire_scan import compile_scan
from .convert import status_of


# ---- every RPC of a servicer ----------------------------------------------------------------------
Refused = Callable[[str, errors.FerrumError, float], None]


#: Requests up to this size are always parsed (a parse this small costs at most tens of ms, and
#: leaves room for fields a newer client adds to a message we think empty).
PARSE_FREE_BYTES = 1 << 20


class Unparsed:
    """Stands in for a request refused before it was parsed: longer than any within its declared
    bounds, or with more items than a bound allows (``core/wire_scan.py``)."""

    __slots__ = ("_error",)

    def __init__(self, error: errors.FerrumError) -> None:
        self._error = error

    def error(self) -> errors.FerrumError:
        return self._error


def _parser(cls, most: int | None, table: Table):
    """``cls.FromString``, or one that answers :class:`Unparsed` without parsing for a request
    past ``most`` bytes, or (past :data:`PARSE_FREE_BYTES`) one whose wire walk finds a field with
    more items than its bound: tens of millions of tiny items cost seconds of the event loop."""
    name, parse = cls.DESCRIPTOR.name, cls.FromString
    limit = max(most, PARSE_FREE_BYTES) if most is not None else None
    # within PARSE_FREE_BYTES the parse is cheap; above it a request passes the walk first
    scan = compile_scan(cls.DESCRIPTOR, table) if limit is None or limit > PARSE_FREE_BYTES else None

    def parse_bounded(raw: bytes):
        if limit is not None and len(raw) > limit:
            return Unparsed(errors.invalid(f"the {name} is {len(raw)} bytes; within its declared limits it is at "
                                           f"most {limit} bytes", limit=limit, requested=len(raw)))
        if scan is not None and len(raw) > PARSE_FREE_BYTES:
            refused = scan(raw)
            if refused is not None:
                return Unparsed(refused)
        return parse(raw)
    return parse_bounded


_HANDLERS = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}


def add_guarded(server, servicer, service: ServiceDescriptor, table: Table = {}, *,  # noqa: B006
                rpc_prefix: str = "", on_refusal: Refused | None = None) -> None:
    """Register ``servicer`` for ``service`` on ``server`` (as the generated ``add_..._to_server``
    does) with every method guarded: a request longer than the most its declared bounds allow is
    refused unparsed; every other is checked against the bounds (``table`` adds bounds the
    descriptors lack) before the handler runs. A refusal ends the call INVALID_ARGUMENT naming the
    field and its limit; ``on_refusal(rpc, error, seconds)`` counts and logs it (the RPC's name is
    ``rpc_prefix`` + the method's). A refused message of a request stream ends the stream."""
    checks = compile_checks(service, table)
    handlers = {}
    for m in service.methods:
        fn = _wrap(getattr(servicer, m.name), checks.get(m.name, _nothing), rpc_prefix + m.name,
                   m.client_streaming, m.server_streaming, on_refusal)
        handlers[m.name] = _HANDLERS[m.client_streaming, m.server_streaming](
            fn, request_deserializer=_parser(GetMessageClass(m.input_type), max_encoded_bytes(m.input_type, table), table),
            response_serializer=GetMessageClass(m.output_type).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def _nothing(request) -> None:
    """The check of a request without bounded fields."""


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
            if request.__class__ is Unparsed:
                raise request.error()
            check(request)
        except errors.FerrumError as e:
            await _refuse(context, rpc, e, t0, on_refusal)

    if client_streaming:
        async def checked_stream(requests, context):
            async for r in requests:
                await checked(r, context)
                yield r

        if server_streaming and not inspect.isasyncgenfunction(fn):
            async def stream_stream_written(requests, context):  # writes with context.write (write_deadline.py)
                return await fn(checked_stream(requests, context), context)
            return stream_stream_written

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

    if server_streaming and not inspect.isasyncgenfunction(fn):
        async def unary_stream_written(request, context):  # writes with context.write (write_deadline.py)
            await checked(request, context)
            return await fn(request, context)
        return unary_stream_written

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


__all__ = ["PARSE_FREE_BYTES", "Unparsed", "add_guarded"]
