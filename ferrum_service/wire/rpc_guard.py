"""The one guard every RPC this server hosts runs under (the contract's and the vLLM protocol's).

:meth:`RpcGuard.answer` refuses work while the server drains and turns every error into a gRPC
status (``convert.status_of``: ErrorInfo always; BadRequest naming the field; RetryInfo for
RESOURCE_EXHAUSTED / UNAVAILABLE); an unexpected exception is logged with its traceback and
answered INTERNAL. Each call is timed, counted under the code it ended with, and traced (when
tracing is on). The server (``server.py``) builds one and hands it to both services.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc
import structlog
from grpc_status import rpc_status

from ..core import errors
from ..core.callers import CallerActivity, enter_call
from ..core.serving_state import ServingState
from ..core.settings import default
from . import tracing
from .convert import as_ferrum_error, status_of
from .metrics import Metrics
from .write_deadline import send_stream

log = structlog.get_logger("ferrum_service.wire.servicer")

#: What a server that drains by migration still answers (reads, its caches' export to peers, moves).
WHILE_MIGRATING = {"Info", "Capabilities", "Status", "KvCapacity", "AdmissionLimits", "KvSlotCapacity",
                   "CacheMetrics", "LoraMetrics", "Loads", "ListCaches", "ListAdapters", "ExportKv", "Abort",
                   "ReleaseCache", "MigrateStreams", "Tokenize", "Detokenize", "ApplyChatTemplate", "Shutdown",
                   "AcceptMigration",  # refuses new streams itself, but drops pre-copies (migration.py)
                   # the vLLM protocol's reads and Abort (its HealthCheck says the server drains)
                   "VllmEngine.GetModelInfo", "VllmEngine.GetServerInfo", "VllmEngine.GetLoads",
                   "VllmEngine.GetTokenizer", "VllmEngine.Abort"}


def request_ids(request) -> dict:
    """The ids a request carries, as span attributes."""
    if request is None:
        return {}
    inner = getattr(request, "input", None)
    return {"model_id": getattr(request, "model_id", ""),
            "cache_id": getattr(request, "cache_id", "") or getattr(inner, "cache_id", ""),
            "request_id": getattr(request, "request_id", "") or getattr(inner, "request_id", "")}


class _Outcome:
    """The status code an RPC ended with (for metrics)."""

    code = "OK"


class RpcGuard:
    """Draining, errors as statuses, metrics and tracing for every RPC (see the module doc)."""

    def __init__(self, metrics: Metrics, *, activity: CallerActivity | None = None, tokens_checked: bool = False,
                 admin_open: bool = False, serving: ServingState | None = None,
                 stream_write_timeout: float = default("stream_write_timeout")) -> None:
        """``tokens_checked``: bearer tokens are verified (they then name the caller that owns a
        cache); ``admin_open``: the admin RPCs may be called (admin tokens guard them, or the
        operator opened them); ``activity``: where each call's origin is recorded (for the lease
        reaper's idle-origin rule); ``serving``: the server's drain flags (``shutting_down``: every
        RPC refused; ``migrating``: only :data:`WHILE_MIGRATING` answered);
        ``stream_write_timeout``: seconds a server stream's next message may wait for its client
        (write_deadline.py; 0 = none)."""
        self.metrics = metrics
        self.activity = activity if activity is not None else CallerActivity()
        self.tokens_checked = tokens_checked
        self.admin_open = admin_open
        self.serving = serving if serving is not None else ServingState()
        self.stream_write_timeout = stream_write_timeout

    def paused(self) -> bool:
        """No new work is taken (the server drains, or drains by migration)."""
        return self.serving.paused()

    def enter(self, context: grpc.aio.ServicerContext) -> str:
        """Record the call's caller and origin (``callers.enter_call``); returns the origin."""
        return enter_call(context, self.activity, tokens_checked=self.tokens_checked)

    def check_serving(self) -> None:
        """UNAVAILABLE while the server shuts down."""
        if self.serving.shutting_down:
            raise errors.unavailable("the server is shutting down; retry on another replica")

    def check_admin(self, rpc: str) -> None:
        """Admin RPCs are closed unless admin tokens guard them (the auth interceptor checks the
        token) or the operator opened them (``--open-admin-rpcs``)."""
        if not self.admin_open:
            raise errors.permission_denied(
                f"{rpc} is an admin RPC: configure admin tokens (--admin-token-file) or start the server with "
                "--open-admin-rpcs")

    @contextlib.asynccontextmanager
    async def answer(self, rpc: str, context: grpc.aio.ServicerContext, request=None):
        """Run an RPC's body under the guard (see the module doc)."""
        t0 = time.perf_counter()
        outcome = _Outcome()
        self.enter(context)
        span = (tracing.start_rpc(rpc, context.invocation_metadata(), **request_ids(request))
                if tracing.on else None)
        try:
            self.check_serving()
            if self.serving.migrating and rpc not in WHILE_MIGRATING:
                raise errors.unavailable("the server drains (its streams move to a peer); retry on another replica")
            yield outcome
        except asyncio.CancelledError:
            outcome.code = "CANCELLED"
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            e = as_ferrum_error(exc, rpc)
            outcome.code = e.code.name
            if isinstance(exc, errors.FerrumError):
                self.log_refusal(rpc, e)
            await context.abort_with_status(rpc_status.to_status(status_of(e)))
        finally:
            self.metrics.observe(rpc, outcome.code, time.perf_counter() - t0)
            tracing.end(span, outcome.code)

    async def unary(self, rpc: str, context: grpc.aio.ServicerContext, fn: Callable[[], Awaitable[Any]],
                    request=None):
        """A unary RPC: ``fn()``'s answer under :meth:`answer`."""
        async with self.answer(rpc, context, request):
            return await fn()

    async def send(self, rpc: str, messages: AsyncIterator, context: grpc.aio.ServicerContext) -> None:
        """Send a server stream's messages under the stream write timeout (write_deadline.py)."""
        await send_stream(rpc, messages, context, self.stream_write_timeout)

    async def stream(self, rpc: str, context: grpc.aio.ServicerContext, request, body: AsyncIterator) -> None:
        """A server stream under the guard: :meth:`answer` (the caller entered once, the drain
        refused, errors as statuses, timed, counted, traced) around ``body``'s messages, each
        written under the stream write timeout (:meth:`send`). ``body`` is an async generator
        not started yet: a refused call never runs it."""
        async with self.answer(rpc, context, request):
            await send_stream(rpc, body, context, self.stream_write_timeout)

    def refused(self, rpc: str, e: errors.FerrumError, seconds: float) -> None:
        """A call refused before its handler ran (a request over a declared limit, ``limits.py``):
        logged and counted as the guard counts the others."""
        self.log_refusal(rpc, e)
        self.metrics.observe(rpc, e.code.name, seconds)

    def log_refusal(self, rpc: str, e: errors.FerrumError) -> None:
        """Log a refused request (RESOURCE_EXHAUSTED as a warning, and counted)."""
        lvl = log.warning if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED else log.info
        lvl("request refused", rpc=rpc, code=e.code.name, kind=e.kind.name, field=e.field, message=e.message,
            **{k: v for k, v in e.metadata.items() if k in ("cache_id", "model_id")})
        if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self.metrics.admission_refusals.inc()


__all__ = ["WHILE_MIGRATING", "RpcGuard", "request_ids"]
