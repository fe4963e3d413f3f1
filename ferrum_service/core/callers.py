"""Who is calling: the identity that owns the caches a call creates.

When callers authenticate (bearer tokens, or client certificates under mutual TLS), each cache
belongs to the caller that created it: another caller's cache is NOT_FOUND to them, never touched.
The identity is a digest of the bearer token (``token:<sha256 prefix>``; the token itself is never
kept) or the client certificate's names (``x509:CN=<common names>``, else ``x509:SAN=<alt names>``); unauthenticated
servers use one shared identity (``""``), as before.

The servicer sets :data:`current_caller` at the start of each RPC (each RPC runs in its own
asyncio task, so the value is that call's); checks and cache adoption read it.

:data:`current_origin` is where the call comes from: the caller's identity and its network host
(``context.peer()`` without the port, so a client that reconnects is the same origin). A cache made
by a unary call records it, and :class:`CallerActivity` remembers when each origin last called, so
the lease reaper can free the caches of an origin that has gone quiet (``leases.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
import secrets
import time
import urllib.parse
from typing import Iterator

import grpc
from ferrum_client.prefix_keys import token_caller

current_caller: contextvars.ContextVar[str] = contextvars.ContextVar("ferrum_caller", default="")
current_origin: contextvars.ContextVar[str] = contextvars.ContextVar("ferrum_origin", default="")
#: When the call's deadline passes (``time.monotonic()``; None = the caller set none).
current_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("ferrum_deadline", default=None)


def peer_host(peer: str | None) -> str:
    """``context.peer()`` without the client's port: ``ipv4:127.0.0.1:50000`` → ``ipv4:127.0.0.1``,
    ``ipv6:[::1]:50000`` → ``ipv6:[::1]``; other forms (``unix:...``) unchanged."""
    if not peer:
        return ""
    if peer.startswith(("ipv4:", "ipv6:")):
        head, _, port = peer.rpartition(":")
        if port.isdigit() and head not in ("ipv4", "ipv6"):
            return head
    return peer


class CallerActivity:
    """When each origin (caller identity @ host) last made a call, and which origins have a stream
    open now (Generate, Session, SubscribeKvEvents, ExportKv, ImportKv: an origin is active for as
    long as one of its streams is, however long it runs). Written on the event loop by every RPC,
    Session step and stream, read by the lease reaper; plain dicts are enough."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._open: dict[str, int] = {}  # origin -> streams open now

    @contextlib.contextmanager
    def streaming(self, origin: str) -> Iterator[None]:
        """Count ``origin`` as active while the block (a stream) runs; its idle time starts at
        the end of its last stream."""
        if not origin:
            yield
            return
        self._open[origin] = self._open.get(origin, 0) + 1
        try:
            yield
        finally:
            n = self._open.get(origin, 1) - 1
            if n > 0:
                self._open[origin] = n
            else:
                self._open.pop(origin, None)
            self.seen(origin)

    def seen(self, origin: str, now: float | None = None) -> None:
        if origin:
            self._last[origin] = time.monotonic() if now is None else now

    def idle_for(self, origin: str, now: float | None = None) -> float:
        """Seconds since ``origin`` last called or had a stream open (0 while one is open;
        infinite if never seen)."""
        if origin in self._open:
            return 0.0
        last = self._last.get(origin)
        if last is None:
            return float("inf")
        return (time.monotonic() if now is None else now) - last

    def forget_idle(self, older_than: float, now: float | None = None) -> None:
        """Drop origins quiet for longer than ``older_than`` seconds (keeps the table small)."""
        now = time.monotonic() if now is None else now
        for k in [k for k, t in self._last.items() if now - t > older_than and k not in self._open]:
            del self._last[k]


def enter_call(context: grpc.aio.ServicerContext, activity: CallerActivity | None, *, tokens_checked: bool) -> str:
    """Set :data:`current_caller` and :data:`current_origin` for this call and record the origin's
    activity; returns the origin."""
    caller = caller_identity(context, tokens_checked=tokens_checked)
    current_caller.set(caller)
    try:
        host = peer_host(context.peer())
    except Exception:  # noqa: BLE001 - a test double without a peer
        host = ""
    origin = f"{caller}@{host}" if host else ""
    current_origin.set(origin)
    try:
        left = context.time_remaining()
    except Exception:  # noqa: BLE001 - a test double without a deadline
        left = None
    current_deadline.set(time.monotonic() + left if left is not None else None)
    if activity is not None:
        activity.seen(origin)
    return origin


_LOG_KEY = secrets.token_bytes(32)  # per process: log ids cannot be tied to a token offline


def log_id(identity: str) -> str:
    """A caller identity or origin as logs show it: a keyed digest (HMAC-SHA256 with a key drawn
    at process start, 16 hex digits), so log lines of one process can be grouped by caller, but a
    token cannot be recovered from them by guessing (an identity is the unsalted ``token_caller``
    digest, which clients recompute for prefix keys and so cannot be salted). The network host of an
    origin (after ``@``) is kept as it is; "" stays ""."""
    caller, at, host = identity.partition("@")
    if not caller:
        return identity
    digest = hmac.new(_LOG_KEY, caller.encode(), hashlib.sha256).hexdigest()[:16]
    return f"caller#{digest}{at}{host}"


def caller_identity(context: grpc.aio.ServicerContext, *, tokens_checked: bool) -> str:
    """The caller's identity for cache ownership ("" when calls are not authenticated).

    ``tokens_checked``: the server verifies bearer tokens, so a token names a real caller."""
    if tokens_checked:
        for k, v in context.invocation_metadata() or ():
            if k == "authorization" and isinstance(v, str) and v.lower().startswith("bearer "):
                return token_caller(v[7:])
    return x509_identity(context.auth_context() or {})


def x509_identity(auth: dict) -> str:
    """A client certificate's identity from gRPC's auth context: ``x509:CN=`` + its common names,
    else ``x509:SAN=`` + its subject alternative names, each value percent-quoted and joined with
    ``,`` (so ``CN=a,b`` and the two names ``a`` and ``b`` differ, and a CN never equals a SAN);
    "" without a certificate. The issuer is not part of it: ``--tls-client-ca`` should hold only
    CAs whose names do not overlap (docs/operating.md)."""
    for key, field in (("x509_common_name", "CN"), ("x509_subject_alternative_name", "SAN")):
        vals = auth.get(key)
        if vals:
            names = ",".join(urllib.parse.quote(v.decode(errors="replace"), safe="") for v in vals)
            return f"x509:{field}={names}"
    return ""


__all__ = ["CallerActivity", "caller_identity", "current_caller", "current_origin", "enter_call", "log_id", "peer_host",
           "x509_identity"]
