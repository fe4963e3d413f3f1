"""Serving-latency metrics (``wire/serving_metrics.py``) and the serving log lines
(``wire/serving_log.py``) of a real ``ferrum-service serve`` process: TTFT, inter-token, end-to-end
and queue histograms and the token counters per model, from both ``Generate`` protocols; the
``process_*`` / ``python_*`` series; the ``serving stats`` and ``request done`` lines, and both
turned off by their settings."""

from __future__ import annotations

import json
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from .support.servers import ServerProcess, free_port
from .support.traffic import serving_traffic
from .support.waits import wait_until

MOCK = "configurable,id=mock,vocab_size=1000,token_sequence=10:20:30"


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _log_events(srv, event: str) -> list[dict]:
    out = []
    for line in srv.log(tail=10 ** 7).splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == event:
            out.append(rec)
    return out


def test_serving_metrics_and_log_lines_from_a_live_server():
    port = free_port()
    with ServerProcess("--model", MOCK, "--metrics-port", str(port), "--stats-log-interval", "0.3") as srv:
        sent = serving_traffic(srv.target, "mock")
        # the cancelled stream ends on the server a moment after the client cancels it
        assert wait_until(lambda: _value(_scrape(port), "ferrum_requests_finished_total", model="mock",
                                         finish_reason="cancelled") == 1, timeout=10)
        ms = _scrape(port)
        assert wait_until(lambda: len(_log_events(srv, "serving stats")) >= 1, timeout=10)
        completions = _log_events(srv, "request done")
        stats = _log_events(srv, "serving stats")

    finished = sent.finishes["length"]
    # every stream that sent a token (the cancelled one too) has one TTFT sample
    assert _value(ms, "ferrum_time_to_first_token_seconds_count", model="mock") == sent.streams + 1
    gen = _value(ms, "ferrum_generation_tokens_total", model="mock")
    assert gen >= sent.generated_tokens + 1  # + what the cancelled stream sent before it went
    # one inter-token gap per token after a stream's first
    assert _value(ms, "ferrum_inter_token_seconds_count", model="mock") == gen - (sent.streams + 1)
    assert _value(ms, "ferrum_inter_token_seconds_sum", model="mock") > 0
    # prompts: the finished ones plus the cancelled one's 2 tokens (the refused one never started)
    assert _value(ms, "ferrum_prompt_tokens_total", model="mock") == sent.prompt_tokens + 2
    assert _value(ms, "ferrum_queue_seconds_count", model="mock") == sent.streams + 1
    assert _value(ms, "ferrum_e2e_request_seconds_count", model="mock", finish_reason="length") == finished
    assert _value(ms, "ferrum_requests_finished_total", model="mock", finish_reason="length") == finished
    assert _value(ms, "ferrum_requests_finished_total", model="mock", finish_reason="error") == 1
    assert _value(ms, "ferrum_stalled_seconds", model="mock") == 0
    # the process and runtime series a default registry has
    assert _value(ms, "process_cpu_seconds_total") > 0
    assert _value(ms, "process_resident_memory_bytes") > 0
    assert any(name == "python_gc_collections_total" for name, _ in ms)
    assert any(name == "python_info" for name, _ in ms)

    by_id = {c["request_id"]: c for c in completions}
    for rid in sent.request_ids:
        c = by_id[rid]
        assert c["model_id"] == "mock" and c["finish"] == "length" and c["generated_tokens"] > 0
        assert c["ttft_ms"] is not None and c["duration_ms"] >= c["ttft_ms"]
        assert "caller" in c and c["prompt_tokens"] > 0
    assert by_id["cancelled"]["finish"] == "cancelled"
    assert by_id["refused"]["finish"] == "error" and by_id["refused"]["ttft_ms"] is None
    busy = [s for s in stats if s["generation_tokens_per_s"] > 0 or s["running"]]
    assert busy, stats
    assert {"prompt_tokens_per_s", "running", "waiting", "kv_cache_usage_pct"} <= set(busy[0])


def test_serving_log_lines_can_be_turned_off():
    with ServerProcess("--model", MOCK, "--stats-log-interval", "0", "--no-request-log") as srv:
        serving_traffic(srv.target, "mock", rounds=1)
        time.sleep(0.5)
        assert not _log_events(srv, "request done")
        assert not _log_events(srv, "serving stats")
    with ServerProcess("--model", MOCK, env={"FERRUM_NO_REQUEST_LOG": "1", "FERRUM_STATS_LOG_INTERVAL": "0"}) as srv:
        serving_traffic(srv.target, "mock", rounds=1)
        time.sleep(0.5)
        assert not _log_events(srv, "request done") and not _log_events(srv, "serving stats")


#: The Accept header Prometheus 2.x/3.x scrapes with (OpenMetrics first).
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def test_a_prometheus_scrape_gets_the_colon_names_as_they_are():
    """Asked for OpenMetrics, prometheus_client rewrote ``vllm:x`` samples to ``vllm_x`` (under a
    ``# TYPE vllm:x`` line): Prometheus never stored llm-d's model-server names. The endpoint
    answers in the text format, names unchanged."""
    port = free_port()
    with ServerProcess("--model", MOCK, "--metrics-port", str(port)):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": PROMETHEUS_ACCEPT})
        with urllib.request.urlopen(req, timeout=5) as r:
            text = r.read().decode()
    samples = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert name in samples, f"{name} not among the samples: {sorted(s for s in samples if 'vllm' in s)}"
    assert "ferrum_time_to_first_token_seconds_bucket" in samples
