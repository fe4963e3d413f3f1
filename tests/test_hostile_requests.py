"""Hostile requests are bounded before any work, and callers are isolated.

Against a ``ferrum-service serve`` subprocess hosting the tiny random-weight Llama (1,024
positions, vocabulary 512; per-step ceiling 8,192 positions), a tiny BERT and the scripted
executor, each request below — unary, as a Session step and through Generate where it applies —
must get its documented code at once, the server's peak RSS during the case must stay under a
stated bound, the server must still serve, and no cache may be left behind.

Before packed steps and these limits, one BatchPrefill of a 1,000-token row plus 31 one-token rows
raised the server's RSS by ~278 MiB (padding to a [32, 1000, 1000] mask); on SmolLM2 the same shape
asked for gigabytes. It now costs its 1,031 real tokens; what the ceilings refuse is real work past
them (32 x 1,000 tokens in one step). Also checked: caches belong to the authenticated caller that made them (another caller
gets NOT_FOUND and cannot touch them), and cache ids are unguessable.
"""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import psutil
import pytest

from ferrum_client import Client, FerrumRpcError, messages as m, pb, tpb

from .conftest_models import tiny_bert_dir, tiny_llama_dir  # noqa: F401 - fixtures
from .support.servers import ServerProcess
from .support.waits import wait_no_listed_caches

C = grpc.StatusCode
RSS_BOUND = 150 * 1024 * 1024  # peak RSS growth allowed while a hostile request is refused
MESSAGE_LIMIT = 8 * 1024 * 1024


@pytest.fixture(scope="module")
def hostile_server(tiny_llama_dir, tiny_bert_dir):  # noqa: F811
    with ServerProcess("--model", f"hf-causal-lm,id=tiny,path={tiny_llama_dir},device=cpu",
                       "--model", f"bert,id=enc,path={tiny_bert_dir},device=cpu",
                       "--model", "configurable,id=mock,vocab_size=1000,token_sequence=10:20:30",
                       "--max-message-bytes", str(MESSAGE_LIMIT), "--max-text-bytes", "65536") as srv:
        yield srv


class PeakRss:
    """Samples a process's RSS every few milliseconds while the block runs."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.base = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self._stop.wait(0.002)

    def __enter__(self) -> "PeakRss":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.base


def _forward_request(model: str, batch: int, seq: int) -> pb.ForwardRequest:
    t = tpb.Tensor(dtype=tpb.DATA_TYPE_INT32, shape=[batch, seq],
                   data=np.ones(batch * seq, dtype="<i4").tobytes())
    return pb.ForwardRequest(model_id=model, input=t)


def _long_row_plus_short_rows(model: str) -> pb.BatchPrefillRequest:
    return pb.BatchPrefillRequest(model_id=model, inputs=[m.prefill_input([1] * 1000)] +
                                  [m.prefill_input([2]) for _ in range(31)])


def _many_long_rows(model: str) -> pb.BatchPrefillRequest:
    """32 rows of 1,000 tokens: 32,000 positions in one step, past the 8,192 ceiling."""
    return pb.BatchPrefillRequest(model_id=model, inputs=[m.prefill_input([1 + i] * 1000) for i in range(32)])


# (name, request builder, RPC, expected code, text the message must contain)
UNARY = [
    ("32 rows of 1,000 tokens in one step", lambda: _many_long_rows("tiny"), "BatchPrefill",
     C.INVALID_ARGUMENT, "token positions"),
    ("all-positions full logits past the message limit",
     lambda: pb.BatchPrefillRequest(model_id="tiny", inputs=[m.prefill_input(
         [3] * 1000, policy=m.full_logits(), all_positions=True)] * 8), "BatchPrefill", C.INVALID_ARGUMENT,
     "message limit"),
    ("Forward batch x seq past the per-step ceiling", lambda: _forward_request("tiny", 64, 1000), "Forward",
     C.INVALID_ARGUMENT, "token positions"),
    ("Forward longer than the model", lambda: _forward_request("tiny", 1, 2000), "Forward",
     C.INVALID_ARGUMENT, "limit is 1024"),
    ("Forward on the encoder past its positions", lambda: _forward_request("enc", 1, 4000), "Forward",
     C.INVALID_ARGUMENT, "input.shape"),
    ("2M-token prompt", lambda: pb.PrefillRequest(model_id="tiny", input=m.prefill_input([1] * 2_000_000)),
     "Prefill", C.INVALID_ARGUMENT, "limit is 1048576"),  # the contract's bound, before the model's
    ("100k-token prompt", lambda: pb.PrefillRequest(model_id="tiny", input=m.prefill_input([1] * 100_000)),
     "Prefill", C.INVALID_ARGUMENT, "limit is 1024"),
    ("verify on a guessed cache id", lambda: pb.ForwardVerifyRequest(model_id="mock", cache_id="mock-1", token_ids=[1]),
     "ForwardVerify", C.NOT_FOUND, "cache_id"),
    ("text past the text limit", lambda: pb.TokenizeRequest(model_id="tiny", text="a" * 100_000), "Tokenize",
     C.INVALID_ARGUMENT, "limit is 65536"),
    ("chat template past the text limit", lambda: pb.ApplyChatTemplateRequest(
        model_id="tiny", messages=[pb.ChatMessage(role="user", content="b" * 100_000)]), "ApplyChatTemplate",
     C.INVALID_ARGUMENT, "limit is 65536"),
    ("detokenize 1M ids", lambda: pb.DetokenizeRequest(model_id="tiny", token_ids=[1] * 1_000_000), "Detokenize",
     C.INVALID_ARGUMENT, "limit is"),
    ("fork a guessed cache id", lambda: pb.ForkCacheRequest(model_id="tiny", cache_id="hf-" + "0" * 32), "ForkCache",
     C.NOT_FOUND, "cache_id"),
    ("fork with no cache id", lambda: pb.ForkCacheRequest(model_id="tiny"), "ForkCache", C.INVALID_ARGUMENT,
     "cache_id is empty"),
    ("fork a guessed id on an executor without forks", lambda: pb.ForkCacheRequest(model_id="mock",
                                                                                   cache_id="mock-1"),
     "ForkCache", C.NOT_FOUND, "unknown"),
    ("LoadAdapter without admin rights", lambda: pb.LoadAdapterRequest(model_id="tiny", name="x", path="/etc"),
     "LoadAdapter", C.PERMISSION_DENIED, "admin"),
    ("UnloadAdapter without admin rights", lambda: pb.UnloadAdapterRequest(model_id="tiny", name="x"),
     "UnloadAdapter", C.PERMISSION_DENIED, "admin"),
    ("ListAdapters of an unknown model", lambda: pb.ListAdaptersRequest(model_id="nope"), "ListAdapters",
     C.NOT_FOUND, "not hosted"),
]


def _no_caches(c: Client) -> None:
    """No live cache, allowing a closed Session's caches a few seconds to go (the server releases
    them when it sees the stream end, after the client has moved on)."""
    assert len(wait_no_listed_caches(c, timeout=5)) == 0, "a refused request left a cache"


@pytest.mark.parametrize("name,build,rpc,code,text", UNARY, ids=[u[0] for u in UNARY])
def test_hostile_unary_request_is_refused_before_work(hostile_server, name, build, rpc, code, text):
    with Client(hostile_server.target) as c:
        req = build()
        with PeakRss(hostile_server.pid) as rss:
            t0 = time.perf_counter()
            with pytest.raises(FerrumRpcError) as e:
                c.call(rpc, req)
            took = time.perf_counter() - t0
        assert e.value.code == code, e.value.message
        assert text in e.value.message
        assert rss.growth < RSS_BOUND, f"{name}: RSS grew {rss.growth / 2**20:.0f} MiB while refusing"
        print(f"{name}: {e.value.code.name} in {took * 1000:.1f} ms, peak RSS +{rss.growth / 2**20:.1f} MiB")
        assert c.health() == "SERVING"
        _no_caches(c)
        assert c.prefill("tiny", [1, 2, 3]).output.cache.num_tokens == 3  # still serving real work
        c.release_cache("tiny", c.list_caches("tiny").caches[0].cache_id)


def test_hostile_steps_in_a_session_and_generate(hostile_server):
    with Client(hostile_server.target) as c:
        with PeakRss(hostile_server.pid) as rss:
            with c.session() as s:
                with pytest.raises(FerrumRpcError) as e:
                    s.step(_many_long_rows("tiny"))
                assert e.value.code == C.INVALID_ARGUMENT and "token positions" in e.value.message
                # the session goes on
                out = s.step(pb.PrefillRequest(model_id="tiny", input=m.prefill_input([4, 5]))).output
                assert out.cache.num_tokens == 2
            with pytest.raises(FerrumRpcError) as e:
                c.generate("tiny", token_ids=[1] * 5000, max_tokens=4).tokens()
            assert e.value.code == C.INVALID_ARGUMENT and "limit is 1024" in e.value.message
            with pytest.raises(FerrumRpcError) as e:
                c.generate("tiny", text="c" * 100_000, max_tokens=4).tokens()
            assert e.value.code == C.INVALID_ARGUMENT and "text" in e.value.field
        assert rss.growth < RSS_BOUND
        _no_caches(c)


def test_one_long_row_with_31_short_rows_costs_its_real_tokens(hostile_server):
    """The shape that padding used to blow up (+278 MiB on this model: a [32, 1000, 1000] mask)
    now runs packed: 1,031 positions, bounded memory, every row served."""
    with Client(hostile_server.target) as c:
        with PeakRss(hostile_server.pid) as rss:
            r = c.call("BatchPrefill", _long_row_plus_short_rows("tiny"))
        assert [o.cache.num_tokens for o in r.outputs] == [1000] + [1] * 31
        assert rss.growth < 64 * 1024 * 1024, f"RSS grew {rss.growth / 2**20:.0f} MiB"
        print(f"1,000 + 31 x 1 rows: served, peak RSS +{rss.growth / 2**20:.1f} MiB")
        for o in r.outputs:
            c.release_cache("tiny", o.cache.cache_id)


def test_callers_cannot_see_or_touch_each_others_caches(tmp_path):
    (tmp_path / "tokens").write_text("alice-secret\nbob-secret\n")
    with ServerProcess("--model", "configurable,id=mock,vocab_size=1000,token_sequence=10:20:30",
                       "--auth-token-file", str(tmp_path / "tokens")) as srv, \
            Client(srv.target, token="alice-secret") as alice, Client(srv.target, token="bob-secret") as bob:
        cid = alice.prefill("mock", [1, 2]).output.cache.cache_id
        assert len(cid.split("-")[-1]) == 32  # 128 random bits
        for call in (lambda: bob.decode("mock", cid, 1), lambda: bob.truncate_kv("mock", cid, 0),
                     lambda: bob.forward_verify("mock", cid, [1, 2]),
                     lambda: bob.prefill("mock", [3], cache_id=cid)):
            with pytest.raises(FerrumRpcError) as e:
                call()
            assert e.value.code == C.NOT_FOUND
        assert bob.release_cache("mock", cid).released is False
        assert bob.abort("mock", cache_id=cid).released_cache is False
        assert [x.cache_id for x in bob.list_caches().caches] == []
        with bob.session() as s:
            with pytest.raises(FerrumRpcError) as e:
                s.step(pb.DecodeRequest(model_id="mock", input=m.decode_input(cid, 1)))
            assert e.value.code == C.NOT_FOUND
        # alice's cache is intact and hers to use
        assert [x.cache_id for x in alice.list_caches().caches] == [cid]
        assert alice.decode("mock", cid, 5).output.cache.num_tokens == 3
        assert alice.release_cache("mock", cid).released is True


def test_retry_ids_are_per_caller(tmp_path):
    """The same client_step_id from two callers runs twice (no replay of another caller's result)."""
    (tmp_path / "tokens").write_text("alice-secret\nbob-secret\n")
    with ServerProcess("--model", "configurable,id=mock,vocab_size=1000,token_sequence=10:20:30,"
                       "counter=per_sequence", "--auth-token-file", str(tmp_path / "tokens")) as srv, \
            Client(srv.target, token="alice-secret") as alice, Client(srv.target, token="bob-secret") as bob:
        req = pb.PrefillRequest(model_id="mock", input=m.prefill_input([1]), client_step_id="step-1")
        a = alice.call("Prefill", req).output.cache.cache_id
        assert alice.call("Prefill", req).output.cache.cache_id == a  # alice's retry replays
        b = bob.call("Prefill", req).output.cache.cache_id
        assert b != a  # bob's step ran on its own
        assert [x.cache_id for x in bob.list_caches().caches] == [b]
        alice.release_cache("mock", a)
        bob.release_cache("mock", b)


# ---- the handoff, adapter and event RPCs -----------------------------------------------------------
def _export(c: Client, cid: str) -> tuple[pb.KvTransferHeader, list]:
    msgs = list(c.export_kv("tiny", cid))
    return msgs[0].header, [x.chunk for x in msgs[1:]]


def _import(c: Client, header, chunks, **kw):
    reqs = [pb.ImportKvRequest(model_id="tiny", header=header, **kw)] + [pb.ImportKvRequest(chunk=x) for x in chunks]
    return c.call("ImportKv", iter(reqs))


def _edited(msg, **fields):
    out = type(msg)()
    out.CopyFrom(msg)
    for k, v in fields.items():
        if isinstance(v, list):
            del getattr(out, k)[:]
            getattr(out, k).extend(v)
        else:
            setattr(out, k, v)
    return out


def test_hostile_fork_export_import_and_events(hostile_server):
    """Bad input to ForkCache, ExportKv, ImportKv and SubscribeKvEvents: wrong types of model,
    huge or out-of-range numbers, unknown ids, corrupt or short K/V. Each gets its documented code,
    changes nothing, and the server keeps serving."""
    with Client(hostile_server.target) as c:
        cid = c.prefill("tiny", list(range(1, 41))).output.cache.cache_id
        header, chunks = _export(c, cid)
        S = pb.ForkCacheRequest
        cases = [
            (lambda: c.call("ForkCache", S(model_id="tiny", cache_id=cid, keep_tokens=2**63)), C.OUT_OF_RANGE,
             "keep_tokens"),
            (lambda: c.call("ForkCache", S(model_id="tiny", cache_id=cid, reserve_tokens=2**64 - 1)),
             C.INVALID_ARGUMENT, "limit is 1024"),
            (lambda: c.call("ForkCache", S(model_id="enc", cache_id=cid)), C.UNIMPLEMENTED, "encoder"),
            (lambda: c.call("ForkCache", S(model_id="mock", cache_id=cid)), C.INVALID_ARGUMENT, "belongs to model"),
            (lambda: list(c.export_kv("tiny", "hf-" + "1" * 32)), C.NOT_FOUND, "cache_id"),
            (lambda: list(c.export_kv("tiny", cid, 30, 2**64 - 1)), C.OUT_OF_RANGE, "token range"),
            (lambda: list(c.export_kv("mock", "mock-1")), C.UNIMPLEMENTED, "export or import"),
            (lambda: c.call("ImportKv", iter([])), C.INVALID_ARGUMENT, "empty"),
            (lambda: c.call("ImportKv", iter([pb.ImportKvRequest(model_id="tiny", chunk=chunks[0])])),
             C.INVALID_ARGUMENT, "header"),
            (lambda: _import(c, header, chunks, reserve_tokens=2**64 - 1), C.INVALID_ARGUMENT, "limit is 1024"),
            (lambda: _import(c, header, chunks, cache_salt="s" * 5000), C.INVALID_ARGUMENT, "cache_salt"),
            (lambda: _import(c, _edited(header, token_ids=[10**6] * 40), chunks), C.INVALID_ARGUMENT, "vocabulary"),
            (lambda: _import(c, _edited(header, token_ids=[1] * 100_000), chunks), C.INVALID_ARGUMENT, "token ids"),
            (lambda: _import(c, _edited(header, fingerprint="0" * 64), chunks), C.FAILED_PRECONDITION, "fingerprint"),
            (lambda: _import(c, _edited(header, adapter="nope"), chunks), C.FAILED_PRECONDITION, "adapter"),
            (lambda: _import(c, header, [_edited(chunks[0], checksum=chunks[0].checksum ^ 1)] + chunks[1:]),
             C.DATA_LOSS, "checksum"),
            (lambda: _import(c, header, [_edited(chunks[0], layer=99)] + chunks[1:]), C.INVALID_ARGUMENT, "layer"),
            (lambda: _import(c, header, [_edited(chunks[0], token_end=2**40)] + chunks[1:]), C.INVALID_ARGUMENT,
             "tokens"),
            (lambda: _import(c, header, [_edited(chunks[0], key=b"\0" * 8)] + chunks[1:]), C.INVALID_ARGUMENT,
             "bytes"),
            (lambda: _import(c, header, chunks + [chunks[0]]), C.INVALID_ARGUMENT, "index"),
            (lambda: _import(c, header, chunks[:1]), C.DATA_LOSS, "nothing was imported"),
            (lambda: next(iter(c.subscribe_kv_events("nope"))), C.NOT_FOUND, "not hosted"),
        ]
        with PeakRss(hostile_server.pid) as rss:
            for i, (call, code, text) in enumerate(cases):
                with pytest.raises(FerrumRpcError) as e:
                    call()
                assert e.value.code == code and text in e.value.message, (i, e.value.code, e.value.message)
        assert rss.growth < RSS_BOUND
        assert [x.cache_id for x in c.list_caches().caches] == [cid]  # nothing made, nothing lost
        assert _import(c, header, chunks).cache.num_tokens == 40  # the untouched stream still imports
        for x in c.list_caches().caches:
            c.release_cache(x.model_id, x.cache_id)
        _no_caches(c)


def test_floods_of_the_new_rpcs_are_bounded(hostile_server):
    """64 concurrent forks, exports and imports of one cache, 64 LoadAdapter calls and 40
    subscriptions: every call ends with success or a documented refusal (busy, capped, denied), other
    callers are answered within 1 s throughout, and nothing is left behind."""
    with Client(hostile_server.target) as c, Client(hostile_server.target) as other:
        cid = c.prefill("tiny", list(range(1, 41))).output.cache.cache_id
        header, chunks = _export(c, cid)
        ok = {C.RESOURCE_EXHAUSTED, C.ABORTED, C.PERMISSION_DENIED}
        codes: list = []
        lock = threading.Lock()
        made: list[str] = []

        def run(call):
            try:
                r = call()
                cache = getattr(r, "cache", None)
                if cache is not None and cache.cache_id:
                    with lock:
                        made.append(cache.cache_id)
                codes.append("OK")
            except FerrumRpcError as e:
                codes.append(e.code)

        calls = ([lambda: c.fork_cache("tiny", cid)] * 64 + [lambda: list(c.export_kv("tiny", cid))] * 64 +
                 [lambda: _import(c, header, chunks)] * 64 +
                 [lambda: c.load_adapter("x", "/etc", model_id="tiny")] * 64)
        threads = [threading.Thread(target=run, args=(f,)) for f in calls]
        subs = [c.subscribe_kv_events(from_seq=1) for _ in range(40)]  # no auth: the cap counts the client host
        slowest = 0.0
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            t0 = time.perf_counter()
            assert other.loads("tiny").loads[0].model_id == "tiny"
            slowest = max(slowest, time.perf_counter() - t0)
            time.sleep(0.05)
        for t in threads:
            t.join()
        refused_subs = 0
        for s in subs:
            try:
                next(iter(s))
            except FerrumRpcError as e:
                assert e.code == C.RESOURCE_EXHAUSTED, e
                refused_subs += 1
            s.cancel()
        assert slowest < 1.0, f"another caller waited {slowest:.2f} s"
        assert len(codes) == len(calls) and all(x == "OK" or x in ok for x in codes), set(map(str, codes))
        assert codes.count(C.PERMISSION_DENIED) == 64  # every LoadAdapter (no admin rights here)
        assert refused_subs == 40 - 16  # the per-caller cap (all of this client's streams count as one caller)
        print(f"floods: {len(made)} caches made, slowest Loads {slowest * 1000:.0f} ms, "
              f"{codes.count(C.ABORTED)} busy, {codes.count(C.RESOURCE_EXHAUSTED)} exhausted")
        for x in made + [cid]:
            c.release_cache("tiny", x)
        _no_caches(c)


def _subscribed(c: Client, within: float = 5.0):
    """A subscription replaying from seq 1, once the server takes it (the streams an earlier test
    cancelled may take a moment to leave the per-caller count)."""
    deadline = time.monotonic() + within
    while True:
        s = c.subscribe_kv_events(from_seq=1, include_block_events=True)
        try:
            next(iter(s))
            return s
        except FerrumRpcError as e:
            assert e.code == C.RESOURCE_EXHAUSTED and time.monotonic() < deadline, e
            time.sleep(0.05)


def test_slow_and_huge_transfers_do_not_stall_other_callers(hostile_server):
    """A K/V export read slowly, an import that sends its header and then stalls, and 16
    subscriptions that read nothing more from a replay: another caller's Prefill, Loads and
    ListAdapters are each answered within 1 s meanwhile."""
    with Client(hostile_server.target) as c, Client(hostile_server.target) as other:
        cid = c.prefill("tiny", [(7 * i) % 500 + 1 for i in range(1000)]).output.cache.cache_id
        header, chunks = _export(c, cid)
        slow_stream = c.export_kv("tiny", cid, max_chunk_bytes=4096)
        slow = iter(slow_stream)
        next(slow)  # the header; the rest is read one chunk at a time below
        stall = threading.Event()

        def stalled_stream():
            yield pb.ImportKvRequest(model_id="tiny", header=header)
            stall.wait(30)

        stalled: list = []

        def importer():
            try:
                c.call("ImportKv", stalled_stream())
                stalled.append("OK")
            except FerrumRpcError as e:
                stalled.append(e.code)

        t = threading.Thread(target=importer)
        t.start()
        subs = [_subscribed(c) for _ in range(16)]
        try:
            times = []
            for i in range(10):
                next(slow)
                for call in (lambda: other.prefill("tiny", [1, 2, 3 + i]), lambda: other.loads(),
                             lambda: other.list_adapters()):
                    t0 = time.perf_counter()
                    r = call()
                    times.append(time.perf_counter() - t0)
                    if hasattr(r, "output"):
                        other.release_cache("tiny", r.output.cache.cache_id)
                time.sleep(0.1)
            assert max(times) < 1.0, f"slowest answer {max(times):.2f} s"
            print(f"slow/huge transfers: other callers' slowest answer {max(times) * 1000:.0f} ms")
        finally:
            stall.set()
            t.join(30)
            for s in subs:
                s.cancel()
            slow_stream.cancel()
        assert stalled == [C.DATA_LOSS]  # the stalled import ended without importing anything
        deadline = time.monotonic() + 5
        while not c.release_cache("tiny", cid).released:  # the cancelled export lets go of it
            assert time.monotonic() < deadline
            time.sleep(0.05)
        _no_caches(c)


def test_new_rpcs_refuse_another_callers_ids(tmp_path, tiny_llama_dir):  # noqa: F811
    """Two authenticated callers and an admin: bob cannot fork, export, continue or learn of
    alice's cache, nor load or unload adapters; ListAdapters tells him no path."""
    (tmp_path / "tokens").write_text("alice-secret\nbob-secret\n")
    (tmp_path / "admin").write_text("admin-secret\n")
    with ServerProcess("--model", f"hf-causal-lm,id=tiny,path={tiny_llama_dir},device=cpu",
                       "--auth-token-file", str(tmp_path / "tokens"), "--admin-token-file", str(tmp_path / "admin")
                       ) as srv, Client(srv.target, token="alice-secret") as alice, \
            Client(srv.target, token="bob-secret") as bob:
        bob_events = bob.subscribe_kv_events(from_seq=1, include_block_events=True)
        cid = alice.prefill("tiny", list(range(1, 41))).output.cache.cache_id
        header, chunks = _export(alice, cid)
        for call in (lambda: bob.fork_cache("tiny", cid), lambda: list(bob.export_kv("tiny", cid)),
                     lambda: bob.decode("tiny", cid, 1),
                     lambda: bob.call("ReserveKvSlots", pb.ReserveKvSlotsRequest(
                         model_id="tiny", requests=[tpb.KvSlotRequest(cache_id=cid, target_len=64)]))):
            with pytest.raises(FerrumRpcError) as e:
                call()
            assert e.value.code == C.NOT_FOUND, e.value
        for call in (lambda: bob.load_adapter("x", str(tmp_path), model_id="tiny"),
                     lambda: bob.unload_adapter("x", model_id="tiny")):
            with pytest.raises(FerrumRpcError) as e:
                call()
            assert e.value.code == C.PERMISSION_DENIED, e.value
        # bob may import bytes he holds: the cache is his own, alice's is untouched
        mine = _import(bob, header, chunks).cache.cache_id
        assert [x.cache_id for x in bob.list_caches().caches] == [mine]
        assert [x.cache_id for x in alice.list_caches().caches] == [cid]
        bob.release_cache("tiny", mine)
        alice.release_cache("tiny", cid)
        mark = bob.prefill("tiny", [5]).output.cache.cache_id
        bob.release_cache("tiny", mark)
        seen = set()
        for msg in bob_events:
            if msg.WhichOneof("message") == "event":
                seen.add(msg.event.cache_id)
                if msg.event.cache_id == mark and msg.event.kind == pb.KV_EVENT_KIND_RELEASED:
                    break
        bob_events.cancel()
        assert seen == {mine, mark}, seen  # none of alice's
