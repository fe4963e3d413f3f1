"""Small helpers for calling the vLLM engine protocol in tests: bearer metadata, a tokenized
``GenerateRequest``, and the error a call raises."""

from __future__ import annotations

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb


def auth(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token`` as a bearer token."""
    return (("authorization", f"Bearer {token}"),)


def gen_request(ids, rid: str = "r", stream: bool = False, **sp) -> vpb.GenerateRequest:
    """A ``GenerateRequest`` of token ids with the given sampling parameters."""
    return vpb.GenerateRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=ids), stream=stream,
                               sampling_params=vpb.SamplingParams(**sp))


def rpc_error(fn) -> grpc.RpcError:
    """The ``grpc.RpcError`` that ``fn()`` raises (the test fails if it raises none)."""
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value
