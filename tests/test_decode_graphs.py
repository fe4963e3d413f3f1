"""The static decode path (``decode_graphs.py``) on the CPU: what a CUDA graph replays, run eagerly.

Two executors over the same tiny random-weight Llama: one with today's packed path
(``decode_graphs="off"``, the CPU default) and one whose decode-only steps go through the static
buffers, padded to their bucket (``decode_graphs="static"``). They must give the same logits and
greedy tokens, padding rows must not write into any cache's blocks, and steps the static path does
not take must fall back to the packed path."""

from __future__ import annotations

import pytest
import torch

from ferrum_service.core.types import DecodeInput, LogitsPolicy, PrefillInput
from ferrum_service.executors.transformers import HfCausalLmExecutor
from ferrum_service.executors.transformers.decode_graphs import (
    DecodeRunner,
    batch_buckets,
    bucket_for,
    max_table_blocks,
    width_buckets,
)
from ferrum_service.executors.transformers.forward import Row
from ferrum_service.core.steps import Want

from .conftest_models import tiny_llama_dir  # noqa: F401
from .support.prompts import prompt_ids


def test_buckets_are_powers_of_two_up_to_the_limit():
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 32]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert batch_buckets(1) == [1]
    assert [bucket_for(n, batch_buckets(48)) for n in (1, 3, 5, 17, 33, 48, 49)] == [1, 4, 8, 32, 48, 48, None]
    assert width_buckets(64) == [8, 16, 32, 64] and width_buckets(5) == [5]
    assert max_table_blocks(1024, 16) == 64 and max_table_blocks(1000, 16) == 63


def _pair(path, **kw):
    mk = lambda mode, mid: HfCausalLmExecutor.from_path(path, model_id=mid, device="cpu", dtype="fp32",  # noqa: E731
                                                        kv_budget_tokens=4096, max_batch_size=8,
                                                        decode_graphs=mode, **kw)
    return mk("off", "tiny-eager"), mk("static", "tiny-static")


@pytest.fixture(scope="module")
def pair(tiny_llama_dir):
    return _pair(tiny_llama_dir)


def _greedy_run(ex, prompts, steps):
    """Prefill ``prompts``, then ``steps`` greedy batch_decode steps: (tokens, logits per step)."""
    outs = ex.batch_prefill([PrefillInput(token_ids=p) for p in prompts])
    caches = [o.cache.cache_id for o in outs]
    toks = [int(o.logits.argmax()) for o in outs]
    seen, logits = [list(toks)], []
    try:
        for _ in range(steps):
            dec = ex.batch_decode([DecodeInput(cache_id=c, token_id=t) for c, t in zip(caches, toks)])
            logits.append(torch.stack([d.logits for d in dec]))
            toks = [int(d.logits.argmax()) for d in dec]
            seen.append(list(toks))
    finally:
        for c in caches:
            ex.release_cache(c)
    return seen, logits


#: How far the static and the packed path's fp32 logits may be apart: they sum in different orders
#: (padded buckets vs packed rows), 2.6e-5 apart on logits of ~2.5 on one host's CPU kernels (under
#: 1e-5 on another); a wrong position, block or row gives differences of order 1.
FP32_TOL = 1e-4


@pytest.mark.parametrize("rows", [1, 3, 5, 8])
def test_static_path_gives_the_packed_paths_logits_and_tokens(pair, rows):
    eager, static = pair
    assert eager.decode_runner is None and static.decode_runner is not None
    prompts = [prompt_ids(7 + 9 * i, 100 + rows + i, lo=5, hi=500) for i in range(rows)]
    before = static.decode_runner.stats.static_runs
    t_e, l_e = _greedy_run(eager, prompts, 12)  # 7 + 12 crosses block boundaries (block size 16)
    t_s, l_s = _greedy_run(static, prompts, 12)
    assert static.decode_runner.stats.static_runs - before == 12  # every decode step took the static path
    assert t_s == t_e
    for a, b in zip(l_s, l_e):
        assert torch.allclose(a, b, atol=FP32_TOL, rtol=FP32_TOL), (a - b).abs().max()
    assert static.kv_capacity().used_bytes == 0


def test_gathered_backend_matches_too(tiny_llama_dir):
    eager, static = _pair(tiny_llama_dir)
    r = static.decode_runner
    static.decode_runner = static.forward_rows.decode_runner = DecodeRunner(
        static.model, static.pool, max_rows=8, max_blocks=r.max_blocks, pad_id=0, capture=False, backend="gathered")
    assert static.decode_runner.widths == [8, 16, 32, 64]
    prompts = [prompt_ids(n, 7 + n, lo=5, hi=500) for n in (3, 40, 130)]  # widths 1, 3 and 9 blocks: two buckets
    t_e, l_e = _greedy_run(eager, prompts, 6)
    t_s, l_s = _greedy_run(static, prompts, 6)
    assert t_s == t_e and static.decode_runner.stats.static_runs == 6
    for a, b in zip(l_s, l_e):
        assert torch.allclose(a, b, atol=FP32_TOL, rtol=FP32_TOL)


def test_padding_rows_write_only_the_spare_block(pair):
    _, ex = pair
    pool = ex.pool
    outs = ex.batch_prefill([PrefillInput(token_ids=prompt_ids(n, n, lo=5, hi=500)) for n in (5, 21, 16)])
    try:
        for t in (*pool.k, *pool.v):
            t[pool.spare_block].fill_(7.0)  # so the padding row's write shows
        k0 = [t.clone() for t in pool.k]
        v0 = [t.clone() for t in pool.v]
        handles = [o.cache for o in outs]
        held = {b for h in handles for b in ex.registry.get(h.cache_id).payload.blocks}
        ex.batch_decode([DecodeInput(cache_id=h.cache_id, token_id=11) for h in handles])  # 3 rows -> bucket 4
        bs = pool.block_size
        written, grown = set(), set()
        for h in handles:
            blocks = ex.registry.get(h.cache_id).payload.blocks
            written.add(blocks[h.num_tokens // bs] * bs + h.num_tokens % bs)
            grown |= {s for b in blocks if b not in held for s in range(b * bs, (b + 1) * bs)}
        assert grown  # the 16-token prompt grew a block (zeroed when handed out)
        spare = set(range(pool.spare_block * bs, (pool.spare_block + 1) * bs))
        for before, after in zip(k0 + v0, list(pool.k) + list(pool.v)):
            flat_b, flat_a = before.view(-1, *before.shape[2:]), after.view(-1, *after.shape[2:])
            # never-handed-out blocks hold torch.empty's bytes, NaN among them: NaN == NaN is "unchanged"
            same = (flat_b == flat_a) | (flat_b.isnan() & flat_a.isnan())
            changed = {int(i) for i in (~same).flatten(1).any(1).nonzero().flatten()}
            assert written <= changed  # the real rows' new slots
            # nothing else outside the spare block, except a grown block's slots, zeroed when handed out
            others = changed - spare - written
            assert others <= grown and all(not flat_a[i].any() for i in others)
            assert pool.spare_block * bs in changed  # the padding row wrote its slot 0 of the spare block
        assert torch.count_nonzero(torch.stack([t[0] for t in pool.k])) == 0  # the null block stays zero
    finally:
        for o in outs:
            ex.release_cache(o.cache.cache_id)


def test_steps_the_static_path_does_not_take_fall_back(pair):
    eager, ex = pair
    r = ex.decode_runner
    assert r.key_for([Row([1], 3, [5, 6], Want.LAST)]) == "not decode-only"
    assert r.key_for([Row([1], 0, [5], Want.LAST)]) == "not decode-only"
    assert r.key_for([Row([1], 3, [5], Want.ALL)]) == "all positions"
    assert r.key_for([Row([1], 3, [5], Want.LAST)] * 9) == "rows"
    assert r.key_for([Row(list(range(1, 70)), 64 * 16, [5], Want.LAST)]) == "blocks"
    assert r.key_for([Row([1], 3, [5], Want.LAST)] * 3) == (4, r.max_blocks)
    # a verify step (every position's logits) is declined and runs on the packed path, same logits
    declined = r.stats.declined.get("not decode-only", 0)
    rows = {}
    for e in (eager, ex):
        (a,) = e.batch_prefill([PrefillInput(token_ids=prompt_ids(9, 3, lo=5, hi=500))])
        rows[e.model_id] = e.forward_verify(a.cache.cache_id, [7, 8, 9], LogitsPolicy()).rows.clone()
        e.release_cache(a.cache.cache_id)
    assert r.stats.declined["not decode-only"] == declined + 2  # the prompt's step, then the verify step
    assert torch.allclose(rows["tiny-eager"], rows["tiny-static"], atol=FP32_TOL)


def test_info_reports_the_path_and_the_pool_is_unchanged(pair):
    eager, ex = pair
    m = ex.info().metadata
    assert m["decode_graphs"] == "static-eager" and m["decode_graph_buckets"] == "1,2,4,8"
    assert m["decode_attention"] in ("cpu-op", "gathered") and m["decode_graph_bytes"] == 0
    assert "decode_graphs" not in eager.info().metadata
    a, b = eager.kv_capacity(), ex.kv_capacity()
    assert (a.total_blocks, a.total_bytes) == (b.total_blocks, b.total_bytes)  # the spare block counts nowhere
    assert ex.pool.spare_block not in ex.pool._free and max(ex.pool._free) <= ex.pool.num_blocks  # never handed out
    assert ex.pool.spare_block == ex.pool.num_blocks + 1 and eager.pool.spare_block is None


def test_cuda_graphs_setting_values(tiny_llama_dir):
    from ferrum_service.core.errors import FerrumError
    from ferrum_service.executors.transformers.executor import decode_mode

    assert decode_mode("auto", torch.device("cpu")) == "off"
    assert decode_mode("auto", torch.device("cuda", 0)) == "graphs"
    assert decode_mode("off", torch.device("cuda", 0)) == "off"
    with pytest.raises(FerrumError, match="decode_graphs='sometimes'"):
        decode_mode("sometimes", torch.device("cpu"))


def test_the_setting_and_the_spec_option_reach_the_executor(tiny_llama_dir):
    from ferrum_service.core import settings
    from ferrum_service.hosting.model_specs import build_executor, parse_spec

    st = settings.resolve("serve", {"cuda_graphs": "off"}, {})
    assert str(st["cuda_graphs"]) == "off" and str(settings.default("cuda_graphs")) == "auto"
    spec = f"hf-causal-lm,id=t,path={tiny_llama_dir},kv_budget_tokens=512"
    assert build_executor(parse_spec(spec), device="cpu", cuda_graphs="auto").decode_runner is None  # CPU: off
    ex = build_executor(parse_spec(spec + ",decode_graphs=static"), device="cpu", cuda_graphs="off")
    assert ex.decode_runner is not None and not ex.decode_runner.capture  # the spec's option wins
