"""Forward-progress health and RetryInfo from the measured service rate (``progress.py``), through
real gRPC on the tiny transformers Llama: a model whose queued work makes no progress for
``--stall-timeout`` turns NOT_SERVING (its own health service and the server's ""), and SERVING
again once a step completes; a RESOURCE_EXHAUSTED for a full queue carries a retry delay computed
from the queue length and the recent step rate, not a fixed hint."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2

from ferrum_client import Client, FerrumRpcError, pb

from ferrum_service.executors import ConfigurableModelExecutor
from ferrum_service.hosting.progress import Progress

from .conftest_models import tiny_llama_dir  # noqa: F401
from .support.servers import InProcessServer

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def _tiny(path):
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    return HfCausalLmExecutor.from_path(path, model_id="tiny", device="cpu", kv_budget_tokens=4096)


def _health(c: Client, service: str) -> int:
    return c.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status


def _wait_for(c: Client, service: str, status: int, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if _health(c, service) == status:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"health of {service!r} did not become {status} within {timeout}s")


def test_a_stalled_model_is_not_serving_until_a_step_completes(tiny_llama_dir, monkeypatch):  # noqa: F811
    mock = ConfigurableModelExecutor.with_token_sequence(1000, [7], model_id="mock")
    with InProcessServer([_tiny(tiny_llama_dir), mock], stall_timeout=0.4) as srv, Client(srv.target) as c:
        ex = srv.models.get("tiny").executor
        real = ex.execute
        release = threading.Event()

        def hung(plan):  # a step that does not finish until the test lets it
            release.wait(20)
            return real(plan)

        for svc in ("tiny", "mock", ""):
            assert _health(c, svc) == SERVING
        c.prefill("tiny", [5, 6])  # steps complete: still serving after the timeout
        time.sleep(0.6)
        assert _health(c, "tiny") == SERVING
        monkeypatch.setattr(ex, "execute", hung)
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(c.prefill, "tiny", [5, 6, 7])
            took = _wait_for(c, "tiny", NOT_SERVING, 5)
            assert took >= 0.3, f"NOT_SERVING after {took:.2f}s, before the stall timeout"
            assert _health(c, "") == NOT_SERVING  # the readiness probe's service
            assert _health(c, "mock") == SERVING  # the other model moves
            assert _health(c, "ferrum.executor.v1.ModelExecutor") == SERVING  # follows shutdown only
            assert c.prefill("mock", [1]).output.cache.num_tokens == 1
            release.set()
            out = fut.result(20)
        assert out.output.cache.num_tokens == 3
        _wait_for(c, "tiny", SERVING, 3)
        _wait_for(c, "", SERVING, 3)


def test_retry_info_follows_the_measured_service_rate(tiny_llama_dir, monkeypatch):  # noqa: F811
    with InProcessServer([_tiny(tiny_llama_dir)], max_queue=2) as srv, Client(srv.target) as c:
        ex = srv.models.get("tiny").executor
        real = ex.execute
        step_s = 0.25

        def slow(plan):  # each step takes ~step_s: about 4 steps per second
            time.sleep(step_s)
            return real(plan)

        monkeypatch.setattr(ex, "execute", slow)
        ids = [c.prefill("tiny", [5, 6]).output.cache.cache_id for _ in range(3)]  # the rate is measured
        with ThreadPoolExecutor(8) as pool:
            futs = [pool.submit(c.prefill, "tiny", [5, 6, k]) for k in range(8)]
            results = []
            for f in futs:
                try:
                    results.append(f.result(30))
                except FerrumRpcError as e:
                    results.append(e)
        refused = [r for r in results if isinstance(r, FerrumRpcError)]
        assert refused, "the queue limit refused nothing"
        for e in refused:
            assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED, e
            # (queued + 1) / rate: 3 steps ahead at ~4 per second: ~0.75 s (the old fixed hint: 0.05 s)
            assert 0.3 <= e.retry_after_s <= 3.0, e.retry_after_s
        for r in results:
            if not isinstance(r, FerrumRpcError):
                ids.append(r.output.cache.cache_id)
        for cid in ids:
            c.release_cache("tiny", cid)


def test_progress_rate_and_hint_bounds():
    p = Progress()
    assert p.retry_after_ms(0) == 100 and p.retry_after_ms(5) == 10_000  # nothing measured: idle vs stuck
    t = 1000.0
    for k in range(11):  # 10 steps per second
        p._done.append(t + k * 0.1)
    assert p.rate(now=t + 1.0) == pytest.approx(11.0, rel=0.05)
    assert 250 <= p.retry_after_ms(2, now=t + 1.0) <= 300  # 3 / 11 per second
    assert p.retry_after_ms(100_000, now=t + 1.0) == 10_000  # clamped
    assert p.rate(now=t + 60) == 0.0  # outside the window
    p.busy_since = t
    p.last_done = t + 1.0
    assert p.stalled_for(0, now=t + 9) == 0.0 and p.stalled_for(1, now=t + 9) == pytest.approx(8.0)
