"""The ``ferrum-service`` process: CLI flags, env and config file, auth, graceful SIGTERM drain."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import grpc
import pytest

from ferrum_client import Client, FerrumRpcError

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.servers import REPO, ServerProcess
from .support.waits import wait_until

MOCK = "configurable,id=mock,vocab_size=1000,token_sequence=10:20:30"


def test_sigterm_drains_streams_then_exits_zero():
    srv = ServerProcess("--model", MOCK, "--grace-period", "30").start()
    try:
        with Client(srv.target) as c:
            stream = c.generate("mock", token_ids=[1], max_tokens=4000)  # outlasts the checks below
            it = iter(stream)
            assert next(it).WhichOneof("event") == "started"
            srv.terminate(signal.SIGTERM)
            assert wait_until(lambda: c.health() == "NOT_SERVING")  # health flips first
            with pytest.raises(FerrumRpcError) as e:
                c.prefill("mock", [1])
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
            # the in-flight stream is allowed to finish
            rest = list(it)
            assert rest[-1].WhichOneof("event") == "finished"
        assert srv.wait(40) == 0
    finally:
        srv.stop()
    assert '"stopped"' in srv.log()


def test_env_and_config_file(tmp_path):
    cfg = tmp_path / "ferrum.yaml"
    cfg.write_text("models:\n  - executor: configurable\n    id: fromfile\n    vocab_size: 64\n"
                   "    token_sequence: [5, 6]\n")
    with ServerProcess(env={"FERRUM_CONFIG": str(cfg)}) as srv, Client(srv.target) as c:
        info = c.info().models
        assert [m.model_id for m in info] == ["fromfile"] and info[0].vocab_size == 64
        assert c.generate("fromfile", token_ids=[1], max_tokens=3).tokens() == [5, 5, 6]
    with ServerProcess(env={"FERRUM_MODEL": "stub,id=s1,vocab_size=8;stub,id=s2"}) as srv, Client(srv.target) as c:
        assert [m.model_id for m in c.info().models] == ["s1", "s2"]


def test_bad_model_spec_exits_with_a_message():
    r = subprocess.run([sys.executable, "-m", "ferrum_service", "serve", "--model", "warp-drive", "--port", "0"],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode != 0 and "unknown executor" in (r.stderr + r.stdout)


def test_bearer_token_auth_and_admin_gate(tmp_path):
    (tmp_path / "tokens").write_text("user-secret\n")
    (tmp_path / "admin").write_text("admin-secret\n")
    with ServerProcess("--model", MOCK, "--auth-token-file", str(tmp_path / "tokens"),
                       "--admin-token-file", str(tmp_path / "admin")) as srv:
        with Client(srv.target) as anon:
            assert anon.health() == "SERVING"  # probes need no token
            with pytest.raises(FerrumRpcError) as e:
                anon.info()
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        with Client(srv.target, token="wrong") as bad:
            with pytest.raises(FerrumRpcError) as e:
                bad.prefill("mock", [1])
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        with Client(srv.target, token="user-secret") as user:
            assert user.prefill("mock", [1]).output.output.token_id == 10
            assert user.generate("mock", token_ids=[1], max_tokens=2).tokens() == [10, 10]
            with pytest.raises(FerrumRpcError) as e:
                user.shutdown()
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        with Client(srv.target, token="admin-secret") as admin:
            assert list(admin.warmup().model_ids) == ["mock"]


def test_generate_command_streams_from_a_running_server():
    with ServerProcess("--model", MOCK) as srv:
        r = subprocess.run([sys.executable, "-m", "ferrum_service", "generate", "hello", "--target", srv.target,
                            "--raw", "--max-tokens", "3"], capture_output=True, text=True, cwd=REPO, timeout=60,
                           env={**os.environ, "HF_HUB_OFFLINE": "1"})
    # the configurable model has no tokenizer, so a text prompt is refused with a clear message
    assert r.returncode == 1 and "tokenizer" in r.stderr


def test_models_warm_up_before_the_port_opens(tiny_llama_dir):  # noqa: F811 - fixture
    """``serve`` runs each model's ``warmup`` (one tiny prefill + decode) before the port opens, so a
    fresh server's first request does not pay for faulting in its weights (a first llama.cpp forward
    on a just-converted F16 file took 0.3-3 s here, 30 ms once warm); the warm-up leaves no cache and
    no KV in use. ``--no-warmup`` skips it."""
    spec = f"hf-causal-lm,id=tiny,path={tiny_llama_dir},device=cpu"
    with ServerProcess("--model", spec) as srv, Client(srv.target) as c:
        log = srv.log()
        assert '"model warmed up"' in log and log.index('"model warmed up"') < log.index('"serving"'), log
        assert c.kv_capacity("tiny").used_tokens == 0
        assert len(c.generate("tiny", token_ids=[1, 2, 3], max_tokens=3).tokens()) == 3
    with ServerProcess("--model", spec, "--no-warmup") as srv:
        assert '"model warmed up"' not in srv.log()
