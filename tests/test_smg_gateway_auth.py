"""What the SMG gateway authenticates, with the real ``smg`` (its own venv): the facts the Helm
chart's gateway mode is built on (deploy/README.md "What is authenticated").

- SMG presents gRPC workers no credential: a recording gRPC listener sees no ``authorization``
  (nor any key) in the metadata of SMG's calls, even with ``--api-key`` and tenant keys set. So the
  workers behind it run without tokens and the chart fences them with NetworkPolicies instead; if a
  later SMG starts sending one, this test fails and the chart can give the workers their tokens.
- The keys as the chart sets them (``--api-key K`` and ``--control-plane-api-keys
  chart:operator:admin:C``): K opens the OpenAI API only, C the control plane only, nothing opens
  either without a key. Without a control-plane key, K also opens the control plane (why the chart
  always sets both, from two different Secret keys)."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import grpc
import pytest

from ferrum_service.testing.smg_gateway import Gateway
from .support.servers import ServerProcess
from .test_smg_gateway import venv  # noqa: F401 - fixture (skips when the gateway venv cannot be built)

pytestmark = pytest.mark.slow

API_KEY, CONTROL_KEY, TENANT_KEY = "api-key-7f3a", "control-key-91c2", "tenant-key-5d0e"


class _Recorder(grpc.GenericRpcHandler):
    """Answers nothing (UNIMPLEMENTED); keeps each call's method and metadata."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str]]] = []
        self.lock = threading.Lock()

    def service(self, details):
        with self.lock:
            self.calls.append((details.method, dict(details.invocation_metadata)))
        return None


def test_smg_presents_grpc_workers_no_credential(venv):
    rec = _Recorder()
    srv = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4), handlers=[rec])
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    gw = Gateway(venv, [f"127.0.0.1:{port}"],
                 extra=["--api-key", API_KEY, "--tenant-api-key", f"alice:{TENANT_KEY}"]).launch()
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not any(m.endswith("VllmEngine/HealthCheck") for m, _ in rec.calls):
            assert gw.proc.poll() is None, gw.log_tail()
            time.sleep(0.2)
        with rec.lock:
            calls = list(rec.calls)
        assert any(m == "/vllm.grpc.engine.VllmEngine/HealthCheck" for m, _ in calls), (calls, gw.log_tail())
        for method, md in calls:
            assert "authorization" not in md, (method, md)
            assert not any(k in v for v in md.values() for k in (API_KEY, TENANT_KEY)), (method, md)
    finally:
        gw.stop()
        srv.stop(0)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from ferrum_service.testing.tiny_models import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("gw-auth-tiny"), seed=0)


def _worker(path, *extra: str) -> ServerProcess:
    w = ServerProcess("--model", f"hf-causal-lm,id=tiny,path={path},device=cpu", "--kv-budget-tokens", "2048",
                      *extra, ready_timeout=300)
    w.start()
    return w


@pytest.fixture(scope="module")
def worker(tiny_path):
    """A worker as the chart's gateway mode starts it (gateway.openWorkerAdminRpcs: SMG's
    /flush_cache reaches FlushCache, an admin RPC, without a token)."""
    w = _worker(tiny_path, "--open-admin-rpcs")
    yield w
    w.stop()


CHAT = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}


def _status(gw: Gateway, key: str) -> dict[str, int]:
    return {"chat": gw.post("/v1/chat/completions", CHAT, key=key)[0],
            "workers": gw.get("/workers", key=key)[0],
            "flush": gw.post("/flush_cache", {}, key=key)[0]}


def test_the_charts_keys_split_the_api_from_the_control_plane(venv, worker):
    gw = Gateway(venv, [worker.target], api_key=API_KEY,
                 extra=["--api-key", API_KEY, "--control-plane-api-keys", f"chart:operator:admin:{CONTROL_KEY}"])
    try:
        gw.start("tiny")
        assert _status(gw, "") == {"chat": 401, "workers": 401, "flush": 401}
        assert _status(gw, API_KEY) == {"chat": 200, "workers": 401, "flush": 401}
        assert _status(gw, CONTROL_KEY) == {"chat": 401, "workers": 200, "flush": 200}
        assert gw.get("/health", key="")[0] == 200  # the probes need no key
    finally:
        gw.stop()


def test_without_a_control_plane_key_the_api_key_manages_workers(venv, worker):
    gw = Gateway(venv, [worker.target], api_key=API_KEY, extra=["--api-key", API_KEY])
    try:
        gw.start("tiny")
        assert _status(gw, API_KEY) == {"chat": 200, "workers": 200, "flush": 200}
    finally:
        gw.stop()


def test_a_worker_with_closed_admin_rpcs_refuses_smgs_flush(venv, tiny_path):
    """FlushCache is an admin RPC (audit M1) and SMG sends no token: a worker without
    --open-admin-rpcs refuses it, which SMG reports as a partial success (206)."""
    closed = _worker(tiny_path)
    gw = Gateway(venv, [closed.target], api_key=API_KEY, extra=["--api-key", API_KEY])
    try:
        gw.start("tiny")
        assert _status(gw, API_KEY) == {"chat": 200, "workers": 200, "flush": 206}
    finally:
        gw.stop()
        closed.stop()
