"""Hostile KV handoff and prefix key spaces (issue 27: F1, F2, F8, F11, F13, F16, F19-F23).

Real servers on loopback ports and the tiny random-weight llama, two (or three) authenticated
callers: no caller poisons another's prefix cache with pushed K/V, spies on another's prompts
through ``cached_tokens``, aims the server's pull at an arbitrary target or borrows credentials
through it, holds staged KV for ever, or reads a cache's blocks after they were freed."""

from __future__ import annotations

import concurrent.futures
import shutil
import sys
import threading
import time
import zlib

import grpc
import numpy as np
import pytest

from ferrum_client import Client, FerrumRpcError, messages as m, pb, tpb
from ferrum_client._proto.ferrum.executor.v1 import executor_pb2_grpc
from ferrum_client.prefix_keys import block_keys, caller_salt, chain_root, token_caller
from ferrum_service.executors.transformers import HfCausalLmExecutor
from ferrum_service.hosting.kv_peers import CALLER_HEADER, MAX_CHANNELS
from ferrum_service.core.types import DecodeInput, PrefillInput

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .lora_fixtures import adapters  # noqa: F401 - fixture
from .support.prompts import prompt_ids
from .support.servers import InProcessServer, free_port
from .support.waits import wait_until
from .test_tls import CA

BS = 16
M = "tiny"
C = grpc.StatusCode
ALICE, BOB, ADMIN, PEER = "tok-alice", "tok-bob", "tok-admin", "tok-peer"


def _executor(path, budget_blocks: int = 64, **kw) -> HfCausalLmExecutor:
    return HfCausalLmExecutor.from_path(path, model_id=M, device="cpu", kv_budget_tokens=budget_blocks * BS, **kw)


def _prefill(c: Client, tokens, **kw) -> pb.PrefillOutput:
    return c.stub.Prefill(pb.PrefillRequest(model_id=M, input=pb.PrefillInput(
        token_ids=tokens, logits=m.full_logits(), **kw)), metadata=c.metadata).output


def _export(c: Client, cache_id: str, **kw) -> list[pb.ExportKvResponse]:
    return list(c.stub.ExportKv(pb.ExportKvRequest(model_id=M, cache_id=cache_id, **kw), metadata=c.metadata))


def _push_stream(msgs, **first) -> list[pb.ImportKvRequest]:
    return ([pb.ImportKvRequest(model_id=M, header=msgs[0].header, **first)]
            + [pb.ImportKvRequest(chunk=x.chunk) for x in msgs[1:]])


def _rpc_error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value


def _assert_empty(ex: HfCausalLmExecutor) -> None:
    assert len(ex.registry) == 0 and ex.registry.staged_imports == 0 and ex.registry.staged_tokens == 0
    ex.prefix.check()
    assert not ex.prefix.refs


def _forged(msgs: list[pb.ExportKvResponse], tokens: list[int]) -> list[pb.ExportKvResponse]:
    """An export of another prompt turned into zeroed K/V claimed to be ``tokens``' (the same
    length), with valid checksums: what a hostile caller can push."""
    out = []
    for x in msgs:
        y = pb.ExportKvResponse()
        y.CopyFrom(x)
        out.append(y)
    out[0].header.ClearField("token_ids")
    out[0].header.token_ids.extend(tokens)
    for y in out[1:]:
        y.chunk.key = bytes(len(y.chunk.key))
        y.chunk.value = bytes(len(y.chunk.value))
        y.chunk.checksum = zlib.crc32(y.chunk.value, zlib.crc32(y.chunk.key))
    return out


# ---- F1: pushed K/V stay in the importer's own key space ----------------------------------------
def test_pushed_kv_never_poisons_another_callers_prefix(tiny_llama_dir):
    ex = _executor(tiny_llama_dir)
    with InProcessServer([ex], auth_tokens=[ALICE, BOB]) as s, Client(s.target, token=ALICE) as alice, \
            Client(s.target, token=BOB) as bob:
        p = prompt_ids(48, 1)
        fresh = _prefill(bob, p, cache_salt="reference", bypass_prefix_cache=True)  # keyed apart from below
        bob.release_cache(M, fresh.cache.cache_id)
        own = _prefill(alice, prompt_ids(48, 2))  # gives alice a valid header (fingerprint, shapes)
        forged = _forged(_export(alice, own.cache.cache_id), p)
        alice.release_cache(M, own.cache.cache_id)
        for salt in ("", "shared:team"):
            r = alice.stub.ImportKv(iter(_push_stream(forged, cache_salt=salt)), metadata=alice.metadata)
            assert r.cached_blocks == 3  # keyed: in alice's own space
            alice.release_cache(M, r.cache.cache_id)  # its blocks stay indexed (evictable)
            got = _prefill(bob, p, cache_salt=salt)
            assert got.cached_tokens == 0, salt
            np.testing.assert_allclose(m.logits_array(got.output), m.logits_array(fresh.output), atol=1e-5)
            bob.release_cache(M, got.cache.cache_id)
        # the importer's own default space does hold them (her word, her risk)
        mine = _prefill(alice, p)
        assert mine.cached_tokens == 47
        alice.release_cache(M, mine.cache.cache_id)
    _assert_empty(ex)


# ---- F2 / F21: server pull only from configured peers, with the server's own credentials --------
class _Probe(executor_pb2_grpc.ModelExecutorServicer):
    """A stand-in peer: records every ExportKv call's metadata and refuses it with a secret text."""

    def __init__(self) -> None:
        self.calls: list[dict[str, str]] = []

    def ExportKv(self, request, context):
        self.calls.append({k: v for k, v in context.invocation_metadata()})
        context.abort(grpc.StatusCode.NOT_FOUND, "probe-secret-detail 10.1.2.3:8080")


@pytest.fixture
def probe():
    srv = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
    p = _Probe()
    executor_pb2_grpc.add_ModelExecutorServicer_to_server(p, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    p.target = f"127.0.0.1:{port}"
    yield p
    srv.stop(0)


def _pull(c: Client, target: str, cache_id: str = "kv-x", **kw):
    return c.stub.ImportKv(iter([pb.ImportKvRequest(model_id=M, source=pb.KvSource(
        target=target, cache_id=cache_id, **kw))]), metadata=c.metadata, timeout=20)


def test_pull_reaches_only_configured_peers_with_the_servers_own_token(tiny_llama_dir, probe, tmp_path):
    ex = _executor(tiny_llama_dir)
    dead = [f"127.0.0.1:{free_port()}" for _ in range(MAX_CHANNELS + 4)]
    with InProcessServer([ex], auth_tokens=[ALICE, BOB], admin_tokens=[ADMIN], kv_peer_tokens=[PEER],
                         kv_peers=[probe.target.replace("127.0.0.1", "localhost"), *dead]) as s, \
            Client(s.target, token=ALICE) as alice, Client(s.target, token=ADMIN) as admin:
        for c in (alice, admin):
            e = _rpc_error(lambda: _pull(c, probe.target.replace("127.0.0.1", "localhost")))
            assert e.code() == C.NOT_FOUND  # the peer's code class is passed on ...
            assert "probe-secret-detail" not in e.details() and "10.1.2.3" not in e.details()  # ... not its text
        # a peer named by DNS name admits the addresses it resolves to (a headless Service's pods)
        port = probe.target.rsplit(":", 1)[1]
        assert _rpc_error(lambda: _pull(alice, f"127.0.0.1:{port}")).code() == C.NOT_FOUND
        assert len(probe.calls) == 3
        for md, who in zip(probe.calls, (ALICE, ADMIN, ALICE)):
            sent = " ".join(md.values())
            assert ALICE not in sent and ADMIN not in sent and BOB not in sent
            assert md["authorization"] == f"Bearer {PEER}"
            assert md[CALLER_HEADER] == token_caller(who).replace(":", "%3A")
        # anything that is not a configured peer is refused before it is dialled
        for target in (f"127.0.0.1:{free_port()}", "unix:/tmp/ferrum.sock", "unix-abstract:x", f"dns:///{probe.target}",
                       "localhost:1", "10.0.0.1:50051"):
            e = _rpc_error(lambda: _pull(alice, target))
            assert e.code() == C.PERMISSION_DENIED, target
            assert "--kv-peer" in e.details()
        assert len(probe.calls) == 3
        # unreachable configured peers: UNAVAILABLE without the connect error; channels stay bounded
        for target in dead:
            e = _rpc_error(lambda: _pull(alice, target))
            assert e.code() == C.UNAVAILABLE
            low = e.details().lower()
            assert "refused" not in low and "connect" not in low and "ipv4" not in low and "socket" not in low
        assert s.server.kv_peers.open_channels <= MAX_CHANNELS
    _assert_empty(ex)


def test_a_peer_exports_only_the_callers_own_cache(tiny_llama_dir):
    """The exporting side: a peer token opens ExportKv only, for the identity it carries; a
    caller cannot claim another identity with the header alone."""
    a, b = _executor(tiny_llama_dir), _executor(tiny_llama_dir)
    auth = {"auth_tokens": [ALICE, BOB], "kv_peer_tokens": [PEER]}
    with InProcessServer([a], **auth) as sa, InProcessServer([b], kv_peers=[sa.target], **auth) as sb, \
            Client(sa.target, token=ALICE) as alice_a, Client(sa.target, token=BOB) as bob_a, \
            Client(sb.target, token=ALICE) as alice_b, Client(sb.target, token=BOB) as bob_b, \
            Client(sa.target, token=PEER) as peer_a:
        src = _prefill(alice_a, prompt_ids(40, 3))
        assert _rpc_error(lambda: _pull(bob_b, sa.target, src.cache.cache_id)).code() == C.NOT_FOUND
        _assert_empty(b)
        # bob naming alice's identity himself: ignored (his own token), NOT_FOUND
        forged = list(bob_a.metadata) + [(CALLER_HEADER, token_caller(ALICE))]
        e = _rpc_error(lambda: list(bob_a.stub.ExportKv(pb.ExportKvRequest(model_id=M, cache_id=src.cache.cache_id),
                                                         metadata=forged)))
        assert e.code() == C.NOT_FOUND
        # the peer token opens nothing else
        e = _rpc_error(lambda: peer_a.stub.Prefill(pb.PrefillRequest(model_id=M, input=pb.PrefillInput(
            token_ids=[1, 2])), metadata=peer_a.metadata))
        assert e.code() == C.UNAUTHENTICATED
        # alice's pull works; pulled K/V may go to a shared space (they come from a trusted peer)
        r = alice_b.stub.ImportKv(iter([pb.ImportKvRequest(model_id=M, cache_salt="shared:team", source=pb.KvSource(
            target=sa.target, cache_id=src.cache.cache_id))]), metadata=alice_b.metadata)
        assert r.imported_tokens == 40
        alice_b.release_cache(M, r.cache.cache_id)
        hit = _prefill(bob_b, prompt_ids(40, 3), cache_salt="shared:team")
        assert hit.cached_tokens == 32
        bob_b.release_cache(M, hit.cache.cache_id)
        # K/V alice pushed into A are still hers only when B pulls them from A (no laundering)
        q = prompt_ids(48, 30)
        other = _prefill(alice_a, prompt_ids(48, 31), cache_salt="other")
        forged = _forged(_export(alice_a, other.cache.cache_id), q)
        pushed = alice_a.stub.ImportKv(iter(_push_stream(forged)), metadata=alice_a.metadata)
        fork = alice_a.fork_cache(M, pushed.cache.cache_id).cache  # forks of it are caller-supplied too
        pulled = alice_b.stub.ImportKv(iter([pb.ImportKvRequest(
            model_id=M, cache_salt="shared:team", source=pb.KvSource(target=sa.target, cache_id=fork.cache_id))]),
            metadata=alice_b.metadata)
        alice_b.release_cache(M, pulled.cache.cache_id)
        laundered = _prefill(bob_b, q, cache_salt="shared:team")
        assert laundered.cached_tokens == 0
        bob_b.release_cache(M, laundered.cache.cache_id)
        for h in alice_a.list_caches().caches:
            alice_a.release_cache(M, h.cache_id)
    _assert_empty(a)
    _assert_empty(b)


def test_router_hands_off_between_mutual_tls_servers(tiny_llama_dir, tmp_path):
    """F21: the router's TLS reaches the pull (KvSource.tls); the decode server's pull channel
    verifies the prefill server with the operator's CA and presents its own client certificate
    (the prefill server requires one); the pull acts for the router's identity (its certificate)."""
    from ferrum_client.routing import DisaggregatedRouter

    ca = CA("kv test CA")
    files = {"ca.pem": ca.pem}
    files["srv.crt"], files["srv.key"] = ca.issue("ferrum-server", server=True)
    files["peer.crt"], files["peer.key"] = ca.issue("decode-peer", server=False)
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    router_cert, router_key = ca.issue("scheduler", server=False)
    f = {k: str(tmp_path / k) for k in files}
    tls = {"tls_cert": f["srv.crt"], "tls_key": f["srv.key"], "tls_client_ca": f["ca.pem"], "kv_peer_tokens": [PEER]}
    pre, dec, one = _executor(tiny_llama_dir), _executor(tiny_llama_dir), _executor(tiny_llama_dir)
    with InProcessServer([pre], role="prefill", **tls) as sp, \
            InProcessServer([dec], role="decode", kv_peers=[sp.target], kv_peer_ca=f["ca.pem"],
                            kv_peer_cert=f["peer.crt"], kv_peer_key=f["peer.key"], **tls) as sd, \
            InProcessServer([one]) as so, Client(so.target) as co:
        p = prompt_ids(30, 4)
        ref = [e.token.token_id for e in co.generate(M, token_ids=p, max_tokens=3, ignore_eos=True)
               if e.WhichOneof("event") == "token"]
        with DisaggregatedRouter([sp.target], [sd.target], root_certificates=ca.pem, private_key=router_key,
                                 certificate_chain=router_cert, handoff_timeout=20) as router, \
                router.new_session() as s:
            h = s.prefill(M, p, reserve_tokens=len(p) + 4)
            assert h.output.token_id == ref[0] and h.imported.imported_tokens == len(p)
            d = s.decode(M, h.cache.cache_id, h.output.token_id)
            assert d.output.output.token_id == ref[1]
            s.release_cache(M, h.cache.cache_id)
    for ex in (pre, dec):
        _assert_empty(ex)


# ---- F8: control characters in cache_salt ---------------------------------------------------------
def test_control_characters_in_cache_salt_are_refused(tiny_llama_dir):
    ex = _executor(tiny_llama_dir)
    with InProcessServer([ex]) as s, Client(s.target) as c:
        p = prompt_ids(20)
        for salt in ("\x00sql", "a\x00b", "tenant\n", "\x7f", "\x85x"):
            with pytest.raises(FerrumRpcError) as e:
                c.prefill(M, p, cache_salt=salt)
            assert e.value.code == C.INVALID_ARGUMENT and e.value.field == "input.cache_salt", salt
        with pytest.raises(FerrumRpcError) as e:
            list(c.generate(M, token_ids=p, max_tokens=1, cache_salt="\x00sql"))
        assert e.value.code == C.INVALID_ARGUMENT and e.value.field == "cache_salt"
        with pytest.raises(FerrumRpcError) as e:
            c.unified_decode(M, [m.unified_item(p, cache_salt="\x00sql")])
        assert e.value.code == C.INVALID_ARGUMENT and e.value.field == "items[0].cache_salt"
        own = c.prefill(M, p).output
        msgs = list(c.export_kv(M, own.cache.cache_id))
        e = _rpc_error(lambda: c.stub.ImportKv(iter(_push_stream(msgs, cache_salt="\x00sql"))))
        assert e.code() == C.INVALID_ARGUMENT and "cache_salt" in e.details()
        c.release_cache(M, own.cache.cache_id)
        # printable salts (any script) are fine, and the recipe is unchanged for them
        ok = c.prefill(M, p, cache_salt="tenant-é-名").output
        c.release_cache(M, ok.cache.cache_id)
    _assert_empty(ex)


# ---- F13: per-caller key spaces ------------------------------------------------------------------
def test_default_key_space_is_the_callers_own_under_auth(tiny_llama_dir):
    ex = _executor(tiny_llama_dir)
    with InProcessServer([ex], auth_tokens=[ALICE, BOB]) as s, Client(s.target, token=ALICE) as alice, \
            Client(s.target, token=BOB) as bob:
        p = prompt_ids(48, 5)
        first = alice.prefill(M, p).output
        assert first.cached_tokens == 0
        again = alice.prefill(M, p).output
        assert again.cached_tokens == 47  # her own space works
        spy = bob.prefill(M, p).output
        assert spy.cached_tokens == 0  # no membership oracle across callers
        # a router acting as alice computes her keys: caller_salt(token_caller(token), salt)
        keys = block_keys(p, BS, model_id=M, cache_salt=caller_salt(token_caller(ALICE), ""))
        assert all(k in ex.prefix.index for k in keys)
        assert not any(k in ex.prefix.index for k in block_keys(p, BS, model_id=M, cache_salt=""))
        # a shared salt is one space for everyone who sends it
        q = prompt_ids(48, 6)
        a_sh = alice.prefill(M, q, cache_salt="shared:team").output
        b_sh = bob.prefill(M, q, cache_salt="shared:team").output
        assert b_sh.cached_tokens == 47
        assert all(k in ex.prefix.index for k in block_keys(q, BS, model_id=M, cache_salt="shared:team"))
        # a cache made empty by ReserveKvSlots and filled by Prefill(cache_id=) is keyed in her space too
        r = alice.reserve_kv_slots(M, [tpb.KvSlotRequest(cache_id="mine", target_len=64, new_sequence=True)])
        cid = r.reservation.allocations[0].created_cache_id
        z = prompt_ids(48, 7)
        alice.prefill(M, z, cache_id=cid)
        assert bob.prefill(M, z).output.cached_tokens == 0
        assert alice.prefill(M, z).output.cached_tokens == 47
        for c in (alice, bob):
            for h in c.list_caches().caches:
                c.release_cache(M, h.cache_id)
        del first, spy, a_sh
    _assert_empty(ex)
    # without authentication every caller is one tenant: unchanged
    ex2 = _executor(tiny_llama_dir)
    with InProcessServer([ex2]) as s, Client(s.target) as c1, Client(s.target) as c2:
        p = prompt_ids(48, 8)
        a = c1.prefill(M, p).output
        b = c2.prefill(M, p).output
        assert b.cached_tokens == 47
        assert all(k in ex2.prefix.index for k in block_keys(p, BS, model_id=M, cache_salt=""))
        c1.release_cache(M, a.cache.cache_id)
        c2.release_cache(M, b.cache.cache_id)
    _assert_empty(ex2)


def test_caller_salt_framing_is_unambiguous():
    roots = {chain_root(M, caller_salt(who, salt), adapter=ad)
             for who in ("", "token:ab", "token:abc", "x509:a:b")
             for salt in ("", "s", "shared:x", "caller:8:token:ab")
             for ad in ("", "sql")}
    # 4 plain salts x 2 adapters, plus 3 folded salts x 2 adapters per caller; "shared:" stays plain
    assert len(roots) == 4 * 2 + 3 * 3 * 2
    assert caller_salt("token:ab", "shared:x") == "shared:x"
    assert caller_salt("token:ab", "shared:x", shared_allowed=False) != "shared:x"
    assert caller_salt("", "s") == "s"


# ---- F11: staged imports are bounded in time and counted ------------------------------------------
def test_a_stalled_import_is_dropped_and_counted_meanwhile(tiny_llama_dir):
    a, b = _executor(tiny_llama_dir), _executor(tiny_llama_dir)
    with InProcessServer([a]) as sa, InProcessServer([b], kv_import_idle_timeout=1.0) as sb, \
            Client(sa.target) as ca, Client(sb.target) as cb:
        src = ca.prefill(M, prompt_ids(64, 9)).output
        msgs = _push_stream(list(ca.export_kv(M, src.cache.cache_id, max_chunk_bytes=2048)))
        gate = threading.Event()

        def stalled():
            yield from msgs[:3]
            gate.wait(30)

        fut = cb.stub.ImportKv.future(stalled())
        assert wait_until(lambda: b.registry.staged_imports)
        assert b.registry.staged_imports == 1 and len(b.registry) == 0
        load = cb.loads(M).loads[0]
        assert load.reserved_tokens == 64  # the staged import's KV shows where Loads reports KV use
        t0 = time.time()
        with pytest.raises(grpc.RpcError) as e:
            fut.result(15)
        assert e.value.code() == C.DEADLINE_EXCEEDED and time.time() - t0 < 5
        gate.set()
        assert wait_until(lambda: b.pool.free_blocks == b.pool.num_blocks)
        _assert_empty(b)
        assert cb.loads(M).loads[0].reserved_tokens == 0
        ca.release_cache(M, src.cache.cache_id)


# ---- F16: a cache being exported is not freed under the export ------------------------------------
def test_release_waits_for_an_export_in_progress(tiny_llama_dir):
    ex = _executor(tiny_llama_dir, budget_blocks=12)
    with InProcessServer([ex]) as s, Client(s.target) as c, Client(s.target) as other:
        with c.session() as sess:
            out = sess.step(pb.PrefillRequest(model_id=M, input=pb.PrefillInput(
                token_ids=prompt_ids(80, 10), logits=m.greedy()))).output
            cid = out.cache.cache_id
            ref = _export(c, cid, max_chunk_bytes=1024)
            gate = threading.Event()
            s.server.servicer.kv._io.submit(gate.wait, 30)  # the transfer thread is busy: layer reads wait
            it = c.stub.ExportKv(pb.ExportKvRequest(model_id=M, cache_id=cid, max_chunk_bytes=1024))
            got = [next(it)]
            assert got[0].WhichOneof("message") == "header"
        # the Session ended: its cache is released "soon" — not while the export holds it
        time.sleep(0.3)
        assert cid in ex.registry
        # another caller's prompt takes every free block meanwhile
        filler = other.prefill(M, prompt_ids(7 * BS, 11), bypass_prefix_cache=True).output
        gate.set()
        got += list(it)
        assert [x.SerializeToString() for x in got] == [x.SerializeToString() for x in ref]
        assert wait_until(lambda: cid not in ex.registry)  # released once the export let go
        other.release_cache(M, filler.cache.cache_id)
    _assert_empty(ex)


# ---- F19: the adapter travels by digest; a staged import binds it --------------------------------
def test_import_checks_the_adapter_digest_and_binds_it_while_staged(tiny_llama_dir, adapters, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama_dir, copy)
    a, b = _executor(tiny_llama_dir, max_adapters=2), _executor(copy, max_adapters=2)
    adm = {"admin_tokens": [ADMIN], "auth_tokens": [ALICE], "kv_peer_tokens": [PEER]}
    with InProcessServer([a], **adm) as sa, InProcessServer([b], kv_peers=[sa.target], **adm) as sb, \
            Client(sa.target, token=ADMIN) as ca, Client(sb.target, token=ADMIN) as cb:
        ca.load_adapter("sql", str(adapters["a1"][0]), M)
        cb.load_adapter("sql", str(adapters["a2"][0]), M)  # another adapter under the same name
        src = ca.prefill(M, prompt_ids(40, 12), adapter="sql").output
        msgs = list(ca.export_kv(M, src.cache.cache_id, max_chunk_bytes=2048))
        assert msgs[0].header.adapter == "sql" and len(msgs[0].header.adapter_digest) == 64
        e = _rpc_error(lambda: cb.stub.ImportKv(iter(_push_stream(msgs)), metadata=cb.metadata))
        assert e.code() == C.FAILED_PRECONDITION and "digest" in e.details()
        e = _rpc_error(lambda: _pull(cb, sa.target, src.cache.cache_id))
        assert e.code() == C.FAILED_PRECONDITION
        _assert_empty(b)
        # the same adapter: accepted; while an import bound to it is staged it cannot be unloaded
        cb.unload_adapter("sql", M)
        cb.load_adapter("sql", str(adapters["a1"][0]), M)
        gate = threading.Event()

        def stalled():
            yield from _push_stream(msgs)[:2]
            gate.wait(30)

        fut = cb.stub.ImportKv.future(stalled(), metadata=cb.metadata)
        assert wait_until(lambda: b.registry.staged_imports)
        with pytest.raises(FerrumRpcError) as e2:
            cb.unload_adapter("sql", M)
        assert e2.value.code == C.FAILED_PRECONDITION
        fut.cancel()
        gate.set()
        assert wait_until(lambda: not b.registry.staged_imports)
        r = cb.stub.ImportKv(iter(_push_stream(msgs)), metadata=cb.metadata)
        assert r.cache.adapter == "sql"
        cb.release_cache(M, r.cache.cache_id)
        assert cb.unload_adapter("sql", M).unloaded
        ca.release_cache(M, src.cache.cache_id)
    _assert_empty(b)


# ---- F20: roles ----------------------------------------------------------------------------------
def test_roles_refuse_decode_items_and_new_sequences(tiny_llama_dir):
    pre, dec = _executor(tiny_llama_dir), _executor(tiny_llama_dir)
    with InProcessServer([pre], role="prefill") as sp, InProcessServer([dec], role="decode") as sd, \
            Client(sp.target) as cp, Client(sd.target) as cd:
        p = prompt_ids(40, 13)
        # a chunked prompt through UnifiedDecode is prefill work
        r1 = cp.unified_decode(M, [m.unified_item(p[:20], is_final_chunk=False)]).results[0]
        r2 = cp.unified_decode(M, [m.unified_item(p[20:], cache_id=r1.cache.cache_id, pos_offset=20)]).results[0]
        assert r2.cache.num_tokens == 40 and r2.HasField("output")
        with pytest.raises(FerrumRpcError) as e:  # a decode item is not
            cp.unified_decode(M, [m.unified_item([r2.output.token_id], cache_id=r1.cache.cache_id, pos_offset=40)])
        assert e.value.code == C.FAILED_PRECONDITION and e.value.field == "role"
        # a one-token last chunk of a chunked prompt is still prefill work
        q = prompt_ids(21, 14)
        c1 = cp.unified_decode(M, [m.unified_item(q[:20], is_final_chunk=False)]).results[0]
        c2 = cp.unified_decode(M, [m.unified_item(q[20:], cache_id=c1.cache.cache_id, pos_offset=20)]).results[0]
        assert c2.cache.num_tokens == 21
        cp.release_cache(M, r1.cache.cache_id)
        cp.release_cache(M, c1.cache.cache_id)
        with pytest.raises(FerrumRpcError) as e:
            cd.reserve_kv_slots(M, [tpb.KvSlotRequest(cache_id="s", target_len=64, new_sequence=True)])
        assert e.value.code == C.FAILED_PRECONDITION and e.value.field == "role"
        assert not cd.list_caches().caches
    _assert_empty(pre)
    _assert_empty(dec)


# ---- F22 / F23: the root memo ---------------------------------------------------------------------
def test_root_memo_is_bounded_and_thread_safe(tiny_llama_dir, adapters):
    ex = _executor(tiny_llama_dir, max_adapters=1)
    ex.load_adapter("a1", str(adapters["a1"][0]))
    pc = ex.prefix
    # an adapter-bound cache whose root falls out of the memo still has its blocks dropped with it
    out = ex.prefill(PrefillInput(token_ids=prompt_ids(20, 15), adapter="a1", cache_salt="s0"))
    for i in range(5000):
        pc.root(f"salt-{i}", "a1")
    assert len(pc._roots) <= 4096
    assert len(getattr(pc, "root_adapter", {})) <= 4096
    tok = 7
    for _ in range(BS):
        ex.decode(DecodeInput(cache_id=out.cache.cache_id, token_id=tok))
    assert sum(1 for a in pc.adapter_of.values() if a == "a1") == 2  # both full blocks keyed for a1
    ex.release_cache(out.cache.cache_id)
    ex.unload_adapter("a1")
    assert not any(a == "a1" for a in pc.adapter_of.values())
    pc.check()
    # the event loop (admission) and the worker (steps) compute roots at once
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    errors: list[BaseException] = []

    def hammer(tag: str) -> None:
        try:
            for i in range(20000):
                assert pc.root(f"{tag}-{i % 6000}") == chain_root(M, f"{tag}-{i % 6000}")
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    try:
        ts = [threading.Thread(target=hammer, args=(t,)) for t in "ab"]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[:1]
    assert len(pc._roots) <= 4096


# ---- flags ---------------------------------------------------------------------------------------
def test_kv_peer_flags(tmp_path, monkeypatch):
    from ferrum_service.cli import build_parser, main, resolve_serve_settings
    from ferrum_service.hosting.kv_peers import KvPeers

    monkeypatch.delenv("FERRUM_KV_PEER", raising=False)
    st = resolve_serve_settings(build_parser().parse_args(
        ["serve", "--kv-peer", "a.svc:50051", "--kv-peer", "10.0.0.2:1", "--kv-import-idle-timeout", "5"]))
    assert st["kv_peer"] == ["a.svc:50051", "10.0.0.2:1"] and st["kv_import_idle_timeout"] == 5.0
    monkeypatch.setenv("FERRUM_KV_PEER", "x:1, y:2")
    assert resolve_serve_settings(build_parser().parse_args(["serve"]))["kv_peer"] == ["x:1", "y:2"]
    monkeypatch.delenv("FERRUM_KV_PEER")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("kv_peer: [p:1]\n")
    assert resolve_serve_settings(build_parser().parse_args(["serve", "--config", str(cfg)]))["kv_peer"] == ["p:1"]
    for bad in ("unix:/tmp/s", "dns:///a:1", "a", "a:0", "a:99999", "http://a:1"):
        with pytest.raises(ValueError):
            KvPeers([bad])
        assert main(["serve", "--kv-peer", bad, "--model", "stub"]) == 2
    assert main(["serve", "--kv-peer-cert", "c.pem", "--model", "stub"]) == 2


def test_client_certificates_are_key_spaces_too(tiny_llama_dir, tmp_path):
    ca = CA("kv test CA")
    crt, key = ca.issue("ferrum-server", server=True)
    for n, d in {"ca.pem": ca.pem, "s.crt": crt, "s.key": key}.items():
        (tmp_path / n).write_bytes(d)
    ex = _executor(tiny_llama_dir)
    (c1, k1), (c2, k2) = ca.issue("tenant-one", server=False), ca.issue("tenant-two", server=False)
    with InProcessServer([ex], tls_cert=str(tmp_path / "s.crt"), tls_key=str(tmp_path / "s.key"),
                         tls_client_ca=str(tmp_path / "ca.pem")) as s, \
            Client(s.target, root_certificates=ca.pem, private_key=k1, certificate_chain=c1) as one, \
            Client(s.target, root_certificates=ca.pem, private_key=k2, certificate_chain=c2) as two:
        p = prompt_ids(48, 20)
        a = one.prefill(M, p).output
        b = two.prefill(M, p).output
        assert b.cached_tokens == 0
        mine = block_keys(p, BS, model_id=M, cache_salt=caller_salt("x509:CN=tenant-one"))
        assert all(k in ex.prefix.index for k in mine)
        one.release_cache(M, a.cache.cache_id)
        two.release_cache(M, b.cache.cache_id)
    _assert_empty(ex)


def test_prefix_aware_router_computes_its_own_key_space(tiny_llama_dir):
    """A router acting as one caller finds that caller's cached prefixes on authenticating replicas
    (its keys fold in the identity of its token), and nobody else's."""
    from ferrum_client.routing import StickyRouter

    a, b = _executor(tiny_llama_dir), _executor(tiny_llama_dir)
    with InProcessServer([a], auth_tokens=[ALICE, BOB]) as sa, InProcessServer([b], auth_tokens=[ALICE, BOB]) as sb, \
            Client(sb.target, token=BOB) as bob_b, \
            StickyRouter([sa.target, sb.target], prefix_aware=True, token=ALICE, step_timeout=5.0) as router:
        assert router.key_identity == token_caller(ALICE)
        p, q = prompt_ids(48, 40), prompt_ids(48, 41)
        with router.new_session(prompt_tokens=p, model_id=M) as s:
            out = s.prefill(M, p).output
            home = s.target
            s.release_cache(M, out.cache.cache_id)
        bob_b.release_cache(M, bob_b.prefill(M, q).output.cache.cache_id)  # bob's prompt, on B
        wait_until(lambda: router.prefix_matches(p, M).get(home, 0) >= 48, interval=0.05)
        assert router.prefix_matches(p, M) == {home: 48, ({sa.target, sb.target} - {home}).pop(): 0}
        time.sleep(0.3)
        assert set(router.prefix_matches(q, M).values()) == {0}  # bob's prefix is not alice's to find


def test_a_host_wildcard_peer_admits_that_hosts_ports_only():
    """``--kv-peer 127.0.0.1:*``: every port of that host (servers on one machine), nothing else."""
    import asyncio

    from ferrum_service.core import errors
    from ferrum_service.hosting.kv_peers import KvPeers

    peers = KvPeers(["127.0.0.1:*"])

    async def check(t):
        return await peers.check(t)

    assert asyncio.run(check("127.0.0.1:50051")) == "127.0.0.1:50051"
    for bad in ("127.0.0.2:50051", "localhost:50051", "unix:/tmp/x.sock", "127.0.0.1"):
        with pytest.raises(errors.FerrumError) as e:
            asyncio.run(check(bad))
        assert e.value.kind == errors.ErrorKind.PERMISSION_DENIED
    with pytest.raises(ValueError):
        KvPeers(["*:*"])
