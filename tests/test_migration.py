"""Live migration of Generate streams (migration.py): MigrateStreams, AcceptMigration, resume tokens.

Two real servers on loopback ports, the tiny random-weight llama. A stream moved mid-decode gives
exactly the tokens of an unmoved run (greedy and seeded sampling with a repetition penalty); B
computes no prompt token; every refusal leaves the stream on A and nothing on B; resume tokens are
single use, bound to their caller, and expire. A's decode steps are slowed (a real sleep before each
real step) so the move lands mid-stream instead of after the tiny model has finished."""

from __future__ import annotations

import asyncio
import collections
import random
import re
import shutil
import threading
import time

import pytest

from ferrum_client import AsyncClient, Client, FerrumRpcError, messages as m, pb
from ferrum_service.executors.transformers import HfCausalLmExecutor
from ferrum_service.testing.tiny_models import build_tiny_llama

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.faults import break_export
from .support.servers import InProcessServer, ServerProcess

BS = 16
M = "tiny"
PEER = {"kv_peers": ["127.0.0.1:1024-65535"], "kv_peer_tokens": ["tok-peer"], "open_admin_rpcs": True}


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


def _executor(path, budget_blocks: int = 64) -> HfCausalLmExecutor:
    return HfCausalLmExecutor.from_path(path, model_id=M, device="cpu", kv_budget_tokens=budget_blocks * BS)


def _slow(srv: InProcessServer, seconds: float = 0.03, model: str = M, gate: int | None = None) -> None:
    """Each decode step of ``srv`` waits ``seconds`` first (then runs for real); with ``gate``, a
    stream's decode step number ``gate`` also waits until a move of that stream was asked for (at
    most 10 s), so the move lands at token ``gate`` + 1 however loaded the machine is."""
    host = srv.models.get(model)
    real = host.__dict__.setdefault("_test_real_decode", host.batcher.decode)
    counts: collections.Counter = collections.Counter()

    async def decode(inp):
        await asyncio.sleep(seconds)
        counts[inp.cache_id] += 1
        if gate is not None and counts[inp.cache_id] == gate:
            st = next((s for s in srv.server.streams.generations.values() if s.cache_id == inp.cache_id), None)
            until = time.monotonic() + 10
            while st is not None and st.move_result is None and not st.aborted and time.monotonic() < until:
                await asyncio.sleep(0.005)
        return await real(inp)

    host.batcher.decode = decode


def _fast(srv: InProcessServer, model: str = M) -> None:
    """Undo :func:`_slow`."""
    host = srv.models.get(model)
    host.batcher.decode = host.__dict__.pop("_test_real_decode", host.batcher.decode)


@pytest.fixture
def pair(tiny_llama_dir, tmp_path):
    copy = tmp_path / "copy"  # B loads its own copy: the fingerprint names the weights, not the path
    shutil.copytree(tiny_llama_dir, copy)
    with InProcessServer([_executor(tiny_llama_dir)], **PEER) as a, InProcessServer([_executor(copy)], **PEER) as b:
        yield a, b


def _run(client: Client, prompt, *, move=None, at: int = 16, model: str = M, **kw):
    """Tokens, text pieces and the final event of one stream; ``move(client)`` runs on a thread
    once ``at`` tokens arrived (its result is returned too)."""
    kw.setdefault("max_tokens", 64)
    stream = client.generate(model, token_ids=prompt, ignore_eos=True, request_id="mv", **kw)
    toks, idx, fin, moved, th = [], [], None, [], None
    for ev in stream:
        kind = ev.WhichOneof("event")
        if kind == "token":
            toks.append(ev.token.token_id)
            idx.append(ev.token.index)
            stream.text = getattr(stream, "text", "") + ev.token.text
            if move is not None and len(toks) == at:
                th = threading.Thread(target=lambda: moved.append(move()))
                th.start()
        elif kind == "finished":
            fin = ev.finished
        else:
            assert kind == "started"
    if th is not None:
        th.join(60)
    return toks, idx, fin, (moved[0] if moved else None), stream


SAMPLINGS = {"greedy": {}, "seeded": {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 1234,
                                      "repetition_penalty": 1.3}}


@pytest.mark.parametrize("mode", list(SAMPLINGS))
def test_moved_stream_equals_unmoved(pair, mode):
    a, b = pair
    prompt = _prompt(24)
    with Client(a.target) as ca, Client(b.target) as cb:
        ref, _, ref_fin, _, _ = _run(ca, prompt, **SAMPLINGS[mode])
        _slow(a, gate=15)  # A's 15th decode step (token 15) waits for the move: A sends tokens 0..15
        toks, idx, fin, res, stream = _run(ca, prompt, move=lambda: ca.migrate_streams(b.target, request_id="mv"),
                                           at=15, **SAMPLINGS[mode])
        assert res.migrated == 1 and res.refused == 0, res
        assert stream.migrations == [b.target]
        assert toks == ref and len(toks) == 64
        assert idx == list(range(64))  # no duplicate, no gap
        assert fin.generated_tokens == 64 and fin.prompt_tokens == 24
        assert fin.finish_reason == ref_fin.finish_reason == pb.FINISH_REASON_LENGTH
        st = cb.status(M).metrics
        assert st.prefill_operations == 0 and st.decode_operations > 0  # B computed no prompt token
        assert 64 - st.decode_operations == 16  # B decoded tokens 16..63: the stream moved at token 16
    assert a.live_caches() == {M: 0} and b.live_caches() == {M: 0}


def test_moved_constrained_stream_equals_unmoved(pair):
    """A regex-constrained, seeded, text-streaming stream: B's matcher replays the tokens from the
    constraint's start, so the masks (and the tokens, and the text pieces) are the same."""
    a, b = pair
    prompt = _prompt(10, seed=2)
    kw = dict(temperature=1.0, seed=77, constraint=m.constraint(regex="([a-z][0-9])+"), stream_text=True,
              max_tokens=40)
    with Client(a.target) as ca:
        ref, _, ref_fin, _, ref_stream = _run(ca, prompt, **kw)
        _slow(a, gate=12)
        toks, idx, fin, res, stream = _run(ca, prompt, move=lambda: ca.migrate_streams(b.target), at=12, **kw)
        assert res.migrated == 1 and stream.migrations == [b.target]
        assert toks == ref and idx == list(range(40))
        assert stream.text == ref_stream.text == fin.text == ref_fin.text
        assert re.fullmatch("([a-z][0-9])+", fin.text), fin.text
    assert a.live_caches() == {M: 0} and b.live_caches() == {M: 0}


def test_moved_stream_stops_on_a_stop_sequence_like_unmoved(pair):
    """A stop sequence that ends after the move (its text may span the tokens of both servers)
    stops the moved stream exactly where it stops an unmoved one."""
    a, b = pair
    prompt = _prompt(12, seed=21)
    with Client(a.target) as ca:
        pieces = [ev.token.text for ev in ca.generate(M, token_ids=prompt, max_tokens=64, ignore_eos=True,
                                                      stream_text=True) if ev.WhichOneof("event") == "token"]
        full = "".join(pieces)
        stop = next(x for x in ("".join(pieces[i:i + 2])[-4:] for i in range(24, 60))
                    if len(x) == 4 and full.find(x) >= len("".join(pieces[:22])))
        kw = dict(stream_text=True, stop_sequences=[stop])
        ref, _, ref_fin, _, _ = _run(ca, prompt, **kw)
        assert ref_fin.finish_reason == pb.FINISH_REASON_STOP and 22 < len(ref) < 64
        _slow(a, gate=12)
        toks, idx, fin, res, stream = _run(ca, prompt, move=lambda: ca.migrate_streams(b.target), at=12, **kw)
        assert res.migrated == 1 and stream.migrations == [b.target]
        assert toks == ref and fin.finish_reason == pb.FINISH_REASON_STOP and fin.text == ref_fin.text
    assert a.live_caches() == {M: 0} and b.live_caches() == {M: 0}


def test_async_client_follows(pair):
    a, b = pair
    prompt = _prompt(20, seed=3)
    with Client(a.target) as ca:
        ref = ca.generate(M, token_ids=prompt, max_tokens=48, ignore_eos=True).tokens()
    _slow(a, gate=10)

    async def go():
        async with AsyncClient(a.target) as c:
            toks, mover = [], None
            async for ev in c.generate(M, token_ids=prompt, max_tokens=48, ignore_eos=True, request_id="x"):
                if ev.WhichOneof("event") == "token":
                    toks.append(ev.token.token_id)
                    if len(toks) == 10:
                        mover = asyncio.ensure_future(c.migrate_streams(b.target, request_id="x"))
            return toks, await mover

    toks, res = asyncio.run(go())
    assert res.migrated == 1
    assert toks == ref
    assert a.live_caches() == {M: 0} and b.live_caches() == {M: 0}


def _refused(a, b_target, code: str) -> None:
    """A move to ``b_target`` is refused with ``code`` and the stream finishes on A, whole."""
    prompt = _prompt(16, seed=5)
    with Client(a.target) as ca:
        ref = ca.generate(M, token_ids=prompt, max_tokens=40, ignore_eos=True).tokens()
        _slow(a, 0.01, gate=8)
        stream = ca.generate(M, token_ids=prompt, max_tokens=40, ignore_eos=True, request_id="mv")
        toks, out = [], []
        for ev in stream:
            if ev.WhichOneof("event") == "token":
                toks.append(ev.token.token_id)
                if len(toks) == 8:
                    out.append(ca.migrate_streams(b_target, request_id="mv"))
        _fast(a)
        assert toks == ref and not stream.migrations
        assert out[0].migrated == 0 and out[0].streams[0].error_code == code, out[0]


def test_refusals_keep_the_stream_on_a(tiny_llama_dir, tmp_path):
    other = build_tiny_llama(tmp_path / "other", seed=1)
    with InProcessServer([_executor(tiny_llama_dir)], **PEER) as a:
        # B does not count A as a peer: it will not pull from it
        with InProcessServer([_executor(tiny_llama_dir)], kv_peers=["10.0.0.1:1"], kv_peer_tokens=["tok-peer"]) as b:
            _refused(a, b.target, "PERMISSION_DENIED")
            assert b.live_caches() == {M: 0}
        # B has other weights under the same model id
        with InProcessServer([HfCausalLmExecutor.from_path(other, model_id=M, device="cpu")], **PEER) as b:
            _refused(a, b.target, "FAILED_PRECONDITION")
            assert b.live_caches() == {M: 0}
        # B has no room for the stream
        with InProcessServer([_executor(tiny_llama_dir, budget_blocks=4)], **PEER) as b, Client(b.target) as cb:
            full = cb.prefill(M, _prompt(60, seed=11)).output.cache.cache_id  # 60 of its 64 tokens taken
            _refused(a, b.target, "RESOURCE_EXHAUSTED")
            assert b.live_caches() == {M: 1}
            cb.release_cache(M, full)
        # B is a prefill server: it decodes no stream
        with InProcessServer([_executor(tiny_llama_dir)], role="prefill", **PEER) as b:
            _refused(a, b.target, "FAILED_PRECONDITION")
            assert b.live_caches() == {M: 0}
        # B does not share the peer token
        with InProcessServer([_executor(tiny_llama_dir)], kv_peers=["127.0.0.1:1024-65535"], kv_peer_tokens=["other"]) as b:
            _refused(a, b.target, "PERMISSION_DENIED")
            assert b.live_caches() == {M: 0}
        assert a.live_caches() == {M: 0}


def test_resume_token_is_single_use_bound_and_expires(tiny_llama_dir):
    tokens = ["tok-alice", "tok-bob"]
    cfg = {**PEER, "auth_tokens": tokens, "migration_resume_s": 1.0}
    with InProcessServer([_executor(tiny_llama_dir)], **cfg) as a, InProcessServer([_executor(tiny_llama_dir)], **cfg) as b, \
            Client(a.target, token="tok-alice") as alice_a, Client(b.target, token="tok-alice") as alice_b, \
            Client(b.target, token="tok-bob") as bob_b:
        prompt = _prompt(12, seed=7)
        ref = alice_a.generate(M, token_ids=prompt, max_tokens=30, ignore_eos=True).tokens()
        _slow(a, gate=5)

        def moved_stream():
            stream = alice_a.generate(M, token_ids=prompt, max_tokens=30, ignore_eos=True, request_id="r",
                                      follow_migrations=False)
            toks, mig = [], None
            for ev in stream:
                k = ev.WhichOneof("event")
                if k == "token":
                    toks.append(ev.token.token_id)
                    if len(toks) == 5:
                        threading.Thread(target=lambda: alice_a.migrate_streams(b.target, request_id="r")).start()
                elif k == "migrated":
                    mig = ev.migrated
            assert mig is not None and mig.target == b.target and mig.generated_tokens == len(toks)
            return toks, mig

        toks, mig = moved_stream()
        # another caller cannot resume it (and does not burn it); a made-up token is NOT_FOUND too
        for who, tok in ((bob_b, mig.resume_token), (alice_b, "x" * 32), (alice_b, mig.resume_token + "x")):
            with pytest.raises(FerrumRpcError) as e:
                who.generate(M, resume_token=mig.resume_token if tok is None else tok).tokens()
            assert e.value.code.name == "NOT_FOUND"
        rest = alice_b.generate(M, resume_token=mig.resume_token).tokens()
        assert toks + rest == ref
        with pytest.raises(FerrumRpcError) as e:  # single use
            alice_b.generate(M, resume_token=mig.resume_token).tokens()
        assert e.value.code.name == "NOT_FOUND"
        # a stream nobody resumes is dropped after the deadline, with its cache
        toks, mig = moved_stream()
        assert b.live_caches() == {M: 1}
        time.sleep(1.5)
        assert b.live_caches() == {M: 0}
        with pytest.raises(FerrumRpcError) as e:
            alice_b.generate(M, resume_token=mig.resume_token).tokens()
        assert e.value.code.name == "NOT_FOUND"
        assert a.live_caches() == {M: 0}


def test_hostile_calls(pair):
    a, b = pair
    with Client(a.target) as ca, Client(b.target) as cb:
        # AcceptMigration without a peer token: refused before anything is pulled
        with pytest.raises(FerrumRpcError) as e:
            cb.call("AcceptMigration", pb.AcceptMigrationRequest(
                model_id=M, generated_token_ids=[1], source=pb.KvSource(target=a.target, cache_id="c")))
        assert e.value.code.name == "PERMISSION_DENIED"
        # a target that is not a peer, an empty one, a unix socket
        for target, code in ((f"10.1.2.3:{b.server.port}", "PERMISSION_DENIED"), ("", "INVALID_ARGUMENT"),
                             ("unix:/tmp/x", "PERMISSION_DENIED")):
            with pytest.raises(FerrumRpcError) as e:
                ca.migrate_streams(target)
            assert e.value.code.name == code
        # nothing runs / an unknown request id: nothing moves
        assert ca.migrate_streams(b.target, request_id="nope").migrated == 0
        # a flood of moves for one stream: it moves once, the others are told, the tokens stay whole
        prompt = _prompt(16, seed=9)
        ref = ca.generate(M, token_ids=prompt, max_tokens=64, ignore_eos=True).tokens()
        _slow(a, gate=8)
        results = []
        lock = threading.Lock()

        def flood():
            def one():
                try:
                    r = ca.migrate_streams(b.target, request_id="mv")
                except FerrumRpcError as e:  # noqa: F841
                    r = None
                with lock:
                    results.append(r)
            ths = [threading.Thread(target=one) for _ in range(20)]
            for t in ths:
                t.start()
            for t in ths:
                t.join(60)
            return results

        toks, idx, fin, _, stream = _run(ca, prompt, move=flood, at=8)
        assert toks == ref and idx == list(range(64))
        assert sum(r.migrated for r in results if r is not None) == 1
        assert stream.migrations == [b.target]
        # a resume token on the server that moved the stream away: NOT_FOUND
        with pytest.raises(FerrumRpcError) as e:
            ca.generate(M, resume_token="abc").tokens()
        assert e.value.code.name == "NOT_FOUND"
    assert a.live_caches() == {M: 0} and b.live_caches() == {M: 0}


def test_parked_streams_are_bounded(pair):
    """B holds at most ``max_parked`` streams for their callers: past that, a hand-off is refused
    (RESOURCE_EXHAUSTED) and the stream goes on at A."""
    a, b = pair
    b.server.servicer.migrations.max_parked = 0
    _refused(a, b.target, "RESOURCE_EXHAUSTED")
    assert b.live_caches() == {M: 0}


def test_admin_and_peer_gates_under_auth(tiny_llama_dir):
    cfg = {"kv_peers": ["127.0.0.1:1024-65535"], "kv_peer_tokens": ["tok-peer"], "auth_tokens": ["tok-user"],
           "admin_tokens": ["tok-admin"]}
    with InProcessServer([_executor(tiny_llama_dir)], **cfg) as a, \
            Client(a.target, token="tok-user") as user, Client(a.target, token="tok-admin") as admin, \
            Client(a.target, token="tok-peer") as peer, Client(a.target) as nobody:
        with pytest.raises(FerrumRpcError) as e:
            user.migrate_streams(a.target)
        assert e.value.code.name == "PERMISSION_DENIED"
        with pytest.raises(FerrumRpcError) as e:
            nobody.migrate_streams(a.target)
        assert e.value.code.name == "UNAUTHENTICATED"
        assert admin.migrate_streams(a.target).migrated == 0  # allowed; nothing runs
        bad = pb.AcceptMigrationRequest(model_id=M, generated_token_ids=[1],
                                        source=pb.KvSource(target=a.target, cache_id="nope"))
        with pytest.raises(FerrumRpcError) as e:  # a caller's token is no peer token
            user.call("AcceptMigration", bad)
        assert e.value.code.name == "PERMISSION_DENIED"
        with pytest.raises(FerrumRpcError) as e:  # a peer token opens AcceptMigration, not MigrateStreams
            peer.migrate_streams(a.target)
        assert e.value.code.name == "UNAUTHENTICATED"
        with pytest.raises(FerrumRpcError) as e:  # with the peer token: the bad cache id is NOT_FOUND at the source
            peer.call("AcceptMigration", bad)
        assert e.value.code.name == "NOT_FOUND"
        assert a.live_caches() == {M: 0}


def test_migrate_streams_is_admin_only(tiny_llama_dir):
    with InProcessServer([_executor(tiny_llama_dir)], kv_peers=["127.0.0.1:1024-65535"], kv_peer_tokens=["p"]) as a, \
            Client(a.target) as c:
        with pytest.raises(FerrumRpcError) as e:
            c.migrate_streams(a.target)
        assert e.value.code.name == "PERMISSION_DENIED"


def test_drain_by_migration_rpc(pair):
    """MigrateStreams(drain) moves the running streams and stops new work: health NOT_SERVING,
    Loads says draining, a new Generate is UNAVAILABLE (reads and exports still answer)."""
    a, b = pair
    prompt = _prompt(16, seed=4)
    with Client(a.target) as ca:
        ref = ca.generate(M, token_ids=prompt, max_tokens=64, ignore_eos=True).tokens()
        assert not ca.loads().loads[0].draining
        _slow(a, gate=8)
        toks, idx, fin, res, stream = _run(ca, prompt, move=lambda: ca.migrate_streams(b.target, drain=True), at=8)
        assert res.migrated == 1 and toks == ref and stream.migrations == [b.target]
        assert ca.loads().loads[0].draining
        assert ca.health() == "NOT_SERVING"
        with pytest.raises(FerrumRpcError) as e:
            ca.generate(M, token_ids=prompt, max_tokens=4).tokens()
        assert e.value.code.name == "UNAVAILABLE"
    assert a.live_caches() == {M: 0} and b.live_caches() == {M: 0}


def test_sigterm_with_drain_to_moves_8_streams(tiny_llama_dir, tmp_path):
    """Two server processes; A (``--drain-to B``) gets SIGTERM while 8 streams run on it: all 8
    finish on B with the tokens of unmoved runs, and A exits with no cache left."""
    tok = tmp_path / "peer-token"
    tok.write_text("tok-peer\n")
    spec = f"hf-causal-lm,id={M},path={tiny_llama_dir},device=cpu"
    common = ("--model", spec, "--kv-budget-tokens", "16384", "--kv-peer", "127.0.0.1:1024-65535",
              "--kv-peer-token-file", str(tok))
    n, max_tokens = 8, 160
    prompts = [_prompt(20 + i, seed=100 + i) for i in range(n)]
    kw = [dict(temperature=0.8, seed=i) if i % 2 else {} for i in range(n)]
    with ServerProcess(*common) as pb_, ServerProcess(*common, "--drain-to", pb_.target, "--grace-period", "30") as pa:
        with Client(pb_.target) as cb:
            refs = [cb.generate(M, token_ids=p, max_tokens=max_tokens, ignore_eos=True, **k).tokens()
                    for p, k in zip(prompts, kw)]
        got: dict[int, list[int]] = {}
        moved: dict[int, list[str]] = {}
        errs: list[BaseException] = []
        started = threading.Barrier(n + 1)

        def stream(i: int) -> None:
            try:
                with Client(pa.target) as c:
                    s = c.generate(M, token_ids=prompts[i], max_tokens=max_tokens, ignore_eos=True, **kw[i])
                    toks = []
                    for ev in s:
                        if ev.WhichOneof("event") == "token":
                            toks.append(ev.token.token_id)
                            if len(toks) == 4:
                                started.wait(60)
                    got[i], moved[i] = toks, s.migrations
            except BaseException as e:  # noqa: BLE001
                errs.append(e)

        ths = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
        for t in ths:
            t.start()
        started.wait(120)
        pa.terminate()
        for t in ths:
            t.join(300)
        assert pa.wait(60) == 0
        assert not errs, errs[:2]
        assert [got[i] for i in range(n)] == refs
        assert all(moved[i] == [pb_.target] for i in range(n)), moved
        log = pa.log(200000)
        assert '"migrated": 8' in log and '"released_caches": 0' in log, log[-3000:]
        with Client(pb_.target) as cb:
            time.sleep(0.2)
            assert not cb.list_caches().caches


def test_export_breaking_off_mid_pull_leaves_nothing_on_b(pair):
    """A's ExportKv dies after the header and one chunk (as when A goes down mid-transfer): B
    keeps nothing (no cache, no staged block), and the stream, still alive here, goes on at A."""
    a, b = pair
    break_export(a.server)
    _refused(a, b.target, "UNAVAILABLE")
    assert b.live_caches() == {M: 0}
    assert b.models.get(M).executor.registry.staged_tokens == 0
    assert a.live_caches() == {M: 0}


def test_migrate_streams_bad_model(pair):
    a, b = pair
    with Client(a.target) as ca:
        with pytest.raises(FerrumRpcError) as e:
            ca.migrate_streams(b.target, model_id="no-such-model")
        assert e.value.code.name == "NOT_FOUND"
