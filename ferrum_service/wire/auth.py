"""Bearer-token authentication for the gRPC server.

Callers send ``authorization: Bearer <token>``. Health checks and reflection are open (probes and
``grpcurl list`` need no secret). Admin RPCs (``Warmup``, ``Shutdown``, ``LoadAdapter``,
``UnloadAdapter``, ``MigrateStreams``, and the vLLM protocol's ``FlushCache``, which drops every
tenant's cached prefix, and ``StartProfile`` / ``StopProfile``, which record every tenant's steps) need an admin token when one is configured: a valid ordinary token gets PERMISSION_DENIED there, no token UNAUTHENTICATED.
A KV peer token (``--kv-peer-token-file``, see ``kv_peers.py``) opens ``ExportKv``,
``AcceptMigration`` and ``Generate`` only, the last only to resume a stream the peer moved there in
relay mode (``servicer.py`` refuses any other ``Generate`` with a peer token).
"""

from __future__ import annotations

import hmac

import grpc

OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
ADMIN_METHODS = tuple(f"/ferrum.executor.v1.ModelExecutor/{m}"
                      for m in ("Warmup", "Shutdown", "LoadAdapter", "UnloadAdapter", "MigrateStreams")) + (
    "/vllm.grpc.engine.VllmEngine/FlushCache", "/vllm.grpc.engine.VllmEngine/StartProfile",
    "/vllm.grpc.engine.VllmEngine/StopProfile")
PEER_METHODS = ("/ferrum.executor.v1.ModelExecutor/ExportKv", "/ferrum.executor.v1.ModelExecutor/AcceptMigration",
                # only to resume a stream the peer moved here in relay mode (servicer.py, migration.py)
                "/ferrum.executor.v1.ModelExecutor/Generate")


def _matches(token: str, allowed: list[str]) -> bool:
    return any(hmac.compare_digest(token.encode(), a.encode()) for a in allowed)


def _deny(code: grpc.StatusCode, message: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def abort_unary(request, context):
        await context.abort(code, message)

    async def abort_stream(request_or_iterator, context):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort_stream, handler.request_deserializer,
                                                     handler.response_serializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort_stream, handler.request_deserializer,
                                                    handler.response_serializer)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort_unary, handler.request_deserializer,
                                                    handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(abort_unary, handler.request_deserializer, handler.response_serializer)


def bearer_token(metadata) -> str:
    """The bearer token of a call's metadata ("" when there is none)."""
    for k, v in metadata or ():
        if k == "authorization" and isinstance(v, str) and v.lower().startswith("bearer "):
            return v[7:].strip()
    return ""


def is_admin_call(metadata, admin_tokens: list[str], open_admin_rpcs: bool) -> bool:
    """Whether a call may use the admin RPCs: it carries an admin token when admin tokens are
    configured, else the operator opened them (``--open-admin-rpcs``)."""
    admin = [t for t in admin_tokens if t]
    if admin:
        token = bearer_token(metadata)
        return bool(token) and _matches(token, admin)
    return open_admin_rpcs


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks bearer tokens; ``admin_tokens`` gate the admin RPCs (and also pass ordinary ones)."""

    def __init__(self, tokens: list[str], admin_tokens: list[str], peer_tokens: list[str] = ()) -> None:
        self.tokens = [t for t in tokens if t]
        self.admin_tokens = [t for t in admin_tokens if t]
        self.peer_tokens = [t for t in peer_tokens if t]

    async def intercept_service(self, continuation, details):
        method = details.method
        handler = await continuation(details)
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        token = bearer_token(details.invocation_metadata)
        is_admin = bool(token) and _matches(token, self.admin_tokens)
        is_user = bool(token) and (is_admin or _matches(token, self.tokens))
        if method in ADMIN_METHODS and self.admin_tokens:
            if is_admin:
                return handler
            if is_user:
                return _deny(grpc.StatusCode.PERMISSION_DENIED, f"{method} needs an admin token", handler)
            return _deny(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token", handler)
        if not self.tokens or is_user:
            return handler
        if method in PEER_METHODS and bool(token) and _matches(token, self.peer_tokens):
            return handler
        return _deny(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token", handler)
