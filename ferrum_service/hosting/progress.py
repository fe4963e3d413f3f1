"""Forward progress of a hosted model: its measured service rate, retry hints, and stall health.

Every executor call a model's worker completes (a step, a release, a fork) is recorded by
:class:`Progress` (``ModelHost.call``). From that:

* **RetryInfo from the service rate** (:meth:`Progress.retry_after_ms`): a RESOURCE_EXHAUSTED for
  queue or capacity reasons (the worker queue is full, the KV pool or a cache cap is taken) tells
  the caller to come back after the work ahead of it has drained: ``(queued + 1) / steps per
  second`` over the last :data:`RATE_WINDOW_S` seconds, clamped to
  [:data:`MIN_RETRY_MS`, :data:`MAX_RETRY_MS`]. With no step measured recently it is
  :data:`IDLE_RETRY_MS` when nothing is queued (capacity frees on the next release), and the
  maximum when work is queued (the model is not moving).
* **Stall health** (:class:`StallWatch`, started by the server): a model is *stalled* when work has
  been queued on it (``ModelHost.running > 0``) and no call completed for ``stall_timeout``
  seconds (``--stall-timeout``); its gRPC health (service name = the model id) is then
  NOT_SERVING, and the server's overall "" too (the ModelExecutor service follows shutdown only),
  so a readiness probe takes the replica out of rotation while it cannot make progress. Both return to SERVING
  when a call completes. A model that was shut down, or a draining server, is left as it is.
* **Step clock** (:class:`StepClock`, ``ModelHost.steps``): the model's steps, counted on the event
  loop as each one ends (a batched or unary step, each step of a lone stream's chain), and awaitable:
  what work that must not crowd the model's steps paces itself by (a migration's pre-copy export,
  ``wire/kv_export_pacing.py``).
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, Callable, Iterable

import structlog

from ..core.modes import ExecutorState
from ..core.settings import default
from .periodic import Periodic

log = structlog.get_logger("ferrum_service.hosting.progress")

RATE_WINDOW_S = 10.0
MIN_RETRY_MS = 20
MAX_RETRY_MS = 10_000
IDLE_RETRY_MS = 100
#: Default ``--stall-timeout``: seconds with work queued and no step completed before a model
#: reports NOT_SERVING (0 = never).
DEFAULT_STALL_TIMEOUT_S = default("stall_timeout")


class Progress:
    """Completed calls of one model's worker (thread-safe: recorded on the worker, read on the loop)."""

    def __init__(self) -> None:
        self._done: collections.deque[float] = collections.deque(maxlen=512)
        self.last_done = time.monotonic()
        self.busy_since: float | None = None  # when work was last queued on an idle worker

    def started(self, running_before: int) -> None:
        """A call was submitted; ``running_before``: calls running or queued before it."""
        if running_before == 0:
            self.busy_since = time.monotonic()

    def completed(self) -> None:
        """A call finished on the worker (whatever its outcome: the worker moved on)."""
        now = time.monotonic()
        self._done.append(now)
        self.last_done = now

    def rate(self, now: float | None = None) -> float:
        """Calls completed per second over the last :data:`RATE_WINDOW_S` seconds (0 = none)."""
        now = time.monotonic() if now is None else now
        recent = [t for t in list(self._done) if now - t <= RATE_WINDOW_S]
        if not recent:
            return 0.0
        span = max(now - recent[0], 1e-3)
        return len(recent) / span if len(recent) > 1 else 1.0 / max(span, 1e-3)

    def retry_after_ms(self, queued: int, now: float | None = None) -> int:
        """When work ``queued`` deep ahead of a refused request has likely drained (see module doc)."""
        r = self.rate(now)
        if r <= 0:
            return MAX_RETRY_MS if queued > 0 else IDLE_RETRY_MS
        return int(min(MAX_RETRY_MS, max(MIN_RETRY_MS, 1000.0 * (queued + 1) / r)))

    def stalled_for(self, running: int, now: float | None = None) -> float:
        """Seconds work has been queued with no call completing (0 when idle or moving)."""
        if running <= 0:
            return 0.0
        now = time.monotonic() if now is None else now
        since = max(self.last_done, self.busy_since or 0.0)
        return max(0.0, now - since)


class StepClock:
    """The model's steps ended so far (on the event loop only; see the module doc). Costs a counter
    increment per step while nobody waits."""

    def __init__(self) -> None:
        self.count = 0
        self._next: asyncio.Future | None = None  # resolved by the next tick (made when someone waits)

    def tick(self) -> None:
        """A step ended (whatever its outcome): wake whoever waits for the next one."""
        self.count += 1
        nxt, self._next = self._next, None
        if nxt is not None and not nxt.done():
            nxt.set_result(self.count)

    def next(self) -> asyncio.Future:
        """A future resolved (with the new count) when the next step ends; shared by every waiter,
        so a waiter that gives up must not cancel it."""
        if self._next is None or self._next.done():
            self._next = asyncio.get_running_loop().create_future()
        return self._next


class StallWatch:
    """Checks the progress of every hosted model (``models``: the ``ModelSet``, iterated as its
    ``ModelHost``s) every ``interval`` seconds and calls ``set_health(model_id,
    serving)`` when a model becomes stalled or moves again (see the module doc)."""

    def __init__(self, models: Iterable[Any], stall_timeout: float,
                 set_health: Callable[[str, bool], "asyncio.Future | None"], interval: float | None = None) -> None:
        self.models = models
        self.stall_timeout = float(stall_timeout)
        self.set_health = set_health
        self.interval = interval if interval is not None else min(5.0, max(0.05, self.stall_timeout / 4))
        self.stalled: set[str] = set()
        self._job = Periodic("stall-watch", self.check, lambda: self.interval)

    def start(self) -> None:
        if self.stall_timeout > 0:
            self._job.start()

    async def stop(self) -> None:
        await self._job.stop()

    async def check(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for host in self.models:
            if host.executor.state == ExecutorState.SHUTDOWN:
                if host.model_id in self.stalled:  # shut down while stalled: "" no longer waits for it
                    self.stalled.discard(host.model_id)
                    await self.set_health(host.model_id, False)
                continue
            stuck = host.progress.stalled_for(host.running, now)
            if stuck > self.stall_timeout and host.model_id not in self.stalled:
                self.stalled.add(host.model_id)
                log.warning("model stalled: work queued and no step completed; health NOT_SERVING",
                            model_id=host.model_id, stalled_s=round(stuck, 1), queued=host.running,
                            stall_timeout_s=self.stall_timeout)
                await self.set_health(host.model_id, False)
            elif stuck <= self.stall_timeout and host.model_id in self.stalled:
                self.stalled.discard(host.model_id)
                log.info("model progressing again; health SERVING", model_id=host.model_id)
                await self.set_health(host.model_id, True)


__all__ = ["DEFAULT_STALL_TIMEOUT_S", "Progress", "StallWatch", "StepClock"]
