"""Who this server pulls KV from, and who may export KV on a caller's behalf (server pull's trust).

``ImportKv`` with a ``source`` makes this server call ``ExportKv`` on another server. That is a
network request the caller aims, so it is bounded by what the operator configured:

- **Peers** (``--kv-peer HOST:PORT``, repeatable; ``HOST:LO-HI`` admits a range of ports of one
  host, e.g. ``127.0.0.1:50051-50058`` for servers on one machine; ``HOST:*`` every port, but with
  a peer token only over TLS, since any local process could listen on one of them): the only
  targets this server dials. A peer
  named by a DNS name also admits the addresses that name resolves to now (a Kubernetes headless
  Service names the prefill pods; a router hands their IPs out). Any other target (another host,
  a ``unix:`` path, a ``dns:///`` URI) is PERMISSION_DENIED before anything is dialled. No peers
  configured: every pull is refused.
- **Credentials**: the server authenticates to a peer with its own peer token
  (``--kv-peer-token-file``: the first token is sent) and, for TLS, the operator's CA
  (``--kv-peer-ca``) and client certificate (``--kv-peer-cert`` / ``--kv-peer-key``). The caller's
  own ``authorization`` (or an admin token) is never sent anywhere.
- **On whose behalf**: the pull carries the caller's identity (``x-ferrum-kv-caller``, as
  ``callers.py`` computes it). The exporting server honours it only from a call authenticated
  with one of its peer tokens (every token in its ``--kv-peer-token-file``), and then applies its
  ownership check to that identity: a caller pulls only its own caches, exactly as before. A peer
  token opens ``ExportKv`` and ``AcceptMigration`` only (``auth.py``): a peer hands this server a
  running stream on the same terms (``migration.py``: this server then pulls the stream's KV from
  that peer, which must be one of its own peers).
- **Errors**: the caller learns that the peer failed and the gRPC code class (a request problem
  such as NOT_FOUND is passed on; anything else is UNAVAILABLE), never the peer's error text or a
  connect error (logged here instead).
- **Channels**: one per (peer, TLS), at most :data:`MAX_CHANNELS`, least recently used closed first.

KV that arrives through a pull from a peer is *trusted*: it may be keyed into a shared prefix key
space. KV a caller streams itself is not (``kv_transfer.py``).
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import ipaddress
import re
import socket
import time
import urllib.parse

import grpc
import structlog

from ..core import errors
from ..core.settings import default

log = structlog.get_logger("ferrum_service.hosting.kv_peers")

#: Metadata key carrying the caller's identity on a pull (honoured only with a peer token).
CALLER_HEADER = "x-ferrum-kv-caller"
#: Open channels to peers kept at most (least recently used closed first).
MAX_CHANNELS = 16
# The codes of a peer's refusal that are about the request itself, passed on as they are; any
# other code (the peer is down, refused our credentials, failed) reaches the caller as UNAVAILABLE.
_PASSED_ON = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
              grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED}
# Seconds a peer name's resolved addresses are trusted before they are looked up again.
_RESOLVE_TTL_S = 5.0
_TARGET = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252}))?:(\d{1,5})$")


def normalize_target(target: str) -> str | None:
    """``HOST:PORT`` (host lower-cased), or None when ``target`` is anything else."""
    m = _TARGET.match(target.strip())
    if m is None or not m.group(1) or not 0 < int(m.group(2)) < 65536:
        return None
    return f"{m.group(1).lower()}:{int(m.group(2))}"


def normalize_peer(peer: str) -> str | None:
    """A ``--kv-peer`` value normalised: ``HOST:PORT`` as :func:`normalize_target`, ``HOST:LO-HI``
    (a range of ports of one host) or ``HOST:*`` (every port of one host); None for anything else."""
    host, sep, port = peer.strip().rpartition(":")
    if sep and port == "*":
        t = normalize_target(f"{host}:1")
        return None if t is None else t.rsplit(":", 1)[0] + ":*"
    lo, dash, hi = port.partition("-")
    if sep and dash:
        a, b = normalize_target(f"{host}:{lo}"), normalize_target(f"{host}:{hi}")
        if a is None or b is None or int(lo) > int(hi):
            return None
        return f"{a}-{int(hi)}"
    return normalize_target(peer)


def _ip(host: str) -> str | None:
    """``host`` as a normalised IP address, or None when it is a name."""
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return None


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


class KvPeers:
    """The operator's peer list and pull credentials (one per server)."""

    def __init__(self, peers=(), tokens=(), *, ca: str | None = None, cert: str | None = None,
                 key: str | None = None, max_message_bytes: int = default("max_message_bytes")) -> None:
        """``peers``: HOST:PORT targets (ValueError for anything else); ``tokens``: the peer tokens
        (the first is sent to peers, all are accepted from them); ``ca`` / ``cert`` / ``key``: PEM
        files for TLS to peers (any of them turns TLS on for every pull)."""
        self.targets: set[str] = set()
        self.any_port: set[str] = set()  # HOST:* peers: every port of that host (servers on one machine)
        self.port_ranges: dict[str, list[tuple[int, int]]] = {}  # HOST:LO-HI peers
        for p in peers:
            t = normalize_peer(p)
            if t is None:
                raise ValueError(f"--kv-peer {p!r}: expected HOST:PORT, HOST:LO-HI or HOST:* (unix sockets and URIs "
                                 "are not peers)")
            host, _, port = t.rpartition(":")
            if port == "*":
                self.any_port.add(host)
            elif "-" in port:
                lo, hi = port.split("-")
                self.port_ranges.setdefault(host, []).append((int(lo), int(hi)))
            else:
                self.targets.add(t)
        tokens = [t.strip() for t in tokens if t and t.strip()]
        self._send = tokens[0] if tokens else ""
        self._accept = tokens
        if bool(cert) != bool(key):
            raise ValueError("--kv-peer-cert and --kv-peer-key go together")
        self._ca, self._cert, self._key = _read(ca), _read(cert), _read(key)
        self.tls = bool(ca or cert)
        self.max_message_bytes = max_message_bytes
        self._channels: collections.OrderedDict[tuple[str, bool], grpc.aio.Channel] = collections.OrderedDict()
        self._closing: set[asyncio.Task] = set()
        # Peers named by DNS name: (name, port); their addresses, looked up at most every few seconds.
        self._named = [tuple(t.rsplit(":", 1)) for t in self.targets if _ip(t.rsplit(":", 1)[0]) is None]
        self._resolved: dict[tuple[str, str], tuple[float, set[str]]] = {}

    # ---- the pulling side -----------------------------------------------------------------------
    async def check(self, target: str) -> str:
        """``target`` normalised when it is a configured peer (or an address of a peer's DNS name
        now); PERMISSION_DENIED, nothing dialled, otherwise."""
        t = normalize_target(target)
        if t is not None and (t in self.targets or self._in_range(t) or await self._resolves_to(t)):
            return t
        if t is not None and t.rsplit(":", 1)[0] in self.any_port:
            if self._send and not self.tls:
                # any process on that host could listen there: the peer token goes only over TLS
                raise errors.FerrumError(
                    errors.ErrorKind.PERMISSION_DENIED,
                    "source.target matches only a HOST:* peer, and this server sends its peer token to such a "
                    "peer only over TLS (--kv-peer-ca); its operator can name the port or a port range "
                    "(--kv-peer HOST:LO-HI)", field="source.target")
            return t
        raise errors.FerrumError(
            errors.ErrorKind.PERMISSION_DENIED,
            "source.target is not a KV peer of this server: it pulls only from the peers its operator "
            "configured (--kv-peer)", field="source.target")

    def _in_range(self, target: str) -> bool:
        host, port = target.rsplit(":", 1)
        return any(lo <= int(port) <= hi for lo, hi in self.port_ranges.get(host, ()))

    async def _resolves_to(self, target: str) -> bool:
        host, port = target.rsplit(":", 1)
        ip = _ip(host)
        if ip is None:
            return False
        for name, p in self._named:
            if p == port and ip in await self._addresses(name, p):
                return True
        return False

    async def _addresses(self, name: str, port: str) -> set[str]:
        now = time.monotonic()
        hit = self._resolved.get((name, port))
        if hit is not None and hit[0] > now:
            return hit[1]
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(name, int(port), type=socket.SOCK_STREAM)
            addrs = {str(ipaddress.ip_address(i[4][0].split("%")[0])) for i in infos}
        except (OSError, ValueError):
            addrs = set()
        self._resolved[(name, port)] = (now + _RESOLVE_TTL_S, addrs)
        return addrs

    def metadata(self, caller: str) -> tuple[tuple[str, str], ...]:
        """What a pull sends: this server's peer token and the caller's identity; never the
        caller's own credentials."""
        md: list[tuple[str, str]] = []
        if self._send:
            md.append(("authorization", f"Bearer {self._send}"))
            if caller:
                md.append((CALLER_HEADER, urllib.parse.quote(caller, safe="")))
        return tuple(md)

    def channel(self, target: str, tls: bool) -> grpc.aio.Channel:
        """An open channel to peer ``target`` (TLS when the operator configured it or the caller
        asked for it); the least recently used one is closed past :data:`MAX_CHANNELS`."""
        use_tls = self.tls or tls
        k = (target, use_tls)
        ch = self._channels.get(k)
        if ch is not None:
            self._channels.move_to_end(k)
            return ch
        # A subchannel pool of its own: gRPC shares subchannels process-wide by address, and one
        # left in reconnect back-off by an earlier peer on the same HOST:PORT (a restarted peer, or
        # another server in this process) would fail this channel's first calls without dialling.
        opts = [("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.use_local_subchannel_pool", 1)]
        if use_tls:
            creds = grpc.ssl_channel_credentials(root_certificates=self._ca, private_key=self._key,
                                                 certificate_chain=self._cert)
            ch = grpc.aio.secure_channel(target, creds, options=opts)
        else:
            ch = grpc.aio.insecure_channel(target, options=opts)
        self._channels[k] = ch
        while len(self._channels) > MAX_CHANNELS:
            _, old = self._channels.popitem(last=False)
            task = asyncio.ensure_future(old.close(grace=30.0))  # pulls in flight on it may finish
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return ch

    @property
    def open_channels(self) -> int:
        return len(self._channels)

    def refused(self, target: str, cache_id: str, e: grpc.aio.AioRpcError) -> errors.FerrumError:
        """A peer's refusal as the caller sees it: the code class, no remote text (logged here)."""
        log.warning("kv pull failed", target=target, cache_id=cache_id, code=e.code().name, details=e.details())
        code = e.code() if e.code() in _PASSED_ON else grpc.StatusCode.UNAVAILABLE
        return errors.FerrumError(
            errors.ErrorKind.NETWORK, f"source: ExportKv of {cache_id!r} on KV peer {target} failed "
            f"({code.name}); the details are in this server's log", code=code, field="source")

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        if self._closing:
            await asyncio.gather(*list(self._closing), return_exceptions=True)

    # ---- the exporting side ---------------------------------------------------------------------
    def is_peer_token(self, token: str) -> bool:
        return bool(token) and any(hmac.compare_digest(token.encode(), t.encode()) for t in self._accept)

    def on_behalf(self, metadata) -> str | None:
        """The caller a peer's ``ExportKv`` is made for: the identity it carries when the call
        authenticates with one of this server's peer tokens; None for any other call."""
        token = caller = None
        for k, v in metadata or ():
            if k == "authorization" and isinstance(v, str) and v.lower().startswith("bearer "):
                token = v[7:].strip()
            elif k == CALLER_HEADER and isinstance(v, str):
                caller = urllib.parse.unquote(v)
        if token is None or not self.is_peer_token(token):
            return None
        return caller or ""


__all__ = ["CALLER_HEADER", "KvPeers", "MAX_CHANNELS", "normalize_target"]
