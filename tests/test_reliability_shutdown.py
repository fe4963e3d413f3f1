"""Graceful shutdown when the grace period runs out: streams still open then end with a status
(not a hang, not a reset without one), their caches are freed, and the process still exits 0.

(The case where in-flight streams finish inside the grace period is in test_server_process.py.)
"""

from __future__ import annotations

import json
import signal
import threading
import time

import grpc

from ferrum_client import Client, FerrumRpcError, messages as m, pb

from .support.servers import ServerProcess
from .support.waits import wait_until

MOCK = "configurable,id=mock,vocab_size=1000,token_sequence=10:20:30"


def test_grace_period_expiry_ends_open_streams_with_a_status_and_exits_zero():
    grace = 1.0
    srv = ServerProcess("--model", MOCK, "--grace-period", str(grace)).start()
    try:
        with Client(srv.target) as c:
            # a Session that holds a cache and stays open (the scheduler is slow to finish)
            s = c.session()
            cid = s.step(pb.PrefillRequest(model_id="mock", input=m.prefill_input([1, 2, 3]))).output.cache.cache_id
            # a KV-event subscription: a stream that never ends by itself
            sub = c.stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(model_id="mock"))
            ended: dict[str, object] = {}

            def drain_sub():
                try:
                    for _ in sub:
                        pass
                    ended["sub"] = "OK"
                except grpc.RpcError as e:
                    ended["sub"] = e.code()

            t = threading.Thread(target=drain_sub, daemon=True)
            t.start()
            # no sleep to 'let the subscription open': open or not yet, the documented end is the
            # same (UNAVAILABLE, checked below)
            assert c.health() == "SERVING"
            t_sig = time.monotonic()
            srv.terminate(signal.SIGTERM)
            assert wait_until(lambda: c.health() == "NOT_SERVING", interval=0.01)  # health turns at once
            # a step on the open session during the drain is refused in-band, the stream stays up
            try:
                s.step(pb.DecodeRequest(model_id="mock", input=m.decode_input(cid, 1)))
                raise AssertionError("a step was accepted while draining")
            except FerrumRpcError as e:
                assert e.code == grpc.StatusCode.UNAVAILABLE and e.retry_after_s
            # ... until the grace period is over: then it ends with a status
            try:
                s.receive()
                raise AssertionError("the session outlived the grace period without a status")
            except FerrumRpcError as e:
                ended["session"] = e.code
            waited = time.monotonic() - t_sig
            t.join(10)
        rc = srv.wait(20)
    finally:
        srv.stop()
    print("stream endings after the grace period:", ended, f"waited {waited:.2f}s")
    assert rc == 0
    assert grace - 0.2 <= waited < grace + 5, waited
    # docs/operating.md, graceful shutdown step 4: streams still open are ended with UNAVAILABLE
    assert ended["session"] == grpc.StatusCode.UNAVAILABLE, ended
    assert ended["sub"] == grpc.StatusCode.UNAVAILABLE, ended
    recs = [json.loads(ln) for ln in srv.log().splitlines() if ln.startswith("{")]
    events = [r["event"] for r in recs]
    assert "grace period over; cancelling streams" in events
    closed = [r for r in recs if r["event"] == "session closed"]
    assert closed and closed[-1]["released_caches"] == 1  # the session's cache was freed
    assert events[-1] == "stopped"
