"""Live migration of ``Generate`` streams between servers (``MigrateStreams``, ``AcceptMigration``,
``GenerateRequest.resume_token``, ``--drain-to``).

Design: the caller follows the stream. Server A stops a stream at a step boundary (right after a
token event was sent, before the next step is queued: the cache then holds the prompt and every
generated token but the last), and calls ``AcceptMigration`` on server B with the stream's decode
state: its original request (sampling with its seed, stop conditions, adapter, salt, output
options), the tokens generated so far and where its constraint started. B pulls the cache's KV
from A through the ordinary server pull (``ImportKv`` with a ``source``: checksummed, all or
nothing, admitted up front with the stream's remaining budget reserved), and parks it under a
fresh resume token. Only then does A end the stream with ``GenerateMigrated{target, resume_token}``
and free its cache; the client calls ``Generate{resume_token}`` on B, which feeds the last token
and goes on. Nothing of the sampler needs moving: a seeded draw at position ``p`` uses
``seed + p`` and the repetition penalty reads the cache's tokens (``sampling.py``), and both are
the same in the imported cache; the constraint's matcher replays the cache's tokens from its start
(``guided.py``).

Failure: any refusal by B (no room, another model or fingerprint, adapter missing, not a peer,
a pull that breaks off) reaches A before it sent anything, and the stream goes on at A. An
import that fails leaves nothing on B (``kv_transfer.py``); a stream B parked but nobody resumes
(A died after B took it, the caller went away) is dropped after ``resume_s`` and its cache freed.
A token event is sent once: A's last one before ``migrated``, B's first after the resume.

Trust (``kv_peers.py`` unchanged): A dials only its configured peers, with its own peer token, on
the stream's caller's behalf; B accepts only calls that carry one of its peer tokens and pulls only
from its configured peers. A resume token is 192 random bits, single use, bound to the caller that
started the stream (another caller's resume is NOT_FOUND, and does not burn the token).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import secrets
import time
from typing import TYPE_CHECKING

import grpc
import structlog
from ferrum_client._proto.ferrum.executor.v1 import executor_pb2_grpc

from ..core import errors
from ..core.callers import current_caller
from ..core.modes import CacheEvent
from ..core.settings import default
from .convert import check_tokens, pb, sampling_params

if TYPE_CHECKING:
    from ..hosting.kv_peers import KvPeers
    from ..hosting.models import ModelSet
    from .kv_transfer import KvTransfer
    from .streams import StreamRegistry
    from .validate import RequestChecks

log = structlog.get_logger("ferrum_service.wire.migration")

#: Seconds B holds a migrated stream for its caller's resume.
DEFAULT_RESUME_S = default("migration_resume_s")
#: Streams parked for a resume at once (each holds its KV): further hand-offs are RESOURCE_EXHAUSTED.
MAX_PARKED = 256
#: Seconds A waits for B to take a stream (pull included) before the stream goes on at A.
HANDOFF_TIMEOUT_S = 60.0
#: Seconds ``MigrateStreams`` waits for its streams to reach a step boundary and be handed off.
MIGRATE_WAIT_S = 120.0


@dataclasses.dataclass
class Parked:
    """A stream B took over, waiting for its caller."""

    model_id: str
    cache_id: str
    caller: str
    request: pb.GenerateRequest
    generated: list[int]
    prompt_tokens: int
    constraint_start: int
    expires: float
    timer: asyncio.TimerHandle | None = None
    adopted: bool = False  # a resumed stream took the cache (and frees it at its end)

    def resume_request(self) -> pb.GenerateRequest:
        """The stream's request as this server continues it: its cache, the last token fed first."""
        r = pb.GenerateRequest()
        r.CopyFrom(self.request)
        r.cache_id, r.last_token_id = self.cache_id, self.generated[-1]
        return r


class Migrations:
    """Both sides of stream migration on one server."""

    def __init__(self, models: "ModelSet", checks: "RequestChecks", kv: "KvTransfer", peers: "KvPeers",
                 streams: "StreamRegistry", advertise: str = "", resume_s: float = DEFAULT_RESUME_S) -> None:
        self.models = models
        self.checks = checks
        self.kv = kv
        self.peers = peers
        self.streams = streams
        self.advertise = advertise  # HOST:PORT peers pull this server's KV from
        self.resume_s = resume_s
        self.parked: dict[str, Parked] = {}
        self.draining = False  # MigrateStreams(drain) or --drain-to: no new work
        self.max_parked = MAX_PARKED

    # ---- the moving side (A) --------------------------------------------------------------------
    async def migrate(self, target: str, *, model_id: str = "", request_id: str = "",
                      wait_s: float = MIGRATE_WAIT_S) -> list[pb.StreamMigration]:
        """Ask every matching running stream to move to ``target`` at its next step boundary and
        wait for the outcomes (a stream not answered in ``wait_s`` is reported DEADLINE_EXCEEDED
        and, if its move has not begun, stays here)."""
        t = await self.peers.check(target)
        if model_id:
            self.models.get(model_id)
        loop = asyncio.get_running_loop()
        asks: list[tuple[object, asyncio.Future]] = []
        out: list[pb.StreamMigration] = []
        for st in list(self.streams.generations.values()):
            if (model_id and st.model_id != model_id) or (request_id and st.request_id != request_id):
                continue
            res = pb.StreamMigration(request_id=st.request_id, model_id=st.model_id)
            if st.move_to or (st.move_result is not None and not st.move_result.done()):
                res.error_code, res.error_message = "ALREADY_EXISTS", "a move of this stream is under way"
                out.append(res)
                continue
            if st.unmovable:
                res.error_code, res.error_message = "FAILED_PRECONDITION", st.unmovable
                out.append(res)
                continue
            st.move_result = loop.create_future()
            st.move_to = t
            asks.append((st, st.move_result))
        if asks:
            await asyncio.wait([f for _, f in asks], timeout=wait_s)
        for st, fut in asks:
            res = pb.StreamMigration(request_id=st.request_id, model_id=st.model_id)
            if not fut.done():
                st.move_to = ""  # not begun yet: it stays (a hand-off under way finishes on its own)
                res.error_code, res.error_message = "DEADLINE_EXCEEDED", "the stream reached no step boundary in time"
            elif isinstance(fut.result(), errors.FerrumError):
                e = fut.result()
                res.error_code, res.error_message = e.code.name, e.message
            else:
                res.migrated = True
                res.handoff_ms = int(fut.result())
            out.append(res)
        log.info("streams migrated", target=t, migrated=sum(r.migrated for r in out),
                 refused=sum(not r.migrated for r in out))
        return out

    async def hand_off(self, host, req: pb.GenerateRequest, cache_id: str, generated: list[int],
                       prompt_tokens: int, constraint_start: int, caller: str, target: str) -> pb.GenerateMigrated:
        """Give one paused stream to ``target`` (its ``AcceptMigration``); the refusal as a
        FerrumError (the stream then goes on here)."""
        t = await self.peers.check(target)
        if not self.advertise:
            raise errors.failed_precondition("this server has no address peers can pull from (--advertise-address)")
        orig = pb.GenerateRequest()
        orig.CopyFrom(req)
        for f in ("token_ids", "text", "chat", "cache_id", "last_token_id", "resume_token"):
            orig.ClearField(f)
        msg = pb.AcceptMigrationRequest(
            model_id=host.model_id, request=orig, generated_token_ids=generated, prompt_tokens=prompt_tokens,
            constraint_start=constraint_start,
            source=pb.KvSource(target=self.advertise, cache_id=cache_id, model_id=host.model_id))
        stub = executor_pb2_grpc.ModelExecutorStub(self.peers.channel(t, False))
        try:
            resp = await stub.AcceptMigration(msg, metadata=self.peers.metadata(caller), timeout=HANDOFF_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.warning("migration refused", target=t, cache_id=cache_id, code=e.code().name, details=e.details())
            raise errors.FerrumError(
                errors.ErrorKind.NETWORK, f"peer {t} did not take the stream ({e.code().name}: {e.details()}); "
                "it goes on here", code=e.code() if e.code() != grpc.StatusCode.OK else grpc.StatusCode.UNKNOWN,
                field="target") from None
        return pb.GenerateMigrated(target=t, resume_token=resp.resume_token, generated_tokens=len(generated),
                                   resume_deadline_ms=resp.resume_deadline_ms)

    # ---- the taking side (B) --------------------------------------------------------------------
    async def accept(self, req: pb.AcceptMigrationRequest, metadata) -> pb.AcceptMigrationResponse:
        caller = self.peers.on_behalf(metadata)
        if caller is None:
            raise errors.permission_denied(
                "AcceptMigration is for KV peers: authenticate with one of this server's KV peer tokens")
        current_caller.set(caller)
        if self.draining:
            raise errors.unavailable("this server drains; it takes no migrated streams")
        if len(self.parked) >= self.max_parked:
            raise errors.exhausted(f"{self.max_parked} migrated streams already wait for their callers")
        self.checks.check_decode_role("AcceptMigration")  # a prefill server decodes no stream
        host = self.models.get(req.model_id)
        orig = req.request
        gen = check_tokens(req.generated_token_ids, host.vocab_size, "generated_token_ids")
        if not gen:
            raise errors.invalid("generated_token_ids is empty: a stream moves after its first token",
                                 field="generated_token_ids")
        if orig.n > 1 or orig.keep_cache or orig.resume_token:
            raise errors.invalid("only a single-sample stream that frees its cache moves", field="request")
        max_tokens = int(orig.stop.max_tokens) or DEFAULT_MAX_TOKENS
        if len(gen) >= max_tokens:
            raise errors.invalid("the stream has no budget left", field="generated_token_ids")
        sp = sampling_params(orig.sampling, host.vocab_size, "request.sampling")
        self.checks.guide(host, sp, "request.sampling.constraint")
        check_tokens(orig.stop.stop_token_ids, host.vocab_size, "request.stop.stop_token_ids", allow_empty=True)
        if orig.stop.stop_sequences and host.executor.tokenizer is None:
            raise errors.failed_precondition("stop.stop_sequences needs a tokenizer", field="request.stop")
        if orig.adapter:
            self.checks.adapter(host, orig.adapter, "request.adapter")
        await self.checks.compile(host, [(sp, "request.sampling.constraint")])
        n_cache = int(req.prompt_tokens) + len(gen) - 1
        reserve = int(req.prompt_tokens) + max_tokens
        self.checks.check_length(host, reserve, "request.stop.max_tokens")
        src = pb.KvSource()
        src.CopyFrom(req.source)
        src.from_token, src.to_token = 0, 0

        async def one():
            yield pb.ImportKvRequest(model_id=host.model_id, reserve_tokens=reserve, cache_salt=orig.cache_salt,
                                     source=src)

        imp = await self.kv.import_(one(), None)
        cache_id = imp.cache.cache_id
        entry = host.executor.registry.get(cache_id)
        if entry.num_tokens != n_cache or (len(gen) > 1 and list(entry.tokens[-(len(gen) - 1):]) != gen[:-1]):
            host.release_soon(cache_id, CacheEvent.RECLAIMED)
            raise errors.failed_precondition(
                f"the pulled cache holds {entry.num_tokens} tokens that are not the stream's prompt and generated "
                f"tokens ({n_cache})", field="source.cache_id")
        token = secrets.token_urlsafe(24)
        loop = asyncio.get_running_loop()
        p = Parked(host.model_id, cache_id, caller, orig, gen, int(req.prompt_tokens), int(req.constraint_start),
                   time.monotonic() + self.resume_s)
        p.timer = loop.call_later(self.resume_s, self._expire, token)
        self.parked[token] = p
        log.info("migrated stream parked", model_id=host.model_id, cache_id=cache_id, generated=len(gen),
                 imported_tokens=imp.imported_tokens)
        return pb.AcceptMigrationResponse(resume_token=token, imported_tokens=imp.imported_tokens,
                                          resume_deadline_ms=int(self.resume_s * 1000))

    def _expire(self, token: str) -> None:
        p = self.parked.pop(token, None)
        if p is not None:
            log.info("migrated stream not resumed; dropped", cache_id=p.cache_id)
            self.models.get(p.model_id).release_soon(p.cache_id, CacheEvent.RECLAIMED)

    def take(self, token: str, model_id: str) -> Parked:
        """The parked stream of ``token`` for the current caller (single use); NOT_FOUND for any
        other token, another caller's, an expired one, or one of another model."""
        p = self.parked.get(token)
        if (p is None or not hmac.compare_digest(p.caller.encode(), current_caller.get().encode())
                or (model_id and model_id != p.model_id) or p.expires < time.monotonic()):
            raise errors.not_found("resume_token: no migrated stream of this caller waits under that token",
                                   field="resume_token")
        del self.parked[token]
        if p.timer is not None:
            p.timer.cancel()
        return p

    def close(self) -> None:
        for token in list(self.parked):
            self._expire(token)


DEFAULT_MAX_TOKENS = 128  # as generate.DEFAULT_MAX_TOKENS (imported there; kept here to avoid a cycle)

__all__ = ["Migrations", "Parked", "DEFAULT_RESUME_S"]
