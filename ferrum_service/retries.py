"""Safe retries: steps carrying a ``client_step_id`` run once; repeats get the first result.

A bounded LRU per model maps a step id to the request's bytes and the response (or the future of
a step still running, so a retry racing the original waits for it). Failed steps are forgotten,
so retrying a step that failed (say, RESOURCE_EXHAUSTED) really retries it.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Awaitable, Callable

from . import errors

WINDOW = 4096


class StepDeduper:
    """The retry window of one server: step ids per model, each with its request and result."""

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self._seen: collections.OrderedDict[tuple[str, str], tuple[bytes, asyncio.Future]] = collections.OrderedDict()

    async def run(self, model_id: str, step_id: str, request, fn: Callable[[], Awaitable]):
        """``fn()`` once per (model, step id); a repeat of the same request gets the first result,
        a different request under a used id INVALID_ARGUMENT."""
        if not step_id:
            return await fn()
        key = (model_id, step_id)
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
        self._seen[key] = (body, fut)
        while len(self._seen) > self.window:
            self._seen.popitem(last=False)
        try:
            result = await fn()
        except BaseException as e:
            self._seen.pop(key, None)
            if not fut.done():
                fut.set_exception(e if isinstance(e, Exception) else errors.unavailable("step was cancelled"))
                fut.exception()  # mark retrieved
            raise
        fut.set_result(result)
        return result
