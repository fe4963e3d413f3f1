"""A hosted model: its executor, the worker thread it runs on, per-cache step exclusion, and the
running of its steps.

``ModelHost.call`` runs one executor method off the event loop on the model's single worker thread
(so model state needs no locks and forward passes never block the server), or inline for cheap
executors; ``ModelHost.step`` runs one :class:`~ferrum_service.core.steps.StepPlan` there
(``steps.run``: masks, the forward, counters, sampling). ``ModelHost.hold`` marks caches busy for
the duration of a step: a second step on a busy cache is refused with ABORTED instead of racing it;
holding a cache also renews its lease (``last_access``, see ``leases.py``). ``max_queue`` bounds the
steps waiting for the worker: past it new steps are refused at once with RESOURCE_EXHAUSTED
(releases and shutdown are never refused, and decode steps of running ``Generate`` streams are not
new work). The model's step queue for ``Generate`` streams (``batcher.py``) is attached by the
server's wiring (:meth:`ModelHost.attach`); the host knows it only as a :class:`StepQueue`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

import grpc

from ..core import errors
from ..core.settings import default
from ..core.steps import StepLimits, StepPlan, run
from ..executors.base import ModelExecutor
from .progress import Progress, StepClock


def new_worker(name: str) -> concurrent.futures.ThreadPoolExecutor:
    """A model's worker: one thread that runs all of its torch work.

    Load the model on it too (``new_worker(...).submit(load).result()``): each thread that runs
    parallel torch ops gets its own OpenMP thread team, and a second team (the loading thread's)
    competing for the same cores made every served step ~20-30 % slower on a 2-core CPU
    (BatchDecode B=8 on SmolLM2: 81-91 ms per step with one team, 104-125 ms with two)."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"exec-{name}")


class StepQueue(Protocol):
    """What the host needs of the model's step queue for ``Generate`` streams (``batcher.py``)."""

    @property
    def queued_prompts(self) -> int: ...

    def prompt_work(self) -> tuple[int, int, int]: ...

    def forget(self, cache_id: str) -> None: ...

    def configure(self, prefill_tokens_per_step: int, tail_step_factor: float) -> None: ...


@dataclass(frozen=True)
class HostSettings:
    """The server's settings a hosted model runs under (``ServerConfig``; defaults in settings.py)."""

    max_queue: int = 0  # steps allowed to wait for the worker (0 = unbounded)
    speculation_default: int = 0  # draft tokens of a Generate stream that asks for none (0 = off)
    max_caches: int = 0  # live caches of the model (0 = the executor's own limit)
    max_step_bytes: int = default("max_step_bytes")
    max_response_bytes: int = default("max_message_bytes")
    max_text_bytes: int = default("max_text_bytes")
    prefill_chunk_tokens: int = default("prefill_chunk_tokens")  # the batcher's prompt tokens per step
    prefill_tail_factor: float = default("prefill_tail_factor")


@dataclass
class Timed:
    """An executor call's result and where its time went."""

    value: Any
    queued_ns: int
    forward_ns: int
    submitted_ns: int = 0  # perf_counter_ns when the call was made (for trace spans)


class ModelHost:
    """One model served by the server."""

    def __init__(self, model_id: str, executor: ModelExecutor, *, max_batch: int = default("max_batch"), max_queue: int = 0,
                 worker: concurrent.futures.ThreadPoolExecutor | None = None, speculation_default: int = 0) -> None:
        """``worker``: the single-thread pool the executor was loaded on (see :func:`new_worker`);
        default a new one. ``speculation_default``: draft tokens a Generate stream that asks for
        no speculation gets (0 = off; ``--speculation-draft-tokens``)."""
        self.model_id = model_id
        self.executor = executor
        self.info = executor.info()
        self.vocab_size = self.info.vocab_size
        # Fixed for an executor's life and read on every step, so read once (on the transformers
        # executor ``capabilities()`` sums every parameter).
        self.capabilities = executor.capabilities()
        self.supports_generation = self.capabilities.supports_generation
        # A batched step never exceeds what the executor takes in one forward.
        self.max_batch = min(max_batch, self.capabilities.max_batch_size or max_batch)
        self.max_queue = max_queue  # steps allowed to wait for the worker (0 = unbounded)
        self.speculation_default = speculation_default
        lim = executor.admission_limits()
        self.limits = StepLimits(max_step_tokens=lim.maximum_scheduled_tokens if lim is not None else 0,
                                 max_rows=self.capabilities.max_batch_size)
        self._pool = worker or new_worker(model_id)
        self._busy: set[str] = set()
        self._unheld: dict[str, asyncio.Event] = {}  # cache id -> set when its hold ends (waited on)
        self.running = 0  # steps executing or queued on the worker
        self._pending_releases: set[asyncio.Task] = set()
        self.batcher: StepQueue | Any = None  # the model's step queue for Generate streams (``attach``)
        self.progress = Progress()  # completed calls: the service rate (retry hints) and stall health
        #: The model's steps as they end, on the loop (:meth:`step`, and each chained step: ``batcher.py``).
        self.steps = StepClock()
        #: Called on the worker after each step while a profile waits or records (``profiler.py``);
        #: None otherwise, so a step costs nothing more.
        self.step_hook: Callable[[], None] | None = None
        #: Set while the worker chains a lone stream's decode steps (``batcher.py``): asks it to
        #: stop after the step it runs (thread-safe), so that other work for the worker waits one
        #: step at most.
        self.interrupt: Callable[[], None] | None = None

    def configure(self, settings: HostSettings) -> None:
        """Run under the server's ``settings`` (the server's wiring calls it once, before serving)."""
        self.max_queue = settings.max_queue
        self.speculation_default = settings.speculation_default
        if settings.max_caches > 0:
            reg = self.executor.registry
            reg.max_active = min(reg.max_active, settings.max_caches) if reg.max_active else settings.max_caches
        self.limits.max_step_bytes = settings.max_step_bytes
        self.limits.max_response_bytes = settings.max_response_bytes
        self.limits.max_text_bytes = settings.max_text_bytes
        if self.batcher is not None:
            self.batcher.configure(settings.prefill_chunk_tokens, settings.prefill_tail_factor)

    def attach(self, queue: StepQueue) -> None:
        """Give the host the model's step queue (the server's wiring does, ``batcher.py``): its
        queued prompts count as waiting work, and it forgets a released cache."""
        self.batcher = queue

    # ---- running executor methods -------------------------------------------------------------
    def on_worker(self, fn: Callable[[], Any], timeout: float = 5.0) -> Any:
        """Run ``fn()`` on the model's worker from a thread that is not the event loop (e.g. a
        metrics scrape reading the executor's native state, never while a step runs); blocks."""
        if self.executor.inline:
            return fn()
        self.yield_worker()
        return self._pool.submit(fn).result(timeout)

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Queue ``fn(*args)`` on the model's worker behind the work already queued, outside the
        step accounting of :meth:`call` (clean-up such as dropping a failed import). RuntimeError
        once the worker is shut down."""
        self.yield_worker()
        return self._pool.submit(fn, *args)

    def yield_worker(self) -> None:
        """Other work wants the worker: a chain of decode steps stops after its current step."""
        stop = self.interrupt
        if stop is not None:
            stop()

    @property
    def waiting(self) -> int:
        """Steps queued behind the one the worker is running (new Generate prompts included)."""
        return max(0, self.running - 1) + (self.batcher.queued_prompts if self.batcher is not None else 0)

    def retry_after_ms(self) -> int:
        """RetryInfo for a request refused for queue or capacity reasons: the work queued now at
        the measured service rate (``progress.py``)."""
        return self.progress.retry_after_ms(self.waiting)

    def check_accepting(self, fn: Callable[..., Any] | None = None) -> None:
        """UNAVAILABLE once the model is shut down; RESOURCE_EXHAUSTED (with RetryInfo) when
        ``max_queue`` steps already wait for the worker — except for ``fn`` = release or shutdown:
        freeing memory is never refused."""
        self.check_up()
        if not self.max_queue or self.executor.inline:
            return
        if fn == self.executor.release_cache or fn == self.executor.shutdown:
            return
        if self.waiting >= self.max_queue:
            raise errors.exhausted(
                f"model {self.model_id!r}: {self.waiting} steps are waiting for its worker; the queue limit "
                f"is {self.max_queue}",
                retry_after_ms=self.retry_after_ms(),
                model_id=self.model_id,
                queued=self.waiting,
                limit=self.max_queue,
            )

    def check_up(self) -> None:
        """UNAVAILABLE once the model is shut down (its caches are gone with it)."""
        if self.executor.is_shut_down:
            raise errors.unavailable(f"model {self.model_id!r} is shut down", model_id=self.model_id)

    async def call(self, fn: Callable[..., Any], *args: Any, admit: bool = True,
                   on_orphan: Callable[[Any], None] | None = None, interrupts: bool = True) -> Timed:
        """Run ``fn(*args)`` on the model's worker (inline for cheap executors).

        ``admit=False`` skips the queue limit (steps of work already admitted). ``on_orphan``:
        called with the result when the caller was cancelled while ``fn`` ran (or just after it
        finished): whatever the step created (caches) has nobody to hand it to, so it is freed.
        ``interrupts``: stop a chain of decode steps the worker runs (:meth:`yield_worker`)."""
        self.check_accepting(fn) if admit else self.check_up()
        if interrupts:
            self.yield_worker()
        submitted = time.perf_counter_ns()
        self.progress.started(self.running)
        self.running += 1
        try:
            if self.executor.inline:
                try:
                    value = fn(*args)
                finally:
                    self.progress.completed()
                done = time.perf_counter_ns()
                return Timed(value, 0, done - submitted, submitted)
            started: list[int] = []

            def run() -> Any:
                started.append(time.perf_counter_ns())
                try:
                    return fn(*args)
                finally:
                    self.progress.completed()

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
            return Timed(value, started[0] - submitted, done - started[0], submitted)
        except errors.FerrumError as e:
            self.hint_retry(e)
            raise
        finally:
            self.running -= 1

    def hint_retry(self, e: errors.FerrumError) -> None:
        """Give a RESOURCE_EXHAUSTED that carries a retry hint (queue, KV or cache capacity) the
        hint computed from the measured service rate (:meth:`retry_after_ms`)."""
        if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.retry_after_ms:
            e.retry_after_ms = self.retry_after_ms()

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
                ev = self._unheld.pop(c, None)
                if ev is not None:
                    ev.set()

    def is_busy(self, cache_id: str) -> bool:
        return cache_id in self._busy

    async def wait_unheld(self, cache_id: str) -> None:
        """Return once no step or transfer holds the cache (woken by the hold's end, not polled)."""
        while cache_id in self._busy:
            ev = self._unheld.get(cache_id)
            if ev is None:
                ev = self._unheld[cache_id] = asyncio.Event()
            await ev.wait()

    def release_soon(self, cache_id: str, reason: str = "released") -> None:
        """Free a cache from a ``finally`` that may run inside a cancelled task.

        The release runs as its own task (not the cancelled one), so a second cancellation cannot
        interrupt it and leak the cache. It waits while a step or transfer holds the cache (an
        ``ExportKv`` reading its blocks on another thread): freed blocks could go to another
        caller's prompt under the reader."""
        if self.batcher is not None:
            self.batcher.forget(cache_id)
        if cache_id not in self.executor.registry:
            return
        if self.executor.inline and not self.is_busy(cache_id):
            self.executor.release_cache(cache_id, reason)
            return

        async def _release() -> None:
            await self.wait_unheld(cache_id)
            try:
                with self.hold([cache_id], "cache_id"):  # nothing starts reading it while it goes
                    if self.executor.inline:
                        self.executor.release_cache(cache_id, reason)
                        return
                    self.yield_worker()
                    await asyncio.get_running_loop().run_in_executor(self._pool, self.executor.release_cache,
                                                                     cache_id, reason)
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

    async def step(self, plan: StepPlan, *, admit: bool = True,
                   on_orphan: Callable[[Any], None] | None = None) -> Timed:
        """Run ``plan`` on the worker (``steps.run``); the value is its :class:`StepResult`. Ticks
        :attr:`steps` when it ends."""
        hook = self.step_hook
        try:
            if hook is None:
                return await self.call(run, self.executor, plan, admit=admit, on_orphan=on_orphan)
            return await self.call(self.run_step, self.executor, plan, admit=admit, on_orphan=on_orphan)
        finally:
            self.steps.tick()

    def run_step(self, executor: ModelExecutor, plan: StepPlan) -> Any:
        """``steps.run`` with the step hook, on the worker."""
        hook = self.step_hook
        try:
            return run(executor, plan)
        finally:
            if hook is not None:
                hook()
