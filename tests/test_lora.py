"""LoRA adapters on the transformers executor: an adapter row equals the merged-weights model, a
mixed batch equals each row alone, caches are bound to their adapter, prefix keys include it,
residency is bounded (LRU), and every refusal. Tiny random adapters written by PEFT."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ferrum_client.prefix_keys import block_keys
from ferrum_service.core import errors
from ferrum_service.executors.transformers import HfCausalLmExecutor
from ferrum_service.testing.tiny_adapters import build_lora_adapter
from ferrum_service.testing.tiny_models import build_tiny_llama
from ferrum_service.core.types import DecodeInput, KvSlotRequest, PrefillInput, UnifiedItem

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .lora_fixtures import adapters  # noqa: F401 - fixture

TOL = 1e-4
P = [1, 5, 9, 33, 7, 100, 42, 8, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 30, 31, 2, 3]


def _ex(path, **kw) -> HfCausalLmExecutor:
    return HfCausalLmExecutor.from_path(path, model_id="tiny", device="cpu", kv_budget_tokens=4096, **kw)


@pytest.fixture
def ex(tiny_llama_dir, adapters):
    e = _ex(tiny_llama_dir)
    for name, (ad, _m) in adapters.items():
        e.load_adapter(name, str(ad))
    yield e
    for c in e.registry.entries():
        e.release_cache(c.cache_id)
    e.prefix.check()


@pytest.fixture(scope="module")
def merged(adapters):
    return {name: _ex(m) for name, (_a, m) in adapters.items()}


def _greedy(e, tokens, n, adapter="", bypass=True):
    """Greedy tokens and the logits rows of a prefill + n-1 decodes on one cache."""
    out = e.prefill(PrefillInput(token_ids=tokens, adapter=adapter, bypass_prefix_cache=bypass))
    rows, toks = [out.logits], [int(out.logits.argmax())]
    cid = out.cache.cache_id
    for _ in range(n - 1):
        d = e.decode(DecodeInput(cache_id=cid, token_id=toks[-1]))
        rows.append(d.logits)
        toks.append(int(d.logits.argmax()))
    e.release_cache(cid)
    return toks, torch.stack(rows)


def _close(a, b):
    assert (a - b).abs().max().item() < TOL, (a - b).abs().max().item()


def test_adapter_row_equals_merged_model(ex, merged):
    base_toks, base_rows = _greedy(ex, P, 6)
    for name, ref in merged.items():
        toks, rows = _greedy(ex, P, 6, adapter=name)
        want_toks, want_rows = _greedy(ref, P, 6)
        _close(rows, want_rows)
        assert toks == want_toks
        assert (rows - base_rows).abs().max().item() > 1e-2, f"{name} does not change the model"
    m = ex.lora_metrics()
    assert m["enabled"] and m["adapter_count"] == 3 and m["projection_applications"] > 0
    assert {k: v["rank"] for k, v in m["adapters"].items()} == {"a1": 4, "a2": 8, "a3": 2}


def test_mixed_batch_equals_rows_alone(ex):
    rows = [("a1", P), ("", P[:7]), ("a2", P[:11]), ("a1", P[3:18]), ("a3", P[:5])]
    alone = [ex.prefill(PrefillInput(token_ids=t, adapter=a, bypass_prefix_cache=True)) for a, t in rows]
    together = ex.batch_prefill([PrefillInput(token_ids=t, adapter=a, bypass_prefix_cache=True) for a, t in rows])
    for x, y in zip(alone, together):
        _close(x.logits, y.logits)
        assert x.cache.adapter == y.cache.adapter
    # One batched decode over caches of different lengths and adapters (the packed path) ...
    nxt = [int(o.logits.argmax()) for o in alone]
    d_alone = [ex.decode(DecodeInput(cache_id=o.cache.cache_id, token_id=t)) for o, t in zip(alone, nxt)]
    d_together = ex.batch_decode([DecodeInput(cache_id=o.cache.cache_id, token_id=t) for o, t in zip(together, nxt)])
    for x, y in zip(d_alone, d_together):
        _close(x.logits, y.logits)
    # ... and a unified step mixing a decode with an adapter and a new prompt with another.
    u = ex.unified_decode([
        UnifiedItem(seq_id="d", q_tokens=[5], cache_id=together[0].cache.cache_id, pos_offset=len(P) + 1),
        UnifiedItem(seq_id="p", q_tokens=P[:9], adapter="a3", bypass_prefix_cache=True),
    ])
    _close(u[0].logits, ex.decode(DecodeInput(cache_id=alone[0].cache.cache_id, token_id=5)).logits)
    _close(u[1].logits, ex.prefill(PrefillInput(token_ids=P[:9], adapter="a3", bypass_prefix_cache=True)).logits)
    assert u[1].cache.adapter == "a3"


def test_cache_is_bound_to_its_adapter(ex):
    a = ex.prefill(PrefillInput(token_ids=P, adapter="a1"))
    cid = a.cache.cache_id
    assert ex.registry.get(cid).adapter == "a1" and a.cache.adapter == "a1"
    with pytest.raises(errors.FerrumError) as e:
        ex.unified_decode([UnifiedItem(seq_id="x", q_tokens=[3], cache_id=cid, pos_offset=len(P), adapter="a2")])
    assert e.value.code.name == "FAILED_PRECONDITION" and "a1" in e.value.message
    assert ex.registry.get(cid).num_tokens == len(P)  # nothing ran
    base = ex.prefill(PrefillInput(token_ids=P))
    with pytest.raises(errors.FerrumError) as e:
        ex.batch_prefill([PrefillInput(token_ids=[4], cache_id=base.cache.cache_id, adapter="a1")])
    assert e.value.code.name == "FAILED_PRECONDITION" and "base model" in e.value.message
    # A fork keeps the adapter and continues exactly like its source.
    f, _shared = ex.fork_cache(cid, len(P))
    assert f.adapter == "a1"
    x = ex.decode(DecodeInput(cache_id=cid, token_id=9))
    y = ex.decode(DecodeInput(cache_id=f.cache_id, token_id=9))
    _close(x.logits, y.logits)
    # Unloading an adapter that live caches use is refused; after their release it goes.
    with pytest.raises(errors.FerrumError) as e:
        ex.unload_adapter("a1")
    assert e.value.code.name == "FAILED_PRECONDITION" and "2 live cache" in e.value.message
    ex.release_cache(cid)
    ex.release_cache(f.cache_id)
    unloaded, dropped = ex.unload_adapter("a1")
    assert unloaded and dropped == len(P) // ex.block_size  # its cached prompt block(s) went with it
    assert ex.unload_adapter("a1") == (False, 0)
    with pytest.raises(errors.FerrumError) as e:
        ex.prefill(PrefillInput(token_ids=P, adapter="a1"))
    assert e.value.code.name == "NOT_FOUND"
    ex.prefix.check()


def test_failed_first_step_leaves_an_empty_cache_unbound(ex):
    """An empty cache (ReserveKvSlots) is bound by its first step; a step that fails, in the
    forward or at the adapter lookup, unbinds it again: the adapter can be unloaded and the cache
    can still take another adapter."""
    r = ex.reserve_kv_slots([KvSlotRequest(cache_id="s", target_len=8, new_sequence=True)])
    cid = r.allocations[0].created_cache_id
    with pytest.raises(IndexError):  # a token id past the vocabulary fails inside the forward
        ex.unified_decode([UnifiedItem(seq_id="s", q_tokens=[1, 10**6], cache_id=cid, adapter="a1")])
    e = ex.registry.get(cid)
    assert e.adapter == "" and e.num_tokens == 0 and e.payload.adapter == ""
    assert e.payload.root == ex.prefix.root("", "")
    assert ex.adapter_bindings()["a1"] == 0
    with pytest.raises(errors.FerrumError) as err:  # an adapter that is not loaded: refused, unbound
        ex.unified_decode([UnifiedItem(seq_id="s", q_tokens=[1, 2], cache_id=cid, adapter="nope")])
    assert err.value.code.name == "NOT_FOUND"
    assert ex.registry.get(cid).adapter == ""
    assert ex.unload_adapter("a1") == (True, 0)
    out = ex.unified_decode([UnifiedItem(seq_id="s", q_tokens=[1, 2], cache_id=cid, adapter="a2")])
    assert len(out) == 1 and ex.registry.get(cid).adapter == "a2" and ex.registry.get(cid).num_tokens == 2
    ex.release_cache(cid)
    ex.prefix.check()


def test_prefix_keys_include_the_adapter(ex):
    bs = ex.block_size
    p = P * 3  # 66 tokens: 4 full blocks
    assert ex.prefill(PrefillInput(token_ids=p, adapter="a1")).cached_tokens == 0
    assert ex.prefill(PrefillInput(token_ids=p)).cached_tokens == 0  # the base model shares nothing with a1
    assert ex.prefill(PrefillInput(token_ids=p, adapter="a2")).cached_tokens == 0
    hit = ex.prefill(PrefillInput(token_ids=p, adapter="a1"))
    assert hit.cached_tokens == 4 * bs
    _close(hit.logits, ex.prefill(PrefillInput(token_ids=p, adapter="a1", bypass_prefix_cache=True)).logits)
    keys = block_keys(p, bs, model_id="tiny", adapter="a1")
    assert all(k in ex.prefix.index for k in keys)
    assert ex.prefix.index.keys().isdisjoint(block_keys(p, bs, model_id="tiny", adapter="a3"))
    assert block_keys(p, bs, model_id="tiny") != keys


def test_residency_is_bounded_lru(tiny_llama_dir, adapters, merged):
    e = _ex(tiny_llama_dir, max_adapters=2)
    for name, (ad, _m) in adapters.items():
        e.load_adapter(name, str(ad))
    assert sorted(a.name for a in e.adapters.resident) == ["a2", "a3"]  # a1, least recently used, went
    assert e.capabilities().max_adapters == 2 and e.capabilities().supports_lora
    for name in ("a1", "a2", "a3", "a1"):  # each step reads back what it needs
        toks, rows = _greedy(e, P, 2, adapter=name)
        _close(rows, _greedy(merged[name], P, 2)[1])
    m = e.lora_metrics()
    assert m["resident"] == 2 and m["loads"] >= 5 and m["evictions"] >= 3
    with pytest.raises(errors.FerrumError) as err:
        e.batch_prefill([PrefillInput(token_ids=P, adapter=n) for n in ("a1", "a2", "a3")])
    assert err.value.code.name == "RESOURCE_EXHAUSTED" and "at most 2" in err.value.message
    assert not e.registry.entries()


def test_changed_adapter_file_is_refused_on_reload(tiny_llama_dir, adapters, tmp_path):
    ad = shutil.copytree(adapters["a1"][0], tmp_path / "a1")
    e = _ex(tiny_llama_dir, max_adapters=1)
    e.load_adapter("x", str(ad))
    e.load_adapter("y", str(adapters["a2"][0]))  # x leaves device memory
    shutil.copy(adapters["a3"][0] / "adapter_model.safetensors", ad / "adapter_model.safetensors")
    with pytest.raises(errors.FerrumError) as err:
        e.prefill(PrefillInput(token_ids=P, adapter="x"))
    assert err.value.code.name == "FAILED_PRECONDITION" and "changed" in err.value.message


def test_load_refusals(ex, tiny_llama_dir, adapters, tmp_path):
    a1 = adapters["a1"][0]

    def refused(name, path, code, words):
        with pytest.raises(errors.FerrumError) as err:
            ex.load_adapter(name, str(path))
        assert err.value.code.name == code and words in err.value.message, err.value.message

    assert ex.load_adapter("a1", str(a1))[1] is False  # same name, same path: nothing read
    refused("a1", adapters["a2"][0], "ALREADY_EXISTS", "unload it first")
    refused("bad name!", a1, "INVALID_ARGUMENT", "letters, digits")
    refused("z", tmp_path / "missing", "INVALID_ARGUMENT", "not a directory")

    def variant(name, edit_cfg=None, pickled=False):
        d = shutil.copytree(a1, tmp_path / name)
        if edit_cfg:
            cfg = json.loads((d / "adapter_config.json").read_text())
            edit_cfg(cfg)
            (d / "adapter_config.json").write_text(json.dumps(cfg))
        if pickled:
            (d / "adapter_model.safetensors").rename(d / "adapter_model.bin")
        return d

    refused("p", variant("p", pickled=True), "INVALID_ARGUMENT", "pickled")
    refused("d", variant("d", lambda c: c.update(use_dora=True)), "INVALID_ARGUMENT", "DoRA")
    refused("b", variant("b", lambda c: c.update(bias="all")), "INVALID_ARGUMENT", "biases")
    refused("s", variant("s", lambda c: c.update(modules_to_save=["lm_head"])), "INVALID_ARGUMENT", "extra modules")
    refused("t", variant("t", lambda c: c.update(peft_type="PREFIX_TUNING")), "INVALID_ARGUMENT", "not a LoRA")
    # An adapter trained for another model (other widths) does not fit this one.
    other = build_tiny_llama(tmp_path / "wide", seed=5, hidden_size=96)
    refused("w", build_lora_adapter(other, tmp_path / "wide-lora", seed=1), "INVALID_ARGUMENT", "layer is")
    # The LM head is not a decoder-layer linear: refused, not silently ignored.
    refused("h", build_lora_adapter(tiny_llama_dir, tmp_path / "head", seed=1, targets=("lm_head",)),
            "INVALID_ARGUMENT", "lm_head")
    assert sorted(ex.adapters.adapters) == ["a1", "a2", "a3"]  # nothing half-registered


def test_executor_without_lora(tiny_llama_dir):
    e = _ex(tiny_llama_dir, max_adapters=0)
    assert not e.capabilities().supports_lora and e.lora_metrics() is None
    with pytest.raises(errors.FerrumError) as err:
        e.load_adapter("a", "/nowhere")
    assert err.value.code.name == "UNIMPLEMENTED"
