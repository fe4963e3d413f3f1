"""Cancellation and leases: a caller that cancels, runs out of deadline or vanishes (its channel
closed, its process killed) during ``Generate`` or ``Session`` stops the work within one step and
its caches are freed; ownerless caches idle past ``--cache-ttl`` are reclaimed; metrics count both.

The model here is a configurable executor made slow (``inline = False`` and 20 ms per decode, on
its worker thread like a real model), so "within one step" is measurable: after the stream ends at
most the one step already on the worker completes. Every test that uses the ``srv`` fixture runs
again on the llama.cpp executor (SmolLM2 Q4_1, the same 20 ms added to each step) and then also
checks the executor's own books: no sequence id in use and no KV cell held by llama.cpp.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import grpc
import pytest

from ferrum_client import Client, FerrumRpcError, messages as m, pb

from ferrum_service.executors import ConfigurableModelExecutor

from .support import llama
from .support.servers import REPO, InProcessServer, ServerProcess
from .support.waits import wait_until

STEP_S = 0.02


class SlowModel(ConfigurableModelExecutor):
    """Decodes take ``STEP_S`` on the model's worker thread; counts every decode it runs."""

    inline = False

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.decodes = 0

    def decode(self, inp):
        time.sleep(STEP_S)
        self.decodes += 1
        return super().decode(inp)

    def batch_decode(self, inputs):
        time.sleep(STEP_S)
        self.decodes += len(inputs)
        return [super(SlowModel, self).decode(i) for i in inputs]


def _slow():
    return SlowModel(1000, [10, 20, 30], model_id="slow")


def _slow_llama():
    """The llama.cpp executor with ``STEP_S`` added to every step; counts the rows it runs."""
    from ferrum_service.executors.llama_cpp import LlamaCppExecutor

    class SlowLlama(LlamaCppExecutor):
        def _step(self, items, field, **kw):
            time.sleep(STEP_S)
            self.decodes += len(items)
            return super()._step(items, field, **kw)

    ex = SlowLlama(llama.gguf(), model_id="slow", threads=2, n_ctx=8192, n_seq=16)
    ex.decodes = 0
    ex.warmup()  # llama.cpp's first decode builds its graphs: not part of "one step"
    ex.decodes = 0
    return ex


@pytest.fixture(params=["configurable", "llama-cpp"])
def srv(request):
    ex = _slow() if request.param == "configurable" else _slow_llama()
    with InProcessServer([ex], cache_ttl=0) as s:
        yield s
        if llama.is_llama(ex):  # the executor's own books back to their initial values
            wait_until(lambda: s.live_caches()["slow"] == 0)
            llama.assert_books(s.models.get("slow"), idle=True)


def _ex(srv) -> SlowModel:
    return srv.models.get("slow").executor


def _assert_stopped_and_freed(srv, ex: SlowModel) -> None:
    """No more than one step runs after the stream ended, and its caches are gone (on llama.cpp:
    its sequence ids and KV cells too)."""
    assert wait_until(lambda: srv.live_caches()["slow"] == 0), "the stream's cache was not freed"
    settled = ex.decodes
    time.sleep(10 * STEP_S)
    assert ex.decodes == settled, "decodes went on after the stream ended"
    assert srv.server.streams.active == set()
    if llama.is_llama(ex):
        llama.assert_books(srv.models.get("slow"), idle=True)


def _metric(srv, name: str, **labels) -> float:
    return srv.server.metrics.value(name, labels)


# ---- Generate ------------------------------------------------------------------------------------
def test_generate_deadline_stops_within_one_step_and_frees_the_cache(srv):
    ex = _ex(srv)
    with Client(srv.target) as c:
        t0 = time.monotonic()
        n = 0
        with pytest.raises(FerrumRpcError) as e:
            for ev in c.generate("slow", token_ids=[1, 2, 3], max_tokens=4000, timeout=0.4):
                n += ev.WhichOneof("event") == "token"
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        at_error = ex.decodes
        assert time.monotonic() - t0 < 2.0 and 5 < n < 4000
    assert wait_until(lambda: srv.server.streams.active == set()), "the stream never ended on the server"
    assert ex.decodes - at_error <= 1, "more than the in-flight step ran after the deadline"
    _assert_stopped_and_freed(srv, ex)
    assert _metric(srv, "ferrum_cancelled_streams_total") >= 1


def test_generate_closed_channel_stops_and_frees_the_cache(srv):
    ex = _ex(srv)
    c = Client(srv.target)
    it = iter(c.generate("slow", token_ids=[1, 2, 3], max_tokens=4000))
    assert next(it).WhichOneof("event") == "started"
    next(it)
    assert srv.live_caches()["slow"] == 1
    c.close()  # the connection goes away without a cancel from the application
    _assert_stopped_and_freed(srv, ex)
    assert ex.decodes < 200


_CLIENT = textwrap.dedent("""
    import sys, time
    from ferrum_client import Client, messages as m, pb
    target, mode = sys.argv[1], sys.argv[2]
    c = Client(target)
    if mode == "generate":
        it = iter(c.generate("slow", token_ids=[1, 2, 3], max_tokens=4000))
        next(it); next(it)
    else:
        s = c.session()
        cid = s.step(pb.PrefillRequest(model_id="slow", input=m.prefill_input([1, 2, 3]))).output.cache.cache_id
        for _ in range(500):  # pipelined: ~10 s of queued work on the server
            s.send(pb.DecodeRequest(model_id="slow", input=m.decode_input(cid, 5)))
        s.receive()
    print("READY", flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("mode", ["generate", "session"])
def test_killed_client_process_stops_the_stream_and_frees_its_cache(srv, mode):
    ex = _ex(srv)
    p = subprocess.Popen([sys.executable, "-c", _CLIENT, srv.target, mode], stdout=subprocess.PIPE, text=True,
                         cwd=REPO)
    try:
        line = p.stdout.readline()
        assert line.strip() == "READY", line
        assert srv.live_caches()["slow"] == 1
        assert ex.decodes >= 1
        p.kill()  # SIGKILL: no goodbye, the kernel resets the TCP connection
        p.wait(10)
        killed_at = ex.decodes
        _assert_stopped_and_freed(srv, ex)
        assert ex.decodes - killed_at <= 3, "work went on well after the client vanished"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(5)
    assert _metric(srv, "ferrum_reclaimed_caches_total", model="slow") >= 1


_FREED = {pb.KV_EVENT_KIND_RELEASED: "released", pb.KV_EVENT_KIND_RECLAIMED: "reclaimed",
          pb.KV_EVENT_KIND_EVICTED: "evicted"}


def _freed_reasons(client: Client, cache_ids: set[str]) -> dict[str, str]:
    """How each cache was freed, read from the KV event stream (replayed from the start)."""
    got: dict[str, str] = {}
    stream = client.subscribe_kv_events("slow", from_seq=1, timeout=10)
    for msg in stream:
        assert msg.WhichOneof("message") == "event", msg
        ev = msg.event
        if ev.cache_id in cache_ids and ev.kind in _FREED:
            got[ev.cache_id] = _FREED[ev.kind]
            if set(got) == cache_ids:
                break
    stream.cancel()
    return got


def test_generate_frees_its_cache_released_when_finished_and_reclaimed_when_it_ends_abnormally(srv):
    """A Generate stream that yields GenerateFinished frees its cache with reason ``released``; one
    cancelled by its client, run out of deadline or stopped by Abort frees it with ``reclaimed``
    (as a Session's caches on close) — in the KV events and the registry's counters."""
    reg = _ex(srv).registry
    released0, reclaimed0 = reg.released_total, reg.reclaimed_total
    cids: dict[str, str] = {}
    with Client(srv.target) as c:
        evs = list(c.generate("slow", token_ids=[1, 2, 3], max_tokens=3))
        assert evs[-1].WhichOneof("event") == "finished"
        cids["finished"] = evs[0].started.cache.cache_id

        s = c.generate("slow", token_ids=[1, 2, 3], max_tokens=4000)
        it = iter(s)
        cids["cancelled"] = next(it).started.cache.cache_id
        next(it)
        s.cancel()

        with pytest.raises(FerrumRpcError) as e:
            for ev in c.generate("slow", token_ids=[1, 2, 3], max_tokens=4000, timeout=0.3):
                if ev.WhichOneof("event") == "started":
                    cids["deadline"] = ev.started.cache.cache_id
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED

        it = iter(c.generate("slow", token_ids=[1, 2, 3], max_tokens=4000, request_id="abort-me"))
        cids["aborted"] = next(it).started.cache.cache_id
        next(it)
        assert c.abort("slow", request_id="abort-me").aborted_streams == 1
        with pytest.raises(FerrumRpcError) as e:
            for _ in it:
                pass
        assert e.value.code == grpc.StatusCode.CANCELLED

        assert wait_until(lambda: srv.live_caches()["slow"] == 0), "a stream's cache was not freed"
        reasons = _freed_reasons(c, set(cids.values()))
    assert {how: reasons.get(cid) for how, cid in cids.items()} == {
        "finished": "released", "cancelled": "reclaimed", "deadline": "reclaimed", "aborted": "reclaimed"}
    assert reg.released_total - released0 == 1
    assert reg.reclaimed_total - reclaimed0 == 3
    assert _metric(srv, "ferrum_reclaimed_caches_total", model="slow") == reclaimed0 + 3


# ---- Session -------------------------------------------------------------------------------------
def _session_requests(stop: threading.Event, cid_box: list, n: int = 500):
    """A Session request iterator: a prefill, then ``n`` pipelined decodes on its cache."""
    yield pb.SessionRequest(step_id=1, prefill=pb.PrefillRequest(model_id="slow", input=m.prefill_input([1, 2])))
    while not cid_box:
        if stop.wait(0.005):
            return
    for i in range(n):
        yield pb.SessionRequest(step_id=2 + i, decode=pb.DecodeRequest(
            model_id="slow", input=m.decode_input(cid_box[0], 5)))
    stop.wait(30)


def test_session_deadline_stops_pipelined_steps_and_frees_the_cache(srv):
    ex = _ex(srv)
    stop, box = threading.Event(), []
    with Client(srv.target) as c:
        responses = c.stub.Session(_session_requests(stop, box), timeout=0.5)
        got = 0
        try:
            with pytest.raises(grpc.RpcError) as e:
                for r in responses:
                    if r.WhichOneof("result") == "prefill":
                        box.append(r.prefill.output.cache.cache_id)
                    else:
                        assert r.WhichOneof("result") == "decode", r
                    got += 1
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            at_error = ex.decodes
        finally:
            stop.set()
    assert 5 < got < 100
    assert wait_until(lambda: srv.server.streams.active == set()), "the stream never ended on the server"
    assert ex.decodes - at_error <= 1
    _assert_stopped_and_freed(srv, ex)
    assert _metric(srv, "ferrum_reclaimed_caches_total", model="slow") == 1
    assert _metric(srv, "ferrum_cancelled_streams_total") >= 1


def test_session_cancel_and_closed_channel_free_their_caches(srv):
    ex = _ex(srv)
    for how in ("cancel", "close channel"):
        c = Client(srv.target)
        s = c.session()
        cid = s.step(pb.PrefillRequest(model_id="slow", input=m.prefill_input([1]))).output.cache.cache_id
        for _ in range(300):
            s.send(pb.DecodeRequest(model_id="slow", input=m.decode_input(cid, 5)))
        s.receive()
        assert srv.live_caches()["slow"] == 1
        if how == "cancel":
            s.cancel()
        c.close()
        _assert_stopped_and_freed(srv, ex)
        assert ex.decodes < 300, how


# ---- leases --------------------------------------------------------------------------------------
def test_idle_ownerless_caches_are_reclaimed_after_the_ttl_and_steps_renew_the_lease():
    ttl = 0.6
    with InProcessServer([ConfigurableModelExecutor.with_token_sequence(1000, [7], model_id="mock")],
                         cache_ttl=ttl) as srv, Client(srv.target) as c:
        idle = c.prefill("mock", [1, 2]).output.cache.cache_id
        busy = c.prefill("mock", [1, 2]).output.cache.cache_id
        trunc = c.prefill("mock", [1, 2, 3]).output.cache.cache_id
        with c.session() as s:
            owned = s.step(pb.PrefillRequest(model_id="mock", input=m.prefill_input([3]))).output.cache.cache_id
            reg = srv.models.get("mock").executor.registry
            deadline = time.monotonic() + 10 + 3 * ttl  # poll until the idle cache is reclaimed
            while idle in reg and time.monotonic() < deadline:  # `busy` decoded, `trunc` truncated: renewed
                c.decode("mock", busy, 1)
                c.truncate_kv("mock", trunc, 2)
                time.sleep(ttl / 4)
            # the idle unary cache is gone, with the documented NOT_FOUND
            with pytest.raises(FerrumRpcError) as e:
                c.decode("mock", idle, 1)
            assert e.value.code == grpc.StatusCode.NOT_FOUND and "was released" in e.value.message
            assert {x.cache_id for x in srv.models.get("mock").executor.registry.entries()} == {busy, trunc, owned}
            # a cache owned by an open stream is the stream's to free, however idle it is
            assert s.step(pb.DecodeRequest(model_id="mock", input=m.decode_input(owned, 1))).output.cache.num_tokens == 2
        assert wait_until(lambda: srv.live_caches()["mock"] == 2)
        assert srv.server.metrics.value("ferrum_expired_caches_total", {"model": "mock"}) == 1
        # after the caller stops touching them, they expire too
        assert wait_until(lambda: srv.live_caches()["mock"] == 0, timeout=5 * ttl)
        assert srv.server.metrics.value("ferrum_expired_caches_total", {"model": "mock"}) == 3
        assert srv.server.metrics.value("ferrum_reclaimed_caches_total", {"model": "mock"}) == 4  # + the session's


def test_caches_of_a_quiet_origin_are_reclaimed_long_before_the_ttl():
    """Issue 15 (4): ownerless caches remember where the call that made them came from (caller @
    host). While that origin keeps calling, an idle cache of it keeps the full TTL; once the origin
    makes no call at all for ``origin_idle_ttl``, its idle caches are reclaimed then (ferrum's
    engine never releases its draft executor's caches; they go soon after the engine goes quiet)."""
    from ferrum_service.core.callers import peer_host

    assert peer_host("ipv4:127.0.0.1:50123") == "ipv4:127.0.0.1"
    assert peer_host("ipv6:[::1]:50123") == "ipv6:[::1]" and peer_host("unix:/tmp/s") == "unix:/tmp/s"
    quiet = 1.0  # at 0.4 s a stall of the calling loop on a loaded CI machine read as a quiet origin
    with InProcessServer([ConfigurableModelExecutor.with_token_sequence(1000, [7], model_id="mock")],
                         cache_ttl=60, origin_idle_ttl=quiet) as srv, Client(srv.target) as c:
        assert srv.server.leases.interval == pytest.approx(quiet / 4)
        reg = srv.models.get("mock").executor.registry
        idle = c.prefill("mock", [1, 2]).output.cache.cache_id
        used = c.prefill("mock", [1, 2]).output.cache.cache_id
        assert reg.get(idle).origin == "@ipv4:127.0.0.1"
        t_end = time.monotonic() + 4 * quiet
        while time.monotonic() < t_end:  # the origin keeps calling: its idle cache is kept
            c.decode("mock", used, 1)
            time.sleep(quiet / 8)
        assert idle in reg and used in reg
        t_quiet = time.monotonic()
        assert wait_until(lambda: srv.live_caches()["mock"] == 0, timeout=5)  # the origin went quiet
        assert time.monotonic() - t_quiet < 3 * quiet + 0.5
        assert srv.server.metrics.value("ferrum_idle_origin_caches_total", {"model": "mock"}) == 2
        assert srv.server.metrics.value("ferrum_expired_caches_total", {"model": "mock"}) == 0
    with InProcessServer([ConfigurableModelExecutor.with_token_sequence(1000, [7], model_id="mock")],
                         cache_ttl=60, origin_idle_ttl=0) as srv, Client(srv.target) as c:
        cid = c.prefill("mock", [1]).output.cache.cache_id
        srv.models.get("mock").executor.registry.get(cid).last_access -= 30  # idle, origin quiet: kept
        srv.server.activity._last.clear()
        assert srv.server.leases.expired() == []  # the rule is off: only the TTL reclaims
        assert c.decode("mock", cid, 1).output.cache.num_tokens == 2


def test_ttl_zero_never_reclaims():
    with InProcessServer([ConfigurableModelExecutor.with_token_sequence(1000, [7], model_id="mock")],
                         cache_ttl=0) as srv, Client(srv.target) as c:
        assert not srv.server.leases.enabled
        cid = c.prefill("mock", [1]).output.cache.cache_id
        entry = srv.models.get("mock").executor.registry.get(cid)
        entry.last_access -= 3600  # an hour idle
        time.sleep(0.2)
        assert c.decode("mock", cid, 1).output.cache.num_tokens == 2


def test_cache_ttl_from_the_environment_and_the_reclaim_is_logged():
    with ServerProcess("--model", "configurable,id=mock,vocab_size=1000,token_sequence=7",
                       env={"FERRUM_CACHE_TTL": "0.4"}) as srv, Client(srv.target) as c:
        cid = c.prefill("mock", [1, 2]).output.cache.cache_id
        assert wait_until(lambda: c.kv_capacity("mock").used_tokens == 0, timeout=5)
        with pytest.raises(FerrumRpcError) as e:
            c.decode("mock", cid, 1)
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        log = srv.log()
    assert "cache lease expired; reclaimed" in log and cid in log and '"ttl_s": 0.4' in log
