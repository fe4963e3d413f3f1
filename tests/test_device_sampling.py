"""The batch sampler that runs on the rows' device (``core/device_sampling.py``), checked on the CPU
against the per-row path (``core/sampling.py``): the same tokens for greedy and seeded rows, the
same log-probabilities and top lists, and unseeded draws inside each row's filtered support."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ferrum_service.core.device_sampling import choose_tokens, seeded_noise
from ferrum_service.core.logits_filters import filtered_probs, shaped_logits
from ferrum_service.core.sampling import process_rows, sample_on_device
from ferrum_service.core.sampling_torch import sample_row
from ferrum_service.core.types import LogitsPolicy, SamplingParams

V = 300


def pol(top_logprobs: int = 0, **kw) -> LogitsPolicy:
    return LogitsPolicy(sampling=SamplingParams(**kw), top_logprobs=top_logprobs)


def _mask(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return bytes((rng.random(V) < 0.3).astype(np.uint8))


def _policies():
    return [
        pol(),  # plain greedy
        pol(top_logprobs=5),
        pol(temperature=0.8, seed=11),
        pol(temperature=1.3, top_k=20, seed=12, top_logprobs=3),
        pol(temperature=1.0, top_p=0.9, seed=13),
        pol(temperature=0.7, min_p=0.05, seed=14),
        pol(temperature=1.1, top_k=50, top_p=0.8, min_p=0.01, repetition_penalty=1.3, seed=15),
        pol(repetition_penalty=1.5),  # greedy with a penalty over the history
        pol(temperature=0.9, token_mask=_mask(1), seed=16),
        pol(token_mask=_mask(2), top_logprobs=2),
        pol(temperature=2.0, top_k=1, seed=17),
    ]


@pytest.mark.parametrize("trial", range(6))
def test_same_tokens_logprobs_and_tops_as_the_per_row_path(trial):
    g = torch.Generator().manual_seed(trial)
    pols = _policies()
    rows = torch.randn(len(pols), V, generator=g) * 3
    hist = [torch.randint(0, V, (12,), generator=g).tolist() for _ in pols]
    pos = [40 + 7 * trial + i for i in range(len(pols))]
    want = process_rows(rows, pols, hist, pos)
    got = sample_on_device(rows, pols, hist, pos)
    for w, o in zip(want, got):
        assert o.token_id == w.token_id
        assert o.logprob == pytest.approx(w.logprob, abs=1e-5)
        assert [i for i, _ in o.top] == [i for i, _ in w.top]
        assert [x for _, x in o.top] == pytest.approx([x for _, x in w.top], abs=1e-5)
    # one row at a time through the reference sampler too (seeded and greedy rows)
    for i, p in enumerate(pols):
        assert sample_row(rows[i], p, hist[i], pos[i])[0] == got[i].token_id


def test_seeded_noise_is_what_multinomial_draws():
    probs = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(3)), -1)
    for seed, position in [(0, 0), (5, 17), (2**62, 9)]:
        gen = torch.Generator().manual_seed((seed + position) % (1 << 63))
        want = int(torch.multinomial(probs, 1, generator=gen))
        assert int((probs / seeded_noise(seed, position, V)).argmax()) == want


def test_unseeded_draws_stay_in_the_filtered_support():
    g = torch.Generator().manual_seed(9)
    pols = [pol(temperature=1.0, top_k=5), pol(temperature=1.0, top_p=0.5), pol(temperature=1.0, min_p=0.2)]
    rows = torch.randn(len(pols), V, generator=g) * 4
    _, probs = filtered_probs(shaped_logits(rows, pols, [[]] * 3), pols)
    seen = [set() for _ in pols]
    for _ in range(30):
        toks, _lp = choose_tokens(rows, pols, [[]] * 3, [0] * 3)
        for k, t in enumerate(toks.tolist()):
            assert probs[k, t] > 0
            seen[k].add(t)
    assert len(seen[0]) > 1  # it draws (not a disguised argmax)


def test_a_row_with_no_allowed_token_falls_back_like_the_cpu_path():
    rows = torch.randn(2, V, generator=torch.Generator().manual_seed(4))
    pols = [pol(temperature=1.0, seed=1, token_mask=bytes(V)), pol(temperature=1.0, seed=2)]
    want = process_rows(rows, pols, [[], []], [3, 4])
    got = sample_on_device(rows, pols, [[], []], [3, 4])
    assert [r.token_id for r in got] == [r.token_id for r in want]
