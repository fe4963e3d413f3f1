"""Caches made by KV handoff count against the per-caller cap (audit 2026-12-05, H1), through real
gRPC on the tiny transformers Llama with two authenticated callers.

Before, ``ImportKv`` (a push, or a pull from a ``--kv-peer``; the vLLM protocol's PD pull and a
migration's import go through the same code) never claimed against ``--max-caches-per-caller``:
one caller could import its way to the model's whole ``--max-caches`` (staged, header-only imports
included) and every other caller was refused. A sender that trickled one chunk just inside the idle
limit could also hold a staged import for as long as it liked; ``--kv-import-timeout`` bounds the
whole transfer.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from ferrum_client import Client, FerrumRpcError, pb

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.servers import InProcessServer, free_port
from .support.waits import wait_until

pytest.importorskip("transformers")

M = "tiny"
C = grpc.StatusCode
ALICE, BOB, PEER = "tok-alice", "tok-bob", "tok-peer"


def _executor(path):
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    return HfCausalLmExecutor.from_path(path, model_id=M, device="cpu", kv_budget_tokens=64 * 16)


def _err(fn) -> FerrumRpcError:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return FerrumRpcError.from_rpc_error(e.value)


def _source(c: Client, tokens=(5, 6, 7)) -> tuple[str, list[pb.ExportKvResponse]]:
    """A cache of ``c``'s and its export (header and chunks, one token per chunk)."""
    out = c.stub.Prefill(pb.PrefillRequest(model_id=M, input=pb.PrefillInput(token_ids=list(tokens))),
                         metadata=c.metadata).output
    msgs = list(c.stub.ExportKv(pb.ExportKvRequest(model_id=M, cache_id=out.cache.cache_id, max_chunk_bytes=1),
                                metadata=c.metadata))
    return out.cache.cache_id, msgs


def _push(msgs) -> list[pb.ImportKvRequest]:
    return [pb.ImportKvRequest(model_id=M, header=msgs[0].header)] + [pb.ImportKvRequest(chunk=x.chunk)
                                                                      for x in msgs[1:]]


def _bob_prefills(b: Client) -> str:
    return b.stub.Prefill(pb.PrefillRequest(model_id=M, input=pb.PrefillInput(token_ids=[9, 10])),
                          metadata=b.metadata).output.cache.cache_id


def test_pushed_and_pulled_imports_count_against_the_callers_cap(tiny_llama_dir):  # noqa: F811
    """The audit's probe: alice holds one cache and imports copies of it; at her cap of 8 the next
    push, and the next pull (the server pulling from a peer: here itself), are RESOURCE_EXHAUSTED
    "limit per caller is 8" with a RetryInfo. Bob is not affected."""
    port = free_port()
    with InProcessServer([_executor(tiny_llama_dir)], port=port, auth_tokens=[ALICE, BOB], kv_peer_tokens=[PEER],
                         kv_peers=[f"127.0.0.1:{port}"], max_caches=20, max_caches_per_caller=8) as srv, \
            Client(srv.target, token=ALICE) as a, Client(srv.target, token=BOB) as b:
        src, msgs = _source(a)
        pull = [pb.ImportKvRequest(model_id=M, source=pb.KvSource(target=srv.target, cache_id=src))]
        for k in range(7):  # pushes and pulls alike: alice then holds 8
            a.stub.ImportKv(iter(_push(msgs) if k % 2 else pull), metadata=a.metadata, timeout=30)
        reg = srv.models.get(M).executor.registry
        assert len(reg) == 8
        for stream in (_push(msgs), pull):
            e = _err(lambda: a.stub.ImportKv(iter(stream), metadata=a.metadata, timeout=30))
            assert e.code == C.RESOURCE_EXHAUSTED and "limit per caller is 8" in e.message, e
            assert e.retry_after_s and e.retry_after_s >= 1.0, "RetryInfo missing"
        assert len(reg) == 8 and reg.staged_imports == 0
        _bob_prefills(b)  # bob still gets caches
        a.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id=M, cache_id=src), metadata=a.metadata)
        a.stub.ImportKv(iter(_push(msgs)), metadata=a.metadata, timeout=30)  # room again


def test_staged_imports_count_while_they_trickle(tiny_llama_dir):  # noqa: F811
    """Header-only imports that never finish: alice's staged imports stop at her cap (the rest are
    refused at once), so bob still gets caches; before, 20 of them took the model's whole
    --max-caches and bob was refused "the limit is 20"."""
    with InProcessServer([_executor(tiny_llama_dir)], auth_tokens=[ALICE, BOB], max_caches=20,
                         max_caches_per_caller=8) as srv, \
            Client(srv.target, token=ALICE) as a, Client(srv.target, token=BOB) as b:
        src, msgs = _source(a)
        a.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id=M, cache_id=src), metadata=a.metadata)
        reg = srv.models.get(M).executor.registry
        assert wait_until(lambda: len(reg) == 0)
        gate = threading.Event()

        def header_only():
            yield _push(msgs)[0]
            gate.wait(60)

        futs = []
        try:
            for _ in range(20):
                futs.append(a.stub.ImportKv.future(header_only(), metadata=a.metadata, timeout=60))
                time.sleep(0.02)
            assert wait_until(lambda: sum(f.done() for f in futs) >= 12, timeout=20)
            refused = [f for f in futs if f.done()]
            for f in refused:
                e = FerrumRpcError.from_rpc_error(f.exception())
                assert e.code == C.RESOURCE_EXHAUSTED and "limit per caller is 8" in e.message, e
            assert wait_until(lambda: reg.staged_imports == 8), reg.staged_imports
            assert len(refused) == 12
            _bob_prefills(b)
        finally:
            gate.set()
            for f in futs:
                f.cancel()
        assert wait_until(lambda: reg.staged_imports == 0)


def test_an_import_that_trickles_is_dropped_at_the_total_deadline(tiny_llama_dir):  # noqa: F811
    """One chunk every 0.4 s never trips the 1.5 s idle limit; --kv-import-timeout 2 drops the
    import (DEADLINE_EXCEEDED naming the setting) and gives its KV back."""
    with InProcessServer([_executor(tiny_llama_dir)], auth_tokens=[ALICE, BOB], kv_import_idle_timeout=1.5,
                         kv_import_timeout=2.0) as srv, Client(srv.target, token=ALICE) as a:
        _, msgs = _source(a, tokens=range(5, 21))
        assert len(msgs) - 1 >= 16  # 16 tokens, one per chunk, per layer: at least 6.4 s at this pace
        reg = srv.models.get(M).executor.registry

        def trickle():
            for m in _push(msgs):
                yield m
                time.sleep(0.4)

        t0 = time.monotonic()
        e = _err(lambda: a.stub.ImportKv(trickle(), metadata=a.metadata, timeout=30))
        took = time.monotonic() - t0
        assert e.code == C.DEADLINE_EXCEEDED and "--kv-import-timeout" in e.message, e
        assert 1.8 < took < 5.0, took
        assert wait_until(lambda: reg.staged_imports == 0 and len(reg) == 1)


def test_the_vllm_pd_pull_counts_against_the_callers_cap(tiny_llama_dir):  # noqa: F811
    """SMG's PD decode leg pulls the prefill's cache with ImportKv: at alice's cap on the decode
    worker (here 1, held by a cache she pushed there) the leg is RESOURCE_EXHAUSTED; before,
    the pull made her a cache past it."""
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc

    from .support.vllm_calls import auth, gen_request, rpc_error

    common = {"auth_tokens": [ALICE, BOB], "kv_peer_tokens": [PEER]}
    with InProcessServer([_executor(tiny_llama_dir)], role="prefill", **common) as pre, \
            InProcessServer([_executor(tiny_llama_dir)], role="decode", kv_peers=[pre.target],
                            max_caches_per_caller=1, **common) as dec, \
            Client(dec.target, token=ALICE) as a, Client(pre.target, token=ALICE) as ap, \
            grpc.insecure_channel(pre.target) as pc, grpc.insecure_channel(dec.target) as dc:
        peng, deng = vllm_engine_pb2_grpc.VllmEngineStub(pc), vllm_engine_pb2_grpc.VllmEngineStub(dc)
        _, msgs = _source(ap)
        a.stub.ImportKv(iter(_push(msgs)), metadata=a.metadata, timeout=30)  # alice's one cache there
        ids = list(range(40, 80))
        leg = list(peng.Generate(gen_request(ids, max_tokens=1, ignore_eos=True, temperature=0.0),
                                 metadata=auth(ALICE), timeout=60))
        params = leg[-1].complete.kv_transfer_params_json
        assert params
        req = gen_request(ids, max_tokens=4, ignore_eos=True, temperature=0.0)
        req.kv_transfer_params_json = params
        e = rpc_error(lambda: list(deng.Generate(req, metadata=auth(ALICE), timeout=60)))
        assert e.code() == C.RESOURCE_EXHAUSTED and "limit per caller is 1" in e.details(), e
        assert len(dec.models.get(M).executor.registry) == 1


def test_the_registry_counts_each_callers_live_caches():
    """The per-caller cap reads a count the registry keeps as caches are made, given to a caller
    and freed (it scanned every live cache on each new one): the count follows each caller's
    caches exactly, and a cache given to another caller moves between the counts."""
    from ferrum_service.core.kv_registry import CacheRegistry

    reg = CacheRegistry("m", total_tokens=1000)
    made = [reg.create([1, 2]) for _ in range(5)]
    assert reg.held_by("") == 5 and reg.held_by("alice") == 0
    for e in made[:3]:
        reg.set_tenant(e, "alice")
    reg.set_tenant(made[3], "bob")
    assert (reg.held_by(""), reg.held_by("alice"), reg.held_by("bob")) == (1, 3, 1)
    reg.set_tenant(made[0], "bob")  # moved: one count down, the other up
    assert (reg.held_by("alice"), reg.held_by("bob")) == (2, 2)
    reg.release(made[1].cache_id)
    reg.release(made[1].cache_id)  # a second release of the same id counts nothing
    reg.release(made[4].cache_id)
    assert (reg.held_by(""), reg.held_by("alice"), reg.held_by("bob")) == (0, 1, 2)
    assert all(reg.held_by(t) == sum(1 for e in reg.entries() if e.tenant == t) for t in ("", "alice", "bob"))
    reg.set_tenant(made[1], "carol")  # a released cache is no longer counted anywhere
    assert reg.held_by("carol") == 0
