"""OpenTelemetry tracing: the span tree a traced caller gets back, checked with the SDK's in-memory
exporter against a real server (the tiny random-weight Llama) on a real port.

A W3C ``traceparent`` in the gRPC metadata continues the caller's trace: each RPC is a server span
whose parent is the caller's span; each step has ``queue`` / ``forward`` (/ ``sampling``) children
timed inside the RPC; a Generate stream has ``generate.prompt`` and ``generate.decode``; each
Session step is a span under the Session's.
"""

from __future__ import annotations

import pytest

from ferrum_client import Client, messages as m, pb

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.servers import InProcessServer

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = [("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01")]


@pytest.fixture
def traced(tiny_llama_dir):  # noqa: F811
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from ferrum_service.wire import tracing
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    assert tracing.configure(provider=provider)
    ex = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=4096)
    try:
        with InProcessServer([ex]) as srv, Client(srv.target) as c:
            yield c, exporter
    finally:
        tracing.shutdown()


def _by_name(spans):
    out = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def _children(spans, parent):
    return [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]


def test_a_step_continues_the_callers_trace_with_timed_children(traced):
    c, exporter = traced
    r = c.stub.Prefill(pb.PrefillRequest(model_id="tiny", input=m.prefill_input([1, 2, 3], request_id="req-7")),
                       metadata=TRACEPARENT)
    cid = r.output.cache.cache_id
    c.stub.Decode(pb.DecodeRequest(model_id="tiny", input=m.decode_input(cid, 5)), metadata=TRACEPARENT)
    c.release_cache("tiny", cid)
    spans = exporter.get_finished_spans()
    names = _by_name(spans)
    prefill = names["ferrum.executor.v1.ModelExecutor/Prefill"][0]
    assert format(prefill.context.trace_id, "032x") == TRACE_ID
    assert format(prefill.parent.span_id, "016x") == PARENT_ID
    assert prefill.attributes["ferrum.model_id"] == "tiny"
    assert prefill.attributes["ferrum.request_id"] == "req-7"
    assert prefill.attributes["rpc.grpc.status_code"] == "OK"
    kids = {s.name: s for s in _children(spans, prefill)}
    assert {"queue", "forward", "sampling"} <= set(kids)
    assert kids["queue"].end_time <= kids["forward"].start_time + 1_000
    assert prefill.start_time <= kids["queue"].start_time and kids["sampling"].end_time <= prefill.end_time
    decode = names["ferrum.executor.v1.ModelExecutor/Decode"][0]
    assert decode.attributes["ferrum.cache_id"] == cid
    assert {"queue", "forward"} <= {s.name for s in _children(spans, decode)}
    # ReleaseCache came without a traceparent: a new trace of its own
    release = names["ferrum.executor.v1.ModelExecutor/ReleaseCache"][0]
    assert release.parent is None and format(release.context.trace_id, "032x") != TRACE_ID


def test_generate_and_session_spans(traced):
    c, exporter = traced
    events = list(c.stub.Generate(m.generate_request("tiny", token_ids=[4, 5], max_tokens=5, ignore_eos=True),
                                  metadata=TRACEPARENT))
    assert events[-1].finished.generated_tokens == 5
    with c.session() as s:
        cid = s.step(pb.PrefillRequest(model_id="tiny", input=m.prefill_input([1, 2]))).output.cache.cache_id
        s.step(pb.DecodeRequest(model_id="tiny", input=m.decode_input(cid, 3)))
    spans = exporter.get_finished_spans()
    names = _by_name(spans)
    gen = names["ferrum.executor.v1.ModelExecutor/Generate"][0]
    assert format(gen.context.trace_id, "032x") == TRACE_ID
    kids = {s.name: s for s in _children(spans, gen)}
    assert kids["generate.decode"].attributes["ferrum.generated_tokens"] == 5
    assert kids["generate.prompt"].attributes["ferrum.prompt_tokens"] == 2
    assert kids["generate.prompt"].end_time <= kids["generate.decode"].start_time
    assert gen.attributes["ferrum.cache_id"].startswith("hf-")
    session = names["ferrum.executor.v1.ModelExecutor/Session"][0]
    steps = [s.name for s in _children(spans, session)]
    assert steps == ["Session.Prefill", "Session.Decode"]
    step = names["Session.Decode"][0]
    assert step.attributes["ferrum.cache_id"] == cid
    assert {"queue", "forward"} <= {s.name for s in _children(spans, step)}
