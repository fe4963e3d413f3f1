"""Packed steps of HfCausalLmExecutor: every row of a batched forward equals that row run alone,
whatever mixes of lengths, chunks, verify rows and block layouts share the step; a step's peak
memory follows its real tokens, not rows x longest."""

from __future__ import annotations

import pytest
import torch

from ferrum_service.executors.transformers import HfCausalLmExecutor
from ferrum_service.executors.transformers.packed_attention import ATTN_NAME, build_step
from ferrum_service.core.types import DecodeInput, LogitsPolicy, OutputMode, PrefillInput, UnifiedItem

from .conftest_models import ForwardCounter, tiny_llama, tiny_llama_dir  # noqa: F401
from .support.prompts import prompt_ids

TOL = 1e-4
NONE = LogitsPolicy(mode=OutputMode.NONE)


def _full(ex, tokens):
    with torch.inference_mode():
        return ex.model(input_ids=torch.tensor([tokens])).logits[0].float()


def _maxdiff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture
def ex(tiny_llama):
    e = HfCausalLmExecutor(tiny_llama.model, tiny_llama.tokenizer, model_id="tiny-packed", kv_budget_tokens=8192)
    yield e
    for entry in e.registry.entries():
        e.release_cache(entry.cache_id)
    assert e.prefix.used_blocks == 0


def _scattered(ex, tokens: list[int], spacer_seed: int) -> str:
    """A cache of ``tokens`` whose blocks are not one contiguous run: it is prefilled in 16-token
    chunks while another cache takes the block between each two of them."""
    cid, spacers = "", []
    for k in range(0, len(tokens), 16):
        o = ex.prefill(PrefillInput(token_ids=tokens[k : k + 16], cache_id=cid, policy=NONE))
        cid = o.cache.cache_id
        spacers.append(ex.prefill(PrefillInput(token_ids=prompt_ids(3, spacer_seed + k, lo=5, hi=512), policy=NONE)).cache.cache_id)
    for s in spacers:
        ex.release_cache(s)
    blocks = ex.registry.get(cid).payload.blocks
    assert blocks != list(range(blocks[0], blocks[0] + len(blocks)))
    return cid


def test_model_keeps_its_own_attention_outside_packed_steps(ex):
    assert ex.model.config._attn_implementation == ATTN_NAME
    assert ex.info().metadata["attn_implementation"] == "sdpa"
    # A padded batch through the plain model (no cache of ours) still masks its padding.
    a, b = prompt_ids(9, 1, lo=5, hi=512), prompt_ids(5, 2, lo=5, hi=512)
    ids = torch.tensor([a, [0] * 4 + b])
    mask = torch.tensor([[1] * 9, [0] * 4 + [1] * 5])
    with torch.inference_mode():
        out = ex.model(input_ids=ids, attention_mask=mask).logits
    assert _maxdiff(out[1, -1], _full(ex, b)[-1]) < TOL


def test_build_step_reads_contiguous_rows_in_place_and_gathers_only_scattered_ones(ex):
    contiguous = ex.prefill(PrefillInput(token_ids=prompt_ids(40, 3, lo=5, hi=512), policy=NONE)).cache.cache_id
    scattered = _scattered(ex, prompt_ids(40, 4, lo=5, hi=512), 100)
    blocks = {c: ex.registry.get(c).payload.blocks for c in (contiguous, scattered)}
    # Two-token rows (verify-like) are attended row by row.
    rows = [(blocks[c], 40, 2) for c in (contiguous, scattered)] + [([], 0, 7)]
    step = build_step(ex.pool, rows, ex.device)
    assert step.rows[0].run_start == blocks[contiguous][0]
    assert step.rows[1].run_start is None
    # Exactly the scattered row's own 3 blocks are gathered: no padding, no other row.
    assert step.gather_index.tolist() == blocks[scattered][:3]
    assert [(r.start, r.n) for r in step.rows] == [(0, 2), (2, 2), (4, 7)]
    assert step.rows[0].mask.shape == (2, 42) and step.group_index is None
    # Without the CPU op (tests/test_cpu_paged_attention.py covers it), one-token rows of similar
    # lengths share one call over exactly their blocks (padded to the group's longest with the null
    # block 0); a much longer row keeps them apart.
    short = ex.prefill(PrefillInput(token_ids=prompt_ids(20, 5, lo=5, hi=512), policy=NONE)).cache.cache_id
    step = build_step(ex.pool, [(blocks[contiguous], 40, 1), (blocks[scattered], 40, 1),
                                (ex.registry.get(short).payload.blocks, 20, 1)], ex.device, paged_op=False)
    assert step.group_index.tolist() == blocks[contiguous][:3] + blocks[scattered][:3] + ex.registry.get(
        short).payload.blocks[:2] + [0]
    assert step.group_mask.sum(-1).flatten().tolist() == [41, 41, 21] and step.gather_index is None
    long = ex.prefill(PrefillInput(token_ids=prompt_ids(200, 6, lo=5, hi=512), policy=NONE)).cache.cache_id
    step = build_step(ex.pool, [(blocks[contiguous], 40, 1), (ex.registry.get(long).payload.blocks, 200, 1)],
                      ex.device, paged_op=False)
    assert step.group_index is None  # too unequal: row by row


def test_mixed_step_rows_equal_each_row_alone(ex):
    """Fresh prompts of different lengths, a chunk continuing a cache (all positions, i.e. verify
    rows), and decodes on short, long, contiguous and scattered caches: one forward, and every
    row's logits equal that row's own full forward."""
    dec_prompts = [prompt_ids(1, 10, lo=5, hi=512), prompt_ids(15, 11, lo=5, hi=512), prompt_ids(33, 12, lo=5, hi=512), prompt_ids(70, 13, lo=5, hi=512)]
    dec_caches = [ex.prefill(PrefillInput(token_ids=p, policy=NONE)).cache.cache_id for p in dec_prompts]
    scat_prompt = prompt_ids(50, 14, lo=5, hi=512)
    dec_prompts.append(scat_prompt)
    dec_caches.append(_scattered(ex, scat_prompt, 200))
    nxt = [prompt_ids(1, 20 + i, lo=5, hi=512)[0] for i in range(len(dec_caches))]
    cont_prompt = prompt_ids(45, 30, lo=5, hi=512)
    cont = ex.prefill(PrefillInput(token_ids=cont_prompt[:20], policy=NONE)).cache.cache_id
    fresh = [prompt_ids(37, 40, lo=5, hi=512), prompt_ids(3, 41, lo=5, hi=512)]
    prefills = [PrefillInput(token_ids=p) for p in fresh]
    prefills.append(PrefillInput(token_ids=cont_prompt[20:], cache_id=cont, all_positions=True))
    decodes = [DecodeInput(cache_id=c, token_id=t) for c, t in zip(dec_caches, nxt)]
    with ForwardCounter(ex.model) as fc:
        p_out, d_out = ex.mixed_step(prefills, decodes)
    assert fc.calls == 1
    for o, p in zip(p_out[:2], fresh):
        assert _maxdiff(o.logits, _full(ex, p)[-1]) < TOL
    full = _full(ex, cont_prompt)
    assert p_out[2].all_logits.shape == (25, 512)
    assert _maxdiff(p_out[2].all_logits, full[20:]) < TOL
    for o, p, t in zip(d_out, dec_prompts, nxt):
        assert o.cache.num_tokens == len(p) + 1
        assert _maxdiff(o.logits, _full(ex, p + [t])[-1]) < TOL


def test_forward_verify_and_chunked_unified_steps_on_scattered_caches(ex):
    prompt, draft = prompt_ids(41, 50, lo=5, hi=512), prompt_ids(5, 51, lo=5, hi=512)
    cid = _scattered(ex, prompt, 300)
    v = ex.forward_verify(cid, draft, LogitsPolicy())
    full = _full(ex, prompt + draft)
    assert _maxdiff(v.rows, full[len(prompt) - 1 + 1 :]) < TOL
    # A prompt in three chunks next to a decode on the scattered cache, one forward each.
    other = prompt_ids(60, 52, lo=5, hi=512)
    seq = prompt + draft
    cache_id, pos = "", 0
    for k, chunk in enumerate([other[:16], other[16:40], other[40:]]):
        t = prompt_ids(1, 60 + k, lo=5, hi=512)[0]
        items = [UnifiedItem(seq_id="p", q_tokens=chunk, cache_id=cache_id, pos_offset=pos, is_final_chunk=k == 2),
                 UnifiedItem(seq_id="d", q_tokens=[t], cache_id=cid, pos_offset=len(seq))]
        res = ex.unified_decode(items)
        seq.append(t)
        cache_id, pos = res[0].cache.cache_id, pos + len(chunk)
        assert _maxdiff(res[1].logits, _full(ex, seq)[-1]) < TOL
    assert _maxdiff(res[0].logits, _full(ex, other)[-1]) < TOL


def _peak_bytes(fn) -> int:
    """Peak of the bytes the CPU allocator holds for tensors allocated while ``fn`` runs (every
    allocation and free torch's profiler records, replayed in time order)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.typed[0] == _EventType.Allocation:
            events.append((node.start_time_ns, node.typed[1].alloc_size))
    cur = peak = 0
    for _, size in sorted(events):
        cur += size
        peak = max(peak, cur)
    return peak


def test_step_peak_memory_follows_real_tokens_not_rows_times_longest(ex):
    """One 600-token sequence decoding next to seven 5-token ones: the step's transient memory is
    that of the long row alone plus the short rows, far below 8 rows x 600 tokens of K/V (what a
    step padded to its longest row gathers)."""
    long_contig = ex.prefill(PrefillInput(token_ids=prompt_ids(600, 70, lo=5, hi=512), policy=NONE)).cache.cache_id
    long_scat = _scattered(ex, prompt_ids(600, 71, lo=5, hi=512), 400)
    shorts = [ex.prefill(PrefillInput(token_ids=prompt_ids(5, 80 + i, lo=5, hi=512), policy=NONE)).cache.cache_id for i in range(7)]

    def step(caches):
        return lambda: ex.batch_decode([DecodeInput(cache_id=c, token_id=9) for c in caches])

    ex.batch_decode([DecodeInput(cache_id=c, token_id=9) for c in shorts])  # untimed warm-up
    short_only = _peak_bytes(step(shorts))
    padded = 8 * 608 * ex.pool.bytes_per_token // ex.num_layers  # one layer's K+V for 8 rows x 608
    for long in (long_contig, long_scat):
        alone = _peak_bytes(step([long]))
        mixed = _peak_bytes(step([long] + shorts))
        assert mixed <= 1.5 * (alone + short_only) + 16384, (mixed, alone, short_only)
        assert mixed < padded / 4, (mixed, padded)
