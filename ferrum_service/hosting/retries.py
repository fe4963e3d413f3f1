"""Safe retries: steps carrying a ``client_step_id`` run once; repeats get the first result.

A bounded LRU maps (caller, model, step id) to the request's bytes and the response (or the future
of a step still running, so a retry racing the original waits for it). Step ids are per caller
(``callers.py``): one caller's id never collides with, nor replays, another's. The window is
bounded in entries and in bytes (requests + responses, full logits included); the oldest entries
go first. Failed steps are forgotten, so retrying a step that failed (say, RESOURCE_EXHAUSTED)
really retries it.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Awaitable, Callable

from ..core import errors
from ..core.callers import current_caller

WINDOW = 4096
WINDOW_BYTES = 64 * 1024 * 1024


class StepDeduper:
    """The retry window of one server."""

    def __init__(self, window: int = WINDOW, window_bytes: int = WINDOW_BYTES) -> None:
        self.window = window
        self.window_bytes = window_bytes
        # key -> (request bytes, result future, bytes held by the entry)
        self._seen: collections.OrderedDict[tuple[str, str, str], list] = collections.OrderedDict()
        self._bytes = 0

    @property
    def held_bytes(self) -> int:
        """Bytes of requests and responses the window holds now."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._seen)

    async def run(self, model_id: str, step_id: str, request, fn: Callable[[], Awaitable]):
        """``fn()`` once per (caller, model, step id); a repeat of the same request gets the first
        result, a different request under a used id INVALID_ARGUMENT."""
        if not step_id:
            return await fn()
        key = (current_caller.get(), model_id, step_id)
        body = request.DESCRIPTOR.full_name.encode() + b"\0" + request.SerializeToString(deterministic=True)
        hit = self._seen.get(key)
        if hit is not None:
            if hit[0] != body:
                raise errors.invalid(
                    f"client_step_id {step_id!r} was already used for a different request", field="client_step_id"
                )
            self._seen.move_to_end(key)
            return await asyncio.shield(hit[1])
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._seen[key] = [body, fut, len(body)]
        self._bytes += len(body)
        self._evict()
        try:
            result = await fn()
        except BaseException as e:
            if key in self._seen and self._seen[key][1] is fut:
                self._forget(key)
            if not fut.done():
                fut.set_exception(e if isinstance(e, Exception) else errors.unavailable("step was cancelled"))
                fut.exception()  # mark retrieved
            raise
        fut.set_result(result)
        entry = self._seen.get(key)
        if entry is not None and entry[1] is fut:
            size = result.ByteSize()
            entry[2] += size
            self._bytes += size
            self._evict()
        return result

    def _forget(self, key) -> None:
        entry = self._seen.pop(key, None)
        if entry is not None:
            self._bytes -= entry[2]

    def _evict(self) -> None:
        while self._seen and (len(self._seen) > self.window or self._bytes > self.window_bytes):
            _, entry = self._seen.popitem(last=False)
            self._bytes -= entry[2]
