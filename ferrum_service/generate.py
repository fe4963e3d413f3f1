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
import time
from typing import TYPE_CHECKING, AsyncIterator

from . import errors, tracing
from .convert import check_token, check_tokens, handle_pb, pb, sampling_params
from .streams import StreamState
from .types import DecodeInput, LogitsPolicy, OutputMode, PrefillInput
from .validate import RequestChecks, admit

if TYPE_CHECKING:
    from .host import ModelHost
    from .models import ModelSet

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


def _stop_sequence_in(text: str, piece: str, stops) -> bool:
    """Whether a stop sequence ends inside ``text``'s last ``piece`` (earlier text held none)."""
    return bool(piece) and any(s and s in text[-(len(piece) + len(s) - 1):] for s in stops)


async def generate(models: "ModelSet", checks: RequestChecks, req: pb.GenerateRequest, owner: str,
                   state: StreamState) -> AsyncIterator[pb.GenerateResponse]:
    """Run one generation; yields ``GenerateResponse`` events. ``state.aborted`` (``Abort``) stops
    it at the next step with CANCELLED."""
    t_start = time.perf_counter_ns()
    host = models.get(req.model_id)
    state.model_id, state.request_id, state.cache_id = host.model_id, req.request_id, req.cache_id
    checks.require_generation(host, "Generate")
    sp = sampling_params(req.sampling, host.vocab_size, "sampling")
    if req.top_logprobs > 64:
        raise errors.invalid(f"top_logprobs = {req.top_logprobs} exceeds the maximum 64", field="top_logprobs")
    policy = LogitsPolicy(mode=OutputMode.SAMPLED_TOKEN, sampling=sp, top_logprobs=int(req.top_logprobs))
    max_tokens = int(req.stop.max_tokens) or DEFAULT_MAX_TOKENS
    stop_ids = set(check_tokens(req.stop.stop_token_ids, host.vocab_size, "stop.stop_token_ids", allow_empty=True))
    eos_ids = set() if req.stop.ignore_eos else set(host.info.eos_token_ids)
    tok = host.executor.tokenizer
    if req.stop.stop_sequences and tok is None:
        raise errors.failed_precondition("stop.stop_sequences needs a tokenizer", field="stop.stop_sequences")
    prompt = await _prompt_tokens(host, checks, req)
    reg = host.executor.registry
    prior = 0
    if req.cache_id:
        prior = checks.live_entry(host, req.cache_id, "cache_id").num_tokens
        if not prompt and not req.HasField("last_token_id"):
            raise errors.invalid("cache_id without a prompt needs last_token_id", field="last_token_id")
    if req.HasField("last_token_id"):
        check_token(req.last_token_id, host.vocab_size, "last_token_id")
    total = prior + len(prompt) + max_tokens
    checks.check_length(host, total, "stop.max_tokens")
    if prompt:
        checks.check_step(host, [(len(prompt), prior)], 1, "token_ids" if req.token_ids.token_ids else "prompt")
    detok = IncrementalDetokenizer(tok) if tok is not None and (req.stream_text or req.stop.stop_sequences) else None

    created = ""
    cache_id = req.cache_id
    generated = 0
    finish = pb.FINISH_REASON_UNSPECIFIED
    out_ids: list[int] = []
    ttft = 0
    finished = False  # GenerateFinished was yielded: the stream ended normally
    try:
        with host.hold([cache_id], "cache_id"):
            # --- prefill (or feed the caller's last token into its cache) ---
            if prompt:
                inp = PrefillInput(token_ids=prompt, cache_id=cache_id, policy=policy,
                                   reserve_tokens=total if not cache_id else 0, request_id=req.request_id)
                if cache_id:
                    admit(host, "stop.max_tokens", grow=[(reg.get(cache_id), total)])
                out, row = await host.batcher.prefill(inp)
                if not cache_id:
                    created = cache_id = out.cache.cache_id
                    state.cache_id = cache_id
                    checks.adopt(reg.get(cache_id), "" if req.keep_cache else owner)
                handle = out.cache
            else:
                admit(host, "stop.max_tokens", grow=[(reg.get(cache_id), total)])
                row = await host.batcher.decode(
                    DecodeInput(cache_id=cache_id, token_id=req.last_token_id, policy=policy)
                )
                handle = host.executor.handle(reg.get(cache_id))
            yield pb.GenerateResponse(started=pb.GenerateStarted(
                cache=handle_pb(handle), prompt_tokens=len(prompt), request_id=req.request_id))
            ttft = time.perf_counter_ns() - t_start
            if tracing.enabled():
                tracing.annotate(cache_id=cache_id)
                tracing.interval("generate.prompt", t_start, t_start + ttft, prompt_tokens=len(prompt))

            # --- decode loop ---
            # On a cache the stream owns, the next step is queued before this token's event is
            # sent, so sending overlaps the next forward (on a caller's cache it is not: a step the
            # caller never sees would leave an extra token in it).
            pipeline = bool(created) and not req.keep_cache
            pending: asyncio.Task | None = None
            try:
                while True:
                    state.check_aborted()
                    token = row.token_id
                    generated += 1
                    out_ids.append(token)
                    piece = detok.push(token) if detok is not None else ""
                    ev = pb.TokenEvent(token_id=token, logprob=row.logprob, index=generated - 1,
                                       text=piece if req.stream_text else "")
                    for t, lp in row.top:
                        ev.top_logprobs.add(token_id=t, logprob=lp)
                    if token in stop_ids:
                        finish = pb.FINISH_REASON_STOP
                    elif token in eos_ids:
                        finish = pb.FINISH_REASON_EOS
                    elif detok is not None and _stop_sequence_in(detok.text, piece, req.stop.stop_sequences):
                        finish = pb.FINISH_REASON_STOP
                    elif generated >= max_tokens:
                        finish = pb.FINISH_REASON_LENGTH
                    nxt = DecodeInput(cache_id=cache_id, token_id=token, policy=policy)
                    if pipeline and finish == pb.FINISH_REASON_UNSPECIFIED:
                        pending = asyncio.ensure_future(host.batcher.decode(nxt))
                    yield pb.GenerateResponse(token=ev)
                    if finish != pb.FINISH_REASON_UNSPECIFIED:
                        break
                    state.check_aborted()
                    if pending is not None:
                        row, pending = await pending, None
                    else:
                        row = await host.batcher.decode(nxt)
            finally:
                if pending is not None:  # the stream ended with a step queued: drop it
                    pending.cancel()
                    pending.add_done_callback(lambda t: t.cancelled() or t.exception())
        if tracing.enabled():
            tracing.interval("generate.decode", t_start + ttft, time.perf_counter_ns(), generated_tokens=generated,
                             finish_reason=pb.FinishReason.Name(finish))
        fin = pb.GenerateFinished(
            finish_reason=finish, prompt_tokens=len(prompt), generated_tokens=generated,
            time_to_first_token_ns=ttft, total_ns=time.perf_counter_ns() - t_start,
        )
        if req.stream_text and detok is not None:
            fin.text = detok.text  # exactly the streamed pieces (a trailing partial UTF-8 char is dropped)
        elif tok is not None:
            fin.text = tok.decode(out_ids, skip_special_tokens=True)
        if cache_id and (req.keep_cache or not created) and cache_id in reg:
            fin.cache.CopyFrom(handle_pb(host.executor.handle(reg.get(cache_id))))
        finished = True
        yield pb.GenerateResponse(finished=fin)
    finally:
        if created and not req.keep_cache:
            host.release_soon(created, "released" if finished else "reclaimed")
