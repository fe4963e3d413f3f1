"""Decode steps as CUDA graphs, paged decode attention and device sampling, on a CUDA device.

Skipped without CUDA (CI has none); ``benchmarks/gpu_check.py`` runs this file first on a lent GPU.
The same logic's CPU counterparts run everywhere: ``test_decode_graphs.py`` (static buffers,
padding, fallback), ``test_paged_decode.py`` (the kernels' indexing, Triton under its
interpreter), ``test_device_sampling.py`` (the batch sampler)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


from ferrum_service.core.sampling import process_rows, sample_on_device  # noqa: E402
from ferrum_service.core.types import DecodeInput, LogitsPolicy, PrefillInput, SamplingParams  # noqa: E402
from ferrum_service.executors.transformers import HfCausalLmExecutor  # noqa: E402
from ferrum_service.executors.transformers import paged_decode as pd  # noqa: E402

from .conftest_models import tiny_llama_dir  # noqa: E402,F401
from .support.prompts import prompt_ids  # noqa: E402
from .test_decode_graphs import _greedy_run  # noqa: E402
from .test_paged_decode import _case  # noqa: E402


@pytest.fixture(scope="module")
def cuda_pair(tiny_llama_dir):
    mk = lambda mode, mid: HfCausalLmExecutor.from_path(tiny_llama_dir, model_id=mid, device="cuda",  # noqa: E731
                                                        dtype="fp32", kv_budget_tokens=8192, max_batch_size=16,
                                                        decode_graphs=mode)
    return mk("off", "tiny-eager"), mk("auto", "tiny-graphs")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_triton_kernel_matches_the_reference_on_cuda(dtype, seed):
    q, k, v, table, lengths = (t.cuda() for t in _case(seed, dtype=dtype, hq=9, hkv=3, d=64, bs=16, blocks=200,
                                                       width=16, rows=33))
    ref = pd.reference_decode(q.float(), k, v, table, lengths)
    got = pd.triton_decode(q, k, v, table, lengths).float()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert torch.allclose(got, ref, atol=tol, rtol=tol), (got - ref).abs().max()
    wide = torch.zeros(table.shape[0], 40, dtype=torch.int32, device="cuda")
    wide[:, :16] = table  # a strided view of a wider buffer, as the runner passes it
    assert torch.equal(pd.triton_decode(q, k, v, wide[:, :16], lengths), pd.triton_decode(q, k, v, table, lengths))
    assert torch.allclose(pd.gathered_decode(q, k, v, table, lengths).float(), ref, atol=tol, rtol=tol)
    for split in (1, 3, pd.SPLIT_BLOCKS):
        got = pd.triton_decode(q, k, v, wide[:, :16], lengths, blocks_per_split=split).float()
        assert torch.allclose(got, ref, atol=tol, rtol=tol), (split, (got - ref).abs().max())


def test_graphed_steps_give_the_eager_steps_tokens_and_logits(cuda_pair):
    eager, graphs = cuda_pair
    r = graphs.decode_runner
    assert r.capture and r.backend == "triton" and eager.decode_runner is None
    for rows in (1, 3, 8, 13):
        prompts = [prompt_ids(5 + 11 * i, 200 + rows + i, lo=5, hi=500) for i in range(rows)]
        replays = r.stats.replays
        t_e, l_e = _greedy_run(eager, prompts, 20)
        t_g, l_g = _greedy_run(graphs, prompts, 20)
        assert r.stats.replays - replays == 20
        assert t_g == t_e
        for a, b in zip(l_g, l_e):
            assert torch.allclose(a, b, atol=1e-3, rtol=1e-3), (a - b).abs().max()
    assert graphs.kv_capacity().used_bytes == 0


def test_warmup_captures_every_bucket_and_reports_their_memory(cuda_pair):
    _, graphs = cuda_pair
    graphs.warmup()
    m = graphs.info().metadata
    assert m["decode_graphs"] == "cuda-graphs" and m["decode_graph_buckets"] == "1,2,4,8,16"
    assert m["decode_graphs_captured"] >= 5 and m["decode_graph_bytes"] > 0


def test_padding_rows_leave_other_caches_alone_on_cuda(cuda_pair):
    _, ex = cuda_pair
    outs = ex.batch_prefill([PrefillInput(token_ids=prompt_ids(n, n, lo=5, hi=500)) for n in (5, 9, 30)])
    other = ex.batch_prefill([PrefillInput(token_ids=prompt_ids(40, 99, lo=5, hi=500))])[0]
    blocks = ex.registry.get(other.cache.cache_id).payload.blocks
    before = [t[blocks].clone() for t in (*ex.pool.k, *ex.pool.v)]
    for _ in range(5):  # 3 rows -> bucket 4: one padding row each step
        ex.batch_decode([DecodeInput(cache_id=o.cache.cache_id, token_id=11) for o in outs])
    after = [t[blocks] for t in (*ex.pool.k, *ex.pool.v)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    for o in outs + [other]:
        ex.release_cache(o.cache.cache_id)


def test_seeded_sampling_on_the_gpu_gives_the_cpu_tokens_at_fp32():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(16, 4096, generator=g) * 3
    pols = [LogitsPolicy(sampling=SamplingParams(temperature=0.9, top_p=0.95, top_k=(i % 3) * 20, seed=100 + i),
                         top_logprobs=i % 4) for i in range(16)]
    hist = [list(range(i, i + 10)) for i in range(16)]
    pos = [50 + i for i in range(16)]
    cpu = process_rows(rows, pols, hist, pos)
    gpu = sample_on_device(rows.cuda(), pols, hist, pos)
    assert [r.token_id for r in gpu] == [r.token_id for r in cpu]
    assert [r.logprob for r in gpu] == pytest.approx([r.logprob for r in cpu], abs=1e-4)
