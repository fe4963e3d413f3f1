"""Server-side speculation in ``Generate`` on the llama.cpp executor (SmolLM2 Q4_1): a copy task
whose drafts are mostly accepted gives plain decoding's greedy and seeded output, and leaves no
sequence id or KV cell behind (``support.llama.assert_books``)."""

from __future__ import annotations

import pytest

from ferrum_client import Client, pb, tpb

from .support import llama
from .support.servers import InProcessServer

PARAGRAPH = ("The committee met on Tuesday to review the budget for the new library. After a long discussion, "
             "the members agreed to fund the reading room and a small cafe near the entrance.")
PROMPT = f"{PARAGRAPH}\n\n{PARAGRAPH}\n\n{PARAGRAPH[:30]}"


@pytest.fixture(scope="module", params=["unified", "streams"])  # both KV layouts (issue 39)
def srv(request):
    ex = llama.executor("llama", n_seq=4, kv=request.param)
    with InProcessServer([ex]) as s:
        yield s


def _gen(c, spec=None, **kw):
    req = pb.GenerateRequest(model_id="llama", text=PROMPT, stop=pb.StopConditions(max_tokens=48, ignore_eos=True),
                             **kw)
    if spec is not None:
        req.speculation.CopyFrom(spec)
    evs = list(c.stub.Generate(req))
    return [e.token.token_id for e in evs if e.WhichOneof("event") == "token"], evs[-1].finished


@pytest.mark.parametrize("sampling", [None, tpb.SamplingParams(temperature=0.9, top_p=0.95, seed=5)])
def test_llama_cpp_speculation_equals_plain_decoding(srv, sampling):
    kw = {"sampling": sampling} if sampling is not None else {}
    with Client(srv.target) as c:
        plain, pf = _gen(c, **kw)
        spec, sf = _gen(c, pb.SpeculationOptions(max_draft_tokens=8), **kw)
    assert spec == plain
    assert sf.draft_tokens > 0 and pf.draft_tokens == 0
    if sampling is None:
        assert sf.accepted_draft_tokens >= 20  # the copy is mostly accepted
    host = next(iter(srv.models))
    srv.live_caches()
    llama.assert_books(host, idle=True)
