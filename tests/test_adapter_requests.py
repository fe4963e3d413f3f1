"""The Python client's LoRA surface, without a server: the request messages its builders make
(``adapter=`` on prefill inputs, unified items, Generate and Session steps; LoadAdapter,
UnloadAdapter, ListAdapters), the methods both clients get from them, and prefix keys / the
prefix mirror with an adapter. Live behaviour is in ``tests/test_lora*.py``."""

from __future__ import annotations

import hashlib
import inspect

import pytest

from ferrum_client import AsyncClient, Client, pb, tpb
from ferrum_client import messages as m
from ferrum_client import prefix_keys as pk
from ferrum_client import requests as rq
from ferrum_client.prefix_mirror import PrefixMirror, recipe_usable

pytestmark = pytest.mark.timeout(60)

SERVICE = pb.DESCRIPTOR.services_by_name["ModelExecutor"]


def test_adapter_rpc_requests():
    assert rq.load_adapter("sql", "/adapters/sql", "tiny") == pb.LoadAdapterRequest(
        model_id="tiny", name="sql", path="/adapters/sql")
    assert rq.load_adapter("sql", "/adapters/sql") == pb.LoadAdapterRequest(name="sql", path="/adapters/sql")
    assert rq.unload_adapter("sql", model_id="tiny") == pb.UnloadAdapterRequest(model_id="tiny", name="sql")
    assert rq.UNARY["list_adapters"].build("tiny") == pb.ListAdaptersRequest(model_id="tiny")
    assert rq.UNARY["list_adapters"].build() == pb.ListAdaptersRequest()
    assert rq.UNARY["lora_metrics"].build("tiny") == pb.LoraMetricsRequest(model_id="tiny")
    for name, args in [("load_adapter", ("sql", "/p")), ("unload_adapter", ("sql",)), ("list_adapters", ())]:
        spec = rq.UNARY[name]  # each builder makes the request its RPC takes
        assert spec.build(*args).DESCRIPTOR is SERVICE.methods_by_name[spec.rpc].input_type


@pytest.mark.parametrize("cls", [Client, AsyncClient])
def test_both_clients_have_the_adapter_methods(cls):
    for name, rpc, params in [("load_adapter", "LoadAdapter", ["self", "name", "path", "model_id", "timeout"]),
                              ("unload_adapter", "UnloadAdapter", ["self", "name", "model_id", "timeout"]),
                              ("list_adapters", "ListAdapters", ["self", "model_id", "timeout"]),
                              ("lora_metrics", "LoraMetrics", ["self", "model_id", "timeout"])]:
        method = getattr(cls, name)
        sig = inspect.signature(method)
        assert list(sig.parameters) == params
        assert sig.parameters["model_id"].default == ""
        assert f"RPC ``{rpc}``" in method.__doc__
        assert rq.UNARY[name].rpc == rpc and rpc in SERVICE.methods_by_name
    assert inspect.iscoroutinefunction(AsyncClient.load_adapter)


def test_adapter_on_prefill_inputs_and_requests():
    inp = m.prefill_input([1, 2, 3], adapter="sql", cache_salt="t")
    assert (inp.adapter, inp.cache_salt, list(inp.token_ids)) == ("sql", "t", [1, 2, 3])
    assert m.prefill_input([1]).adapter == ""
    req = rq.prefill("tiny", [1, 2, 3], reserve_tokens=8, adapter="sql")
    assert req.model_id == "tiny" and req.input.adapter == "sql" and req.input.reserve_tokens == 8
    # continuing a cache: empty = the cache's own adapter (nothing sent)
    assert not rq.prefill("tiny", [4], cache_id="c1").input.adapter
    batch = rq.batch_prefill("tiny", [[1, 2], m.prefill_input([3, 4], adapter="sql")])
    assert [i.adapter for i in batch.inputs] == ["", "sql"]


def test_adapter_on_unified_items_and_generate():
    item = m.unified_item([1, 2, 3], seq_id="s1", adapter="sql", is_final_chunk=False)
    assert (item.adapter, item.seq_id, item.is_final_chunk) == ("sql", "s1", False)
    req = rq.unified_decode("tiny", [item, m.unified_item([7], cache_id="c1", pos_offset=3)])
    assert [i.adapter for i in req.items] == ["sql", ""]
    gen = m.generate_request("tiny", token_ids=[1, 2], adapter="sql", cache_salt="t", max_tokens=4)
    assert (gen.adapter, gen.cache_salt, gen.stop.max_tokens) == ("sql", "t", 4)
    assert m.generate_request("tiny", text="hi").adapter == ""


def test_adapter_in_session_steps():
    env = rq.session_request(3, rq.prefill("tiny", [1, 2], adapter="sql"))
    assert env.step_id == 3 and env.WhichOneof("step") == "prefill" and env.prefill.input.adapter == "sql"
    env = rq.session_request(4, rq.unified_decode("tiny", [m.unified_item([1], adapter="sql")]))
    assert env.unified_decode.items[0].adapter == "sql"


def test_prefix_keys_fold_in_the_adapter():
    root = pk.chain_root("smollm2", adapter="sql")
    assert root == hashlib.sha256(b"ferrum-prefix-v1\0smollm2\0\0sql").digest()
    # the values docs/contract.md shows ("LoRA adapters")
    assert root.hex() == "dface100585335f896783f9c629ed2d79ce215bce6ad7beba4c5d0f8e6abfaad"
    assert pk.block_keys([1, 2, 3, 4], 4, model_id="smollm2", adapter="sql")[0].hex() == (
        "92d60358c17235b71cc285e82c518b6b194f97da6d50176c0229a2fc490f809c")
    # the base model's keys are what they were before adapters
    assert pk.chain_root("smollm2", adapter="") == pk.chain_root("smollm2")


def _recipe(extra_keys) -> tpb.PrefixCacheRecipe:
    return tpb.PrefixCacheRecipe(enabled=True, algorithm=pk.ALGORITHM, block_size=4, seed=pk.SEED,
                                 extra_keys=list(extra_keys))


def test_mirror_keys_follow_the_adapter():
    prompt = list(range(100, 112))  # 3 full blocks of 4
    keys = pk.block_keys(prompt, 4, model_id="tiny", adapter="sql")
    mir = PrefixMirror()
    mir.recipes["tiny"] = _recipe(pk.EXTRA_KEYS)
    mir.apply(pb.KvBlockEvent(seq=1, model_id="tiny", stored=pb.KvBlockStored(
        block_hashes=keys, parent_block_hash=pk.chain_root("tiny", adapter="sql"), token_ids=prompt,
        block_size=4, adapter="sql")))
    assert mir.cached_tokens("tiny", prompt, adapter="sql") == 12
    assert mir.cached_tokens("tiny", prompt) == 0  # the base model's blocks are other blocks
    assert mir.cached_tokens("tiny", prompt, adapter="other") == 0


def test_a_recipe_from_before_adapters_keys_base_model_prompts_only():
    old = _recipe(["model_id", "cache_salt"])
    assert recipe_usable(old) and not recipe_usable(old, adapter="sql")
    assert recipe_usable(_recipe(pk.EXTRA_KEYS), adapter="sql")
    prompt = list(range(8))
    mir = PrefixMirror()
    mir.recipes["tiny"] = old
    assert mir.prompt_keys("tiny", prompt) == pk.block_keys(prompt, 4, model_id="tiny")
    assert mir.prompt_keys("tiny", prompt, adapter="sql") == []
