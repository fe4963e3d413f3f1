"""``Generate``: the decode loop on the server, one event per token.

The prompt goes through the model's batcher (``host.batcher.prefill``) and each later step feeds
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
from ..core.stop_conditions import MAX_STOP_TOKEN_IDS, StopStrings, check_stop_sequences
from ..core.guided import GuideState, new_matcher
from ..core.steps import StepRow
from ..core.types import DecodeInput, LogitsPolicy, OutputMode, PrefillInput
from . import tracing
from .convert import check_token, check_tokens, handle_pb, pb, sampling_params
from .streams import StreamState
from .validate import RequestChecks, admit

if TYPE_CHECKING:
    from ..hosting.host import ModelHost
    from ..hosting.models import ModelSet
    from .migration import Migrations, Parked

DEFAULT_MAX_TOKENS = 128


async def _prompt_tokens(host: "ModelHost", checks: RequestChecks, req: pb.GenerateRequest) -> list[int]:
    """The prompt's token ids: given, or the text / chat tokenized off the event loop."""
    which = req.WhichOneof("prompt")
    if which == "token_ids":
        return checks.tokens(host, req.token_ids.token_ids, "token_ids.token_ids", allow_empty=bool(req.cache_id))
    tok = host.executor.tokenizer
    if which in ("text", "chat") and tok is None:
        raise errors.failed_precondition(
            f"{which}: model {host.model_id!r} has no tokenizer; send token_ids", field=which
        )
    if which == "text":
        checks.check_text(host, [req.text], "text")
        ids = list(await asyncio.to_thread(tok.encode, req.text, add_special_tokens=True))
        if not ids:
            raise errors.invalid("text tokenizes to no tokens", field="text")
        return checks.tokens(host, ids, "text")
    if which == "chat":
        if not req.chat.messages:
            raise errors.invalid("chat.messages is empty", field="chat.messages")
        msgs = [{"role": m.role, "content": m.content} for m in req.chat.messages]
        checks.check_text(host, [m["content"] for m in msgs] + [m["role"] for m in msgs], "chat.messages")

        def encode_chat() -> list[int]:
            text = host.executor.apply_chat_template(msgs, add_generation_prompt=True)
            return list(tok.encode(text, add_special_tokens=False))

        return checks.tokens(host, await asyncio.to_thread(encode_chat), "chat.messages")
    if not req.cache_id:
        raise errors.invalid("prompt is not set: send token_ids, text or chat (or a cache_id)", field="prompt")
    return []


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


MAX_SAMPLES = 64
# Sample i draws with seed ``seed + i * stride``. torch's CPU generator keeps only the low 32 bits
# of a seed, and a draw at position p uses ``seed + p``: with this odd stride (2^32 / golden ratio)
# the low 32 bits of two samples' seeds stay more than 2^25 apart for all 64 samples, so no two
# samples share a draw at any position below that.
_SAMPLE_SEED_STRIDE = 0x9E3779B9


class _Sample:
    """One sample's decode loop: its cache, its policy, the tokens and text it produced."""

    def __init__(self, index: int, cache_id: str, row, policy: LogitsPolicy, detok, stops: StopStrings | None
                 ) -> None:
        self.index = index
        self.cache_id = cache_id
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


async def generate(models: "ModelSet", checks: RequestChecks, req: pb.GenerateRequest, owner: str,
                   state: StreamState, migrations: "Migrations | None" = None, *,
                   reserve_output: int = 0, adopt_cache: bool = False) -> AsyncIterator[pb.GenerateResponse]:
    """Run one generation; yields ``GenerateResponse`` events. ``state.aborted`` (``Abort``) stops
    it at the next step with CANCELLED; ``state.move_to`` moves it to a peer at the next step
    boundary (``migration.py``). With ``req.resume_token``, a stream a peer moved here goes on.

    KV for the prompt and all of ``stop.max_tokens`` is reserved up front, so a stream never runs
    out mid-way. With ``reserve_output`` > 0 (and below ``max_tokens``), only the prompt and that
    many output tokens are reserved; past them each step grows the cache by what it writes, and a
    step the KV budget cannot admit ends the stream with RESOURCE_EXHAUSTED naming how far it got
    (not a finish "length": the output was cut by other requests' KV, not by its limit; the cache
    is freed as at any end).

    With ``adopt_cache``, the stream takes ``req.cache_id`` over (a cache imported for it): it is
    freed when the stream ends, as a cache the stream made."""
    if not req.resume_token:
        async for ev in _generate(models, checks, req, owner, state, migrations, None, reserve_output,
                                  adopt_cache):
            yield ev
        return
    if migrations is None:
        raise errors.not_found("resume_token: this server takes no migrated streams", field="resume_token")
    parked = migrations.take(req.resume_token, req.model_id)
    try:
        async for ev in _generate(models, checks, parked.resume_request(), owner, state, migrations, parked):
            yield ev
    finally:
        if not parked.adopted:  # refused before the stream took the cache: nobody else frees it
            models.get(parked.model_id).release_soon(parked.cache_id, "reclaimed")


async def _generate(models: "ModelSet", checks: RequestChecks, req: pb.GenerateRequest, owner: str,
                    state: StreamState, migrations: "Migrations | None", parked: "Parked | None",
                    reserve_output: int = 0, adopt_cache: bool = False) -> AsyncIterator[pb.GenerateResponse]:
    t_start = time.perf_counter_ns()
    state.unmovable = "the stream has not sent its first token yet"
    host = models.get(req.model_id)
    state.bind(host.model_id, req.request_id, req.cache_id)
    checks.require_generation(host, "Generate")
    sp = sampling_params(req.sampling, host.vocab_size, "sampling")
    checks.guide(host, sp, "sampling.constraint")
    if req.top_logprobs > 64:
        raise errors.invalid(f"top_logprobs = {req.top_logprobs} exceeds the maximum 64", field="top_logprobs")
    n = max(1, int(req.n))
    if n > MAX_SAMPLES:
        raise errors.invalid(f"n = {req.n} exceeds the maximum {MAX_SAMPLES}", field="n")
    if n > 1 and req.cache_id:
        raise errors.invalid("n > 1 needs a new prompt, not a cache_id", field="n")
    if n > 1 and not host.executor.capabilities().supports_fork:
        raise errors.unsupported(f"n > 1: model {host.model_id!r} cannot fork caches (ForkCache)")
    salt = checks.salt(req.cache_salt, "cache_salt")
    spec = speculation.request_config(req, getattr(host, "speculation_default", 0))
    if spec is not None and not speculation.usable(LogitsPolicy(sampling=sp), host.executor):
        spec = None  # decodes plainly (documented in the contract)
    policy = LogitsPolicy(mode=OutputMode.SAMPLED_TOKEN, sampling=sp, top_logprobs=int(req.top_logprobs))
    max_tokens = int(req.stop.max_tokens) or DEFAULT_MAX_TOKENS
    stop_ids = set(check_tokens(req.stop.stop_token_ids, host.vocab_size, "stop.stop_token_ids", allow_empty=True,
                                max_len=MAX_STOP_TOKEN_IDS))
    eos_ids = set() if req.stop.ignore_eos else set(host.info.eos_token_ids)
    tok = host.executor.tokenizer
    check_stop_sequences(req.stop.stop_sequences, "stop.stop_sequences")
    if req.stop.stop_sequences and tok is None:
        raise errors.failed_precondition("stop.stop_sequences needs a tokenizer", field="stop.stop_sequences")
    prompt = await _prompt_tokens(host, checks, req)
    reg = host.executor.registry
    entry = checks.live_entry(host, req.cache_id, "cache_id") if req.cache_id else None
    prior = entry.num_tokens if entry is not None else 0
    adapter = checks.adapter(host, req.adapter, "adapter", entry)
    if entry is not None:
        if parked is not None:  # B may have fed the last token already (Parked.first)
            prior = parked.cache_tokens
        if not prompt and not req.HasField("last_token_id"):
            raise errors.invalid("cache_id without a prompt needs last_token_id", field="last_token_id")
    if req.HasField("last_token_id"):
        check_token(req.last_token_id, host.vocab_size, "last_token_id")
    resumed = len(parked.generated) if parked is not None else 0
    total = prior + len(prompt) + max_tokens - resumed + (1 if resumed else 0)
    checks.check_length(host, total, "stop.max_tokens")
    # What is reserved up front (all of it unless the caller lets the cache grow: see generate())
    grows = 0 < reserve_output < max_tokens - resumed
    reserve = prior + len(prompt) + reserve_output if grows else total
    # the prompt's step: its cost checked now, run by the batcher below
    inp = PrefillInput(token_ids=prompt, cache_id=req.cache_id, policy=policy,
                       reserve_tokens=reserve if not req.cache_id else 0, request_id=req.request_id,
                       cache_salt=salt, bypass_prefix_cache=req.bypass_prefix_cache, adapter=adapter)
    if prompt:
        checks.plan(host, [StepRow.prompt(inp, entry)], "token_ids" if req.token_ids.token_ids else "prompt")
    await checks.compile(host, [(sp, "sampling.constraint")])
    stops = StopStrings(req.stop.stop_sequences) if req.stop.stop_sequences else None  # compiled once

    def detokenizer():
        return IncrementalDetokenizer(tok) if tok is not None and (req.stream_text or req.stop.stop_sequences) else None

    created: list[str] = []  # caches this stream made (released at the end unless kept)
    cache_id = req.cache_id
    ttft = 0
    finished = [0]  # GenerateFinished events yielded (all n of them: the stream ended normally)
    prompt_count = parked.prompt_tokens if parked is not None else prior + len(prompt)
    try:
        if adopt_cache and cache_id and parked is None:  # handed to this stream: freed at its end
            created.append(cache_id)
        if parked is not None:  # the migrated cache is this stream's now: freed at its end
            created.append(cache_id)
            parked.adopted = True
            entry = reg.get(cache_id)
            entry.owner = owner
            if sp.constraint is not None and entry.guide is None:  # replays the cache from the constraint's start
                entry.guide = GuideState(sp.constraint, parked.constraint_start, new_matcher(sp.compiled),
                                         compiled=sp.compiled)
        # A migrated stream's cache is not held for the whole stream (it may move on again).
        with host.hold([cache_id] if parked is None else [], "cache_id"):
            # the caches this stream creates count against the caller's cap while they are made
            with checks.quota.claim(host, 0 if cache_id else n, "prompt"):
                # --- prefill (or feed the caller's last token into its cache) ---
                cached = 0
                if prompt:
                    if cache_id:
                        admit(host, field="stop.max_tokens", grow=[(reg.get(cache_id), reserve)])
                    out, row = await host.batcher.prefill(inp)
                    cached = out.cached
                    if not cache_id:
                        cache_id = out.cache.cache_id
                        created.append(cache_id)
                        state.cache_id = cache_id
                        checks.adopt(reg.get(cache_id), "" if req.keep_cache else owner)
                    handle = out.cache
                else:
                    admit(host, field="stop.max_tokens", grow=[(reg.get(cache_id), reserve)])
                    if parked is not None and parked.first is not None:  # run when B took the stream
                        row = await parked.first
                    else:
                        row = await host.batcher.decode(
                            DecodeInput(cache_id=cache_id, token_id=req.last_token_id, policy=policy)
                        )
                    handle = host.executor.handle(reg.get(cache_id))
                samples = [_Sample(0, cache_id, row, policy, detokenizer(), stops)]
                if parked is not None:  # the tokens sent before the move (stop sequences, text)
                    s0 = samples[0]
                    s0.out_ids, s0.generated = list(parked.generated), resumed
                    if s0.detok is not None:
                        for t in parked.generated:
                            s0.detok.push(t)
                    if s0.stop_cursor is not None:  # no stop string ended in it (the source went on)
                        s0.stop_cursor.feed(s0.detok.text)
                if n > 1:
                    samples += await _fork_samples(host, checks, samples[0], prompt, n, reserve, owner, req, created,
                                                   detokenizer, stops, salt, adapter)
            state.stats.started(len(prompt))
            yield pb.GenerateResponse(started=pb.GenerateStarted(
                cache=handle_pb(handle), prompt_tokens=prompt_count, request_id=req.request_id, cached_tokens=cached,
                resumed_tokens=resumed))
            state.unmovable = ("" if migrations is not None and n == 1 and created and not req.keep_cache
                               else "only a single-sample stream on a cache it created, without keep_cache, moves")
            if state.unmovable and state.move_to:
                state.answer_move(errors.failed_precondition(state.unmovable))
            ttft = time.perf_counter_ns() - t_start
            if tracing.enabled():
                tracing.annotate(cache_id=cache_id)
                tracing.interval("generate.prompt", t_start, t_start + ttft, prompt_tokens=len(prompt))

            # On a cache the stream owns, the next step is queued before this token's event is
            # sent, so sending overlaps the next forward (on a caller's cache it is not: a step the
            # caller never sees would leave an extra token in it).
            pipeline = bool(created) and not req.keep_cache

            mover = None if state.unmovable else migrations.mover(host, req, state, sp.constraint is not None)

            # one n-gram index of the prompt for all samples (each cache holds the same tokens
            # now), built on a thread: O(n-gram sizes x prompt) must not stall the event loop
            prompt_index = None
            if spec is not None:
                prompt_index = await asyncio.to_thread(speculation.PromptIndex, spec,
                                                       list(reg.get(samples[0].cache_id).tokens))

            async def run(s: _Sample) -> AsyncIterator[pb.GenerateResponse]:
                if spec is not None:
                    s.drafter = speculation.NgramDrafter(spec, prompt_index)
                async for ev in _decode_loop(host, req, state, s, pipeline, max_tokens, stop_ids, eos_ids, mover,
                                             grows):
                    yield ev
                if not pipeline:
                    await _drop_unfed(host, s, prior + (len(prompt) if prompt else 1))
                finished[0] += 1
                state.stats.finished("migrated" if s.migrated else pb.FinishReason.Name(s.finish))
                if s.migrated:
                    return
                yield pb.GenerateResponse(finished=_finished(host, req, s, prompt_count, ttft, t_start, tok,
                                                             keep=bool(req.keep_cache or not created)))

            if n == 1:
                async for ev in run(samples[0]):
                    yield ev
            else:
                async for ev in _merged([run(s) for s in samples]):
                    yield ev
        if tracing.enabled():
            tracing.interval("generate.decode", t_start + ttft, time.perf_counter_ns(),
                             generated_tokens=sum(s.generated for s in samples),
                             finish_reason=pb.FinishReason.Name(samples[0].finish))
    finally:
        if not req.keep_cache:
            for c in created:
                host.release_soon(c, "released" if finished[0] == n else "reclaimed")


async def _fork_samples(host, checks, first: _Sample, prompt: list[int], n: int, total: int, owner: str, req,
                        created: list[str], detokenizer, stops: StopStrings | None, salt: str, adapter: str
                        ) -> list[_Sample]:
    """Samples 1..n-1: caches forked from the prompt's (all but its last token, shared blocks),
    then the last prompt token decoded into each with the sample's own seed, in one batched step."""
    reg = host.executor.registry
    sp = first.policy.sampling
    forks: list[str] = []
    for _ in range(1, n):
        if len(prompt) > 1:
            # A fork that finishes after the stream was cancelled has nobody to free it: on_orphan does.
            entry, _shared = (await host.call(host.executor.fork_cache, first.cache_id, len(prompt) - 1, total,
                                              on_orphan=lambda v: host.release_soon(v[0].cache_id, "reclaimed"))).value
        else:  # nothing to share: the one-token prompt is prefilled per sample below
            entry = None
        if entry is not None:
            forks.append(entry.cache_id)
            created.append(entry.cache_id)
            checks.adopt(reg.get(entry.cache_id), "" if req.keep_cache else owner)
        else:
            forks.append("")
    samples = []
    steps = []
    for i, fork in enumerate(forks, start=1):
        seed = None if sp.seed is None else (sp.seed + i * _SAMPLE_SEED_STRIDE) % (1 << 63)
        policy = dataclasses.replace(first.policy, sampling=dataclasses.replace(sp, seed=seed))
        samples.append(_Sample(i, fork, None, policy, detokenizer(), stops))
        if fork:
            steps.append(host.batcher.decode(DecodeInput(cache_id=fork, token_id=prompt[-1], policy=policy)))
        else:
            steps.append(host.batcher.prefill(PrefillInput(token_ids=list(prompt), policy=policy, reserve_tokens=total,
                                                           cache_salt=salt, bypass_prefix_cache=True,
                                                           adapter=adapter)))
    results = await asyncio.gather(*steps, return_exceptions=True)
    for s, r in zip(samples, results):
        if not s.cache_id and not isinstance(r, BaseException):
            out, r = r
            s.cache_id = out.cache.cache_id
            created.append(s.cache_id)
            checks.adopt(reg.get(s.cache_id), "" if req.keep_cache else owner)
        s.row = r
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return samples


async def _decode_loop(host, req, state: StreamState, s: _Sample, pipeline: bool, max_tokens: int,
                       stop_ids: set[int], eos_ids: set[int], mover=None, grows: bool = False
                       ) -> AsyncIterator[pb.GenerateResponse]:
    """One sample's tokens, one ``TokenEvent`` each, until a stop condition (``s.finish``) or a
    move (``mover``, asked for by ``state.move_to``: at a step boundary, with no step queued).
    With ``grows`` (the cache was not reserved for all of ``max_tokens``), a step the KV budget
    cannot admit ends the stream with RESOURCE_EXHAUSTED (see :func:`generate`)."""
    row = s.row
    pending: asyncio.Task | None = None
    try:
        while True:
            state.check_aborted()
            events = []
            for r in [row] + row.extra:  # more than one token when drafts were accepted
                token = r.token_id
                s.generated += 1
                s.out_ids.append(token)
                piece = s.detok.push(token) if s.detok is not None else ""
                ev = pb.TokenEvent(token_id=token, logprob=r.logprob, index=s.generated - 1,
                                   text=piece if req.stream_text else "", sample_index=s.index)
                for t, lp in r.top:
                    ev.top_logprobs.add(token_id=t, logprob=lp)
                events.append(ev)
                if token in stop_ids:
                    s.finish = pb.FINISH_REASON_STOP
                elif token in eos_ids:
                    s.finish = pb.FINISH_REASON_EOS
                elif s.stop_cursor is not None and s.stop_cursor.feed(piece) is not None:
                    s.finish = pb.FINISH_REASON_STOP
                elif s.generated >= max_tokens:
                    s.finish = pb.FINISH_REASON_LENGTH
                if s.finish != pb.FINISH_REASON_UNSPECIFIED:
                    break
            draft: list[int] = []
            if s.drafter is not None:
                if row.drafted:
                    s.draft_tokens += row.drafted
                    s.accepted_drafts += len(row.extra)
                    speculation.stats_of(host).record(row.drafted, len(row.extra))
                    s.drafter.feedback(row.drafted, len(row.extra))
                s.drafter.extend([ev.token_id for ev in events])
                if s.finish == pb.FINISH_REASON_UNSPECIFIED:
                    # each draft token may become one more output token: never past max_tokens
                    draft = s.drafter.propose(max_tokens - s.generated - 1)
            nxt = DecodeInput(cache_id=s.cache_id, token_id=token, policy=s.policy, draft=draft)
            moving = mover is not None and s.finish == pb.FINISH_REASON_UNSPECIFIED and mover.pause_now(s)
            if pipeline and s.finish == pb.FINISH_REASON_UNSPECIFIED and not moving:
                pending = asyncio.ensure_future(host.batcher.decode(nxt))
                # two loop turns: the step is queued, then the batcher starts it (it waits for this
                # stream), so the send below overlaps the forward instead of delaying it
                await asyncio.sleep(0)
                await asyncio.sleep(0)
            for ev in events:
                state.stats.token(s.index)
                yield pb.GenerateResponse(token=ev)
            if s.finish != pb.FINISH_REASON_UNSPECIFIED:
                return
            state.check_aborted()
            if moving and pending is None:
                moved = await mover.hand_off(s)
                if moved is not None:
                    s.migrated = True
                    yield pb.GenerateResponse(migrated=moved)
                    return
            try:
                if pending is not None:
                    row, pending = await pending, None
                else:
                    row = await host.batcher.decode(nxt)
            except errors.FerrumError as e:
                pending = None
                if not grows or e.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                # Said as such, never a finish "length": that would read as the end of the context,
                # when it is other requests' reservations that leave this output no room.
                raise errors.exhausted(
                    f"sample {s.index}: its output could not grow past {s.generated} tokens: the worker's KV "
                    f"budget is held by other requests ({e.message}); set max_tokens to reserve the output up "
                    "front, or retry", retry_after_ms=e.retry_after_ms or host.retry_after_ms(),
                    field="stop.max_tokens", generated_tokens=s.generated) from None
    finally:
        if pending is not None:  # the stream ended with a step queued: drop it
            pending.cancel()
            pending.add_done_callback(lambda t: t.cancelled() or t.exception())
        if mover is not None:  # a pre-copy no move finished is dropped at the target
            mover.close()


async def _drop_unfed(host, s: _Sample, start: int) -> None:
    """A kept cache holds every output token but the last (as after plain decoding): a stream
    that stopped inside a step's accepted drafts drops the drafts after its last token."""
    reg = host.executor.registry
    want = start + s.generated - 1
    if s.drafter is not None and s.cache_id in reg and reg.get(s.cache_id).num_tokens > want:
        await host.call(host.executor.truncate_kv, s.cache_id, want, admit=False)


def _finished(host, req, s: _Sample, prompt_tokens: int, ttft: int, t_start: int, tok, keep: bool
              ) -> pb.GenerateFinished:
    fin = pb.GenerateFinished(
        finish_reason=s.finish, prompt_tokens=prompt_tokens, generated_tokens=s.generated,
        time_to_first_token_ns=ttft, total_ns=time.perf_counter_ns() - t_start, sample_index=s.index,
        draft_tokens=s.draft_tokens, accepted_draft_tokens=s.accepted_drafts,
    )
    if req.stream_text and s.detok is not None:
        fin.text = s.detok.text  # exactly the streamed pieces (a trailing partial UTF-8 char is dropped)
    elif tok is not None:
        fin.text = tok.decode(s.out_ids, skip_special_tokens=True)
    reg = host.executor.registry
    if s.cache_id and keep and s.cache_id in reg:
        fin.cache.CopyFrom(handle_pb(host.executor.handle(reg.get(s.cache_id))))
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
