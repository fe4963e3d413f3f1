"""Stream bookkeeping: which streams run, which caches they own, and ``Abort``.

A ``Session`` or ``Generate`` stream gets an owner name; caches created on it carry that owner and
are freed when the stream ends, however it ends (``release_owned``). The server's drain waits for
``active`` streams. ``Abort`` finds running generations by request id or cache id, stops them at
their next step, and releases a cache once no step holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import structlog

from ..core import errors
from ..core.callers import current_caller, current_origin
from ..core.modes import CacheEvent
from .serving_metrics import StreamRecorder

if TYPE_CHECKING:
    from ..core.callers import CallerActivity
    from .serving_metrics import ServingMetrics
    from ..hosting.host import ModelHost
    from ..hosting.models import ModelSet

log = structlog.get_logger("ferrum_service.wire.streams")


@dataclass
class StreamState:
    """What ``Abort`` needs to find and stop a running generation."""

    owner: str
    model_id: str = ""
    request_id: str = ""
    cache_id: str = ""
    tenant: str = ""  # the caller that started it: only that caller can Abort it
    aborted: bool = False
    # Live migration (migration.py): the peer to move to at the next step boundary, the future
    # that gets the outcome (hand-off ms, or the refusal), and why the stream cannot move ("" = it can).
    move_to: str = ""
    move_result: "asyncio.Future | None" = None
    unmovable: str = ""
    # the stream's serving-latency timings (serving_metrics.py); the registry gives it the server's metrics
    stats: StreamRecorder = field(default=None, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.stats is None:
            self.stats = StreamRecorder(None, self)

    def answer_move(self, result) -> None:
        """Report a move's outcome to whoever asked for it (``MigrateStreams``)."""
        self.move_to = ""
        if self.move_result is not None and not self.move_result.done():
            self.move_result.set_result(result)

    def check_aborted(self) -> None:
        """CANCELLED once ``Abort`` named this stream (checked between steps)."""
        if self.aborted:
            raise errors.FerrumError(errors.ErrorKind.CANCELLED, "the request was aborted (Abort RPC)")


class StreamRegistry:
    """The server's running streams."""

    def __init__(self, models: "ModelSet", activity: "CallerActivity | None" = None) -> None:
        self.models = models
        self.activity = activity  # origins count as active while their streams run (leases.py)
        self.active: set[asyncio.Task] = set()  # every running stream's task (the drain waits on them)
        self.generations: dict[str, StreamState] = {}
        self.serving: "ServingMetrics | None" = None  # where the streams' recorders report (the server sets it)
        self._ids = itertools.count(1)

    def new_owner(self, kind: str) -> str:
        """A fresh owner name for a stream of ``kind`` ("session", "generate")."""
        return f"{kind}-{next(self._ids)}"

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Count the current task as an active stream while the block runs (and its origin,
        ``current_origin``, as active: set it first, ``callers.enter_call``)."""
        task = asyncio.current_task()
        self.active.add(task)
        origin = current_origin.get()
        try:
            with self.activity.streaming(origin) if self.activity is not None else contextlib.nullcontext():
                yield
        finally:
            self.active.discard(task)

    @contextlib.contextmanager
    def generation(self, owner: str) -> Iterator[StreamState]:
        """Register a ``Generate`` stream (findable by ``Abort``) while the block runs."""
        state = StreamState(owner, tenant=current_caller.get())
        state.stats = StreamRecorder(self.serving, state)
        self.generations[owner] = state
        error: BaseException | None = None
        try:
            yield state
        except BaseException as e:
            error = e
            raise
        finally:
            self.generations.pop(owner, None)
            state.answer_move(errors.failed_precondition("the stream ended before it could move"))
            state.stats.close(error)

    def release_owned(self, owner: str, reason: CacheEvent = CacheEvent.RELEASED) -> int:
        """Free every cache a stream created (it ended); returns how many."""
        n = 0
        for host in self.models:
            for entry in host.executor.registry.entries():
                if entry.owner == owner:
                    host.release_soon(entry.cache_id, reason)
                    n += 1
        return n

    # ---- Abort ------------------------------------------------------------------------------------
    async def abort(self, host: "ModelHost | None", *, request_id: str = "", cache_id: str = "") -> tuple[int, bool]:
        """Stop the generations that carry ``request_id`` or run on ``cache_id`` (on ``host``, or
        on any model when ``host`` is None) and release ``cache_id`` once no step holds it. Only
        the current caller's streams and caches are touched. Idempotent. Returns (streams newly
        aborted, whether the cache was released)."""
        caller = current_caller.get()
        aborted = 0
        for st in list(self.generations.values()):
            if st.tenant != caller or (host is not None and st.model_id and st.model_id != host.model_id):
                continue
            if (request_id and st.request_id == request_id) or (cache_id and st.cache_id == cache_id):
                if not st.aborted:
                    st.aborted = True
                    aborted += 1
        released = False
        if cache_id:
            for h in [host] if host is not None else list(self.models):
                if cache_id in h.executor.registry and h.executor.registry.get(cache_id).tenant == caller:
                    released = await self._release_when_idle(h, cache_id)
        return aborted, released

    @staticmethod
    async def _release_when_idle(host: "ModelHost", cache_id: str, timeout: float = 10.0) -> bool:
        """Release a cache once no step holds it (an aborted stream lets go within one step)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while host.is_busy(cache_id) and loop.time() < deadline:
            await asyncio.sleep(0.005)
        if cache_id not in host.executor.registry:
            return False
        with host.hold([cache_id], "cache_id"):
            return (await host.call(host.executor.release_cache, cache_id)).value[0]


__all__ = ["StreamRegistry", "StreamState"]
