"""Cache leases: caches nobody owns are reclaimed once idle past a TTL.

A cache created on a ``Session`` or ``Generate`` stream belongs to that stream and is freed when
the stream ends, however it ends (finish, cancel, deadline, dropped connection). A cache created by
a unary RPC (``Prefill``, ``BatchPrefill``, ``Generate`` with ``keep_cache``) has no owning stream:
if the scheduler that made it vanishes, nothing would free it. Each such cache therefore holds a
*lease*: every step that touches it (prefill into it, decode, verify, truncate — anything that
holds it through :meth:`ModelHost.hold`) renews the lease by updating ``CacheEntry.last_access``.
The :class:`LeaseReaper` (started and stopped by ``Server``) wakes every ``interval`` seconds
and releases, with reason ``reclaimed``, every ownerless cache idle for longer than ``ttl``
seconds that no step holds right now. Each reclaim is logged and counted
(``ferrum_expired_caches_total``, and ``ferrum_reclaimed_caches_total`` with the others).

**Quiet origins.** A cache records where the unary call that made it came from (its *origin*:
the caller's identity and network host, ``callers.py``). When an origin has made no call at all for
``origin_idle_ttl`` seconds (default 60) — the scheduler that made the cache has stopped or died —
its ownerless caches idle that long are reclaimed then, without waiting for the full ``ttl``. An
origin that keeps calling keeps the full ``ttl`` for each of its caches. This is what frees the
caches a client made and can never release, e.g. ferrum's engine in speculative mode, which never
calls ``release_cache`` on its draft executor (ferrum in process keeps those too), soon after that
engine goes quiet. Reclaims by this rule are counted in ``ferrum_idle_origin_caches_total``.

``ttl = 0`` turns leases off (caches live until released or the server stops);
``origin_idle_ttl = 0`` turns the quiet-origin rule off (it never exceeds ``ttl``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog

from ..core.callers import CallerActivity, log_id
from ..core.modes import CacheEvent, ExecutorState
from ..hosting.periodic import Periodic

if TYPE_CHECKING:
    from ..hosting.models import ModelSet
    from .metrics import Metrics

log = structlog.get_logger("ferrum_service.wire.leases")


class LeaseReaper:
    """Background task reclaiming idle ownerless caches."""

    def __init__(self, models: "ModelSet", metrics: "Metrics", ttl: float, interval: float | None = None,
                 *, origin_idle_ttl: float = 0.0, activity: CallerActivity | None = None) -> None:
        self.models = models
        self.metrics = metrics
        self.ttl = float(ttl)
        self.activity = activity
        # The quiet-origin rule needs to know who calls; it never waits longer than the TTL itself.
        self.origin_idle_ttl = float(origin_idle_ttl) if activity is not None and self.ttl > 0 else 0.0
        if self.origin_idle_ttl > self.ttl:
            self.origin_idle_ttl = self.ttl
        shortest = min(t for t in (self.ttl, self.origin_idle_ttl) if t > 0) if self.ttl > 0 else 0.0
        # Check often enough that a cache outlives its TTL by at most ~25 %, but not more than
        # once per 50 ms nor less than once per 30 s.
        self.interval = interval if interval is not None else min(30.0, max(0.05, shortest / 4))
        self._job = Periodic("lease-reaper", self.sweep, lambda: self.interval)

    @property
    def enabled(self) -> bool:
        return self.ttl > 0

    def start(self) -> None:
        if self.enabled:
            self._job.start()

    async def stop(self) -> None:
        await self._job.stop()

    def _why(self, entry, now: float) -> str | None:
        """Why an ownerless cache not held by a step is due now: "lease" (idle past the TTL),
        "idle_origin" (idle past ``origin_idle_ttl`` and its origin quiet that long), else None."""
        idle = now - entry.last_access
        if idle > self.ttl:
            return "lease"
        t = self.origin_idle_ttl
        if t > 0 and entry.origin and idle > t and self.activity.idle_for(entry.origin, now) > t:
            return "idle_origin"
        return None

    def expired(self, now: float | None = None) -> list[tuple[object, object]]:
        """(host, entry) of every ownerless cache due for reclaim and not held by a step."""
        now = time.monotonic() if now is None else now
        out = []
        for host in self.models:
            if host.executor.state == ExecutorState.SHUTDOWN:
                continue
            for entry in host.executor.registry.entries():
                if entry.owner or host.is_busy(entry.cache_id):
                    continue
                if self._why(entry, now):
                    out.append((host, entry))
        return out

    async def sweep(self) -> int:
        """Reclaim what is due now; returns how many caches were freed."""
        n = 0
        for host, entry in self.expired():
            cid = entry.cache_id
            # Re-check at the last moment: a step may have taken or renewed the cache meanwhile.
            if host.is_busy(cid) or cid not in host.executor.registry:
                continue
            why = self._why(entry, time.monotonic())
            if why is None:
                continue
            idle = time.monotonic() - entry.last_access
            try:
                with host.hold([cid], "cache_id"):
                    released, freed_bytes, tokens = (
                        await host.call(host.executor.release_cache, cid, CacheEvent.RECLAIMED)).value
            except Exception as e:  # noqa: BLE001 - busy or shut down: try again next sweep
                log.debug("lease reclaim skipped", model_id=host.model_id, cache_id=cid, error=str(e))
                continue
            if released:
                n += 1
                if why == "lease":
                    self.metrics.expired_caches.labels(host.model_id).inc()
                    log.info("cache lease expired; reclaimed", model_id=host.model_id, cache_id=cid,
                             idle_s=round(idle, 3), ttl_s=self.ttl, tokens=tokens, freed_bytes=freed_bytes)
                else:
                    self.metrics.idle_origin_caches.labels(host.model_id).inc()
                    log.info("cache of a quiet origin reclaimed", model_id=host.model_id, cache_id=cid,
                             origin=log_id(entry.origin), idle_s=round(idle, 3), origin_idle_ttl_s=self.origin_idle_ttl,
                             tokens=tokens, freed_bytes=freed_bytes)
        if self.activity is not None:
            self.activity.forget_idle(max(self.ttl, 3600.0))
        return n
