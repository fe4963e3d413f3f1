"""A hosted model: its executor, the worker thread it runs on, and per-cache step exclusion.

``ModelHost.call`` runs one executor method off the event loop on the model's single worker thread
(so model state needs no locks and forward passes never block the server), or inline for cheap
executors. ``ModelHost.hold`` marks caches busy for the duration of a step: a second step on a
busy cache is refused with ABORTED instead of racing it; holding a cache also renews its lease
(``last_access``, see ``leases.py``). ``max_queue`` bounds the steps waiting for the worker: past
it new steps are refused at once with RESOURCE_EXHAUSTED (releases and shutdown are never refused,
and decode steps of running ``Generate`` streams are not new work).

Continuous batching (the server's own, so a plain ``Generate`` client gets it): every running
stream's next decode step (``decode_batched``) and new streams' prompts (``prefill_batched``) go
into one queue; each step takes all queued decode steps and as many new prompts as
``prefill_tokens_per_step`` allows, and runs them as one forward (``mixed_step``), up to
``max_batch`` rows (never more than the executor's own limit).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from . import errors
from .executors.base import ModelExecutor
from .sampling import RowResult, process_rows
from .types import DecodeInput, PrefillInput, PrefillOutput


def new_worker(name: str) -> concurrent.futures.ThreadPoolExecutor:
    """A model's worker: one thread that runs all of its torch work.

    Load the model on it too (``new_worker(...).submit(load).result()``): each thread that runs
    parallel torch ops gets its own OpenMP thread team, and a second team (the loading thread's)
    competing for the same cores made every served step ~20-30 % slower on a 2-core CPU
    (BatchDecode B=8 on SmolLM2: 81-91 ms per step with one team, 104-125 ms with two)."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"exec-{name}")


@dataclass
class _Pending:
    """A Generate stream's step waiting for the next batched forward."""

    inp: PrefillInput | DecodeInput
    fut: asyncio.Future

    def fail(self, e: BaseException) -> None:
        if not self.fut.done():
            self.fut.set_exception(e)


@dataclass
class Timed:
    """An executor call's result and where its time went."""

    value: Any
    queued_ns: int
    forward_ns: int


class ModelHost:
    """One model served by the server."""

    def __init__(self, model_id: str, executor: ModelExecutor, *, max_batch: int = 64, max_queue: int = 0,
                 worker: concurrent.futures.ThreadPoolExecutor | None = None) -> None:
        """``worker``: the single-thread pool the executor was loaded on (see :func:`new_worker`);
        default a new one."""
        self.model_id = model_id
        self.executor = executor
        self.info = executor.info()
        self.vocab_size = self.info.vocab_size
        caps = executor.capabilities()
        # Fixed for an executor's life; checked on every step, so read once.
        self.supports_generation = caps.supports_generation
        # A batched step never exceeds what the executor takes in one forward.
        self.max_batch = min(max_batch, caps.max_batch_size or max_batch)
        self.max_queue = max_queue  # steps allowed to wait for the worker (0 = unbounded)
        self._pool = worker or new_worker(model_id)
        self._busy: set[str] = set()
        self._decode_queue: list[_Pending] = []  # decode steps of running Generate streams
        self._prefill_queue: list[_Pending] = []  # prompts of new Generate streams
        self._batch_task: asyncio.Task | None = None
        # Streams of the last decode batch that have not resubmitted (or ended) yet; the next batch
        # waits a little for them (see ``_gather_stragglers``).
        self._expected: set[str] = set()
        self.decode_batch_sizes: list[int] = []  # recent decode batch sizes (diagnostics, bounded)
        self.mixed_steps = 0  # batched steps that joined new prompts with running decodes (diagnostics)
        self.running = 0  # steps executing or queued on the worker
        self._pending_releases: set[asyncio.Task] = set()

    # ---- running executor methods -------------------------------------------------------------
    @property
    def waiting(self) -> int:
        """Steps queued behind the one the worker is running (new Generate prompts included)."""
        return max(0, self.running - 1) + len(self._prefill_queue)

    def _admit(self, fn: Callable[..., Any]) -> None:
        if not self.max_queue or self.executor.inline:
            return
        if fn == self.executor.release_cache or fn == self.executor.shutdown:
            return  # freeing memory is never refused
        if self.waiting >= self.max_queue:
            raise errors.exhausted(
                f"model {self.model_id!r}: {self.waiting} steps are waiting for its worker; the queue limit "
                f"is {self.max_queue}",
                retry_after_ms=50,
                model_id=self.model_id,
                queued=self.waiting,
                limit=self.max_queue,
            )

    async def call(self, fn: Callable[..., Any], *args: Any, admit: bool = True,
                   on_orphan: Callable[[Any], None] | None = None) -> Timed:
        """Run ``fn(*args)`` on the model's worker (inline for cheap executors).

        ``admit=False`` skips the queue limit (steps of work already admitted). ``on_orphan``:
        called with the result when the caller was cancelled while ``fn`` ran (or just after it
        finished): whatever the step created (caches) has nobody to hand it to, so it is freed."""
        if self.executor.state == "shutdown":
            raise errors.unavailable(f"model {self.model_id!r} is shut down", model_id=self.model_id)
        if admit:
            self._admit(fn)
        submitted = time.perf_counter_ns()
        self.running += 1
        try:
            if self.executor.inline:
                value = fn(*args)
                done = time.perf_counter_ns()
                return Timed(value, 0, done - submitted)
            started: list[int] = []

            def run() -> Any:
                started.append(time.perf_counter_ns())
                return fn(*args)

            fut = asyncio.get_running_loop().run_in_executor(self._pool, run)
            try:
                # shield: a cancelled caller must not lose the result of a step that ran anyway
                value = await asyncio.shield(fut)
            except asyncio.CancelledError:
                def orphaned(f: asyncio.Future) -> None:
                    if not f.cancelled() and f.exception() is None and on_orphan is not None:
                        on_orphan(f.result())

                fut.add_done_callback(orphaned)  # also retrieves an exception nobody awaits now
                raise
            done = time.perf_counter_ns()
            return Timed(value, started[0] - submitted, done - started[0])
        finally:
            self.running -= 1

    @contextlib.contextmanager
    def hold(self, cache_ids: Iterable[str], field: str):
        """Mark caches busy for one step; ABORTED if another step holds one of them."""
        ids = [c for c in cache_ids if c]
        for c in ids:
            if c in self._busy:
                raise errors.busy(
                    f"{field}: cache {c!r} is busy with another step; steps on one cache must not overlap",
                    field=field,
                    cache_id=c,
                )
        self._busy.update(ids)
        reg = self.executor.registry
        for c in ids:
            reg.touch(c)
        try:
            yield
        finally:
            self._busy.difference_update(ids)
            for c in ids:
                reg.touch(c)

    def is_busy(self, cache_id: str) -> bool:
        return cache_id in self._busy

    def release_soon(self, cache_id: str, reason: str = "released") -> None:
        """Free a cache from a ``finally`` that may run inside a cancelled task.

        The release runs as its own task (not the cancelled one), so a second cancellation cannot
        interrupt it and leak the cache."""
        self._expected.discard(cache_id)
        if cache_id not in self.executor.registry:
            return
        if self.executor.inline:
            self.executor.release_cache(cache_id, reason)
            return

        async def _release() -> None:
            try:
                await asyncio.get_running_loop().run_in_executor(self._pool, self.executor.release_cache, cache_id, reason)
            except Exception:  # noqa: BLE001 - the pool is gone at shutdown; the executor frees all then
                pass

        task = asyncio.get_running_loop().create_task(_release())
        self._pending_releases.add(task)
        task.add_done_callback(self._pending_releases.discard)

    async def drain_releases(self) -> None:
        """Wait for releases scheduled by :meth:`release_soon`."""
        while self._pending_releases:
            await asyncio.gather(*list(self._pending_releases), return_exceptions=True)

    def shutdown_pool(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- continuous batching of Generate streams ------------------------------------------------
    #: Prompt tokens one batched step may take on top of the running streams' decode tokens. New
    #: prompts join the running batch (one forward for both) up to this many tokens per step, so a
    #: burst of new streams delays the running ones by a bounded amount per step.
    prefill_tokens_per_step = 512

    def _kick(self) -> None:
        if self._batch_task is None or self._batch_task.done():
            self._batch_task = asyncio.create_task(self._drain())

    async def decode_batched(self, inp: DecodeInput) -> RowResult:
        """One decode step + sampling, batched with whatever other streams run right now. The
        repetition-penalty history is the cache's tokens (see :meth:`decode_and_sample`)."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._decode_queue.append(_Pending(inp, fut))
        self._kick()
        return await fut

    async def prefill_batched(self, inp: PrefillInput) -> tuple[PrefillOutput, RowResult]:
        """A ``Generate`` stream's prompt (+ sampling of its first token), run in the same forward
        as the running streams' decode steps. New work: refused at once past ``max_queue``. If the
        stream is cancelled while its step runs, the cache the step created is reclaimed."""
        if self.executor.state == "shutdown":
            raise errors.unavailable(f"model {self.model_id!r} is shut down", model_id=self.model_id)
        self._admit(None)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._prefill_queue.append(_Pending(inp, fut))
        self._kick()
        try:
            return await fut
        except asyncio.CancelledError:
            # cancelled after the step set its result but before this task resumed
            if fut.done() and not fut.cancelled() and fut.exception() is None and not inp.cache_id:
                self.release_soon(fut.result()[0].cache.cache_id, "reclaimed")
            raise

    #: Longest wait (seconds) for streams of the previous batch to resubmit before a batch runs.
    straggler_wait_s = 0.005

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
        while loop.time() < deadline and len(self._decode_queue) < self.max_batch:
            queued = {p.inp.cache_id for p in self._decode_queue}
            if self._expected <= queued:
                break
            await asyncio.sleep(0)

    def _next_batch(self) -> tuple[list["_Pending"], list["_Pending"]]:
        """Up to ``max_batch`` rows: every queued decode step first, then new prompts (oldest
        first) while the room and :attr:`prefill_tokens_per_step` allow (at least one prompt
        when there is room)."""
        decodes = [p for p in self._decode_queue[: self.max_batch] if not p.fut.cancelled()]
        del self._decode_queue[: self.max_batch]
        prefills: list[_Pending] = []
        tokens = 0
        room = self.max_batch - len(decodes)
        while self._prefill_queue and len(prefills) < room:
            p = self._prefill_queue[0]
            if p.fut.cancelled():
                self._prefill_queue.pop(0)
                continue
            n = len(p.inp.token_ids)
            if prefills and tokens + n > self.prefill_tokens_per_step:
                break
            prefills.append(self._prefill_queue.pop(0))
            tokens += n
        return prefills, decodes

    async def _drain(self) -> None:
        while self._decode_queue or self._prefill_queue:
            await self._gather_stragglers()
            prefills, decodes = self._next_batch()
            self._expected = {p.inp.cache_id for p in decodes}
            if not prefills and not decodes:
                continue
            if decodes:
                self.decode_batch_sizes.append(len(decodes))
                if len(self.decode_batch_sizes) > 4096:
                    del self.decode_batch_sizes[:2048]
            try:
                pre, dec = (await self.call(self._step_and_sample, prefills, decodes, admit=False)).value
            except errors.FerrumError as e:
                if len(prefills) + len(decodes) == 1:
                    (prefills or decodes)[0].fail(e)
                    continue
                # Isolate the failing row: rerun each alone so one bad stream does not fail others
                # (the step was all or nothing, so nothing of it was applied).
                for p in prefills + decodes:
                    one = ([p], []) if p in prefills else ([], [p])
                    try:
                        pre1, dec1 = (await self.call(self._step_and_sample, *one, admit=False)).value
                        self._resolve(p, (pre1 or dec1)[0])
                    except Exception as e2:  # noqa: BLE001 - forwarded to the stream that caused it
                        p.fail(e2)
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

    def _resolve(self, p: "_Pending", result) -> None:
        if not p.fut.done():
            p.fut.set_result(result)
        elif isinstance(p.inp, PrefillInput) and not p.inp.cache_id:
            self.release_soon(result[0].cache.cache_id, "reclaimed")  # its stream is gone

    def _step_and_sample(self, prefills: list["_Pending"], decodes: list["_Pending"]):
        """The batcher's step: ([(PrefillOutput, RowResult)], [RowResult])."""
        pre, _, rows = self.step_and_sample([p.inp for p in prefills], [p.inp for p in decodes])
        return list(zip(pre, rows[: len(pre)])), rows[len(pre):]

    def decode_and_sample(self, inputs: list[DecodeInput]) -> tuple[list, list[RowResult]]:
        """One (batched) decode step and its sampling; runs on the worker thread."""
        _, outs, rows = self.step_and_sample([], inputs)
        return outs, rows

    def step_and_sample(self, prefills: list[PrefillInput], decodes: list[DecodeInput]):
        """One step over prompts and decode steps of different sequences (one forward where the
        executor can: ``mixed_step``) and the sampling of every row; runs on the worker thread.
        Each row's repetition-penalty history is its cache's tokens. Returns (prefill outputs,
        decode outputs, rows: the prompts' rows first)."""
        ex = self.executor
        t0 = time.perf_counter()
        if prefills and decodes:
            pre, dec = ex.mixed_step(prefills, decodes)
            self.mixed_steps += 1
        elif prefills:
            pre, dec = (ex.batch_prefill(prefills) if len(prefills) > 1 else [ex.prefill(prefills[0])]), []
        else:
            pre, dec = [], (ex.batch_decode(decodes) if len(decodes) > 1 else [ex.decode(decodes[0])])
        dt = time.perf_counter() - t0
        if prefills:
            ex.stats.record("prefill", dt, len(prefills))
        if decodes:
            ex.stats.record("decode", dt, len(decodes))
        reg = ex.registry
        caches = [o.cache for o in pre] + [o.cache for o in dec]
        rows = process_rows(
            [o.logits for o in pre] + [o.logits for o in dec],
            [i.policy for i in prefills + decodes],
            [reg.get(c.cache_id).tokens for c in caches],
            [c.num_tokens for c in caches],
        )
        return pre, dec, rows
