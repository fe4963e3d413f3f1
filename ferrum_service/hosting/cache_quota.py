"""Caps on live caches: per model (``--max-caches``) and per caller (``--max-caches-per-caller``).

A cache costs the server memory even when it holds no KV blocks: a fork shares its source's blocks
and an empty ``ReserveKvSlots(new_sequence)`` cache holds none, yet each keeps an entry and a copy
of its tokens. So the number of live caches is capped twice, both refused with RESOURCE_EXHAUSTED
and a RetryInfo from the measured service rate (``progress.py``; at least 1 s for a caller at its
own cap) before any work:

* **per model**: the registry's ``max_active`` (the server sets it to ``--max-caches``, or keeps
  the executor's own lower limit: llama.cpp's ``n_seq``); it counts every live cache, staged
  imports committed included;
* **per caller** (:class:`CacheQuota`): the caches one caller identity (``callers.py``: a bearer
  token's digest or a client certificate's subject; all unauthenticated callers are one) holds on
  a model, plus those its calls are creating right now (staged imports and pre-copies
  included), so a burst of concurrent calls cannot slip past it.

``ReserveKvSlots`` also takes at most :data:`MAX_SLOT_REQUESTS` requests per call.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Iterator

from ferrum_client._proto.ferrum.executor.v1 import executor_pb2 as pb

from ..core import errors
from ..core.callers import current_caller
from ..core.request_limits import limit_of
from ..core.settings import default

if TYPE_CHECKING:
    from .host import ModelHost

#: Default ``--max-caches`` (live caches per model) and ``--max-caches-per-caller``.
DEFAULT_MAX_CACHES = default("max_caches")
DEFAULT_MAX_CACHES_PER_CALLER = default("max_caches_per_caller")
#: Least retry delay for a caller at its own cap: only its own releases make room, so retrying
#: at the service rate (tens of ms on an idle model) would only spin.
QUOTA_RETRY_MS = 1000
#: Most requests one ``ReserveKvSlots`` call may carry (declared in the contract).
MAX_SLOT_REQUESTS = limit_of(pb.ReserveKvSlotsRequest, "requests")


class CacheQuota:
    """Live caches per caller and model, with the ones being created counted (event loop only)."""

    def __init__(self, per_caller: int = 0) -> None:
        self.per_caller = int(per_caller)
        self._pending: dict[tuple[str, str], int] = {}

    @contextlib.contextmanager
    def claim(self, host: "ModelHost", new: int, field: str) -> Iterator[None]:
        """Hold room for ``new`` caches the current caller's call creates while the block runs
        (adopt them inside it); RESOURCE_EXHAUSTED when the caller would go past its cap."""
        release = self.take(host, new, field)
        try:
            yield
        finally:
            release()

    def take(self, host: "ModelHost", new: int, field: str) -> Callable[[], None]:
        """Room for ``new`` caches of the current caller held until the returned function is
        called (once; later calls do nothing): for a creation that outlives one call, such as a
        migration's staged pre-copy. RESOURCE_EXHAUSTED when the caller would go past its cap."""
        if self.per_caller <= 0 or new <= 0:
            return _nothing
        caller = current_caller.get()
        key = (host.model_id, caller)
        live = host.executor.registry.held_by(caller)
        pending = self._pending.get(key, 0)
        if live + pending + new > self.per_caller:
            raise errors.exhausted(
                f"{field}: this caller holds {live} caches on model {host.model_id!r}"
                + (f" and is creating {pending}" if pending else "")
                + f"; the limit per caller is {self.per_caller}: release caches it no longer needs",
                retry_after_ms=max(QUOTA_RETRY_MS, host.retry_after_ms()), field=field, model_id=host.model_id, live=live,
                limit=self.per_caller)
        self._pending[key] = pending + new
        done = False

        def release() -> None:
            nonlocal done
            if done:
                return
            done = True
            left = self._pending.get(key, new) - new
            if left > 0:
                self._pending[key] = left
            else:
                self._pending.pop(key, None)
        return release


def _nothing() -> None:
    return None

__all__ = ["CacheQuota", "DEFAULT_MAX_CACHES", "DEFAULT_MAX_CACHES_PER_CALLER", "MAX_SLOT_REQUESTS"]
