"""Live migration with a pre-copy (migration.py): B stages the stream's KV while A keeps decoding,
and the pause moves only the tail.

A moved stream still gives exactly the tokens of an unmoved run (greedy, seeded sampling with a
repetition penalty, a regex constraint) and B computes no prompt token; ``StreamMigration`` says
how many tokens were pre-copied and how few were pulled during the pause. A pre-copy that no move
finishes (the stream ended first, B refused, the finish failed, nobody came back for it) leaves no
cache and no staged KV on B. Two real servers on loopback ports (in-process, so A's steps can be
slowed to place the move; one test runs two ``serve`` processes with the default threshold)."""

from __future__ import annotations

import asyncio
import collections
import shutil
import threading
import time

import grpc
import pytest

from ferrum_client import Client, FerrumRpcError, messages as m, pb
from ferrum_client._proto.ferrum.executor.v1 import executor_pb2_grpc
from ferrum_service.hosting.kv_peers import CALLER_HEADER

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.faults import break_export
from .support.servers import InProcessServer, ServerProcess
from .test_migration import PEER, M, _executor, _fast, _prompt, _slow

SAMPLINGS = {"greedy": {}, "seeded": {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 1234,
                                      "repetition_penalty": 1.3},
             "constrained": {"temperature": 1.0, "seed": 77, "constraint": m.constraint(regex="([a-z][0-9])+"),
                             "stream_text": True}}


@pytest.fixture
def pair(tiny_llama_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama_dir, copy)
    with InProcessServer([_executor(tiny_llama_dir)], **PEER) as a, InProcessServer([_executor(copy)], **PEER) as b:
        a.server.servicer.migrations.precopy_tokens = 16  # the tiny prompts here are pre-copied too
        yield a, b


def _bytes_per_token(srv) -> int:
    lay = srv.models.get(M).executor.kv_layout()
    return lay.num_layers * lay.num_kv_heads * (lay.head_dim + lay.v_head_dim) * lay.element_size


def _nothing_on(b, timeout: float = 10.0) -> None:
    """B holds no cache, no pre-copy and no staged KV (waited for: an abandon is asynchronous)."""
    reg = b.models.get(M).executor.registry
    until = time.monotonic() + timeout
    while time.monotonic() < until and (b.server.servicer.migrations.precopies or reg.staged_tokens):
        time.sleep(0.02)
    assert not b.server.servicer.migrations.precopies
    assert reg.staged_tokens == 0 and reg.staged_imports == 0
    assert b.live_caches() == {M: 0}
    with Client(b.target) as cb:
        load = cb.loads().loads[0]
        assert load.active_caches == 0 and load.reserved_tokens == 0
        assert load.free_blocks == load.total_blocks  # every block free (or evictable prefix blocks)


def _hold_after_move_until(srv, cond, gate: int, seconds: float = 0.02) -> None:
    """``srv``'s decode steps wait ``seconds`` each; a stream's step number ``gate`` waits until a
    move of it was asked for, and every later one until ``cond()`` (each at most 10 s): the move and
    its pre-copy land while the stream is at a known place, however loaded the machine is."""
    host = srv.models.get(M)
    real = host.__dict__.setdefault("_test_real_decode", host.batcher.decode)
    counts: collections.Counter = collections.Counter()

    async def decode(inp):
        await asyncio.sleep(seconds)
        counts[inp.cache_id] += 1
        st = next((s for s in srv.server.streams.generations.values() if s.cache_id == inp.cache_id), None)
        until = time.monotonic() + 10
        if counts[inp.cache_id] == gate:
            while st is not None and st.move_result is None and time.monotonic() < until:
                await asyncio.sleep(0.005)
        elif counts[inp.cache_id] > gate:
            while not cond() and time.monotonic() < until:
                await asyncio.sleep(0.005)
        return await real(inp)

    host.batcher.decode = decode


def _count_stagings(srv) -> list[int]:
    """The token counts of the pre-copies ``srv`` stages from now on."""
    kv = srv.server.servicer.kv
    real, out = kv.stage_pull, []

    async def counted(host, src, reserve, salt):
        st = await real(host, src, reserve, salt)
        out.append(len(st.tokens))
        return st

    kv.stage_pull = counted
    return out


def _stream(client: Client, prompt, *, move=None, at: int, **kw):
    """Tokens, indices, the final event, ``move()``'s result (run on a thread after ``at`` tokens)."""
    stream = client.generate(M, token_ids=prompt, ignore_eos=True, request_id="mv", **kw)
    toks, idx, fin, out, th = [], [], None, [], None
    for ev in stream:
        kind = ev.WhichOneof("event")
        if kind == "token":
            toks.append(ev.token.token_id)
            idx.append(ev.token.index)
            if move is not None and len(toks) == at:
                th = threading.Thread(target=lambda: out.append(move()))
                th.start()
        elif kind == "finished":
            fin = ev.finished
    if th is not None:
        th.join(60)
    return toks, idx, fin, (out[0] if out else None), stream


@pytest.mark.parametrize("mode", list(SAMPLINGS))
def test_precopied_move_equals_unmoved_and_pauses_on_the_tail(pair, mode):
    a, b = pair
    prompt = _prompt(120, seed=31)
    kw = dict(SAMPLINGS[mode], max_tokens=64)
    with Client(a.target) as ca, Client(b.target) as cb:
        ref, _, ref_fin, _, _ = _stream(ca, prompt, at=0, **kw)
        staged = _count_stagings(b)
        _hold_after_move_until(a, lambda: bool(staged), gate=12)
        toks, idx, fin, res, stream = _stream(ca, prompt, move=lambda: ca.migrate_streams(b.target, request_id="mv"),
                                              at=12, **kw)
        _fast(a)
        assert res.migrated == 1 and stream.migrations == [b.target], res
        assert toks == ref and idx == list(range(64))  # no duplicate, no gap
        assert fin.finish_reason == ref_fin.finish_reason and fin.generated_tokens == 64 and fin.prompt_tokens == 120
        if mode == "constrained":
            assert fin.text == ref_fin.text
        st = cb.status(M).metrics
        assert st.prefill_operations == 0  # B computed no prompt token
        sent_by_a = 64 - st.decode_operations
        r = res.streams[0]
        # the pre-copy held the full blocks of the cache when the move was asked (prompt + 12 tokens);
        # the pause pulled the rest of A's cache: that partial block and the 1-3 tokens decoded meanwhile
        assert r.precopied_tokens == (120 + 13 - 1) // 16 * 16
        assert r.precopied_tokens + r.paused_tokens == 120 + sent_by_a - 1
        assert 1 <= r.paused_tokens <= 16 + 3 and r.paused_tokens * 6 < r.precopied_tokens, r
        assert r.paused_bytes == r.paused_tokens * _bytes_per_token(a)
    assert a.live_caches() == {M: 0}
    _nothing_on(b)


def test_below_the_threshold_the_whole_cache_moves_at_the_pause(pair):
    """No pre-copy below ``precopy_tokens``; and B without its early first step (the resume
    feeds the last token itself): the same tokens either way."""
    a, b = pair
    a.server.servicer.migrations.precopy_tokens = 1000
    b.server.servicer.migrations.first_step = False
    prompt = _prompt(24, seed=32)
    with Client(a.target) as ca:
        ref = ca.generate(M, token_ids=prompt, max_tokens=40, ignore_eos=True).tokens()
        _slow(a, gate=8)
        toks, _, _, res, _ = _stream(ca, prompt, move=lambda: ca.migrate_streams(b.target), at=8, max_tokens=40)
        _fast(a)
        assert toks == ref and res.migrated == 1
        r = res.streams[0]
        assert r.precopied_tokens == 0 and r.paused_tokens == 24 + 9 - 1  # A sent tokens 0..8 (its 8th step waited)
        assert r.paused_bytes == r.paused_tokens * _bytes_per_token(a)
    _nothing_on(b)


def test_precopy_abandoned_when_the_stream_ends_first(pair):
    """The stream reaches max_tokens while (or right after) B stages its pre-copy: the move is
    answered FAILED_PRECONDITION, the tokens are whole, and B drops the staged KV (A abandons it)."""
    a, b = pair
    prompt = _prompt(40, seed=33)
    with Client(a.target) as ca:
        ref = ca.generate(M, token_ids=prompt, max_tokens=10, ignore_eos=True).tokens()
        staged = _count_stagings(b)
        _hold_after_move_until(a, lambda: bool(staged), gate=8)
        toks, idx, fin, res, stream = _stream(ca, prompt, move=lambda: ca.migrate_streams(b.target), at=8,
                                              max_tokens=10)
        _fast(a)
        assert toks == ref and idx == list(range(10)) and not stream.migrations
        assert res.migrated == 0 and res.streams[0].error_code == "FAILED_PRECONDITION", res
        assert staged == [40 + 9 - 1]  # B did stage the cache as it was when the move was asked
    assert a.live_caches() == {M: 0}
    _nothing_on(b)


def test_precopy_refused_keeps_the_stream_on_a(tiny_llama_dir):
    """B has no room for the stream's reservation: the pre-copy is RESOURCE_EXHAUSTED and the
    stream finishes on A, whole; B stages nothing."""
    with InProcessServer([_executor(tiny_llama_dir)], **PEER) as a, \
            InProcessServer([_executor(tiny_llama_dir, budget_blocks=6)], **PEER) as b, \
            Client(a.target) as ca, Client(b.target) as cb:
        a.server.servicer.migrations.precopy_tokens = 16
        full = cb.prefill(M, _prompt(60, seed=11)).output.cache.cache_id
        prompt = _prompt(24, seed=34)
        ref = ca.generate(M, token_ids=prompt, max_tokens=40, ignore_eos=True).tokens()
        _slow(a, 0.01, gate=8)
        toks, _, _, res, stream = _stream(ca, prompt, move=lambda: ca.migrate_streams(b.target), at=8, max_tokens=40)
        _fast(a)
        assert toks == ref and not stream.migrations
        assert res.migrated == 0 and res.streams[0].error_code == "RESOURCE_EXHAUSTED", res
        assert b.live_caches() == {M: 1} and not b.server.servicer.migrations.precopies
        assert b.models.get(M).executor.registry.staged_tokens == 0
        cb.release_cache(M, full)
        assert a.live_caches() == {M: 0}


def test_failed_finish_drops_the_precopy(pair):
    """A's export of the tail breaks off (as when A goes down during the pause): the move is
    refused, the stream finishes on A, whole, and B drops the pre-copy it staged."""
    a, b = pair
    break_export(a.server, lambda req: req.from_token > 0)  # the tail's pull
    prompt = _prompt(40, seed=35)
    with Client(a.target) as ca:
        ref = ca.generate(M, token_ids=prompt, max_tokens=40, ignore_eos=True).tokens()
        staged = _count_stagings(b)
        _hold_after_move_until(a, lambda: bool(staged), gate=8)
        toks, _, _, res, stream = _stream(ca, prompt, move=lambda: ca.migrate_streams(b.target), at=8, max_tokens=40)
        _fast(a)
        assert toks == ref and not stream.migrations
        assert res.migrated == 0 and res.streams[0].error_code == "UNAVAILABLE", res
        assert len(staged) == 1
    assert a.live_caches() == {M: 0}
    _nothing_on(b, timeout=0.5)  # dropped before the refusal was answered


def test_precopy_pull_breaking_off_leaves_nothing_on_b(pair):
    """A's export dies in the middle of the pre-copy (as when A goes down then): B keeps nothing
    and the stream, still alive at A, finishes there, whole."""
    a, b = pair
    break_export(a.server, lambda req: req.to_token > 0)  # the pre-copy's range
    prompt = _prompt(40, seed=38)
    with Client(a.target) as ca:
        ref = ca.generate(M, token_ids=prompt, max_tokens=40, ignore_eos=True).tokens()
        _slow(a, 0.01, gate=8)
        toks, _, _, res, stream = _stream(ca, prompt, move=lambda: ca.migrate_streams(b.target), at=8, max_tokens=40)
        _fast(a)
        assert toks == ref and not stream.migrations
        assert res.migrated == 0 and res.streams[0].error_code == "UNAVAILABLE", res
    assert a.live_caches() == {M: 0}
    _nothing_on(b, timeout=0.5)


def test_move_called_off_during_its_precopy(pair):
    """``MigrateStreams`` gives up (DEADLINE_EXCEEDED) while B still pulls the pre-copy: the stream
    goes on at A, whole, and the pre-copy B then finishes is abandoned."""
    a, b = pair
    kv = b.server.servicer.kv
    real = kv.stage_pull
    staged = []

    async def slow(host, src, reserve, salt):
        await asyncio.sleep(0.6)
        st = await real(host, src, reserve, salt)
        staged.append(len(st.tokens))
        return st

    kv.stage_pull = slow
    prompt = _prompt(40, seed=39)
    with Client(a.target) as ca:
        ref = ca.generate(M, token_ids=prompt, max_tokens=80, ignore_eos=True).tokens()
        _slow(a, 0.02, gate=8)
        migrations = a.server.servicer.migrations
        toks, _, _, res, stream = _stream(
            ca, prompt, move=lambda: a.run(migrations.migrate(b.target, wait_s=0.2)), at=8, max_tokens=80)
        _fast(a)
        assert toks == ref and not stream.migrations
        assert [r.error_code for r in res] == ["DEADLINE_EXCEEDED"] and staged == [48]
    assert a.live_caches() == {M: 0}
    _nothing_on(b)


def _peer_stub(srv, caller: str = "", token: str = "tok-peer"):
    ch = grpc.insecure_channel(srv.target)
    md = (("authorization", f"Bearer {token}"),) + (((CALLER_HEADER, caller),) if caller else ())
    stub = executor_pb2_grpc.ModelExecutorStub(ch)
    return ch, lambda req: stub.AcceptMigration(req, metadata=md, timeout=30)


def test_precopy_hostile_calls_deadline_and_abandon(pair):
    """AcceptMigration's pre-copy forms called directly (as a peer): range checks, another caller's
    or source's id is NOT_FOUND (and not used up), an abandon drops it, a wrong from_token uses it
    up, nothing is a live cache while staged, and an unfinished pre-copy is dropped at its deadline."""
    a, b = pair
    mig = b.server.servicer.migrations
    reg = b.models.get(M).executor.registry
    with Client(a.target) as ca:
        prompt = _prompt(40, seed=36)
        cache = ca.prefill(M, prompt, reserve_tokens=80).output.cache.cache_id  # the "stream's" cache on A

        def req(**kw) -> pb.AcceptMigrationRequest:
            r = pb.AcceptMigrationRequest(model_id=M, generated_token_ids=[5], prompt_tokens=40,
                                          source=pb.KvSource(target=a.target, cache_id=cache, to_token=40),
                                          request=pb.GenerateRequest(stop=pb.StopConditions(max_tokens=40,
                                                                                            ignore_eos=True)),
                                          precopy=True)
            for k, v in kw.items():
                setattr(r, k, v) if not isinstance(v, pb.KvSource) else r.source.CopyFrom(v)
            return r

        ch, call = _peer_stub(b)
        ch2, other = _peer_stub(b, caller="mallory")
        ch3, wrong = _peer_stub(b, token="not-a-peer-token")
        try:
            def code(fn, r) -> str:
                with pytest.raises(grpc.RpcError) as e:
                    fn(r)
                return e.value.code().name

            assert code(wrong, req()) == "PERMISSION_DENIED"
            too_far = pb.KvSource(target=a.target, cache_id=cache, to_token=41)
            assert code(call, req(source=too_far)) == "INVALID_ARGUMENT"
            assert code(call, req(source=pb.KvSource(target=a.target, cache_id=cache, from_token=1,
                                                     to_token=40))) == "INVALID_ARGUMENT"
            assert code(call, req(source=pb.KvSource(target=a.target, cache_id="nope", to_token=40))) == "NOT_FOUND"
            assert code(call, req(precopy_id="x")) == "INVALID_ARGUMENT"
            assert not mig.precopies and reg.staged_tokens == 0

            resp = call(req())
            assert resp.precopy_id and resp.imported_tokens == 40 and not resp.resume_token
            assert resp.imported_bytes == 40 * _bytes_per_token(b)
            assert reg.staged_tokens == 80 and b.live_caches() == {M: 0}  # held, reserved, but no cache
            fin = req(precopy=False, precopy_id=resp.precopy_id,
                      source=pb.KvSource(target=a.target, cache_id=cache, from_token=40))
            # another caller, another source cache, a made-up id: NOT_FOUND, and the pre-copy is still there
            assert code(other, fin) == "NOT_FOUND"
            bad = pb.AcceptMigrationRequest()
            bad.CopyFrom(fin)
            bad.source.cache_id = "other"
            assert code(call, bad) == "NOT_FOUND"
            bad.CopyFrom(fin)
            bad.precopy_id = "x" * 32
            assert code(call, bad) == "NOT_FOUND"
            assert code(other, req(precopy=False, precopy_id=resp.precopy_id, abandon=True)) == "NOT_FOUND"
            assert len(mig.precopies) == 1
            # a finish with a wrong from_token is refused and uses the pre-copy up
            bad.CopyFrom(fin)
            bad.source.from_token = 39
            assert code(call, bad) == "INVALID_ARGUMENT"
            assert not mig.precopies and reg.staged_tokens == 0
            assert code(call, fin) == "NOT_FOUND"

            # abandon drops it at once
            resp = call(req())
            call(req(precopy=False, precopy_id=resp.precopy_id, abandon=True))
            assert not mig.precopies and reg.staged_tokens == 0
            # the bound on staged pre-copies
            mig.max_precopies = 1
            resp = call(req())
            assert code(call, req()) == "RESOURCE_EXHAUSTED"
            call(req(precopy=False, precopy_id=resp.precopy_id, abandon=True))
            # a finish: the tail after a pre-copy of the first 30 tokens, then a resumable stream
            mig.max_precopies = 64
            resp = call(req(source=pb.KvSource(target=a.target, cache_id=cache, to_token=30)))
            done = call(req(precopy=False, precopy_id=resp.precopy_id,
                            source=pb.KvSource(target=a.target, cache_id=cache, from_token=30)))
            assert done.resume_token and done.imported_tokens == 10
            assert done.imported_bytes == 10 * _bytes_per_token(b)
            assert b.live_caches() == {M: 1} and reg.staged_tokens == 0 and not mig.precopies
            with Client(b.target) as cb:
                assert len(cb.generate(M, resume_token=done.resume_token).tokens()) == 39
            # B starts draining between a pre-copy and its finish: the finish is refused, the pre-copy dropped
            resp = call(req())
            mig.serving.migrating = True
            assert code(call, req(precopy=False, precopy_id=resp.precopy_id,
                                  source=pb.KvSource(target=a.target, cache_id=cache, from_token=40))) == "UNAVAILABLE"
            assert not mig.precopies and reg.staged_tokens == 0
            mig.serving.migrating = False
            # nobody finishes it: dropped at the deadline
            mig.resume_s = 0.5
            call(req())
            assert reg.staged_tokens == 80
            time.sleep(1.0)
            assert not mig.precopies and reg.staged_tokens == 0
        finally:
            for c in (ch, ch2, ch3):
                c.close()
        ca.release_cache(M, cache)
    assert a.live_caches() == {M: 0}
    _nothing_on(b)


def test_precopied_move_between_two_processes(tiny_llama_dir, tmp_path):
    """Two ``serve`` processes with the default pre-copy threshold (256 cached tokens): a greedy and
    a seeded 300-token-prompt stream moved at token 16 give the tokens of unmoved runs; most of the
    KV went ahead of the pause; B ran no prefill and holds nothing after."""
    tok = tmp_path / "peer-token"
    tok.write_text("tok-peer\n")
    spec = f"hf-causal-lm,id={M},path={tiny_llama_dir},device=cpu"
    common = ("--model", spec, "--kv-budget-tokens", "8192", "--kv-peer", "127.0.0.1:1024-65535",
              "--kv-peer-token-file", str(tok), "--open-admin-rpcs")
    with ServerProcess(*common) as pb_, ServerProcess(*common) as pa, Client(pa.target) as ca, \
            Client(pb_.target) as cb:
        prompt = _prompt(300, seed=37)
        for kw in ({}, {"temperature": 0.8, "seed": 5, "repetition_penalty": 1.2}):
            ref = cb.generate(M, token_ids=prompt, max_tokens=200, ignore_eos=True, **kw).tokens()
            before = cb.status(M).metrics
            toks, idx, fin, res, stream = _stream(
                ca, prompt, move=lambda: ca.migrate_streams(pb_.target, request_id="mv"), at=16, max_tokens=200, **kw)
            assert res.migrated == 1 and stream.migrations == [pb_.target], res
            assert toks == ref and idx == list(range(200))
            after = cb.status(M).metrics
            assert after.prefill_operations == before.prefill_operations  # B computed no prompt token
            r = res.streams[0]
            assert r.precopied_tokens >= (300 + 16 - 1) // 16 * 16 and r.precopied_tokens % 16 == 0
            assert 1 <= r.paused_tokens and r.paused_tokens * 4 < r.precopied_tokens, r
        assert not ca.list_caches().caches and not cb.list_caches().caches
        load = cb.loads().loads[0]
        assert load.active_caches == 0 and load.reserved_tokens == 0 and load.free_blocks == load.total_blocks
