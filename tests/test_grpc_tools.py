"""The usual gRPC tools work against a live server through reflection alone (no .proto files):
grpcurl lists, describes every kind of symbol and calls a method; ghz load-tests a method it
resolves by reflection; grpc-health-probe (the Kubernetes probe's tool) reads health overall and
per model.

The tools are Go modules installed by ``scripts/grpc_tools.sh`` (``scripts/test.sh`` runs it and
puts them on PATH). Outside CI a machine without them skips this module; in CI a missing tool fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .support.servers import ServerProcess

BIN = Path(os.environ.get("FERRUM_CACHE_DIR", Path.home() / ".cache/ferrum-service")) / "bin"
MOCK = "configurable,id=mock,vocab_size=1000,token_sequence=10:20:30"


def _tool(name: str) -> str:
    path = shutil.which(name) or (str(BIN / name) if (BIN / name).exists() else None)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing: scripts/grpc_tools.sh installs it")
        pytest.skip(f"{name} not installed (scripts/grpc_tools.sh)")
    return path


def _run(*cmd: str, timeout: float = 60, stderr: bool = False) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{cmd}: rc={r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout + (r.stderr if stderr else "")


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--model", MOCK) as srv:
        yield srv


def test_grpcurl_lists_and_describes_every_kind_of_symbol(server):
    grpcurl = _tool("grpcurl")
    services = _run(grpcurl, "-plaintext", server.target, "list").split()
    assert {"ferrum.executor.v1.ModelExecutor", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= set(services)
    methods = _run(grpcurl, "-plaintext", server.target, "list", "ferrum.executor.v1.ModelExecutor").split()
    assert "ferrum.executor.v1.ModelExecutor.Prefill" in methods and len(methods) >= 28
    for symbol, expect in [
        ("ferrum.executor.v1.ModelExecutor", "service ModelExecutor"),
        ("ferrum.executor.v1.ModelExecutor.Prefill", "rpc Prefill"),
        ("ferrum.executor.v1.ModelExecutor.Generate", "returns ( stream"),
        ("ferrum.executor.v1.PrefillRequest", "message PrefillRequest"),
        ("ferrum.executor.v1.LogitsPolicy", "message LogitsPolicy"),  # from types.proto
        ("ferrum.executor.v1.FinishReason", "enum FinishReason"),
        ("ferrum.executor.v1.PrefillRequest.model_id", "model_id"),
        ("grpc.health.v1.Health.Check", "rpc Check"),
        ("grpc.reflection.v1.ServerReflection", "service ServerReflection"),
    ]:
        out = _run(grpcurl, "-plaintext", server.target, "describe", symbol)
        assert expect in out, (symbol, out)


def test_grpcurl_calls_a_method_by_reflection(server):
    grpcurl = _tool("grpcurl")
    out = json.loads(_run(grpcurl, "-plaintext", "-d", '{"model_id": "mock", "input": {"token_ids": [1, 2]}}',
                          server.target, "ferrum.executor.v1.ModelExecutor/Prefill"))
    assert out["output"]["output"]["token_id"] == 10
    cid = out["output"]["cache"]["cache_id"]
    out = json.loads(_run(grpcurl, "-plaintext", "-d", json.dumps({"model_id": "mock", "cache_id": cid}),
                          server.target, "ferrum.executor.v1.ModelExecutor/ReleaseCache"))
    assert out["released"] is True


def test_ghz_resolves_the_method_by_reflection_and_runs(server):
    ghz = _tool("ghz")
    out = json.loads(_run(ghz, "--insecure", "--call", "ferrum.executor.v1.ModelExecutor.Tokenize",
                          "-d", '{"model_id": "mock", "text": "hi"}', "-n", "40", "-c", "2", "--format", "json",
                          server.target, timeout=120))
    # the scripted model has no tokenizer: every call must get its documented FAILED_PRECONDITION
    assert out["count"] == 40 and out["statusCodeDistribution"] == {"FailedPrecondition": 40}
    out = json.loads(_run(ghz, "--insecure", "--call", "ferrum.executor.v1.ModelExecutor.Loads",
                          "-d", '{"model_id": "mock"}', "-n", "60", "-c", "3", "--format", "json", server.target,
                          timeout=120))
    assert out["count"] == 60 and out["statusCodeDistribution"] == {"OK": 60}


def test_grpc_health_probe_reads_the_server_and_each_model(server):
    probe = _tool("grpc-health-probe")
    assert "status: SERVING" in _run(probe, "-addr", server.target, stderr=True)
    assert "status: SERVING" in _run(probe, "-addr", server.target, "-service", "mock", stderr=True)
    r = subprocess.run([probe, "-addr", server.target, "-service", "no-such-model"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode != 0
