"""ferrum's ``NoSelectableFiniteLogit`` on the wire (issue 40): a greedy row whose token mask,
together with its structured-output constraint, leaves no finite logit answers
``LogitsOutput.no_selectable_finite_logit`` and no token — a real server, the tiny random-weight
llama, xgrammar masks."""

from __future__ import annotations

import numpy as np

from ferrum_client import Client, messages as m, pb, tpb
from ferrum_service.executors.transformers import HfCausalLmExecutor

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.prompts import prompt_ids
from .support.servers import InProcessServer

M = "tiny"


def _policy(mode: tpb.LogitsPolicy, mask: bytes | None = None) -> tpb.LogitsPolicy:
    mode.sampling.constraint.CopyFrom(tpb.OutputConstraint(regex="[0-9]+"))
    if mask is not None:
        mode.sampling.token_mask = mask
    return mode


def _prefill(c: Client, policy: tpb.LogitsPolicy) -> pb.PrefillOutput:
    return c.stub.Prefill(pb.PrefillRequest(model_id=M, input=pb.PrefillInput(
        token_ids=prompt_ids(12, 1), logits=policy)), metadata=c.metadata).output


def test_a_mask_that_leaves_no_finite_logit_is_its_own_answer(tiny_llama_dir):
    ex = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id=M, device="cpu", kv_budget_tokens=1024)
    with InProcessServer([ex]) as s, Client(s.target) as c:
        full = _prefill(c, _policy(m.full_logits()))
        row = m.logits_array(full.output)
        refused, allowed = np.flatnonzero(~np.isfinite(row)), np.flatnonzero(np.isfinite(row))
        assert refused.size and allowed.size  # the constraint masked some tokens, not all
        vocab = row.shape[0]

        def mask(*ids: int) -> bytes:
            b = bytearray(vocab)
            for i in ids:
                b[i] = 1
            return bytes(b)

        none = _prefill(c, _policy(m.greedy(), mask(int(refused[0]), int(refused[-1])))).output
        assert none.no_selectable_finite_logit and not none.HasField("token_id") and none.logprob == 0.0
        some = _prefill(c, _policy(m.greedy(), mask(int(refused[0]), int(allowed[0])))).output
        assert not some.no_selectable_finite_logit and some.token_id == int(allowed[0])
        plain = _prefill(c, _policy(m.greedy())).output
        assert not plain.no_selectable_finite_logit and plain.token_id in set(allowed.tolist())
        c.release_cache(M, full.cache.cache_id)  # the others go with the server
