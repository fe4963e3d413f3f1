"""The load records of the vLLM protocol's ``SubscribeKvEvents`` (``vllm_load.py``) on a real
server with the tiny random Llama: records before the first batch for a subscriber that asks for
them (numbered 0) and none for one that does not, the telemetry on the first record and the
heartbeats only, the heartbeat pace, a wedged step's silence and pending prefill, ``GetLoads``
answered from the same record, and a flood of streams that changes the load all the time still
sending at most one ``load_only`` batch per tick."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from ferrum_service.wire.vllm_load import HEARTBEAT_INTERVAL, LOAD_TICK

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.servers import InProcessServer
from .support.vllm_calls import gen_request
from .support.waits import wait_for

pytest.importorskip("transformers")


def _server(path):
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    return InProcessServer([HfCausalLmExecutor.from_path(path, model_id="tiny", device="cpu",
                                                         kv_budget_tokens=8192)])


class Reader:
    """Reads one subscription on a thread: ``got`` = (monotonic arrival, batch)."""

    def __init__(self, eng, **req) -> None:
        self.call = eng.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(**req), timeout=120)
        self.got: list[tuple[float, cpb.KvEventBatch]] = []
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        try:
            for b in self.call:
                self.got.append((time.monotonic(), b))
        except grpc.RpcError:
            pass

    def load_only(self) -> list[tuple[float, cpb.KvEventBatch]]:
        return [(t, b) for t, b in self.got if b.load.load_only]

    def close(self) -> None:
        self.call.cancel()
        self._t.join(5)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):  # noqa: F811
    with _server(tiny_llama_dir) as srv, grpc.insecure_channel(srv.target) as ch:
        yield srv, vllm_engine_pb2_grpc.VllmEngineStub(ch)


def test_records_before_the_first_batch_and_the_heartbeat_pace(server):
    srv, eng = server
    r = Reader(eng, load_records_before_first_batch=True)
    try:
        first = wait_for(lambda: list(r.got), bool, 3, 0.01)
        assert first, "no record before the first batch"
        b = first[0][1]
        assert b.sequence_number == 0 and b.load.load_only and not b.events and b.load.sample == 1
        rec = b.load
        # the record, truthfully: idle, the model's admission window and pool, steps reported
        assert rec.running_requests == rec.waiting_requests == 0 and not rec.HasField("engine_silence_ms")
        assert rec.max_running_requests == srv.models.get("tiny").max_batch
        assert rec.max_total_num_tokens == 8192 and rec.engine_reports_steps
        assert rec.HasField("waiting_uncached_tokens") and rec.prefill_pending_tokens == 0
        time.sleep(2 * HEARTBEAT_INTERVAL + 0.5)
        beats = r.load_only()
        gaps = [b2[0] - b1[0] for b1, b2 in zip(beats, beats[1:])]
        # idle: one per second (none in between), then the back-off
        assert 2 <= len(beats) <= 4, gaps
        assert all(g >= HEARTBEAT_INTERVAL - 0.15 for g in gaps), gaps
        assert [x[1].load.sample for x in beats] == list(range(1, len(beats) + 1))
        assert all(x[1].load.HasField("max_total_num_tokens") for x in beats)  # telemetry on heartbeats
    finally:
        r.close()


def test_no_record_before_the_first_batch_without_the_flag(server):
    """A subscriber that predates ``load_only`` would take a batch numbered 0 for a duplicate:
    it gets none before its first batch, then event batches with the record (core only after its
    first), then heartbeats that repeat the last sequence it was sent."""
    srv, eng = server
    start = srv.server.vllm.relay.seq
    r = Reader(eng, start_sequence_number=start)
    try:
        time.sleep(1.5)
        assert r.got == []
        for k in range(2):  # two prompts of two full blocks each: block events
            list(eng.Generate(gen_request(list(range(200 + 40 * k, 240 + 40 * k)), max_tokens=1), timeout=30))
        events = wait_for(lambda: [b for _, b in r.got if b.events], lambda e: len(e) >= 2, 10, 0.02)
        assert len(events) >= 2 and all(b.HasField("load") and not b.load.load_only for b in events)
        assert r.got[0][1].events and r.got[0][1].load.HasField("max_total_num_tokens")  # first: full
        assert not events[1].load.HasField("max_total_num_tokens")  # later event batches: the core
        beat = wait_for(r.load_only, bool, 3, 0.05)
        assert beat and beat[0][1].sequence_number == max(b.sequence_number for b in events)
        samples = [b.load.sample for _, b in r.got]
        assert samples == sorted(samples) and len(set(samples)) == len(samples)
    finally:
        r.close()


def test_a_wedged_step_shows_as_silence_and_pending_prefill(server):
    srv, eng = server
    ex = srv.models.get("tiny").executor
    real = ex.execute
    release = threading.Event()
    ex.execute = lambda plan: (release.wait(60), real(plan))[1]
    r = Reader(eng, load_records_before_first_batch=True)
    pool = ThreadPoolExecutor(1)
    prompt = list(range(7, 7 + 37))
    try:
        fut = pool.submit(lambda: list(eng.Generate(gen_request(prompt, max_tokens=2, ignore_eos=True), timeout=60)))
        silent = wait_for(lambda: [b.load for _, b in r.got if b.load.engine_silence_ms >= 1500], bool, 10, 0.05)
        assert silent, [b.load for _, b in r.got][-3:]
        rec = silent[-1]
        assert rec.running_requests + rec.waiting_requests == 1
        assert rec.prefill_pending_tokens == len(prompt)  # in the wedged step, not computed yet
        # while busy, no back-off: a record at least every second
        beats = [t for t, b in r.load_only()]
        assert max(b - a for a, b in zip(beats, beats[1:])) < HEARTBEAT_INTERVAL + 0.5
        # GetLoads reads the same record
        load = eng.GetLoads(vpb.GetLoadsRequest()).loads[0]
        assert load.num_running_reqs + load.num_waiting_reqs == 1
        assert load.max_running_requests == rec.max_running_requests
        release.set()
        assert fut.result(30)[-1].complete.finish_reason == "length"
        idle = wait_for(lambda: r.got[-1][1].load, lambda x: not x.HasField("engine_silence_ms"), 5, 0.05)
        assert not idle.HasField("engine_silence_ms") and idle.running_requests == 0
    finally:
        release.set()
        ex.execute = real
        r.close()
        pool.shutdown()


def test_a_flood_of_streams_sends_at_most_one_load_only_batch_per_tick(server):
    """32 short streams at once (the load changes at every step) and 4 subscribers: each gets at
    most one ``load_only`` batch per tick, and the server answers GetLoads meanwhile."""
    srv, eng = server
    readers = [Reader(eng, load_records_before_first_batch=True) for _ in range(4)]
    for r in readers:
        assert wait_for(lambda r=r: list(r.got), bool, 5, 0.01), "a subscriber got no first record"
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(32) as pool:
            futs = [pool.submit(lambda k=k: list(eng.Generate(gen_request([5 + k % 40] * 20, rid=f"f{k}",
                                                                             max_tokens=32, ignore_eos=True), timeout=60)))
                    for k in range(64)]
            worst = 0.0
            while not all(f.done() for f in futs):
                a = time.monotonic()
                eng.GetLoads(vpb.GetLoadsRequest(), timeout=10)
                worst = max(worst, time.monotonic() - a)
                time.sleep(0.05)
            for f in futs:
                assert f.result()[-1].complete.finish_reason == "length"
        for r in readers:  # a reader thread may record the flood's batches after the last stream ends
            assert wait_for(lambda r=r: [t for t, _ in r.load_only() if t >= t0], bool, 5, 0.02), \
                "a subscriber got no load_only batch for the flood"
        elapsed = time.monotonic() - t0
        for r in readers:
            n = len([t for t, _ in r.load_only() if t >= t0])
            assert 1 <= n <= elapsed / LOAD_TICK + 2, (n, elapsed)
            busy = [b.load for _, b in r.got if b.load.running_requests + b.load.waiting_requests > 1]
            assert busy, "no record showed the flood"
        assert worst < 2.0, worst
    finally:
        for r in readers:
            r.close()
