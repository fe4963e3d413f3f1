"""Server-side speculation in ``Generate`` (speculation.py): output equals plain decoding (greedy
identical, seeded sampling token-identical, unseeded sampling distributed the same), the KV of
rejected drafts is dropped, stop conditions / keep_cache / n>1 behave as without it, bad options are
INVALID_ARGUMENT naming the field, and acceptance is reported per request and in Prometheus.

Real server on a loopback port with two tiny transformers models: the random-weight llama (its
drafts are mostly rejected, and its output depends on the whole context, so KV left behind by a
rejected draft would change it) and the same model made to count (each token's successor is
token + 1 whatever the context, so a prompt holding counting runs has its drafts accepted).
"""

from __future__ import annotations

import collections
import random
import threading
from types import SimpleNamespace

import grpc
import pytest
import torch

from ferrum_client import Client, pb, tpb
from ferrum_service.core import speculation
from ferrum_service.executors.transformers import HfCausalLmExecutor
from ferrum_service.core.speculation import MAX_DRAFT_TOKENS, NgramDrafter, SpeculationConfig, sample_verified
from ferrum_service.core.types import DecodeInput, LogitsPolicy, SamplingParams

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.servers import InProcessServer


def _counting(path, kv_budget_tokens: int = 8192) -> HfCausalLmExecutor:
    """The tiny llama rewired so that its next token is the current one + 1: the layers add
    nothing to the residual stream and the output head scores token v with the embedding of v-1."""
    ex = HfCausalLmExecutor.from_path(path, model_id="count", device="cpu", kv_budget_tokens=kv_budget_tokens)
    m = ex.model
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        m.lm_head.weight.copy_(torch.roll(m.model.embed_tokens.weight, 1, dims=0) * 4)
    return ex


@pytest.fixture(scope="module")
def srv(tiny_llama_dir):
    tiny = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=8192)
    count = _counting(tiny_llama_dir)
    with InProcessServer([tiny, count]) as s:
        yield s
    for ex in (tiny, count):
        ex.prefix.check()
        assert not ex.prefix.refs


@pytest.fixture(scope="module")
def client(srv):
    with Client(srv.target) as c:
        yield c


@pytest.fixture(autouse=True)
def no_leaks(srv):
    yield
    assert srv.live_caches() == {"tiny": 0, "count": 0}
    for h in srv.models:  # no block held: every cache, and every rejected draft's block, let go
        assert not h.executor.prefix.refs


def _gen(c, model: str, prompt: list[int], max_tokens: int = 40, spec: pb.SpeculationOptions | None = None,
         **kw):
    stop = kw.pop("stop", None) or pb.StopConditions(max_tokens=max_tokens, ignore_eos=True)
    req = pb.GenerateRequest(model_id=model, token_ids=pb.TokenIds(token_ids=prompt), stop=stop, **kw)
    if spec is not None:
        req.speculation.CopyFrom(spec)
    evs = list(c.stub.Generate(req))
    toks = collections.defaultdict(list)
    lps = collections.defaultdict(list)
    fins = {}
    for e in evs:
        if e.WhichOneof("event") == "token":
            toks[e.token.sample_index].append(e.token.token_id)
            lps[e.token.sample_index].append(e.token.logprob)
        elif e.WhichOneof("event") == "finished":
            fins[e.finished.sample_index] = e.finished
    return toks, lps, fins


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(n)]


SPEC = pb.SpeculationOptions(max_draft_tokens=6)
# A counting run, its start again, a jump, and its start again: the output counts on from 103; the
# drafter copies the first run (accepted) until 139, where it proposes "100 101 102 50" (rejected:
# the model counts on to 140), and after that it finds nothing.
COUNT_PROMPT = list(range(100, 140)) + list(range(100, 103)) + list(range(50, 60)) + list(range(100, 103))


# ---- the drafter --------------------------------------------------------------------------------
def test_drafter_proposes_what_followed_the_latest_occurrence_longest_ngram_first():
    d = NgramDrafter(SpeculationConfig(max_draft=4, min_ngram=1, max_ngram=3), [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 3])
    # "5 3" and "8 5 3" never occurred before; "3" last occurred before "7 8 5 3"
    assert d.propose(10) == [7, 8, 5, 3]
    assert d.propose(2) == [7, 8]
    d.extend([9])  # "3 9": only once before, followed by "9 1 2 3"
    assert d.propose(10) == [9, 1, 2, 3]
    assert NgramDrafter(SpeculationConfig(max_draft=4, min_ngram=2, max_ngram=2), [1, 2, 3, 4]).propose(4) == []
    assert d.propose(0) == []
    d.feedback(4, 1)  # a rejection shortens the next drafts, full acceptances lengthen them again
    assert d.propose(10) == [9, 1, 2]
    d.feedback(3, 3)
    assert d.propose(10) == [9, 1, 2, 3]


def test_request_config_caps_huge_drafts_and_names_bad_fields():
    req = pb.GenerateRequest(speculation=pb.SpeculationOptions(max_draft_tokens=4_000_000_000))
    assert speculation.request_config(req, 0).max_draft == MAX_DRAFT_TOKENS
    assert speculation.request_config(pb.GenerateRequest(), 0) is None
    assert speculation.request_config(pb.GenerateRequest(), 99).max_draft == MAX_DRAFT_TOKENS
    off = pb.GenerateRequest(speculation=pb.SpeculationOptions(disabled=True, max_ngram=99))
    assert speculation.request_config(off, 4) is None


@pytest.mark.parametrize("opt,field", [
    (pb.SpeculationOptions(min_ngram=9), "speculation.min_ngram"),
    (pb.SpeculationOptions(max_ngram=4_000_000_000), "speculation.max_ngram"),
    (pb.SpeculationOptions(min_ngram=5, max_ngram=2), "speculation.min_ngram"),
])
def test_bad_options_are_invalid_argument_naming_the_field(client, opt, field):
    with pytest.raises(grpc.RpcError) as ei:
        _gen(client, "tiny", [5, 6, 7], spec=opt)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in ei.value.details()


def test_a_huge_draft_size_is_capped_per_step(srv, client):
    stats = speculation.stats_of(next(h for h in srv.models if h.model_id == "count"))
    before = (stats.draft_tokens, stats.verify_rows)
    toks, _, fins = _gen(client, "count", COUNT_PROMPT, 60, pb.SpeculationOptions(max_draft_tokens=4_000_000_000))
    plain, _, _ = _gen(client, "count", COUNT_PROMPT, 60)
    assert toks == plain
    drafted, rows = stats.draft_tokens - before[0], stats.verify_rows - before[1]
    assert fins[0].draft_tokens == drafted > 0
    assert drafted <= MAX_DRAFT_TOKENS * rows


# ---- greedy: identical to plain decoding --------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_random_model_equals_plain_decoding_with_rejected_drafts(client, seed):
    prompt = _prompt(seed, 8) * 4  # repeated text: the drafter proposes at almost every step
    plain, plain_lp, pf = _gen(client, "tiny", prompt, 120)
    spec, spec_lp, sf = _gen(client, "tiny", prompt, 120, SPEC)
    assert spec == plain
    assert max(abs(a - b) for a, b in zip(spec_lp[0], plain_lp[0])) < 1e-3
    assert sf[0].draft_tokens > 50 and sf[0].accepted_draft_tokens < sf[0].draft_tokens
    assert pf[0].draft_tokens == 0 and pf[0].accepted_draft_tokens == 0
    assert sf[0].finish_reason == pf[0].finish_reason == pb.FINISH_REASON_LENGTH


def test_greedy_counting_model_accepts_and_rejects_and_equals_plain(client):
    plain, _, _ = _gen(client, "count", COUNT_PROMPT, 80)
    assert plain[0][:5] == [103, 104, 105, 106, 107]  # the rewired model counts
    spec, _, sf = _gen(client, "count", COUNT_PROMPT, 80, SPEC)
    assert spec == plain
    f = sf[0]
    assert 0 < f.accepted_draft_tokens < f.draft_tokens
    assert f.accepted_draft_tokens >= 30  # most of the copy is accepted


def test_greedy_when_the_drafter_never_proposes(client):
    prompt = _prompt(7, 30)  # no 8-gram recurs in 30 distinct-ish tokens and 6 outputs
    plain, _, _ = _gen(client, "tiny", prompt, 6)
    spec, _, sf = _gen(client, "tiny", prompt, 6, pb.SpeculationOptions(min_ngram=8, max_ngram=8))
    assert spec == plain and sf[0].draft_tokens == 0


def test_concurrent_streams_share_steps_and_each_equals_its_plain_run(srv, client):
    prompts = [_prompt(s, 6) * 3 for s in range(3)] + [COUNT_PROMPT[i:] for i in (0, 5, 9)]
    models = ["tiny"] * 3 + ["count"] * 3
    alone = [_gen(client, m, p, 50)[0] for m, p in zip(models, prompts)]
    got: dict[int, tuple] = {}

    def one(i: int) -> None:
        got[i] = _gen(client, models[i], prompts[i], 50, SPEC if i % 2 == 0 else None)

    ts = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    for i in range(6):
        assert got[i][0] == alone[i], i
    assert any(got[i][2][0].draft_tokens for i in (0, 2, 4))


# ---- sampling -------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["tiny", "count"])
def test_seeded_sampling_is_token_identical(client, model):
    prompt = COUNT_PROMPT if model == "count" else _prompt(3, 8) * 4
    sp = tpb.SamplingParams(temperature=1.3, top_k=50, top_p=0.95, seed=1234, repetition_penalty=1.05)
    plain, _, _ = _gen(client, model, prompt, 60, sampling=sp)
    spec, _, sf = _gen(client, model, prompt, 60, SPEC, sampling=sp)
    assert spec == plain
    assert sf[0].draft_tokens > 0


def test_seeded_samples_n_equal_plain_per_sample(client):
    sp = tpb.SamplingParams(temperature=1.0, seed=99)
    plain, _, pf = _gen(client, "count", COUNT_PROMPT, 30, sampling=sp, n=3)
    spec, _, sf = _gen(client, "count", COUNT_PROMPT, 30, SPEC, sampling=sp, n=3)
    assert spec == plain and len(spec) == 3
    assert all(sf[i].draft_tokens > 0 for i in range(3))


class _FakeRegistryEntry:
    def __init__(self, n: int) -> None:
        self.cache_id, self.tokens = "c", list(range(n))

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def test_unseeded_verification_draws_from_the_target_distribution():
    """The acceptance rule with a point draft: the first token is distributed as p whatever the
    draft, the draft is accepted with probability p(draft), and only a rejection truncates."""
    torch.manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    row = torch.stack([p.log(), torch.tensor([0.1, 0.2, 0.3, 0.4]).log()])
    pol = LogitsPolicy(sampling=SamplingParams(temperature=1.0))
    truncated = []
    ex = SimpleNamespace(truncate_kv=lambda cid, n: truncated.append(n))
    counts = collections.Counter()
    accepted = 0
    n = 4000
    for _ in range(n):
        entry = _FakeRegistryEntry(12)  # 10 before the step + the fed token + 1 draft
        (r,) = sample_verified(ex, [row], [pol], [entry], [[1]])
        counts[r.token_id] += 1
        assert r.drafted == 1
        accepted += len(r.extra)
        if r.extra:
            assert r.token_id == 1
    for t in range(4):
        assert abs(counts[t] / n - float(p[t])) < 0.03, (t, counts)
    assert abs(accepted / n - 0.3) < 0.03
    assert len(truncated) == n - accepted and set(truncated) == {11}


# ---- stop conditions, kept caches, constraints ---------------------------------------------------
def test_stop_token_inside_accepted_drafts_ends_where_plain_does(client):
    plain, _, pf = _gen(client, "count", COUNT_PROMPT, 80)
    stop_tok = plain[0][20]  # well inside the copied run
    stop = pb.StopConditions(max_tokens=80, ignore_eos=True, stop_token_ids=[stop_tok])
    a, _, af = _gen(client, "count", COUNT_PROMPT, stop=stop)
    b, _, bf = _gen(client, "count", COUNT_PROMPT, stop=stop, spec=SPEC)
    assert a == b and a[0][-1] == stop_tok and len(a[0]) == 21
    assert af[0].finish_reason == bf[0].finish_reason == pb.FINISH_REASON_STOP
    assert bf[0].accepted_draft_tokens > 0


def test_stop_sequence_and_max_tokens_end_where_plain_does(client):
    plain, _, pf = _gen(client, "tiny", _prompt(4, 8) * 4, 60, stream_text=True)
    text = pf[0].text
    assert len(text) > 20
    stop = pb.StopConditions(max_tokens=60, ignore_eos=True, stop_sequences=[text[12:16]])
    a, _, af = _gen(client, "tiny", _prompt(4, 8) * 4, stop=stop, stream_text=True)
    b, _, bf = _gen(client, "tiny", _prompt(4, 8) * 4, stop=stop, spec=SPEC, stream_text=True)
    assert a == b and af[0].text == bf[0].text and bf[0].finish_reason == af[0].finish_reason
    for mt in (1, 2, 7):
        assert _gen(client, "count", COUNT_PROMPT, mt, SPEC)[0] == _gen(client, "count", COUNT_PROMPT, mt)[0]
        assert len(_gen(client, "count", COUNT_PROMPT, mt, SPEC)[0][0]) == mt


def test_kept_cache_holds_what_plain_decoding_leaves(client):
    plain, _, _ = _gen(client, "count", COUNT_PROMPT, 80)
    stop = pb.StopConditions(max_tokens=80, ignore_eos=True, stop_token_ids=[plain[0][25]])
    handles = []
    for spec in (None, SPEC):
        toks, _, fins = _gen(client, "count", COUNT_PROMPT, stop=stop, spec=spec, keep_cache=True)
        handles.append((toks, fins[0].cache.num_tokens, fins[0].cache.cache_id, fins[0].accepted_draft_tokens))
    assert handles[0][0] == handles[1][0]
    assert handles[0][1] == handles[1][1] == len(COUNT_PROMPT) + 25  # every token but the last
    assert handles[1][3] > 0
    # continuing the kept cache gives the same next tokens
    nxt = []
    for toks, _, cid, _ in handles:
        req = pb.GenerateRequest(model_id="count", cache_id=cid, last_token_id=toks[0][-1],
                                 stop=pb.StopConditions(max_tokens=5, ignore_eos=True), speculation=SPEC)
        nxt.append([e.token.token_id for e in client.stub.Generate(req) if e.WhichOneof("event") == "token"])
        client.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id="count", cache_id=cid))
    assert nxt[0] == nxt[1] == [plain[0][26] + i for i in range(5)]


def test_a_constraint_turns_speculation_off(client):
    pytest.importorskip("xgrammar")
    sp = tpb.SamplingParams(constraint=tpb.OutputConstraint(regex="[a-z ]{1,30}"))
    a, _, af = _gen(client, "tiny", _prompt(5, 6) * 4, 20, sampling=sp)
    b, _, bf = _gen(client, "tiny", _prompt(5, 6) * 4, 20, SPEC, sampling=sp)
    assert a == b and bf[0].draft_tokens == 0


# ---- metrics and the server default ----------------------------------------------------------------
def test_metrics_count_drafts_and_acceptances(srv, client):
    m = srv.server.metrics
    lab = {"model": "count"}
    d0 = m.value("ferrum_speculation_draft_tokens_total", lab)
    a0 = m.value("ferrum_speculation_accepted_tokens_total", lab)
    r0 = m.value("ferrum_speculation_verify_rows_total", lab)
    _, _, f = _gen(client, "count", COUNT_PROMPT, 50, SPEC)
    assert m.value("ferrum_speculation_draft_tokens_total", lab) - d0 == f[0].draft_tokens > 0
    assert m.value("ferrum_speculation_accepted_tokens_total", lab) - a0 == f[0].accepted_draft_tokens > 0
    assert m.value("ferrum_speculation_verify_rows_total", lab) > r0


def test_server_default_applies_to_requests_without_the_option(tiny_llama_dir):
    ex = _counting(tiny_llama_dir)
    with InProcessServer([ex], speculation_draft_tokens=5) as s, Client(s.target) as c:
        plain, _, on = _gen(c, "count", COUNT_PROMPT, 40)
        off, _, of = _gen(c, "count", COUNT_PROMPT, 40, pb.SpeculationOptions(disabled=True))
        assert plain == off and on[0].draft_tokens > 0 and of[0].draft_tokens == 0
        assert s.live_caches() == {"count": 0}


def test_drafts_fit_the_reservation_of_a_full_kv_budget(tiny_llama_dir):
    """A budget of exactly one stream's reservation: drafts never need KV past it (each draft may
    become an output token, so none is proposed past max_tokens), and the stream completes."""
    max_tokens = 96 - len(COUNT_PROMPT)  # prompt + max_tokens = 96 tokens = 6 blocks of 16
    ex2 = _counting(tiny_llama_dir, kv_budget_tokens=96)
    with InProcessServer([ex2]) as s, Client(s.target) as c:
        plain, _, _ = _gen(c, "count", COUNT_PROMPT, max_tokens)
        spec, _, f = _gen(c, "count", COUNT_PROMPT, max_tokens, pb.SpeculationOptions(max_draft_tokens=16))
        assert spec == plain and len(spec[0]) == max_tokens
        assert f[0].accepted_draft_tokens > 0 and f[0].finish_reason == pb.FINISH_REASON_LENGTH
        assert s.live_caches() == {"count": 0}
        assert not ex2.prefix.refs


def test_python_client_helper_sets_the_option(srv):
    from ferrum_client import messages

    assert messages.generate_request("m", token_ids=[1], speculation=8).speculation.max_draft_tokens == 8
    assert not messages.generate_request("m", token_ids=[1]).HasField("speculation")
    with Client(srv.target) as c:
        evs = list(c.generate("count", token_ids=COUNT_PROMPT, max_tokens=30, ignore_eos=True, speculation=6))
    fin = evs[-1].finished
    assert fin.generated_tokens == 30 and 0 < fin.accepted_draft_tokens <= fin.draft_tokens


def test_speculation_draft_tokens_flag(tiny_llama_dir):
    from .support.servers import ServerProcess

    spec = f"hf-causal-lm,id=tiny,path={tiny_llama_dir}"
    prompt = _prompt(2, 8) * 4
    with ServerProcess("--model", spec, "--speculation-draft-tokens", "3") as proc, Client(proc.target) as c:
        toks, _, f = _gen(c, "tiny", prompt, 30)
        off, _, g = _gen(c, "tiny", prompt, 30, pb.SpeculationOptions(disabled=True))
    assert toks == off and f[0].draft_tokens > 0 and g[0].draft_tokens == 0


def test_a_verify_row_shares_the_step_with_plain_decode_rows(srv):
    """The batcher puts a speculating stream's row (token + drafts) and another stream's one-token
    row in one forward; the rejected draft's KV is gone when the step returns."""
    import asyncio

    from ferrum_service.core.types import PrefillInput

    host = next(h for h in srv.models if h.model_id == "count")
    ex = host.executor

    async def go():
        (pa, _), (pb_, _) = await asyncio.gather(
            host.batcher.prefill(PrefillInput(token_ids=COUNT_PROMPT, reserve_tokens=80)),
            host.batcher.prefill(PrefillInput(token_ids=[7, 8, 9], reserve_tokens=20)))
        ca, cb = pa.cache.cache_id, pb_.cache.cache_id
        ops = ex.stats.decode_ops
        ra, rb = await asyncio.gather(host.batcher.decode(DecodeInput(ca, 103, draft=[104, 105, 7])),
                                      host.batcher.decode(DecodeInput(cb, 10)))
        out = ra, rb, ex.stats.decode_ops - ops, ex.registry.get(ca).num_tokens, ex.registry.get(cb).num_tokens
        for c in (ca, cb):
            await host.call(ex.release_cache, c)
        return out

    ra, rb, steps, na, nb = srv.run(go())
    assert steps == 1
    assert (ra.token_id, [r.token_id for r in ra.extra], ra.drafted) == (104, [105, 106], 3)
    assert rb.token_id == 11 and not rb.extra and rb.drafted == 0
    assert na == len(COUNT_PROMPT) + 3 and nb == 4  # 103, 104, 105 kept; the draft 7 dropped
