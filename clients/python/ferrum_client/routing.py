"""Client-side routing for several ferrum-service replicas: sticky sessions.

A session's KV cache lives on the replica whose Prefill created it; no other replica can serve its
Decode, ForwardVerify, TruncateKv or ReleaseCache (they answer NOT_FOUND). So:

1. **New session -> pick a replica**: among the replicas that are up and not draining, the one
   with the fewest open sessions here (ties broken round-robin). Stateless calls (Info, Generate,
   Tokenize, ...) may go anywhere; :meth:`StickyRouter.any_client` picks the same way.
   **Prefix-aware** (``StickyRouter(..., prefix_aware=True)``): the router follows every replica's
   prefix-cache block events (:mod:`ferrum_client.prefix_mirror`, one background thread per
   replica) and ``new_session(prompt_tokens=..., model_id=..., cache_salt=..., adapter=...)``
   goes to the replica holding the longest cached prefix of the prompt, in blocks keyed by
   :mod:`ferrum_client.prefix_keys` with that replica's advertised recipe; ties (a cold prompt
   included) fall back to the fewest sessions, then round-robin.
2. **Every step of a session -> that replica**, never another one.
3. **A replica fails** (UNAVAILABLE from a call, or removed from the replica set): every session
   on it fails fast with :class:`ReplicaLost` (code UNAVAILABLE) without further network calls
   (its caches are gone); new sessions go to the survivors. A replica whose health says
   NOT_SERVING is draining (SIGTERM): its sessions keep working, it gets no new ones.

On Kubernetes the replica set is the headless Service's A records (one per ready pod):
:meth:`StickyRouter.from_dns` resolves them, :meth:`StickyRouter.refresh` re-resolves.

**Disaggregated mode** (:class:`DisaggregatedRouter`): prompts are computed on prefill replicas
(``--role prefill``), each cache is handed to a decode replica (``--role decode``) by server pull
(``ImportKv`` with a ``source``: the decode replica fetches the K/V from the prefill replica itself,
one of its configured KV peers, on this client's behalf; the client never relays the bytes), the
prefill replica's cache is released, and every later step of the session goes to the decode
replica. Long prompts then never
stall the decode replicas' token streams.

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

from . import messages as m, prefix_keys
from ._proto.ferrum.executor.v1 import executor_pb2 as pb
from ._proto.ferrum.executor.v1 import types_pb2 as tpb
from .client import Client
from .errors import FerrumRpcError
from .prefix_mirror import BlockEventFollower, PrefixMirror

__all__ = ["StickyRouter", "RoutedSession", "Replica", "ReplicaLost", "NoReplicaAvailable", "resolve_dns",
           "DisaggregatedRouter", "DisaggregatedSession", "Handoff"]


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
    ``key_identity``: the identity the replicas give this client, folded into the prefix keys it
    computes (replicas that authenticate callers key each caller's prompts in its own space,
    :func:`ferrum_client.prefix_keys.caller_salt`); default: from ``token`` when one is given
    (``token_caller``), else none. Under mutual TLS pass ``"x509:CN=" + the certificate's common
    name`` (percent-quoted); pass ``""`` for replicas that check no tokens. Thread-safe.
    """

    def __init__(self, targets: Iterable[str] = (), *, resolver: Callable[[], Iterable[str]] | None = None,
                 step_timeout: float = 10.0, client_factory: Callable[..., Client] = Client,
                 prefix_aware: bool = False, key_identity: str | None = None, **client_kw: Any) -> None:
        self.prefix_aware = prefix_aware
        token = client_kw.get("token")
        self.key_identity = key_identity if key_identity is not None else (
            prefix_keys.token_caller(token) if token else "")
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
                       cache_salt: str, adapter: str = "") -> dict[str, int]:
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
                salt = prefix_keys.caller_salt(self.key_identity, cache_salt)
                keyed[k] = r.mirror.prompt_keys(model_id, prompt_tokens, salt, adapter)
            keys = keyed[k]
            out[r.target] = r.mirror.cached_blocks(model_id, keys) * recipe.block_size if keys else 0
        return out

    def _pick(self, prompt_tokens=None, model_id: str = "", cache_salt: str = "",
              adapter: str = "") -> tuple[Replica, int]:
        live = [r for r in self._replicas.values() if r.up and not r.draining]
        if not live:
            raise NoReplicaAvailable()
        cached = 0
        if self.prefix_aware and prompt_tokens:
            scores = self._prefix_scores(live, prompt_tokens, model_id, cache_salt, adapter)
            cached = max(scores.values())
            live = [r for r in live if scores[r.target] == cached]
        least = min(len(r.sessions) for r in live)
        tied = sorted((r for r in live if len(r.sessions) == least), key=lambda r: r.target)
        return tied[next(self._rr) % len(tied)], cached

    def prefix_matches(self, prompt_tokens, model_id: str, cache_salt: str = "", adapter: str = "") -> dict[str, int]:
        """Prefix-aware mode: per live replica, the leading tokens of ``prompt_tokens`` (computed
        with LoRA ``adapter``) its mirrored prefix cache holds (what routing compares)."""
        with self._lock:
            live = [r for r in self._replicas.values() if r.up]
        return self._prefix_scores(live, list(prompt_tokens), model_id, cache_salt, adapter)

    # ---- sessions ------------------------------------------------------------------------------
    def new_session(self, session_id: str | None = None, *, prompt_tokens=None, model_id: str = "",
                    cache_salt: str = "", adapter: str = "") -> "RoutedSession":
        """Bind a new session to a replica: least sessions, round-robin on ties; in prefix-aware
        mode with ``prompt_tokens`` (and the ``model_id``, ``cache_salt`` and LoRA ``adapter`` its
        Prefill will use), first the replicas holding the longest cached prefix of the prompt. The
        session's ``expected_cached_tokens`` is that prefix's length per the mirror (a hint)."""
        sid = session_id or uuid.uuid4().hex
        tokens = list(prompt_tokens) if prompt_tokens is not None else None
        with self._lock:
            if sid in self._sessions:
                raise ValueError(f"session {sid} already exists")
            r, cached = self._pick(tokens, model_id, cache_salt, adapter)
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

    def any_client(self, *, prompt_tokens=None, model_id: str = "", cache_salt: str = "",
                   adapter: str = "") -> Client:
        """A client for a stateless call (Info, Generate, Tokenize ...), chosen like a new session
        (in prefix-aware mode, pass a ``Generate``'s prompt to send it where its prefix is cached)."""
        tokens = list(prompt_tokens) if prompt_tokens is not None else None
        with self._lock:
            return self._pick(tokens, model_id, cache_salt, adapter)[0].client

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


@dataclass
class Handoff:
    """A prompt computed on a prefill replica and its cache handed to a decode replica."""

    cache: tpb.KvCacheHandle  # the cache on the decode replica
    output: tpb.LogitsOutput  # the prompt's last-position output (computed on the prefill replica)
    cached_tokens: int  # prompt tokens the prefill replica took from its prefix cache
    prefill_target: str
    decode_target: str
    prefill_s: float  # the Prefill call
    handoff_s: float  # the ImportKv (server pull) call
    imported: pb.ImportKvResponse | None = None


class DisaggregatedRouter:
    """Prefill on a prefill replica, KV handoff by server pull, decode on a decode replica.

    ``prefill_targets`` / ``decode_targets``: the two replica sets (a ``--role both`` replica may be
    in both); each is a :class:`StickyRouter` (least sessions first, fail fast on a lost replica).
    ``source_targets``: how decode replicas reach a prefill replica when that differs from this
    client's address for it (``{client address: address seen from the decode replicas}``).
    """

    def __init__(self, prefill_targets: Iterable[str] = (), decode_targets: Iterable[str] = (), *,
                 source_targets: dict[str, str] | None = None, step_timeout: float = 10.0,
                 handoff_timeout: float = 60.0, client_factory: Callable[..., Client] = Client,
                 **client_kw: Any) -> None:
        self.prefill = StickyRouter(prefill_targets, step_timeout=step_timeout, client_factory=client_factory,
                                    **client_kw)
        self.decode = StickyRouter(decode_targets, step_timeout=step_timeout, client_factory=client_factory,
                                   **client_kw)
        self.source_targets = dict(source_targets or {})
        self.handoff_timeout = handoff_timeout
        # TLS to the replicas (root_certificates given) means TLS between them too: the decode
        # replica pulls from the prefill replica over TLS (KvSource.tls).
        self.tls = client_kw.get("root_certificates") is not None

    @classmethod
    def from_roles(cls, targets: Iterable[str], **kw: Any) -> "DisaggregatedRouter":
        """Sort replicas by the role their ``Info`` advertises (``both`` / unspecified: in both sets)."""
        factory = kw.get("client_factory", Client)
        client_kw = {k: v for k, v in kw.items() if k not in ("source_targets", "step_timeout", "handoff_timeout",
                                                               "client_factory", "key_identity", "prefix_aware")}
        pre, dec = [], []
        for t in targets:
            with factory(t, **client_kw) as c:
                role = c.info().role
            if role in (pb.SERVER_ROLE_PREFILL, pb.SERVER_ROLE_BOTH, pb.SERVER_ROLE_UNSPECIFIED):
                pre.append(t)
            if role in (pb.SERVER_ROLE_DECODE, pb.SERVER_ROLE_BOTH, pb.SERVER_ROLE_UNSPECIFIED):
                dec.append(t)
        return cls(pre, dec, **kw)

    def new_session(self, session_id: str | None = None) -> "DisaggregatedSession":
        """A session whose cache will live on a decode replica (chosen now, least sessions first)."""
        return DisaggregatedSession(self, self.decode.new_session(session_id))

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()

    def __enter__(self) -> "DisaggregatedRouter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DisaggregatedSession:
    """One session of a :class:`DisaggregatedRouter`: :meth:`prefill` computes a prompt on a
    prefill replica and hands its cache to this session's decode replica; every other
    :class:`Client` step method (``decode``, ``forward_verify``, ``release_cache``, ...) goes to the
    decode replica, as in a :class:`RoutedSession`."""

    def __init__(self, router: DisaggregatedRouter, decode_session: RoutedSession) -> None:
        self.router = router
        self.decode_session = decode_session

    @property
    def target(self) -> str:
        return self.decode_session.target

    def prefill(self, model_id: str, token_ids: Iterable[int], *, reserve_tokens: int = 0,
                policy: tpb.LogitsPolicy | None = None, cache_salt: str = "", adapter: str = "") -> Handoff:
        """Prefill on a prefill replica, pull the cache into the decode replica, release it on the
        prefill replica. The new cache (on the decode replica) is this session's; with LoRA
        ``adapter``, both replicas need that adapter loaded (the import binds the new cache to it)."""
        ids = list(token_ids)
        with self.router.prefill.new_session() as ps:
            t0 = time.perf_counter()
            inp = pb.PrefillInput(token_ids=ids, logits=policy or m.greedy(), cache_salt=cache_salt, adapter=adapter)
            out = _prefill(ps, model_id, inp)
            prefill_target = ps.target
            t1 = time.perf_counter()
            try:
                source = self.router.source_targets.get(ps.target, ps.target)
                imported = self._pull(model_id, source, prefill_target, out.cache.cache_id,
                                      reserve_tokens=max(reserve_tokens, len(ids)), cache_salt=cache_salt)
            finally:
                try:
                    ps.call("release_cache", model_id, out.cache.cache_id)
                except FerrumRpcError:
                    pass  # the prefill replica is gone: its cache with it
            t2 = time.perf_counter()
        return Handoff(cache=imported.cache, output=out.output, cached_tokens=out.cached_tokens,
                       prefill_target=prefill_target, decode_target=self.target, prefill_s=t1 - t0, handoff_s=t2 - t1,
                       imported=imported)

    def _pull(self, model_id: str, source: str, prefill_target: str, cache_id: str, **kw: Any) -> pb.ImportKvResponse:
        """The decode replica pulls ``cache_id`` from ``source``. UNAVAILABLE naming the source (the
        decode replica could not reach the prefill replica) marks the prefill replica down, not
        this session's decode replica."""
        sid = self.decode_session.session_id
        r = self.decode_session.replica
        if not r.up:
            raise ReplicaLost(r.target, sid, r.last_error)
        try:
            return r.client.pull_kv(model_id, source, cache_id, timeout=self.router.handoff_timeout,
                                    tls=self.router.tls, **kw)
        except FerrumRpcError as e:
            if e.code not in _REPLICA_DOWN_CODES:
                raise
            if e.field == "source":
                self.router.prefill.mark_down(prefill_target, f"unreachable from {r.target}: {e.message}")
                raise ReplicaLost(prefill_target, sid, e.message) from e
            self.router.decode.mark_down(r.target, f"ImportKv: {e.code.name}: {e.message}")
            raise ReplicaLost(r.target, sid, e.message) from e

    def generate(self, model_id: str, token_ids: Iterable[int], *, max_tokens: int = 16, temperature: float = 0.0,
                 seed: int | None = None, **kw: Any):
        """Token ids as they come: the first from the prefill replica (right after the prompt), the
        rest from a ``Generate`` on the decode replica over the handed-off cache (released at the end)."""
        ids = list(token_ids)
        policy = m.sampled(m.sampling(temperature, seed=seed)) if temperature > 0 else m.greedy()
        h = self.prefill(model_id, ids, reserve_tokens=len(ids) + max_tokens, policy=policy)
        try:
            first = h.output.token_id
            yield first
            if max_tokens > 1:
                r = self.decode_session.replica
                stream = r.client.generate(model_id, cache_id=h.cache.cache_id, last_token_id=first,
                                           max_tokens=max_tokens - 1, temperature=temperature,
                                           seed=None if seed is None else seed + 1, **kw)
                for ev in stream:
                    if ev.WhichOneof("event") == "token":
                        yield ev.token.token_id
        finally:
            try:
                self.decode_session.call("release_cache", model_id, h.cache.cache_id)
            except FerrumRpcError:
                pass

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_"):
            raise AttributeError(method)
        return getattr(self.decode_session, method)

    def close(self) -> None:
        self.decode_session.close()

    def __enter__(self) -> "DisaggregatedSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _prefill(session: RoutedSession, model_id: str, inp: pb.PrefillInput) -> pb.PrefillOutput:
    """A Prefill of a full ``PrefillInput`` on a routed session's replica."""
    r = session.replica
    if not r.up:
        raise ReplicaLost(r.target, session.session_id, r.last_error)
    try:
        return r.client.call("Prefill", pb.PrefillRequest(model_id=model_id, input=inp)).output
    except FerrumRpcError as e:
        if e.code in _REPLICA_DOWN_CODES:
            session.router.mark_down(r.target, f"Prefill: {e.code.name}: {e.message}")
            raise ReplicaLost(r.target, session.session_id, e.message) from e
        raise
