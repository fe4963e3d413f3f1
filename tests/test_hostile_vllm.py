"""Hostile callers on the vLLM engine protocol (``vllm.grpc.engine.VllmEngine``, audit 2026-12-05:
M1, M2, L8, L9 and the protocol's RPCs one by one), through a real gRPC server on the tiny
transformers Llama with two authenticated callers (alice, bob) and an admin token.

Every RPC: no token is UNAUTHENTICATED; one caller cannot reach another's streams (Abort by the
other's request id) or events (its prompts' token ids); floods of subscriptions stop at the
contract's subscriber caps; oversized messages are refused by the transport before any work; a
client that stops reading its stream (Generate, GetTokenizer, SubscribeKvEvents) does not hold up
other callers' RPCs. ``FlushCache`` is an admin RPC with a bounded wait; the tokenizer bundle's
digest is computed once; a non-streamed answer that could pass the message limit is refused first.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.servers import InProcessServer
from .support.vllm_calls import auth, gen_request, rpc_error
from .support.waits import wait_no_live_caches, wait_until

pytest.importorskip("transformers")

C = grpc.StatusCode
ALICE, BOB, ADMIN = "tok-alice", "tok-bob", "tok-admin"
MAX_MESSAGE = 512 * 1024
PROMPT = list(range(5, 45))


_auth = auth
A, B, ADM = _auth(ALICE), _auth(BOB), _auth(ADMIN)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):  # noqa: F811
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    ex = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=4096)
    with InProcessServer([ex], auth_tokens=[ALICE, BOB], admin_tokens=[ADMIN], max_kv_event_subscribers=4,
                         max_kv_event_subscribers_per_caller=3, max_message_bytes=MAX_MESSAGE) as srv:
        with grpc.insecure_channel(srv.target) as ch:
            yield srv, vllm_engine_pb2_grpc.VllmEngineStub(ch)


def _req(ids=PROMPT, rid="r", stream=False, **sp) -> vpb.GenerateRequest:
    return gen_request(ids, rid, stream, **sp)


_code = rpc_error


def _loads_ms(eng, md=A) -> float:
    t0 = time.perf_counter()
    eng.GetLoads(vpb.GetLoadsRequest(), metadata=md, timeout=10)
    return (time.perf_counter() - t0) * 1000


# ---- every RPC needs a token ----------------------------------------------------------------------
def test_every_rpc_needs_a_token(server):
    _srv, eng = server
    calls = [lambda: list(eng.Generate(_req(max_tokens=2), timeout=10)),
             lambda: eng.Embed(vpb.EmbedRequest(request_id="e", tokenized=vpb.TokenizedInput(input_ids=[1]))),
             lambda: eng.HealthCheck(vpb.HealthCheckRequest()),
             lambda: eng.Abort(vpb.AbortRequest(request_ids=["x"])),
             lambda: eng.GetModelInfo(vpb.GetModelInfoRequest()),
             lambda: eng.GetServerInfo(vpb.GetServerInfoRequest()),
             lambda: eng.GetLoads(vpb.GetLoadsRequest()),
             lambda: list(eng.GetTokenizer(cpb.GetTokenizerRequest())),
             lambda: list(eng.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), timeout=5)),
             lambda: eng.FlushCache(cpb.FlushCacheRequest())]
    for call in calls:
        assert _code(call).code() == C.UNAUTHENTICATED
    bad = _auth("tok-mallory")
    assert _code(lambda: eng.GetLoads(vpb.GetLoadsRequest(), metadata=bad)).code() == C.UNAUTHENTICATED


# ---- M1: FlushCache is admin-only, its wait bounded -----------------------------------------------
def test_flush_cache_is_admin_only_and_bounded(server):
    """Any caller could drop every tenant's cached prefix (alice's next identical prompt then
    reported cached_tokens 0); now an ordinary token is PERMISSION_DENIED, as for the contract's
    admin RPCs, and timeout_s is bounded."""
    srv, eng = server
    ids = list(range(200, 240))
    list(eng.Generate(_req(ids, max_tokens=1, temperature=0.0), metadata=A, timeout=30))
    assert wait_no_live_caches(srv) == {"tiny": 0}
    e = _code(lambda: eng.FlushCache(cpb.FlushCacheRequest(timeout_s=0), metadata=B))
    assert e.code() == C.PERMISSION_DENIED and "admin" in e.details(), e
    c = list(eng.Generate(_req(ids, max_tokens=1, temperature=0.0), metadata=A, timeout=30))[0].complete
    assert c.cached_tokens >= 16  # bob flushed nothing
    for bad in (1e9, -1.0, float("nan")):
        e = _code(lambda: eng.FlushCache(cpb.FlushCacheRequest(timeout_s=bad), metadata=ADM))
        assert e.code() == C.INVALID_ARGUMENT and "timeout_s" in e.details() and "60" in e.details(), e
    assert wait_no_live_caches(srv) == {"tiny": 0}
    assert eng.FlushCache(cpb.FlushCacheRequest(timeout_s=1), metadata=ADM).success


def test_flush_cache_refusal_names_no_server_wide_count(server):
    """While another caller's stream holds a cache the admin's flush says so without the count of
    live caches (which told any caller how busy the server is); concurrent waits share one look."""
    srv, eng = server
    it = eng.Generate(_req(rid="busy", stream=True, max_tokens=900, ignore_eos=True), metadata=A, timeout=120)
    next(it)
    try:
        results = []
        threads = [threading.Thread(target=lambda: results.append(
            eng.FlushCache(cpb.FlushCacheRequest(timeout_s=0.5), metadata=ADM, timeout=10))) for _ in range(8)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert time.perf_counter() - t0 < 5.0
        assert len(results) == 8 and all(not r.success for r in results)
        assert all("live" in r.message and not any(ch.isdigit() for ch in r.message) for r in results), results[0]
        assert srv.run(_flush_tasks(srv)) <= 1
    finally:
        it.cancel()
    assert wait_no_live_caches(srv) == {"tiny": 0}


async def _flush_tasks(srv) -> int:
    """The flush waits' look-up loops still running (one at most, and none once nobody waits)."""
    t = srv.server.vllm._flush_wait
    return 0 if t is None or t.done() else 1


# ---- M2: vLLM subscriptions under the contract's subscriber caps ----------------------------------
def test_vllm_subscriptions_are_capped_in_all_and_per_caller(server):
    """--max-kv-event-subscribers 4, per caller 3: bob's 4th vLLM subscription is
    RESOURCE_EXHAUSTED (per caller), alice's 2nd (the 5th in all) too; before, any number opened."""
    _srv, eng = server
    opened = []
    try:
        for _ in range(3):
            s = eng.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(start_sequence_number=0), metadata=B, timeout=60)
            s.initial_metadata()  # the server took it
            opened.append(s)
        e = _code(lambda: next(eng.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), metadata=B, timeout=10)))
        assert e.code() == C.RESOURCE_EXHAUSTED and "per caller is 3" in e.details(), e
        s = eng.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), metadata=A, timeout=60)
        s.initial_metadata()
        opened.append(s)
        e = _code(lambda: next(eng.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), metadata=A, timeout=10)))
        assert e.code() == C.RESOURCE_EXHAUSTED and "limit is 4" in e.details(), e
    finally:
        for s in opened:
            s.cancel()
    # the places are given back when the streams end
    assert wait_until(lambda: _opens(eng), timeout=10)


def _opens(eng) -> bool:
    """Whether a new subscription of bob's is taken (a refused one has ended)."""
    s = eng.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), metadata=B, timeout=10)
    try:
        s.initial_metadata()
        time.sleep(0.1)
        return not s.done()
    finally:
        s.cancel()


def test_vllm_events_carry_no_other_callers_tokens_and_slow_subscribers_hold_nobody(server):
    """Bob's subscription (and one that never reads) sees no token id of alice's prompt, and alice's
    RPCs are answered meanwhile."""
    srv, eng = server
    slow = eng.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), metadata=B, timeout=60)
    slow.initial_metadata()  # open, never read
    sub = eng.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(start_sequence_number=0), metadata=B, timeout=60)
    got: list = []

    def read():
        try:
            for b in sub:
                got.append(b)
        except grpc.RpcError:
            pass

    t = threading.Thread(target=read, daemon=True)
    t.start()
    try:
        secret = list(range(300, 348))
        for k in range(6):
            list(eng.Generate(_req([300 + k] + secret[1:], max_tokens=2, temperature=0.0), metadata=A, timeout=30))
        assert max(_loads_ms(eng) for _ in range(5)) < 1000
        time.sleep(0.5)
    finally:
        sub.cancel()
        slow.cancel()
        t.join(5)
    leaked = [blk for b in got for ev in b.events if ev.WhichOneof("data") == "stored"
              for blk in ev.stored.blocks if set(blk.token_ids) & set(secret)]
    assert not leaked


# ---- Generate and Abort: another caller's ids, floods, slow readers ------------------------------
def test_another_callers_request_id_is_not_abortable(server):
    srv, eng = server
    it = eng.Generate(_req(rid="shared-id", stream=True, max_tokens=60, ignore_eos=True), metadata=A, timeout=60)
    next(it)
    eng.Abort(vpb.AbortRequest(request_ids=["shared-id"] * 100), metadata=B)
    rest = list(it)
    assert rest[-1].complete.finish_reason == "length"
    assert wait_no_live_caches(srv) == {"tiny": 0}


def test_a_flood_of_unread_streams_does_not_hold_up_another_caller(server):
    """Bob opens 12 streaming Generates and reads none of them; alice's Loads stay under a second and
    her own Generate completes; once bob goes away nothing is left."""
    srv, eng = server
    bobs = [eng.Generate(_req(rid=f"b{k}", stream=True, max_tokens=150, ignore_eos=True), metadata=B, timeout=120)
            for k in range(12)]
    try:
        for s in bobs:
            s.initial_metadata()
        worst = max(_loads_ms(eng) for _ in range(5))
        assert worst < 1000, worst
        c = list(eng.Generate(_req(rid="alice", max_tokens=4, ignore_eos=True), metadata=A, timeout=60))[0].complete
        assert c.completion_tokens == 4
    finally:
        for s in bobs:
            s.cancel()
    assert wait_no_live_caches(srv, timeout=30) == {"tiny": 0}


def test_oversized_fields_are_refused_before_work(server):
    """A message over --max-message-bytes is refused by the transport (RESOURCE_EXHAUSTED), a prompt
    over the context or ids outside the vocabulary INVALID_ARGUMENT naming the field; nothing is
    left and another caller is answered meanwhile."""
    srv, eng = server
    e = _code(lambda: list(eng.Generate(vpb.GenerateRequest(request_id="big", text="x" * (MAX_MESSAGE + 1),
                                                            sampling_params=vpb.SamplingParams(max_tokens=1)),
                                        metadata=B, timeout=10)))
    assert e.code() == C.RESOURCE_EXHAUSTED
    e = _code(lambda: list(eng.Generate(_req([5] * 5000, max_tokens=1), metadata=B, timeout=10)))
    assert e.code() == C.INVALID_ARGUMENT
    e = _code(lambda: list(eng.Generate(_req([5, 10 ** 6], max_tokens=1), metadata=B, timeout=10)))
    assert e.code() == C.INVALID_ARGUMENT and "input_ids" in e.details()
    e = _code(lambda: eng.Embed(vpb.EmbedRequest(request_id="e", tokenized=vpb.TokenizedInput(input_ids=[5] * 50)),
                                metadata=B))
    assert e.code() == C.INVALID_ARGUMENT  # a generation model does not embed
    assert _loads_ms(eng) < 1000
    assert wait_no_live_caches(srv) == {"tiny": 0}


# ---- L9: a non-streamed answer's size is checked before any work --------------------------------
def test_a_non_streamed_answer_over_the_message_limit_is_refused_first(server):
    """1,000 tokens with 64 log-probabilities each are ~600 KB in one message, over this server's
    512 KiB: INVALID_ARGUMENT naming the limit at once (before, every token was computed and the
    send then failed); streamed, the same request runs."""
    srv, eng = server
    t0 = time.perf_counter()
    ids = PROMPT[:8]
    e = _code(lambda: list(eng.Generate(_req(ids, max_tokens=1000, logprobs=64, ignore_eos=True), metadata=B,
                                        timeout=120)))
    took = time.perf_counter() - t0
    assert e.code() == C.INVALID_ARGUMENT and "max_tokens" in e.details() and str(MAX_MESSAGE) in e.details(), e
    assert took < 2.0, took
    s = eng.Generate(_req(ids, stream=True, max_tokens=1000, logprobs=64, ignore_eos=True), metadata=B, timeout=120)
    assert next(s).WhichOneof("response") == "chunk"
    s.cancel()
    small = list(eng.Generate(_req(max_tokens=4, logprobs=64, ignore_eos=True), metadata=B, timeout=60))
    assert small[0].complete.completion_tokens == 4
    assert wait_no_live_caches(srv) == {"tiny": 0}


# ---- L8 + slow readers: GetTokenizer ----------------------------------------------------------------
def test_tokenizer_digest_is_computed_once_and_a_slow_reader_holds_nobody(server, monkeypatch):
    import hashlib as real_hashlib

    from ferrum_service.wire import tokenizer_cache

    calls = []

    class Counting:
        """hashlib as tokenizer_cache (which builds the bundle) sees it, counting sha256 calls."""

        def __getattr__(self, name):
            return getattr(real_hashlib, name)

        @staticmethod
        def sha256(data=b""):
            calls.append(len(data))
            return real_hashlib.sha256(data)

    monkeypatch.setattr(tokenizer_cache, "hashlib", Counting())
    srv, eng = server
    slow = eng.GetTokenizer(cpb.GetTokenizerRequest(), metadata=B, timeout=60)
    slow.initial_metadata()  # never read
    digests = set()
    for _ in range(5):
        chunks = list(eng.GetTokenizer(cpb.GetTokenizerRequest(), metadata=A, timeout=30))
        data = b"".join(c.data for c in chunks)
        assert real_hashlib.sha256(data).hexdigest() == chunks[-1].sha256
        digests.add(chunks[-1].sha256)
    slow.cancel()
    assert len(digests) == 1
    assert len(calls) <= 1, f"the zip was hashed {len(calls)} times for 6 calls"
