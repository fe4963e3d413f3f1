"""Observability: ``/metrics`` over HTTP on the metrics port has request counters and latency
histograms by RPC and status code, generated tokens, active caches, KV tokens/blocks/bytes in use,
queue depth, admission refusals, cancelled streams, reclaimed and expired caches."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ferrum_client import Client, FerrumRpcError, messages as m, pb

from ferrum_service.executors import ConfigurableModelExecutor, StubModelExecutor

from .support.servers import InProcessServer, free_port


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.status == 200
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _get(samples, name, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"{name}{labels} not exported; have: {sorted(k for k in samples if k[0] == name)}"
    return samples[key]


def test_metrics_endpoint_exports_the_service_figures():
    port = free_port()
    mock = ConfigurableModelExecutor.with_token_sequence(1000, [7], model_id="mock", kv_budget_tokens=64)
    with InProcessServer([mock, StubModelExecutor("stub", 100)], metrics_port=port, cache_ttl=1.0) as srv, \
            Client(srv.target) as c:
        keep = c.prefill("mock", list(range(1, 21))).output.cache.cache_id  # 20 tokens: 2 blocks
        for _ in range(3):
            c.decode("mock", keep, 1)
        with pytest.raises(FerrumRpcError):
            c.prefill("mock", [5000])  # INVALID_ARGUMENT
        with pytest.raises(FerrumRpcError):
            c.prefill("mock", [1] * 50)  # RESOURCE_EXHAUSTED: 23 + 50 > 64
        assert len(c.generate("stub", token_ids=[1], max_tokens=5).tokens()) == 5
        with c.session() as s:
            s.step(pb.PrefillRequest(model_id="stub", input=m.prefill_input([1, 2])))
        gone = c.prefill("stub", [1]).output.cache.cache_id  # never touched again: its lease expires
        live = c.prefill("stub", [1, 2, 3]).output.cache.cache_id
        # keep `keep` and `live` alive (touched every ~0.1 s against a 1 s TTL: a CI stall of 0.4 s
        # once expired them at 0.3 s) until `gone`'s lease expires; at most 35 rounds (mock's budget)
        rounds = 0
        while rounds < 35 and not srv.models.get("stub").executor.registry.was_released(gone):
            c.decode("mock", keep, 1)
            c.decode("stub", live, 1)
            rounds += 1
            time.sleep(0.1)
        assert srv.models.get("stub").executor.registry.was_released(gone)
        decodes = 3 + 2 * rounds
        ms = _scrape(port)

        # requests and latency by RPC and code
        assert _get(ms, "ferrum_requests_total", rpc="Prefill", code="OK") == 3
        assert _get(ms, "ferrum_requests_total", rpc="Prefill", code="INVALID_ARGUMENT") == 1
        assert _get(ms, "ferrum_requests_total", rpc="Prefill", code="RESOURCE_EXHAUSTED") == 1
        assert _get(ms, "ferrum_requests_total", rpc="Decode", code="OK") == decodes
        assert _get(ms, "ferrum_requests_total", rpc="Generate", code="OK") == 1
        assert _get(ms, "ferrum_requests_total", rpc="Session.Prefill", code="OK") == 1
        assert _get(ms, "ferrum_request_seconds_count", rpc="Prefill", code="OK") == 3
        assert _get(ms, "ferrum_request_seconds_bucket", rpc="Decode", code="OK", le="+Inf") == decodes
        assert _get(ms, "ferrum_request_seconds_bucket", rpc="Decode", code="OK", le="0.0002") <= decodes
        assert _get(ms, "ferrum_request_seconds_sum", rpc="Generate", code="OK") > 0
        # tokens, caches, KV use, queue, refusals, stream ends, leases
        assert _get(ms, "ferrum_generated_tokens_total") == 5
        mock_tokens = len(srv.models.get("mock").executor.registry.get(keep).tokens)
        assert _get(ms, "ferrum_active_caches", model="mock") == 1
        assert _get(ms, "ferrum_active_caches", model="stub") == 1
        assert _get(ms, "ferrum_kv_used_tokens", model="mock") == mock_tokens
        assert _get(ms, "ferrum_kv_used_blocks", model="mock") == -(-mock_tokens // 16)
        assert _get(ms, "ferrum_kv_used_bytes", model="mock") >= 0
        assert _get(ms, "ferrum_queue_depth", model="mock") == 0
        assert _get(ms, "ferrum_admission_refusals_total") == 1
        assert _get(ms, "ferrum_expired_caches_total", model="stub") == 1
        assert _get(ms, "ferrum_reclaimed_caches_total", model="stub") == 2  # the session's + the expired
        assert _get(ms, "ferrum_cancelled_streams_total") == 0
