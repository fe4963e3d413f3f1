"""Client-side routing for several ferrum-service replicas: sticky sessions.

A session's KV cache lives on the replica whose Prefill created it; no other replica can serve its
Decode, ForwardVerify, TruncateKv or ReleaseCache (they answer NOT_FOUND). So:

1. **New session -> pick a replica**: among the replicas that are up and not draining, the one
   with the fewest open sessions here (ties broken round-robin). Stateless calls (Info, Generate,
   Tokenize, ...) may go anywhere; :meth:`StickyRouter.any_client` picks the same way.
   **Prefix-aware** (``StickyRouter(..., prefix_aware=True)``): the router follows every replica's
   prefix-cache block events (:mod:`ferrum_client.prefix_mirror`, one background thread per
   replica) and ``new_session(prompt_tokens=..., model_id=..., cache_salt=...)`` goes to the
   replica holding the longest cached prefix of the prompt, in blocks keyed by
   :mod:`ferrum_client.prefix_keys` with that replica's advertised recipe; ties (a cold prompt
   included) fall back to the fewest sessions, then round-robin.
2. **Every step of a session -> that replica**, never another one.
3. **A replica fails** (UNAVAILABLE from a call, or removed from the replica set): every session
   on it fails fast with :class:`ReplicaLost` (code UNAVAILABLE) without further network calls
   (its caches are gone); new sessions go to the survivors. A replica whose health says
   NOT_SERVING is draining (SIGTERM): its sessions keep working, it gets no new ones.

On Kubernetes the replica set is the headless Service's A records (one per ready pod):
:meth:`StickyRouter.from_dns` resolves them, :meth:`StickyRouter.refresh` re-resolves.

    router = StickyRouter(["10.0.0.5:50051", "10.0.0.6:50051"])
    with router.new_session() as s:
        out = s.prefill("smollm2", [1, 2, 3]).output
        step = s.decode("smollm2", out.cache.cache_id, out.output.token_id)
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import grpc

from .client import Client
from .errors import FerrumRpcError
from .prefix_mirror import BlockEventFollower, PrefixMirror

__all__ = ["StickyRouter", "RoutedSession", "Replica", "ReplicaLost", "NoReplicaAvailable", "resolve_dns"]


class ReplicaLost(FerrumRpcError):
    """The session's replica is gone (its KV caches with it). Code UNAVAILABLE; start a new session."""

    def __init__(self, target: str, session_id: str, cause: str = "") -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE,
                         f"replica {target} is unavailable; session {session_id} lost its KV caches"
                         + (f" ({cause})" if cause else ""), kind="REPLICA_LOST")
        self.target = target
        self.session_id = session_id


class NoReplicaAvailable(FerrumRpcError):
    """No replica is up and accepting new sessions."""

    def __init__(self, message: str = "no replica is available for new sessions") -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message, kind="NO_REPLICA")


@dataclass
class Replica:
    target: str
    client: Client
    up: bool = True
    draining: bool = False
    sessions: set[str] = field(default_factory=set)
    last_error: str = ""
    # prefix-aware routing: the replica's cached block keys, kept by a follower thread
    mirror: PrefixMirror | None = None
    follower: BlockEventFollower | None = None


def resolve_dns(host: str, port: int) -> list[str]:
    """``ip:port`` for every address ``host`` resolves to (a headless Service: one per ready pod)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    out = []
    for family, _t, _p, _c, addr in infos:
        ip = addr[0]
        t = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        if t not in out:
            out.append(t)
    return sorted(out)


# Errors that mean "this replica is gone", as opposed to "this request was wrong".
_REPLICA_DOWN_CODES = {grpc.StatusCode.UNAVAILABLE}


class StickyRouter:
    """Spreads new sessions over replicas and keeps each session on the replica that holds its caches.

    ``targets``: initial ``host:port`` list; ``resolver``: a callable returning the current list
    (used by :meth:`refresh`); ``step_timeout``: default deadline of each routed call, so a call to
    a replica that vanished without a connection reset still fails within it. Extra keyword
    arguments go to each :class:`Client` (``token``, ``root_certificates``, ...).
    ``prefix_aware``: follow each replica's prefix-cache block events and route a new session
    with ``prompt_tokens`` to the replica holding the longest cached prefix (module docstring).
    Thread-safe.
    """

    def __init__(self, targets: Iterable[str] = (), *, resolver: Callable[[], Iterable[str]] | None = None,
                 step_timeout: float = 10.0, client_factory: Callable[..., Client] = Client,
                 prefix_aware: bool = False, **client_kw: Any) -> None:
        self.prefix_aware = prefix_aware
        self._lock = threading.RLock()
        self._replicas: dict[str, Replica] = {}
        self._sessions: dict[str, Replica] = {}
        self._rr = itertools.count()
        self._resolver = resolver
        self._factory = client_factory
        self._client_kw = {"timeout": step_timeout, **client_kw}
        self.step_timeout = step_timeout
        for t in targets:
            self._add(t)
        if resolver is not None and not self._replicas:
            self.refresh()

    @classmethod
    def from_dns(cls, host: str, port: int = 50051, **kw: Any) -> "StickyRouter":
        """Replicas from a DNS name, e.g. a headless Service ``ferrum-service-headless.ns.svc``."""
        return cls(resolver=lambda: resolve_dns(host, port), **kw)

    # ---- replica set ---------------------------------------------------------------------------
    def _add(self, target: str) -> Replica:
        r = self._replicas.get(target)
        if r is None or not r.up:
            if r is not None:
                self._stop_following(r)
                r.client.close()
            r = Replica(target, self._factory(target, **self._client_kw))
            if self.prefix_aware:
                r.mirror = PrefixMirror()
                r.follower = BlockEventFollower(r.client, r.mirror, name=target).start()
            self._replicas[target] = r
        return r

    @staticmethod
    def _stop_following(r: Replica, timeout: float = 0.0) -> None:
        if r.follower is not None:
            r.follower.stop(timeout)
        if r.mirror is not None:
            r.mirror.clear()

    def wait_following(self, timeout: float = 10.0) -> bool:
        """Prefix-aware mode: wait until every live replica's block-event stream is open."""
        deadline = time.monotonic() + timeout
        for r in self.replicas():
            if r.up and r.follower is not None:
                if not r.follower.wait_connected(max(0.0, deadline - time.monotonic())):
                    return False
        return True

    def refresh(self) -> None:
        """Re-resolve the replica set: new targets join; vanished ones are marked down (their sessions fail fast)."""
        if self._resolver is None:
            return
        current = set(self._resolver())
        with self._lock:
            for t in current:
                if t not in self._replicas or not self._replicas[t].up:
                    self._add(t)
            for t, r in list(self._replicas.items()):
                if t not in current and r.up:
                    self._mark_down(r, "removed from the replica set")

    def check_health(self, timeout: float = 1.0) -> dict[str, str]:
        """Ask each live replica's grpc.health.v1 (service ""): NOT_SERVING = draining (no new sessions)."""
        out = {}
        with self._lock:
            replicas = [r for r in self._replicas.values() if r.up]
        for r in replicas:
            try:
                status = r.client.health(timeout=timeout)
            except FerrumRpcError as e:
                status = e.code.name
                if e.code in _REPLICA_DOWN_CODES:
                    with self._lock:
                        self._mark_down(r, f"health check: {e.code.name}")
            else:
                r.draining = status != "SERVING"
            out[r.target] = status
        return out

    def replicas(self) -> list[Replica]:
        with self._lock:
            return list(self._replicas.values())

    def _mark_down(self, r: Replica, why: str) -> None:
        if r.up:
            r.up = False
            r.last_error = why
            self._stop_following(r)

    def mark_down(self, target: str, why: str = "marked down") -> None:
        with self._lock:
            r = self._replicas.get(target)
            if r is not None:
                self._mark_down(r, why)

    def _prefix_scores(self, replicas: Iterable[Replica], prompt_tokens, model_id: str,
                       cache_salt: str) -> dict[str, int]:
        """Cached leading tokens of the prompt per replica, from the mirrors (keys computed once
        per distinct recipe)."""
        keyed: dict[tuple, list[bytes]] = {}
        out = {}
        for r in replicas:
            if r.mirror is None:
                out[r.target] = 0
                continue
            recipe = r.mirror.recipes.get(model_id)
            k = (recipe.block_size, recipe.seed, tuple(recipe.extra_keys)) if recipe is not None else None
            if k not in keyed:
                keyed[k] = r.mirror.prompt_keys(model_id, prompt_tokens, cache_salt)
            keys = keyed[k]
            out[r.target] = r.mirror.cached_blocks(model_id, keys) * recipe.block_size if keys else 0
        return out

    def _pick(self, prompt_tokens=None, model_id: str = "", cache_salt: str = "") -> tuple[Replica, int]:
        live = [r for r in self._replicas.values() if r.up and not r.draining]
        if not live:
            raise NoReplicaAvailable()
        cached = 0
        if self.prefix_aware and prompt_tokens:
            scores = self._prefix_scores(live, prompt_tokens, model_id, cache_salt)
            cached = max(scores.values())
            live = [r for r in live if scores[r.target] == cached]
        least = min(len(r.sessions) for r in live)
        tied = sorted((r for r in live if len(r.sessions) == least), key=lambda r: r.target)
        return tied[next(self._rr) % len(tied)], cached

    def prefix_matches(self, prompt_tokens, model_id: str, cache_salt: str = "") -> dict[str, int]:
        """Prefix-aware mode: per live replica, the leading tokens of ``prompt_tokens`` its
        mirrored prefix cache holds (what routing compares)."""
        with self._lock:
            live = [r for r in self._replicas.values() if r.up]
        return self._prefix_scores(live, list(prompt_tokens), model_id, cache_salt)

    # ---- sessions ------------------------------------------------------------------------------
    def new_session(self, session_id: str | None = None, *, prompt_tokens=None, model_id: str = "",
                    cache_salt: str = "") -> "RoutedSession":
        """Bind a new session to a replica: least sessions, round-robin on ties; in prefix-aware
        mode with ``prompt_tokens`` (and the ``model_id`` and ``cache_salt`` its Prefill will
        use), first the replicas holding the longest cached prefix of the prompt. The session's
        ``expected_cached_tokens`` is that prefix's length per the mirror (a hint)."""
        sid = session_id or uuid.uuid4().hex
        tokens = list(prompt_tokens) if prompt_tokens is not None else None
        with self._lock:
            if sid in self._sessions:
                raise ValueError(f"session {sid} already exists")
            r, cached = self._pick(tokens, model_id, cache_salt)
            r.sessions.add(sid)
            self._sessions[sid] = r
        s = RoutedSession(self, sid)
        s.expected_cached_tokens = cached
        return s

    def replica_of(self, session_id: str) -> Replica:
        with self._lock:
            try:
                return self._sessions[session_id]
            except KeyError:
                raise KeyError(f"unknown session {session_id}") from None

    def end_session(self, session_id: str) -> None:
        with self._lock:
            r = self._sessions.pop(session_id, None)
            if r is not None:
                r.sessions.discard(session_id)

    def call(self, session_id: str, method: str, *args: Any, **kw: Any) -> Any:
        """Run ``Client.<method>(*args, **kw)`` on the session's replica.

        Raises :class:`ReplicaLost` at once, without a network call, when that replica is already
        known to be down; an UNAVAILABLE from the call marks the replica down and is raised as
        :class:`ReplicaLost` too. Other errors (NOT_FOUND, INVALID_ARGUMENT, ...) pass through.
        """
        r = self.replica_of(session_id)
        if not r.up:
            raise ReplicaLost(r.target, session_id, r.last_error)
        kw.setdefault("timeout", self.step_timeout)
        try:
            return getattr(r.client, method)(*args, **kw)
        except FerrumRpcError as e:
            if e.code in _REPLICA_DOWN_CODES:
                with self._lock:
                    self._mark_down(r, f"{method}: {e.code.name}: {e.message}")
                raise ReplicaLost(r.target, session_id, e.message) from e
            raise

    def any_client(self, *, prompt_tokens=None, model_id: str = "", cache_salt: str = "") -> Client:
        """A client for a stateless call (Info, Generate, Tokenize ...), chosen like a new session
        (in prefix-aware mode, pass a ``Generate``'s prompt to send it where its prefix is cached)."""
        tokens = list(prompt_tokens) if prompt_tokens is not None else None
        with self._lock:
            return self._pick(tokens, model_id, cache_salt)[0].client

    def close(self) -> None:
        with self._lock:
            replicas = list(self._replicas.values())
        for r in replicas:
            self._stop_following(r, timeout=5.0)
        with self._lock:
            for r in self._replicas.values():
                r.client.close()
            self._replicas.clear()
            self._sessions.clear()

    def __enter__(self) -> "StickyRouter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RoutedSession:
    """One session pinned to one replica: every call goes there (``s.prefill(...)``, ``s.decode(...)``,
    any :class:`Client` step method). Closing it releases nothing on the server by itself; call
    ``release_cache`` for the caches you created, then ``close()``."""

    def __init__(self, router: StickyRouter, session_id: str) -> None:
        self.router = router
        self.session_id = session_id
        self.expected_cached_tokens = 0

    @property
    def replica(self) -> Replica:
        return self.router.replica_of(self.session_id)

    @property
    def target(self) -> str:
        return self.replica.target

    def call(self, method: str, *args: Any, **kw: Any) -> Any:
        return self.router.call(self.session_id, method, *args, **kw)

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_") or not callable(getattr(Client, method, None)):
            raise AttributeError(method)
        return lambda *a, **kw: self.call(method, *a, **kw)

    def close(self) -> None:
        self.router.end_session(self.session_id)

    def __enter__(self) -> "RoutedSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
