"""ForkCache and Generate n on the llama.cpp executor (``llama_memory_seq_cp``: the fork shares
the source's KV cells in llama.cpp's unified cache)."""

from __future__ import annotations

import random

import pytest

from ferrum_client import Client, pb, tpb
from ferrum_service.core.types import DecodeInput, PrefillInput

from .support.servers import InProcessServer
from .support.llama import assert_no_leak, maxdiff
from .support.packaged import smollm2_gguf_path

pytest.importorskip("llama_cpp")

# Besides the per-batch quantisation noise of test_llama_cpp.TOL, a sequence whose KV cells were
# placed in another order (cells freed by another sequence's truncation are reused) sums its
# attention in another order, which llama.cpp's CPU kernels do in fp16: up to ~1 logit here.
TOL = 1.5


@pytest.fixture(scope="module")
def llc():
    from ferrum_service.executors.llama_cpp import LlamaCppExecutor

    return LlamaCppExecutor(smollm2_gguf_path(), model_id="smollm2", threads=2, n_ctx=1024)


def _fresh(ex, tokens):
    out = ex.prefill(PrefillInput(tokens))
    ex.release_cache(out.cache.cache_id)
    return out.logits


def _same(a, b) -> None:
    assert int(a.argmax()) == int(b.argmax())
    assert maxdiff(a, b) < TOL


def test_forks_diverge_independently(llc):
    rng = random.Random(3)
    p = [rng.randrange(100, 40000) for _ in range(60)]
    a = llc.prefill(PrefillInput(p))
    f, shared = llc.fork_cache(a.cache.cache_id, 50)
    assert shared == 50 and f.num_tokens == 50
    _same(llc.decode(DecodeInput(f.cache_id, 7)).logits, _fresh(llc, p[:50] + [7]))
    _same(llc.decode(DecodeInput(a.cache.cache_id, 9)).logits, _fresh(llc, p + [9]))
    llc.truncate_kv(a.cache.cache_id, 10)
    _same(llc.decode(DecodeInput(f.cache_id, 11)).logits, _fresh(llc, p[:50] + [7, 11]))
    llc.release_cache(a.cache.cache_id)
    _same(llc.decode(DecodeInput(f.cache_id, 12)).logits, _fresh(llc, p[:50] + [7, 11, 12]))
    llc.release_cache(f.cache_id)
    assert_no_leak(llc)


def test_generate_n_on_llama_cpp(llc):
    with InProcessServer([llc]) as srv, Client(srv.target) as c:
        req = pb.GenerateRequest(model_id="smollm2", text="Once upon a time", n=3,
                                 sampling=tpb.SamplingParams(temperature=0.8, seed=7),
                                 stop=pb.StopConditions(max_tokens=5, ignore_eos=True))
        evs = list(c.stub.Generate(req))
        samples = _by_sample(evs)
        assert sorted(samples) == [0, 1, 2] and all(len(t) == 5 for t in samples.values())
        assert [e.WhichOneof("event") for e in evs].count("finished") == 3
        assert _by_sample(c.stub.Generate(req)) == samples  # same seeds, same samples
    assert_no_leak(llc)


def _by_sample(events) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for ev in events:
        if ev.WhichOneof("event") == "token":
            out.setdefault(ev.token.sample_index, []).append(ev.token.token_id)
    return out
