"""Continuous batching of ``Generate`` streams (the server's own, so a plain client gets it).

Every running stream's next decode step (:meth:`ContinuousBatcher.decode`) and new streams' prompts
(:meth:`ContinuousBatcher.prefill`) go into one queue per model. Each step takes every queued decode
step and as many new prompts as :attr:`ContinuousBatcher.prefill_tokens_per_step` allows, and runs
them as one forward on the model's worker (``ModelHost.step_and_sample``: the executor's
``mixed_step`` when both kinds are present), up to ``max_batch`` rows. Before a step it waits a few
milliseconds for the streams of the previous step to queue their next token (stragglers), so B
streams share one forward per token. A step that fails is all or nothing; its rows are then rerun
one by one so that one bad stream does not fail the others.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import errors
from .sampling import RowResult
from .types import DecodeInput, PrefillInput, PrefillOutput

if TYPE_CHECKING:
    from .host import ModelHost


@dataclass
class _Pending:
    """A stream's step waiting for the next batched forward."""

    inp: PrefillInput | DecodeInput
    fut: asyncio.Future

    def fail(self, e: BaseException) -> None:
        if not self.fut.done():
            self.fut.set_exception(e)


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
                return [self._prefill_queue.pop(0)], []
        max_batch = self.host.max_batch
        decodes = [p for p in self._decode_queue[:max_batch] if not p.fut.cancelled()]
        del self._decode_queue[:max_batch]
        prefills: list[_Pending] = []
        tokens = 0
        room = max_batch - len(decodes)
        while self._prefill_queue and len(prefills) < room:
            p = self._prefill_queue[0]
            if p.fut.cancelled():
                self._prefill_queue.pop(0)
                continue
            n = len(p.inp.token_ids)
            if prefills and tokens + n > self.prefill_tokens_per_step:
                break
            if (prefills or decodes) and not self._fits(prefills + [p], decodes):
                if not prefills:
                    self._prompt_alone_next = True
                break
            prefills.append(self._prefill_queue.pop(0))
            tokens += n
        return prefills, decodes

    def _drop_cancelled_prompts(self) -> None:
        self._prefill_queue = [p for p in self._prefill_queue if not p.fut.cancelled()]

    def _fits(self, prefills: list[_Pending], decodes: list[_Pending]) -> bool:
        """Whether one forward over these rows stays within the model's per-step ceilings."""
        reg, lim = self.host.executor.registry, self.host.limits
        rows = []
        for p in prefills:
            past = reg.get(p.inp.cache_id).num_tokens if p.inp.cache_id in reg else 0
            rows.append((len(p.inp.token_ids), past))
        for p in decodes:
            rows.append((1, reg.get(p.inp.cache_id).num_tokens if p.inp.cache_id in reg else 0))
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
            try:
                pre, dec = (await self.host.call(self._step, prefills, decodes, admit=False)).value
            except errors.FerrumError as e:
                if len(prefills) + len(decodes) == 1:
                    (prefills or decodes)[0].fail(e)
                else:
                    await self._isolate(prefills, decodes)
                continue
            except Exception as e:  # noqa: BLE001
                for p in prefills + decodes:
                    p.fail(e)
                continue
            for p, r in zip(prefills, pre):
                self._resolve(p, r)
            for p, r in zip(decodes, dec):
                self._resolve(p, r)
            # The streams resume on later loop turns; give them the chance to queue their next
            # step before this task decides the queue is empty and ends.
            await self._gather_stragglers()
        self._expected = set()

    async def _isolate(self, prefills: list[_Pending], decodes: list[_Pending]) -> None:
        """Rerun each row of a failed step alone, so only the stream that caused the failure gets
        it (the step was all or nothing, so nothing of it was applied)."""
        for p in prefills + decodes:
            one = ([p], []) if p in prefills else ([], [p])
            try:
                pre1, dec1 = (await self.host.call(self._step, *one, admit=False)).value
                self._resolve(p, (pre1 or dec1)[0])
            except Exception as e2:  # noqa: BLE001 - forwarded to the stream that caused it
                p.fail(e2)

    def _resolve(self, p: _Pending, result) -> None:
        if not p.fut.done():
            p.fut.set_result(result)
        elif isinstance(p.inp, PrefillInput) and not p.inp.cache_id:
            self.host.release_soon(result[0].cache.cache_id, "reclaimed")  # its stream is gone

    def _step(self, prefills: list[_Pending], decodes: list[_Pending]):
        """One batched step on the worker: ([(PrefillOutput, RowResult)], [RowResult])."""
        pre, _, rows = self.host.step_and_sample([p.inp for p in prefills], [p.inp for p in decodes])
        if prefills and decodes:
            self.mixed_steps += 1
        return list(zip(pre, rows[: len(pre)])), rows[len(pre):]


__all__ = ["ContinuousBatcher"]
