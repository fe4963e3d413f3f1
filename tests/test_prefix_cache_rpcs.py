"""Prefix caching over the wire: cached_tokens, ForkCache (RPC and Session step), Generate n,
block events on SubscribeKvEvents, pool counts in KvCapacity / Loads / Prometheus, the flag.

Real server on a loopback port, the tiny random-weight llama (raw stubs: the contract itself)."""

from __future__ import annotations

import threading

import grpc
import pytest
from ferrum_client import Client, pb, tpb
from ferrum_client.prefix_keys import block_keys, chain_root

from ferrum_service.core.steps import RowKind
from ferrum_service.executors.transformers import HfCausalLmExecutor

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.prompts import prompt_ids
from .support.servers import InProcessServer, ServerProcess
from .support.waits import subscribe_from_now, wait_no_live_caches

BS = 16


@pytest.fixture
def srv(tiny_llama_dir):
    ex = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=64 * BS)
    with InProcessServer([ex]) as s:
        yield s
        for e in ex.registry.entries():
            ex.release_cache(e.cache_id)
        ex.prefix.check()
        assert not ex.prefix.refs


def _prefill(c: Client, tokens, **kw) -> pb.PrefillOutput:
    req = pb.PrefillRequest(model_id="tiny", input=pb.PrefillInput(token_ids=tokens, **kw))
    return c.stub.Prefill(req).output


def _release(c: Client, cache_id: str) -> None:
    c.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id="tiny", cache_id=cache_id))


def test_info_capabilities_and_cached_tokens(srv):
    with Client(srv.target) as c:
        info = c.stub.Info(pb.InfoRequest(model_id="tiny")).models[0]
        r = info.prefix_cache
        assert (r.enabled, r.algorithm, r.block_size, r.seed, list(r.extra_keys)) == (
            True, "sha256-chain-v1", BS, "ferrum-prefix-v1", ["model_id", "cache_salt", "adapter"])
        caps = c.stub.Capabilities(pb.CapabilitiesRequest(model_id="tiny")).capabilities
        assert caps.supports_prefix_caching and caps.supports_fork
        p = prompt_ids(50)
        a = _prefill(c, p)
        b = _prefill(c, p + [1, 2])
        assert (a.cached_tokens, b.cached_tokens) == (0, 48)
        assert a.output.token_id == _prefill(c, p, bypass_prefix_cache=True).output.token_id
        assert _prefill(c, p, cache_salt="other").cached_tokens == 0
        (res,) = c.stub.UnifiedDecode(pb.UnifiedDecodeRequest(model_id="tiny", items=[
            pb.UnifiedBatchItem(seq_id="x", q_tokens=p, is_final_chunk=True)])).results
        assert res.cached_tokens == 48 and res.output.token_id == a.output.token_id
        with pytest.raises(grpc.RpcError) as e:
            _prefill(c, p, cache_salt="s" * 2000)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in e.value.details()


def test_fork_cache_rpc_and_session_step(srv):
    with Client(srv.target) as c:
        p = prompt_ids(40)
        a = _prefill(c, p)
        f = c.stub.ForkCache(pb.ForkCacheRequest(model_id="tiny", cache_id=a.cache.cache_id, keep_tokens=36))
        assert f.cache.num_tokens == 36 and f.shared_blocks == 3 and f.cache.cache_id != a.cache.cache_id
        # the fork continues exactly as a fresh prompt of the same 37 tokens
        d = c.stub.Decode(pb.DecodeRequest(model_id="tiny", input=pb.DecodeInput(cache_id=f.cache.cache_id,
                                                                                token_id=p[36])))
        fresh = _prefill(c, p[:37], bypass_prefix_cache=True)
        assert d.output.output.token_id == fresh.output.token_id
        for bad, code in ((dict(keep_tokens=0), grpc.StatusCode.OUT_OF_RANGE),
                          (dict(keep_tokens=41), grpc.StatusCode.OUT_OF_RANGE),
                          (dict(reserve_tokens=10**6), grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(grpc.RpcError) as e:
                c.stub.ForkCache(pb.ForkCacheRequest(model_id="tiny", cache_id=a.cache.cache_id, **bad))
            assert e.value.code() == code, bad
        with pytest.raises(grpc.RpcError) as e:
            c.stub.ForkCache(pb.ForkCacheRequest(model_id="tiny", cache_id="hf-unknown"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        for cid in (a.cache.cache_id, f.cache.cache_id, fresh.cache.cache_id):
            _release(c, cid)
        # a Session's fork belongs to the Session: closing it frees the fork
        import queue

        requests: queue.Queue = queue.Queue()
        stream = c.stub.Session(iter(requests.get, None))
        requests.put(pb.SessionRequest(step_id=1, prefill=pb.PrefillRequest(
            model_id="tiny", input=pb.PrefillInput(token_ids=p))))
        out = next(stream)
        requests.put(pb.SessionRequest(step_id=2, fork_cache=pb.ForkCacheRequest(
            model_id="tiny", cache_id=out.prefill.output.cache.cache_id)))
        fk = next(stream)
        assert fk.step_id == 2 and fk.fork_cache.cache.num_tokens == 40 and fk.fork_cache.shared_blocks == 3
        assert srv.live_caches()["tiny"] == 2
        requests.put(None)
        assert list(stream) == []
    assert wait_no_live_caches(srv, timeout=5)["tiny"] == 0


def _generate(c: Client, prompt, **kw):
    req = pb.GenerateRequest(model_id="tiny", token_ids=pb.TokenIds(token_ids=prompt),
                             stop=pb.StopConditions(max_tokens=kw.pop("max_tokens", 6), ignore_eos=True), **kw)
    return list(c.stub.Generate(req))


def _samples(events) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for ev in events:
        if ev.WhichOneof("event") == "token":
            out.setdefault(ev.token.sample_index, []).append(ev.token.token_id)
    return out


def test_generate_n_samples_share_the_prompt_and_reproduce(srv):
    with Client(srv.target) as c:
        p = prompt_ids(70)
        sampling = tpb.SamplingParams(temperature=1.0, seed=123)
        evs = _generate(c, p, n=4, sampling=sampling)
        kinds = [e.WhichOneof("event") for e in evs]
        assert kinds[0] == "started" and kinds.count("started") == 1 and kinds.count("finished") == 4
        assert kinds[-1] == "finished"
        assert sorted(e.finished.sample_index for e in evs if e.WhichOneof("event") == "finished") == [0, 1, 2, 3]
        got = _samples(evs)
        assert sorted(got) == [0, 1, 2, 3] and all(len(t) == 6 for t in got.values())
        assert len({tuple(t) for t in got.values()}) > 1, "four seeded samples were all the same"
        assert _samples(_generate(c, p, n=4, sampling=sampling)) == got  # same seeds, same samples
        # sample 0 is what n=1 gives; greedy samples all agree with it
        assert _samples(_generate(c, p, sampling=sampling))[0] == got[0]
        greedy = _samples(_generate(c, p, n=3))
        assert greedy[0] == greedy[1] == greedy[2]
        with pytest.raises(grpc.RpcError) as e:
            _generate(c, p, n=65)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert srv.live_caches()["tiny"] == 0


def test_a_cached_prompt_joins_running_streams_in_one_chunk(srv):
    """Chunked prefill budgets computed tokens: a prompt whose prefix is cached joins the running
    decodes with its cached tokens plus at most one budget of new ones."""
    host = srv.models.get("tiny")
    host.batcher.prefill_tokens_per_step = 16
    steps = []
    real_step = host.step

    def spy(plan, **kw):
        steps.append(([len(r.tokens) for r in plan.rows if r.kind is RowKind.PROMPT],
                      sum(1 for r in plan.rows if r.kind is RowKind.DECODE)))
        return real_step(plan, **kw)

    host.step = spy
    with Client(srv.target) as c:
        long = prompt_ids(100, 9)
        _release(c, _prefill(c, long[:96]).cache.cache_id)  # 96 tokens cached (6 blocks)
        running = c.stub.Generate(pb.GenerateRequest(model_id="tiny", token_ids=pb.TokenIds(token_ids=[3, 4]),
                                                     stop=pb.StopConditions(max_tokens=30, ignore_eos=True)))
        next(running)
        late = _generate(c, long, max_tokens=2)
        assert late[0].started.cached_tokens == 96
        list(running)
    joined = [chunks for chunks, d in steps if chunks and d]
    assert [100] in joined, steps  # 96 cached + 4 new tokens in one step beside the decode


def test_capacity_loads_and_metrics_read_the_pool(srv):
    with Client(srv.target) as c:
        p = prompt_ids(64)
        a = _prefill(c, p)
        forks = [c.stub.ForkCache(pb.ForkCacheRequest(model_id="tiny", cache_id=a.cache.cache_id))
                 for _ in range(3)]
        cap = c.stub.KvCapacity(pb.KvCapacityRequest(model_id="tiny")).capacity
        assert cap.used_tokens == 4 * 64  # per cache ...
        assert cap.used_bytes == 4 * 16 * 64 * cap.bytes_per_token // 64  # ... but four blocks held once
        assert (cap.total_blocks, cap.free_blocks, cap.block_size) == (64, 60, BS)
        for f in forks:
            _release(c, f.cache.cache_id)
        _release(c, a.cache.cache_id)
        cap = c.stub.KvCapacity(pb.KvCapacityRequest(model_id="tiny")).capacity
        assert (cap.evictable_blocks, cap.cached_blocks, cap.free_tokens) == (4, 4, 64 * BS)
        _prefill(c, p)
        (load,) = c.stub.Loads(pb.LoadsRequest(model_id="tiny")).loads
        assert (load.total_blocks, load.free_blocks, load.cached_blocks) == (64, 60, 4)
        assert load.prefix_hit_tokens == 63 and load.prefix_queried_tokens == 128
        metrics = c.stub.CacheMetrics(pb.CacheMetricsRequest(model_id="tiny")).metrics
        assert metrics["prefix_cache"]["hit_tokens"] == 63
    m = srv.server.metrics
    assert m.value("ferrum_prefix_hit_tokens_total", {"model": "tiny"}) == 63
    assert m.value("ferrum_prefix_cached_blocks", {"model": "tiny"}) == 4


def test_block_events_carry_the_advertised_keys(srv):
    got: list = []
    with Client(srv.target) as c:
        # from now on, whenever the server registers them: no sleep until they are live
        call = subscribe_from_now(c, "tiny", include_block_events=True)
        plain = subscribe_from_now(c, "tiny")

        def read(stream, sink, n):
            for ev in stream:
                sink.append(ev)
                if len(sink) >= n:
                    return

        cache_only: list = []
        readers = [threading.Thread(target=read, args=(call, got, 3), daemon=True),
                   threading.Thread(target=read, args=(plain, cache_only, 2), daemon=True)]
        for t in readers:
            t.start()
        p = prompt_ids(40)
        a = _prefill(c, p, cache_salt="t1")
        _release(c, a.cache.cache_id)
        for t in readers:
            t.join(10)
        call.cancel()
        plain.cancel()
    kinds = [e.WhichOneof("message") for e in got]
    assert kinds == ["event", "block_event", "event"], kinds  # created, stored, released
    stored = got[1].block_event.stored
    assert list(stored.block_hashes) == block_keys(p, BS, model_id="tiny", cache_salt="t1")
    assert stored.parent_block_hash == chain_root("tiny", "t1")
    assert list(stored.token_ids) == p[:32] and stored.block_size == BS
    assert [e.WhichOneof("message") for e in cache_only] == ["event", "event"]
    assert got[1].block_event.seq == got[0].event.seq + 1


def test_no_prefix_cache_flag(tiny_llama_dir):
    spec = f"hf-causal-lm,id=tiny,path={tiny_llama_dir}"
    with ServerProcess("--model", spec, "--no-prefix-cache") as proc, Client(proc.target) as c:
        assert not c.stub.Info(pb.InfoRequest(model_id="tiny")).models[0].prefix_cache.enabled
        p = prompt_ids(40)
        _prefill(c, p)
        assert _prefill(c, p).cached_tokens == 0
        f = c.stub.ForkCache(pb.ForkCacheRequest(model_id="tiny", cache_id=_prefill(c, p).cache.cache_id))
        assert f.shared_blocks == 3  # forks still share
