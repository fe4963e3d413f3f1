"""Property-based fuzzing of every RPC with hypothesis.

Requests are generated from the protobuf descriptors, so every field of every request message
(and every RPC the contract grows) is covered: random ints at the edges of their types and of the
models' vocabularies (negative, huge), cache ids drawn from the caches that really exist, model
ids real and bogus, random logits policies, NaN/inf floats, random bytes, unknown enum values,
random oneof choices, nested messages, Struct metadata. Against an in-process server hosting the
scripted, EOS, per-sequence and stub executors, the tiny real Llama on transformers and SmolLM2 on
the llama.cpp executor (``llama``; 16 sequence ids, 2,048 KV cells, so both run out):

* no call ends INTERNAL or UNKNOWN (nor a Session step), the server never goes down;
* no leaked cache: after every case the registries hold only caches the fuzzer was told about
  (unary results) — caches of Sessions and Generates that ended are gone; at the end the fuzzer
  releases everything it holds and every registry is empty;
* the llama.cpp executor's own books agree with its registry after every case (sequence ids in
  use = live caches, every id free or held exactly once, llama.cpp's KV cells = the registry's
  tokens) and are back at their initial values at the end.

``FERRUM_FUZZ_EXAMPLES`` (default 2000, split over the tests) scales it; derandomized, so CI runs
the same cases every time (set ``FERRUM_FUZZ_RANDOM=1`` to explore new ones).

Not fuzzed: ``Shutdown`` (it would end the models under test; covered in test_rpcs.py).
"""

from __future__ import annotations

import asyncio
import collections
import math
import os
import time

import grpc
import pytest
from google.protobuf import descriptor as D
from google.protobuf import message_factory, struct_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferrum_client._proto.ferrum.executor.v1 import executor_pb2
from ferrum_service.executors import ConfigurableModelExecutor, StubModelExecutor

from .conftest_models import tiny_llama_dir  # noqa: F401
from .support import llama
from .support.servers import InProcessServer
from .support.waits import wait_until

TOTAL = int(os.environ.get("FERRUM_FUZZ_EXAMPLES", "2000"))
DERANDOMIZE = os.environ.get("FERRUM_FUZZ_RANDOM") != "1"
SERVICE = executor_pb2.DESCRIPTOR.services_by_name["ModelExecutor"]
SKIP = {"Shutdown"}
MODEL_IDS = ["mock", "eos", "perseq", "stub", "tiny", "llama"]
BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
STEP_TIMEOUT = 10.0


def _repeated(f: D.FieldDescriptor) -> bool:
    r = getattr(f, "is_repeated", None)
    return bool(r) if r is not None else f.label == D.FieldDescriptor.LABEL_REPEATED


def _cls(desc: D.Descriptor):
    return message_factory.GetMessageClass(desc)


# ---- value generation ----------------------------------------------------------------------------
_INT_RANGES = {
    D.FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1), D.FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    D.FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1), D.FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    D.FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1), D.FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    D.FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1), D.FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    D.FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), D.FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
_EDGES = [0, 1, 2, 3, 4, 5, 7, 10, 16, 42, 99, 100, 101, 511, 512, 513, 999, 1000, 1001, 4095, 4096, 4097, 65536, -1,
          -2]


_SMALL = {"new_len", "position", "pos_offset", "target_len", "admission_target_len", "reserve_tokens", "max_tokens",
          "top_k", "top_logprobs", "from_seq", "seed", "seq_id", "step_id"}
_FLOAT_OK = {"temperature": (0.0, 2.0), "top_p": (0.05, 1.0), "min_p": (0.0, 0.9), "repetition_penalty": (0.5, 2.0),
             "presence_penalty": (-1.0, 1.0), "frequency_penalty": (-1.0, 1.0)}


class Gen:
    """Draws request messages; knows the live caches so ids hit real ones."""

    def __init__(self, data, known: set[str]) -> None:
        self.data = data
        self.known = known

    def draw(self, strategy):
        return self.data.draw(strategy)

    def int_value(self, f: D.FieldDescriptor) -> int:
        lo, hi = _INT_RANGES[f.type]
        name = f.name
        choice = self.draw(st.integers(0, 11))
        if choice < 6 and "token" in name:
            v = self.draw(st.integers(0, 99))  # inside every model's vocabulary
        elif choice < 6 and name in _SMALL:
            v = self.draw(st.integers(0, 24))
        elif choice < 9:
            v = self.draw(st.sampled_from(_EDGES))
        elif choice < 11:
            v = self.draw(st.integers(-50, 1200))
        else:
            v = self.draw(st.sampled_from([lo, hi, lo + 1, hi - 1, 2**31 - 1, 2**32, 2**53]))
        return min(hi, max(lo, v))

    def string_value(self, f: D.FieldDescriptor) -> str:
        name = f.name
        if name == "model_id":
            return self.draw(st.sampled_from(MODEL_IDS * 4 + ["", "nope", "MOCK", "mock ", "../etc"]))
        if name == "cache_id":
            # draws of a fixed shape whatever the pool holds (hypothesis replays cases)
            pool = sorted(self.known)
            r = self.draw(st.integers(0, 9))
            i = self.draw(st.integers(0, 63))
            other = self.draw(st.sampled_from(["", "kv-1", "mock-999999", "stub-1", "\x00", "x" * 300]))
            return pool[i % len(pool)] if pool and r < 7 else other
        if name in ("request_id", "client_step_id"):
            return self.draw(st.sampled_from(["", "", "r1", "r2", "step-a"]))
        if name == "role":
            return self.draw(st.sampled_from(["user", "system", "assistant", "", "tool"]))
        return self.draw(st.text(max_size=24))

    def float_value(self, f: D.FieldDescriptor) -> float:
        if f.name in _FLOAT_OK and self.draw(st.integers(0, 3)) < 3:
            return self.draw(st.floats(*_FLOAT_OK[f.name]))
        return self.draw(st.one_of(
            st.sampled_from([0.0, 0.5, 1.0, -1.0, 2.0, math.nan, math.inf, -math.inf, 1e-45, 1e38, 0.999]),
            st.floats(allow_nan=True, allow_infinity=True, width=32)))

    def bytes_value(self, f: D.FieldDescriptor) -> bytes:
        if f.name == "token_mask":
            return self.draw(st.sampled_from([b"", b"\x01" * 1000, b"\x00" * 1000, b"\x01" * 100, b"\xff" * 512,
                                              b"\x01" * 999]))
        return self.draw(st.binary(max_size=64))

    def scalar(self, f: D.FieldDescriptor):
        t = f.type
        if t in _INT_RANGES:
            return self.int_value(f)
        if t in (D.FieldDescriptor.TYPE_FLOAT, D.FieldDescriptor.TYPE_DOUBLE):
            return self.float_value(f)
        if t == D.FieldDescriptor.TYPE_BOOL:
            return self.draw(st.booleans())
        if t == D.FieldDescriptor.TYPE_STRING:
            return self.string_value(f)
        if t == D.FieldDescriptor.TYPE_BYTES:
            return self.bytes_value(f)
        if t == D.FieldDescriptor.TYPE_ENUM:
            values = [v.number for v in f.enum_type.values]
            return self.draw(st.sampled_from(values + [max(values) + 1, 99, -1]))
        raise AssertionError(f"unhandled field type {t} of {f.full_name}")

    def struct(self, msg: struct_pb2.Struct) -> None:
        n = self.draw(st.integers(0, 3))
        for _ in range(n):
            k = self.draw(st.text(max_size=8))
            msg[k] = self.draw(st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=8),
                                         st.lists(st.integers(-5, 5), max_size=3)))

    def fill(self, msg, depth: int = 0) -> None:
        desc = msg.DESCRIPTOR
        if desc.full_name == "google.protobuf.Struct":
            self.struct(msg)
            return
        if desc.full_name in ("google.protobuf.Value", "google.protobuf.ListValue"):
            return
        oneof_pick = {}
        for o in desc.oneofs:
            if o.fields and not (len(o.fields) == 1 and o.name.startswith("_")):  # real oneofs, not proto3 optional
                oneof_pick[o.name] = self.draw(st.sampled_from([None] + [f.name for f in o.fields]))
        for f in desc.fields:
            o = f.containing_oneof
            if o is not None and o.name in oneof_pick:
                if oneof_pick[o.name] != f.name:
                    continue
                p_set = 1.0
            elif f.name in ("model_id", "cache_id"):
                p_set = 0.92
            elif f.name in ("logits", "sampling", "stop", "metadata"):
                p_set = 0.35
            else:
                p_set = 0.75 if depth < 3 else 0.2
            if self.draw(st.floats(0, 1)) > p_set:
                continue
            self.set_field(msg, f, depth)

    def set_field(self, msg, f: D.FieldDescriptor, depth: int) -> None:
        is_msg = f.type == D.FieldDescriptor.TYPE_MESSAGE
        if _repeated(f):
            if is_msg and f.message_type.GetOptions().map_entry:
                kf, vf = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
                for _ in range(self.draw(st.integers(0, 2))):
                    k = self.scalar(kf)
                    if vf.type == D.FieldDescriptor.TYPE_MESSAGE:
                        self.fill(getattr(msg, f.name)[k], depth + 1)
                    else:
                        getattr(msg, f.name)[k] = self.scalar(vf)
                return
            n = self.draw(st.integers(0, 24 if not is_msg else (4 if depth < 2 else 1)))
            field = getattr(msg, f.name)
            if "token" in f.name and f.type in _INT_RANGES and self.draw(st.integers(0, 4)) < 4:
                field.extend(self.draw(st.lists(st.integers(0, 99), min_size=n, max_size=n)))  # a valid list
                return
            for _ in range(n):
                if is_msg:
                    self.fill(field.add(), depth + 1)
                else:
                    field.append(self.scalar(f))
            return
        if is_msg:
            sub = getattr(msg, f.name)
            sub.SetInParent()
            self.fill(sub, depth + 1)
        else:
            setattr(msg, f.name, self.scalar(f))

    def message(self, desc: D.Descriptor):
        msg = _cls(desc)()
        self.fill(msg)
        return msg


def _tame(req) -> None:
    """Keep cases short: generations above 64 tokens that the model would accept are cut to 64."""
    if req.DESCRIPTOR.name == "GenerateRequest" and 64 < req.stop.max_tokens <= 4096:
        req.stop.max_tokens = 64


def _cache_ids(msg, out: set[str]) -> None:
    """Every KvCacheHandle.cache_id in a response, and every cache a reservation created for a new
    sequence (``KvSlotAllocation.created_cache_id``): the caches the fuzzer now holds."""
    for f, v in msg.ListFields():
        if f.type != D.FieldDescriptor.TYPE_MESSAGE:
            continue
        items = v if _repeated(f) else [v]
        if _repeated(f) and f.message_type.GetOptions().map_entry:
            items = list(v.values()) if f.message_type.fields_by_name["value"].type == D.FieldDescriptor.TYPE_MESSAGE \
                else []
        for it in items:
            if it.DESCRIPTOR.name in ("KvCacheHandle", "CacheHandle") and it.cache_id:
                out.add(it.cache_id)
            if it.DESCRIPTOR.name == "KvSlotAllocation" and it.created_cache_id:  # a new_sequence reservation
                out.add(it.created_cache_id)
            _cache_ids(it, out)


# ---- the server and the calls --------------------------------------------------------------------
class Fuzzer:
    def __init__(self, srv: InProcessServer) -> None:
        self.srv = srv
        self.channel = grpc.insecure_channel(srv.target)
        self.known: set[str] = set()  # caches the fuzzer was handed and may still hold
        self.stats: collections.Counter = collections.Counter()
        self.cases = 0
        self.current = None
        self.failures: list[str] = []
        self.details: collections.Counter = collections.Counter()
        self.ok_by_model: collections.Counter = collections.Counter()  # successful unary/streaming calls

    def method(self, name: str):
        m = SERVICE.methods_by_name[name]
        path = f"/{SERVICE.full_name}/{name}"
        req_ser = _cls(m.input_type).SerializeToString
        resp_de = _cls(m.output_type).FromString
        kind = {(False, False): self.channel.unary_unary, (False, True): self.channel.unary_stream,
                (True, True): self.channel.stream_stream}[(m.client_streaming, m.server_streaming)]
        return kind(path, request_serializer=req_ser, response_deserializer=resp_de)

    def check_code(self, name: str, code: grpc.StatusCode, detail: str) -> None:
        self.stats[(name, code.name)] += 1
        if code in BAD:
            self.failures.append(f"{name} -> {code.name}: {detail}\nrequest: {self.current!r}")
        if os.environ.get("FERRUM_FUZZ_DEBUG"):
            self.details[(name, code.name, detail.split(":")[0][:40])] += 1
        assert code not in BAD, f"{name} answered {code.name}: {detail}"

    def call(self, name: str, req) -> None:
        self.cases += 1
        self.current = req
        m = SERVICE.methods_by_name[name]
        fn = self.method(name)
        try:
            if not m.server_streaming:
                self.absorb(fn(req, timeout=STEP_TIMEOUT))
            else:
                timeout = 0.3 if name == "SubscribeKvEvents" else STEP_TIMEOUT
                for resp in fn(req, timeout=timeout):
                    self.absorb(resp)
            self.stats[(name, "OK")] += 1
            self.ok_by_model[getattr(req, "model_id", "")] += 1
        except grpc.RpcError as e:
            if name == "SubscribeKvEvents" and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self.stats[(name, "OK(deadline)")] += 1
                return
            self.check_code(name, e.code(), e.details())

    def session(self, steps: list) -> None:
        self.cases += 1
        self.current = steps
        fn = self.method("Session")
        try:
            for resp in fn(iter(steps), timeout=STEP_TIMEOUT):
                if resp.WhichOneof("result") == "error":
                    code = next((c for c in grpc.StatusCode if c.value[0] == resp.error.code), grpc.StatusCode.UNKNOWN)
                    self.check_code("Session." + (resp.WhichOneof("result") or "?"), code, resp.error.message)
                else:
                    self.stats[("Session.step", "OK")] += 1
            self.stats[("Session", "OK")] += 1
        except grpc.RpcError as e:
            self.check_code("Session", e.code(), e.details())
        # caches made on the session died with it: forget any the fuzzer saw there
        self.known = {c for c in self.known if self.live(c)}

    def absorb(self, resp) -> None:
        _cache_ids(resp, self.known)

    def live(self, cache_id: str) -> bool:
        return any(cache_id in h.executor.registry for h in self.srv.models)

    def registry_ids(self) -> set[str]:
        async def ids():
            for h in self.srv.server.models:
                await h.drain_releases()
            return {e.cache_id for h in self.srv.server.models for e in h.executor.registry.entries()}
        return self.srv.run(ids())

    def check_no_leak(self) -> None:
        for attempt in range(20):
            extra = self.registry_ids() - self.known
            if not extra:
                break
            time.sleep(0.02)  # a stream's finally may still be running
        if extra:
            self.failures.append(f"leak {sorted(extra)[:5]} after {self.current!r}")
        assert not extra, f"caches nobody was told about: {sorted(extra)[:5]}"
        for h in self.srv.server.models:  # the registry's running sums agree with a recount
            reg = h.executor.registry
            assert (reg.used_tokens, reg.used_tokens + reg.reserved_tokens) == reg.recount(), self.current
            if llama.is_llama(h.executor):  # sequence ids and llama.cpp's KV cells agree with the registry
                try:
                    llama.assert_books(h)
                except AssertionError as e:
                    self.failures.append(f"{e} after {self.current!r}")
                    raise
        self.known = {c for c in self.known if self.live(c)}
        assert self.srv.server.streams.active == set() or self._wait_streams()
        assert self.srv.run(_ok()) == "ok", "the server's loop stopped answering"

    def _wait_streams(self) -> bool:
        return wait_until(lambda: not self.srv.server.streams.active, timeout=2, interval=0.01)


async def _ok():
    await asyncio.sleep(0)
    return "ok"


@pytest.fixture(scope="module")
def fuzz(tiny_llama_dir):  # noqa: F811
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    executors = [
        ConfigurableModelExecutor.with_token_sequence(1000, [10, 20, 30], model_id="mock", kv_budget_tokens=20_000),
        ConfigurableModelExecutor.with_eos_after(1000, 3, 2, model_id="eos"),
        ConfigurableModelExecutor.with_token_sequence(1000, [10, 20, 30], model_id="perseq", counter="per_sequence"),
        StubModelExecutor("stub", 100),
        HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=4096),
        llama.executor("llama", n_ctx=2048, n_seq=16),
    ]
    with InProcessServer(executors, cache_ttl=0) as srv:
        f = Fuzzer(srv)
        # a few caches to aim at from the start
        for mid in MODEL_IDS:
            r = f.method("Prefill")(executor_pb2.PrefillRequest(model_id=mid, input=executor_pb2.PrefillInput(
                token_ids=[1, 2, 3])), timeout=10)
            f.absorb(r)
        yield f
        # the end: release all the fuzzer holds; every registry must then be empty
        rel = f.method("ReleaseCache")
        for cid in sorted(f.known):
            for mid in MODEL_IDS:
                try:
                    if rel(executor_pb2.ReleaseCacheRequest(model_id=mid, cache_id=cid), timeout=10).released:
                        break
                except grpc.RpcError:
                    pass
        assert f.registry_ids() == set(), "caches left after releasing everything the fuzzer held"
        llama.assert_books(srv.models.get("llama"), idle=True)
        for h in srv.models:
            assert h.executor.state != "shutdown"
        for fl in f.failures[:5]:
            print("FUZZ FAILURE:", fl)
        if f.details:
            print("\n".join(f"{v:5d} {k}" for k, v in f.details.most_common(40)))
        print("fuzz: successful calls by model: " + ", ".join(f"{k or '(none)'}={v}" for k, v in
                                                               sorted(f.ok_by_model.items())))
        print(f"\nfuzz: {f.cases} cases; outcomes: " + ", ".join(
            f"{k[0]}:{k[1]}={v}" for k, v in sorted(f.stats.items())))


def _settings(n: int):
    return settings(max_examples=n, deadline=None, derandomize=DERANDOMIZE, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=True)


UNARY = [m.name for m in SERVICE.methods if m.name not in SKIP and not m.client_streaming]


def test_fuzz_unary_and_server_streaming_rpcs(fuzz):
    n = int(TOTAL * 0.75)
    before = fuzz.cases

    @_settings(n)
    @given(st.data())
    def case(data):
        name = data.draw(st.sampled_from(UNARY))
        g = Gen(data, fuzz.known)
        req = g.message(SERVICE.methods_by_name[name].input_type)
        _tame(req)
        fuzz.call(name, req)
        fuzz.check_no_leak()

    case()
    assert fuzz.cases - before >= n * 0.9
    covered = {k[0] for k in fuzz.stats}
    assert set(UNARY) <= covered, f"RPCs never fuzzed: {set(UNARY) - covered}"


def test_fuzz_session_streams(fuzz):
    n = TOTAL - int(TOTAL * 0.75)
    before = fuzz.cases
    step_desc = SERVICE.methods_by_name["Session"].input_type
    step_fields = [f.name for f in step_desc.oneofs_by_name["step"].fields]

    @_settings(n)
    @given(st.data())
    def case(data):
        g = Gen(data, fuzz.known)
        steps = []
        for i in range(data.draw(st.integers(1, 6))):
            msg = _cls(step_desc)(step_id=data.draw(st.integers(0, 2**64 - 1)))
            which = data.draw(st.sampled_from(step_fields + [None]))
            if which is not None:
                sub = getattr(msg, which)
                sub.SetInParent()
                g.fill(sub, 1)
            steps.append(msg)
        fuzz.session(steps)
        fuzz.check_no_leak()

    case()
    assert fuzz.cases - before >= n * 0.9


def test_a_client_step_id_reused_for_another_kind_of_step_is_invalid_not_internal(fuzz):
    """Found by the fuzzer: a ReleaseCache and a ForwardVerify with the same model, the same
    client_step_id and no other fields serialize to the same bytes; the retry cache then answered
    the second with the first's response (INTERNAL). It must be INVALID_ARGUMENT naming the field."""
    S = executor_pb2.SessionRequest
    cid = fuzz.method("Prefill")(executor_pb2.PrefillRequest(model_id="mock", input=executor_pb2.PrefillInput(
        token_ids=[1, 2])), timeout=10).output.cache.cache_id
    steps = [S(step_id=1, release_cache=executor_pb2.ReleaseCacheRequest(model_id="mock", cache_id=cid,
                                                                          client_step_id="dup")),
             S(step_id=2, forward_verify=executor_pb2.ForwardVerifyRequest(model_id="mock", cache_id=cid,
                                                                           client_step_id="dup"))]
    resps = list(fuzz.method("Session")(iter(steps), timeout=10))
    assert resps[0].WhichOneof("result") == "release_cache" and resps[0].release_cache.released
    err = resps[1].error
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and err.field == "client_step_id", resps[1]
