"""Constraint-compile pool fairness between callers (audit M6).

The pool compiles 2 constraints at a time with 2 more waiting, server-wide. xgrammar cannot be
interrupted, so a compile whose request gave up (its deadline passed) kept its slot until it ended:
bob, sending distinct slow legal schemas with short deadlines, kept every slot, and alice's fresh
simple schema was RESOURCE_EXHAUSTED. Now an identified caller holds at most half the slots (its
given-up compiles count against it, not against the others), and a compile still waiting for a
thread when every request for it has given up is dropped. Real server on a loopback port with two
bearer callers, tiny random-weight Llama (its own tokenizer, so xgrammar compiles for it).
"""

from __future__ import annotations

import json
import time

import grpc
import pytest

from ferrum_client import Client, pb, tpb

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.servers import InProcessServer

pytest.importorskip("xgrammar")


def _slow_schema(tag: str, n: int = 600, reps: int = 40) -> str:
    """Legal (under every shape limit) but slow to compile (600 patterned properties: seconds)."""
    props = {f"{tag}{i}": {"type": "string", "pattern": f"^[a-z]{{1,{reps}}}$"} for i in range(n)}
    return json.dumps({"type": "object", "properties": props, "required": list(props)})


def _gen(schema: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(model_id="tiny", token_ids=pb.TokenIds(token_ids=[5, 6, 7, 8]),
                              sampling=tpb.SamplingParams(constraint=tpb.OutputConstraint(json_schema=schema)),
                              stop=pb.StopConditions(max_tokens=2))


def test_one_callers_given_up_slow_compiles_do_not_refuse_another_callers_schema(tiny_llama_dir):  # noqa: F811
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    ex = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=4096)
    with InProcessServer([ex], auth_tokens=["alice-secret", "bob-secret"], max_compile_seconds=60.0) as srv, \
            Client(srv.target, token="alice-secret") as alice, Client(srv.target, token="bob-secret") as bob:
        pool = srv.server.servicer.ops.checks.compiler
        bob_codes = []
        t0 = time.monotonic()
        for k in range(6):  # distinct slow schemas, each with a short deadline
            with pytest.raises(grpc.RpcError) as e:
                list(bob.stub.Generate(_gen(_slow_schema(f"bob{k}_")), timeout=0.2, metadata=bob.metadata))
            bob_codes.append(e.value.code())
        assert pool.in_flight >= 1  # bob's compiles go on (they cannot be stopped)
        assert time.monotonic() - t0 < 3.0
        simple = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
        # within 2 s of bob's burst
        events = list(alice.stub.Generate(_gen(simple), timeout=120, metadata=alice.metadata))
        assert events[-1].WhichOneof("event") == "finished", events[-1]
        print(f"bob's codes {[c.name for c in bob_codes]}; alice's schema compiled and ran")
        assert set(bob_codes) <= {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
        deadline = time.monotonic() + 120
        while pool.in_flight:  # let bob's compiles end before the server stops
            assert time.monotonic() < deadline
            time.sleep(0.2)
