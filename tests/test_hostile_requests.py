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
]


def _no_caches(c: Client) -> None:
    """No live cache, allowing a closed Session's caches a few seconds to go (the server releases
    them when it sees the stream end, after the client has moved on)."""
    deadline = time.monotonic() + 5
    while c.list_caches().caches and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(c.list_caches().caches) == 0, "a refused request left a cache"


@pytest.mark.parametrize("name,build,rpc,code,text", UNARY, ids=[u[0] for u in UNARY])
def test_hostile_unary_request_is_refused_before_work(hostile_server, name, build, rpc, code, text):
    with Client(hostile_server.target) as c:
        req = build()
        with PeakRss(hostile_server.pid) as rss:
            t0 = time.perf_counter()
            with pytest.raises(FerrumRpcError) as e:
                c._call(rpc, req)
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
            r = c._call("BatchPrefill", _long_row_plus_short_rows("tiny"))
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
        a = alice._call("Prefill", req).output.cache.cache_id
        assert alice._call("Prefill", req).output.cache.cache_id == a  # alice's retry replays
        b = bob._call("Prefill", req).output.cache.cache_id
        assert b != a  # bob's step ran on its own
        assert [x.cache_id for x in bob.list_caches().caches] == [b]
        alice.release_cache("mock", a)
        bob.release_cache("mock", b)
