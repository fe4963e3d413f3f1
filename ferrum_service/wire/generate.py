"""``Generate``: the decode loop on the server, one event per token.

A request is checked once into a :class:`~ferrum_service.wire.generate_spec.GenerateSpec`
(``validate.py``; the vLLM protocol and a migration's resume build theirs) and one
:class:`Generation` runs it. The prompt goes through the model's batcher (``host.batcher.prefill``) and each later step feeds
the last token through ``host.batcher.decode``; the batcher joins the prompts and steps of all
concurrent streams of a model into batched forwards (continuous batching, see ``batcher.py``). The loop checks for
cancellation between steps; whatever ends the stream (finish, error, client cancel, deadline,
dropped connection, Abort), the ``finally`` frees the cache it created unless the caller asked to keep it: with reason ``released`` once ``GenerateFinished``
was yielded, else ``reclaimed`` (the stream ended abnormally, as a Session's caches on close).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING, AsyncIterator

import grpc

from ..core import errors, speculation
from ..core.guided import GuideState, new_matcher
from ..core.kv_registry import CacheEntry
from ..core.stop_conditions import StopStrings
from ..core.types import LogitsPolicy, PrefillInput
from ..hosting.batcher import HeldDecode
from . import tracing
from .convert import handle_pb, pb
from .generate_spec import DEFAULT_MAX_TOKENS, MAX_SAMPLES, GenerateSpec
from .streams import StreamState
from .validate import RequestChecks, admit

if TYPE_CHECKING:
    from ..hosting.models import ModelSet
    from .migration import Migrations


class IncrementalDetokenizer:
    """Text pieces of a growing token sequence, each decoded from a short window of recent ids
    (not the whole output again), that concatenate to the decoded whole.

    The window starts a few tokens back (``_prefix``) so that tokenizers whose text for a token
    depends on its left neighbour (leading spaces, byte pieces) decode it in context; a piece ending
    in an incomplete UTF-8 sequence is held back until the next token completes it."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # window start
        self._read = 0  # ids before this are already in ``text``

    def push(self, t: int) -> str:
        """Add one token; the new text it completes ("" while a character is incomplete)."""
        self.ids.append(t)
        before = self.tok.decode(self.ids[self._prefix:self._read], skip_special_tokens=True)
        now = self.tok.decode(self.ids[self._prefix:], skip_special_tokens=True)
        if now.endswith("\ufffd") or len(now) <= len(before):
            return ""
        piece = now[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += piece
        return piece


# Sample i draws with seed ``seed + i * stride``. torch's CPU generator keeps only the low 32 bits
# of a seed, and a draw at position p uses ``seed + p``: with this odd stride (2^32 / golden ratio)
# the low 32 bits of two samples' seeds stay more than 2^25 apart for all 64 samples, so no two
# samples share a draw at any position below that.
_SAMPLE_SEED_STRIDE = 0x9E3779B9
_UNMOVABLE = "only a single-sample stream on a cache it created, without keep_cache, moves"


class _Sample:
    """One sample's decode loop: its cache, its policy, the tokens and text it produced."""

    def __init__(self, index: int, entry: CacheEntry, row, policy: LogitsPolicy, detok, stops: StopStrings | None
                 ) -> None:
        self.index = index
        self.entry = entry  # its cache (held here: a step is queued with it, not looked up again)
        self.cache_id = entry.cache_id
        self.row = row
        self.policy = policy
        self.detok = detok
        self.stop_cursor = stops.cursor() if stops and detok is not None else None  # where its text stands
        self.out_ids: list[int] = []
        self.generated = 0
        self.finish = pb.FINISH_REASON_UNSPECIFIED
        self.drafter: speculation.NgramDrafter | None = None  # server-side speculation (speculation.py)
        self.draft_tokens = 0
        self.accepted_drafts = 0
        self.migrated = False  # the stream moved to a peer (ended with GenerateMigrated)
        self.relayed: pb.GenerateFinished | None = None  # moved in relay mode: the target's final event
        self.chain = False  # the worker may run its next step ahead (HeldDecode.chain)

    def step(self, token: int, draft: list[int], last: bool, moving: bool = False) -> HeldDecode:
        """The decode step feeding ``token``; ``last``: it makes the sample's last token by
        ``max_tokens``, so the worker runs no step after it; ``moving``: a move of the stream is
        under way, so neither (each boundary until the pause settles the cache: a step run ahead
        would be run twice, and the stream wait for it)."""
        return HeldDecode(cache_id=self.cache_id, token_id=token, policy=self.policy, draft=draft, entry=self.entry,
                          chain=self.chain and not last and not moving)


async def generate(models: "ModelSet", checks: RequestChecks, req: pb.GenerateRequest, state: StreamState,
                   migrations: "Migrations | None" = None, relay: bool = False) -> AsyncIterator[pb.GenerateResponse]:
    """The contract's ``Generate``: ``req`` checked into a :class:`GenerateSpec` and run by a
    :class:`Generation`. With ``req.resume_token``, a stream a peer moved here goes on (its spec
    was built by this server when it took the stream: ``migration.Parked``); ``relay``: the call
    is that peer's, resuming a stream it moved in relay mode on its caller's behalf."""
    if not req.resume_token:
        host = models.get(req.model_id)
        state.bind(host.model_id, req.request_id, req.cache_id)
        spec = await checks.generate_spec(host, req)
        async for ev in Generation(spec, checks, state.owner, state, migrations).events():
            yield ev
        return
    if migrations is None:
        raise errors.not_found("resume_token: this server takes no migrated streams", field="resume_token")
    parked = migrations.take(req.resume_token, req.model_id, relay=relay)
    run = None
    try:
        host = models.get(parked.model_id)
        state.bind(host.model_id, parked.request.request_id, parked.cache_id)
        run = Generation(parked.resume_spec(host), checks, state.owner, state, migrations)
        async for ev in run.events():
            yield ev
    finally:
        if run is None or not run.created:  # refused before the stream took the cache: nobody else frees it
            models.get(parked.model_id).release_soon(parked.cache_id, "reclaimed")


class Generation:
    """Runs one :class:`GenerateSpec`: its start (the prompt's step, or the caller's last token fed
    into its cache), each sample's decode loop, and its end, yielding ``GenerateResponse`` events.

    ``state.aborted`` (``Abort``) stops it at the next step with CANCELLED; ``state.move_to`` moves
    it to a peer at the next step boundary (``migration.py``). KV for the prompt and all of
    ``max_tokens`` is reserved up front, so a stream never runs out mid-way; with
    ``spec.reserve_output`` > 0 (and below ``max_tokens``) only the prompt and that many output
    tokens are, past them each step grows the cache by what it writes, and a step the KV budget
    cannot admit ends the stream with RESOURCE_EXHAUSTED naming how far it got (not a finish
    "length": the output was cut by other requests' KV, not by its limit). Whatever ends it, the
    caches it created (or took over: ``spec.adopt_cache``, a resume) are freed unless the caller
    asked to keep them: ``released`` once every ``GenerateFinished`` was sent, else ``reclaimed``."""

    def __init__(self, spec: GenerateSpec, checks: RequestChecks, owner: str, state: StreamState,
                 migrations: "Migrations | None" = None) -> None:
        self.spec = spec
        self.host = spec.host
        self.checks = checks
        self.owner = owner
        self.state = state
        self.migrations = migrations
        self.t_start = time.perf_counter_ns()
        self.ttft = 0
        self.cache_id = spec.cache_id
        self.created: list[str] = []  # caches this stream made or took over (released at the end unless kept)
        self.finished = 0  # GenerateFinished events sent (all n of them: the stream ended normally)
        self.samples: list[_Sample] = []
        self.mover = None  # the moving side of a single-sample stream (migration.StreamMover)
        # On a cache the stream owns, the next step is queued before this token's event is sent,
        # so sending overlaps the next forward (on a caller's cache it is not: a step the caller
        # never sees would leave an extra token in it).
        self.pipeline = False
        self.prompt_index: speculation.PromptIndex | None = None
        self.tok = self.host.executor.tokenizer

    async def events(self) -> AsyncIterator[pb.GenerateResponse]:
        """The stream's events: started, a token each, finished per sample (or migrated)."""
        spec, host = self.spec, self.host
        try:
            if spec.resume is not None or (spec.adopt_cache and self.cache_id):  # freed at its end
                self._take_cache()
            # A migrated stream's cache is not held for the whole stream (it may move on again).
            with host.hold([self.cache_id] if spec.resume is None else [], "cache_id"):
                # the caches this stream creates count against the caller's cap while they are made
                with self.checks.quota.claim(host, 0 if self.cache_id else spec.n, "prompt"):
                    started = await self._start()
                yield pb.GenerateResponse(started=started)
                await self._before_decoding()
                if spec.n == 1:
                    async for ev in self._run(self.samples[0]):
                        yield ev
                else:
                    async for ev in _merged([self._run(s) for s in self.samples]):
                        yield ev
            if tracing.on:
                tracing.interval("generate.decode", self.t_start + self.ttft, time.perf_counter_ns(),
                                 generated_tokens=sum(s.generated for s in self.samples),
                                 finish_reason=pb.FinishReason.Name(self.samples[0].finish))
        finally:
            if not spec.keep_cache:
                for c in self.created:
                    host.release_soon(c, "released" if self.finished == spec.n else "reclaimed")

    def _take_cache(self) -> None:
        """The stream takes over the cache it was handed (imported for it, or moved here)."""
        self.created.append(self.cache_id)
        resume, entry = self.spec.resume, self.spec.entry
        if resume is None:
            return
        entry.owner = self.owner
        sp = self.spec.policy.sampling
        if sp.constraint is not None and entry.guide is None:  # replays the cache from the constraint's start
            entry.guide = GuideState(sp.constraint, resume.constraint_start, new_matcher(sp.compiled),
                                     compiled=sp.compiled)

    async def _start(self) -> pb.GenerateStarted:
        """The prompt's step (or the caller's last token fed into its cache): the first sample,
        the others forked from it; what ``GenerateStarted`` reports."""
        spec, host = self.spec, self.host
        reg = host.executor.registry
        cached = 0
        if spec.prompt:
            if spec.entry is not None:
                admit(host, field="stop.max_tokens", grow=[(spec.entry, spec.reserve)])
            out, row = await host.batcher.prefill(spec.prefill)
            cached = out.cached
            if spec.entry is None:
                self.cache_id = out.cache.cache_id
                self.created.append(self.cache_id)
                self.state.cache_id = self.cache_id
                self.checks.adopt(reg.get(self.cache_id), "" if spec.keep_cache else self.owner)
            handle = out.cache
        else:
            admit(host, field="stop.max_tokens", grow=[(spec.entry, spec.reserve)])
            if spec.resume is not None and spec.resume.first is not None:  # run when this server took the stream
                row = await spec.resume.first
            else:
                row = await host.batcher.decode(HeldDecode(cache_id=self.cache_id, token_id=spec.last_token,
                                                           policy=spec.policy, entry=spec.entry))
            handle = host.executor.handle(spec.entry)
        first = _Sample(0, spec.entry or reg.get(self.cache_id), row, spec.policy, self._detokenizer(),
                        spec.stops.strings)
        self.samples.append(first)
        if spec.resume is not None:
            self._replay(first)
        if spec.n > 1:
            await self._fork(first)
        self.state.stats.started(len(spec.prompt))
        return pb.GenerateStarted(cache=handle_pb(handle), prompt_tokens=spec.prompt_tokens,
                                  request_id=spec.request_id, cached_tokens=cached, resumed_tokens=spec.resumed)

    def _detokenizer(self) -> "IncrementalDetokenizer | None":
        spec = self.spec
        if self.tok is not None and (spec.stream_text or spec.stops.sequences):
            return IncrementalDetokenizer(self.tok)
        return None

    def _replay(self, s: _Sample) -> None:
        """A resumed stream's first sample: the tokens sent before the move (stop strings, text)."""
        generated = self.spec.resume.generated
        s.out_ids, s.generated = list(generated), len(generated)
        if s.detok is not None:
            for t in generated:
                s.detok.push(t)
        if s.stop_cursor is not None:  # no stop string ended in it (the source went on)
            s.stop_cursor.feed(s.detok.text)

    async def _fork(self, first: _Sample) -> None:
        """Samples 1..n-1: caches forked from the prompt's (all but its last token, shared blocks),
        then the last prompt token decoded into each with the sample's own seed, in one batched step."""
        spec, host = self.spec, self.host
        reg = host.executor.registry
        prompt = spec.prompt
        sp = first.policy.sampling
        owner = "" if spec.keep_cache else self.owner
        steps, policies, forks = [], [], []
        for i in range(1, spec.n):
            entry = None
            if len(prompt) > 1:
                # A fork that finishes after the stream was cancelled has nobody to free it: on_orphan does.
                entry, _shared = (await host.call(host.executor.fork_cache, first.cache_id, len(prompt) - 1,
                                                  spec.reserve, on_orphan=lambda v: host.release_soon(
                                                      v[0].cache_id, "reclaimed"))).value
            if entry is not None:  # else nothing to share: the one-token prompt is prefilled per sample below
                entry = reg.get(entry.cache_id)
                self.created.append(entry.cache_id)
                self.checks.adopt(entry, owner)
            forks.append(entry)
        for i, entry in enumerate(forks, start=1):
            seed = None if sp.seed is None else (sp.seed + i * _SAMPLE_SEED_STRIDE) % (1 << 63)
            policy = dataclasses.replace(first.policy, sampling=dataclasses.replace(sp, seed=seed))
            policies.append(policy)
            if entry is not None:
                steps.append(host.batcher.decode(HeldDecode(cache_id=entry.cache_id, token_id=prompt[-1],
                                                            policy=policy, entry=entry)))
            else:
                steps.append(host.batcher.prefill(PrefillInput(
                    token_ids=list(prompt), policy=policy, reserve_tokens=spec.reserve, cache_salt=spec.salt,
                    bypass_prefix_cache=True, adapter=spec.adapter)))
        results = await asyncio.gather(*steps, return_exceptions=True)
        for i, (entry, policy, r) in enumerate(zip(forks, policies, results), start=1):
            if isinstance(r, BaseException):
                continue
            if entry is None:
                out, r = r
                entry = reg.get(out.cache.cache_id)
                self.created.append(entry.cache_id)
                self.checks.adopt(entry, owner)
            self.samples.append(_Sample(i, entry, r, policy, self._detokenizer(), spec.stops.strings))
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def _before_decoding(self) -> None:
        """After ``GenerateStarted``: whether the stream can move, its first-token time, the
        pipelining, the mover, and the prompt's n-gram index when it speculates."""
        spec, state = self.spec, self.state
        movable = (self.migrations is not None and spec.request is not None and spec.n == 1 and self.created
                   and not spec.keep_cache)
        state.unmovable = "" if movable else _UNMOVABLE
        if state.unmovable and state.move_to:
            state.answer_move(errors.failed_precondition(state.unmovable))
        self.ttft = time.perf_counter_ns() - self.t_start
        if tracing.on:
            tracing.annotate(cache_id=self.cache_id)
            tracing.interval("generate.prompt", self.t_start, self.t_start + self.ttft, prompt_tokens=len(spec.prompt))
        self.pipeline = bool(self.created) and not spec.keep_cache
        if not state.unmovable:
            self.mover = self.migrations.mover(self.host, spec.request, state, spec.policy.sampling.constraint is not None)
        # one n-gram index of the prompt for all samples (each cache holds the same tokens now),
        # built on a thread: O(n-gram sizes x prompt) must not stall the event loop
        if spec.speculation is not None:
            self.prompt_index = await asyncio.to_thread(speculation.PromptIndex, spec.speculation,
                                                        list(self.samples[0].entry.tokens))

    async def _run(self, s: _Sample) -> AsyncIterator[pb.GenerateResponse]:
        """One sample from its first token to its ``GenerateFinished`` (or its move)."""
        spec = self.spec
        if spec.speculation is not None:
            s.drafter = speculation.NgramDrafter(spec.speculation, self.prompt_index)
        # One sample on a cache the stream frees at its end, each step feeding the last sampled
        # token: a step the worker runs ahead is dropped with the cache if the stream stops.
        s.chain = (self.pipeline and spec.n == 1 and s.drafter is None and s.policy.sampling.constraint is None)
        async for ev in self._decode(s):
            yield ev
        if not self.pipeline:
            await self._drop_unfed(s)
        self.finished += 1
        self.state.stats.finished("migrated" if s.migrated else pb.FinishReason.Name(s.finish))
        if s.relayed is not None:
            yield pb.GenerateResponse(finished=self._relayed_finish(s))
        elif not s.migrated:
            yield pb.GenerateResponse(finished=self._finished(s))

    def _tokens(self, s: _Sample, row) -> list[pb.TokenEvent]:
        """The token events of one step's row (more than one when drafts were accepted), up to the
        one that ends the sample (``s.finish``)."""
        stops, stream_text = self.spec.stops, self.spec.stream_text
        events = []
        for r in [row] + row.extra:
            token = r.token_id
            s.generated += 1
            s.out_ids.append(token)
            piece = s.detok.push(token) if s.detok is not None else ""
            ev = pb.TokenEvent(token_id=token, logprob=r.logprob, index=s.generated - 1,
                               text=piece if stream_text else "", sample_index=s.index)
            for t, lp in r.top:
                ev.top_logprobs.add(token_id=t, logprob=lp)
            events.append(ev)
            if token in stops.token_ids:
                s.finish = pb.FINISH_REASON_STOP
            elif token in stops.eos_ids:
                s.finish = pb.FINISH_REASON_EOS
            elif s.stop_cursor is not None and s.stop_cursor.feed(piece) is not None:
                s.finish = pb.FINISH_REASON_STOP
            elif s.generated >= stops.max_tokens:
                s.finish = pb.FINISH_REASON_LENGTH
            if s.finish != pb.FINISH_REASON_UNSPECIFIED:
                break
        return events

    def _draft(self, s: _Sample, row, events: list[pb.TokenEvent]) -> list[int]:
        """The draft tokens the sample's next step verifies (none without speculation)."""
        if s.drafter is None:
            return []
        if row.drafted:
            s.draft_tokens += row.drafted
            s.accepted_drafts += len(row.extra)
            speculation.stats_of(self.host).record(row.drafted, len(row.extra))
            s.drafter.feedback(row.drafted, len(row.extra))
        s.drafter.extend([ev.token_id for ev in events])
        if s.finish != pb.FINISH_REASON_UNSPECIFIED:
            return []
        # each draft token may become one more output token: never past max_tokens
        return s.drafter.propose(self.spec.stops.max_tokens - s.generated - 1)

    async def _decode(self, s: _Sample) -> AsyncIterator[pb.GenerateResponse]:
        """One sample's tokens, one ``TokenEvent`` each, until a stop condition (``s.finish``) or a
        move (the mover, asked for by ``state.move_to``: at a step boundary, with no step queued)."""
        state, batcher, mover = self.state, self.host.batcher, self.mover
        row = s.row
        pending: asyncio.Task | None = None
        try:
            while True:
                state.check_aborted()
                events = self._tokens(s, row)
                nxt = s.step(events[-1].token_id, self._draft(s, row, events),
                             last=s.generated + 1 >= self.spec.stops.max_tokens, moving=bool(state.move_to))
                going_on = s.finish == pb.FINISH_REASON_UNSPECIFIED
                moving = going_on and await self._pauses(s)
                if self.pipeline and going_on and not moving:
                    pending = asyncio.ensure_future(batcher.decode(nxt))
                    # two loop turns: the step is queued, then the batcher starts it (it waits for
                    # this stream), so the send below overlaps the forward instead of delaying it
                    await asyncio.sleep(0)
                    await asyncio.sleep(0)
                for ev in events:
                    state.stats.token(s.index)
                    yield pb.GenerateResponse(token=ev)
                if not going_on:
                    return
                state.check_aborted()
                if moving and pending is None:
                    moved = await mover.hand_off(s)
                    if moved is not None and not mover.relay:
                        s.migrated = True
                        yield pb.GenerateResponse(migrated=moved)
                        return
                    if moved is not None:
                        async for ev in self._relay(s, moved):
                            yield ev
                        return
                try:
                    if pending is not None:
                        row, pending = await pending, None
                    else:
                        row = await batcher.decode(nxt)
                except errors.FerrumError as e:
                    pending = None
                    raise self._cut_short(s, e) from None
        finally:
            if pending is not None:  # the stream ended with a step queued: drop it
                pending.cancel()
                pending.add_done_callback(lambda t: t.cancelled() or t.exception())
            if mover is not None:  # a pre-copy no move finished is dropped at the target
                mover.close()

    async def _pauses(self, s: _Sample) -> bool:
        """At a step boundary of a sample that goes on: whether it pauses here for its move
        (``mover.pause_now``), its cache first settled to exactly what was fed. A move that starts
        a pre-copy while the worker has run a step ahead waits one boundary: the next step takes
        that step and ends the chain (not undone and run again, nor waited for before this token)."""
        mover, batcher = self.mover, self.host.batcher
        if mover is None:
            return False
        if self.state.move_to:
            if batcher.ran_ahead(s.cache_id) and mover.will_precopy(s):
                return False
            await batcher.settle(s.cache_id)
        return mover.pause_now(s)

    async def _relay(self, s: _Sample, moved: pb.GenerateMigrated) -> AsyncIterator[pb.GenerateResponse]:
        """Relay mode (``GenerateRequest.migration_mode``, every vLLM-protocol stream): the stream
        moved to ``moved.target``; its cache here is freed now (the target holds a copy) and the
        target's token events go on on this stream (their indices go on from ``s.generated``: the
        target's first token is the step after the last one sent here), its ``finished`` kept for
        :meth:`_relayed_finish`."""
        if s.cache_id in self.created:
            self.created.remove(s.cache_id)
            self.host.release_soon(s.cache_id, "released")
        async for ev in self.migrations.relays.events(moved, self.host.model_id, self.state):
            kind = ev.WhichOneof("event")
            if kind == "token":
                s.generated += 1
                s.out_ids.append(ev.token.token_id)
                ev.token.sample_index = s.index
                self.state.stats.token(s.index)
                yield ev
            elif kind == "finished":
                s.relayed = ev.finished
                s.finish = ev.finished.finish_reason
        if s.relayed is None:
            raise errors.FerrumError(errors.ErrorKind.NETWORK, f"the stream moved to {moved.target}, which ended it "
                                     "without its final event", code=grpc.StatusCode.UNAVAILABLE)

    def _relayed_finish(self, s: _Sample) -> pb.GenerateFinished:
        """The target's final event as this stream's own: its finish, counts and text (the whole
        stream's: the target replays the tokens sent here), this stream's timings and sample
        index, the speculation counts of both servers."""
        fin = pb.GenerateFinished()
        fin.CopyFrom(s.relayed)
        fin.sample_index = s.index
        fin.time_to_first_token_ns = self.ttft
        fin.total_ns = time.perf_counter_ns() - self.t_start
        fin.draft_tokens += s.draft_tokens
        fin.accepted_draft_tokens += s.accepted_drafts
        fin.ClearField("cache")
        return fin

    def _cut_short(self, s: _Sample, e: errors.FerrumError) -> errors.FerrumError:
        """The error a failed step ends the stream with: its own, or, when the cache was to grow
        (``spec.grows``) and the KV budget could not admit the step, RESOURCE_EXHAUSTED said as
        such, never a finish "length": that would read as the end of the context, when it is
        other requests' reservations that leave this output no room."""
        if not self.spec.grows or e.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            return e
        return errors.exhausted(
            f"sample {s.index}: its output could not grow past {s.generated} tokens: the worker's KV "
            f"budget is held by other requests ({e.message}); set max_tokens to reserve the output up "
            "front, or retry", retry_after_ms=e.retry_after_ms or self.host.retry_after_ms(),
            field="stop.max_tokens", generated_tokens=s.generated)

    async def _drop_unfed(self, s: _Sample) -> None:
        """A kept cache holds every output token but the last (as after plain decoding): a stream
        that stopped inside a step's accepted drafts drops the drafts after its last token."""
        spec, host = self.spec, self.host
        want = spec.prior + (len(spec.prompt) if spec.prompt else 1) + s.generated - 1
        if s.drafter is not None and not s.entry.released and s.entry.num_tokens > want:
            await host.call(host.executor.truncate_kv, s.cache_id, want, admit=False)

    def _finished(self, s: _Sample) -> pb.GenerateFinished:
        spec = self.spec
        fin = pb.GenerateFinished(
            finish_reason=s.finish, prompt_tokens=spec.prompt_tokens, generated_tokens=s.generated,
            time_to_first_token_ns=self.ttft, total_ns=time.perf_counter_ns() - self.t_start, sample_index=s.index,
            draft_tokens=s.draft_tokens, accepted_draft_tokens=s.accepted_drafts,
        )
        if spec.stream_text and s.detok is not None:
            fin.text = s.detok.text  # exactly the streamed pieces (a trailing partial UTF-8 char is dropped)
        elif self.tok is not None:
            fin.text = self.tok.decode(s.out_ids, skip_special_tokens=True)
        keep = spec.keep_cache or not self.created
        if keep and not s.entry.released:
            fin.cache.CopyFrom(handle_pb(self.host.executor.handle(s.entry)))
        return fin


async def _merged(streams: list[AsyncIterator[pb.GenerateResponse]]) -> AsyncIterator[pb.GenerateResponse]:
    """Events of several samples' streams as they come; the first error cancels the others."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(it) -> None:
        try:
            async for ev in it:
                queue.put_nowait(ev)
            queue.put_nowait(done)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # handed to the consumer, which re-raises it
            queue.put_nowait(e)
        finally:
            await it.aclose()

    tasks = [asyncio.ensure_future(pump(it)) for it in streams]
    left = len(tasks)
    try:
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


__all__ = ["DEFAULT_MAX_TOKENS", "MAX_SAMPLES", "Generation", "IncrementalDetokenizer", "generate"]
