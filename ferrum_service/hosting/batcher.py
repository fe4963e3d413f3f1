"""Continuous batching of ``Generate`` streams (the server's own, so a plain client gets it).

Every running stream's next decode step (:meth:`ContinuousBatcher.decode`) and new streams' prompts
(:meth:`ContinuousBatcher.prefill`) go into one queue per model. Each step takes every queued decode
step and prompt tokens up to :attr:`ContinuousBatcher.prefill_tokens_per_step` (chunked prefill: a
longer prompt joins step after step, a chunk at a time, continuing the cache its first chunk made),
and runs them as one forward on the model's worker (``ModelHost.step_and_sample``: the executor's
``mixed_step`` when both kinds are present), up to ``max_batch`` rows. So running streams keep their
pace while prompts arrive: a step costs at most their decodes plus one budget of prompt tokens. Before a step it waits a few
milliseconds for the streams of the previous step to queue their next token (stragglers), so B
streams share one forward per token. A step that fails is all or nothing; its rows are then rerun
one by one so that one bad stream does not fail the others.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core import errors
from ..core.sampling import RowResult
from ..core.types import DecodeInput, PrefillInput, PrefillOutput

if TYPE_CHECKING:
    from .host import ModelHost


@dataclass
class _Pending:
    """A stream's step waiting for the next batched forward. A prompt taken in chunks keeps its
    progress here: ``done`` tokens are in the cache ``created`` (made by its first chunk)."""

    inp: PrefillInput | DecodeInput
    fut: asyncio.Future
    done: int = 0
    created: str = ""
    cached: int = 0  # leading tokens of the prompt's first chunk the prefix cache holds now

    def fail(self, e: BaseException) -> None:
        if not self.fut.done():
            self.fut.set_exception(e)

    def chunk(self, size: int) -> tuple[PrefillInput, bool]:
        """The next ``size`` tokens of this prompt as a step input, and whether they are its last."""
        inp = self.inp
        ids = inp.token_ids[self.done:self.done + size]
        last = self.done + len(ids) >= len(inp.token_ids)
        if not self.done and last:
            return inp, True
        policy = inp.policy
        if not last and policy.sampling.constraint is not None:
            # A structured-output constraint starts where the whole prompt ends: a chunk in the
            # middle of the prompt carries none (its row is not sampled), or the constraint would
            # start there and take the rest of the prompt for output.
            policy = dataclasses.replace(policy, sampling=dataclasses.replace(policy.sampling, constraint=None,
                                                                              compiled=None))
        return PrefillInput(token_ids=ids, cache_id=self.created or inp.cache_id, policy=policy,
                            reserve_tokens=inp.reserve_tokens if not self.done and not inp.cache_id else 0,
                            metadata=inp.metadata, request_id=inp.request_id, cache_salt=inp.cache_salt,
                            adapter=inp.adapter,
                            bypass_prefix_cache=inp.bypass_prefix_cache), last


class ContinuousBatcher:
    """The step queue of one hosted model's ``Generate`` streams."""

    #: Prompt tokens one batched step may take on top of the running streams' decode tokens. New
    #: prompts join the running batch (one forward for both) up to this many tokens per step, so a
    #: burst of new streams delays the running ones by a bounded amount per step.
    prefill_tokens_per_step = 512
    #: Longest wait (seconds) for streams of the previous batch to resubmit before a batch runs.
    straggler_wait_s = 0.005

    def __init__(self, host: "ModelHost") -> None:
        self.host = host
        self._decode_queue: list[_Pending] = []  # decode steps of running streams
        self._prefill_queue: list[_Pending] = []  # prompts of new streams
        self._task: asyncio.Task | None = None
        # Streams of the last batch that have not resubmitted (or ended) yet; the next batch waits a
        # little for them (see ``_gather_stragglers``).
        self._expected: set[str] = set()
        self.mixed_steps = 0  # steps that joined new prompts with running decodes (diagnostics)
        self._prompt_alone_next = False  # a prompt too costly to join the decodes goes first, alone
        self._chunks: list[tuple[PrefillInput, bool]] = []  # the next step's prompt chunks (and last?)

    @property
    def queued_prompts(self) -> int:
        """New streams' prompts waiting for a step (they count against the host's queue limit)."""
        return len(self._prefill_queue)

    def forget(self, cache_id: str) -> None:
        """A stream's cache is gone: the next step does not wait for it."""
        self._expected.discard(cache_id)

    # ---- what streams call ------------------------------------------------------------------------
    async def decode(self, inp: DecodeInput) -> RowResult:
        """One decode step + sampling, batched with whatever other streams run right now (the
        repetition-penalty history is the cache's tokens)."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._decode_queue.append(_Pending(inp, fut))
        self._kick()
        return await fut

    async def prefill(self, inp: PrefillInput) -> tuple[PrefillOutput, RowResult]:
        """A stream's prompt (+ sampling of its first token), run in the same forward as the running
        streams' decode steps. New work: refused at once past the host's queue limit. If the stream
        is cancelled while its step runs, the cache the step created is reclaimed."""
        self.host.check_accepting()
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._prefill_queue.append(_Pending(inp, fut))
        self._kick()
        try:
            return await fut
        except asyncio.CancelledError:
            # cancelled after the step set its result but before this task resumed
            if fut.done() and not fut.cancelled() and fut.exception() is None and not inp.cache_id:
                self.host.release_soon(fut.result()[0].cache.cache_id, "reclaimed")
            raise

    # ---- the loop ---------------------------------------------------------------------------------
    def _kick(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain())

    async def _gather_stragglers(self) -> None:
        """Yield loop turns until every stream of the previous batch has queued its next step (or
        ended), at most :attr:`straggler_wait_s`.

        Without this wait a batch is cut as soon as the first few streams of the previous batch are
        back (the others are still sending their token event), so B streams split into two or
        more forwards per token — each costing nearly a full weight read on a memory-bound model.
        """
        await asyncio.sleep(0)
        if not self._expected:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.straggler_wait_s
        while loop.time() < deadline and len(self._decode_queue) < self.host.max_batch:
            queued = {p.inp.cache_id for p in self._decode_queue}
            if self._expected <= queued:
                break
            await asyncio.sleep(0)

    def _next_batch(self) -> tuple[list[_Pending], list[_Pending]]:
        """Up to ``max_batch`` rows: every queued decode step first, then new prompts (oldest
        first) while the room, :attr:`prefill_tokens_per_step` and the model's per-step ceilings
        allow (at least one prompt when there is room). A prompt that cannot join the running
        decodes within the ceilings (padding makes a long prompt cost rows x its length) runs
        alone in the next step."""
        if self._prompt_alone_next:
            self._prompt_alone_next = False
            self._drop_cancelled_prompts()
            if self._prefill_queue:
                p = self._prefill_queue.pop(0)
                self._chunks = [p.chunk(len(p.inp.token_ids) - p.done)]
                return [p], []
        max_batch = self.host.max_batch
        decodes = [p for p in self._decode_queue[:max_batch] if not p.fut.cancelled()]
        del self._decode_queue[:max_batch]
        prefills: list[_Pending] = []
        self._chunks = []
        if any(p.inp.draft for p in decodes) and not self._fits([], decodes):
            for p in decodes:  # drafts past the step's ceilings: this step verifies none
                p.inp.draft = []
        tokens = 0
        room = max_batch - len(decodes)
        while self._prefill_queue and len(prefills) < room:
            p = self._prefill_queue[0]
            if p.fut.cancelled():
                self._forget_prompt(self._prefill_queue.pop(0))
                continue
            left = len(p.inp.token_ids) - p.done
            budget = self.prefill_tokens_per_step - tokens
            if budget <= 0:
                break
            # A new prompt's first chunk also takes the tokens the prefix cache holds: they cost
            # nothing to compute, so they do not count against the budget.
            p.cached = self.host.executor.cached_prefix(p.inp) if not p.done and not p.inp.cache_id else 0
            # Only a running batch is protected by chunking; alone, a prompt goes in one step.
            size = min(left, budget + p.cached) if decodes or prefills else left
            chunk, last = p.chunk(size)
            if (prefills or decodes) and not self._fits(prefills + [p], decodes, [chunk]):
                if not prefills:
                    self._prompt_alone_next = True
                break
            self._prefill_queue.pop(0)
            prefills.append(p)
            self._chunks.append((chunk, last))
            tokens += len(chunk.token_ids) - p.cached
            if not last:
                break  # the rest of this prompt goes in the next steps, ahead of later prompts
        return prefills, decodes

    def _drop_cancelled_prompts(self) -> None:
        for p in self._prefill_queue:
            if p.fut.cancelled():
                self._forget_prompt(p)
        self._prefill_queue = [p for p in self._prefill_queue if not p.fut.cancelled()]

    def _forget_prompt(self, p: _Pending) -> None:
        """A prompt's stream is gone: free the cache its first chunks made."""
        if p.created and not p.inp.cache_id:
            self.host.release_soon(p.created, "reclaimed")

    def _fits(self, prefills: list[_Pending], decodes: list[_Pending], extra: list[PrefillInput] = ()) -> bool:
        """Whether one forward over these rows (the prompts' chunks taken so far plus ``extra``)
        stays within the model's per-step ceilings."""
        reg, lim = self.host.executor.registry, self.host.limits
        rows = []
        cached = [p.cached for p in prefills]
        for k, inp in enumerate([c for c, _ in self._chunks] + list(extra)):
            past = reg.get(inp.cache_id).num_tokens if inp.cache_id in reg else cached[k] if k < len(cached) else 0
            rows.append((len(inp.token_ids) - (0 if inp.cache_id else past), past))
        for p in decodes:  # a speculating stream's row also carries its drafts
            rows.append((1 + len(p.inp.draft), reg.get(p.inp.cache_id).num_tokens if p.inp.cache_id in reg else 0))
        cost = self.host.executor.step_cost(rows, len(rows))
        return ((not lim.max_step_tokens or cost.positions <= lim.max_step_tokens)
                and (not lim.max_step_bytes or cost.scratch_bytes <= lim.max_step_bytes))

    async def _drain(self) -> None:
        while self._decode_queue or self._prefill_queue:
            await self._gather_stragglers()
            prefills, decodes = self._next_batch()
            self._expected = {p.inp.cache_id for p in decodes}
            if not prefills and not decodes:
                continue
            chunks = self._chunks
            try:
                pre, dec = (await self.host.call(self._step, [c for c, _ in chunks], decodes, admit=False)).value
            except errors.FerrumError as e:
                if len(prefills) + len(decodes) == 1:
                    (prefills or decodes)[0].fail(e)
                    self._forget_prompts(prefills)
                else:
                    await self._isolate(prefills, chunks, decodes)
                continue
            except Exception as e:  # noqa: BLE001
                for p in prefills + decodes:
                    p.fail(e)
                self._forget_prompts(prefills)
                continue
            for p, (chunk, last), r in zip(prefills, chunks, pre):
                self._advance(p, chunk, last, r)
            for p, r in zip(decodes, dec):
                self._resolve(p, r)
            # The streams resume on later loop turns; give them the chance to queue their next
            # step before this task decides the queue is empty and ends.
            await self._gather_stragglers()
        self._expected = set()

    async def _isolate(self, prefills: list[_Pending], chunks, decodes: list[_Pending]) -> None:
        """After a failed step (all or nothing: nothing of it was applied), fail only the stream
        that caused it. A prompt is the usual cause (its cache does not fit now): the prompts go
        alone first, and the running streams' decodes then run together, as one step."""
        for p, (chunk, last) in zip(prefills, chunks):
            try:
                pre1, _ = (await self.host.call(self._step, [chunk], [], admit=False)).value
                self._advance(p, chunk, last, pre1[0])
            except Exception as e2:  # noqa: BLE001 - forwarded to the stream that caused it
                p.fail(e2)
                self._forget_prompts([p])
        if not decodes:
            return
        try:
            _, dec = (await self.host.call(self._step, [], decodes, admit=False)).value
            for p, r in zip(decodes, dec):
                self._resolve(p, r)
            return
        except Exception:  # noqa: BLE001 - a decode itself fails: find which, one by one
            pass
        for p in decodes:
            try:
                _, dec1 = (await self.host.call(self._step, [], [p], admit=False)).value
                self._resolve(p, dec1[0])
            except Exception as e2:  # noqa: BLE001
                p.fail(e2)

    def _advance(self, p: _Pending, chunk: PrefillInput, last: bool, result) -> None:
        """A prompt's chunk ran: resolve the stream on its last chunk, else queue the rest first."""
        if last:
            self._resolve(p, result)
            return
        p.done += len(chunk.token_ids)
        p.created = result[0].cache.cache_id
        if p.fut.cancelled():
            self._forget_prompt(p)
        else:
            self._prefill_queue.insert(0, p)

    def _forget_prompts(self, prompts: list[_Pending]) -> None:
        for p in prompts:
            self._forget_prompt(p)

    def _resolve(self, p: _Pending, result) -> None:
        if not p.fut.done():
            p.fut.set_result(result)
        elif isinstance(p.inp, PrefillInput) and not p.inp.cache_id:
            self.host.release_soon(result[0].cache.cache_id, "reclaimed")  # its stream is gone

    def _step(self, prefills: list[PrefillInput], decodes: list[_Pending]):
        """One batched step on the worker: ([(PrefillOutput, RowResult)], [RowResult])."""
        pre, _, rows = self.host.step_and_sample(prefills, [p.inp for p in decodes])
        if prefills and decodes:
            self.mixed_steps += 1
        return list(zip(pre, rows[: len(pre)])), rows[len(pre):]


__all__ = ["ContinuousBatcher"]
