"""The wire walk (``core/wire_scan.py``) refuses a request with more items than its declared bounds
before protobuf parses it, and lets every request within them through, whatever its size.

Parsing holds the interpreter (10M empty stop strings: ~1.8 s of ``FromString`` on the busy 2-core
machine); the walk stops at the bound (65 strings), so its work does not grow with the request.
Real contract and vLLM messages, encoded by protobuf itself.
"""

from __future__ import annotations

import time

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from ferrum_client import pb
from ferrum_service.core.wire_scan import MAX_UNKNOWN, SINGULAR_REPEATS, compile_scan
from ferrum_service.wire.vllm_limits import VLLM_LIMITS

GEN = compile_scan(pb.GenerateRequest.DESCRIPTOR)


def _field(e) -> str:
    return e.metadata["field"] if hasattr(e, "metadata") and "field" in e.metadata else e.field


def test_a_flood_of_tiny_items_is_refused_at_its_bound_in_constant_time():
    raw = pb.GenerateRequest(model_id="m", stop=pb.StopConditions(stop_sequences=[""] * 5_000_000)).SerializeToString()
    t0 = time.perf_counter()
    e = GEN(raw)
    took = time.perf_counter() - t0
    assert e is not None and e.field == "stop.stop_sequences" and "64" in e.message, e
    assert took < 0.2, took  # 65 tags read, not 5M (parsing them takes ~1 s)


def test_requests_within_their_bounds_pass_whatever_their_size():
    assert GEN(pb.GenerateRequest(model_id="m", text="é" * 8_000_000).SerializeToString()) is None
    assert GEN(pb.GenerateRequest(model_id="m", stop=pb.StopConditions(
        stop_sequences=["x" * 256] * 64, stop_token_ids=list(range(1024)))).SerializeToString()) is None
    chunk = compile_scan(pb.ImportKvRequest.DESCRIPTOR)
    kv = pb.ImportKvRequest(model_id="m", chunk=pb.KvChunk(layer=3, key=b"k" * (24 << 20), value=b"v" * (24 << 20)))
    raw = kv.SerializeToString()
    t0 = time.perf_counter()
    assert chunk(raw) is None
    assert time.perf_counter() - t0 < 0.2  # a few fields read, the 48 MiB of values skipped


def test_a_string_longer_than_its_bound_is_refused_unread():
    e = GEN(pb.GenerateRequest(model_id="m" * 2000).SerializeToString())
    assert e is not None and e.field == "model_id" and "1024" in e.message  # 256 characters: ≤ 1,024 bytes
    assert GEN(pb.GenerateRequest(model_id="m" * 256).SerializeToString()) is None


def test_nested_items_are_named_by_their_path():
    scan = compile_scan(vpb.GenerateRequest.DESCRIPTOR, VLLM_LIMITS)
    req = vpb.GenerateRequest(request_id="r")
    req.sampling_params.stop.extend([""] * 100_000)
    e = scan(req.SerializeToString())
    assert e is not None and e.field == "sampling_params.stop", e


def test_undeclared_fields_are_bounded():
    unknown = b"\xf8\x07\x01"  # field 127, a varint: no request declares it
    assert GEN(unknown * MAX_UNKNOWN) is None  # a newer client's few additions pass
    e = GEN(unknown * 5_000_000)
    assert e is not None and "undeclared" in e.message


def test_a_singular_field_repeated_past_any_encoder_is_refused():
    one = pb.GenerateRequest(model_id="m").SerializeToString()
    assert GEN(one * SINGULAR_REPEATS) is None
    e = GEN(one * 1_000_000)
    assert e is not None and e.field == "model_id" and "singular" in e.message


@pytest.mark.parametrize("raw", [b"\xfa\x07\xff\x0f", b"\x0b", b"\x0a\x05ab"], ids=["len-past-end", "group", "short"])
def test_malformed_bytes_are_left_to_the_parser(raw):
    assert GEN(raw) is None
    with pytest.raises(Exception):
        pb.GenerateRequest.FromString(raw)
