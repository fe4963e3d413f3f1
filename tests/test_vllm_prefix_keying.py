"""Whose cached prefixes a vLLM-protocol request may take on a server without authentication
(audit 2026-12-05 H6): the SMG gateway sends workers no credential and nothing that tells its
users apart, so every OpenAI user reaches the worker as the same anonymous caller. By default each
such request has a key space of its own: a prompt another client left cached, or forged K/V another
client pushed, never reach it, and it leaves nothing another request can take. With
``--vllm-shared-prefix-cache`` (the operator's choice) they share the one anonymous space.

Real servers on loopback ports, the tiny random-weight Llama, vLLM's published stubs."""

from __future__ import annotations

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from ferrum_client import Client, messages as m, pb

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.prompts import prompt_ids
from .support.servers import InProcessServer
from .test_hostile_kv import _export, _forged, _push_stream

pytest.importorskip("transformers")

M = "tiny"
PROMPT = prompt_ids(48, 7)  # three full 16-token blocks


def _executor(path):
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    return HfCausalLmExecutor.from_path(path, model_id=M, device="cpu", kv_budget_tokens=64 * 16)


def _vllm(target: str, ids, max_tokens: int = 6, metadata=()) -> vpb.GenerateComplete:
    with grpc.insecure_channel(target) as ch:
        req = vpb.GenerateRequest(request_id="k", tokenized=vpb.TokenizedInput(input_ids=ids),
                                  sampling_params=vpb.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                     ignore_eos=True))
        return list(vllm_engine_pb2_grpc.VllmEngineStub(ch).Generate(req, timeout=60, metadata=metadata))[-1].complete


def _push_forged_prefix(source: Client, target: Client, tokens) -> None:
    """What any pod that reaches an unauthenticated worker can do: push zeroed K/V claimed to be
    ``tokens``' into the worker's anonymous (default) key space, and leave them cached there."""
    own = source.stub.Prefill(pb.PrefillRequest(model_id=M, input=pb.PrefillInput(
        token_ids=prompt_ids(len(tokens), 99), logits=m.full_logits()))).output
    forged = _forged(_export(source, own.cache.cache_id), list(tokens))
    source.release_cache(M, own.cache.cache_id)
    r = target.stub.ImportKv(iter(_push_stream(forged)))
    assert r.cached_blocks == len(tokens) // 16
    target.release_cache(M, r.cache.cache_id)  # its blocks stay indexed


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):  # noqa: F811
    """A server that only ever computes PROMPT itself: the greedy answer to compare against."""
    with InProcessServer([_executor(tiny_llama_dir)]) as srv:
        yield srv, list(_vllm(srv.target, PROMPT).output_ids)


def test_pushed_kv_do_not_reach_a_gateway_request_by_default(tiny_llama_dir, reference):  # noqa: F811
    ref, want = reference
    with InProcessServer([_executor(tiny_llama_dir)]) as srv, Client(srv.target) as pod, \
            Client(ref.target) as elsewhere:
        _push_forged_prefix(elsewhere, pod, PROMPT)
        c = _vllm(srv.target, PROMPT)
        assert c.cached_tokens == 0
        assert list(c.output_ids) == want
        # nor a prefix another client computed in the anonymous space
        other = prompt_ids(48, 8)
        done = pod.stub.Prefill(pb.PrefillRequest(model_id=M, input=pb.PrefillInput(token_ids=other))).output
        pod.release_cache(M, done.cache.cache_id)
        assert _vllm(srv.target, other, max_tokens=1).cached_tokens == 0


def test_gateway_requests_share_no_prefix_with_each_other_by_default(tiny_llama_dir):  # noqa: F811
    with InProcessServer([_executor(tiny_llama_dir)]) as srv:
        first = _vllm(srv.target, PROMPT, max_tokens=1)
        second = _vllm(srv.target, PROMPT, max_tokens=1)
        assert (first.cached_tokens, second.cached_tokens) == (0, 0)
        assert srv.live_caches() == {M: 0}


def test_shared_prefix_cache_is_the_operators_choice(tiny_llama_dir, reference):  # noqa: F811
    """--vllm-shared-prefix-cache: one space for every anonymous request, prefix reuse across
    requests, and (what the NetworkPolicy of the chart's gateway mode is for) pushed K/V reach it."""
    ref, want = reference
    with InProcessServer([_executor(tiny_llama_dir)], vllm_shared_prefix_cache=True) as srv, \
            Client(srv.target) as pod, Client(ref.target) as elsewhere:
        other = prompt_ids(48, 9)
        _vllm(srv.target, other, max_tokens=1)
        assert _vllm(srv.target, other, max_tokens=1).cached_tokens >= 32
        _push_forged_prefix(elsewhere, pod, PROMPT)
        c = _vllm(srv.target, PROMPT)
        assert c.cached_tokens == 47
        assert list(c.output_ids) != want  # the forged K/V answered


def test_authenticated_vllm_callers_keep_their_own_space(tiny_llama_dir):  # noqa: F811
    """The option concerns anonymous callers only: a token's caller reuses its own prefixes and
    never another's, shared or not."""
    alice, bob = [("authorization", "Bearer tok-alice")], [("authorization", "Bearer tok-bob")]
    for shared in (False, True):
        with InProcessServer([_executor(tiny_llama_dir)], auth_tokens=["tok-alice", "tok-bob"],
                             vllm_shared_prefix_cache=shared) as srv:
            assert _vllm(srv.target, PROMPT, 1, alice).cached_tokens == 0
            assert _vllm(srv.target, PROMPT, 1, alice).cached_tokens >= 32
            assert _vllm(srv.target, PROMPT, 1, bob).cached_tokens == 0


def test_private_salts_are_fresh_and_printable():
    from ferrum_service.core.callers import current_caller
    from ferrum_service.wire.vllm_engine import PRIVATE_SALT_PREFIX, request_salt

    salts = {request_salt(False) for _ in range(100)}
    assert len(salts) == 100 and all(s.startswith(PRIVATE_SALT_PREFIX) and s.isprintable() for s in salts)
    assert request_salt(True) == ""
    token = current_caller.set("token:abc")
    try:
        assert request_salt(False) == ""  # the caller's own space (its identity is folded in)
    finally:
        current_caller.reset(token)
