"""KV handoff between servers: ExportKv / ImportKv (pushed and pulled server to server), roles.

Real servers on loopback ports, the tiny random-weight llama: prefill on A, import on B, decode on
B equals one server doing it all; refusals leave nothing behind (no cache, every block free)."""

from __future__ import annotations

import shutil
import threading
import time

import grpc
import numpy as np
import pytest

from ferrum_client import Client, messages as m, pb, tpb
from ferrum_service.executors.transformers import HfCausalLmExecutor
from ferrum_service.testing.tiny_models import build_tiny_llama

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.prompts import prompt_ids
from .support.servers import InProcessServer, ServerProcess
from .support.waits import wait_no_listed_caches, wait_until

BS = 16
M = "tiny"


def _executor(path, budget_blocks: int = 64) -> HfCausalLmExecutor:
    return HfCausalLmExecutor.from_path(path, model_id=M, device="cpu", kv_budget_tokens=budget_blocks * BS)


def _assert_empty(ex: HfCausalLmExecutor) -> None:
    """No cache, no block held (evictable cached blocks are fine), invariants hold."""
    assert len(ex.registry) == 0
    ex.prefix.check()
    assert not ex.prefix.refs


def _release_all(ex: HfCausalLmExecutor) -> None:
    for e in ex.registry.entries():
        ex.release_cache(e.cache_id)


@pytest.fixture
def pair(tiny_llama_dir, tmp_path):
    # B loads a copy from another directory: the fingerprint names the weights, not their path
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama_dir, copy)
    a, b = _executor(tiny_llama_dir), _executor(copy)
    with InProcessServer([a]) as sa, InProcessServer([b], kv_peers=[sa.target]) as sb:
        yield sa, sb, a, b
    for ex in (a, b):
        _release_all(ex)


def _prefill(c: Client, tokens, **kw) -> pb.PrefillOutput:
    return c.stub.Prefill(pb.PrefillRequest(model_id=M, input=pb.PrefillInput(
        token_ids=tokens, logits=m.full_logits(), **kw))).output


def _decode_chain(c: Client, cache_id: str, first: int, steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy decode from ``first``: the tokens and every step's full logits."""
    toks, rows, tok = [], [], first
    for _ in range(steps):
        out = c.stub.Decode(pb.DecodeRequest(model_id=M, input=pb.DecodeInput(
            cache_id=cache_id, token_id=tok, logits=m.full_logits()))).output.output
        row = m.logits_array(out)
        tok = int(np.argmax(row))
        toks.append(tok)
        rows.append(row)
    return toks, rows


def _export(c: Client, cache_id: str, **kw) -> list[pb.ExportKvResponse]:
    return list(c.stub.ExportKv(pb.ExportKvRequest(model_id=M, cache_id=cache_id, **kw)))


def _push(msgs, **first) -> list[pb.ImportKvRequest]:
    """The import stream for exported messages (header first, with ``first``'s settings)."""
    out = [pb.ImportKvRequest(model_id=M, header=msgs[0].header, **first)]
    out += [pb.ImportKvRequest(chunk=x.chunk) for x in msgs[1:]]
    return out


def _code(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_prefill_on_a_decode_on_b_equals_one_server(pair, mode):
    sa, sb, a, b = pair
    p = prompt_ids(50)
    with Client(sa.target) as ca, Client(sb.target) as cb:
        ref = _prefill(ca, p, reserve_tokens=64, bypass_prefix_cache=True)
        t0 = int(np.argmax(m.logits_array(ref.output)))
        ref_toks, ref_rows = _decode_chain(ca, ref.cache.cache_id, t0, 8)

        src = _prefill(ca, p, bypass_prefix_cache=True)
        assert int(np.argmax(m.logits_array(src.output))) == t0
        if mode == "pull":
            r = cb.stub.ImportKv(iter([pb.ImportKvRequest(model_id=M, reserve_tokens=64, source=pb.KvSource(
                target=sa.target, cache_id=src.cache.cache_id, max_chunk_bytes=4096))]))
        else:
            msgs = _export(ca, src.cache.cache_id, max_chunk_bytes=4096)
            h = msgs[0].header
            assert (h.model_id, h.num_layers, h.kv_dtype, list(h.token_ids), list(h.positions)) == (
                M, a.num_layers, tpb.DATA_TYPE_FP32, p, list(range(50)))
            assert h.num_chunks == len(msgs) - 1 and h.checksum_algorithm == "crc32" and len(h.fingerprint) == 64
            assert len(msgs) - 1 > a.num_layers  # layers split into token ranges
            r = cb.stub.ImportKv(iter(_push(msgs, reserve_tokens=64)))
        assert r.imported_tokens == 50 and r.cache.num_tokens == 50 and r.cached_blocks == 3
        assert r.bytes == 50 * a.pool.bytes_per_token
        assert sb.server.metrics.value("ferrum_kv_transfer_bytes_total", {"model": M, "direction": "import"}) == r.bytes
        ca.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id=M, cache_id=src.cache.cache_id))

        toks, rows = _decode_chain(cb, r.cache.cache_id, t0, 8)
        assert toks == ref_toks
        for x, y in zip(rows, ref_rows):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)
        # imported full blocks are cached like computed ones: a prompt sharing them hits
        hit = cb.stub.Prefill(pb.PrefillRequest(model_id=M, input=pb.PrefillInput(token_ids=p + [7])))
        assert hit.output.cached_tokens == 48
        for c, cid in ((ca, ref.cache.cache_id), (cb, r.cache.cache_id), (cb, hit.output.cache.cache_id)):
            c.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id=M, cache_id=cid))
    _assert_empty(a)
    _assert_empty(b)


def test_export_ranges_and_refusals(pair):
    sa, sb, a, b = pair
    with Client(sa.target) as ca:
        src = _prefill(ca, prompt_ids(40))
        cid = src.cache.cache_id
        part = _export(ca, cid, from_token=16, to_token=32)
        assert (part[0].header.from_token, part[0].header.to_token, list(part[0].header.positions)) == (
            16, 32, list(range(16, 32)))
        assert {c.chunk.token_start for c in part[1:]} == {16}
        assert _code(lambda: _export(ca, cid, to_token=41)) == grpc.StatusCode.OUT_OF_RANGE
        assert _code(lambda: _export(ca, "hf-nope")) == grpc.StatusCode.NOT_FOUND
        # a partial range cannot start a new cache
        assert _code(lambda: Client(sb.target).stub.ImportKv(iter(_push(part)))) == grpc.StatusCode.INVALID_ARGUMENT
        ca.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id=M, cache_id=cid))
    _assert_empty(b)


def test_import_into_a_full_server_is_refused_with_nothing_kept(tiny_llama_dir):
    a, b = _executor(tiny_llama_dir), _executor(tiny_llama_dir, budget_blocks=16)
    with InProcessServer([a]) as sa, InProcessServer([b], kv_peers=[sa.target]) as sb, Client(sa.target) as ca, \
            Client(sb.target) as cb:
        filler = _prefill(cb, prompt_ids(190, 9), bypass_prefix_cache=True)  # 12 of 16 blocks
        free = b.pool.free_blocks
        src = _prefill(ca, prompt_ids(100))
        msgs = _push(_export(ca, src.cache.cache_id))
        assert _code(lambda: cb.stub.ImportKv(iter(msgs))) == grpc.StatusCode.RESOURCE_EXHAUSTED
        # refused at the header, before any chunk is read (not DATA_LOSS for the missing chunks)
        assert _code(lambda: cb.stub.ImportKv(iter(msgs[:1]))) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _code(lambda: cb.stub.ImportKv(iter([pb.ImportKvRequest(model_id=M, source=pb.KvSource(
            target=sa.target, cache_id=src.cache.cache_id))]))) == grpc.StatusCode.RESOURCE_EXHAUSTED
        # a reservation beyond the pool is refused too
        small = _prefill(ca, prompt_ids(20))
        assert _code(lambda: cb.stub.ImportKv(iter(_push(_export(ca, small.cache.cache_id), reserve_tokens=80)))
                     ) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert b.pool.free_blocks == free and len(b.registry) == 1
        cb.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id=M, cache_id=filler.cache.cache_id))
        _assert_empty(b)
    _release_all(a)


def test_interrupted_transfer_leaves_no_cache(pair):
    sa, sb, a, b = pair
    with Client(sa.target) as ca, Client(sb.target) as cb:
        src = _prefill(ca, prompt_ids(60))
        msgs = _push(_export(ca, src.cache.cache_id, max_chunk_bytes=2048))
        # the stream ends early: DATA_LOSS, nothing imported
        assert _code(lambda: cb.stub.ImportKv(iter(msgs[:len(msgs) // 2]))) == grpc.StatusCode.DATA_LOSS
        _assert_empty(b)
        # the caller goes away mid-stream (cancelled): nothing kept
        gate = threading.Event()

        def stalled():
            yield from msgs[:5]
            gate.wait(10)

        fut = cb.stub.ImportKv.future(stalled())
        # the header was admitted: blocks are staged
        assert wait_until(lambda: b.pool.free_blocks < b.pool.num_blocks)
        assert len(b.registry) == 0
        fut.cancel()
        gate.set()
        assert wait_until(lambda: b.pool.free_blocks == b.pool.num_blocks)
        _assert_empty(b)
        # the source cannot go away mid-pull: while A exports the cache to B (A's transfer thread
        # held up, so the export is in flight and holds the cache), A refuses to release it
        # (ABORTED: busy); the pull then completes with every token
        big = _prefill(ca, prompt_ids(200, 3))
        host_a = sa.models.get(M)
        held = threading.Event()
        sa.server.servicer.kv._io.submit(held.wait, 30)
        try:
            pulled = cb.stub.ImportKv.future(iter([pb.ImportKvRequest(model_id=M, source=pb.KvSource(
                target=sa.target, cache_id=big.cache.cache_id, max_chunk_bytes=1024))]))
            assert wait_until(lambda: host_a.is_busy(big.cache.cache_id)), "the export never held the cache"
            assert _code(lambda: ca.stub.ReleaseCache(pb.ReleaseCacheRequest(
                model_id=M, cache_id=big.cache.cache_id))) == grpc.StatusCode.ABORTED
        finally:
            held.set()
        got = pulled.result(30)
        assert got.imported_tokens == 200 and got.cache.num_tokens == 200
        cb.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id=M, cache_id=got.cache.cache_id))
        ca.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id=M, cache_id=src.cache.cache_id))
        assert ca.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id=M, cache_id=big.cache.cache_id)).released
    _assert_empty(b)


def test_mismatches_are_refused(pair, tmp_path):
    sa, sb, a, b = pair
    other = HfCausalLmExecutor.from_path(build_tiny_llama(tmp_path / "other", seed=1), model_id=M, device="cpu",
                                         kv_budget_tokens=64 * BS)
    with InProcessServer([other], kv_peers=[sa.target]) as so, Client(sa.target) as ca, Client(sb.target) as cb, \
            Client(so.target) as co:
        src = _prefill(ca, prompt_ids(30))
        msgs = _push(_export(ca, src.cache.cache_id))

        def altered(**h):
            first = pb.ImportKvRequest()
            first.CopyFrom(msgs[0])
            for k, v in h.items():
                setattr(first.header, k, v)
            return [first] + msgs[1:]

        FP = grpc.StatusCode.FAILED_PRECONDITION
        assert _code(lambda: cb.stub.ImportKv(iter(altered(model_id="other")))) == FP
        assert _code(lambda: cb.stub.ImportKv(iter(altered(fingerprint="0" * 64)))) == FP
        assert _code(lambda: cb.stub.ImportKv(iter(altered(kv_dtype=tpb.DATA_TYPE_BF16)))) == FP
        assert _code(lambda: cb.stub.ImportKv(iter(altered(num_kv_heads=7)))) == FP
        # other weights under the same id and shape: the fingerprint tells them apart
        assert _code(lambda: co.stub.ImportKv(iter(msgs))) == FP
        with pytest.raises(grpc.RpcError) as e:
            co.stub.ImportKv(iter([pb.ImportKvRequest(model_id=M, source=pb.KvSource(
                target=sa.target, cache_id=src.cache.cache_id))]))
        assert e.value.code() == FP and "fingerprint" in e.value.details()
        ca.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id=M, cache_id=src.cache.cache_id))
    _assert_empty(b)
    _assert_empty(other)


def test_corrupted_chunk_is_data_loss(pair):
    sa, sb, a, b = pair
    with Client(sa.target) as ca, Client(sb.target) as cb:
        src = _prefill(ca, prompt_ids(40))
        msgs = _push(_export(ca, src.cache.cache_id, max_chunk_bytes=2048))
        bad = pb.ImportKvRequest()
        bad.CopyFrom(msgs[3])
        key = bytearray(bad.chunk.key)
        key[5] ^= 0x40
        bad.chunk.key = bytes(key)
        with pytest.raises(grpc.RpcError) as e:
            cb.stub.ImportKv(iter(msgs[:3] + [bad] + msgs[4:]))
        assert e.value.code() == grpc.StatusCode.DATA_LOSS and "checksum" in e.value.details()
        # out of order, or short of bytes: INVALID_ARGUMENT
        assert _code(lambda: cb.stub.ImportKv(iter([msgs[0], msgs[2]] + msgs[1:2] + msgs[3:]))
                     ) == grpc.StatusCode.INVALID_ARGUMENT
        ca.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id=M, cache_id=src.cache.cache_id))
    _assert_empty(b)


def test_roles(tiny_llama_dir):
    pre, dec = _executor(tiny_llama_dir), _executor(tiny_llama_dir)
    with InProcessServer([pre], role="prefill") as sp, \
            InProcessServer([dec], role="decode", kv_peers=[sp.target]) as sd, \
            Client(sp.target) as cp, Client(sd.target) as cd:
        assert cp.stub.Info(pb.InfoRequest()).role == pb.SERVER_ROLE_PREFILL
        assert cd.stub.Info(pb.InfoRequest()).role == pb.SERVER_ROLE_DECODE
        caps = cp.stub.Capabilities(pb.CapabilitiesRequest(model_id=M)).capabilities
        assert caps.supports_kv_transfer
        p = prompt_ids(30)
        FP = grpc.StatusCode.FAILED_PRECONDITION
        assert _code(lambda: _prefill(cd, p)) == FP
        assert _code(lambda: list(cd.stub.Generate(m.generate_request(M, token_ids=p, max_tokens=2)))) == FP
        src = _prefill(cp, p)
        assert _code(lambda: cp.stub.Decode(pb.DecodeRequest(model_id=M, input=pb.DecodeInput(
            cache_id=src.cache.cache_id, token_id=1)))) == FP
        assert _code(lambda: list(cp.stub.Generate(m.generate_request(M, token_ids=p, max_tokens=2)))) == FP
        r = cd.stub.ImportKv(iter([pb.ImportKvRequest(model_id=M, source=pb.KvSource(
            target=sp.target, cache_id=src.cache.cache_id))]))
        cp.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id=M, cache_id=src.cache.cache_id))
        t0 = int(np.argmax(m.logits_array(src.output)))
        req = m.generate_request(M, max_tokens=4, ignore_eos=True, cache_id=r.cache.cache_id, last_token_id=t0)
        events = list(cd.stub.Generate(req))
        assert sum(1 for e in events if e.WhichOneof("event") == "token") == 4
        cd.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id=M, cache_id=r.cache.cache_id))
    _assert_empty(pre)
    _assert_empty(dec)


def test_disaggregated_router_matches_one_server(tiny_llama_dir):
    from ferrum_client.routing import DisaggregatedRouter

    pre, dec, one = _executor(tiny_llama_dir), _executor(tiny_llama_dir), _executor(tiny_llama_dir)
    with InProcessServer([pre], role="prefill") as sp, \
            InProcessServer([dec], role="decode", kv_peers=[sp.target]) as sd, \
            InProcessServer([one]) as so, Client(so.target) as co:
        with DisaggregatedRouter.from_roles([sp.target, sd.target]) as router:
            assert [r.target for r in router.prefill.replicas()] == [sp.target]
            assert [r.target for r in router.decode.replicas()] == [sd.target]
            for i in range(3):
                p = prompt_ids(30 + 7 * i, i)
                ref = [e.token.token_id for e in co.generate(M, token_ids=p, max_tokens=6, ignore_eos=True)
                       if e.WhichOneof("event") == "token"]
                with router.new_session() as s:
                    assert s.target == sd.target
                    got = list(s.generate(M, p, max_tokens=6, ignore_eos=True))
                    h = s.prefill(M, p, reserve_tokens=len(p) + 4)
                    assert h.output.token_id == ref[0] and h.cache.num_tokens == len(p)
                    assert h.imported.imported_tokens == len(p) and h.handoff_s > 0
                    d = s.decode(M, h.cache.cache_id, h.output.token_id)
                    assert d.output.output.token_id == ref[1]
                    s.release_cache(M, h.cache.cache_id)
                assert got == ref
    for ex in (pre, dec):
        _assert_empty(ex)


def test_router_source_down_marks_the_prefill_replica(tiny_llama_dir):
    """A decode replica that cannot reach the source answers UNAVAILABLE naming the source: the
    router marks the prefill replica down and keeps the decode replica."""
    from ferrum_client.routing import DisaggregatedRouter, ReplicaLost

    pre, dec = _executor(tiny_llama_dir), _executor(tiny_llama_dir)
    with InProcessServer([pre], role="prefill") as sp, \
            InProcessServer([dec], role="decode", kv_peers=["127.0.0.1:1"]) as sd:
        # the decode replica is told to reach the prefill replica at a dead address (a configured peer)
        with DisaggregatedRouter([sp.target], [sd.target], source_targets={sp.target: "127.0.0.1:1"},
                                 handoff_timeout=10) as router, router.new_session() as s:
            with pytest.raises(ReplicaLost) as e:
                s.prefill(M, prompt_ids(20))
            assert e.value.target == sp.target
            assert not router.prefill.replicas()[0].up and router.decode.replicas()[0].up
    _assert_empty(pre)
    _assert_empty(dec)


def test_client_push_import(pair):
    sa, sb, a, b = pair
    with Client(sa.target) as ca, Client(sb.target) as cb:
        src = _prefill(ca, prompt_ids(33))
        r = cb.import_kv(M, ca.export_kv(M, src.cache.cache_id, max_chunk_bytes=1024), reserve_tokens=40)
        assert r.cache.num_tokens == 33 and r.chunks > 2
        cb.release_cache(M, r.cache.cache_id)
        ca.release_cache(M, src.cache.cache_id)
    _assert_empty(b)


def test_server_pull_acts_for_its_caller(tiny_llama_dir):
    a, b = _executor(tiny_llama_dir), _executor(tiny_llama_dir)
    tokens = ["tok-alice", "tok-bob"]
    peer = {"kv_peer_tokens": ["tok-peer"]}
    with InProcessServer([a], auth_tokens=tokens, **peer) as sa, \
            InProcessServer([b], auth_tokens=tokens, kv_peers=[sa.target], **peer) as sb, \
            Client(sa.target, token="tok-alice") as alice_a, Client(sb.target, token="tok-alice") as alice_b, \
            Client(sb.target, token="tok-bob") as bob_b:
        src = alice_a.prefill(M, prompt_ids(20)).output
        # bob's pull reaches A (with B's peer token) on bob's behalf: alice's cache is NOT_FOUND to
        # him, and B keeps nothing
        with pytest.raises(Exception) as e:
            bob_b.pull_kv(M, sa.target, src.cache.cache_id)
        assert "NOT_FOUND" in str(e.value)
        _assert_empty(b)
        r = alice_b.pull_kv(M, sa.target, src.cache.cache_id)
        assert r.cache.num_tokens == 20
        assert [c.cache_id for c in alice_b.list_caches().caches] == [r.cache.cache_id]
        assert not bob_b.list_caches().caches  # the imported cache is alice's
        alice_b.release_cache(M, r.cache.cache_id)
        alice_a.release_cache(M, src.cache.cache_id)
    _assert_empty(a)
    _assert_empty(b)


def test_export_does_not_wait_for_the_sources_busy_worker(pair):
    """A prefill server's worker is busy with prompts; a pull from it must not queue behind them."""
    sa, sb, a, b = pair
    with Client(sa.target) as ca, Client(sb.target) as cb:
        src = ca.prefill(M, prompt_ids(64)).output
        cb.release_cache(M, cb.pull_kv(M, sa.target, src.cache.cache_id).cache.cache_id)  # warm (fingerprints)
        busy = sa.models.get(M).submit(time.sleep, 3.0)  # a long step on A's worker
        t0 = time.perf_counter()
        r = cb.pull_kv(M, sa.target, src.cache.cache_id)
        assert time.perf_counter() - t0 < 2.0 and not busy.done()
        busy.result()
        cb.release_cache(M, r.cache.cache_id)
        ca.release_cache(M, src.cache.cache_id)
    _assert_empty(b)


def test_role_flag_is_checked():
    from ferrum_service.hosting.models import ModelSet
    from ferrum_service.server import Server, ServerConfig

    with pytest.raises(ValueError, match="role"):
        Server(ModelSet(), ServerConfig(role="decoder", port=0, metrics_port=0))


def test_unsupported_executor_is_unimplemented():
    from ferrum_service.executors import StubModelExecutor

    with InProcessServer([StubModelExecutor("stub", 100)]) as s, Client(s.target) as c:
        caps = c.stub.Capabilities(pb.CapabilitiesRequest(model_id="stub")).capabilities
        assert not caps.supports_kv_transfer
        cid = c.stub.Prefill(pb.PrefillRequest(model_id="stub", input=pb.PrefillInput(token_ids=[1, 2]))).output.cache.cache_id
        assert _code(lambda: list(c.stub.ExportKv(pb.ExportKvRequest(model_id="stub", cache_id=cid)))
                     ) == grpc.StatusCode.UNIMPLEMENTED


def test_two_processes_16_sessions_handed_off(tiny_llama_dir):
    spec = f"hf-causal-lm,id={M},path={tiny_llama_dir},device=cpu"
    common = ("--model", spec, "--kv-budget-tokens", "8192")
    with ServerProcess(*common, "--role", "prefill") as pa, \
            ServerProcess(*common, "--role", "decode", "--kv-peer", pa.target) as pd:
        errors: list[BaseException] = []
        results: dict[int, list[int]] = {}

        def session(i: int) -> None:
            try:
                with Client(pa.target) as ca, Client(pd.target) as cd:
                    p = prompt_ids(40 + i, i)
                    src = ca.stub.Prefill(pb.PrefillRequest(model_id=M, input=pb.PrefillInput(
                        token_ids=p, logits=m.greedy()))).output
                    r = cd.stub.ImportKv(iter([pb.ImportKvRequest(model_id=M, reserve_tokens=len(p) + 8,
                                                                  source=pb.KvSource(target=pa.target,
                                                                                     cache_id=src.cache.cache_id))]))
                    ca.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id=M, cache_id=src.cache.cache_id))
                    req = m.generate_request(M, max_tokens=6, ignore_eos=True, cache_id=r.cache.cache_id,
                                             last_token_id=src.output.token_id)
                    toks = [e.token.token_id for e in cd.stub.Generate(req) if e.WhichOneof("event") == "token"]
                    assert len(toks) == 6
                    cd.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id=M, cache_id=r.cache.cache_id))
                    results[i] = toks
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=session, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors[:3]
        assert len(results) == 16
        with Client(pa.target) as ca, Client(pd.target) as cd:
            assert wait_no_listed_caches(ca) == []
            assert wait_no_listed_caches(cd) == []
            loads = cd.stub.Loads(pb.LoadsRequest()).loads[0]
            assert loads.active_caches == 0 and loads.free_blocks == loads.total_blocks
