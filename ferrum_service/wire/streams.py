"""Stream bookkeeping: which streams run, which caches they own, and ``Abort``.

A ``Session`` or ``Generate`` stream gets an owner name; caches created on it carry that owner and
are freed when the stream ends, however it ends (``release_owned``). The server's drain waits for
``active`` streams. ``Abort`` finds running generations by request id or cache id, stops them at
their next step, and releases a cache once no step holds it. Generations are indexed by (caller,
request id), so aborting a request id is one lookup however many streams run.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

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

MAX_ABORT_REQUEST_IDS = 1024
"""Most request ids one vLLM ``Abort`` may name (``request_ids``): counted before any is read, so a
flood of ids is refused at once (INVALID_ARGUMENT naming the field and this limit)."""
#: Why a stream bound to its request cannot move yet (``MigrateStreams`` answers it FAILED_PRECONDITION).
NOT_STARTED = "the stream has not sent its first token yet"


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
    unmovable: str = ""  # why the stream cannot move now ("" = it can)
    # Called once when ``Abort`` names the stream (a relayed stream cancels its call to the target:
    # migration.Migrations.relay), so an abort does not wait for the next step.
    on_abort: "Callable[[], object] | None" = field(default=None, repr=False, compare=False)
    # the stream's serving-latency timings (serving_metrics.py), reported to ``serving`` (the
    # server's metrics, which the registry hands in; none: timed, reported nowhere)
    stats: StreamRecorder = field(init=False, repr=False)
    serving: InitVar["ServingMetrics | None"] = None

    # Set by StreamRegistry.generation: files the stream under a new request id (bind).
    _index: "Callable[[StreamState, str], None] | None" = field(default=None, repr=False, compare=False)

    def __post_init__(self, serving: "ServingMetrics | None") -> None:
        self.stats = StreamRecorder(serving, self)

    def bind(self, model_id: str, request_id: str, cache_id: str) -> None:
        """Name what the stream runs: its model, request id and cache (what ``Abort`` finds it by),
        before its request is checked; it cannot move before its first token (the generation
        clears :attr:`unmovable` then, or says why it never can)."""
        self.unmovable = NOT_STARTED
        self.model_id, self.cache_id = model_id, cache_id
        if self._index is not None:
            self._index(self, request_id)
        else:
            self.request_id = request_id

    def answer_move(self, result) -> None:
        """Report a move's outcome to whoever asked for it (``MigrateStreams``)."""
        self.move_to = ""
        if self.move_result is not None and not self.move_result.done():
            self.move_result.set_result(result)

    def abort(self) -> bool:
        """Mark the stream aborted (its loop stops at the next step); True the first time."""
        if self.aborted:
            return False
        self.aborted = True
        if self.on_abort is not None:
            self.on_abort()
        return True

    def check_aborted(self) -> None:
        """CANCELLED once ``Abort`` named this stream (checked between steps)."""
        if self.aborted:
            raise errors.FerrumError(errors.ErrorKind.CANCELLED, "the request was aborted (Abort RPC)")


class StreamRegistry:
    """The server's running streams."""

    def __init__(self, models: "ModelSet", activity: "CallerActivity | None" = None,
                 serving: "ServingMetrics | None" = None) -> None:
        """``serving``: where the streams' recorders report (serving_metrics.py)."""
        self.models = models
        self.activity = activity  # origins count as active while their streams run (leases.py)
        self.active: set[asyncio.Task] = set()  # every running stream's task (the drain waits on them)
        self.generations: dict[str, StreamState] = {}
        # (caller, request id) -> the generations carrying it, by owner
        self._by_request: dict[tuple[str, str], dict[str, StreamState]] = {}
        self.serving = serving
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
    def generation(self, kind: str) -> Iterator[StreamState]:
        """A new generation stream of ``kind`` ("generate", "vllm"; its owner name is made from
        it): counted as running (:meth:`running`) and registered (findable by ``Abort``) while
        the block runs. Enter the call first (``callers.enter_call``): the stream belongs to the
        current caller and origin."""
        owner = self.new_owner(kind)
        state = StreamState(owner, tenant=current_caller.get(), _index=self._file, serving=self.serving)
        with self.running():
            self.generations[owner] = state
            error: BaseException | None = None
            try:
                yield state
            except BaseException as e:
                error = e
                raise
            finally:
                self.generations.pop(owner, None)
                self._unfile(state)
                state.answer_move(errors.failed_precondition("the stream ended before it could move"))
                state.stats.close(error)

    def _file(self, state: StreamState, request_id: str) -> None:
        """Index ``state`` under ``request_id`` (instead of its previous one)."""
        self._unfile(state)
        state.request_id = request_id
        if request_id and state.owner in self.generations:
            self._by_request.setdefault((state.tenant, request_id), {})[state.owner] = state

    def _unfile(self, state: StreamState) -> None:
        key = (state.tenant, state.request_id)
        group = self._by_request.get(key)
        if group is not None:
            group.pop(state.owner, None)
            if not group:
                del self._by_request[key]

    def with_request_id(self, request_id: str) -> list[StreamState]:
        """The current caller's generations that carry ``request_id``."""
        return list(self._by_request.get((current_caller.get(), request_id), {}).values())

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
        found = self.with_request_id(request_id) if request_id else []
        if cache_id:  # one id per call: a scan of the running streams
            found += [st for st in self.generations.values() if st.tenant == caller and st.cache_id == cache_id]
        aborted = 0
        for st in found:
            if host is not None and st.model_id and st.model_id != host.model_id:
                continue
            if st.abort():
                aborted += 1
        released = False
        if cache_id:
            for h in [host] if host is not None else list(self.models):
                if cache_id in h.executor.registry and h.executor.registry.get(cache_id).tenant == caller:
                    released = await self._release_when_idle(h, cache_id)
        return aborted, released

    def abort_requests(self, request_ids: Sequence[str], field: str) -> int:
        """Stop the current caller's generations that carry any of ``request_ids`` (vLLM's
        ``Abort``): one lookup per id. INVALID_ARGUMENT naming ``field`` when there are more than
        :data:`MAX_ABORT_REQUEST_IDS` ids, before any is read. Returns the streams newly aborted."""
        n = len(request_ids)
        if n > MAX_ABORT_REQUEST_IDS:
            raise errors.invalid(f"{field} has {n} request ids; the limit is {MAX_ABORT_REQUEST_IDS}", field=field,
                                 limit=MAX_ABORT_REQUEST_IDS, requested=n)
        aborted = 0
        for rid in request_ids:
            for st in self.with_request_id(rid) if rid else ():
                if st.abort():
                    aborted += 1
        return aborted

    @staticmethod
    async def _release_when_idle(host: "ModelHost", cache_id: str, timeout: float = 10.0) -> bool:
        """Release a cache once no step holds it (an aborted stream lets go within one step)."""
        try:
            await asyncio.wait_for(host.wait_unheld(cache_id), timeout)
        except asyncio.TimeoutError:
            pass  # still held: the hold below answers ABORTED "busy"
        if cache_id not in host.executor.registry:
            return False
        with host.hold([cache_id], "cache_id"):
            return (await host.call(host.executor.release_cache, cache_id)).value[0]


__all__ = ["MAX_ABORT_REQUEST_IDS", "StreamRegistry", "StreamState"]
