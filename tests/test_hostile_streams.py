"""Server streams whose client stops reading (audit M5).

A client whose gRPC core answers keepalive pings but whose application reads nothing kept a server
stream open forever: a Generate kept its reserved KV, an ExportKv its hold on the cache (so the
cache could not be released, and every release of it polled at 200 Hz). With
``--stream-write-timeout`` the stream is ended once a message waits that long for its client, and
what it held is released. Real server on a loopback port (tiny random-weight Llama); the clients
are real gRPC channels with a small receive window that stop reading after the first message.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from ferrum_client import Client, pb
from ferrum_service.executors.transformers import HfCausalLmExecutor

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.servers import InProcessServer

WRITE_TIMEOUT_S = 1.0
# A receive window that the server fills quickly: no BDP growth, 64 KiB of lookahead.
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 65536)]


@pytest.fixture(scope="module")
def srv(tiny_llama_dir):  # noqa: F811
    ex = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=16384)
    with InProcessServer([ex], stream_write_timeout=WRITE_TIMEOUT_S) as s:
        yield s


def _stub(target: str):
    ch = grpc.insecure_channel(target, options=SMALL_WINDOW)
    return ch, Client(target).stub.__class__(ch)


def _live(srv) -> int:
    return srv.live_caches()["tiny"]


def _wait_until(cond, within: float) -> float:
    """Seconds until ``cond()`` held (AssertionError past ``within``)."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < within, f"not within {within} s"
        time.sleep(0.1)
    return time.monotonic() - t0


def test_generate_whose_client_stops_reading_is_ended_and_its_cache_freed(srv):
    ch, stub = _stub(srv.target)
    try:
        req = pb.GenerateRequest(model_id="tiny", token_ids=pb.TokenIds(token_ids=[5, 6, 7]), top_logprobs=64,
                                 stop=pb.StopConditions(max_tokens=1000, ignore_eos=True))
        call = stub.Generate(req)
        first = next(call)  # started: the stream runs, then nothing more is read
        assert first.WhichOneof("event") == "started"
        assert _live(srv) == 1
        took = _wait_until(lambda: _live(srv) == 0, within=WRITE_TIMEOUT_S + 20)
        print(f"non-reading Generate: cache freed {took:.1f} s after the client stopped reading")
        with pytest.raises(grpc.RpcError) as e:  # the stream ended early (not with its 1,000 tokens)
            for _ in call:
                pass
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "write timeout" in e.value.details()
    finally:
        ch.close()


def test_non_reading_exports_of_a_closed_sessions_caches_are_ended_and_the_caches_freed(srv):
    """The audit's probe, scaled down: a Session makes caches, an ExportKv of each is opened and
    not read, and the Session closes. Each export held its cache for as long as its client stayed
    connected (the Session's release waited on it, polling at 200 Hz); now the exports end within
    the write timeout, the caches go, the server's CPU stays near idle and Loads answers at once."""
    import psutil

    ch, stub = _stub(srv.target)
    exports = []
    try:
        requests = [pb.SessionRequest(prefill=pb.PrefillRequest(model_id="tiny", input=pb.PrefillInput(
            token_ids=[(7 * i + k) % 500 + 5 for i in range(1000)]))) for k in range(8)]
        gate = threading.Event()

        def session_requests():
            yield from requests
            gate.wait(30)

        session = stub.Session(session_requests())
        caches = [next(session).prefill.output.cache.cache_id for _ in requests]
        for cid in caches:  # 1,000 tokens of K/V each, in 4 KiB chunks: far past the receive window
            call = stub.ExportKv(pb.ExportKvRequest(model_id="tiny", cache_id=cid, max_chunk_bytes=4096))
            assert next(call).WhichOneof("message") == "header"
            exports.append(call)
        gate.set()  # the Session closes: its caches are released once nothing holds them
        with pytest.raises(StopIteration):
            next(session)
        took = _wait_until(lambda: _live(srv) == 0, within=WRITE_TIMEOUT_S + 20)
        print(f"non-reading exports of a closed Session: caches freed after {took:.1f} s")
        proc = psutil.Process()  # the server runs in this process: nothing of it is left running
        cpu0, t0 = proc.cpu_times(), time.monotonic()
        time.sleep(1.5)
        cpu1, t1 = proc.cpu_times(), time.monotonic()
        busy = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / (t1 - t0)
        with Client(srv.target) as other:
            q0 = time.perf_counter()
            other.loads()
            loads_s = time.perf_counter() - q0
        print(f"  test process (server included) CPU {max(busy, 0.0) * 100:.0f}% of a core once they were freed, "
              f"Loads {loads_s * 1000:.0f} ms")
        assert loads_s < 1.0 and busy < 0.3, (loads_s, busy)
        for call in exports:
            with pytest.raises(grpc.RpcError) as e:
                for _ in call:
                    pass
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        for call in exports:
            call.cancel()
        ch.close()
