"""Bounded compilation of structured-output constraints (what they are: ``guided.py``).

Compiling a constraint is the one step of a request whose cost its size alone does not bound: a
JSON schema of objects nested 450 deep is 27 KB (under the 64 KiB cap) and takes ~9 s to compile
here, 1,000 deep ~110 s; xgrammar's compiler cannot be interrupted. So that no request can stall
the server or other callers:

* **Shape limits, before anything** (:func:`check_shape`, INVALID_ARGUMENT naming the field): a
  JSON schema must parse and nest at most :data:`MAX_JSON_DEPTH` levels with at most
  :data:`MAX_SCHEMA_PROPERTIES` properties in all; a regex or grammar nests brackets at most
  :data:`MAX_PATTERN_DEPTH` deep; a choice list has at most :data:`MAX_CHOICES` entries. One
  request compiles at most :data:`MAX_CONSTRAINTS_PER_REQUEST` distinct constraints, counted
  before the first one compiles.
* **Off the event loop, in a bounded pool** (:class:`CompilePool`): a few threads (xgrammar
  releases the GIL while compiling: measured, the loop kept ticking every ~12 ms during a 9 s
  compile) and a short queue; when both are taken, new compiles are refused at once with
  RESOURCE_EXHAUSTED and a RetryInfo computed from the recent compile times. Requests asking for a
  constraint already being compiled wait for that compile (no second slot). A thread stuck on a
  long compile holds only its own slot; the event loop and cached constraints never wait for it.
* **A time limit**: the request's deadline, and at most the server's ``--max-compile-seconds``.
  Past it the request is refused (DEADLINE_EXCEEDED when its own deadline ran out first: the
  result is still cached when the thread finishes; else INVALID_ARGUMENT: the constraint is too
  costly for this server, and its late result is dropped, so the refusal stays the same).
* **A bounded cache** of compiled constraints per model (``guided.Guides``: an LRU by entries and
  bytes, xgrammar's own unbounded cache is off); a cached constraint needs no pool slot.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Sequence

from ferrum_client._proto.ferrum.executor.v1 import types_pb2 as tpb

from ..core import errors
from ..core.callers import current_caller, current_deadline
from ..core.request_limits import limit_of
from ..core.settings import default
from ..core.types import ConstraintSpec, SamplingParams

if TYPE_CHECKING:
    from .host import ModelHost

#: Deepest nesting of arrays / objects in a JSON-schema document (~half as many schema levels).
MAX_JSON_DEPTH = 64
#: Most ``properties`` entries in one JSON schema, all levels together.
MAX_SCHEMA_PROPERTIES = 1024
#: Deepest nesting of ( [ { in a regex or grammar (outside quoted strings and escapes).
MAX_PATTERN_DEPTH = 64
#: Most entries in one choice list (declared in the contract).
MAX_CHOICES = limit_of(tpb.ChoiceList, "choices")
#: Most distinct constraints one request may compile (a batch naming one schema N times is one).
MAX_CONSTRAINTS_PER_REQUEST = 8
#: Threads compiling at once, and compiles that may wait for one (server-wide).
COMPILE_THREADS = 2
COMPILE_QUEUE = 2
#: The server's longest compile (``--max-compile-seconds``).
DEFAULT_MAX_COMPILE_SECONDS = default("max_compile_seconds")


def check_shape(spec: ConstraintSpec, field: str) -> None:
    """INVALID_ARGUMENT (naming ``field.kind``) when a constraint is over a shape limit; cheap
    (one parse or one scan of at most 64 KiB), run before any compile."""
    f = f"{field}.{spec.kind}"
    if spec.kind == "choice":
        if len(spec.choices) > MAX_CHOICES:
            raise errors.invalid(f"{f} has {len(spec.choices)} choices; the limit is {MAX_CHOICES}", field=f,
                                 limit=MAX_CHOICES)
        return
    if spec.kind == "json_schema":
        try:
            doc = json.loads(spec.text)
        except (ValueError, RecursionError) as e:
            raise errors.invalid(f"{f} does not compile: not JSON ({str(e)[:200]})", field=f) from None
        depth, props = _json_shape(doc)
        if depth > MAX_JSON_DEPTH:
            raise errors.invalid(f"{f} nests {depth} levels deep; the limit is {MAX_JSON_DEPTH}", field=f,
                                 limit=MAX_JSON_DEPTH, depth=depth)
        if props > MAX_SCHEMA_PROPERTIES:
            raise errors.invalid(f"{f} has {props} properties; the limit is {MAX_SCHEMA_PROPERTIES}", field=f,
                                 limit=MAX_SCHEMA_PROPERTIES, properties=props)
        return
    depth = _bracket_depth(spec.text, regex=spec.kind == "regex")
    if depth > MAX_PATTERN_DEPTH:
        raise errors.invalid(f"{f} nests brackets {depth} deep; the limit is {MAX_PATTERN_DEPTH}", field=f,
                             limit=MAX_PATTERN_DEPTH, depth=depth)


def _json_shape(doc: Any) -> tuple[int, int]:
    """(nesting depth, ``properties`` entries) of a parsed JSON document, without recursion."""
    deepest = props = 0
    stack = [(doc, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, dict):
            deepest = max(deepest, d)
            p = node.get("properties")
            if isinstance(p, dict):
                props += len(p)
            stack.extend((v, d + 1) for v in node.values())
        elif isinstance(node, list):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in node)
    return deepest, props


def _bracket_depth(text: str, regex: bool) -> int:
    """Deepest nesting of ( [ { in a regex (escapes and character classes skipped) or a grammar
    (quoted strings skipped)."""
    depth = deepest = 0
    i, n = 0, len(text)
    in_class = False
    quote = ""
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if regex:
            if in_class:
                in_class = ch != "]"
            elif ch == "[":
                in_class = True
            elif ch == "(":
                depth += 1
            elif ch == ")":
                depth = max(0, depth - 1)
        elif quote:
            if ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(0, depth - 1)
        deepest = max(deepest, depth)
        i += 1
    return deepest


class CompilePool:
    """The server's constraint compiles: ``threads`` at a time, ``queue`` more waiting, each at most
    ``max_seconds`` (and the request's deadline). Used from the event loop only."""

    def __init__(self, threads: int = COMPILE_THREADS, queue: int = COMPILE_QUEUE,
                 max_seconds: float = DEFAULT_MAX_COMPILE_SECONDS) -> None:
        self.threads = max(1, int(threads))
        self.slots = self.threads + max(0, int(queue))
        self.max_seconds = float(max_seconds)
        self.in_flight = 0  # compiles running or queued (a timed-out one holds its slot until it ends)
        # An identified caller's share of the slots: its compiles (those whose request gave up
        # included: xgrammar cannot be interrupted) count against it until they end, so one
        # caller's slow schemas cannot take every slot. Callers without an identity share one space.
        self.per_caller = max(1, self.slots // 2)
        self._by_caller: collections.Counter[str] = collections.Counter()
        self.refused = 0
        self.timed_out = 0
        self._recent = collections.deque(maxlen=32)  # seconds the last compiles took
        self._running: dict = {}  # (model's Guides, constraint) -> the compile under way, shared
        self._pool: ThreadPoolExecutor | None = None

    def retry_after_ms(self) -> int:
        """When a slot is likely free again: the recent mean compile time x the compiles ahead per
        thread (20 ms .. 10 s)."""
        mean = sum(self._recent) / len(self._recent) if self._recent else 1.0
        return int(min(10_000, max(20, 1000 * mean * self.in_flight / self.threads)))

    async def compile(self, host: "ModelHost", spec: ConstraintSpec, field: str) -> Any:
        """The compiled constraint: from the model's cache, else compiled in the pool."""
        from ..core.guided import guides_of

        guides = guides_of(host.executor)
        guides.check_tokenizer(field)
        hit = guides.cached(spec)
        if hit is not None:
            return hit
        limit = self.max_seconds if self.max_seconds > 0 else None
        deadline = current_deadline.get()
        by_deadline = False
        if deadline is not None:
            left = deadline - time.monotonic()
            if limit is None or left < limit:
                limit, by_deadline = max(0.0, left), True
        key = (id(guides), spec)
        running = self._running.get(key)
        if running is None:  # a compile of the same constraint already under way is shared
            running = self._start(guides, spec, field)
        shared, first_field, abandoned, waiters, fut = running
        waiters[0] += 1
        try:
            return await asyncio.wait_for(asyncio.shield(shared), limit)
        except asyncio.TimeoutError:
            self.timed_out += 1
            if by_deadline:  # the caller's deadline: its result is still worth caching
                raise errors.FerrumError(errors.ErrorKind.TIMEOUT, f"{field}: the request's deadline passed while "
                                         "its constraint compiled", field=field) from None
            abandoned.append(True)
            raise errors.invalid(f"{field}.{spec.kind} did not compile within {self.max_seconds:g} s (this "
                                 "server's limit): simplify it", field=f"{field}.{spec.kind}",
                                 limit_seconds=self.max_seconds) from None
        except errors.FerrumError as e:
            if first_field == field:
                raise
            # another request started this compile: its error names that request's field
            raise errors.FerrumError(e.kind, e.message.replace(first_field, field, 1), code=e.code,
                                     field=e.field.replace(first_field, field, 1), metadata=e.metadata) from None
        finally:
            waiters[0] -= 1
            if not waiters[0] and not shared.done():
                fut.cancel()  # nobody waits for it: a compile still queued is dropped (its slot freed)

    def _start(self, guides, spec: ConstraintSpec, field: str):
        """Submit a compile to the pool (RESOURCE_EXHAUSTED when every slot is taken, or the
        caller's share of them); returns (its future, the field it was started for, its abandoned
        flag, its count of waiting requests, the pool's future)."""
        if self.in_flight >= self.slots:
            self.refused += 1
            raise errors.exhausted(
                f"{field}: {self.in_flight} constraints are compiling or waiting to; the server compiles "
                f"{self.threads} at a time (a cached constraint does not wait)", field=field,
                retry_after_ms=self.retry_after_ms(), compiling=self.in_flight, limit=self.slots)
        caller = current_caller.get()
        if caller and self._by_caller[caller] >= self.per_caller:
            self.refused += 1
            raise errors.exhausted(
                f"{field}: this caller has {self._by_caller[caller]} constraints compiling or waiting to (at "
                f"most {self.per_caller} per caller; a compile whose request gave up counts until it ends)",
                field=field, retry_after_ms=self.retry_after_ms(), compiling=self._by_caller[caller],
                limit=self.per_caller)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ferrum-grammar")
        loop = asyncio.get_running_loop()
        self.in_flight += 1
        self._by_caller[caller] += 1
        t0 = time.monotonic()
        key = (id(guides), spec)

        def finished(f) -> None:  # on the compiling thread (or the loop's, if dropped): count it on the loop
            def free() -> None:
                self.in_flight -= 1
                self._by_caller[caller] -= 1
                if not self._by_caller[caller]:
                    del self._by_caller[caller]
                if not f.cancelled():
                    self._recent.append(time.monotonic() - t0)
                self._running.pop(key, None)
            try:
                loop.call_soon_threadsafe(free)
            except RuntimeError:  # the loop is closed (shutdown)
                pass

        abandoned: list[bool] = []  # set when the server's limit passes: the late result is not cached
        fut = self._pool.submit(guides.compile, spec, field, lambda: not abandoned)
        fut.add_done_callback(finished)
        shared = asyncio.wrap_future(fut)
        shared.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody may await it now
        self._running[key] = (shared, field, abandoned, [0], fut)
        return self._running[key]

    async def compile_all(self, host: "ModelHost", items: Sequence[tuple[SamplingParams, str]]) -> None:
        """Compile every constrained ``(sampling, field)`` of one request into ``sampling.compiled``:
        the distinct constraints are counted first (INVALID_ARGUMENT past
        :data:`MAX_CONSTRAINTS_PER_REQUEST`), then compiled one after another."""
        todo = [(sp, f) for sp, f in items if sp.constraint is not None and sp.compiled is None]
        if not todo:
            return
        first: dict[ConstraintSpec, str] = {}
        for sp, f in todo:
            if sp.constraint not in first:
                if len(first) == MAX_CONSTRAINTS_PER_REQUEST:
                    raise errors.invalid(
                        f"{f}: one request may carry at most {MAX_CONSTRAINTS_PER_REQUEST} distinct constraints",
                        field=f, limit=MAX_CONSTRAINTS_PER_REQUEST)
                first[sp.constraint] = f
        done = {spec: await self.compile(host, spec, f) for spec, f in first.items()}
        for sp, _f in todo:
            sp.compiled = done[sp.constraint]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["CompilePool", "MAX_CHOICES", "MAX_CONSTRAINTS_PER_REQUEST", "MAX_JSON_DEPTH", "MAX_PATTERN_DEPTH",
           "MAX_SCHEMA_PROPERTIES", "check_shape"]
