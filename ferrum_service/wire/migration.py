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
and free its cache; the client calls ``Generate{resume_token}`` on B, which sends the token of
the step feeding the last token (run as soon as B parked the stream, while the caller reconnects)
and goes on. Nothing of the sampler needs moving: a seeded draw at position ``p`` uses
``seed + p`` and the repetition penalty reads the cache's tokens (``sampling.py``), and both are
the same in the imported cache; the constraint's matcher replays the cache's tokens from its start
(``guided.py``).

Pre-copy (the pause without the bulk of the KV): when the stream's cache holds at least
``precopy_tokens`` tokens (tensor layouts only), A first asks B for a pre-copy
(``AcceptMigration{precopy}``, source range [0, k) with k the cache's full blocks then) and goes on
decoding while B pulls those k tokens into a staged import (``KvTransfer.stage_pull``: admitted with
the stream's whole reservation, private, no cache, not resumable, dropped after ``resume_s``). At
the first step boundary after B answered, A pauses as above and asks B to finish
(``AcceptMigration{precopy_id}``, source from token k): B pulls only the tail, the tokens decoded
meanwhile (``extend_pull``: the executor's ``import_extend`` then the usual writes), commits and
parks. Nothing writes A's full blocks while B reads them (a decode writes past the cache's last
token, and copies on write only the block it writes into; ``ExportKv`` holds the cache, so nothing
frees it under the read). The pre-copy's export is paced against the model's steps
(``kv_export_pacing.py``): the stream's mover marks its cache in the ``ExportPacing`` registry this
object owns (``KvTransfer`` reads it) until B answers, the stream ends or the move is called off,
and meanwhile A exports at most ``PACED_EXPORT_BYTES_PER_STEP`` (at least a layer) per step, so the
export's CPU does not stall the stream it copies; the tail pull in the pause is never paced. While
a move is under way the worker runs no decode step ahead of the stream (``HeldDecode.chain``
false): each boundary settles the cache, which would undo that step and run it again. A step the
worker had already run ahead when a move that pre-copies is asked is kept (the stream's next step
takes it) and the pre-copy starts one boundary later (``Generation._pauses``).

A pre-copy B holds is used once, by the caller and source it was made for; a stream that ends on A
(or a move called off) with a pre-copy made sends ``abandon`` (and B drops it after ``resume_s``
anyway); a pre-copy that B refuses, or a finish that fails, leaves the stream on A and nothing on B.

Failure: any refusal by B (no room, another model or fingerprint, adapter missing, not a peer,
a pull that breaks off) reaches A before it sent anything, and the stream goes on at A. An
import that fails leaves nothing on B (``kv_transfer.py``); a stream B parked but nobody resumes
(A died after B took it, the caller went away) is dropped after ``resume_s`` and its cache freed.
A token event is sent once: A's last one before ``migrated``, B's first after the resume.

Relay mode (``GenerateRequest.migration_mode = MIGRATION_MODE_RELAY``, and every vLLM-protocol
stream, whose callers cannot follow ``GenerateMigrated``): the move is the same, with
``AcceptMigration{relay}``; then A, instead of ending the stream, frees its cache and resumes it on
B itself (``Generate{resume_token}`` with its peer token, on the caller's behalf: :meth:`migration_relay.Relays.events`)
and sends B's token and finished events on the caller's stream as its own (``generate.py``,
``Generation._relay``). B's first token is the step after A's last, so nothing repeats or goes
missing. A relay-parked stream is taken only by a peer-authenticated ``Generate`` for its caller,
and a peer token opens ``Generate`` for nothing else (``servicer.py``); ``Abort`` and the caller's
cancel cancel the call to B; at most ``migration_relay.MAX_RELAYS`` relays run at once (a move past it is
refused before it starts).

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

from ..core import errors, speculation
from ..core.callers import current_caller
from ..core.guided import GuideState, new_matcher
from ..core.modes import CacheEvent
from ..core.serving_state import ServingState
from ..core.settings import default
from ..core.stop_conditions import MAX_STOP_TOKEN_IDS, StopStrings, check_stop_sequences
from ..core.types import LogitsPolicy, OutputMode, SamplingParams
from ..executors.base import ModelExecutor
from ..hosting.batcher import HeldDecode
from ..hosting.kv_peers import normalize_target
from .convert import check_tokens, pb, sampling_params
from .generate_spec import DEFAULT_MAX_TOKENS, GenerateSpec, Resume, Stops
from .kv_export_pacing import ExportPacing
from .migration_relay import Relays
from .validate import RequestChecks

if TYPE_CHECKING:
    from ..hosting.kv_peers import KvPeers
    from ..hosting.models import ModelSet
    from .kv_transfer import KvTransfer, StagedKv
    from .streams import StreamRegistry

log = structlog.get_logger("ferrum_service.wire.migration")

#: Seconds B holds a migrated stream for its caller's resume.
DEFAULT_RESUME_S = default("migration_resume_s")
#: Streams parked for a resume at once (each holds its KV): further hand-offs are RESOURCE_EXHAUSTED.
MAX_PARKED = 256
#: Seconds A waits for B to take a stream (pull included) before the stream goes on at A.
HANDOFF_TIMEOUT_S = 60.0
#: Seconds ``MigrateStreams`` waits for its streams to reach a step boundary and be handed off.
MIGRATE_WAIT_S = 120.0
#: A stream whose cache holds this many tokens is pre-copied to its target before it pauses.
DEFAULT_PRECOPY_TOKENS = 256
#: Pre-copies B stages at once (each holds a stream's reserved KV): further ones are RESOURCE_EXHAUSTED.
MAX_PRECOPIES = 64
#: Seconds A waits for B to answer an ``abandon``.
ABANDON_TIMEOUT_S = 10.0


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
    cache_tokens: int = 0  # what the cache held when it was parked
    # The step that feeds the last token, run when the stream was parked (its row: the first token
    # the resumed stream sends), so that it does not wait on the caller's reconnection.
    first: "asyncio.Future | None" = None
    sampling: SamplingParams | None = None  # the request's sampling, checked and compiled when it was taken
    relay: bool = False  # taken only by a peer resuming it on the caller's behalf (AcceptMigration.relay)

    def policy(self) -> LogitsPolicy:
        return LogitsPolicy(mode=OutputMode.SAMPLED_TOKEN, sampling=self.sampling,
                            top_logprobs=int(self.request.top_logprobs))

    def resume_spec(self, host) -> GenerateSpec:
        """The stream as this server goes on with it: its cache, the last token fed first. Built
        from what :meth:`Migrations.accept` checked when it took the stream (not checked again)."""
        r = self.request
        policy = self.policy()
        stops = Stops(max_tokens=int(r.stop.max_tokens) or DEFAULT_MAX_TOKENS, token_ids=frozenset(r.stop.stop_token_ids),
                      eos_ids=RequestChecks.eos_ids(host, r.stop.ignore_eos), sequences=tuple(r.stop.stop_sequences),
                      strings=StopStrings(r.stop.stop_sequences) if r.stop.stop_sequences else None)
        draft = RequestChecks.speculation(host, policy, speculation.request_config(r, host.speculation_default))
        resume = Resume(tuple(self.generated), self.prompt_tokens, self.cache_tokens, self.constraint_start, self.first)
        return GenerateSpec(host, r.request_id, (), host.executor.registry.get(self.cache_id, "resume_token"), policy,
                            stops, last_token=self.generated[-1], salt=RequestChecks.salt(r.cache_salt, "cache_salt"),
                            adapter=r.adapter, bypass_prefix_cache=r.bypass_prefix_cache, speculation=draft,
                            stream_text=r.stream_text, resume=resume, request=r)


@dataclasses.dataclass
class PreCopy:
    """A pre-copy B staged for a move still to come (no cache until the move finishes it)."""

    model_id: str
    caller: str
    source: tuple[str, str]  # (A as B dialled it, the stream's cache there)
    reserve: int
    salt: str
    adapter: str
    staged: "StagedKv"
    timer: asyncio.TimerHandle | None = None


@dataclasses.dataclass
class PreCopied:
    """A's view of a pre-copy its target holds."""

    target: str
    precopy_id: str
    tokens: int
    nbytes: int


@dataclasses.dataclass
class MoveReport:
    """A move's outcome on A (``StreamMigration``)."""

    handoff_ms: float
    precopied_tokens: int = 0
    paused_tokens: int = 0
    paused_bytes: int = 0


class StreamMover:
    """The moving side (A) of one stream, consulted by its decode loop at each step boundary.
    Asked to move (``state.move_to``), it has the target pre-copy the stream's KV while the stream
    goes on (when :meth:`Migrations.can_precopy`), and pauses it once the pre-copy is answered (at
    once without one); :meth:`hand_off` then moves it with only the tail left to pull."""

    def __init__(self, migrations: "Migrations", host, req: pb.GenerateRequest, state, constrained: bool) -> None:
        self.migrations = migrations
        self.host = host
        self.req = req
        self.state = state
        self.constrained = constrained
        self.task: asyncio.Task | None = None  # the pre-copy (a PreCopied, or the refusal)
        self.target = ""
        self.paced = ""  # the cache whose pre-copy export is paced (kv_export_pacing.py), until answered
        # Relay mode: the stream goes on on the caller's stream, this server relaying the target's events.
        self.relay = req.migration_mode == pb.MIGRATION_MODE_RELAY

    def _decode_state(self, s) -> tuple[int, int, int]:
        """(tokens the cache holds, the prompt's length, where the constraint started)."""
        entry = self.host.executor.registry.get(s.cache_id)
        start = entry.guide.start if entry.guide is not None and self.constrained else 0
        return entry.num_tokens, entry.num_tokens - (len(s.out_ids) - 1), start

    def will_precopy(self, s) -> bool:
        """Whether the move asked for would start with a pre-copy (none started yet; the cache
        long enough: read from the registry, so within a token of what the stream fed)."""
        return self.task is None and self.migrations.can_precopy(
            self.host, self.host.executor.registry.get(s.cache_id).num_tokens)

    def pause_now(self, s) -> bool:
        """Whether the stream pauses at this boundary (no step of it queued) for :meth:`hand_off`;
        starts the pre-copy the first time a move is asked for."""
        st = self.state
        if self.task is not None and st.move_to != self.target:  # the move was called off meanwhile
            self.close()
            st.answer_move(errors.FerrumError(errors.ErrorKind.CANCELLED, "the move was called off during its "
                                              "pre-copy", code=grpc.StatusCode.DEADLINE_EXCEEDED))
        if not st.move_to:
            return False
        if self.task is None and self.relay and not self.migrations.relays.room():
            st.answer_move(self.migrations.relays.full())
            return False
        if self.task is None:
            n, prompt, start = self._decode_state(s)
            # Full blocks only: the stream's next writes (and a copy-on-write of the block they go
            # to) never touch them while the target reads them.
            bs = max(1, self.host.executor.block_size)
            upto = n - n % bs
            if not upto or not self.migrations.can_precopy(self.host, n):
                return True
            self.target = st.move_to
            # the stream decodes on while its KV is exported: that export is paced (until answered)
            self.paced = s.cache_id
            self.migrations.pacing.start(self.host.model_id, s.cache_id)
            self.task = asyncio.ensure_future(self._precopy(s.cache_id, list(s.out_ids), prompt, start, upto))
            self.task.add_done_callback(lambda t: t.cancelled() or t.exception())
            return False
        return self.task.done()

    async def _precopy(self, cache_id: str, generated: list[int], prompt: int, start: int, upto: int) -> "PreCopied":
        """The pre-copy, its export paced until it is answered (unpaced before the task is done:
        the tail pulled in the pause is not paced)."""
        st = self.state
        try:
            return await self.migrations.precopy(self.host, self.req, cache_id, generated, prompt, start, st.tenant,
                                                 self.target, upto)
        finally:
            self._unpace()

    def _unpace(self) -> None:
        if self.paced:
            self.migrations.pacing.stop(self.host.model_id, self.paced)
            self.paced = ""

    async def hand_off(self, s) -> pb.GenerateMigrated | None:
        """Hand the paused stream over; None (the move answered with the refusal) if it stays here."""
        t0 = time.perf_counter_ns()
        st = self.state
        held = False  # the relay slot this move took (given back unless it succeeds)
        try:
            pre = None
            if self.task is not None:
                task, self.task = self.task, None
                pre = task.result()  # a refused pre-copy is the move's refusal
            if self.relay:
                self.migrations.relays.take()  # given back when the relay ends (Relays.events)
                held = True
            _n, prompt, start = self._decode_state(s)
            moved, rep = await self.migrations.hand_off(self.host, self.req, s.cache_id, list(s.out_ids), prompt,
                                                        start, st.tenant, st.move_to, pre, relay=self.relay)
        except BaseException as e:
            if held:
                self.migrations.relays.give_back()
            if isinstance(e, errors.FerrumError):
                st.answer_move(e)
                return None
            if not isinstance(e, Exception):
                raise
            # whatever failed, the stream goes on here
            st.answer_move(errors.FerrumError(errors.ErrorKind.INTERNAL, f"the hand-off failed: {e!r}",
                                              code=grpc.StatusCode.INTERNAL))
            return None
        rep.handoff_ms = (time.perf_counter_ns() - t0) / 1e6
        st.answer_move(rep)
        return moved

    def close(self) -> None:
        """The stream ended (or its move was called off) with a pre-copy no move will finish: have
        the target drop it, once it answered if its pull is still under way (cancelling the call
        could lose an answer the target already gave, and leave the staged KV to its deadline).
        The pre-copy's export, if still under way, goes on unpaced."""
        self._unpace()
        task, self.task = self.task, None
        if task is None:
            return
        m, model_id, cache_id, caller = self.migrations, self.host.model_id, self.state.cache_id, self.state.tenant

        def abandon(t: asyncio.Task) -> None:
            if not t.cancelled() and t.exception() is None:
                m.abandon(t.result(), model_id, cache_id, caller)

        task.add_done_callback(abandon)


class Migrations:
    """Both sides of stream migration on one server."""

    def __init__(self, models: "ModelSet", checks: "RequestChecks", kv: "KvTransfer", peers: "KvPeers",
                 streams: "StreamRegistry", advertise: str = "", resume_s: float = DEFAULT_RESUME_S,
                 precopy_tokens: int = DEFAULT_PRECOPY_TOKENS, serving: ServingState | None = None,
                 pacing: ExportPacing | None = None) -> None:
        """``serving``: the server's drain flags (this object sets ``migrating``); ``pacing``: where
        the streams pre-copied from here are marked while they decode (the registry ``kv`` reads to
        pace their exports: the server hands both the same one)."""
        self.models = models
        self.checks = checks
        self.kv = kv
        self.peers = peers
        self.streams = streams
        self.advertise = advertise  # HOST:PORT peers pull this server's KV from
        self.resume_s = resume_s
        self.parked: dict[str, Parked] = {}
        self.serving = serving if serving is not None else ServingState()  # its ``migrating``: no new work
        self.max_parked = MAX_PARKED
        self.precopy_tokens = precopy_tokens  # 0 = never pre-copy
        self.first_step = True  # run a parked stream's first step before its caller is back
        self.precopies: dict[str, PreCopy] = {}
        self.max_precopies = MAX_PRECOPIES
        self._staging = 0  # pre-copies being pulled
        self._tasks: set[asyncio.Task] = set()  # abandons in flight
        self.relays = Relays(peers)  # the streams this server relays (moved in relay mode)
        self.pacing = pacing if pacing is not None else ExportPacing()

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
                rep = fut.result()
                rep = rep if isinstance(rep, MoveReport) else MoveReport(float(rep))
                res.migrated = True
                res.handoff_ms, res.precopied_tokens = int(rep.handoff_ms), rep.precopied_tokens
                res.paused_tokens, res.paused_bytes = rep.paused_tokens, rep.paused_bytes
            out.append(res)
        log.info("streams migrated", target=t, migrated=sum(r.migrated for r in out),
                 refused=sum(not r.migrated for r in out))
        return out

    def mover(self, host, req: pb.GenerateRequest, state, constrained: bool) -> StreamMover:
        """The moving side of one stream (its decode loop consults it)."""
        return StreamMover(self, host, req, state, constrained)

    def can_precopy(self, host, cache_tokens: int) -> bool:
        """Whether a stream of ``host`` with a cache of ``cache_tokens`` tokens is pre-copied
        before it pauses (per-layer tensor KV only: a whole-state backend moves in one piece)."""
        ex = host.executor
        return (self.precopy_tokens > 0 and cache_tokens >= self.precopy_tokens and bool(self.advertise)
                and host.capabilities.supports_kv_transfer
                and type(ex).import_extend is not ModelExecutor.import_extend)

    async def _accept_call(self, target: str, msg: pb.AcceptMigrationRequest, caller: str, what: str,
                           timeout: float = HANDOFF_TIMEOUT_S) -> tuple[str, pb.AcceptMigrationResponse]:
        t = await self.peers.check(target)
        if not self.advertise:
            raise errors.failed_precondition("this server has no address peers can pull from (--advertise-address)")
        msg.source.target = self.advertise
        stub = executor_pb2_grpc.ModelExecutorStub(self.peers.channel(t, False))
        try:
            return t, await stub.AcceptMigration(msg, metadata=self.peers.metadata(caller), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            log.warning("migration refused", target=t, what=what, cache_id=msg.source.cache_id, code=e.code().name,
                        details=e.details())
            raise errors.FerrumError(
                errors.ErrorKind.NETWORK, f"peer {t} did not take the stream ({what}: {e.code().name}: "
                f"{e.details()}); it goes on here",
                code=e.code() if e.code() != grpc.StatusCode.OK else grpc.StatusCode.UNKNOWN, field="target") from None

    @staticmethod
    def _message(host, req: pb.GenerateRequest, cache_id: str, generated: list[int], prompt_tokens: int,
                 constraint_start: int) -> pb.AcceptMigrationRequest:
        orig = pb.GenerateRequest()
        orig.CopyFrom(req)
        for f in ("token_ids", "text", "chat", "cache_id", "last_token_id", "resume_token"):
            orig.ClearField(f)
        return pb.AcceptMigrationRequest(
            model_id=host.model_id, request=orig, generated_token_ids=generated, prompt_tokens=prompt_tokens,
            constraint_start=constraint_start, source=pb.KvSource(cache_id=cache_id, model_id=host.model_id))

    async def precopy(self, host, req: pb.GenerateRequest, cache_id: str, generated: list[int], prompt_tokens: int,
                      constraint_start: int, caller: str, target: str, upto: int) -> PreCopied:
        """Have ``target`` stage tokens [0, ``upto``) of the stream's cache while it goes on here;
        the refusal as a FerrumError."""
        msg = self._message(host, req, cache_id, generated, prompt_tokens, constraint_start)
        msg.precopy, msg.source.to_token = True, upto
        t, resp = await self._accept_call(target, msg, caller, "pre-copy")
        return PreCopied(t, resp.precopy_id, resp.imported_tokens, resp.imported_bytes)

    def abandon(self, pre: PreCopied, model_id: str, cache_id: str, caller: str) -> None:
        """Tell the target to drop a pre-copy no move will finish (in the background; B drops it
        after its deadline anyway)."""
        msg = pb.AcceptMigrationRequest(model_id=model_id, precopy_id=pre.precopy_id, abandon=True,
                                        source=pb.KvSource(cache_id=cache_id, model_id=model_id))

        async def run() -> None:
            try:
                await self._accept_call(pre.target, msg, caller, "abandon", ABANDON_TIMEOUT_S)
            except errors.FerrumError:
                pass  # logged; the deadline drops it

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def hand_off(self, host, req: pb.GenerateRequest, cache_id: str, generated: list[int],
                       prompt_tokens: int, constraint_start: int, caller: str, target: str,
                       pre: PreCopied | None = None, relay: bool = False) -> tuple[pb.GenerateMigrated, MoveReport]:
        """Give one paused stream to ``target`` (its ``AcceptMigration``; with ``pre``, B pulls
        only the tail after that pre-copy; with ``relay``, B parks it for this server's resume on
        the caller's behalf); the refusal as a FerrumError (the stream then goes on here). The
        report's ``handoff_ms`` is left for the caller to fill in."""
        msg = self._message(host, req, cache_id, generated, prompt_tokens, constraint_start)
        msg.relay = relay
        if pre is not None:
            msg.precopy_id, msg.source.from_token = pre.precopy_id, pre.tokens
            target = pre.target
        t, resp = await self._accept_call(target, msg, caller, "move")
        rep = MoveReport(0.0, pre.tokens if pre is not None else 0, resp.imported_tokens, resp.imported_bytes)
        return pb.GenerateMigrated(target=t, resume_token=resp.resume_token, generated_tokens=len(generated),
                                   resume_deadline_ms=resp.resume_deadline_ms), rep

    # ---- the taking side (B) --------------------------------------------------------------------
    async def accept(self, req: pb.AcceptMigrationRequest, metadata) -> pb.AcceptMigrationResponse:
        caller = self.peers.on_behalf(metadata)
        if caller is None:
            raise errors.permission_denied(
                "AcceptMigration is for KV peers: authenticate with one of this server's KV peer tokens")
        current_caller.set(caller)
        if req.abandon:
            await self._drop(self._take_precopy(req, caller))
            return pb.AcceptMigrationResponse()
        if self.serving.migrating:
            if req.precopy_id:  # no move will finish it here
                try:
                    await self._drop(self._take_precopy(req, caller))
                except errors.FerrumError:
                    pass  # not this caller's: left alone
            raise errors.unavailable("this server drains; it takes no migrated streams")
        if req.precopy:
            if req.precopy_id:
                raise errors.invalid("give either precopy or precopy_id", field="precopy_id")
            return await self._precopy(req, caller)
        pre = self._take_precopy(req, caller) if req.precopy_id else None
        try:
            return await self._accept(req, caller, pre)
        except BaseException as exc:  # used once: a finish that fails drops the staged KV
            if pre is not None:
                await self._drop(pre, exc)
            raise

    def _checked(self, req: pb.AcceptMigrationRequest):
        """The stream's request checked as this server would run it: (host, request, generated
        tokens, tokens its cache holds, tokens to reserve)."""
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
        check_tokens(orig.stop.stop_token_ids, host.vocab_size, "request.stop.stop_token_ids", allow_empty=True,
                     max_len=MAX_STOP_TOKEN_IDS)
        check_stop_sequences(orig.stop.stop_sequences, "request.stop.stop_sequences")
        if orig.stop.stop_sequences and host.executor.tokenizer is None:
            raise errors.failed_precondition("stop.stop_sequences needs a tokenizer", field="request.stop")
        if orig.adapter:
            self.checks.adapter(host, orig.adapter, "request.adapter")
        n_cache = int(req.prompt_tokens) + len(gen) - 1
        reserve = int(req.prompt_tokens) + max_tokens
        self.checks.check_length(host, reserve, "request.stop.max_tokens")
        return host, orig, gen, sp, n_cache, reserve

    async def _precopy(self, req: pb.AcceptMigrationRequest, caller: str) -> pb.AcceptMigrationResponse:
        """Stage tokens [0, source.to_token) of the stream's cache under a new pre-copy id."""
        if len(self.precopies) + self._staging >= self.max_precopies:
            raise errors.exhausted(f"{self.max_precopies} pre-copies are already staged here")
        host, orig, gen, sp, n_cache, reserve = self._checked(req)
        upto = int(req.source.to_token)
        if not 0 < upto <= n_cache:
            raise errors.invalid(f"a pre-copy stages tokens [0, source.to_token) of the {n_cache} the cache holds",
                                 field="source.to_token")
        self._staging += 1
        try:
            # compiled now: a cache hit in the pause
            await self.checks.compile(host, [(sp, "request.sampling.constraint")])
            src = pb.KvSource()
            src.CopyFrom(req.source)
            src.target = await self.peers.check(src.target)
            st = await self.kv.stage_pull(host, src, reserve, orig.cache_salt)
        finally:
            self._staging -= 1
        pid = secrets.token_urlsafe(24)
        pre = PreCopy(host.model_id, caller, (src.target, src.cache_id), reserve, orig.cache_salt, orig.adapter, st)
        # The tokens after the prompt must be the stream's generated ones.
        done = upto - int(req.prompt_tokens)
        if len(st.tokens) != upto or (done > 0 and st.tokens[-done:] != gen[:done]):
            await self._drop(pre)
            raise errors.failed_precondition(f"the pulled {len(st.tokens)} tokens are not the stream's first {upto}",
                                             field="source.cache_id")
        pre.timer = asyncio.get_running_loop().call_later(self.resume_s, self._expire_precopy, pid)
        self.precopies[pid] = pre
        log.info("migration pre-copy staged", model_id=host.model_id, tokens=upto, bytes=st.nbytes)
        return pb.AcceptMigrationResponse(precopy_id=pid, imported_tokens=upto, imported_bytes=st.nbytes,
                                          resume_deadline_ms=int(self.resume_s * 1000))

    def _take_precopy(self, req: pb.AcceptMigrationRequest, caller: str) -> PreCopy:
        """The pre-copy ``req.precopy_id`` names, taken out of the table (used once); NOT_FOUND
        unless it is this caller's, of this model, from this source."""
        p = self.precopies.get(req.precopy_id)
        source = (normalize_target(req.source.target) or "", req.source.cache_id)
        if (p is None or not hmac.compare_digest(p.caller.encode(), caller.encode())
                or (req.model_id and req.model_id != p.model_id) or source != p.source):
            raise errors.not_found("precopy_id: no pre-copy of this caller's stream is staged under that id",
                                   field="precopy_id")
        del self.precopies[req.precopy_id]
        if p.timer is not None:
            p.timer.cancel()
        return p

    def _drop(self, p: PreCopy, exc: BaseException | None = None) -> asyncio.Future:
        """Give a pre-copy's staged KV back; awaitable until it is back (a cancelled call does
        not wait: the abort runs on its own)."""
        if p.timer is not None:
            p.timer.cancel()
        task = self.kv.abort_staged(p.staged)
        if isinstance(exc, asyncio.CancelledError):
            task = None
        return asyncio.shield(task) if task is not None else _done()

    def _expire_precopy(self, pid: str) -> None:
        p = self.precopies.pop(pid, None)
        if p is not None:
            log.info("migration pre-copy not finished in time; dropped", model_id=p.model_id)
            self._drop(p)

    async def _accept(self, req: pb.AcceptMigrationRequest, caller: str,
                      pre: PreCopy | None) -> pb.AcceptMigrationResponse:
        host, orig, gen, sp, n_cache, reserve = self._checked(req)
        await self.checks.compile(host, [(sp, "request.sampling.constraint")])
        src = pb.KvSource()
        src.CopyFrom(req.source)
        if pre is None:
            src.from_token, src.to_token = 0, 0

            async def one():
                yield pb.ImportKvRequest(model_id=host.model_id, reserve_tokens=reserve, cache_salt=orig.cache_salt,
                                         source=src)

            imp = await self.kv.import_(one(), None)
            cache_id, pulled, nbytes = imp.cache.cache_id, imp.imported_tokens, imp.bytes
        else:
            if (reserve, orig.cache_salt, orig.adapter) != (pre.reserve, pre.salt, pre.adapter):
                raise errors.failed_precondition("the stream's budget, salt or adapter differ from its pre-copy's",
                                                 field="precopy_id")
            held = len(pre.staged.tokens)
            if src.from_token != held or held > n_cache:
                raise errors.invalid(f"the pre-copy holds {held} of the cache's {n_cache} tokens: source.from_token "
                                     f"must be {held}", field="source.from_token")
            src.target, src.to_token = pre.source[0], 0
            if held < n_cache:
                pulled, nbytes = await self.kv.extend_pull(pre.staged, src)
            else:
                pulled = nbytes = 0  # nothing was decoded since the pre-copy
            cache_id = (await self.kv.commit_staged(pre.staged)).cache_id
        entry = host.executor.registry.get(cache_id)
        if entry.num_tokens != n_cache or (len(gen) > 1 and list(entry.tokens[-(len(gen) - 1):]) != gen[:-1]):
            host.release_soon(cache_id, CacheEvent.RECLAIMED)
            raise errors.failed_precondition(
                f"the pulled cache holds {entry.num_tokens} tokens that are not the stream's prompt and generated "
                f"tokens ({n_cache})", field="source.cache_id")
        token = secrets.token_urlsafe(24)
        loop = asyncio.get_running_loop()
        p = Parked(host.model_id, cache_id, caller, orig, gen, int(req.prompt_tokens), int(req.constraint_start),
                   time.monotonic() + self.resume_s, cache_tokens=n_cache, sampling=sp, relay=req.relay)
        p.timer = loop.call_later(self.resume_s, self._expire, token)
        self.parked[token] = p
        if self.first_step:
            p.first = loop.create_task(self._first_step(host, p, sp))
            p.first.add_done_callback(lambda t: t.cancelled() or t.exception())
        log.info("migrated stream parked", model_id=host.model_id, cache_id=cache_id, generated=len(gen),
                 imported_tokens=pulled, imported_bytes=nbytes, precopied=len(pre.staged.tokens) - pulled if pre else 0)
        return pb.AcceptMigrationResponse(resume_token=token, imported_tokens=pulled, imported_bytes=nbytes,
                                          resume_deadline_ms=int(self.resume_s * 1000))

    @staticmethod
    async def _first_step(host, p: Parked, sp):
        """Feed the stream's last token now, as its resume would (same policy, the constraint's
        matcher from its start): a seeded draw depends on the position only, so the token is the
        one the resume would draw; the resume sends this row first (``generate.py``)."""
        entry = host.executor.registry.get(p.cache_id)
        if sp.constraint is not None:
            entry.guide = GuideState(sp.constraint, p.constraint_start, new_matcher(sp.compiled), compiled=sp.compiled)
        return await host.batcher.decode(HeldDecode(cache_id=p.cache_id, token_id=p.generated[-1], policy=p.policy(),
                                                    entry=entry))

    def _expire(self, token: str) -> None:
        p = self.parked.pop(token, None)
        if p is not None:
            log.info("migrated stream not resumed; dropped", cache_id=p.cache_id)
            self.models.get(p.model_id).release_soon(p.cache_id, CacheEvent.RECLAIMED)

    def take(self, token: str, model_id: str, relay: bool = False) -> Parked:
        """The parked stream of ``token`` for the current caller (single use); NOT_FOUND for any
        other token, another caller's, an expired one, one of another model, or one parked for the
        other kind of resume (``relay``: a peer's on the caller's behalf, else the caller's own)."""
        p = self.parked.get(token)
        if (p is None or not hmac.compare_digest(p.caller.encode(), current_caller.get().encode())
                or (model_id and model_id != p.model_id) or p.expires < time.monotonic() or p.relay != relay):
            raise errors.not_found("resume_token: no migrated stream of this caller waits under that token",
                                   field="resume_token")
        del self.parked[token]
        if p.timer is not None:
            p.timer.cancel()
        return p

    def start_draining(self) -> bool:
        """Take no new work from now on (MigrateStreams(drain), --drain-to); True the first time."""
        first, self.serving.migrating = not self.serving.migrating, True
        return first

    def close(self) -> None:
        self.pacing.close()
        for token in list(self.parked):
            self._expire(token)
        for pid in list(self.precopies):
            self._expire_precopy(pid)


def _done() -> asyncio.Future:
    f = asyncio.get_running_loop().create_future()
    f.set_result(None)
    return f


__all__ = ["Migrations", "MoveReport", "Parked", "PreCopy", "StreamMover", "DEFAULT_RESUME_S"]
