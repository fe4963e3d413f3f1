"""The vLLM protocol's ``StartProfile`` / ``StopProfile`` (``wire/vllm_profile.py``,
``hosting/profiler.py``) on a real server with the tiny random Llama, an ordinary and an admin
token, and ``--profile-dir``: a profile of N model steps over a real ``Generate`` writes a Chrome
trace under the directory and stops by itself; StopProfile without a profile, a second
StartProfile, a non-admin caller, hostile ``output_dir`` values, profiling off and a llama.cpp
model are refused with their reason, and nothing is written outside the directory. Also
``SamplingParams.grammar_from_first_token``: the constraint holds from the first token."""

from __future__ import annotations

import json
import os
import stat
import time

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.servers import InProcessServer
from .support.vllm_calls import auth, gen_request, rpc_error
from .support.waits import wait_until

pytest.importorskip("transformers")
pytest.importorskip("torch.profiler")

C = grpc.StatusCode
USER, ADMIN = "tok-user", "tok-admin"
U, ADM = auth(USER), auth(ADMIN)
PROMPT = list(range(5, 25))


@pytest.fixture(scope="module")
def profile_root(tmp_path_factory):
    return tmp_path_factory.mktemp("profiles") / "traces"  # made by the server, 0700


@pytest.fixture(scope="module")
def server(tiny_llama_dir, profile_root):  # noqa: F811
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    ex = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=4096)
    with InProcessServer([ex], auth_tokens=[USER], admin_tokens=[ADMIN], profile_dir=str(profile_root),
                         profile_keep=3) as srv:
        with grpc.insecure_channel(srv.target) as ch:
            yield srv, vllm_engine_pb2_grpc.VllmEngineStub(ch)


def _traces(root) -> list:
    return sorted(p for p in root.rglob("trace-*.json"))


@pytest.fixture(autouse=True)
def _no_profile_left(request):
    """A test that fails half-way leaves no profile running for the next ones."""
    yield
    if "server" in request.fixturenames:
        _srv, eng = request.getfixturevalue("server")
        try:
            eng.StopProfile(cpb.StopProfileRequest(), metadata=ADM, timeout=60)
        except grpc.RpcError:
            pass


def test_profile_of_n_steps_over_generate_writes_a_trace(server, profile_root):
    srv, eng = server
    host = srv.models.get("tiny")
    before = set(_traces(profile_root))
    t0 = time.perf_counter()
    r = eng.StartProfile(cpb.StartProfileRequest(output_dir="run1", num_steps=3, record_shapes=True), metadata=ADM,
                         timeout=60)
    start_s = time.perf_counter() - t0
    assert r.success and "3 steps" in r.message, r
    assert host.step_hook is not None  # armed only while a profile runs
    out = list(eng.Generate(gen_request(PROMPT, "p1", max_tokens=6, temperature=0.0), metadata=U, timeout=60))
    assert out[-1].complete.output_ids  # the generation itself is untouched
    # 6 tokens = 6 steps (the prompt's, then 5 decodes) > 3: the profiler stopped by itself
    wait_until(lambda: host.step_hook is None, timeout=30)
    t0 = time.perf_counter()
    stop = eng.StopProfile(cpb.StopProfileRequest(), metadata=ADM, timeout=60)
    stop_s = time.perf_counter() - t0
    assert stop.success and "trace written: run1/trace-" in stop.message and "3 steps" in stop.message, stop
    new = [p for p in _traces(profile_root) if p not in before]
    assert len(new) == 1 and new[0].parent == profile_root / "run1"
    size = new[0].stat().st_size
    trace = json.loads(new[0].read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("aten::") for n in names), "the model's torch ops are in the trace"
    assert stat.S_IMODE(new[0].stat().st_mode) == 0o600
    assert stat.S_IMODE(profile_root.stat().st_mode) == 0o700
    assert stat.S_IMODE((profile_root / "run1").stat().st_mode) == 0o700
    print(f"\nprofile figures: start {start_s:.3f} s, stop+write {stop_s:.3f} s, trace {size} bytes, "
          f"{len(trace['traceEvents'])} events")


def test_stop_without_profile_and_two_starts(server, profile_root):
    srv, eng = server
    e = rpc_error(lambda: eng.StopProfile(cpb.StopProfileRequest(), metadata=ADM, timeout=30))
    assert e.code() == C.FAILED_PRECONDITION and "no profile is running" in e.details(), e
    assert eng.StartProfile(cpb.StartProfileRequest(output_dir="two"), metadata=ADM, timeout=60).success
    try:
        e = rpc_error(lambda: eng.StartProfile(cpb.StartProfileRequest(output_dir="other"), metadata=ADM, timeout=30))
        assert e.code() == C.FAILED_PRECONDITION and "already" in e.details() and "one at a time" in e.details(), e
        assert not (profile_root / "other").exists()  # the refused one made nothing
        list(eng.Generate(gen_request(PROMPT, "p2", max_tokens=2, temperature=0.0), metadata=U, timeout=60))
    finally:
        stop = eng.StopProfile(cpb.StopProfileRequest(), metadata=ADM, timeout=60)
    # without num_steps it records until StopProfile: the 2 steps of the Generate
    assert stop.success and "two/trace-" in stop.message and "2 steps" in stop.message, stop
    assert srv.models.get("tiny").step_hook is None
    # then a new profile may start; stopped before its start step, it writes nothing
    n = len(_traces(profile_root))
    assert eng.StartProfile(cpb.StartProfileRequest(start_step=1000, num_steps=1), metadata=ADM, timeout=60).success
    stop = eng.StopProfile(cpb.StopProfileRequest(), metadata=ADM, timeout=60)
    assert stop.success and "no trace written" in stop.message, stop
    assert len(_traces(profile_root)) == n


def test_start_step_lets_steps_pass_first(server, profile_root):
    srv, eng = server
    host = srv.models.get("tiny")
    r = eng.StartProfile(cpb.StartProfileRequest(output_dir="later", start_step=2, num_steps=2), metadata=ADM,
                         timeout=60)
    assert r.success and "after 2 steps" in r.message
    list(eng.Generate(gen_request(PROMPT, "p3", max_tokens=6, temperature=0.0), metadata=U, timeout=60))
    wait_until(lambda: host.step_hook is None, timeout=30)
    stop = eng.StopProfile(cpb.StopProfileRequest(), metadata=ADM, timeout=60)
    assert stop.success and "later/trace-" in stop.message and "2 steps" in stop.message, stop


def test_non_admin_refused(server, profile_root):
    _srv, eng = server
    for call in (lambda md: eng.StartProfile(cpb.StartProfileRequest(), metadata=md, timeout=30),
                 lambda md: eng.StopProfile(cpb.StopProfileRequest(), metadata=md, timeout=30)):
        e = rpc_error(lambda: call(U))
        assert e.code() == C.PERMISSION_DENIED and "admin" in e.details(), e
        assert rpc_error(lambda: call(())).code() == C.UNAUTHENTICATED
    assert not _srv.models.get("tiny").step_hook  # nothing started


def test_hostile_output_dir_refused_nothing_written_outside(server, profile_root, tmp_path):
    srv, eng = server
    parent = profile_root.parent
    outside_before = {p for p in parent.iterdir() if p != profile_root}
    for bad in ("../x", "..", ".", "/etc", "/tmp/evil", "a/b", "a\\b", ".hidden", "x" * 65, "x" * 10_000, "é",
                "a b", "run\x00"):
        e = rpc_error(lambda: eng.StartProfile(cpb.StartProfileRequest(output_dir=bad, num_steps=1), metadata=ADM,
                                               timeout=30))
        assert e.code() == C.INVALID_ARGUMENT and "output_dir" in e.details(), (bad[:20], e)
    assert srv.models.get("tiny").step_hook is None
    # a subdirectory that is a link out of the directory is refused too
    profile_root.mkdir(mode=0o700, exist_ok=True)
    os.symlink(tmp_path, profile_root / "link")
    try:
        e = rpc_error(lambda: eng.StartProfile(cpb.StartProfileRequest(output_dir="link"), metadata=ADM, timeout=30))
        assert e.code() == C.FAILED_PRECONDITION and "symbolic link" in e.details(), e
    finally:
        os.unlink(profile_root / "link")
    assert {p for p in parent.iterdir() if p != profile_root} == outside_before
    assert not (parent / "x").exists() and not list(tmp_path.iterdir())
    for p in profile_root.rglob("*"):  # everything under the directory is ours, private
        assert not p.is_symlink() and p.resolve().is_relative_to(profile_root.resolve())


def test_other_bad_requests_named(server):
    _srv, eng = server
    cases = [(dict(num_steps=0), "num_steps"), (dict(num_steps=-1), "num_steps"), (dict(start_step=-5), "start_step"),
             (dict(num_steps=10**6), "num_steps"), (dict(activities=["GPU"]), "no GPU activity"),
             (dict(activities=["TPU"]), "TPU unknown"), (dict(profile_by_stage=True), "profile_by_stage")]
    for kw, said in cases:
        e = rpc_error(lambda: eng.StartProfile(cpb.StartProfileRequest(**kw), metadata=ADM, timeout=30))
        assert e.code() == C.INVALID_ARGUMENT and said in e.details(), (kw, e)


def test_traces_kept_bounded(server, profile_root):
    _srv, eng = server
    for i in range(5):
        assert eng.StartProfile(cpb.StartProfileRequest(output_dir=f"keep{i}"), metadata=ADM, timeout=60).success
        list(eng.Generate(gen_request(PROMPT, f"k{i}", max_tokens=1, temperature=0.0), metadata=U, timeout=60))
        assert "trace written" in eng.StopProfile(cpb.StopProfileRequest(), metadata=ADM, timeout=60).message
    kept = _traces(profile_root)
    assert len(kept) == 3  # --profile-keep 3: the newest
    assert {p.parent.name for p in kept} == {"keep2", "keep3", "keep4"}


def test_profiling_off_names_the_flag(tiny_llama_dir):  # noqa: F811
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    ex = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=1024)
    with InProcessServer([ex], open_admin_rpcs=True) as srv, grpc.insecure_channel(srv.target) as ch:
        eng = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        e = rpc_error(lambda: eng.StartProfile(cpb.StartProfileRequest(output_dir="x"), timeout=30))
        assert e.code() == C.FAILED_PRECONDITION and "--profile-dir" in e.details(), e


def test_llama_cpp_refused_with_reason(tmp_path):
    from .support.packaged import smollm2_gguf_path

    pytest.importorskip("llama_cpp")
    path = smollm2_gguf_path(llama_cpp=True)
    from ferrum_service.executors.llama_cpp import LlamaCppExecutor

    ex = LlamaCppExecutor(path, model_id="smollm2", threads=2, n_ctx=256, n_seq=1)
    root = tmp_path / "traces"
    with InProcessServer([ex], open_admin_rpcs=True, profile_dir=str(root)) as srv, \
            grpc.insecure_channel(srv.target) as ch:
        eng = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        e = rpc_error(lambda: eng.StartProfile(cpb.StartProfileRequest(num_steps=1), timeout=30))
        assert e.code() == C.FAILED_PRECONDITION and "llama-cpp" in e.details() and "torch profiler" in e.details(), e
        assert srv.models.get("smollm2").step_hook is None
    assert not root.exists() or not list(root.rglob("*"))


# ---- grammar_from_first_token --------------------------------------------------------------------
@pytest.mark.parametrize("constraint", ["json_schema", "regex"])
def test_grammar_from_first_token_constrains_from_the_first_token(server, constraint):
    pytest.importorskip("xgrammar")
    srv, eng = server
    tok = srv.models.get("tiny").executor.tokenizer
    if constraint == "json_schema":
        schema = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                  "required": ["x"], "additionalProperties": False}
        sp = dict(json_schema=json.dumps(schema))
    else:
        sp = dict(regex="ab[0-9]{3}")
    for seed in (1, 2):
        req = gen_request(PROMPT, f"g{seed}", stream=True, max_tokens=40, temperature=1.0, seed=seed,
                          grammar_from_first_token=True, **sp)
        chunks = [r.chunk for r in eng.Generate(req, metadata=U, timeout=60) if r.WhichOneof("response") == "chunk"]
        ids = [t for c in chunks for t in c.token_ids]
        first = tok.decode(ids[:1], skip_special_tokens=True)
        text = tok.decode(ids, skip_special_tokens=True)
        if constraint == "json_schema":
            assert first.lstrip()[:1] == "{", first  # the very first token already obeys the schema
            value = json.loads(text)
            assert set(value) == {"x"} and 0 <= value["x"] <= 9
        else:
            assert "ab".startswith(first) or first.startswith("a"), first
            assert len(text) == 5 and text.startswith("ab") and text[2:].isdigit(), text


def test_trace_bytes_kept_bounded(tmp_path):
    """``--profile-keep-bytes``: the oldest traces go past the byte bound, the newest stays."""
    from ferrum_service.hosting.profiler import StepProfiler

    root = tmp_path / "t"
    (root / "sub").mkdir(parents=True, mode=0o700)
    files = [root / "trace-a.json", root / "sub" / "trace-b.json", root / "trace-c.json", root / "sub" / "trace-d.json"]
    for i, f in enumerate(files):
        f.write_bytes(b"x" * 1000)
        os.utime(f, ns=(10**18 + i * 10**9, 10**18 + i * 10**9))
    outside = tmp_path / "trace-outside.json"
    outside.write_bytes(b"x" * 5000)
    os.symlink(tmp_path, root / "link")  # a link out is never followed
    StepProfiler(str(root), keep=10, keep_bytes=2500)._prune()
    assert [f.exists() for f in files] == [False, False, True, True] and outside.exists()
    files[3].write_bytes(b"x" * 9000)  # the newest alone is over the bound: it stays
    StepProfiler(str(root), keep=10, keep_bytes=2500)._prune()
    assert [f.exists() for f in files] == [False, False, False, True]
