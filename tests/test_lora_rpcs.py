"""LoRA adapters over the wire: LoadAdapter / ListAdapters / UnloadAdapter (admin-gated), the
`adapter` field on Prefill, UnifiedDecode and Generate, adapter-bound caches, mixed adapters in
one batched Generate step, block events, LoraMetrics, preloading from the command line.

A real server on a loopback port: the tiny random-weight llama, next to its merged-weights twins
(the reference an adapter's output must equal), raw stubs (the contract itself)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from ferrum_client import Client, pb
from ferrum_client.prefix_keys import block_keys, chain_root
from ferrum_service.executors.configurable import ConfigurableModelExecutor
from ferrum_service.executors.transformers import HfCausalLmExecutor

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .lora_fixtures import adapters  # noqa: F401 - fixture
from .support.servers import InProcessServer, ServerProcess
from .support.waits import subscribe_from_now

P = [1, 5, 9, 33, 7, 100, 42, 8, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 30, 31, 2, 3, 44, 45, 46, 47, 48, 49,
     50, 51, 52, 53, 54, 55]


def _hf(path, model_id, **kw):
    return HfCausalLmExecutor.from_path(path, model_id=model_id, device="cpu", kv_budget_tokens=4096, **kw)


@pytest.fixture(scope="module")
def srv(tiny_llama_dir, adapters):
    exs = [_hf(tiny_llama_dir, "tiny", max_adapters=2)]
    exs += [_hf(m, f"{name}-merged", max_adapters=0) for name, (_a, m) in adapters.items()]
    exs.append(ConfigurableModelExecutor.with_token_sequence(1000, [7], model_id="seq"))
    with InProcessServer(exs, open_admin_rpcs=True) as s:
        yield s


def _code(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), e.value.details()


def _generate(c, model, max_tokens=8, **kw):
    req = pb.GenerateRequest(model_id=model, token_ids=pb.TokenIds(token_ids=P),
                             stop=pb.StopConditions(max_tokens=max_tokens, ignore_eos=True), **kw)
    events = list(c.stub.Generate(req))
    return [e.token.token_id for e in events if e.WhichOneof("event") == "token"], events


def _load(c, name, path, model="tiny"):
    return c.stub.LoadAdapter(pb.LoadAdapterRequest(model_id=model, name=name, path=str(path)))


def test_load_list_generate_unload(srv, adapters):
    with Client(srv.target) as c:
        caps = c.stub.Capabilities(pb.CapabilitiesRequest(model_id="tiny")).capabilities
        assert caps.supports_lora and caps.max_adapters == 2
        r = _load(c, "a1", adapters["a1"][0])
        assert r.loaded and r.adapter.rank == 4 and r.adapter.resident and r.load_ns > 0
        assert sorted(r.adapter.target_modules) == sorted(
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        assert not _load(c, "a1", adapters["a1"][0]).loaded  # idempotent
        _load(c, "a2", adapters["a2"][0])
        listed = {a.name: a for a in c.stub.ListAdapters(pb.ListAdaptersRequest()).adapters}
        assert set(listed) == {"a1", "a2"} and listed["a2"].rank == 8 and listed["a1"].model_id == "tiny"

        for name in ("a1", "a2"):
            got, events = _generate(c, "tiny", adapter=name)
            want, _ = _generate(c, f"{name}-merged")
            assert got == want, name
            assert events[0].started.cache.adapter == name
        base, _ = _generate(c, "tiny")
        assert base != _generate(c, "tiny", adapter="a1")[0]
        # n samples fork the prompt's cache: every sample runs with the adapter
        _, events = _generate(c, "tiny", adapter="a1", n=2)
        per_sample = {0: [], 1: []}
        for e in events:
            if e.WhichOneof("event") == "token":
                per_sample[e.token.sample_index].append(e.token.token_id)
        assert per_sample[0] == per_sample[1] == _generate(c, "a1-merged")[0]

        # a cache bound to a1: unload refused while it lives, steps with another adapter refused
        out = c.stub.Prefill(pb.PrefillRequest(model_id="tiny", input=pb.PrefillInput(token_ids=P, adapter="a1"))).output
        assert out.cache.adapter == "a1"
        code, msg = _code(lambda: c.stub.UnloadAdapter(pb.UnloadAdapterRequest(model_id="tiny", name="a1")))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "live cache" in msg
        code, msg = _code(lambda: c.stub.Prefill(pb.PrefillRequest(model_id="tiny", input=pb.PrefillInput(
            token_ids=[3], cache_id=out.cache.cache_id, adapter="a2"))))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "input.adapter" in msg
        code, msg = _code(lambda: list(c.stub.Generate(pb.GenerateRequest(
            model_id="tiny", cache_id=out.cache.cache_id, last_token_id=3, adapter="a2"))))
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        # the cache's own adapter continues it: same token as the merged model's decode
        d = c.stub.Decode(pb.DecodeRequest(model_id="tiny", input=pb.DecodeInput(cache_id=out.cache.cache_id,
                                                                                token_id=P[0])))
        assert d.output.cache.adapter == "a1"
        m = c.stub.LoraMetrics(pb.LoraMetricsRequest(model_id="tiny")).metrics
        assert m["enabled"] and m["adapter_count"] == 2 and m["active_cache_bindings"] == 1
        assert m["projection_applications"] > 0
        c.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id="tiny", cache_id=out.cache.cache_id))
        u = c.stub.UnloadAdapter(pb.UnloadAdapterRequest(model_id="tiny", name="a1"))
        assert u.unloaded and u.dropped_blocks >= 2  # the prompt's cached blocks went with it
        assert not c.stub.UnloadAdapter(pb.UnloadAdapterRequest(model_id="tiny", name="a1")).unloaded
        code, msg = _code(lambda: _generate(c, "tiny", adapter="a1"))
        assert code == grpc.StatusCode.NOT_FOUND and "a1" in msg
        c.stub.UnloadAdapter(pb.UnloadAdapterRequest(model_id="tiny", name="a2"))


def test_mixed_adapters_in_one_batched_generate(srv, adapters):
    """Concurrent streams with different adapters (and none) share the batcher's steps; each one's
    tokens equal its merged model's."""
    with Client(srv.target) as c:
        _load(c, "a1", adapters["a1"][0])
        _load(c, "a3", adapters["a3"][0])
        want = {"a1": _generate(c, "a1-merged", 12)[0], "a3": _generate(c, "a3-merged", 12)[0],
                "": _generate(c, "tiny", 12)[0]}
        jobs = ["a1", "a3", "", "a1", "a3", ""]
        with ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(lambda a: _generate(c, "tiny", 12, adapter=a)[0], jobs))
        for a, toks in zip(jobs, got):
            assert toks == want[a], a
        m = c.stub.LoraMetrics(pb.LoraMetricsRequest(model_id="tiny")).metrics
        assert m["adapters"]["a1"]["steps"] >= 12 and m["adapters"]["a3"]["steps"] >= 12
        pm = srv.server.metrics
        assert pm.value("ferrum_lora_adapter_steps_total", {"model": "tiny", "adapter": "a1"}) == \
            m["adapters"]["a1"]["steps"]
        assert pm.value("ferrum_lora_resident_adapters", {"model": "tiny"}) == 2
        assert pm.value("ferrum_lora_loads_total", {"model": "tiny"}) >= 2
        for a in ("a1", "a3"):
            c.stub.UnloadAdapter(pb.UnloadAdapterRequest(model_id="tiny", name=a))


def test_block_events_and_keys_carry_the_adapter(srv, adapters):
    got: list = []
    with Client(srv.target) as c:
        _load(c, "a2", adapters["a2"][0])
        call = subscribe_from_now(c, "tiny", include_block_events=True)  # misses nothing from here on

        def read():
            for ev in call:
                if ev.WhichOneof("message") == "block_event" and ev.block_event.WhichOneof("data") == "stored":
                    got.append(ev.block_event.stored)
                    return

        t = threading.Thread(target=read, daemon=True)
        t.start()
        p = [int(x) for x in range(200, 240)]
        out = c.stub.Prefill(pb.PrefillRequest(model_id="tiny", input=pb.PrefillInput(token_ids=p, adapter="a2"))).output
        t.join(10)
        call.cancel()
        stored = got[0]
        assert stored.adapter == "a2"
        assert list(stored.block_hashes) == block_keys(p, 16, model_id="tiny", adapter="a2")
        assert stored.parent_block_hash == chain_root("tiny", adapter="a2")
        again = c.stub.Prefill(pb.PrefillRequest(model_id="tiny", input=pb.PrefillInput(token_ids=p, adapter="a2")))
        base = c.stub.Prefill(pb.PrefillRequest(model_id="tiny", input=pb.PrefillInput(token_ids=p)))
        assert (again.output.cached_tokens, base.output.cached_tokens) == (32, 0)
        for o in (out, again.output, base.output):
            c.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id="tiny", cache_id=o.cache.cache_id))
        c.stub.UnloadAdapter(pb.UnloadAdapterRequest(model_id="tiny", name="a2"))


def test_refusals_on_the_wire(srv, adapters, tmp_path):
    with Client(srv.target) as c:
        code, msg = _code(lambda: _load(c, "x", adapters["a1"][0], model="seq"))
        assert code == grpc.StatusCode.UNIMPLEMENTED
        code, msg = _code(lambda: _generate(c, "seq", adapter="a1"))
        assert code == grpc.StatusCode.UNIMPLEMENTED and "adapter" in msg
        code, msg = _code(lambda: c.stub.UnifiedDecode(pb.UnifiedDecodeRequest(model_id="tiny", items=[
            pb.UnifiedBatchItem(seq_id="s", q_tokens=[1, 2], is_final_chunk=True, adapter="nope")])))
        assert code == grpc.StatusCode.NOT_FOUND and "items[0].adapter" in msg
        code, msg = _code(lambda: _load(c, "x", tmp_path))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "adapter_model.safetensors" in msg
        code, msg = _code(lambda: _load(c, "x", ""))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        _load(c, "a1", adapters["a1"][0])
        code, msg = _code(lambda: _load(c, "a1", adapters["a2"][0]))
        assert code == grpc.StatusCode.ALREADY_EXISTS
        c.stub.UnloadAdapter(pb.UnloadAdapterRequest(model_id="tiny", name="a1"))


def test_admin_rpcs_are_gated(tiny_llama_dir, adapters):
    ex = _hf(tiny_llama_dir, "tiny")
    with InProcessServer([ex]) as closed, Client(closed.target) as c:
        code, msg = _code(lambda: _load(c, "a1", adapters["a1"][0]))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "--open-admin-rpcs" in msg
        assert not c.stub.ListAdapters(pb.ListAdaptersRequest()).adapters  # listing is not admin
    ex2 = _hf(tiny_llama_dir, "tiny")
    req = pb.LoadAdapterRequest(model_id="tiny", name="a1", path=str(adapters["a1"][0]))
    with InProcessServer([ex2], auth_tokens=["user"], admin_tokens=["root"]) as s, Client(s.target) as c:
        def load(token):
            return c.stub.LoadAdapter(req, metadata=(("authorization", f"Bearer {token}"),))

        assert _code(lambda: load("user"))[0] == grpc.StatusCode.PERMISSION_DENIED
        assert load("root").loaded


def test_preload_from_the_command_line(tiny_llama_dir, adapters):
    spec = f"hf-causal-lm,id=tiny,path={tiny_llama_dir},max_adapters=3,adapter.a2={adapters['a2'][0]}"
    with ServerProcess("--model", spec, "--adapter", f"tiny:a1={adapters['a1'][0]}",
                       "--adapter", f"a3={adapters['a3'][0]}") as proc, Client(proc.target) as c:
        listed = sorted(a.name for a in c.stub.ListAdapters(pb.ListAdaptersRequest(model_id="tiny")).adapters)
        assert listed == ["a1", "a2", "a3"]
        assert c.stub.Capabilities(pb.CapabilitiesRequest(model_id="tiny")).capabilities.max_adapters == 3
        req = pb.GenerateRequest(model_id="tiny", token_ids=pb.TokenIds(token_ids=P), adapter="a3",
                                 stop=pb.StopConditions(max_tokens=4, ignore_eos=True))
        assert sum(1 for e in c.stub.Generate(req) if e.WhichOneof("event") == "token") == 4


def test_preload_settings_from_flags_spec_and_yaml(tmp_path):
    """Where preloaded adapters come from: ``--adapter [MODEL:]NAME=PATH``, ``adapter.NAME=PATH`` in
    a spec, ``adapters: {NAME: PATH}`` under a model in the YAML config; bad flags are refused."""
    from ferrum_service.cli import build_parser, resolve_serve_settings

    cfg = tmp_path / "ferrum.yaml"
    cfg.write_text("models:\n"
                   "  - {executor: hf-causal-lm, id: tiny, path: /m/tiny, max_adapters: 2,\n"
                   "     adapters: {sql: /ad/sql, chat: /ad/chat}}\n"
                   "  - {executor: minilm}\n")
    st = resolve_serve_settings(build_parser().parse_args(
        ["serve", "--config", str(cfg), "--adapter", "code=/ad/code", "--adapter", "tiny:sql=/ad/sql2"]))
    assert st["adapters"] == {"tiny": {"sql": "/ad/sql2", "chat": "/ad/chat", "code": "/ad/code"}, "minilm": {}}
    st = resolve_serve_settings(build_parser().parse_args(
        ["serve", "--model", "hf-causal-lm,id=a,path=/m,adapter.x=/ad/x", "--model", "hf-causal-lm,id=b,path=/m"]))
    assert st["adapters"] == {"a": {"x": "/ad/x"}, "b": {}}
    from ferrum_service.core.settings import SettingError

    for bad in (["--adapter", "x=/p"], ["--adapter", "nope:x=/p"], ["--adapter", "x"]):
        with pytest.raises(SettingError, match="--adapter"):  # serve prints it and exits 2
            resolve_serve_settings(build_parser().parse_args(
                ["serve", "--model", "hf-causal-lm,id=a,path=/m", "--model", "hf-causal-lm,id=b,path=/m", *bad]))
