"""Gemma 2's attention-logit soft-capping in packed steps (issue 27, F12): every step that is not a
fresh prompt used to raise NotImplementedError (INTERNAL on the wire). Each row of decode steps
(one at a time, grouped), chunks continuing a cache and mixed steps now equals transformers' own
eager forward of the whole sequence, and a Generate through gRPC equals transformers' greedy
generation."""

from __future__ import annotations

import pytest
import torch

from ferrum_client import Client, pb

from ferrum_service.core.types import DecodeInput, LogitsPolicy, OutputMode, PrefillInput

from .support.servers import InProcessServer

TOL = 1e-4


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                       sliding_window=256, attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
                       initializer_range=0.2, eos_token_id=1, bos_token_id=2, pad_token_id=0)
    d = tmp_path_factory.mktemp("tiny-gemma2")
    Gemma2ForCausalLM(cfg).eval().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def reference(gemma2_dir):
    from transformers import Gemma2ForCausalLM

    return Gemma2ForCausalLM.from_pretrained(gemma2_dir, attn_implementation="eager").eval()


def _executor(d):
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    return HfCausalLmExecutor.from_path(d, model_id="g2", device="cpu", kv_budget_tokens=2048)


def _full(ref, ids) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


def test_softcapped_steps_equal_the_eager_forward(gemma2_dir, reference):
    ex = _executor(gemma2_dir)
    pol = LogitsPolicy(mode=OutputMode.FULL_LOGITS)
    seqs = [[5, 9, 33, 7, 100, 21, 3, 77, 8, 12, 40, 41],
            [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71],
            [200, 3, 4, 150, 151, 9, 9, 9, 30, 31, 32, 33]]
    full = [_full(reference, s) for s in seqs]
    outs = ex.batch_prefill([PrefillInput(token_ids=s[:4], policy=pol) for s in seqs])
    cids = [o.cache.cache_id for o in outs]
    for o, f in zip(outs, full):
        assert (o.logits.reshape(-1) - f[3]).abs().max() < TOL
    # a chunk continuing each cache (rows with a past, several tokens: the masked per-row path)
    outs = ex.batch_prefill([PrefillInput(token_ids=s[4:7], cache_id=c, policy=pol) for s, c in zip(seqs, cids)])
    for o, f in zip(outs, full):
        assert (o.logits.reshape(-1) - f[6]).abs().max() < TOL
    # grouped decodes (one-token rows of similar lengths in one batched call)
    for j in range(7, 10):
        outs = ex.batch_decode([DecodeInput(cache_id=c, token_id=s[j], policy=pol) for s, c in zip(seqs, cids)])
        for o, f in zip(outs, full):
            assert (o.logits.reshape(-1) - f[j]).abs().max() < TOL
    # a single decode, and a mixed step (a new prompt beside a decode)
    o = ex.decode(DecodeInput(cache_id=cids[0], token_id=seqs[0][10], policy=pol))
    assert (o.logits.reshape(-1) - full[0][10]).abs().max() < TOL
    new = [11, 12, 13, 14, 15]
    pre, dec = ex.mixed_step([PrefillInput(token_ids=new, policy=pol)],
                             [DecodeInput(cache_id=cids[1], token_id=seqs[1][10], policy=pol)])
    assert (pre[0].logits.reshape(-1) - _full(reference, new)[-1]).abs().max() < TOL
    assert (dec[0].logits.reshape(-1) - full[1][10]).abs().max() < TOL
    for c in cids + [pre[0].cache.cache_id]:
        ex.release_cache(c)


def test_generate_through_grpc_equals_transformers_greedy(gemma2_dir, reference):
    prompt = [5, 9, 33, 7, 100, 21]
    with torch.no_grad():
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                  min_new_tokens=12)[0, len(prompt):].tolist()
    with InProcessServer([_executor(gemma2_dir)]) as srv, Client(srv.target) as c:
        evs = list(c.stub.Generate(pb.GenerateRequest(model_id="g2", token_ids=pb.TokenIds(token_ids=prompt),
                                                      stop=pb.StopConditions(max_tokens=12, ignore_eos=True))))
        got = [e.token.token_id for e in evs if e.WhichOneof("event") == "token"]
        assert got == want
        assert srv.live_caches() == {"g2": 0}
