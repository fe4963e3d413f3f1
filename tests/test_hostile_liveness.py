"""One long legal step does not fail the liveness probe (audit L12).

A model whose queued work makes no progress for ``--stall-timeout`` turns the server's ``""``
health NOT_SERVING, which the chart's liveness probe also checked: one step longer than the
timeout (a big model on CPU) got the pod restarted and every tenant's streams lost. ``""`` stays
the readiness signal; liveness asks the ``liveness`` service, SERVING while the server runs. Real
server on a loopback port (tiny Llama, one of its steps held back by the test).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from grpc_health.v1 import health_pb2

from ferrum_client import Client
from ferrum_service.executors.transformers import HfCausalLmExecutor

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.servers import InProcessServer

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def _health(c: Client, service: str) -> int:
    return c.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status


def test_a_long_step_turns_readiness_not_liveness_not_serving(tiny_llama_dir, monkeypatch):  # noqa: F811
    ex = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=4096)
    with InProcessServer([ex], stall_timeout=0.4) as srv, Client(srv.target) as c:
        real = ex.execute
        release = threading.Event()

        def long_step(plan):  # a legal step that takes longer than the stall timeout
            release.wait(20)
            return real(plan)

        assert _health(c, "liveness") == SERVING
        monkeypatch.setattr(ex, "execute", long_step)
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(c.prefill, "tiny", [5, 6, 7])
            deadline = time.monotonic() + 5
            while _health(c, "") != NOT_SERVING:  # readiness: out of rotation while it lasts
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert _health(c, "liveness") == SERVING  # liveness: not restarted for it
            release.set()
            assert fut.result(20).output.cache.num_tokens == 3
