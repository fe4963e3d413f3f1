"""The bad-input matrix: each malformed request gets its documented status code and a message
naming the field; afterwards the server still serves and the caches are intact.

The same table is in docs/errors.md.
"""

from __future__ import annotations

import math

import grpc
import pytest

from ferrum_client import FerrumRpcError, messages as m, pb, tpb

C = grpc.StatusCode


def _sampled(**kw):
    return m.sampled(m.sampling(**kw))


# (name, call(client, cache_id) -> None, expected code, text the message must contain)
CASES = [
    ("unknown model", lambda c, k: c.prefill("nope", [1]), C.NOT_FOUND, "model_id"),
    ("empty model id with several models", lambda c, k: c.prefill("", [1]), C.INVALID_ARGUMENT, "model_id"),
    ("unknown cache id", lambda c, k: c.decode("mock", "kv-unknown", 1), C.NOT_FOUND, "input.cache_id"),
    ("empty cache id", lambda c, k: c.decode("mock", "", 1), C.INVALID_ARGUMENT, "input.cache_id"),
    ("foreign cache id", lambda c, k: c.decode("perseq", k, 1), C.INVALID_ARGUMENT, "belongs to model"),
    ("token id >= vocab", lambda c, k: c.decode("mock", k, 1000), C.INVALID_ARGUMENT, "input.token_id"),
    ("negative token id", lambda c, k: c.decode("mock", k, -1), C.INVALID_ARGUMENT, "input.token_id"),
    ("prompt token >= vocab", lambda c, k: c.prefill("mock", [1, 5000]), C.INVALID_ARGUMENT, "input.token_ids[1]"),
    ("negative prompt token", lambda c, k: c.prefill("mock", [-3]), C.INVALID_ARGUMENT, "input.token_ids[0]"),
    ("empty prompt", lambda c, k: c.prefill("mock", []), C.INVALID_ARGUMENT, "input.token_ids"),
    ("prompt longer than the model", lambda c, k: c.prefill("mock", [1] * 4097), C.INVALID_ARGUMENT, "limit is 4096"),
    ("reserve beyond the model", lambda c, k: c.prefill("mock", [1], reserve_tokens=10_000), C.INVALID_ARGUMENT,
     "input.reserve_tokens"),
    ("truncate past the end", lambda c, k: c.truncate_kv("mock", k, 99), C.OUT_OF_RANGE, "new_len"),
    ("truncate below zero", lambda c, k: c.truncate_kv("mock", k, -1), C.OUT_OF_RANGE, "new_len"),
    ("truncate unknown cache", lambda c, k: c.truncate_kv("mock", "kv-x", 0), C.NOT_FOUND, "cache_id"),
    ("batch decode with a duplicate cache", lambda c, k: c.batch_decode("mock", [(k, 1), (k, 2)]),
     C.INVALID_ARGUMENT, "appears twice"),
    ("batch mixing models", lambda c, k: c.batch_decode("perseq", [(k, 1)]), C.INVALID_ARGUMENT, "belongs to model"),
    ("empty batch decode", lambda c, k: c.batch_decode("mock", []), C.INVALID_ARGUMENT, "inputs"),
    ("empty batch prefill", lambda c, k: c.batch_prefill("mock", []), C.INVALID_ARGUMENT, "inputs"),
    ("top_p > 1", lambda c, k: c.decode("mock", k, 1, policy=_sampled(top_p=1.5)), C.INVALID_ARGUMENT,
     "input.logits.sampling.top_p"),
    ("top_p = 0", lambda c, k: c.decode("mock", k, 1, policy=_sampled(top_p=0.0)), C.INVALID_ARGUMENT, "top_p"),
    ("NaN temperature", lambda c, k: c.decode("mock", k, 1, policy=_sampled(temperature=math.nan)),
     C.INVALID_ARGUMENT, "input.logits.sampling.temperature"),
    ("negative temperature", lambda c, k: c.decode("mock", k, 1, policy=_sampled(temperature=-1.0)),
     C.INVALID_ARGUMENT, "temperature"),
    ("infinite temperature", lambda c, k: c.decode("mock", k, 1, policy=_sampled(temperature=math.inf)),
     C.INVALID_ARGUMENT, "temperature"),
    ("min_p out of range", lambda c, k: c.decode("mock", k, 1, policy=_sampled(min_p=1.0)), C.INVALID_ARGUMENT,
     "min_p"),
    ("zero repetition penalty", lambda c, k: c.decode("mock", k, 1, policy=_sampled(repetition_penalty=0.0)),
     C.INVALID_ARGUMENT, "repetition_penalty"),
    ("token mask allowing nothing", lambda c, k: c.decode("mock", k, 1, policy=_sampled(token_mask=b"\0" * 1000)),
     C.INVALID_ARGUMENT, "token_mask"),
    ("too many top logprobs", lambda c, k: c.decode("mock", k, 1, policy=m.top_logprobs(65)), C.INVALID_ARGUMENT,
     "top_logprobs"),
    ("top-logprobs mode without k", lambda c, k: c.decode(
        "mock", k, 1, policy=tpb.LogitsPolicy(mode=tpb.OUTPUT_MODE_TOP_LOGPROBS)), C.INVALID_ARGUMENT, "top_logprobs"),
    ("bad logits dtype", lambda c, k: c.decode(
        "mock", k, 1, policy=tpb.LogitsPolicy(mode=tpb.OUTPUT_MODE_FULL_LOGITS, logits_dtype=tpb.DATA_TYPE_INT8)),
     C.INVALID_ARGUMENT, "logits_dtype"),
    ("stale position", lambda c, k: c.decode("mock", k, 1, position=0), C.FAILED_PRECONDITION, "input.position"),
    ("generate max_tokens beyond the model", lambda c, k: c.generate("mock", token_ids=[1], max_tokens=5000).tokens(),
     C.INVALID_ARGUMENT, "stop.max_tokens"),
    ("generate without a prompt", lambda c, k: c.generate("mock").tokens(), C.INVALID_ARGUMENT, "prompt"),
    ("generate text without a tokenizer", lambda c, k: c.generate("mock", text="hi").tokens(),
     C.FAILED_PRECONDITION, "tokenizer"),
    ("unified decode unsupported", lambda c, k: c.unified_decode("mock", [m.unified_item([1])]), C.UNIMPLEMENTED,
     "UnifiedDecode"),
    ("verify with a bad token", lambda c, k: c.forward_verify("mock", k, [1, 1000]), C.INVALID_ARGUMENT,
     "token_ids[1]"),
    ("accept prefix without sampled tokens", lambda c, k: c.forward_verify(
        "mock", k, [1, 2], accept_greedy_prefix=True, policy=m.full_logits()), C.INVALID_ARGUMENT,
     "accept_greedy_prefix"),
    ("release a foreign cache", lambda c, k: c.release_cache("perseq", k), C.INVALID_ARGUMENT, "belongs to model"),
]


@pytest.mark.parametrize("name,call,code,text", CASES, ids=[c[0] for c in CASES])
def test_bad_input_matrix(fresh_server, client, name, call, code, text):
    cid = client.prefill("mock", [1, 2, 3]).output.cache.cache_id
    with pytest.raises(FerrumRpcError) as e:
        call(client, cid)
    assert e.value.code == code, f"{name}: {e.value}"
    assert text in e.value.message, f"{name}: {e.value.message!r} does not mention {text!r}"
    assert e.value.kind, "every error carries ferrum's error kind (google.rpc.ErrorInfo)"
    # the server still serves and the cache is intact
    assert client.kv_capacity("mock").used_tokens == 3
    d = client.decode("mock", cid, 1).output
    assert d.cache.num_tokens == 4


def test_message_above_size_limit_is_refused_and_server_survives():
    from ferrum_client import Client
    from ferrum_service.executors import StubModelExecutor

    from .support.servers import InProcessServer

    with InProcessServer([StubModelExecutor("stub", 100)], max_message_bytes=64 * 1024) as srv, \
            Client(srv.target) as c:
        with pytest.raises(FerrumRpcError) as e:
            c.prefill("stub", [1] * 100_000)
        assert e.value.code == C.RESOURCE_EXHAUSTED
        assert c.prefill("stub", [1, 2]).output.cache.num_tokens == 2


def test_error_details_carry_kind_field_and_retry(fresh_server, client):
    with pytest.raises(FerrumRpcError) as e:
        client.prefill("mock", [1, 99999])
    assert e.value.kind == "REQUEST_VALIDATION" and e.value.field == "input.token_ids[1]"
    assert e.value.metadata["vocab_size"] == "1000"


def test_concurrent_steps_on_one_cache_are_refused_with_aborted():
    """Two steps on one cache at once: the second is ABORTED (steps on a cache never overlap)."""
    import threading

    from ferrum_client import Client
    from ferrum_service.executors import ConfigurableModelExecutor

    from .support.servers import InProcessServer

    started, go = threading.Event(), threading.Event()

    class SlowExecutor(ConfigurableModelExecutor):
        inline = False  # run on the worker thread, like a real model

        def decode(self, inp):
            started.set()  # the first decode holds the cache until the test lets it go
            assert go.wait(30), "the test never released the first decode"
            return super().decode(inp)

    with InProcessServer([SlowExecutor(100, [5], model_id="slow")]) as srv, Client(srv.target) as c:
        cid = c.prefill("slow", [1]).output.cache.cache_id
        results: list = []
        t = threading.Thread(target=lambda: results.append(c.decode("slow", cid, 1)))
        t.start()
        assert started.wait(30), "the first decode never started"
        try:
            with pytest.raises(FerrumRpcError) as e:
                c.decode("slow", cid, 1)
        finally:
            go.set()
            t.join(30)
        assert e.value.code == C.ABORTED and "busy" in e.value.message
        assert results[0].output.cache.num_tokens == 2
        assert c.decode("slow", cid, 1).output.cache.num_tokens == 3
