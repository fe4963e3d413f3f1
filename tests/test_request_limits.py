"""Request size limits declared once and checked before any work (issue 37), on a real server.

* Every repeated, map, string and bytes field of every request message of both services on the
  port (the contract's ``ModelExecutor``: ``buf.validate`` annotations; vLLM's ``VllmEngine``: the
  table of ``wire/vllm_limits.py``) has a declared bound: the descriptor walk finds none without.
* A request over a bound is refused INVALID_ARGUMENT naming the field path and its limit, on unary,
  server-streaming, client-streaming and bidi RPCs of both services, before any conversion (an
  over-long id list that also holds an id outside the vocabulary is refused for its length).
* A ~60 MiB request (under the 64 MiB message limit) is refused while another caller's ``Loads``
  every 50 ms never takes more than 0.5 s: longer than its bounds allow, it is never parsed (30M
  empty request ids cost ~2 s of parsing on the event loop otherwise); of a type whose bounds add
  up past the message limit (``Generate``: a 16M-character text), the wire walk
  (``core/wire_scan.py``) refuses it at the first field past its count, unparsed too.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from ferrum_client import FerrumRpcError, pb, tpb
from ferrum_client._proto.ferrum.executor.v1 import executor_pb2_grpc
from ferrum_service.core.request_limits import declared, limit_of, max_encoded_bytes, unbounded_fields
from ferrum_service.core.settings import default
from ferrum_service.executors import StubModelExecutor
from ferrum_service.wire.vllm_limits import VLLM_LIMITS

from .support.servers import InProcessServer

EXECUTOR = pb.DESCRIPTOR.services_by_name["ModelExecutor"]
VLLM = vpb.DESCRIPTOR.services_by_name["VllmEngine"]
INV = grpc.StatusCode.INVALID_ARGUMENT


# ---- declared bounds --------------------------------------------------------------------------------
@pytest.mark.parametrize("service,table", [(EXECUTOR, {}), (VLLM, VLLM_LIMITS)], ids=["contract", "vllm"])
def test_every_request_field_has_a_declared_bound(service, table):
    missing = {m.name: unbounded_fields(m.input_type, table) for m in service.methods}
    assert not {k: v for k, v in missing.items() if v}, f"request fields without a declared bound: {missing}"


def test_the_walk_finds_fields_without_a_bound():
    """The walk is not vacuous: vLLM's messages carry no annotations, so without the table every
    list and string of them is reported, nested ones included."""
    found = unbounded_fields(vpb.GenerateRequest.DESCRIPTOR)
    for path in ("vllm.grpc.engine.GenerateRequest.request_id", "vllm.grpc.engine.TokenizedInput.input_ids",
                 "vllm.grpc.engine.SamplingParams.stop", "vllm.grpc.engine.SamplingParams.logit_bias",
                 "smg.grpc.common.ShmHandle.name"):
        assert path in found
    assert "vllm.grpc.engine.AbortRequest.request_ids" in unbounded_fields(vpb.AbortRequest.DESCRIPTOR)


def test_the_bounds_come_from_the_contract():
    assert declared(pb.StopConditions.DESCRIPTOR.fields_by_name["stop_sequences"]).count == 64
    assert limit_of(pb.TokenIds, "token_ids") == 1 << 20
    assert VLLM_LIMITS["vllm.grpc.engine.TokenizedInput"]["input_ids"].count == limit_of(pb.TokenIds, "token_ids")
    assert VLLM_LIMITS["vllm.grpc.engine.SamplingParams"]["stop"] == \
        declared(pb.StopConditions.DESCRIPTOR.fields_by_name["stop_sequences"])


def test_a_request_at_every_bound_fits_the_encoding_bound():
    """Nothing within its bounds is refused unparsed: requests filled to every bound (4-byte
    characters, the largest varints) encode within ``max_encoded_bytes``."""
    big = "\U0001F600"
    reqs = [
        (vpb.AbortRequest(request_ids=[big * 256] * 1024), VLLM_LIMITS),
        (pb.DetokenizeRequest(model_id=big * 256, token_ids=[-1] * (1 << 18)), {}),
        (pb.ReserveKvSlotsRequest(model_id=big * 256, requests=[tpb.KvSlotRequest(
            cache_id=big * 256, target_len=2**64 - 1, admission_target_len=2**64 - 1, new_sequence=True)] * 1024), {}),
    ]
    d = pb.DecodeRequest(model_id=big * 256, client_step_id=big * 256)
    d.input.cache_id, d.input.token_id, d.input.position = big * 256, -1, 2**64 - 1
    sp = d.input.logits.sampling
    sp.penalty_token_ids.extend([-1] * (1 << 18))
    sp.token_mask = b"\xff" * (1 << 18)
    sp.constraint.choice.choices.extend(["x" * 1024] * 4096)
    d.input.metadata.update({f"{i:064d}": "v" * 200 for i in range(64)})
    reqs.append((d, {}))
    for req, table in reqs:
        assert req.ByteSize() <= max_encoded_bytes(req.DESCRIPTOR, table), req.DESCRIPTOR.name


# ---- refusals on a real server ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    with InProcessServer([StubModelExecutor("stub", 100)]) as srv:
        yield srv


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.target, options=[("grpc.max_send_message_length", 1 << 27)]) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return executor_pb2_grpc.ModelExecutorStub(channel)


@pytest.fixture(scope="module")
def engine(channel):
    return vllm_engine_pb2_grpc.VllmEngineStub(channel)


def _refused(call, *args, field: str, limit: int, **kw) -> FerrumRpcError:
    with pytest.raises(grpc.RpcError) as info:
        out = call(*args, timeout=30, **kw)
        if hasattr(out, "__iter__"):
            list(out)
    e = FerrumRpcError.from_rpc_error(info.value)
    assert e.code == INV, e
    assert e.field == field and field in e.message and str(limit) in e.message, e
    assert e.metadata.get("limit") == str(limit), e.metadata
    return e


def test_unary_over_a_bound_names_the_field(stub):
    long_id = "c" * 257
    _refused(stub.Decode, pb.DecodeRequest(model_id="stub", input=pb.DecodeInput(cache_id=long_id)),
             field="input.cache_id", limit=256)
    req = pb.BatchPrefillRequest(model_id="stub")
    req.inputs.add(token_ids=[1, 2])
    req.inputs.add(token_ids=[1]).logits.sampling.penalty_token_ids.extend([1] * ((1 << 18) + 1))
    _refused(stub.BatchPrefill, req, field="inputs[1].logits.sampling.penalty_token_ids", limit=1 << 18)
    req = pb.ReserveKvSlotsRequest(model_id="stub", requests=[tpb.KvSlotRequest(cache_id="x")] * 1025)
    _refused(stub.ReserveKvSlots, req, field="requests", limit=1024)
    salt = "é" * 513  # 513 characters, 1026 UTF-8 bytes
    _refused(stub.Prefill, pb.PrefillRequest(model_id="stub", input=pb.PrefillInput(token_ids=[1], cache_salt=salt)),
             field="input.cache_salt", limit=1024)


def test_server_stream_over_a_bound_names_the_field(stub):
    req = pb.GenerateRequest(model_id="stub", token_ids=pb.TokenIds(token_ids=[1, 2]))
    req.stop.stop_sequences.extend(["x"] * 65)
    _refused(stub.Generate, req, field="stop.stop_sequences", limit=64)
    req = pb.GenerateRequest(model_id="stub", token_ids=pb.TokenIds(token_ids=[1, 2]))
    req.stop.stop_sequences.extend(["ok", "y" * 257])
    _refused(stub.Generate, req, field="stop.stop_sequences[1]", limit=256)


def test_session_step_over_a_bound_ends_the_stream(stub):
    """A bidi stream: the first step is answered, the over-limit one ends the stream INVALID_ARGUMENT."""
    steps = [pb.SessionRequest(step_id=1, release_cache=pb.ReleaseCacheRequest(model_id="stub", cache_id="gone")),
             pb.SessionRequest(step_id=2, decode=pb.DecodeRequest(model_id="stub"))]
    steps[1].decode.input.metadata.update({f"k{i}": i for i in range(65)})
    answers = []
    with pytest.raises(grpc.RpcError) as info:
        for r in stub.Session(iter(steps), timeout=30):
            answers.append(r)
    assert [a.step_id for a in answers] == [1]
    e = FerrumRpcError.from_rpc_error(info.value)
    assert e.code == INV and e.field == "decode.input.metadata" and "64" in e.message, e


def test_client_stream_over_a_bound_names_the_field(stub):
    head = pb.ImportKvRequest(model_id="stub", header=pb.KvTransferHeader(model_id="stub", fingerprint="f" * 300))
    _refused(stub.ImportKv, iter([head]), field="header.fingerprint", limit=256)


def test_vllm_rpcs_over_a_bound_name_the_field(engine):
    _refused(engine.Abort, vpb.AbortRequest(request_ids=["r"] * 1025), field="request_ids", limit=1024)
    gen = vpb.GenerateRequest(request_id="r", tokenized=vpb.TokenizedInput(input_ids=[1, 2]),
                              sampling_params=vpb.SamplingParams(stop=["s"] * 65, max_tokens=1))
    _refused(engine.Generate, gen, field="sampling_params.stop", limit=64)
    gen = vpb.GenerateRequest(request_id="r", tokenized=vpb.TokenizedInput(input_ids=[1]),
                              sampling_params=vpb.SamplingParams(stop_token_ids=[1] * 1025, max_tokens=1))
    _refused(engine.Generate, gen, field="sampling_params.stop_token_ids", limit=1024)
    _refused(engine.Embed, vpb.EmbedRequest(request_id="e" * 257), field="request_id", limit=256)


def test_the_count_is_checked_before_any_conversion(engine):
    """Over-long input ids whose first id is outside the vocabulary: refused for the count (the
    ids are never converted or range-checked)."""
    n = limit_of(pb.TokenIds, "token_ids")
    gen = vpb.GenerateRequest(request_id="r", tokenized=vpb.TokenizedInput(input_ids=[10**6] + [1] * n))
    _refused(engine.Generate, gen, field="tokenized.input_ids", limit=n)


def test_profile_rpcs_check_their_request_before_the_admin_gate(engine):
    _refused(engine.StartProfile, cpb.StartProfileRequest(activities=["cpu"] * 65), field="activities", limit=64)
    _refused(engine.StartProfile, cpb.StartProfileRequest(output_dir="d" * 65), field="output_dir", limit=64)
    with pytest.raises(grpc.RpcError) as info:  # within the limits: an admin RPC (tests/test_vllm_profile.py)
        engine.StartProfile(cpb.StartProfileRequest(activities=["cpu"]), timeout=30)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_a_valid_request_still_runs(stub, engine):
    pre = stub.Prefill(pb.PrefillRequest(model_id="stub", input=pb.PrefillInput(token_ids=[1, 2, 3])), timeout=30)
    cache = pre.output.cache.cache_id
    dec = stub.Decode(pb.DecodeRequest(model_id="stub", input=pb.DecodeInput(cache_id=cache, token_id=4)), timeout=30)
    assert dec.output.cache.num_tokens == 4
    stub.ReleaseCache(pb.ReleaseCacheRequest(model_id="stub", cache_id=cache), timeout=30)
    assert engine.HealthCheck(vpb.HealthCheckRequest(), timeout=30).healthy


# ---- a 64 MiB flood -----------------------------------------------------------------------------
def test_the_message_limit_is_64_mib():
    assert default("max_message_bytes") == 64 << 20


#: ~60 MiB requests (under the 64 MiB message limit) and the field each is refused for ("": the
#: whole request, longer than its bounds allow, refused unparsed).
FLOODS = {
    "vllm-abort-ids": ("", lambda: vpb.AbortRequest(request_ids=["abcdefgh"] * 6_000_000)),
    "vllm-abort-empty-ids": ("", lambda: vpb.AbortRequest(request_ids=[""] * 30_000_000)),
    "detokenize": ("", lambda: pb.DetokenizeRequest(model_id="stub", token_ids=[1 << 21] * 15_000_000)),
    # types whose bounds add up past 64 MiB (a 16M-character text): parsed only after the wire walk
    "generate-empty-stops": ("stop.stop_sequences", lambda: pb.GenerateRequest(
        model_id="stub", token_ids=pb.TokenIds(token_ids=[1]), stop=pb.StopConditions(stop_sequences=[""] * 30_000_000))),
    "vllm_generate-empty-stops": ("sampling_params.stop", lambda: _vllm_generate_with_stops(30_000_000)),
}


def _vllm_generate_with_stops(n: int) -> vpb.GenerateRequest:
    req = vpb.GenerateRequest(request_id="flood", tokenized=vpb.TokenizedInput(input_ids=[1]))
    req.sampling_params.stop.extend([""] * n)
    return req


@pytest.mark.parametrize("rpc", list(FLOODS))
def test_a_64_mib_request_is_refused_without_stalling_another_caller(server, channel, stub, engine, rpc):
    """A ~60 MiB request is refused INVALID_ARGUMENT while another caller's ``Loads`` every 50 ms
    is answered within 0.5 s each."""
    field, make = FLOODS[rpc]
    req = make()
    send = {"vllm": engine.Abort, "detokenize": stub.Detokenize, "generate": stub.Generate,
            "vllm_generate": engine.Generate}[rpc.split("-")[0]]
    assert 56 << 20 < req.ByteSize() < 64 << 20
    worst = [0.0]
    stop = threading.Event()

    def poll():
        with grpc.insecure_channel(server.target) as ch:
            other = executor_pb2_grpc.ModelExecutorStub(ch)
            other.Loads(pb.LoadsRequest(), timeout=10)
            while not stop.is_set():
                t0 = time.perf_counter()
                other.Loads(pb.LoadsRequest(), timeout=10)
                worst[0] = max(worst[0], time.perf_counter() - t0)
                time.sleep(0.05)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    time.sleep(0.2)
    outcome = None
    try:
        out = send(req, timeout=60)
        if hasattr(out, "__iter__"):  # a server stream: its status comes with the first read
            list(out)
    except grpc.RpcError as err:
        outcome = FerrumRpcError.from_rpc_error(err)
    finally:
        time.sleep(0.3)
        stop.set()
        t.join(15)
    print(f"{rpc}: worst Loads {worst[0] * 1e3:.0f} ms")
    assert worst[0] < 0.5, f"another caller's Loads took {worst[0]:.3f} s"
    assert outcome is not None and outcome.code == INV and outcome.field == field, outcome
