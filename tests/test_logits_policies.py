"""What each call can ask back: sampled tokens (seeded), full logits in three dtypes, top-k."""

from __future__ import annotations

import math

import numpy as np

from ferrum_client import messages as m

# ConfigurableModelExecutor rows: 10.0 at the scripted token, 0.0 elsewhere (V = 1000).
LOGP_TARGET = 10.0 - math.log(math.exp(10.0) + 999)


def test_default_is_a_greedy_token_without_logits(client):
    out = client.prefill("mock", [1]).output.output
    assert out.token_id == 10 and abs(out.logprob - LOGP_TARGET) < 1e-5
    assert not out.HasField("logits") and len(out.top_logprobs) == 0


def test_full_logits_in_fp32_fp16_bf16(client):
    for dtype, nbytes in (("fp32", 4), ("fp16", 2), ("bf16", 2)):
        out = client.prefill("mock", [1], policy=m.full_logits(dtype)).output.output
        assert not out.HasField("token_id")
        assert list(out.logits.shape) == [1000] and len(out.logits.data) == 1000 * nbytes
        row = m.logits_array(out)
        assert row[10] == 10.0 and np.count_nonzero(row) == 1


def test_top_logprobs(client):
    out = client.prefill("mock", [1], policy=m.top_logprobs(3)).output.output
    assert not out.HasField("token_id")
    assert [t.token_id for t in out.top_logprobs][0] == 10
    assert abs(out.top_logprobs[0].logprob - LOGP_TARGET) < 1e-5
    assert len(out.top_logprobs) == 3
    out = client.prefill("mock", [1], policy=m.greedy(top_logprobs=2)).output.output
    assert out.token_id == 10 and len(out.top_logprobs) == 2


def _sample(client, seed, n=12, **kw):
    cid = client.prefill("stub", [1]).output.cache.cache_id
    policy = m.sampled(m.sampling(temperature=1.0, seed=seed, **kw))
    toks = [client.decode("stub", cid, 1, policy=policy).output.output.token_id for _ in range(n)]
    client.release_cache("stub", cid)
    return toks


def test_same_seed_same_tokens(client):
    # stub logits are all zero: sampling is uniform over 100 tokens, so tokens depend on the seed only
    a, b, c = _sample(client, 7), _sample(client, 7), _sample(client, 8)
    assert a == b
    assert a != c
    assert len(set(a)) > 3


def test_top_k_and_mask_restrict_sampling(client):
    mask = bytes(1 if i in (3, 5) else 0 for i in range(100))
    toks = _sample(client, 1, n=20, token_mask=mask)
    assert set(toks) <= {3, 5} and len(set(toks)) == 2
    greedy_masked = client.decode("stub", client.prefill("stub", [1]).output.cache.cache_id, 1,
                                  policy=m.sampled(m.sampling(token_mask=mask))).output.output
    assert greedy_masked.token_id == 3
