"""Scheduler-facing operations: Loads, KV events + snapshot, Abort, safe retries, keepalive."""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest

from ferrum_client import Client, FerrumRpcError, messages as m, pb

from ferrum_service.executors import ConfigurableModelExecutor, StubModelExecutor

from .support.servers import InProcessServer
from .support.waits import wait_no_live_caches, wait_until

KIND = {pb.KV_EVENT_KIND_CREATED: "created", pb.KV_EVENT_KIND_EXTENDED: "extended",
        pb.KV_EVENT_KIND_TRUNCATED: "truncated", pb.KV_EVENT_KIND_RELEASED: "released",
        pb.KV_EVENT_KIND_RECLAIMED: "reclaimed", pb.KV_EVENT_KIND_EVICTED: "evicted"}


class Mirror:
    """A scheduler's view of the server's caches, built from a snapshot + KV events."""

    def __init__(self) -> None:
        self.caches: dict[tuple[str, str], int] = {}
        self.last_seq = 0
        self.lock = threading.Lock()
        self.lags: list[float] = []

    def load_snapshot(self, snap: pb.ListCachesResponse) -> None:
        with self.lock:
            self.caches = {(c.model_id, c.cache_id): c.num_tokens for c in snap.caches}
            self.last_seq = snap.as_of_seq

    def apply(self, ev: pb.KvEvent) -> None:
        with self.lock:
            assert ev.seq > self.last_seq, "sequence numbers only grow"
            self.last_seq = ev.seq
            key = (ev.model_id, ev.cache_id)
            if KIND[ev.kind] in ("released", "reclaimed", "evicted"):
                self.caches.pop(key, None)
            else:
                self.caches[key] = ev.num_tokens
            self.lags.append(time.time_ns() - ev.time_unix_ns)


def _follow(client: Client, mirror: Mirror, stop: threading.Event, from_seq: int | None, out: list):
    stream = client.subscribe_kv_events(from_seq=from_seq)
    out.append(stream)
    try:
        for msg in stream:
            if msg.WhichOneof("message") == "resync_required":
                mirror.load_snapshot(client.list_caches())
                continue
            mirror.apply(msg.event)
    except FerrumRpcError as e:
        if e.code != grpc.StatusCode.CANCELLED:
            raise


def test_mirror_tracks_server_through_random_operations():
    """Several clients run 1,200 random operations; a scheduler mirrors the caches from Loads +
    KV events, drops its subscription half way and resumes from its last sequence number, and ends
    with an exact match against the server's snapshot."""
    executors = [ConfigurableModelExecutor.with_token_sequence(500, [3, 4, 5], model_id="a"),
                 ConfigurableModelExecutor.with_token_sequence(500, [6], model_id="b", kv_budget_tokens=4000)]
    with InProcessServer(executors) as srv:
        watcher = Client(srv.target)
        mirror = Mirror()
        mirror.load_snapshot(watcher.list_caches())
        stop = threading.Event()
        streams: list = []
        t = threading.Thread(target=_follow, args=(watcher, mirror, stop, mirror.last_seq + 1, streams))
        t.start()
        rng = random.Random(1234)
        clients = [Client(srv.target) for _ in range(3)]
        live: list[tuple[str, str]] = []
        counts: dict[str, int] = {}
        errors_seen: dict[str, int] = {}

        def op(i: int) -> None:
            c = clients[i % 3]
            kind = rng.choice(["prefill", "decode", "decode", "batch", "truncate", "verify", "release",
                               "abort", "generate"])
            counts[kind] = counts.get(kind, 0) + 1
            model = rng.choice(["a", "b"])
            mine = [x for x in live if x[0] == model]
            try:
                if kind == "prefill" or not mine:
                    cid = c.prefill(model, [1] * rng.randint(1, 20)).output.cache.cache_id
                    live.append((model, cid))
                elif kind == "decode":
                    c.decode(model, rng.choice(mine)[1], 1)
                elif kind == "batch":
                    sel = rng.sample(mine, min(len(mine), rng.randint(1, 4)))
                    c.batch_decode(model, [(x[1], 2) for x in sel])
                elif kind == "truncate":
                    _, cid = rng.choice(mine)
                    n = srv.models.get(model).executor.registry.get(cid).num_tokens
                    c.truncate_kv(model, cid, rng.randint(0, n))
                elif kind == "verify":
                    c.forward_verify(model, rng.choice(mine)[1], [1, 2, 3], accept_greedy_prefix=rng.random() < .5)
                elif kind == "release":
                    x = rng.choice(mine)
                    c.release_cache(model, x[1])
                    live.remove(x)
                elif kind == "abort":
                    x = rng.choice(mine)
                    c.abort(model, cache_id=x[1])
                    live.remove(x)
                elif kind == "generate":
                    c.generate(model, token_ids=[1, 2], max_tokens=rng.randint(1, 5)).tokens()
            except FerrumRpcError as e:
                # the only expected refusal: model b's small KV budget is full
                assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                errors_seen[e.code.name] = errors_seen.get(e.code.name, 0) + 1

        for i in range(600):
            op(i)
        # drop the subscription and resume from the last sequence number seen
        streams[-1].cancel()
        t.join(10)
        resume = mirror.last_seq + 1
        for i in range(600, 1200):
            op(i)
        t2 = threading.Thread(target=_follow, args=(watcher, mirror, stop, resume, streams))
        t2.start()
        # wait until the mirror has caught up with the server's sequence
        wait_until(lambda: mirror.last_seq >= watcher.loads().kv_event_seq, timeout=20, interval=0.05)
        snap = watcher.list_caches()
        expected = {(x.model_id, x.cache_id): x.num_tokens for x in snap.caches}
        with mirror.lock:
            assert mirror.caches == expected
        loads = {l.model_id: l for l in watcher.loads().loads}
        for model in ("a", "b"):
            mine = {k: v for k, v in expected.items() if k[0] == model}
            assert loads[model].active_caches == len(mine)
            assert loads[model].resident_tokens == sum(mine.values())
            reg = srv.models.get(model).executor.registry  # running sums == a recount after 1,200 ops
            assert (reg.used_tokens, reg.used_tokens + reg.reserved_tokens) == reg.recount()
        streams[-1].cancel()
        t2.join(10)
        lags = sorted(mirror.lags)
        print(f"\nmirror: {sum(counts.values())} ops {counts}, refusals {errors_seen}, "
              f"{len(lags)} events, lag p50 {lags[len(lags) // 2] / 1e3:.0f} us p99 "
              f"{lags[int(len(lags) * .99)] / 1e3:.0f} us")
        assert sum(counts.values()) == 1200 and len(lags) > 1200
        for c in clients + [watcher]:
            c.close()


def test_resume_from_a_point_that_left_the_buffer_asks_for_resync():
    with InProcessServer([StubModelExecutor("s", 10)]) as srv, Client(srv.target) as c:
        srv.server.servicer.events.replay = type(srv.server.servicer.events.replay)(maxlen=5)
        for _ in range(20):
            c.prefill("s", [1])
        first = next(iter(c.subscribe_kv_events(from_seq=1)))
        assert first.WhichOneof("message") == "resync_required"
        assert first.resync_required.oldest_available_seq == 16 and first.resync_required.next_seq == 21


def test_slow_subscriber_is_dropped_without_blocking_compute():
    """The hub never waits: a subscriber whose bounded buffer is full is marked dropped, told the
    first sequence number it missed, and publishing goes on (real asyncio loop, no server)."""
    import asyncio

    from ferrum_service.hosting.kv_events import KvEventHub, SubscriberDropped

    async def scenario():
        hub = KvEventHub(subscriber_buffer=100)
        sub, gone, nxt = hub.subscribe("", None)
        assert gone is None and nxt == 1
        t0 = time.perf_counter()
        for i in range(10_000):  # the subscriber reads nothing
            hub.publish("extended", "m", "c", i)
        publish_s = time.perf_counter() - t0
        await asyncio.sleep(0)  # deliveries run on the subscriber's loop
        with pytest.raises(SubscriberDropped) as e:
            await sub.next()
        # told to resume from the first event it did not get
        assert e.value.resume_from_seq == 1 and "resume from seq" in str(e.value)
        sub.close()
        # what was missed is still in the replay buffer: resuming works (read as we go this time)
        sub2, gone2, _ = hub.subscribe("", 1)
        assert gone2 is None
        assert [(await sub2.next()).seq for _ in range(10_000)] == list(range(1, 10_001))
        return publish_s

    publish_s = asyncio.run(scenario())
    assert publish_s < 2.0


def test_dropped_subscriber_gets_resource_exhausted_with_resume_point():
    with InProcessServer([StubModelExecutor("s", 10)]) as srv, Client(srv.target) as c:
        srv.server.servicer.events.subscriber_buffer = 0  # every live subscriber is "too slow"
        errs: list = []

        def follow():
            try:
                list(c.subscribe_kv_events(timeout=30))
            except FerrumRpcError as e:
                errs.append(e)

        t = threading.Thread(target=follow)
        t.start()
        seqs = []
        deadline = time.monotonic() + 10
        while t.is_alive() and time.monotonic() < deadline:  # until the subscription sees an event
            c.prefill("s", [1])
            seqs.append(c.loads().kv_event_seq)
            time.sleep(0.05)
        t.join(30)
        e = errs[0]
        assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "resume from seq" in e.message
        assert 1 <= int(e.metadata["resume_from_seq"]) <= seqs[-1]
        assert c.prefill("s", [1]).output.cache.num_tokens == 1  # the server keeps serving


def test_retried_decode_step_advances_the_cache_once(client):
    cid = client.prefill("perseq", [1]).output.cache.cache_id
    req = pb.DecodeRequest(model_id="perseq", input=m.decode_input(cid, 7), client_step_id="step-1")
    first = client.call("Decode", req)
    again = client.call("Decode", req)
    assert first == again
    assert first.output.cache.num_tokens == 2
    assert client.kv_capacity("perseq").used_tokens == 2
    other = pb.DecodeRequest(model_id="perseq", input=m.decode_input(cid, 8), client_step_id="step-1")
    with pytest.raises(FerrumRpcError) as e:
        client.call("Decode", other)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.field == "client_step_id"
    # also on a Session stream
    with client.session() as s:
        sreq = pb.DecodeRequest(model_id="perseq", input=m.decode_input(cid, 7), client_step_id="step-2")
        a, b = s.step(sreq), s.step(sreq)
    assert a == b and a.output.cache.num_tokens == 3


def test_abort_generate_by_request_id(fresh_server, client):
    stream = client.generate("mock", token_ids=[1], max_tokens=4000, request_id="req-42")
    it = iter(stream)
    assert next(it).WhichOneof("event") == "started"
    r = client.abort("mock", request_id="req-42")
    assert r.aborted_streams == 1
    with pytest.raises(FerrumRpcError) as e:
        list(it)
    assert e.value.code == grpc.StatusCode.CANCELLED
    assert client.abort("mock", request_id="req-42").aborted_streams == 0  # idempotent
    assert client.abort("mock", request_id="never-existed").aborted_streams == 0
    assert wait_no_live_caches(fresh_server, timeout=5)["mock"] == 0


def test_abort_racing_a_finishing_stream_leaves_nothing_behind(fresh_server, client):
    for i in range(30):
        stream = client.generate("mock", token_ids=[1], max_tokens=3, request_id=f"race-{i}")
        got: list = []
        t = threading.Thread(target=lambda: got.append(client.abort("mock", request_id=f"race-{i}")))
        try:
            t.start()
            events = list(stream)
            assert events[-1].WhichOneof("event") == "finished"
        except FerrumRpcError as e:
            assert e.code == grpc.StatusCode.CANCELLED  # the documented outcome of a won race
        t.join()
    assert wait_no_live_caches(fresh_server, timeout=5)["mock"] == 0


def test_abort_by_cache_id_releases_it(client):
    cid = client.prefill("mock", [1, 2]).output.cache.cache_id
    r = client.abort("mock", cache_id=cid)
    assert r.released_cache
    assert client.abort("mock", cache_id=cid).released_cache is False
    with pytest.raises(FerrumRpcError) as e:
        client.decode("mock", cid, 1)
    assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_long_unary_call_outlives_client_keepalive():
    class Slow(ConfigurableModelExecutor):
        inline = False

        def decode(self, inp):
            time.sleep(3.0)
            return super().decode(inp)

    with InProcessServer([Slow(50, [9], model_id="slow")]) as srv:
        opts = [("grpc.keepalive_time_ms", 500), ("grpc.keepalive_timeout_ms", 1000),
                ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
        with Client(srv.target, options=opts) as c:
            cid = c.prefill("slow", [1]).output.cache.cache_id
            t0 = time.monotonic()
            out = c.decode("slow", cid, 1, timeout=30).output
            assert out.output.token_id == 9 and time.monotonic() - t0 >= 2.9


def test_loads_is_cheap(client):
    for i in range(20):
        client.prefill("mock", [1] * 5)
    t0 = time.perf_counter()
    n = 300
    for _ in range(n):
        loads = client.loads()
    per_call_us = (time.perf_counter() - t0) / n * 1e6
    mock = next(l for l in loads.loads if l.model_id == "mock")
    assert mock.active_caches == 20 and mock.resident_tokens == 100 and mock.block_size == 16
    assert mock.prefill_latency.count == 20
    print(f"\nLoads round trip: {per_call_us:.0f} us per call over {n} calls")
