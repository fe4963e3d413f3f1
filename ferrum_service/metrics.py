"""Prometheus metrics of the server (served over HTTP on ``--metrics-port``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

if TYPE_CHECKING:
    from .models import ModelSet

_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)


class Metrics:
    """Request counters/latencies by RPC and status code, tokens, caches, KV use, refusals."""

    def __init__(self, models: "ModelSet | None") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ferrum_requests_total", "RPCs and Session steps by status code",
                                ["rpc", "code"], registry=r)
        self.latency = Histogram("ferrum_request_seconds", "RPC / step latency", ["rpc"], buckets=_BUCKETS,
                                 registry=r)
        self.tokens_generated = Counter("ferrum_generated_tokens_total", "Tokens streamed by Generate", registry=r)
        self.admission_refusals = Counter("ferrum_admission_refusals_total", "RESOURCE_EXHAUSTED answers",
                                          registry=r)
        self.cancelled_streams = Counter("ferrum_cancelled_streams_total", "Generate/Session streams cancelled",
                                         registry=r)
        self.reclaimed_caches = Counter("ferrum_reclaimed_caches_total", "Caches freed because their owner left",
                                        registry=r)
        if models is not None:
            self._model_gauges(models)

    def _model_gauges(self, models: "ModelSet") -> None:
        r = self.registry
        active = Gauge("ferrum_active_caches", "Live KV caches", ["model"], registry=r)
        used = Gauge("ferrum_kv_used_tokens", "KV tokens held", ["model"], registry=r)
        used_b = Gauge("ferrum_kv_used_bytes", "KV bytes held", ["model"], registry=r)
        blocks = Gauge("ferrum_kv_used_blocks", "KV blocks held", ["model"], registry=r)
        queue = Gauge("ferrum_queue_depth", "Steps running or waiting on the model's worker", ["model"], registry=r)
        for host in models:
            reg = host.executor.registry
            mid = host.model_id
            active.labels(mid).set_function(lambda reg=reg: len(reg))
            used.labels(mid).set_function(lambda reg=reg: reg.used_tokens)
            used_b.labels(mid).set_function(lambda reg=reg: reg.used_tokens * reg.bytes_per_token)
            blocks.labels(mid).set_function(
                lambda reg=reg: sum(-(-e.num_tokens // reg.block_size) for e in reg.entries()))
            queue.labels(mid).set_function(lambda host=host: host.running)

    def observe(self, rpc: str, code: str, seconds: float) -> None:
        self.requests.labels(rpc, code).inc()
        self.latency.labels(rpc).observe(seconds)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, addr=host, registry=self.registry)
