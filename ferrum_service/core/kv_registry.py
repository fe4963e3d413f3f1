"""The KV cache registry: every live cache of one executor, its tokens, and the KV budget.

Each executor owns one :class:`CacheRegistry`. The registry does the bookkeeping every executor
needs in the same way — ids, token history, token budget and reservations, owners, leases —
and holds an opaque ``payload`` per cache where a real executor keeps its tensors. (The
one-step-at-a-time rule per cache is not kept here: ``ModelHost.hold`` refuses a second step on a
busy cache.) Admission happens here, before any work: a cache that would not fit the budget is
refused with RESOURCE_EXHAUSTED.

Thread-safe: the server reads it from the asyncio loop thread while an executor's worker thread
creates and extends caches; a lock guards the table (payloads belong to the executor).

Totals (tokens held, budget held) are kept as running sums updated by every mutation, so admission
costs O(1) per step however many caches are live. Mutate entries only through the registry
(``create``/``extend``/``truncate``/``set_reserved``/``release``) or the sums drift.
"""

from __future__ import annotations

import collections
import math
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from . import errors
from .modes import CacheEvent
from .types import CacheHandle


def new_cache_id(prefix: str) -> str:
    """A cache id nobody can guess (128 random bits): ids from two replicas never collide, so a
    step routed to the wrong replica gets NOT_FOUND, and an id is never a handle on another
    caller's cache."""
    return f"{prefix}-{secrets.token_hex(16)}"


@dataclass
class CacheEntry:
    """One live cache."""

    cache_id: str
    model_id: str
    tokens: list[int]
    reserved_total: int = 0  # tokens promised to this cache (>= len(tokens) once set)
    payload: Any = None  # executor-specific state (e.g. K/V tensors)
    owner: str = ""  # a Session / Generate stream that frees it when it ends ("" = the caller)
    tenant: str = ""  # the authenticated caller it belongs to ("" = calls are not authenticated)
    adapter: str = ""  # the LoRA adapter the cache was computed with and is bound to ("" = the base model)
    guide: Any = None  # structured-output state (guided.GuideState) once a constrained row was sampled
    origin: str = ""  # where the unary call that made it came from ("caller@host", callers.py)
    last_access: float = field(default_factory=time.monotonic)
    chunking: bool = False  # its last UnifiedDecode item was a non-final prompt chunk (role checks)
    caller_supplied: bool = False  # holds K/V a caller streamed in (ImportKv), not computed here (kv_transfer.py)
    released: bool = False  # set when the registry forgets it (a holder of the entry needs no look-up)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def check_adapter(self, name: str, field: str) -> None:
        """FAILED_PRECONDITION when a step names LoRA adapter ``name`` and this cache is bound to
        another (the base model included). An empty cache not yet bound (``ReserveKvSlots``) takes
        the first one named; "" always means the cache's own."""
        if name and name != self.adapter and (self.tokens or self.adapter):
            bound = f"adapter {self.adapter!r}" if self.adapter else "the base model"
            raise errors.failed_precondition(f"{field}: cache {self.cache_id!r} is bound to {bound}, not adapter "
                                             f"{name!r}", field=field, cache_adapter=self.adapter)

    @property
    def footprint(self) -> int:
        """Tokens of budget this cache holds (its tokens, or its reservation if larger)."""
        return max(len(self.tokens), self.reserved_total)


class CacheRegistry:
    """Live caches of one executor and the KV budget they share."""

    def __init__(
        self,
        model_id: str,
        *,
        total_tokens: int,
        block_size: int = 16,
        bytes_per_token: int = 0,
        per_request_tokens: int | None = None,
        max_active: int = 0,
        id_prefix: str = "kv",
        on_event: Callable[[CacheEvent, CacheEntry], None] | None = None,
        token_admission: bool = True,
    ) -> None:
        """``token_admission=False``: the executor admits KV itself (a paged pool where blocks are
        shared); the registry then only enforces ``max_active``."""
        self.model_id = model_id
        self.token_admission = token_admission
        self.total_tokens = total_tokens
        self.block_size = block_size
        self.bytes_per_token = bytes_per_token
        self.per_request_tokens = per_request_tokens
        self.max_active = max_active
        self.id_prefix = id_prefix
        self.on_event = on_event
        self._lock = threading.RLock()
        self._caches: dict[str, CacheEntry] = {}
        self._by_tenant: collections.Counter[str] = collections.Counter()  # live caches per tenant
        self._released: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.created_total = 0
        self.released_total = 0
        self.reclaimed_total = 0
        # Running sums over live caches: tokens held and budget held (sum of footprints).
        self._tokens_held = 0
        self._budget_held = 0
        self.peak_tokens = 0  # the most tokens live caches held at once (``ModelStats`` peak)
        # Imports whose K/V are arriving (ImportKv): not caches yet, but they hold KV and will be.
        self.staged_imports = 0
        self.staged_tokens = 0

    # ---- queries -----------------------------------------------------------------------------
    def subscribe(self, sink: Callable[[CacheEvent, CacheEntry], None]) -> None:
        """Send this registry's cache events to ``sink`` (the server's KV event hub; one sink)."""
        self.on_event = sink

    def __len__(self) -> int:
        return len(self._caches)

    def __contains__(self, cache_id: str) -> bool:
        return cache_id in self._caches

    def entries(self) -> list[CacheEntry]:
        with self._lock:
            return list(self._caches.values())

    def held_by(self, tenant: str) -> int:
        """Live caches that belong to ``tenant`` (counted as they come and go, not scanned)."""
        return self._by_tenant[tenant]

    @property
    def used_tokens(self) -> int:
        """Tokens held by live caches."""
        return self._tokens_held

    @property
    def reserved_tokens(self) -> int:
        """Budget promised to live caches beyond the tokens they hold."""
        return self._budget_held - self._tokens_held

    @property
    def free_tokens(self) -> int:
        return max(0, self.total_tokens - self._budget_held - self.staged_tokens)

    def recount(self) -> tuple[int, int]:
        """(tokens, budget) summed over the live caches the slow way (a check on the running sums)."""
        entries = self.entries()
        return sum(e.num_tokens for e in entries), sum(e.footprint for e in entries)

    def touch(self, cache_id: str) -> None:
        """Renew a cache's lease (``last_access``); a no-op for caches that are not live."""
        entry = self._caches.get(cache_id)
        if entry is not None:
            entry.last_access = time.monotonic()

    def was_released(self, cache_id: str) -> bool:
        return cache_id in self._released

    def get(self, cache_id: str, field: str = "cache_id") -> CacheEntry:
        """The live cache, or NOT_FOUND naming whether it never existed or was released."""
        entry = self._caches.get(cache_id)
        if entry is None:
            if not cache_id:
                raise errors.invalid(f"{field} is empty", field=field)
            state = "was released" if cache_id in self._released else "is unknown"
            raise errors.not_found(
                f"{field}: cache {cache_id!r} {state} on model {self.model_id!r}",
                field=field,
                cache_id=cache_id,
                model_id=self.model_id,
            )
        return entry

    def handle(self, entry: CacheEntry, memory_bytes: int | None = None) -> CacheHandle:
        """The wire snapshot of a cache."""
        n = entry.num_tokens
        blocks = math.ceil(n / self.block_size) if self.block_size else 0
        return CacheHandle(
            cache_id=entry.cache_id,
            model_id=self.model_id,
            num_tokens=n,
            block_size=self.block_size,
            num_blocks=blocks,
            memory_bytes=memory_bytes if memory_bytes is not None else n * self.bytes_per_token,
            adapter=entry.adapter,
        )

    # ---- admission ---------------------------------------------------------------------------
    def sequence_limit(self, max_sequence_length: int) -> int:
        """Most tokens one sequence may hold: the model's length, or this registry's per-request
        ceiling if lower (0 = no limit)."""
        limit = max_sequence_length
        if self.per_request_tokens:
            limit = min(limit, self.per_request_tokens) if limit else self.per_request_tokens
        return limit

    def check_sequence_length(self, total: int, field: str, max_sequence_length: int) -> None:
        """INVALID_ARGUMENT when one sequence could never hold ``total`` tokens."""
        limit = self.sequence_limit(max_sequence_length)
        if limit and total > limit:
            raise errors.invalid(
                f"{field}: the sequence would hold {total} tokens; this model's limit is {limit}",
                field=field,
                limit=limit,
                requested=total,
            )

    def admit(self, extra_tokens: int, field: str, *, new_caches: int = 0) -> None:
        """RESOURCE_EXHAUSTED unless ``extra_tokens`` more tokens of budget are free now."""
        if self.max_active and len(self._caches) + self.staged_imports + new_caches > self.max_active:
            raise errors.exhausted(
                f"{field}: {len(self._caches)} caches are active; the limit is {self.max_active}",
                field=field,
                active=len(self._caches),
                limit=self.max_active,
            )
        free = self.free_tokens
        if self.token_admission and extra_tokens > free:
            raise errors.exhausted(
                f"{field}: needs {extra_tokens} KV tokens but only {free} of {self.total_tokens} are free",
                field=field,
                needed=extra_tokens,
                free=free,
                total=self.total_tokens,
            )

    def stage(self, tokens: int, field: str) -> None:
        """Admit an import of ``tokens`` (RESOURCE_EXHAUSTED as a new cache's) and count it as held
        until :meth:`unstage` (its commit turns it into a cache, or it is aborted)."""
        with self._lock:
            self.admit(tokens, field, new_caches=1)
            self.staged_imports += 1
            self.staged_tokens += tokens

    def unstage(self, tokens: int) -> None:
        with self._lock:
            self.staged_imports -= 1
            self.staged_tokens -= tokens

    def growth(self, entry: CacheEntry, new_len: int) -> int:
        """Budget tokens ``entry`` needs beyond what it holds to reach ``new_len`` tokens."""
        return max(0, new_len - entry.footprint)

    # ---- mutation ----------------------------------------------------------------------------
    def create(self, tokens: list[int], *, reserve_tokens: int = 0, owner: str = "", field: str = "input",
               event: CacheEvent = CacheEvent.CREATED) -> CacheEntry:
        """Admit and register a new cache holding ``tokens`` (``event``: created | forked)."""
        need = max(len(tokens), reserve_tokens)
        with self._lock:
            self.admit(need, field, new_caches=1)
            cache_id = new_cache_id(self.id_prefix)
            entry = CacheEntry(cache_id, self.model_id, list(tokens), reserved_total=reserve_tokens, owner=owner)
            self._caches[cache_id] = entry
            self._by_tenant[entry.tenant] += 1
            self.created_total += 1
            self._tokens_held += entry.num_tokens
            self._budget_held += entry.footprint
            self.peak_tokens = max(self.peak_tokens, self._tokens_held)
        self._emit(event, entry)
        return entry

    def extend(self, entry: CacheEntry, tokens: list[int]) -> None:
        """Append tokens (admission must have been checked with :meth:`growth`)."""
        with self._lock:
            before = entry.footprint
            entry.tokens.extend(tokens)
            self._account(entry, len(tokens), before)
        entry.last_access = time.monotonic()
        self._emit(CacheEvent.EXTENDED, entry)

    def truncate(self, entry: CacheEntry, new_len: int) -> int:
        with self._lock:
            before = entry.footprint
            removed = len(entry.tokens) - new_len
            del entry.tokens[new_len:]
            self._account(entry, -removed, before)
        entry.last_access = time.monotonic()
        self._emit(CacheEvent.TRUNCATED, entry)
        return removed

    def set_tenant(self, entry: CacheEntry, tenant: str) -> None:
        """Give a cache to ``tenant`` (the caller it belongs to; ``held_by`` counts it there)."""
        with self._lock:
            if entry.cache_id in self._caches and entry.tenant != tenant:
                self._uncount(entry.tenant)
                self._by_tenant[tenant] += 1
            entry.tenant = tenant

    def _uncount(self, tenant: str) -> None:
        n = self._by_tenant[tenant] - 1
        if n > 0:
            self._by_tenant[tenant] = n
        else:
            del self._by_tenant[tenant]

    def set_reserved(self, entry: CacheEntry, reserved_total: int) -> None:
        """Set the tokens of budget promised to ``entry`` (its reservation)."""
        with self._lock:
            before = entry.footprint
            entry.reserved_total = reserved_total
            self._account(entry, 0, before)

    def _account(self, entry: CacheEntry, token_delta: int, footprint_before: int) -> None:
        if entry.cache_id in self._caches:
            self._tokens_held += token_delta
            self._budget_held += entry.footprint - footprint_before
            self.peak_tokens = max(self.peak_tokens, self._tokens_held)

    def release(self, cache_id: str, *, reason: CacheEvent = CacheEvent.RELEASED) -> CacheEntry | None:
        """Forget a cache; None when it is not live. ``reason``: released | reclaimed | evicted."""
        with self._lock:
            entry = self._caches.pop(cache_id, None)
            if entry is None:
                return None
            entry.released = True
            self._uncount(entry.tenant)
            self._tokens_held -= entry.num_tokens
            self._budget_held -= entry.footprint
            self._released[cache_id] = None
            while len(self._released) > 65536:
                self._released.popitem(last=False)
            if reason == CacheEvent.RECLAIMED:
                self.reclaimed_total += 1
            else:
                self.released_total += 1
        self._emit(reason, entry)
        return entry

    def _emit(self, kind: CacheEvent, entry: CacheEntry) -> None:
        if self.on_event is not None:
            self.on_event(kind, entry)
