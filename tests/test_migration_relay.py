"""Transparent migration (``MIGRATION_MODE_RELAY``, every ``VllmEngine.Generate`` stream): the
moving server A resumes the stream on B itself and relays B's events on the caller's own stream.

Two real servers on loopback ports, the tiny random-weight llama (as ``test_migration.py``). A
stream moved mid-decode in relay mode gives the caller exactly the events of an unmoved run (tokens,
indices, finish reason, usage, text), with no ``migrated`` event; a vLLM stream likewise (chunks and
Complete), also when moved by a drain; cancelling the caller's stream or aborting its request id on
A during the relay ends the stream on B and frees both caches; the relay's trust and cap hold."""

from __future__ import annotations

import shutil
import statistics
import threading
import time

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from ferrum_client import Client, FerrumRpcError, pb

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.servers import InProcessServer
from .test_migration import M, PEER, SAMPLINGS, _executor, _fast, _prompt, _run, _slow

RELAY = {"migration_mode": "relay"}
VLLM_SAMPLINGS = {"greedy": {"temperature": 0.0},
                  "seeded": {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 1234, "repetition_penalty": 1.3}}


@pytest.fixture
def pair(tiny_llama_dir, tmp_path):  # noqa: F811
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama_dir, copy)
    with InProcessServer([_executor(tiny_llama_dir)], **PEER) as a, InProcessServer([_executor(copy)], **PEER) as b:
        yield a, b


def wait_for(pred, timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _no_caches(*servers) -> None:
    for s in servers:
        wait_for(lambda s=s: s.live_caches() == {M: 0}, timeout=20, what=f"no live cache on {s.target}")


@pytest.mark.parametrize("mode", list(SAMPLINGS))
def test_relayed_stream_equals_unmoved(pair, mode):
    """The caller's stream never ends: no ``migrated`` event (``_run`` accepts only started, token
    and finished), the same tokens, indices 0..63, finish reason, usage and text as an unmoved run."""
    a, b = pair
    prompt = _prompt(24)
    kw = dict(SAMPLINGS[mode], stream_text=True)
    with Client(a.target) as ca, Client(b.target) as cb:
        ref, _, ref_fin, _, ref_stream = _run(ca, prompt, **kw)
        _slow(a, gate=15)
        toks, idx, fin, res, stream = _run(ca, prompt, move=lambda: ca.migrate_streams(b.target, request_id="mv"),
                                           at=15, follow_migrations=False, **RELAY, **kw)
        assert res.migrated == 1 and res.refused == 0, res
        assert stream.migrations == []
        assert toks == ref and idx == list(range(64))
        assert fin.generated_tokens == ref_fin.generated_tokens == 64 and fin.prompt_tokens == 24
        assert fin.finish_reason == ref_fin.finish_reason == pb.FINISH_REASON_LENGTH
        assert fin.text == ref_fin.text and stream.text == ref_stream.text
        assert not fin.HasField("cache") and fin.time_to_first_token_ns > 0 and fin.total_ns > fin.time_to_first_token_ns
        st = cb.status(M).metrics
        assert st.prefill_operations == 0 and 64 - st.decode_operations == 16  # B decoded tokens 16..63
    _no_caches(a, b)
    assert a.server.migrations.relays.running == 0


def test_follow_mode_is_still_the_default(pair):
    """A native stream that asks for nothing ends with ``GenerateMigrated`` (followed by the client)."""
    a, b = pair
    prompt = _prompt(12, seed=3)
    with Client(a.target) as ca:
        ref, *_ = _run(ca, prompt, max_tokens=40)
        _slow(a, gate=10)
        toks, idx, fin, res, stream = _run(ca, prompt, move=lambda: ca.migrate_streams(b.target), at=10, max_tokens=40)
        assert res.migrated == 1 and stream.migrations == [b.target]
        assert toks == ref and idx == list(range(40))
    _no_caches(a, b)


def test_unknown_migration_mode_is_refused(pair):
    """A ``migration_mode`` the contract does not define is INVALID_ARGUMENT naming the field, not
    quietly read as follow mode."""
    a, _ = pair
    with Client(a.target) as ca:
        with pytest.raises(FerrumRpcError) as e:
            list(ca.generate(M, token_ids=_prompt(8), max_tokens=4, migration_mode=7))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "migration_mode" in str(e.value), e.value
    _no_caches(a, _)


# ---- the vLLM protocol ----------------------------------------------------------------------------
def _vllm(target: str, prompt, *, move=None, at: int = 10, rid: str = "vr", stream: bool = True, **sp):
    """A ``VllmEngine.Generate`` stream's responses; ``move()`` runs on a thread once ``at`` chunks came."""
    sp.setdefault("max_tokens", 48)
    sp.setdefault("temperature", 0.0)
    req = vpb.GenerateRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=prompt), stream=stream,
                              sampling_params=vpb.SamplingParams(ignore_eos=True, **sp))
    out, moved, th = [], [], None
    with grpc.insecure_channel(target) as ch:
        for r in vllm_engine_pb2_grpc.VllmEngineStub(ch).Generate(req, timeout=120):
            out.append(r)
            if move is not None and r.WhichOneof("response") == "chunk" and len(out) == at:
                th = threading.Thread(target=lambda: moved.append(move()))
                th.start()
    if th is not None:
        th.join(60)
    return out, (moved[0] if moved else None)


def _ids(responses) -> list[int]:
    ids = []
    for r in responses:
        ids.extend(r.chunk.token_ids if r.WhichOneof("response") == "chunk" else ())
    return ids


def _complete(responses) -> vpb.GenerateComplete:
    last = responses[-1]
    assert last.WhichOneof("response") == "complete"
    return last.complete


@pytest.mark.parametrize("mode", list(SAMPLINGS))
def test_vllm_stream_moved_equals_unmoved(pair, mode):
    a, b = pair
    prompt = _prompt(20, seed=5)
    sp = VLLM_SAMPLINGS[mode]
    with Client(a.target) as ca, Client(b.target) as cb:
        ref, _ = _vllm(a.target, prompt, **sp)
        _slow(a, gate=10)
        out, res = _vllm(a.target, prompt, move=lambda: ca.migrate_streams(b.target, request_id="vr"), at=10, **sp)
        assert res.migrated == 1 and res.refused == 0, res
        assert _ids(out) == _ids(ref) and len(_ids(out)) == 48
        c, rc = _complete(out), _complete(ref)
        assert list(c.output_ids) == list(rc.output_ids) and c.finish_reason == rc.finish_reason == "length"
        assert (c.prompt_tokens, c.completion_tokens) == (rc.prompt_tokens, rc.completion_tokens)
        assert all(r.chunk.prompt_tokens == 20 for r in out if r.WhichOneof("response") == "chunk")
        assert cb.status(M).metrics.prefill_operations == 0
    _no_caches(a, b)


def test_vllm_unary_moved_equals_unmoved(pair):
    """A non-streaming vLLM request moved mid-way: one Complete with every token."""
    a, b = pair
    prompt = _prompt(16, seed=6)
    with Client(a.target) as ca:
        ref, _ = _vllm(a.target, prompt, stream=False)
        _slow(a, gate=8)
        moved = []

        def mover():
            wait_for(lambda: any(s.request_id == "vr" and s.cache_id for s in a.server.streams.generations.values()),
                     timeout=20, what="the stream runs")
            moved.append(ca.migrate_streams(b.target, request_id="vr"))

        th = threading.Thread(target=mover)
        th.start()
        out, _ = _vllm(a.target, prompt, stream=False)
        th.join(60)
        assert moved and moved[0].migrated == 1, moved
        assert list(_complete(out).output_ids) == list(_complete(ref).output_ids)
        assert _complete(out).completion_tokens == 48
    _no_caches(a, b)


def test_drain_moves_vllm_streams(pair):
    """``MigrateStreams{drain}`` moves the running vLLM streams (it used to refuse them): every
    client sees its whole answer, equal to an unmoved run; A then refuses new work."""
    a, b = pair
    prompts = [_prompt(18, seed=10 + i) for i in range(3)]
    with Client(a.target) as ca:
        refs = [_vllm(a.target, p, rid=f"d{i}")[0] for i, p in enumerate(prompts)]
        _slow(a, seconds=0.05)
        outs: dict[int, list] = {}
        ths = [threading.Thread(target=lambda i=i, p=p: outs.__setitem__(i, _vllm(a.target, p, rid=f"d{i}")[0]))
               for i, p in enumerate(prompts)]
        for t in ths:
            t.start()
        wait_for(lambda: sum(1 for s in a.server.streams.generations.values() if s.cache_id and not s.unmovable) == 3,
                 timeout=30, what="three movable streams on A")
        res = ca.migrate_streams(b.target, drain=True)
        for t in ths:
            t.join(120)
        assert res.migrated == 3 and res.refused == 0, res
        for i in range(3):
            assert _ids(outs[i]) == _ids(refs[i]) and list(_complete(outs[i]).output_ids) == list(
                _complete(refs[i]).output_ids)
        with pytest.raises(grpc.RpcError) as e:
            _vllm(a.target, prompts[0], rid="late")
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    _no_caches(a, b)


# ---- cancellation and abort -----------------------------------------------------------------------
def _relaying(a) -> None:
    wait_for(lambda: a.server.migrations.relays.running == 1, timeout=30, what="A relays the stream")


def test_caller_cancel_during_relay_frees_both(pair):
    a, b = pair
    _slow(b, seconds=0.05)  # B's steps are slow: the relay is under way when the caller cancels
    with Client(a.target) as ca:
        _slow(a, gate=5)
        stream = ca.generate(M, token_ids=_prompt(16), max_tokens=400, ignore_eos=True, request_id="c",
                             **RELAY)
        n = 0
        for ev in stream:
            if ev.WhichOneof("event") == "token":
                n += 1
                if n == 5:
                    threading.Thread(target=lambda: ca.migrate_streams(b.target, request_id="c")).start()
                if n == 12:
                    break
        _relaying(a)
        stream.cancel()
    _no_caches(a, b)
    wait_for(lambda: a.server.migrations.relays.running == 0 and not b.server.streams.generations, timeout=20,
             what="the relay and B's stream ended")


def test_vllm_abort_on_a_reaches_the_relayed_stream(pair):
    """vLLM ``Abort`` on A names a request id whose stream A relays: the relay cancels its call, B's
    stream ends and frees its cache, the client's stream ends at once (no further tokens)."""
    a, b = pair
    _slow(b, seconds=0.1)
    _slow(a, gate=5)
    box: dict = {}

    def run():
        try:
            box["out"] = _vllm(a.target, _prompt(16), rid="ab", max_tokens=400)[0]
        except grpc.RpcError as e:
            box["err"] = e

    th = threading.Thread(target=run)
    th.start()
    wait_for(lambda: any(s.request_id == "ab" and s.cache_id for s in a.server.streams.generations.values()),
             timeout=30, what="the stream runs")
    with Client(a.target) as ca, grpc.insecure_channel(a.target) as ch:
        res = ca.migrate_streams(b.target, request_id="ab")
        assert res.migrated == 1, res
        _relaying(a)
        t0 = time.monotonic()
        vllm_engine_pb2_grpc.VllmEngineStub(ch).Abort(vpb.AbortRequest(request_ids=["ab"]))
        th.join(30)
        assert time.monotonic() - t0 < 5
    if "err" in box:
        assert box["err"].code() == grpc.StatusCode.CANCELLED
    else:
        assert _complete(box["out"]).finish_reason == "abort"
    _no_caches(a, b)
    assert a.server.migrations.relays.running == 0


# ---- trust and limits -----------------------------------------------------------------------------
def test_peer_token_opens_generate_only_for_a_relay_resume(pair):
    a, b = pair
    peer = [("authorization", "Bearer tok-peer")]
    with Client(b.target) as cb:
        with pytest.raises(grpc.RpcError) as e:
            list(cb.stub.Generate(pb.GenerateRequest(model_id=M, token_ids=pb.TokenIds(token_ids=[1, 2, 3])),
                                  metadata=peer))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as e:
            list(cb.stub.Generate(pb.GenerateRequest(model_id=M, resume_token="x" * 32), metadata=peer))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_relay_parked_stream_is_not_the_callers_and_follow_parked_not_the_peers(pair):
    """A stream parked for a relay is NOT_FOUND to the caller's own resume (and keeps waiting for
    the peer's); one parked for a follower is NOT_FOUND to a peer's resume."""
    a, b = pair
    mig = b.server.migrations
    with Client(a.target) as ca, Client(b.target) as cb:
        for relay in (True, False):
            h = a.models.get(M)
            out = list(ca.generate(M, token_ids=_prompt(8), max_tokens=4, keep_cache=True, request_id="k"))
            fin = out[-1].finished
            req = pb.AcceptMigrationRequest(model_id=M, source=pb.KvSource(target=a.target, cache_id=fin.cache.cache_id,
                                                                           model_id=M),
                                            request=pb.GenerateRequest(model_id=M, stop=pb.StopConditions(max_tokens=16)),
                                            generated_token_ids=[e.token.token_id for e in out
                                                                 if e.WhichOneof("event") == "token"][:1],
                                            prompt_tokens=8, relay=relay)
            # A's cache holds the prompt and 4 tokens: trim it to prompt + (generated - 1) = 8 tokens
            a.run(h.call(h.executor.truncate_kv, fin.cache.cache_id, 8, admit=False))
            resp = cb.stub.AcceptMigration(req, metadata=[("authorization", "Bearer tok-peer")])
            assert resp.resume_token
            own = [] if relay else [("authorization", "Bearer tok-peer")]
            with pytest.raises(grpc.RpcError) as e:
                list(cb.stub.Generate(pb.GenerateRequest(model_id=M, resume_token=resp.resume_token), metadata=own))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            assert resp.resume_token in mig.parked  # not burnt
            async def expire(tok=resp.resume_token):
                mig._expire(tok)

            b.run(expire())
            ca.release_cache(M, fin.cache.cache_id)
    _no_caches(a, b)


def test_relays_past_the_cap_are_refused_and_the_stream_goes_on(pair):
    a, b = pair
    a.server.migrations.relays.limit = 0
    prompt = _prompt(14, seed=4)
    with Client(a.target) as ca:
        ref, *_ = _run(ca, prompt, max_tokens=40, **RELAY)
        _slow(a, gate=10)
        toks, idx, fin, res, stream = _run(ca, prompt, move=lambda: ca.migrate_streams(b.target), at=10,
                                           max_tokens=40, **RELAY)
        assert res.migrated == 0 and res.streams[0].error_code == "RESOURCE_EXHAUSTED", res
        assert toks == ref and idx == list(range(40)) and fin.generated_tokens == 40
    _no_caches(a, b)


def test_target_failure_reaches_the_caller(pair):
    """B fails the relayed stream (its decode step raises): the caller's stream ends with B's error
    code, and both caches are freed."""
    a, b = pair
    hb = b.models.get(M)
    real = hb.batcher.decode
    calls = {"n": 0}

    async def failing(inp):
        calls["n"] += 1
        if calls["n"] > 6:
            from ferrum_service.core import errors
            raise errors.FerrumError(errors.ErrorKind.INTERNAL, "boom", code=grpc.StatusCode.DATA_LOSS)
        return await real(inp)

    hb.batcher.decode = failing
    with Client(a.target) as ca:
        _slow(a, gate=6)
        with pytest.raises(FerrumRpcError) as e:
            _run(ca, _prompt(12), move=lambda: ca.migrate_streams(b.target), at=6, max_tokens=60, **RELAY)
        assert e.value.code == grpc.StatusCode.DATA_LOSS, e.value
    _fast(a)
    _no_caches(a, b)


# ---- the pause ------------------------------------------------------------------------------------
def test_relay_pause_with_a_1024_token_context(tiny_llama_dir, tmp_path):  # noqa: F811
    """Relayed moves of streams with a 1,000-token prompt (the tiny model's context is 1,024) are
    pre-copied: the bulk of the KV moves while A decodes, only the tail in the pause, and the
    stream stays whole. The caller-side pause is printed; its target (p50 < 100 ms) is a row of
    ``benchmarks/migration_rows.py`` (timings are not asserted in tests)."""
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama_dir, copy)
    pauses = []
    with InProcessServer([_executor(tiny_llama_dir, 128)], **PEER) as a, \
            InProcessServer([_executor(copy, 128)], **PEER) as b, Client(a.target) as ca:
        for i in range(7):
            prompt = _prompt(1000, seed=100 + i)
            _slow(a, seconds=0.01, gate=8)
            stream = ca.generate(M, token_ids=prompt, max_tokens=20, ignore_eos=True, request_id=f"p{i}",
                                 follow_migrations=False, **RELAY)
            times, th, moved = [], None, []
            for ev in stream:
                if ev.WhichOneof("event") == "token":
                    times.append(time.perf_counter())
                    if len(times) == 8:
                        th = threading.Thread(target=lambda i=i: moved.append(
                            ca.migrate_streams(b.target, request_id=f"p{i}")))
                        th.start()
                assert ev.WhichOneof("event") != "migrated"
            th.join(60)
            _fast(a)
            assert len(times) == 20 and moved[0].migrated == 1, moved
            st = moved[0].streams[0]
            assert st.precopied_tokens >= 512 and st.paused_tokens < st.precopied_tokens, st
            # tokens 0..8 on A (token 8 after the gated step), 9.. relayed from B
            pauses.append(times[9] - times[8])
        _no_caches(a, b)
    p50 = statistics.median(pauses)
    print(f"relay pause p50 {p50 * 1000:.1f} ms over {len(pauses)} moves: {[round(p * 1000, 1) for p in pauses]}")
