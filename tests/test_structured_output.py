"""Structured output (``SamplingParams.constraint``) on the real SmolLM2 through llama.cpp (the
default executor on CPU) and, for the step RPCs, on transformers: outputs parse and match, the
constraint's state follows the cache (truncate, fork), bad constraints are refused up front."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest

from ferrum_client import Client, pb, tpb
from ferrum_client import messages as m
from ferrum_service.executors.configurable import ConfigurableModelExecutor

from .support.servers import InProcessServer
from .support.packaged import smollm2_gguf_path

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "pets": {"type": "array", "maxItems": 2, "items": {"enum": ["cat", "dog", "fish"]}}},
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=["unified", "streams"])  # both KV layouts (issue 39)
def server(request):
    from ferrum_service.executors.llama_cpp import LlamaCppExecutor

    llc = LlamaCppExecutor(smollm2_gguf_path(), model_id="smollm2", threads=2, n_ctx=4096, n_seq=16,
                           kv=request.param)
    mock = ConfigurableModelExecutor.with_token_sequence(1000, [10, 20], model_id="mock")
    with InProcessServer([llc, mock], open_admin_rpcs=True) as srv, Client(srv.target) as c:
        yield srv, c


def _generate(c, constraint, *, seed=0, max_tokens=120, prompt="Describe a person as JSON.", bypass=False):
    req = pb.GenerateRequest(model_id="smollm2", chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user",
                                                                                                content=prompt)]),
                             sampling=tpb.SamplingParams(temperature=0.8, seed=seed, constraint=constraint),
                             stop=pb.StopConditions(max_tokens=max_tokens), bypass_prefix_cache=bypass)
    fin = list(c.stub.Generate(req))[-1].finished
    return fin.text, fin.finish_reason


def test_fifty_json_schema_generations_parse_and_validate(server):
    _, c = server
    cons = tpb.OutputConstraint(json_schema=json.dumps(SCHEMA))
    with ThreadPoolExecutor(8) as pool:  # eight streams at a time: the server batches them
        outs = list(pool.map(lambda s: _generate(c, cons, seed=s), range(50)))
    for text, reason in outs:
        assert reason == pb.FINISH_REASON_EOS, (text, reason)
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({t for t, _ in outs}) > 10, "fifty seeded samples were nearly all the same"


def test_regex_and_choice(server):
    _, c = server
    rx = r"[A-Z][a-z]{2,8} [0-9]{1,3}(, [A-Z][a-z]{2,8} [0-9]{1,3}){0,2}"
    for seed in range(8):
        text, reason = _generate(c, tpb.OutputConstraint(regex=rx), seed=seed, prompt="List cities and numbers.")
        assert re.fullmatch(rx, text), text
    choices = ["red", "green", "blue", "not sure"]
    got = {_generate(c, tpb.OutputConstraint(choice=tpb.ChoiceList(choices=choices)), seed=s,
                     prompt="Pick a colour.")[0] for s in range(6)}
    assert got <= set(choices) and got
    grammar = 'root ::= "(" [0-9]+ (" + " [0-9]+)* ")"'
    text, _ = _generate(c, tpb.OutputConstraint(ebnf_grammar=grammar), prompt="Write a sum.")
    assert re.fullmatch(r"\(\d+( \+ \d+)*\)", text), text


def _allowed(out: pb.PrefillOutput | pb.DecodeOutput) -> set[int]:
    """Token ids a constrained row allows (finite log-probabilities among the top 64)."""
    return {t.token_id for t in out.output.top_logprobs if t.logprob > -1e30}


def test_integer_schema_allows_digits_minus_then_eos(server):
    """ferrum's guided-decoding check: an integer schema allows only digits and '-' first, then
    also the end of text."""
    srv, c = server
    tok = srv.models.get("smollm2").executor.tokenizer
    pol = tpb.LogitsPolicy(mode=tpb.OUTPUT_MODE_TOP_LOGPROBS, top_logprobs=64, sampling=tpb.SamplingParams(
        constraint=tpb.OutputConstraint(json_schema='{"type": "integer"}')))
    out = c.stub.Prefill(pb.PrefillRequest(model_id="smollm2", input=pb.PrefillInput(
        token_ids=tok.encode("A number: "), logits=pol))).output
    first = _allowed(out)
    assert first and all(re.fullmatch(r"-|-?[0-9]+", tok.decode([t])) for t in first), [tok.decode([t]) for t in first]
    assert not first & set(srv.models.get("smollm2").info.eos_token_ids)  # no number yet: no end
    digit = next(t for t in first if re.fullmatch(r"[0-9]+", tok.decode([t])))
    nxt = c.stub.Decode(pb.DecodeRequest(model_id="smollm2", input=pb.DecodeInput(
        cache_id=out.cache.cache_id, token_id=digit, logits=pol))).output
    eos = set(srv.models.get("smollm2").info.eos_token_ids)
    after = _allowed(nxt)
    assert after & eos and all(t in eos or re.fullmatch(r"[0-9]+", tok.decode([t])) for t in after)
    c.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id="smollm2", cache_id=out.cache.cache_id))


def test_state_rolls_back_with_truncate_and_follows_forks(server):
    srv, c = server
    tok = srv.models.get("smollm2").executor.tokenizer
    pol = tpb.LogitsPolicy(mode=tpb.OUTPUT_MODE_TOP_LOGPROBS, top_logprobs=64, sampling=tpb.SamplingParams(
        constraint=tpb.OutputConstraint(regex="(ab)+|[0-9]+")))
    prompt = tok.encode("Go: ")
    out = c.stub.Prefill(pb.PrefillRequest(model_id="smollm2", input=pb.PrefillInput(token_ids=prompt,
                                                                                      logits=pol))).output
    cid = out.cache.cache_id
    start = _allowed(out)
    a = tok.encode("a", add_special_tokens=False)[0]
    step = c.stub.Decode(pb.DecodeRequest(model_id="smollm2", input=pb.DecodeInput(cache_id=cid, token_id=a,
                                                                                    logits=pol))).output
    assert all(tok.decode([t]).startswith("b") for t in _allowed(step))  # after "a" only "b..." fits
    fork = c.stub.ForkCache(pb.ForkCacheRequest(model_id="smollm2", cache_id=cid)).cache
    # the fork carries the constraint: a digit after "a" is refused there too
    digit = tok.encode("7", add_special_tokens=False)[0]
    with pytest.raises(grpc.RpcError) as e:
        c.stub.Decode(pb.DecodeRequest(model_id="smollm2", input=pb.DecodeInput(cache_id=fork.cache_id,
                                                                                token_id=digit, logits=pol)))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not allowed" in e.value.details()
    # truncating the source back to the prompt rolls its constraint back to the start
    c.stub.TruncateKv(pb.TruncateKvRequest(model_id="smollm2", cache_id=cid, new_len=len(prompt)))
    again = c.stub.Decode(pb.DecodeRequest(model_id="smollm2", input=pb.DecodeInput(
        cache_id=cid, token_id=digit, logits=pol))).output
    assert _allowed(again) and all(re.fullmatch(r"[0-9]+", tok.decode([t])) or t in srv.models.get(
        "smollm2").info.eos_token_ids for t in _allowed(again))
    assert start
    for x in (cid, fork.cache_id):
        c.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id="smollm2", cache_id=x))


@pytest.mark.parametrize("constraint,field", [
    (tpb.OutputConstraint(json_schema="{not json"), "sampling.constraint.json_schema"),
    (tpb.OutputConstraint(regex="(unclosed"), "sampling.constraint.regex"),
    (tpb.OutputConstraint(ebnf_grammar="root ::= undefined_rule"), "sampling.constraint.ebnf_grammar"),
    (tpb.OutputConstraint(choice=tpb.ChoiceList()), "sampling.constraint.choice"),
    (tpb.OutputConstraint(regex="a" * 70000), "sampling.constraint.regex"),
    (tpb.OutputConstraint(), "sampling.constraint"),
])
def test_bad_constraints_are_invalid_argument_naming_the_field(server, constraint, field):
    srv, c = server
    with pytest.raises(grpc.RpcError) as e:
        list(c.stub.Generate(pb.GenerateRequest(model_id="smollm2", text="hi", sampling=tpb.SamplingParams(
            constraint=constraint))))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details(), e.value.details()


def test_refusals_without_a_tokenizer_and_in_verify(server):
    _, c = server
    pol = tpb.LogitsPolicy(sampling=tpb.SamplingParams(constraint=tpb.OutputConstraint(regex="[0-9]+")))
    with pytest.raises(grpc.RpcError) as e:
        c.stub.Prefill(pb.PrefillRequest(model_id="mock", input=pb.PrefillInput(token_ids=[1, 2], logits=pol)))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "tokenizer" in e.value.details()
    out = c.stub.Prefill(pb.PrefillRequest(model_id="smollm2", input=pb.PrefillInput(token_ids=[1, 2]))).output
    with pytest.raises(grpc.RpcError) as e:
        c.stub.ForwardVerify(pb.ForwardVerifyRequest(model_id="smollm2", cache_id=out.cache.cache_id,
                                                     token_ids=[3, 4], logits=pol))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    c.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id="smollm2", cache_id=out.cache.cache_id))


def test_python_client_helpers(server):
    srv, c = server
    choices = ["red", "green", "blue"]
    evs = list(c.generate("smollm2", chat=[("user", "Pick a colour.")], max_tokens=8, temperature=0.5, seed=2,
                          constraint=m.constraint(choices=choices)))
    assert evs[-1].finished.text in choices
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    pol = m.sampled(m.sampling(0.0, constraint=m.constraint(json_schema=schema)))
    tok = srv.models.get("smollm2").executor.tokenizer
    out = c.prefill("smollm2", tok.encode("JSON: "), policy=pol).output
    assert tok.decode([out.output.token_id]) in ('{', '{"')  # the schema's first character(s)
    c.release_cache("smollm2", out.cache.cache_id)
    with pytest.raises(ValueError):
        m.constraint(regex="a", choices=["b"])


def test_past_the_end_only_end_tokens_and_rollback_still_works(server):
    """With ignore_eos a finished constraint keeps allowing only the end tokens (it does not fail);
    truncating back into the text rolls those back too."""
    srv, c = server
    eos = set(srv.models.get("smollm2").info.eos_token_ids)
    req = pb.GenerateRequest(model_id="smollm2", text="Pick:", keep_cache=True, sampling=tpb.SamplingParams(
        constraint=tpb.OutputConstraint(choice=tpb.ChoiceList(choices=["yes", "no"]))),
        stop=pb.StopConditions(max_tokens=8, ignore_eos=True))
    evs = list(c.stub.Generate(req))
    toks = [e.token.token_id for e in evs if e.WhichOneof("event") == "token"]
    fin = evs[-1].finished
    assert len(toks) == 8 and set(toks[-4:]) <= eos, toks
    tok = srv.models.get("smollm2").executor.tokenizer
    assert tok.decode([t for t in toks if t not in eos]) in ("yes", "no")
    # back to the start of the answer: the choice is open again
    cid = fin.cache.cache_id
    start = fin.cache.num_tokens - 7  # the cache holds the prompt and the first 7 generated tokens
    c.stub.TruncateKv(pb.TruncateKvRequest(model_id="smollm2", cache_id=cid, new_len=start))
    pol = tpb.LogitsPolicy(mode=tpb.OUTPUT_MODE_TOP_LOGPROBS, top_logprobs=8, sampling=tpb.SamplingParams(
        constraint=tpb.OutputConstraint(choice=tpb.ChoiceList(choices=["yes", "no"]))))
    # feeding the first answer token again is accepted (refused if the finished state had stayed)
    out = c.stub.Decode(pb.DecodeRequest(model_id="smollm2", input=pb.DecodeInput(
        cache_id=cid, token_id=toks[0], logits=pol))).output
    done = tok.decode([toks[0]]) in ("yes", "no")
    assert _allowed(out) and (_allowed(out) <= eos) == done
    c.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id="smollm2", cache_id=cid))


def test_masks_during_the_forward_equal_masks_after_it(server, monkeypatch):
    """The masks computed on the mask thread while the forward runs (the default) give the same
    seeded samples as masks computed after the forward; the overlap path really runs."""
    from ferrum_service.core import guided

    cons = tpb.OutputConstraint(json_schema=json.dumps(SCHEMA))
    prepared = []
    real = guided.prepare_masks

    def counting(*a, **kw):
        p = real(*a, **kw)
        prepared.append(p is not None)
        return p

    srv, c = server
    (host,) = [h for h in srv.server.models if h.model_id == "smollm2"]

    def generate(seed):
        # Each generation from the same llama.cpp KV layout: the sequences the prefix cache keeps
        # (from the module's earlier tests and the previous generation) move where a new sequence's
        # cells land, and the same tokens in other cells give slightly different logits (one row's
        # allowed logits summed to 25.429, 25.441 and 25.459 in three layouts), enough for a seeded
        # draw to differ. With the prefix cache cleared before each one, the rows match bit for bit.
        srv.run(host.drain_releases())
        srv.run(host.call(host.executor.clear_prefix_cache))
        return _generate(c, cons, seed=seed, max_tokens=40, bypass=True)

    monkeypatch.setenv("FERRUM_GUIDED_OVERLAP", "1")
    monkeypatch.setattr("ferrum_service.core.steps.prepare_masks", counting)
    # One at a time (same batches), each prompt computed whole (bypass: no prefix-cache hit).
    on = [generate(s) for s in range(3)]
    monkeypatch.setenv("FERRUM_GUIDED_OVERLAP", "0")
    off = [generate(s) for s in range(3)]
    assert on == off
    assert sum(prepared) > 10  # most decode steps had their masks prepared during the forward
