"""Prometheus metrics of the server (served over HTTP on ``--metrics-port``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import (CollectorRegistry, Counter, Gauge, GCCollector, Histogram, PlatformCollector,
                               ProcessCollector)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..core.speculation import stats_of
from .metrics_http import serve_metrics
from .serving_metrics import ServingMetrics

if TYPE_CHECKING:
    from ..hosting.host import ModelHost
    from ..hosting.models import ModelSet
    from .streams import StreamRegistry

_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)


class Metrics:
    """Request counters/latencies by RPC and status code, tokens, caches, KV use, refusals."""

    def __init__(self, models: "ModelSet | None") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._children: dict[tuple[str, str], tuple] = {}
        self.requests = Counter("ferrum_requests_total", "RPCs and Session steps by status code",
                                ["rpc", "code"], registry=r)
        self.latency = Histogram("ferrum_request_seconds", "RPC / step latency by status code", ["rpc", "code"],
                                 buckets=_BUCKETS, registry=r)
        self.kv_transfer_bytes = Counter("ferrum_kv_transfer_bytes_total",
                                         "K/V bytes sent by ExportKv / kept by ImportKv", ["model", "direction"],
                                         registry=r)
        self.tokens_generated = Counter("ferrum_generated_tokens_total", "Tokens streamed by Generate", registry=r)
        self.admission_refusals = Counter("ferrum_admission_refusals_total", "RESOURCE_EXHAUSTED answers",
                                          registry=r)
        self.cancelled_streams = Counter("ferrum_cancelled_streams_total", "Generate/Session streams cancelled",
                                         registry=r)
        self.expired_caches = Counter("ferrum_expired_caches_total",
                                      "Ownerless caches reclaimed because their lease (--cache-ttl) expired",
                                      ["model"], registry=r)
        self.idle_origin_caches = Counter("ferrum_idle_origin_caches_total",
                                          "Ownerless caches reclaimed early because the origin that made them "
                                          "(caller@host) made no call for --origin-idle-ttl", ["model"], registry=r)
        # the process_*, python_gc_* and python_info series a default registry has
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.serving = ServingMetrics(r, models)  # TTFT, inter-token, e2e, queue, token counters
        if models is not None:
            self._model_gauges(models)
            r.register(_ReclaimedCollector(models))
            r.register(_PrefixCollector(models))
            r.register(_SpeculationCollector(models))
            r.register(_LoraCollector(models))

    def _model_gauges(self, models: "ModelSet") -> None:
        r = self.registry
        active = Gauge("ferrum_active_caches", "Live KV caches", ["model"], registry=r)
        used = Gauge("ferrum_kv_used_tokens", "KV tokens held", ["model"], registry=r)
        used_b = Gauge("ferrum_kv_used_bytes", "KV bytes held", ["model"], registry=r)
        blocks = Gauge("ferrum_kv_used_blocks", "KV blocks held", ["model"], registry=r)
        queue = Gauge("ferrum_queue_depth", "Steps running or waiting on the model's worker", ["model"], registry=r)
        cached = Gauge("ferrum_prefix_cached_blocks", "KV blocks keyed in the prefix cache", ["model"], registry=r)
        evictable = Gauge("ferrum_prefix_evictable_blocks", "Cached KV blocks no cache holds (free on demand)",
                          ["model"], registry=r)
        for host in models:
            reg = host.executor.registry
            mid = host.model_id
            prefix = host.executor.prefix
            active.labels(mid).set_function(lambda reg=reg: len(reg))
            used.labels(mid).set_function(lambda reg=reg: reg.used_tokens)
            if prefix is not None:
                cached.labels(mid).set_function(lambda p=prefix: p.cached_blocks)
                # paged pool: evictable blocks; llama.cpp: retired sequences holding cached blocks
                evictable.labels(mid).set_function(lambda p=prefix: len(p.evictable))
            if hasattr(prefix, "pool"):  # a paged pool: blocks and bytes as the pool holds them (shared ones once)
                used_b.labels(mid).set_function(lambda p=prefix: p.used_blocks * p.pool.block_bytes)
                blocks.labels(mid).set_function(lambda p=prefix: p.used_blocks)
            else:
                used_b.labels(mid).set_function(lambda reg=reg: reg.used_tokens * reg.bytes_per_token)
                blocks.labels(mid).set_function(
                    lambda reg=reg: sum(-(-e.num_tokens // reg.block_size) for e in reg.entries()))
            queue.labels(mid).set_function(lambda host=host: host.running)
        llama = [h for h in models if h.executor.live_sequences() is not None]
        if llama:  # the llama.cpp executor's own books, for leak checks beside the registry's
            seqs = Gauge("ferrum_llama_cpp_sequence_ids_in_use", "llama.cpp sequence ids held by live caches",
                         ["model"], registry=r)
            cells = Gauge("ferrum_llama_cpp_kv_cells", "KV cells llama.cpp holds (read from llama.cpp on the "
                          "model's worker, between steps)", ["model"], registry=r)
            for host in llama:
                seqs.labels(host.model_id).set_function(lambda ex=host.executor: ex.live_sequences())
                cells.labels(host.model_id).set_function(lambda host=host: _on_worker(host, host.executor.kv_cells_used))

    def model_server_protocol(self, models: "ModelSet", streams: "StreamRegistry") -> None:
        """Also export the metrics llm-d's endpoint picker scrapes from a model server, under
        vLLM's names (see :class:`_ModelServerCollector`)."""
        self.registry.register(_ModelServerCollector(models, streams))

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample's current value (0 when absent): for tests and the Status RPC."""
        v = self.registry.get_sample_value(name, labels or {})
        return 0.0 if v is None else v

    def observe(self, rpc: str, code: str, seconds: float) -> None:
        children = self._children.get((rpc, code))
        if children is None:  # labels() costs a lock and a dict build per call: resolve once per pair
            children = self._children[(rpc, code)] = (self.requests.labels(rpc, code), self.latency.labels(rpc, code))
        children[0].inc()
        children[1].observe(seconds)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        self._http = serve_metrics(self.registry, port, host)

    def stop(self) -> None:
        """Close the /metrics HTTP server (if serving)."""
        http = getattr(self, "_http", None)
        if http is not None:
            server, thread = http
            server.shutdown()
            server.server_close()
            thread.join(5)
            self._http = None


def _on_worker(host, fn) -> float:
    try:
        return float(host.on_worker(fn))
    except Exception:  # noqa: BLE001 - worker shut down or busy past the timeout: no value, not a failed scrape
        return float("nan")


class _ReclaimedCollector:
    """``ferrum_reclaimed_caches_total{model}``: caches freed without a release from their user —
    their stream ended (cancel, deadline, dropped connection, Session close) or their lease
    expired — read from each registry's counter."""

    def __init__(self, models: "ModelSet") -> None:
        self.models = models

    def describe(self):
        return [CounterMetricFamily("ferrum_reclaimed_caches", "Caches freed because their owner left or their "
                                    "lease expired", labels=["model"])]

    def collect(self):
        c = CounterMetricFamily("ferrum_reclaimed_caches", "Caches freed because their owner left or their lease "
                                "expired", labels=["model"])
        for host in self.models:
            c.add_metric([host.model_id], host.executor.registry.reclaimed_total)
        yield c


class _PrefixCollector:
    """``ferrum_prefix_queried_tokens_total`` / ``ferrum_prefix_hit_tokens_total{model}``: prompt
    tokens of new sequences that looked the prefix cache up, and those it served (hit rate = hit /
    queried); ``ferrum_prefix_evicted_blocks_total``."""

    _NAMES = (("ferrum_prefix_queried_tokens", "Prompt tokens looked up in the prefix cache", "queried_tokens"),
              ("ferrum_prefix_hit_tokens", "Prompt tokens served from the prefix cache", "hit_tokens"),
              ("ferrum_prefix_evicted_blocks", "Cached KV blocks evicted to make room", "evicted_blocks"))

    def __init__(self, models: "ModelSet") -> None:
        self.models = [h for h in models if h.executor.prefix is not None]

    def describe(self):
        return [CounterMetricFamily(n, h, labels=["model"]) for n, h, _ in self._NAMES]

    def collect(self):
        for name, help_, attr in self._NAMES:
            c = CounterMetricFamily(name, help_, labels=["model"])
            for host in self.models:
                c.add_metric([host.model_id], getattr(host.executor.prefix.stats, attr))
            yield c


class _SpeculationCollector:
    """Server-side speculation in ``Generate`` (speculation.py), per model:
    ``ferrum_speculation_draft_tokens_total`` (drafts verified),
    ``ferrum_speculation_accepted_tokens_total`` (drafts accepted; acceptance rate = accepted /
    draft) and ``ferrum_speculation_verify_rows_total`` (speculative rows run)."""

    _NAMES = (("ferrum_speculation_draft_tokens", "Draft tokens Generate's n-gram speculation verified",
               "draft_tokens"),
              ("ferrum_speculation_accepted_tokens", "Draft tokens accepted (equal to the token drawn there)",
               "accepted_tokens"),
              ("ferrum_speculation_verify_rows", "Speculative rows (a token plus its drafts) run", "verify_rows"))

    def __init__(self, models: "ModelSet") -> None:
        self.models = list(models)

    def describe(self):
        return [CounterMetricFamily(n, h, labels=["model"]) for n, h, _ in self._NAMES]

    def collect(self):
        for name, help_, attr in self._NAMES:
            c = CounterMetricFamily(name, help_, labels=["model"])
            for host in self.models:
                c.add_metric([host.model_id], getattr(stats_of(host), attr))
            yield c


class _LoraCollector:
    """LoRA adapters per model: ``ferrum_lora_adapters`` (registered), ``ferrum_lora_resident_adapters``
    (weights in device memory), ``ferrum_lora_loads_total`` (weights read from disk),
    ``ferrum_lora_evictions_total`` (dropped from device memory for another), and
    ``ferrum_lora_adapter_steps_total{model,adapter}``."""

    def __init__(self, models: "ModelSet") -> None:
        self.models = [h for h in models if h.executor.adapters is not None]

    def describe(self):
        return list(self.collect()) if self.models else []

    def collect(self):
        if not self.models:
            return
        reg = GaugeMetricFamily("ferrum_lora_adapters", "LoRA adapters registered", labels=["model"])
        res = GaugeMetricFamily("ferrum_lora_resident_adapters", "LoRA adapters in device memory", labels=["model"])
        loads = CounterMetricFamily("ferrum_lora_loads", "LoRA adapter weights read from disk", labels=["model"])
        ev = CounterMetricFamily("ferrum_lora_evictions", "LoRA adapters dropped from device memory for another",
                                 labels=["model"])
        steps = CounterMetricFamily("ferrum_lora_adapter_steps", "Steps that ran rows with the adapter",
                                    labels=["model", "adapter"])
        for host in self.models:
            a = host.executor.adapters
            adapters = list(a.adapters.values())
            reg.add_metric([host.model_id], len(adapters))
            res.add_metric([host.model_id], sum(1 for x in adapters if x.resident))
            loads.add_metric([host.model_id], a.loads)
            ev.add_metric([host.model_id], a.evictions)
            for x in adapters:
                steps.add_metric([host.model_id, x.name], x.steps)
        yield from (reg, res, loads, ev, steps)



def requests_of(host: "ModelHost", streams: "StreamRegistry") -> tuple[int, int]:
    """(running, waiting) ``Generate`` streams of a model (the contract's and the vLLM protocol's):
    waiting = those whose prompt is queued for the model's worker, running = the others."""
    gens = sum(1 for st in list(streams.generations.values()) if st.model_id == host.model_id)
    waiting = min(gens, host.batcher.queued_prompts)
    return gens - waiting, waiting


def kv_usage(host: "ModelHost") -> float:
    """KV-cache utilisation in [0, 1]: blocks held by live caches over the pool (a paged pool;
    cached blocks no cache holds count as free, as vLLM counts them), else tokens held over the
    KV budget."""
    cap = host.executor.kv_capacity()
    if cap.total_blocks:
        return max(0.0, min(1.0, 1.0 - (cap.free_blocks + cap.evictable_blocks) / cap.total_blocks))
    return max(0.0, min(1.0, cap.used_tokens / cap.total_tokens)) if cap.total_tokens else 0.0


def cache_layout(host: "ModelHost") -> tuple[int, int]:
    """(block size, KV blocks) of a model: the paged pool's blocks, else its KV budget in blocks of
    its prefix-cache block; (0, 0) when it has no blocks."""
    cap = host.executor.kv_capacity()
    block = int((host.info.prefix_cache or {}).get("block_size") or cap.block_size or 0)
    if not block:
        return 0, 0
    return block, cap.total_blocks or (cap.total_tokens // block)


class _ModelServerCollector:
    """The model-server metrics llm-d's endpoint picker (the Gateway API Inference Extension's
    model server protocol) reads, under the vLLM names it knows, labelled ``model_name``:
    ``vllm:num_requests_waiting`` (queued requests), ``vllm:num_requests_running`` (running
    requests), ``vllm:kv_cache_usage_perc`` and its older name ``vllm:gpu_cache_usage_perc``
    (KV-cache utilisation, 0..1), and for a model with LoRA adapters ``vllm:lora_requests_info``
    (value: the scrape time; labels ``max_lora`` = adapters resident at once,
    ``running_lora_adapters`` = adapters bound to live caches, ``waiting_lora_adapters`` = adapters
    of requests waiting for the worker, always empty: a queued prompt's adapter is not tracked), and
    ``vllm:cache_config_info{block_size, num_gpu_blocks}`` (value 1; :func:`cache_layout`)."""

    def __init__(self, models: "ModelSet", streams: "StreamRegistry") -> None:
        self.models = models
        self.streams = streams

    def describe(self):
        return []  # collected at scrape time only

    def collect(self):
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting for the model (llm-d: "
                                    "TotalQueuedRequests)", labels=["model_name"])
        running = GaugeMetricFamily("vllm:num_requests_running", "Requests running on the model (llm-d: "
                                    "TotalRunningRequests)", labels=["model_name"])
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache utilisation, 1 = full (llm-d: "
                                  "KVCacheUtilization)", labels=["model_name"])
        usage_old = GaugeMetricFamily("vllm:gpu_cache_usage_perc", "KV-cache utilisation, 1 = full (the older "
                                      "vLLM name)", labels=["model_name"])
        lora = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters: resident limit and adapters in use",
                                 labels=["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        cache = GaugeMetricFamily("vllm:cache_config_info", "KV cache layout (llm-d: BlockSize, NumGPUBlocks); "
                                  "value 1", labels=["model_name", "block_size", "num_gpu_blocks"])
        now = time.time()
        for host in self.models:
            run, wait = requests_of(host, self.streams)
            u = kv_usage(host)
            waiting.add_metric([host.model_id], wait)
            running.add_metric([host.model_id], run)
            usage.add_metric([host.model_id], u)
            usage_old.add_metric([host.model_id], u)
            block, blocks = cache_layout(host)
            if block:
                cache.add_metric([host.model_id, str(block), str(blocks)], 1)
            adapters = host.executor.adapters
            if adapters is not None:
                bound = sorted(a for a, n in host.executor.adapter_bindings().items() if a and n)
                lora.add_metric([host.model_id, str(adapters.max_resident), ",".join(bound), ""], now)
        yield from (waiting, running, usage, usage_old)
        if cache.samples:
            yield cache
        if lora.samples:
            yield lora
