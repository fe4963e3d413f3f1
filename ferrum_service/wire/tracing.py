"""OpenTelemetry tracing: a span per RPC, child spans per executor step and per Generate stream.

Off by default, and free when off: nothing of OpenTelemetry is imported and every hook returns at
its first line. :func:`configure` turns it on — with an OTLP exporter to ``--otlp-endpoint``
(``FERRUM_OTLP_ENDPOINT``), or when the standard ``OTEL_TRACES_EXPORTER=otlp`` /
``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`` environment names one, or with a tracer provider given by
the caller (tests use the SDK's in-memory exporter).

Spans:

* ``ferrum.executor.v1.ModelExecutor/<Rpc>`` (server kind) per call, continuing the caller's trace
  when its gRPC metadata carries a W3C ``traceparent``; attributes ``rpc.method``,
  ``ferrum.model_id``, ``ferrum.cache_id``, ``ferrum.request_id``, and the gRPC status code;
* ``Session.<Step>`` per step of a Session stream, under the stream's span;
* per step, ``queue`` (waiting for the model's worker), ``forward`` and ``sampling``, timed by the
  step's own ``StepTimings``;
* per Generate stream, ``generate.prompt`` (until the first token) and ``generate.decode`` (the
  token loop, with ``ferrum.generated_tokens``).

The current RPC's span lives in a context variable of this module (each RPC runs in its own
asyncio task), not in OpenTelemetry's attached context, so streams that yield across await points
never detach a context in the wrong place.
"""

from __future__ import annotations

import contextvars
import time
from typing import Any

from ..core.settings import env

_tracer: Any = None  # an opentelemetry Tracer while tracing is on
_propagator: Any = None
_provider: Any = None
_current: contextvars.ContextVar[Any] = contextvars.ContextVar("ferrum_span", default=None)
# perf_counter_ns -> epoch ns (steps are timed with perf_counter; spans need wall-clock times).
# Every span's start and end come from perf_counter through this one offset, so a parent always
# encloses its children even when the wall clock is stepped or slewed while the server runs.
_EPOCH_OFFSET = time.time_ns() - time.perf_counter_ns()


#: Whether spans are recorded (read as a plain attribute on every RPC; ``configure`` / ``shutdown`` set it).
on = False


def configure(endpoint: str | None = None, *, provider: Any = None, service_name: str = "ferrum-service") -> bool:
    """Turn tracing on when asked to (see the module doc); returns whether it is on."""
    global _tracer, _propagator, _provider, on
    wanted = provider is not None or bool(endpoint) or env("OTEL_TRACES_EXPORTER") == "otlp" or bool(
        env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env("OTEL_EXPORTER_OTLP_ENDPOINT"))
    if not wanted or (env("OTEL_SDK_DISABLED") or "").lower() == "true":
        return False
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if provider is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        name = env("OTEL_SERVICE_NAME") or service_name
        provider = TracerProvider(resource=Resource.create({"service.name": name}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint) if endpoint
                                                       else OTLPSpanExporter()))
    _provider = provider
    _tracer = provider.get_tracer("ferrum_service")
    _propagator = TraceContextTextMapPropagator()
    on = True
    return True


def shutdown() -> None:
    """Flush and stop the exporter (the server calls it when it stops); tracing is off after."""
    global _tracer, _provider, on
    if _provider is not None and hasattr(_provider, "shutdown"):
        _provider.shutdown()
    _tracer = _provider = None
    on = False


def _epoch(perf_ns: int) -> int:
    return perf_ns + _EPOCH_OFFSET


def _now() -> int:
    return _epoch(time.perf_counter_ns())


# ---- RPC spans ------------------------------------------------------------------------------------
def start_rpc(rpc: str, metadata, **attrs: Any) -> Any:
    """Start the span of one RPC (continuing a ``traceparent`` in ``metadata``) and make it this
    task's current span; None when tracing is off."""
    if _tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    span = _tracer.start_span(f"ferrum.executor.v1.ModelExecutor/{rpc}", context=_propagator.extract(carrier),
                              kind=SpanKind.SERVER, attributes={"rpc.system": "grpc", "rpc.method": rpc,
                                                                **_clean(attrs)}, start_time=_now())
    _current.set(span)
    return span


def start_child(name: str, **attrs: Any) -> Any:
    """Start a child of the current span and make it current (e.g. one Session step); None when off."""
    if _tracer is None:
        return None
    parent = _current.get()
    span = _tracer.start_span(name, context=_in(parent), attributes=_clean(attrs), start_time=_now())
    _current.set(span)
    return span


def end(span: Any, code: str = "OK", restore: Any = None) -> None:
    """End ``span`` with its gRPC status code; ``restore`` becomes the current span again."""
    if span is None:
        return
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("rpc.grpc.status_code", code)
    if code not in ("OK", "CANCELLED"):
        span.set_status(Status(StatusCode.ERROR, code))
    span.end(end_time=_now())
    _current.set(restore)


def current() -> Any:
    return _current.get()


def annotate(**attrs: Any) -> None:
    """Attributes on the current span (model, cache, request ids) once they are known."""
    span = _current.get()
    if span is not None:
        span.set_attributes(_clean(attrs))


# ---- step spans -----------------------------------------------------------------------------------
def step(submitted_ns: int, queued_ns: int, forward_ns: int, sampling_ns: int = 0, **attrs: Any) -> None:
    """Child spans of one executor step from its timings (perf_counter ns): ``queue`` from
    submission until the worker took it, ``forward`` while it ran, and ``sampling`` (the last
    ``sampling_ns`` of the run) when the step sampled on the worker."""
    parent = _current.get()
    if parent is None:
        return
    ctx = _in(parent)
    start = _epoch(submitted_ns)
    run = start + queued_ns
    a = _clean(attrs)
    for name, t0, t1 in (("queue", start, run), ("forward", run, run + forward_ns - sampling_ns),
                         ("sampling", run + forward_ns - sampling_ns, run + forward_ns)):
        if name == "sampling" and not sampling_ns:
            continue
        _tracer.start_span(name, context=ctx, start_time=t0, attributes=a).end(end_time=t1)


def interval(name: str, t0_perf_ns: int, t1_perf_ns: int, **attrs: Any) -> None:
    """A child span of the current span over ``[t0, t1]`` (perf_counter ns)."""
    parent = _current.get()
    if parent is None:
        return
    _tracer.start_span(name, context=_in(parent), start_time=_epoch(t0_perf_ns),
                       attributes=_clean(attrs)).end(end_time=_epoch(t1_perf_ns))


def _in(span: Any):
    if span is None:
        return None
    from opentelemetry import trace

    return trace.set_span_in_context(span)


def _clean(attrs: dict) -> dict:
    return {("ferrum." + k if "." not in k else k): v for k, v in attrs.items() if v not in (None, "")}


__all__ = ["annotate", "configure", "current", "enabled", "end", "interval", "shutdown", "start_child",
           "start_rpc", "step"]
