"""A background job on the event loop: one coroutine run every ``interval`` seconds until stopped.

The lease reaper (``leases.py``) and the stall watch (``progress.py``) are such jobs. A run that
raises is logged and the next one goes ahead: a job that stopped on one bad run would leave leases
unreclaimed, or health stuck, for the rest of the process.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import structlog

log = structlog.get_logger("ferrum_service.hosting.periodic")


class Periodic:
    """``await run()`` every ``interval()`` seconds (read before each sleep, so its owner may
    change it) from :meth:`start` until :meth:`stop`."""

    def __init__(self, name: str, run: Callable[[], Awaitable[None]], interval: Callable[[], float]) -> None:
        self.name = name
        self._run = run
        self._interval = interval
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start the job on the running loop (once; later calls do nothing)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=self.name)

    async def stop(self) -> None:
        """Cancel the job and wait until it has ended."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval())
            try:
                await self._run()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the job must outlive a bad run
                log.exception("background job failed", job=self.name)
