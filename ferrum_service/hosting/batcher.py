"""Continuous batching of ``Generate`` streams (the server's own, so a plain client gets it).

Every running stream's next decode step (:meth:`ContinuousBatcher.decode`) and new streams' prompts
(:meth:`ContinuousBatcher.prefill`) go into one queue per model. Each step takes every queued decode
step and prompt tokens up to a budget (chunked prefill: a longer prompt joins step after step, a
chunk at a time, continuing the cache its first chunk made): at most
:attr:`ContinuousBatcher.prefill_tokens_per_step`, and while streams decode, what the measured costs
say keeps the step within :attr:`ContinuousBatcher.tail_step_factor` decode steps (adaptive),
and runs them as one forward on the model's worker: one :class:`~ferrum_service.core.steps.StepPlan`
whose rows are the prompts' chunks and the decode steps, up to ``max_batch`` rows, within the
model's per-step ceilings (``StepPlan.fits``). So running streams keep their
pace while prompts arrive: a step costs at most their decodes plus one budget of prompt tokens. Before a step it waits a few
milliseconds for the streams of the previous step to queue their next token (stragglers), so B
streams share one forward per token. A step that fails is all or nothing; its rows are then rerun
one by one so that one bad stream does not fail the others.

A lone stream (one decode row, nothing else queued) on an executor whose steps chain
(``chains_decodes``: the llama.cpp and transformers executors) does not return to the event loop
between steps: the worker runs its next step itself, feeding the token it just sampled, and posts
each row to the loop (:meth:`ContinuousBatcher._chain`). It runs at most one step ahead of the
stream's asking for it, and none after a step the stream marks its last (``HeldDecode.chain``
false: its ``max_tokens``); any other work for the worker (a prompt, another stream's step, a
unary call, a release) stops the chain after the step it runs. A step run ahead that the stream
never asks for is freed with the cache the stream frees at its end, or undone (``settle``:
``truncate_kv``) before a move reads the cache or a different step follows.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import structlog

from ..core import errors
from ..core.kv_registry import CacheEntry, CacheRegistry
from ..core.sampling import RowResult
from ..core.settings import default
from ..core.steps import RowOutput, StepPlan, StepResult, StepRow
from ..core.types import DecodeInput, LogitsPolicy, OutputMode, PrefillInput
from .host import ModelHost
from .step_costs import StepCostModel

log = structlog.get_logger("ferrum_service.hosting.batcher")


@dataclass
class HeldDecode(DecodeInput):
    """A decode step of a stream that holds its cache's entry (``generate.py``): queued with it, so
    the step needs no look-up of the cache (its liveness is the entry's ``released``)."""

    entry: CacheEntry | None = None
    #: The stream feeds each step's sampled token into its next step and nothing else (no drafts,
    #: no constraint, one sample, a cache it owns and frees at its end): the worker may run the
    #: next step ahead of the stream's asking for it (see :class:`_Chain`).
    chain: bool = False


@dataclass
class _Pending:
    """A stream's step waiting for the next batched forward. A prompt taken in chunks keeps its
    progress here: ``done`` tokens are in the cache ``created`` (made by its first chunk)."""

    inp: PrefillInput | DecodeInput
    fut: asyncio.Future
    entry: CacheEntry | None = None  # a decode step's cache, when its stream holds it (no look-up)
    done: int = 0
    created: str = ""
    cached: int = 0  # leading tokens of the prompt's first chunk the prefix cache holds now
    queued_at: float = field(default_factory=time.perf_counter)

    def fail(self, e: BaseException) -> None:
        if not self.fut.done():
            self.fut.set_exception(e)

    def chunk(self, size: int, reg: CacheRegistry) -> tuple[StepRow, bool]:
        """The next ``size`` tokens of this prompt as a step row, and whether they are its last. A
        chunk before the last asks for no logits (nothing is sampled in the middle of a prompt; a
        structured-output constraint starts where the whole prompt ends)."""
        inp = self.inp
        ids = list(inp.token_ids[self.done:self.done + size])
        last = self.done + len(ids) >= len(inp.token_ids)
        cache_id = self.created or inp.cache_id
        part = dataclasses.replace(inp, token_ids=ids, cache_id=cache_id,
                                   reserve_tokens=inp.reserve_tokens if not self.done else 0,
                                   policy=inp.policy if last else _NO_OUTPUT)
        return StepRow.prompt(part, reg.get(cache_id) if cache_id else None, cached=self.cached), last


#: The policy of a chunk in the middle of a prompt: no logits, nothing sampled.
_NO_OUTPUT = LogitsPolicy(mode=OutputMode.NONE)


class ContinuousBatcher:
    """The step queue of one hosted model's ``Generate`` streams."""

    #: Prompt tokens one batched step may take on top of the running streams' decode tokens. New
    #: prompts join the running batch (one forward for both) up to this many tokens per step, so a
    #: burst of new streams delays the running ones by a bounded amount per step.
    prefill_tokens_per_step = default("prefill_chunk_tokens")
    #: Longest wait (seconds) for streams of the previous batch to resubmit before a batch runs.
    straggler_wait_s = 0.005
    #: Adaptive prompt budget: while streams are decoding, the prompt tokens a step takes are sized
    #: from the measured costs so that the step lasts about this many times a decode-only step
    #: (within [:attr:`min_prompt_tokens`, :attr:`prefill_tokens_per_step`]); a burst of arriving
    #: prompts then stretches the running streams' inter-token latency by this factor at most,
    #: instead of by a whole budget of prefill. 0 = a fixed budget of :attr:`prefill_tokens_per_step`.
    tail_step_factor = default("prefill_tail_factor")
    min_prompt_tokens = 16
    #: Called with the seconds a prompt waited in the queue when its first chunk joins a step
    #: (the server's ``ferrum_queue_seconds``).
    on_queue_wait: Callable[[float], None] | None = None

    def __init__(self, host: "ModelHost") -> None:
        self.host = host
        self._decode_queue: list[_Pending] = []  # decode steps of running streams
        self._prefill_queue: list[_Pending] = []  # prompts of new streams
        self._task: asyncio.Task | None = None
        # Streams of the last batch that have not resubmitted (or ended) yet; the next batch waits a
        # little for them (see ``_gather_stragglers``).
        self._expected: set[str] = set()
        # While the loop waits for stragglers: the streams still missing, and the future that wakes
        # it when the last of them queues (no polling of the event loop meanwhile).
        self._missing: set[str] = set()
        self._all_back: asyncio.Future | None = None
        self.mixed_steps = 0  # steps that joined new prompts with running decodes (diagnostics)
        self._prompt_alone_next = False  # a prompt too costly to join the decodes goes first, alone
        self.costs = StepCostModel()  # measured: what a step's decode rows and prompt tokens cost
        self._stepping: _Batch | None = None  # the batch whose forward runs now
        self._chains: dict[str, _Chain] = {}  # cache id -> its chain of decode steps (running, or one step ahead)
        self._running_chain: _Chain | None = None
        host.attach(self)

    def configure(self, prefill_tokens_per_step: int, tail_step_factor: float) -> None:
        """The server's prompt-chunk settings (``--prefill-chunk-tokens``, ``--prefill-tail-factor``)."""
        self.prefill_tokens_per_step = prefill_tokens_per_step
        self.tail_step_factor = tail_step_factor

    @property
    def queued_prompts(self) -> int:
        """New streams' prompts waiting for a step (they count against the host's queue limit)."""
        return len(self._prefill_queue)

    def prompt_work(self) -> tuple[int, int, int]:
        """Prompt tokens still to compute: (in the queue and in the step running now, in the queue
        for prompts that have not started, in the step running now). What the load record reports
        as the engine's prefill work in hand (``vllm_load.py``); O(queued prompts), on the loop."""
        queued = fresh = 0
        for p in self._prefill_queue:
            left = len(p.inp.token_ids) - p.done
            queued += left
            if not p.done:
                fresh += left
        b = self._stepping
        running = sum(len(p.inp.token_ids) - p.done for p in b.prompts) if b is not None else 0
        return queued + running, fresh, running

    def forget(self, cache_id: str) -> None:
        """A stream's cache is gone: the next step does not wait for it (and a step the worker
        ran ahead for it is dropped with the cache)."""
        ch = self._chains.pop(cache_id, None)
        if ch is not None:
            ch.halt()
        self._expected.discard(cache_id)
        self._arrived(cache_id)

    # ---- what streams call ------------------------------------------------------------------------
    async def decode(self, inp: DecodeInput) -> RowResult:
        """One decode step + sampling, batched with whatever other streams run right now (the
        repetition-penalty history is the cache's tokens). A :class:`HeldDecode` carries its
        cache; a plain input's is looked up when the step is batched."""
        ch = self._chains.get(inp.cache_id)
        if ch is not None:
            fut = self._claim(ch, inp)
            if fut is not None:
                return await fut
            await self.settle(inp.cache_id)  # not the step the worker ran ahead: undo that one
        self._halt_chain()
        fut = asyncio.get_running_loop().create_future()
        self._decode_queue.append(_Pending(inp, fut, inp.entry if isinstance(inp, HeldDecode) else None))
        self._arrived(inp.cache_id)
        self._kick()
        return await fut

    async def prefill(self, inp: PrefillInput) -> tuple[RowOutput, RowResult]:
        """A stream's prompt (+ sampling of its first token), run in the same forward as the running
        streams' decode steps. New work: refused at once past the host's queue limit. If the stream
        is cancelled while its step runs, the cache the step created is reclaimed."""
        self.host.check_accepting()
        self._halt_chain()
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
        """Wait until every stream of the previous batch has queued its next step (or ended), at
        most :attr:`straggler_wait_s` (woken by the last one to queue: :meth:`_arrived`).

        Without this wait a batch is cut as soon as the first few streams of the previous batch are
        back (the others are still sending their token event), so B streams split into two or
        more forwards per token — each costing nearly a full weight read on a memory-bound model.
        """
        await asyncio.sleep(0)
        if not self._expected or len(self._decode_queue) >= self.host.max_batch:
            return
        missing = self._expected - {p.inp.cache_id for p in self._decode_queue}
        if not missing:
            return
        loop = asyncio.get_running_loop()
        self._missing, self._all_back = missing, loop.create_future()
        timer = loop.call_later(self.straggler_wait_s, self._wake_up)
        try:
            await self._all_back
        finally:
            timer.cancel()
            self._missing, self._all_back = set(), None

    def _arrived(self, cache_id: str) -> None:
        """A stream the loop waits for queued its step (or ended): wake it when none is missing."""
        if self._all_back is None:
            return
        self._missing.discard(cache_id)
        if not self._missing or len(self._decode_queue) >= self.host.max_batch:
            self._wake_up()

    def _wake_up(self) -> None:
        if self._all_back is not None and not self._all_back.done():
            self._all_back.set_result(None)

    def _next_batch(self) -> "_Batch":
        """Up to ``max_batch`` rows: every queued decode step first, then new prompts (oldest
        first) while the room, :attr:`prefill_tokens_per_step` and the model's per-step ceilings
        allow (at least one prompt when there is room). A prompt that cannot join the running
        decodes within the ceilings (padding makes a long prompt cost rows x its length) runs
        alone in the next step."""
        reg = self.host.executor.registry
        batch = _Batch()
        if self._prompt_alone_next:
            self._prompt_alone_next = False
            self._drop_cancelled_prompts()
            if self._prefill_queue:
                p = self._prefill_queue.pop(0)
                self._leaves_queue(p)
                batch.add_prompt(p, *p.chunk(len(p.inp.token_ids) - p.done, reg))
                return batch
        max_batch = self.host.max_batch
        for p in self._decode_queue[:max_batch]:
            if p.fut.cancelled():
                continue
            if p.entry.released if p.entry is not None else p.inp.cache_id not in reg:  # gone while it waited
                p.fail(errors.not_found(f"cache {p.inp.cache_id!r} is gone", field="cache_id"))
                continue
            batch.add_decode(p, reg)
        del self._decode_queue[:max_batch]
        if any(r.drafts for r in batch.decode_rows) and not self._fits(batch):
            for p in batch.decodes:  # drafts past the step's ceilings: this step verifies none
                p.inp.draft = []
            batch.rebuild_decodes(reg)
        tokens = 0
        room = max_batch - len(batch.decodes)
        # The cost fit (two least-squares solves after each measured step) only when a prompt waits.
        per_step = self.prompt_budget(len(batch.decodes)) if self._prefill_queue else 0
        while self._prefill_queue and len(batch.prompts) < room:
            p = self._prefill_queue[0]
            if p.fut.cancelled():
                self._forget_prompt(self._prefill_queue.pop(0))
                continue
            left = len(p.inp.token_ids) - p.done
            budget = per_step - tokens
            if budget <= 0:
                break
            # A new prompt's first chunk also takes the tokens the prefix cache holds: they cost
            # nothing to compute, so they do not count against the budget.
            p.cached = self.host.executor.cached_prefix(p.inp) if not p.done and not p.inp.cache_id else 0
            # Only a running batch is protected by chunking; alone, a prompt goes in one step.
            size = min(left, budget + p.cached) if batch.rows else left
            row, last = p.chunk(size, reg)
            if batch.rows and not self._fits(batch, row):
                if not batch.prompts:
                    self._prompt_alone_next = True
                break
            self._prefill_queue.pop(0)
            self._leaves_queue(p)
            batch.add_prompt(p, row, last)
            tokens += row.computed
            if not last:
                break  # the rest of this prompt goes in the next steps, ahead of later prompts
        return batch

    def _leaves_queue(self, p: _Pending) -> None:
        if not p.done and self.on_queue_wait is not None:  # a prompt's first chunk: its queue wait is over
            self.on_queue_wait(time.perf_counter() - p.queued_at)

    def prompt_budget(self, decode_rows: int) -> int:
        """Prompt tokens the next step may compute: :attr:`prefill_tokens_per_step`, or, while
        ``decode_rows`` streams are decoding and the costs are measured, what keeps the step within
        :attr:`tail_step_factor` decode steps of those rows."""
        cap = self.prefill_tokens_per_step
        if not (decode_rows and self.tail_step_factor):
            return cap
        decode_s, token_s = self.costs.decode_s(decode_rows), self.costs.token_s()
        if decode_s is None or token_s is None:
            return cap
        fit = int((self.tail_step_factor - 1.0) * decode_s / token_s + 1e-6)  # (not 49.999... for 50)
        return max(min(self.min_prompt_tokens, cap), min(cap, fit))

    def _measure(self, batch: "_Batch", seconds: float) -> None:
        """Record a step's forward time against its decode rows and computed prompt tokens (and
        log it at debug level with what the cost model expected: ``--log-level debug`` shows why a
        step ran long)."""
        rows, tokens = len(batch.decodes), sum(r.computed for r in batch.prompt_rows)
        if not log.is_enabled_for(logging.DEBUG):  # the fit costs ~0.5 ms a step (busy 2-core machine)
            self.costs.add(rows, tokens, seconds)
            return
        decode_s, token_s = self.costs.decode_s(rows), self.costs.token_s()
        log.debug("batched step", model_id=self.host.model_id, decode_rows=rows, prompt_tokens=tokens,
                  forward_ms=round(seconds * 1e3, 2),
                  expected_ms=None if decode_s is None else round((decode_s + token_s * tokens) * 1e3, 2),
                  decode_only_ms=None if decode_s is None else round(decode_s * 1e3, 2))
        self.costs.add(rows, tokens, seconds)

    def _drop_cancelled_prompts(self) -> None:
        for p in self._prefill_queue:
            if p.fut.cancelled():
                self._forget_prompt(p)
        self._prefill_queue = [p for p in self._prefill_queue if not p.fut.cancelled()]

    def _forget_prompt(self, p: _Pending) -> None:
        """A prompt's stream is gone: free the cache its first chunks made."""
        if p.created and not p.inp.cache_id:
            self.host.release_soon(p.created, "reclaimed")

    def _fits(self, batch: "_Batch", extra: StepRow | None = None) -> bool:
        """Whether one forward over the batch's rows (plus ``extra``) stays within the model's
        per-step ceilings."""
        rows = batch.rows + ([extra] if extra is not None else [])
        return StepPlan(rows).fits(self.host.limits, self.host.executor)

    async def _drain(self) -> None:
        gathered = False  # the end of the last step already waited for its streams
        while self._decode_queue or self._prefill_queue:
            if not gathered:
                await self._gather_stragglers()
            gathered = False
            try:
                batch = self._next_batch()
            except Exception as e:  # noqa: BLE001 - a bug here must fail the streams, not strand them
                self._fail_queued(e)
                continue
            self._expected = {p.inp.cache_id for p in batch.decodes}
            if not batch.rows:
                continue
            if self._chainable(batch):
                await self._chain(batch)
                await self._gather_stragglers()
                gathered = True
                continue
            self._stepping = batch
            try:
                result = await self._step(batch.rows)
            except errors.FerrumError as e:
                if len(batch.rows) == 1:
                    (batch.prompts or batch.decodes)[0].fail(e)
                    self._forget_prompts(batch.prompts)
                else:
                    await self._isolate(batch)
                continue
            except Exception as e:  # noqa: BLE001
                for p in batch.prompts + batch.decodes:
                    p.fail(e)
                self._forget_prompts(batch.prompts)
                continue
            finally:
                self._stepping = None
            if batch.prompts and batch.decodes:
                self.mixed_steps += 1
            self._measure(batch, result.forward_s)
            n = len(batch.prompts)
            for k, (p, last) in enumerate(zip(batch.prompts, batch.last)):
                self._advance(p, batch.rows[k], last, result.outputs[k], result.rows[k])
            for p, r in zip(batch.decodes, result.rows[n:]):
                self._resolve(p, r)
            # The streams resume on later loop turns; give them the chance to queue their next
            # step before this task decides the queue is empty and ends.
            await self._gather_stragglers()
            gathered = True
        self._expected = set()

    def _fail_queued(self, e: BaseException) -> None:
        """Fail every queued step with ``e`` (and free what its prompts' first chunks made)."""
        queued, self._decode_queue, prompts, self._prefill_queue = self._decode_queue, [], self._prefill_queue, []
        for p in queued + prompts:
            p.fail(e)
        self._forget_prompts(prompts)

    async def _isolate(self, batch: "_Batch") -> None:
        """After a failed step (all or nothing: nothing of it was applied), fail only the stream
        that caused it. A prompt is the usual cause (its cache does not fit now): the prompts go
        alone first, and the running streams' decodes then run together, as one step."""
        n = len(batch.prompts)
        for k, (p, last) in enumerate(zip(batch.prompts, batch.last)):
            try:
                res = await self._step([batch.rows[k]])
                self._advance(p, batch.rows[k], last, res.outputs[0], res.rows[0])
            except Exception as e2:  # noqa: BLE001 - forwarded to the stream that caused it
                p.fail(e2)
                self._forget_prompts([p])
        if not batch.decodes:
            return
        try:
            res = await self._step(batch.rows[n:])
            for p, r in zip(batch.decodes, res.rows):
                self._resolve(p, r)
            return
        except Exception:  # noqa: BLE001 - a decode itself fails: find which, one by one
            pass
        for p, row in zip(batch.decodes, batch.rows[n:]):
            try:
                self._resolve(p, (await self._step([row])).rows[0])
            except Exception as e2:  # noqa: BLE001
                p.fail(e2)

    def _advance(self, p: _Pending, row: StepRow, last: bool, out: RowOutput, sampled: RowResult | None) -> None:
        """A prompt's chunk ran: resolve the stream on its last chunk, else queue the rest first."""
        if last:
            self._resolve(p, (out, sampled))
            return
        p.done += len(row.tokens)
        p.created = out.cache.cache_id
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

    # ---- a lone stream's steps chained on the worker --------------------------------------------
    def _chainable(self, batch: "_Batch") -> bool:
        """A batch of one decode step of a stream that allows chaining (:attr:`HeldDecode.chain`),
        nothing else waiting, on an executor whose steps chain (``chains_decodes``)."""
        if batch.prompts or len(batch.decodes) != 1 or self._decode_queue or self._prefill_queue:
            return False
        p = batch.decodes[0]
        ex = self.host.executor
        return (isinstance(p.inp, HeldDecode) and p.inp.chain and p.entry is not None and not p.inp.draft
                and ex.chains_decodes and not ex.inline)

    async def _chain(self, batch: "_Batch") -> None:
        """Run the batch's one decode step, then, on the worker without a return to the event loop
        in between, the stream's next steps (each feeding the token the last one sampled) while
        the stream keeps asking for them (:meth:`_claim`) and nothing else waits for the worker.
        Each step's row is posted to the loop as it is made. At most one step runs ahead of the
        stream's asking: when the stream stops, the cache holds one token more than it fed (freed
        with the cache; :meth:`settle` truncates it where the cache lives on)."""
        p, row = batch.decodes[0], batch.decode_rows[0]
        loop = asyncio.get_running_loop()
        ch = _Chain(p, batch)
        host, entry, inp = self.host, p.entry, p.inp
        self._chains[ch.cache_id] = ch

        def post(value) -> None:
            try:
                loop.call_soon_threadsafe(self._deliver, ch, value)
            except RuntimeError:  # the loop is closed (shutdown): nobody waits
                pass

        def work(executor, plan: StepPlan) -> None:
            res = host.run_step(executor, plan)  # the first step's failure is the batch's (below)
            while True:
                r = res.rows[0]
                with ch.lock:
                    go = (not ch.stop and ch.claimed and r is not None and r.token_id is not None and not r.extra
                          and not r.no_selectable_finite_logit and not entry.released)
                    if go:
                        ch.claimed, ch.ahead, ch.token = False, True, r.token_id
                if not go:
                    post(res)
                    return
                host.progress.completed()  # a step completed (the call records its last one): no stall
                # This row is posted when the next step's llama_decode starts (it releases the GIL):
                # the loop's work on it (the token's event, the send) then overlaps the forward
                # instead of contending with the step's own Python for the GIL.
                held = [res]

                def flush() -> None:
                    if held:
                        post(held.pop())

                nxt = StepPlan([StepRow.decode(dataclasses.replace(inp, token_id=r.token_id, draft=[]), entry,
                                               "inputs")], "inputs", refuse_broken=False, transient=True,
                               on_forward=flush)
                try:
                    res = host.run_step(executor, nxt)
                except BaseException as e:  # noqa: BLE001 - the stream gets it when it asks for this step
                    flush()
                    post(e)
                    return
                flush()  # an executor that does not call on_forward

        self._stepping, self._running_chain, host.interrupt = batch, ch, ch.halt
        try:
            await host.call(work, host.executor, StepPlan([row], "inputs", refuse_broken=False, transient=True),
                            admit=False, interrupts=False)
        except Exception as e:  # noqa: BLE001 - the first step failed: nothing of it was applied
            p.fail(e)
        finally:
            ch.halt()
            self._stepping, self._running_chain, host.interrupt = None, None, None
            ch.running = False
            if not ch.ended.done():
                ch.ended.set_result(None)
            if not ch.ahead and self._chains.get(ch.cache_id) is ch:
                del self._chains[ch.cache_id]

    def _deliver(self, ch: "_Chain", value) -> None:
        """A chained step's result (on the loop, in step order): to the stream waiting for it, or
        kept until the stream asks (:meth:`_claim`)."""
        self.host.steps.tick()
        if isinstance(value, StepResult):
            self._measure(ch.batch, value.forward_s)
            value = value.rows[0]
        w, ch.waiter = ch.waiter, None
        if w is not None and not w.done():
            w.set_exception(value) if isinstance(value, BaseException) else w.set_result(value)
        elif w is not None:  # the stream stopped waiting (it ends): run no further ahead
            ch.halt()
        else:
            ch.parked = value

    def _claim(self, ch: "_Chain", inp: DecodeInput) -> asyncio.Future | None:
        """The stream asks for the step the worker runs (or ran) ahead: a future of its row, or
        None when the ask is not that step (another token, drafts)."""
        with ch.lock:
            if not ch.ahead or ch.waiter is not None or inp.draft or inp.token_id != ch.token:
                return None
            ch.ahead, ch.claimed = False, True
            if not (isinstance(inp, HeldDecode) and inp.chain):  # the stream's last step: none after it
                ch.stop = True
        fut = asyncio.get_running_loop().create_future()
        if ch.parked is not None:
            value, ch.parked = ch.parked, None
            fut.set_exception(value) if isinstance(value, BaseException) else fut.set_result(value)
        else:
            ch.waiter = fut
        if not ch.running and self._chains.get(ch.cache_id) is ch:
            del self._chains[ch.cache_id]
        return fut

    def ran_ahead(self, cache_id: str) -> bool:
        """Whether the worker runs (or ran) a step of the cache's chain that its stream has not
        asked for yet (known before the stream gets the row of the step before it)."""
        ch = self._chains.get(cache_id)
        return ch is not None and ch.ahead

    def _halt_chain(self) -> None:
        if self._running_chain is not None:
            self._running_chain.halt()

    async def settle(self, cache_id: str) -> None:
        """Stop the cache's chain of steps; a step the worker ran ahead that its stream did not ask
        for is taken out of the cache again (``truncate_kv``), so the cache holds exactly what the
        stream fed (before a move reads it, or a different step follows)."""
        ch = self._chains.get(cache_id)
        if ch is None:
            return
        ch.halt()
        await asyncio.shield(ch.ended)
        if self._chains.get(cache_id) is ch:
            del self._chains[cache_id]
        extra = ch.ahead and isinstance(ch.parked, RowResult)  # a failed step undid itself
        ch.ahead, ch.parked = False, None
        entry = ch.entry
        if extra and not entry.released:
            await self.host.call(self.host.executor.truncate_kv, cache_id, entry.num_tokens - 1, admit=False)

    async def _step(self, rows: list[StepRow]):
        """One batched step on the worker (``steps.run``): its :class:`StepResult`. A row whose
        fed token broke its constraint is not refused here: streams sample under the mask."""
        return (await self.host.step(StepPlan(rows, "inputs", refuse_broken=False, transient=True), admit=False)).value


class _Chain:
    """A lone stream's decode steps chained on the worker (:meth:`ContinuousBatcher._chain`).
    ``lock`` guards what both threads read: ``stop``, ``claimed`` (the stream asked for the step
    that runs now), ``ahead`` (a step runs or ran that the stream has not asked for yet) and
    ``token`` (the token that step feeds)."""

    def __init__(self, p: _Pending, batch: "_Batch") -> None:
        self.cache_id = p.inp.cache_id
        self.entry = p.entry
        self.batch = batch
        self.lock = threading.Lock()
        self.stop = False
        self.claimed = True
        self.ahead = False
        self.token: int | None = None
        self.waiter: asyncio.Future | None = p.fut  # who gets the next step's row
        self.parked = None  # a step's row (or error) made before the stream asked for it
        self.running = True
        self.ended: asyncio.Future = asyncio.get_running_loop().create_future()

    def halt(self) -> None:
        """Stop after the step that runs now (any thread)."""
        with self.lock:
            self.stop = True


class _Batch:
    """The rows of the next step: the prompts' chunks first (with whether each is its prompt's
    last), then the decode steps."""

    def __init__(self) -> None:
        self.prompts: list[_Pending] = []
        self.last: list[bool] = []
        self.decodes: list[_Pending] = []
        self.prompt_rows: list[StepRow] = []
        self.decode_rows: list[StepRow] = []

    @property
    def rows(self) -> list[StepRow]:
        return self.prompt_rows + self.decode_rows

    def add_prompt(self, p: _Pending, row: StepRow, last: bool) -> None:
        self.prompts.append(p)
        self.prompt_rows.append(row)
        self.last.append(last)

    def add_decode(self, p: _Pending, reg: CacheRegistry) -> None:
        self.decodes.append(p)
        self.decode_rows.append(self._decode_row(p, reg))

    def rebuild_decodes(self, reg: CacheRegistry) -> None:
        """The decode rows again, after their streams' inputs changed (drafts dropped)."""
        self.decode_rows = [self._decode_row(p, reg) for p in self.decodes]

    @staticmethod
    def _decode_row(p: _Pending, reg: CacheRegistry) -> StepRow:
        return StepRow.decode(p.inp, p.entry or reg.get(p.inp.cache_id), "inputs")


__all__ = ["ContinuousBatcher", "HeldDecode"]
