"""Who is calling: the identity that owns the caches a call creates.

When callers authenticate (bearer tokens, or client certificates under mutual TLS), each cache
belongs to the caller that created it: another caller's cache is NOT_FOUND to them, never touched.
The identity is a digest of the bearer token (``token:<sha256 prefix>``; the token itself is never
kept) or the client certificate's subject (``x509:<common name or SAN>``); unauthenticated
servers use one shared identity (``""``), as before.

The servicer sets :data:`current_caller` at the start of each RPC (each RPC runs in its own
asyncio task, so the value is that call's); checks and cache adoption read it.
"""

from __future__ import annotations

import contextvars
import hashlib

import grpc

current_caller: contextvars.ContextVar[str] = contextvars.ContextVar("ferrum_caller", default="")


def caller_identity(context: grpc.aio.ServicerContext, *, tokens_checked: bool) -> str:
    """The caller's identity for cache ownership ("" when calls are not authenticated).

    ``tokens_checked``: the server verifies bearer tokens, so a token names a real caller."""
    if tokens_checked:
        for k, v in context.invocation_metadata() or ():
            if k == "authorization" and isinstance(v, str) and v.lower().startswith("bearer "):
                return "token:" + hashlib.sha256(v[7:].strip().encode()).hexdigest()[:32]
    auth = context.auth_context() or {}
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        vals = auth.get(key)
        if vals:
            return "x509:" + b",".join(vals).decode(errors="replace")
    return ""


__all__ = ["caller_identity", "current_caller"]
