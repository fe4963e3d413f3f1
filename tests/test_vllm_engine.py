"""``vllm.grpc.engine.VllmEngine`` (vLLM's engine protocol, from the published smg-grpc-proto
stubs) on a real server with the tiny random Llama and BERT: every RPC against the contract's own
answers for the same request, the refusals, aborts and disconnects leaving no cache, the KV
events' numbering and blocks, the tokenizer bundle, an unset max_tokens on a small KV budget, and
SMG's two prefill/decode legs with the KV handoff between a prefill and a decode server."""

from __future__ import annotations

import hashlib
import io
import json
import threading
import time
import zipfile

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from ferrum_client import Client, pb

from .conftest_models import tiny_bert_dir, tiny_llama_dir  # noqa: F401 - fixtures
from .support.servers import InProcessServer
from .support.waits import wait_for, wait_no_live_caches

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def server(tiny_llama_dir):  # noqa: F811
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    ex = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=8192)
    with InProcessServer([ex], open_admin_rpcs=True) as srv:  # FlushCache is an admin RPC
        yield srv


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.target) as ch:
        yield ch


@pytest.fixture(scope="module")
def engine(channel):
    return vllm_engine_pb2_grpc.VllmEngineStub(channel)


@pytest.fixture(scope="module")
def client(server):
    with Client(server.target) as c:
        yield c


PROMPT = list(range(5, 45))  # 40 tokens: two full 16-token blocks of the paged pool


def _gen(engine, ids=PROMPT, stream=False, rid="r", timeout=60, **sp) -> list[vpb.GenerateResponse]:
    req = vpb.GenerateRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=ids), stream=stream,
                              sampling_params=vpb.SamplingParams(**sp))
    return list(engine.Generate(req, timeout=timeout))


def _contract_tokens(client, ids, max_tokens, **stop) -> list[int]:
    req = pb.GenerateRequest(model_id="tiny", token_ids=pb.TokenIds(token_ids=ids),
                             stop=pb.StopConditions(max_tokens=max_tokens, **stop))
    return [e.token.token_id for e in client.stub.Generate(req) if e.WhichOneof("event") == "token"]


def _code(excinfo) -> grpc.StatusCode:
    return excinfo.value.code()


# ---- metadata -------------------------------------------------------------------------------------
def test_model_and_server_info(engine, server):
    mi = engine.GetModelInfo(vpb.GetModelInfoRequest())
    assert mi.served_model_name == "tiny" and mi.is_generation
    assert mi.max_context_length == server.models.get("tiny").info.max_sequence_length > 0
    assert mi.vocab_size == 512 and set(mi.eos_token_ids) == {2, 4}
    si = engine.GetServerInfo(vpb.GetServerInfoRequest())
    assert si.block_size == server.models.get("tiny").info.prefix_cache["block_size"] > 0
    assert si.kv_role == "" and si.kv_connector == "" and si.data_parallel_size == 1 and si.max_num_seqs > 0
    assert engine.HealthCheck(vpb.HealthCheckRequest()).healthy


def test_health_and_reflection_name_the_service(channel):
    h = health_pb2_grpc.HealthStub(channel)
    st = h.Check(health_pb2.HealthCheckRequest(service="vllm.grpc.engine.VllmEngine"))
    assert st.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2 as rpb
    from grpc_reflection.v1alpha import reflection_pb2_grpc as rgrpc

    r = rgrpc.ServerReflectionStub(channel)
    resp = next(r.ServerReflectionInfo(iter([rpb.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert "vllm.grpc.engine.VllmEngine" in names
    resp = next(r.ServerReflectionInfo(iter([rpb.ServerReflectionRequest(
        file_containing_symbol="vllm.grpc.engine.VllmEngine.Generate")])))
    assert resp.WhichOneof("message_response") == "file_descriptor_response"


def test_loads_idle(engine):
    r = engine.GetLoads(vpb.GetLoadsRequest())
    assert r.dp_rank_count == 1 and len(r.loads) == 1
    ld = r.loads[0]
    assert ld.num_running_reqs == ld.num_waiting_reqs == 0 and ld.max_total_num_tokens > 0
    assert 0.0 <= ld.token_usage < 1.0


# ---- Generate -------------------------------------------------------------------------------------
def test_generate_unary_matches_contract_generate(engine, client, server):
    want = _contract_tokens(client, PROMPT, 6, ignore_eos=True)
    out = _gen(engine, max_tokens=6, temperature=0.0, ignore_eos=True)
    assert len(out) == 1 and out[0].WhichOneof("response") == "complete"
    c = out[0].complete
    assert list(c.output_ids) == want and c.completion_tokens == 6 and c.prompt_tokens == len(PROMPT)
    assert c.finish_reason == "length" and c.index == 0
    assert server.live_caches() == {"tiny": 0}


def test_generate_stream_chunks_then_complete(engine, client, server):
    want = _contract_tokens(client, PROMPT, 5, ignore_eos=True)
    out = _gen(engine, stream=True, max_tokens=5, temperature=0.0, ignore_eos=True)
    kinds = [o.WhichOneof("response") for o in out]
    assert kinds == ["chunk"] * 5 + ["complete"]
    assert [t for o in out[:5] for t in o.chunk.token_ids] == want
    assert all(o.chunk.completion_tokens == 1 and o.chunk.prompt_tokens == len(PROMPT) for o in out[:5])
    c = out[-1].complete
    assert c.finish_reason == "length" and list(c.output_ids) == want[-1:]  # vLLM's last delta
    assert server.live_caches() == {"tiny": 0}


def test_n_samples_seeded(engine, server):
    a = _gen(engine, max_tokens=4, temperature=1.0, n=3, seed=7, ignore_eos=True)
    b = _gen(engine, max_tokens=4, temperature=1.0, n=3, seed=7, ignore_eos=True)
    assert [o.complete.index for o in a] == [0, 1, 2]
    assert [list(o.complete.output_ids) for o in a] == [list(o.complete.output_ids) for o in b]
    s = _gen(engine, stream=True, max_tokens=4, temperature=1.0, n=2, seed=7, ignore_eos=True)
    per = {0: [], 1: []}
    for o in s:
        if o.WhichOneof("response") == "chunk":
            per[o.chunk.index] += list(o.chunk.token_ids)
    assert per == {0: list(a[0].complete.output_ids), 1: list(a[1].complete.output_ids)}
    assert sorted(o.complete.index for o in s if o.WhichOneof("response") == "complete") == [0, 1]
    assert server.live_caches() == {"tiny": 0}


def test_stop_token_is_matched(engine, client):
    first = _contract_tokens(client, PROMPT, 3, ignore_eos=True)
    c = _gen(engine, max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[first[1]])[0].complete
    assert list(c.output_ids) == first[:2]
    assert c.finish_reason == "stop" and c.WhichOneof("matched_stop") == "matched_token_id"
    assert c.matched_token_id == first[1]


def test_stop_string_is_matched(engine, server):
    tok = server.models.get("tiny").executor.tokenizer
    full = _gen(engine, max_tokens=12, temperature=0.0, ignore_eos=True)[0].complete
    text = tok.decode(list(full.output_ids), skip_special_tokens=True)
    stop = next((text[i:i + 2] for i in range(2, len(text) - 1) if text[i:i + 2].strip()), None)
    if stop is None:
        pytest.skip(f"the tiny model's text {text!r} has no stop string to cut at")
    c = _gen(engine, max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop])[0].complete
    assert c.finish_reason == "stop" and c.matched_stop_str == stop
    assert len(c.output_ids) < 12 and stop in tok.decode(list(c.output_ids), skip_special_tokens=True)


def test_logprobs(engine):
    out = _gen(engine, stream=True, max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2)
    chunks = [o.chunk for o in out if o.WhichOneof("response") == "chunk"]
    for ch in chunks:
        lp = ch.output_logprobs
        assert list(lp.token_ids) == list(ch.token_ids) and len(lp.token_logprobs) == 1
        top = lp.top_logprobs[0]
        assert len(top.values) == 2 and top.token_ids[0] == ch.token_ids[0]  # greedy: the top-1 is the token
        assert top.values[0] == pytest.approx(lp.token_logprobs[0], abs=1e-5)
    unary = _gen(engine, max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=0)[0].complete
    assert len(unary.output_logprobs.token_logprobs) == 3 and not unary.output_logprobs.top_logprobs


def test_constraint_choice(engine, server):
    pytest.importorskip("xgrammar")
    tok = server.models.get("tiny").executor.tokenizer
    c = _gen(engine, max_tokens=20, temperature=1.0, seed=3,
             choice=vpb.ChoiceConstraint(choices=["alpha", "beta gamma"]))[0].complete
    assert tok.decode(list(c.output_ids), skip_special_tokens=True) in ("alpha", "beta gamma")


def test_constraint_json_schema(engine, server):
    pytest.importorskip("xgrammar")
    tok = server.models.get("tiny").executor.tokenizer
    schema = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["x"], "additionalProperties": False}
    c = _gen(engine, max_tokens=40, temperature=1.0, seed=5, json_schema=json.dumps(schema))[0].complete
    value = json.loads(tok.decode(list(c.output_ids), skip_special_tokens=True))
    assert set(value) == {"x"} and 0 <= value["x"] <= 9


@pytest.mark.parametrize("sp, field", [
    (dict(frequency_penalty=0.5), "frequency_penalty"),
    (dict(presence_penalty=-0.5), "presence_penalty"),
    (dict(logit_bias={5: 10.0}), "logit_bias"),
    (dict(min_tokens=3), "min_tokens"),
    (dict(prompt_logprobs=1), "prompt_logprobs"),
    (dict(structural_tag="{}"), "structural_tag"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=65), "logprobs"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (dict(stop_token_ids=[512]), "stop_token_ids"),
    (dict(regex="("), "regex"),
])
def test_refusals_are_invalid_argument(engine, server, sp, field):
    with pytest.raises(grpc.RpcError) as e:
        _gen(engine, max_tokens=sp.pop("max_tokens", 2), **sp)
    assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert field.split("_")[0] in e.value.details()
    assert server.live_caches() == {"tiny": 0}


def test_refused_inputs(engine, server):
    for req in [
        vpb.GenerateRequest(request_id="x", sampling_params=vpb.SamplingParams(max_tokens=2)),  # no input
        vpb.GenerateRequest(request_id="x", tokenized=vpb.TokenizedInput(input_ids=[]),
                            sampling_params=vpb.SamplingParams(max_tokens=2)),
        vpb.GenerateRequest(request_id="x", tokenized=vpb.TokenizedInput(input_ids=[1, 600]),
                            sampling_params=vpb.SamplingParams(max_tokens=2)),
        vpb.GenerateRequest(request_id="x", tokenized=vpb.TokenizedInput(input_ids=[1, 2 ** 32 - 1]),
                            sampling_params=vpb.SamplingParams(max_tokens=2)),
        vpb.GenerateRequest(request_id="x", tokenized=vpb.TokenizedInput(input_ids=[1, 2]),
                            kv_transfer_params_json="{}", sampling_params=vpb.SamplingParams(max_tokens=2)),
        vpb.GenerateRequest(request_id="x", tokenized=vpb.TokenizedInput(input_ids=[1, 2]), data_parallel_rank=1,
                            sampling_params=vpb.SamplingParams(max_tokens=2)),
        vpb.GenerateRequest(request_id="x", tokenized=vpb.TokenizedInput(input_ids=[1, 2] * 4000),
                            sampling_params=vpb.SamplingParams(max_tokens=2)),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            list(engine.Generate(req, timeout=30))
        assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert server.live_caches() == {"tiny": 0}


def test_text_input_and_truncation(engine, server):
    tok = server.models.get("tiny").executor.tokenizer
    ids = tok.encode("hello world", add_special_tokens=True)
    a = _gen(engine, ids=ids, max_tokens=3, temperature=0.0, ignore_eos=True)[0].complete
    req = vpb.GenerateRequest(request_id="t", text="hello world",
                              sampling_params=vpb.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    b = list(engine.Generate(req))[0].complete
    assert list(a.output_ids) == list(b.output_ids) and b.prompt_tokens == len(ids)
    c = _gen(engine, ids=[7, 8, 9] + ids, max_tokens=3, temperature=0.0, ignore_eos=True,
             truncate_prompt_tokens=len(ids))[0].complete
    assert c.prompt_tokens == len(ids) and list(c.output_ids) == list(a.output_ids)


def test_abort_by_request_id_ends_the_stream_and_frees_its_cache(engine, server):
    req = vpb.GenerateRequest(request_id="to-abort", tokenized=vpb.TokenizedInput(input_ids=PROMPT), stream=True,
                              sampling_params=vpb.SamplingParams(max_tokens=800, ignore_eos=True, temperature=0.0))
    it = engine.Generate(req, timeout=60)
    first = next(it)
    assert first.WhichOneof("response") == "chunk"
    assert wait_for(server.live_caches, lambda live: live == {"tiny": 1}) == {"tiny": 1}
    engine.Abort(vpb.AbortRequest(request_ids=["to-abort", "unknown-id"]))
    with pytest.raises(grpc.RpcError) as e:
        for _ in it:
            pass
    assert _code(e) == grpc.StatusCode.CANCELLED
    assert wait_no_live_caches(server) == {"tiny": 0}


def test_client_disconnect_frees_the_cache(engine, server):
    req = vpb.GenerateRequest(request_id="gone", tokenized=vpb.TokenizedInput(input_ids=PROMPT), stream=True,
                              sampling_params=vpb.SamplingParams(max_tokens=800, ignore_eos=True, temperature=0.0))
    it = engine.Generate(req, timeout=60)
    next(it)
    next(it)
    it.cancel()
    assert wait_no_live_caches(server) == {"tiny": 0}


def test_loads_count_a_running_stream(engine, server):
    req = vpb.GenerateRequest(request_id="busy", tokenized=vpb.TokenizedInput(input_ids=PROMPT), stream=True,
                              sampling_params=vpb.SamplingParams(max_tokens=800, ignore_eos=True, temperature=0.0))
    it = engine.Generate(req, timeout=60)
    next(it)
    ld = engine.GetLoads(vpb.GetLoadsRequest()).loads[0]
    assert ld.num_total_reqs == 1 and ld.num_used_tokens >= len(PROMPT) and ld.token_usage > 0
    assert engine.GetServerInfo(vpb.GetServerInfoRequest()).active_requests == 1
    fl = engine.FlushCache(cpb.FlushCacheRequest(timeout_s=0))
    assert not fl.success and "live" in fl.message
    it.cancel()
    assert wait_no_live_caches(server) == {"tiny": 0}


# ---- tokenizer, KV events, flush --------------------------------------------------------------------
def test_get_tokenizer_bundle(engine, server):
    chunks = list(engine.GetTokenizer(cpb.GetTokenizerRequest()))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest() and all(not c.sha256 for c in chunks[:-1])
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert "tokenizer.json" in names and "tokenizer_config.json" in names
    from tokenizers import Tokenizer

    t = Tokenizer.from_str(zipfile.ZipFile(io.BytesIO(data)).read("tokenizer.json").decode())
    tok = server.models.get("tiny").executor.tokenizer
    text = "hello world, the bundle tokenizes as the model does"
    assert t.encode(text, add_special_tokens=False).ids == tok.encode(text, add_special_tokens=False)
    cfg = json.loads(zipfile.ZipFile(io.BytesIO(data)).read("tokenizer_config.json"))
    template = cfg.get("chat_template") or zipfile.ZipFile(io.BytesIO(data)).read("chat_template.jinja").decode()
    assert template == tok.chat_template
    again = b"".join(c.data for c in engine.GetTokenizer(cpb.GetTokenizerRequest()))
    assert again == data


def test_bundle_drops_fixed_padding():
    from ferrum_service.wire.tokenizer_bundle import _unpadded

    doc = {"version": "1.0", "padding": {"strategy": {"Fixed": 128}, "pad_id": 0}, "model": {"type": "WordPiece"}}
    out = json.loads(_unpadded(json.dumps(doc).encode()))
    assert out["padding"] is None and out["model"] == doc["model"]
    same = json.dumps({"padding": None}).encode()
    assert _unpadded(same) == same


def _collect(stream, n: int, timeout: float = 10.0) -> list[cpb.KvEventBatch]:
    out: list = []

    def read():
        try:
            for b in stream:
                out.append(b)
                if len(out) >= n:
                    return
        except grpc.RpcError:
            pass

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout)
    stream.cancel()
    return out


def test_kv_events_blocks_numbering_resume_and_flush(engine, server):
    bs = engine.GetServerInfo(vpb.GetServerInfoRequest()).block_size
    prompt = list(range(100, 100 + 3 * bs + 2))
    _gen(engine, ids=prompt, max_tokens=1, temperature=0.0)
    relay = server.server.vllm.relay
    # the relay starts with the first subscription, from the oldest event the hub still holds
    _collect(engine.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(start_sequence_number=0)), 1)
    time.sleep(0.5)  # it has relayed what the hub held
    last = server.run(_relay_seq(relay))
    assert last >= 1
    batches = _collect(engine.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(start_sequence_number=0)), last)
    assert [b.sequence_number for b in batches] == list(range(1, last + 1))
    stored = [e.stored for b in batches for e in b.events if e.WhichOneof("data") == "stored"]
    blocks = [blk for s in stored for blk in s.blocks]
    mine = [blk for blk in blocks if list(blk.token_ids) == prompt[:bs]]
    assert mine and all(blk.block_size == bs for blk in blocks)
    # the chain: the prompt's second block names the first as its parent
    chain = next(s for s in stored if any(list(b.token_ids) == prompt[:bs] for b in s.blocks))
    if len(chain.blocks) > 1:
        assert list(chain.blocks[1].token_ids) == prompt[bs:2 * bs]
    # resume after the last applied: nothing replayed twice
    more = _collect(engine.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(start_sequence_number=last - 1)), 1)
    assert [b.sequence_number for b in more] == [last]
    with pytest.raises(grpc.RpcError) as e:
        list(engine.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(start_sequence_number=last + 100), timeout=5))
    assert _code(e) == grpc.StatusCode.OUT_OF_RANGE
    # flush: every block goes, the subscriber hears a clear
    sub = engine.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(start_sequence_number=last))
    fl = engine.FlushCache(cpb.FlushCacheRequest(timeout_s=5))
    assert fl.success, fl.message
    got = _collect(sub, 1)
    assert got and got[0].sequence_number == last + 1 and got[0].events[0].WhichOneof("data") == "cleared"
    c = _gen(engine, ids=prompt, max_tokens=1, temperature=0.0)[0].complete
    assert c.cached_tokens == 0


async def _relay_seq(relay):
    return relay.seq


# ---- Embed ----------------------------------------------------------------------------------------
def test_embed_on_a_generation_model_is_refused(engine):
    with pytest.raises(grpc.RpcError) as e:
        engine.Embed(vpb.EmbedRequest(request_id="e", tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3])))
    assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT


def test_embed_matches_prefill_embedding(tiny_bert_dir):  # noqa: F811
    from ferrum_service.executors.bert import BertModelExecutor

    ex = BertModelExecutor.from_path(tiny_bert_dir, model_id="bert", device="cpu")
    with InProcessServer([ex]) as srv, grpc.insecure_channel(srv.target) as ch, Client(srv.target) as c:
        eng = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        ids = [5, 6, 7, 8]
        r = eng.Embed(vpb.EmbedRequest(request_id="e", tokenized=vpb.TokenizedInput(input_ids=ids)))
        want = c.stub.Prefill(pb.PrefillRequest(model_id="bert", input=pb.PrefillInput(token_ids=ids)))
        vec = np.frombuffer(want.output.embedding.data, dtype="<f4")
        c.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id="bert", cache_id=want.output.cache.cache_id))
        assert r.embedding_dim == vec.size and r.prompt_tokens == 4
        np.testing.assert_allclose(np.array(r.embedding, dtype=np.float32), vec, rtol=1e-5, atol=1e-6)
        assert not eng.GetModelInfo(vpb.GetModelInfoRequest()).is_generation
        with pytest.raises(grpc.RpcError) as e:
            eng.Embed(vpb.EmbedRequest(request_id="e", tokenized=vpb.TokenizedInput(input_ids=[5, 10 ** 6])))
        assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT
        assert srv.live_caches() == {"bert": 0}


# ---- hostile callers ------------------------------------------------------------------------------
def _auth(token: str):
    return (("authorization", f"Bearer {token}"),)


def test_tokens_gate_the_vllm_service_and_callers_cannot_abort_each_other():
    from ferrum_service.executors import ConfigurableModelExecutor

    ex = ConfigurableModelExecutor.with_token_sequence(1000, [7], model_id="mock")
    with InProcessServer([ex], auth_tokens=["alice", "bob"]) as srv, grpc.insecure_channel(srv.target) as ch:
        eng = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        req = vpb.GenerateRequest(request_id="same-id", tokenized=vpb.TokenizedInput(input_ids=[1, 2]), stream=True,
                                  sampling_params=vpb.SamplingParams(max_tokens=900, ignore_eos=True))
        for call in (lambda: list(eng.Generate(req, timeout=10)),
                     lambda: eng.GetModelInfo(vpb.GetModelInfoRequest()),
                     lambda: eng.Abort(vpb.AbortRequest(request_ids=["same-id"]))):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert _code(e) == grpc.StatusCode.UNAUTHENTICATED
        it = eng.Generate(req, metadata=_auth("alice"), timeout=60)
        next(it)
        eng.Abort(vpb.AbortRequest(request_ids=["same-id"]), metadata=_auth("bob"))  # not bob's stream
        got = [next(it) for _ in range(20)]
        assert all(g.WhichOneof("response") == "chunk" for g in got)
        eng.Abort(vpb.AbortRequest(request_ids=["same-id"]), metadata=_auth("alice"))
        with pytest.raises(grpc.RpcError) as e:
            for _ in it:
                pass
        assert _code(e) == grpc.StatusCode.CANCELLED
        assert srv.live_caches() == {"mock": 0}


def test_a_model_without_tokenizer():
    from ferrum_service.executors import ConfigurableModelExecutor

    ex = ConfigurableModelExecutor.with_token_sequence(1000, [7, 8], model_id="mock")
    with InProcessServer([ex]) as srv, grpc.insecure_channel(srv.target) as ch:
        eng = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        out = _gen(eng, ids=[1, 2, 3], max_tokens=4, ignore_eos=True, temperature=0.0)
        ids = list(out[0].complete.output_ids)  # the scripted model's shared step counter decides the order
        assert len(ids) == 4 and set(ids) == {7, 8}
        with pytest.raises(grpc.RpcError) as e:
            list(eng.GetTokenizer(cpb.GetTokenizerRequest()))
        assert _code(e) == grpc.StatusCode.FAILED_PRECONDITION
        for bad in (dict(stop=["x"]), ):
            with pytest.raises(grpc.RpcError) as e:
                _gen(eng, ids=[1, 2, 3], max_tokens=4, **bad)
            assert _code(e) == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as e:
            list(eng.Generate(vpb.GenerateRequest(request_id="t", text="hi",
                                                  sampling_params=vpb.SamplingParams(max_tokens=2))))
        assert _code(e) == grpc.StatusCode.FAILED_PRECONDITION
        assert srv.live_caches() == {"mock": 0}


def test_flood_of_streams_and_aborts_leaves_nothing(engine, server):
    """32 concurrent streams (n = 2 each), half of them aborted or dropped mid-way: every cache
    comes back and the server still answers."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> str:
        req = vpb.GenerateRequest(request_id=f"flood-{i}", tokenized=vpb.TokenizedInput(input_ids=PROMPT[: 8 + i]),
                                  stream=True, sampling_params=vpb.SamplingParams(max_tokens=60, n=2, seed=i,
                                                                                  ignore_eos=True))
        it = engine.Generate(req, timeout=120)
        try:
            for k, _ in enumerate(it):
                if i % 4 == 1 and k == 3:
                    engine.Abort(vpb.AbortRequest(request_ids=[f"flood-{i}"]))
                if i % 4 == 2 and k == 3:
                    it.cancel()
                    return "dropped"
            return "done"
        except grpc.RpcError as e:
            return e.code().name

    with ThreadPoolExecutor(32) as pool:
        outcomes = list(pool.map(one, range(32)))
    assert outcomes.count("done") >= 16 and set(outcomes) <= {"done", "dropped", "CANCELLED"}, outcomes
    assert wait_no_live_caches(server, timeout=30) == {"tiny": 0}
    assert _gen(engine, max_tokens=2, temperature=0.0)[0].complete.completion_tokens == 2


# ---- max_tokens unset: the rest of the context, KV reserved as the contract's Generate does ------
def test_unset_max_tokens_runs_to_the_end_of_the_context(engine, server):
    """vLLM's meaning of an unset max_tokens: the rest of the model's context."""
    ctx = server.models.get("tiny").info.max_sequence_length
    out = _gen(engine, stream=True, temperature=0.0, ignore_eos=True, timeout=120)
    chunks = [o for o in out if o.WhichOneof("response") == "chunk"]
    assert len(chunks) == ctx - len(PROMPT)
    assert out[-1].complete.finish_reason == "length"
    assert server.live_caches() == {"tiny": 0}
    with pytest.raises(grpc.RpcError) as e:  # a prompt that fills the context leaves no room
        _gen(engine, ids=[5] * ctx, temperature=0.0)
    assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def small_kv(tiny_llama_dir):  # noqa: F811
    """A worker whose KV budget (512 tokens) is half the model's 1024-token context (so one
    sequence may hold at most 512: the registry's per-request ceiling)."""
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    ex = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=512,
                                      prefix_cache=False)
    with InProcessServer([ex]) as srv:
        with grpc.insecure_channel(srv.target) as ch:
            yield srv, vllm_engine_pb2_grpc.VllmEngineStub(ch)


def _drain(it) -> tuple[str, int]:
    """A stream's finish reason (or the status code it ended with) and token count."""
    n, reason = 0, ""
    try:
        for o in it:
            if o.WhichOneof("response") == "chunk":
                n += len(o.chunk.token_ids)
            else:
                reason = o.complete.finish_reason
    except grpc.RpcError as e:
        reason = e.code().name
    return reason, n


def test_unset_max_tokens_streams_share_a_budget_of_one_sequence(small_kv):
    """Two unbounded streams at once on a budget one sequence can fill: both are admitted (each
    reserves its prompt + what Generate reserves, not the 504 tokens it may reach), they grow past
    their reservations, one of them is ended where the KV runs out with RESOURCE_EXHAUSTED (never a
    silent finish "length", audit M7), the other reaches the per-sequence ceiling; nothing is
    left. Then one alone runs to the ceiling."""
    from concurrent.futures import ThreadPoolExecutor

    from ferrum_service.wire.generate import DEFAULT_MAX_TOKENS

    srv, eng = small_kv
    total = srv.models.get("tiny").executor.registry.total_tokens
    ids = PROMPT[:8]
    rest = total - len(ids)
    assert 2 * (len(ids) + DEFAULT_MAX_TOKENS) <= total < 2 * total - 2 * len(ids)

    def start(rid: str):
        req = vpb.GenerateRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=ids), stream=True,
                                  sampling_params=vpb.SamplingParams(ignore_eos=True, temperature=0.0))
        it = eng.Generate(req, timeout=120)
        assert next(it).WhichOneof("response") == "chunk"
        return it

    a = start("share-a")
    b = start("share-b")  # admitted while a holds its reservation
    with ThreadPoolExecutor(2) as pool:
        (ra, na), (rb, nb) = pool.map(_drain, [a, b])
    na, nb = na + 1, nb + 1  # the first chunks read in start()
    assert sorted((ra, rb)) == ["RESOURCE_EXHAUSTED", "length"], (ra, rb)
    assert max(na, nb) == rest and min(na, nb) < rest, (na, nb)  # the longer one outlived the other
    assert len(ids) + DEFAULT_MAX_TOKENS < len(ids) + min(na, nb), (na, nb)  # it grew past its reservation
    assert wait_no_live_caches(srv) == {"tiny": 0}
    assert _drain(eng.Generate(vpb.GenerateRequest(
        request_id="alone", tokenized=vpb.TokenizedInput(input_ids=ids),
        sampling_params=vpb.SamplingParams(ignore_eos=True, temperature=0.0)), timeout=120))[0] == "length"
    out = _gen(eng, ids=ids, temperature=0.0, ignore_eos=True)
    assert out[-1].complete.completion_tokens == rest and out[-1].complete.finish_reason == "length"
    # max_tokens given still reserves all of it up front: a second such stream is refused at once
    big = start("big")
    with pytest.raises(grpc.RpcError) as e:
        _gen(eng, ids=ids, max_tokens=rest, temperature=0.0)
    assert _code(e) == grpc.StatusCode.RESOURCE_EXHAUSTED
    big.cancel()
    assert wait_no_live_caches(srv) == {"tiny": 0}


def test_unset_max_tokens_abort_and_disconnect(small_kv):
    """An unbounded stream (one that grows instead of holding its whole reservation) aborted, or
    dropped by its client, frees its cache."""
    srv, eng = small_kv
    req = vpb.GenerateRequest(request_id="unbounded-gone", tokenized=vpb.TokenizedInput(input_ids=PROMPT[:8]),
                              stream=True, sampling_params=vpb.SamplingParams(ignore_eos=True, temperature=0.0))
    it = eng.Generate(req, timeout=60)
    next(it)
    it.cancel()
    assert wait_no_live_caches(srv) == {"tiny": 0}
    req.request_id = "unbounded-abort"
    it = eng.Generate(req, timeout=60)
    next(it)
    eng.Abort(vpb.AbortRequest(request_ids=["unbounded-abort"]))
    with pytest.raises(grpc.RpcError) as e:
        for _ in it:
            pass
    assert _code(e) == grpc.StatusCode.CANCELLED
    assert wait_no_live_caches(srv) == {"tiny": 0}


# ---- PD: SMG's prefill leg, then its decode leg with the relayed kv_transfer_params ---------------
PD_PROMPT = list(range(60, 110))  # 50 tokens: three full blocks and a partial one


@pytest.fixture(scope="module")
def pd_pair(tiny_llama_dir):  # noqa: F811
    """A --role prefill server and a --role decode server that lists it as a KV peer."""
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    def ex():
        return HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=8192)

    with InProcessServer([ex()], role="prefill") as pre:
        with InProcessServer([ex()], role="decode", kv_peers=[pre.target]) as dec:
            with grpc.insecure_channel(pre.target) as pc, grpc.insecure_channel(dec.target) as dc:
                yield pre, dec, vllm_engine_pb2_grpc.VllmEngineStub(pc), vllm_engine_pb2_grpc.VllmEngineStub(dc)


def _req(ids, rid="pd", stream=False, params=None, **sp) -> vpb.GenerateRequest:
    r = vpb.GenerateRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=ids), stream=stream,
                            sampling_params=vpb.SamplingParams(**sp))
    if params is not None:
        r.kv_transfer_params_json = params
    return r


def _prefill_leg(eng, ids, rid="pd") -> str:
    """SMG's prefill leg (max_tokens 1, n 1, not streamed, EOS ignored): the params it relays."""
    out = list(eng.Generate(_req(ids, rid, max_tokens=1, n=1, ignore_eos=True, temperature=0.0), timeout=60))
    assert len(out) == 1 and out[0].complete.completion_tokens == 1
    return out[0].complete.kv_transfer_params_json


def _queried(srv) -> int:
    """Prompt tokens the server looked up in its prefix cache: every new prompt it computes."""
    with Client(srv.target) as c:
        return c.stub.Loads(pb.LoadsRequest(model_id="tiny")).loads[0].prefix_queried_tokens


def test_pd_handoff_the_decode_worker_computes_no_prompt(engine, pd_pair):
    pre, dec, peng, deng = pd_pair
    want = list(_gen(engine, ids=PD_PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)[0].complete.output_ids)
    for stream in (False, True):
        params = _prefill_leg(peng, PD_PROMPT, rid=f"pd-{stream}")
        h = json.loads(params)["ferrum_kv"]
        assert h["source"] == pre.target and h["num_tokens"] == len(PD_PROMPT) and h["model_id"] == "tiny"
        assert pre.live_caches() == {"tiny": 1}  # kept for the decode worker
        q0, p0 = _queried(dec), _queried(pre)
        out = list(deng.Generate(_req(PD_PROMPT, f"pd-{stream}", stream=stream, params=params, max_tokens=8,
                                      temperature=0.0, ignore_eos=True), timeout=60))
        c = out[-1].complete
        got = [t for o in out[:-1] for t in o.chunk.token_ids] if stream else list(c.output_ids)
        assert got == want  # the pulled K/V give the same greedy answer as computing the prompt
        assert c.prompt_tokens == len(PD_PROMPT) and c.cached_tokens == len(PD_PROMPT) - 1
        assert _queried(dec) == q0  # no new prompt computed on the decode worker (only the last token)
        assert _queried(pre) == p0
        assert wait_no_live_caches(pre) == {"tiny": 0}  # freed once pulled
        assert wait_no_live_caches(dec) == {"tiny": 0}


def test_pd_handoff_that_cannot_be_pulled_computes_the_prompt(engine, server, pd_pair):
    """A source that is not a configured peer (never dialled), a cache that is gone, a handoff of
    another prompt, of another length: the decode worker computes the prompt and answers the same."""
    pre, dec, peng, deng = pd_pair
    other = [t + 200 for t in PD_PROMPT]
    want = list(_gen(engine, ids=PD_PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True)[0].complete.output_ids)
    good = json.loads(_prefill_leg(peng, other, rid="other"))["ferrum_kv"]  # a live handoff, of another prompt
    cases = {
        "not a peer": {**good, "source": server.target},
        "gone": {**good, "cache_id": "no-such-cache"},
        "another prompt": good,
        "another length": {**good, "num_tokens": len(PD_PROMPT) + 1},
        "another model": {**good, "model_id": "other"},
    }
    for name, h in cases.items():
        q0 = _queried(dec)
        out = list(deng.Generate(_req(PD_PROMPT, name, params=json.dumps({"ferrum_kv": h}), max_tokens=4,
                                      temperature=0.0, ignore_eos=True), timeout=60))
        c = out[-1].complete
        assert list(c.output_ids) == want, name
        assert _queried(dec) == q0 + len(PD_PROMPT), name  # computed here
        assert wait_no_live_caches(dec) == {"tiny": 0}, name
    assert wait_no_live_caches(pre) == {"tiny": 0}  # "another prompt" pulled (and dropped) the handoff


def test_pd_handoff_nobody_pulls_expires(pd_pair):
    pre, _dec, peng, _deng = pd_pair
    pd = pre.server.vllm.pd
    ttl, pd.ttl_s = pd.ttl_s, 0.5
    try:
        _prefill_leg(peng, PD_PROMPT, rid="orphan")
        assert pre.live_caches() == {"tiny": 1} and pd.offered == 1
        assert wait_no_live_caches(pre, timeout=10) == {"tiny": 0} and pd.offered == 0
    finally:
        pd.ttl_s = ttl
    # a plain request (not a prefill leg: max_tokens 2) is refused by a prefill server (it decodes
    # nothing, as on the contract) and keeps nothing
    with pytest.raises(grpc.RpcError) as e:
        list(peng.Generate(_req(PD_PROMPT, max_tokens=2, temperature=0.0, ignore_eos=True), timeout=60))
    assert _code(e) == grpc.StatusCode.FAILED_PRECONDITION and "role prefill" in e.value.details()
    assert pre.live_caches() == {"tiny": 0}


@pytest.mark.parametrize("params", [
    "not json", "[1, 2]", '{"do_remote_prefill": true, "remote_engine_id": "x", "remote_block_ids": [1]}',
    '{"ferrum_kv": 1}', '{"ferrum_kv": {"source": "h:1", "model_id": "tiny", "cache_id": "c"}}',
    '{"ferrum_kv": {"source": "h:1", "model_id": "tiny", "cache_id": "c", "num_tokens": true}}',
    '{"ferrum_kv": {"source": "", "model_id": "tiny", "cache_id": "c", "num_tokens": 5}}',
    '{"ferrum_kv": {"source": "h:1", "model_id": "tiny", "cache_id": "c", "num_tokens": 0}}',
    '{"ferrum_kv": {"source": "' + "h" * 5000 + '", "model_id": "t", "cache_id": "c", "num_tokens": 5}}',
])
def test_pd_bad_transfer_params_are_invalid_argument(pd_pair, params):
    pre, dec, _peng, deng = pd_pair
    with pytest.raises(grpc.RpcError) as e:
        list(deng.Generate(_req(PD_PROMPT, params=params, max_tokens=2), timeout=30))
    assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT
    assert "kv_transfer_params" in e.value.details()
    assert dec.live_caches() == {"tiny": 0}


def test_pd_legacy_and_n_samples_are_refused(pd_pair):
    _pre, dec, _peng, deng = pd_pair
    ours = json.dumps({"ferrum_kv": {"source": "h:1", "model_id": "tiny", "cache_id": "c", "num_tokens": 50}})
    for req in [_req(PD_PROMPT, params=ours, max_tokens=2, n=2),
                vpb.GenerateRequest(request_id="m", tokenized=vpb.TokenizedInput(input_ids=PD_PROMPT),
                                    kv_transfer_params=vpb.KvTransferParams(remote_host="h", remote_port=1),
                                    sampling_params=vpb.SamplingParams(max_tokens=2))]:
        with pytest.raises(grpc.RpcError) as e:
            list(deng.Generate(req, timeout=30))
        assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT
    assert dec.live_caches() == {"tiny": 0}


def test_pd_handoff_of_another_caller_is_not_pulled(tiny_llama_dir):  # noqa: F811
    """With bearer tokens, bob's decode leg naming alice's handoff cannot pull it (the pull runs
    on bob's behalf: NOT_FOUND there), so it computes the prompt; alice's handoff stays for alice."""
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    def ex():
        return HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=4096)

    auth = {"auth_tokens": ["alice", "bob"], "kv_peer_tokens": ["peer"]}
    with InProcessServer([ex()], role="prefill", **auth) as pre, \
            InProcessServer([ex()], role="decode", kv_peers=[pre.target], **auth) as dec, \
            grpc.insecure_channel(pre.target) as pc, grpc.insecure_channel(dec.target) as dc:
        peng, deng = vllm_engine_pb2_grpc.VllmEngineStub(pc), vllm_engine_pb2_grpc.VllmEngineStub(dc)
        out = list(peng.Generate(_req(PD_PROMPT, max_tokens=1, n=1, ignore_eos=True, temperature=0.0),
                                 metadata=_auth("alice"), timeout=60))
        params = out[0].complete.kv_transfer_params_json
        leg = _req(PD_PROMPT, params=params, max_tokens=3, temperature=0.0, ignore_eos=True)
        c = list(deng.Generate(leg, metadata=_auth("bob"), timeout=60))[-1].complete
        assert c.cached_tokens == 0 and c.completion_tokens == 3  # computed on the decode worker
        assert pre.live_caches() == {"tiny": 1}  # alice's handoff is still there
        c2 = list(deng.Generate(leg, metadata=_auth("alice"), timeout=60))[-1].complete
        assert c2.cached_tokens == len(PD_PROMPT) - 1 and list(c2.output_ids) == list(c.output_ids)
        assert wait_no_live_caches(pre) == {"tiny": 0} and wait_no_live_caches(dec) == {"tiny": 0}


def test_pd_prefill_leg_on_a_model_that_cannot_export_keeps_nothing():
    from ferrum_service.executors import ConfigurableModelExecutor

    ex = ConfigurableModelExecutor.with_token_sequence(1000, [7], model_id="mock")
    assert not ex.capabilities().supports_kv_transfer
    with InProcessServer([ex], role="prefill") as srv, grpc.insecure_channel(srv.target) as ch:
        eng = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        out = list(eng.Generate(_req([1, 2, 3, 4], max_tokens=1, n=1, ignore_eos=True), timeout=30))
        assert out[-1].complete.completion_tokens == 1
        assert not out[-1].complete.HasField("kv_transfer_params_json")
        assert wait_no_live_caches(srv) == {"mock": 0}
