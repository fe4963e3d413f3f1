"""Typos and unusable inputs stop ``ferrum-service serve`` at once: exit 2, one message naming the
place (flag, variable, config key or model spec), no traceback, before any model loads.

Each case runs the real CLI as a subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from .support.servers import REPO, free_port

STUB = "stub,id=stub,vocab_size=16"


def _serve(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FERRUM_")}
    full_env.update({"HF_HUB_OFFLINE": "1", **(env or {})})
    return subprocess.run([sys.executable, "-m", "ferrum_service", "serve", "--host", "127.0.0.1",
                           "--metrics-port", "0", "--log-format", "json", *args],
                          capture_output=True, text=True, cwd=REPO, env=full_env, timeout=timeout)


def _refused(r: subprocess.CompletedProcess, *names: str) -> None:
    out = r.stderr + r.stdout
    assert r.returncode == 2, f"exit {r.returncode}: {out[-1500:]}"
    assert "Traceback" not in out, out[-1500:]
    assert "loading model" not in out, "the check ran after a model started loading"
    for name in names:
        assert name in out, f"{name!r} not named in: {out[-800:]}"


def test_unknown_config_key_is_refused(tmp_path):
    cfg = tmp_path / "ferrum.yaml"
    cfg.write_text("max_bach: 8\nmodels: [stub]\n")
    _refused(_serve("--config", str(cfg)), str(cfg), "'max_bach'", "did you mean 'max_batch'")


@pytest.mark.parametrize("spec,named", [
    ("hf-causal-lm,id=tiny,path=/models/tiny,max_batch=8", ["--model", "'max_batch'", "did you mean 'max_batch_size'"]),
    ("stub,id=s,vocab=16", ["--model", "'vocab'", "vocab_size"]),
    ("llama-cpp,path=/m.gguf,threads=two", ["--model", "threads='two'", "integer"]),
    ("stub,device=gpu", ["--model", "device", "cuda"]),
    ("configurable,token_sequence=1:x", ["--model", "token_sequence"]),
])
def test_unknown_or_bad_model_spec_options_are_refused(spec, named):
    _refused(_serve("--model", spec), *named)


def test_bad_model_options_in_the_config_and_environment_name_their_place(tmp_path):
    cfg = tmp_path / "ferrum.yaml"
    cfg.write_text("models:\n  - executor: stub\n    id: a\n  - executor: bert\n    path: /m\n    normalise: true\n")
    _refused(_serve("--config", str(cfg)), f"models in {cfg}[1]", "'normalise'", "did you mean 'normalize'")
    _refused(_serve(env={"FERRUM_MODEL": "stub;minilm,pth=/m"}), "FERRUM_MODEL", "'pth'")


@pytest.mark.parametrize("args,env,named", [
    (["--log-level", "verbose"], {}, ["--log-level", "debug, info, warning, error"]),
    (["--log-format", "text"], {}, ["--log-format", "json, console, auto"]),
    (["--device", "gpu"], {}, ["--device", "'gpu'"]),
    (["--dtype", "fp8"], {}, ["--dtype", "bf16"]),
    ([], {"FERRUM_ROLE": "decoder"}, ["FERRUM_ROLE", "both, prefill, decode"]),
    ([], {"FERRUM_DEVICE": "cuda:x"}, ["FERRUM_DEVICE"]),
    ([], {"FERRUM_GUIDED_OVERLAP": "sometimes"}, ["FERRUM_GUIDED_OVERLAP", "auto, 1, 0"]),
    ([], {"FERRUM_NO_REFLECTION": "on"}, ["FERRUM_NO_REFLECTION='on'", "true"]),
    ([], {"FERRUM_TRUST_REMOTE_CODE": "ture"}, ["FERRUM_TRUST_REMOTE_CODE='ture'"]),
])
def test_bad_enum_values_and_switches_are_refused(args, env, named):
    _refused(_serve("--model", STUB, *args, env=env), *named)


def test_a_busy_port_is_refused_before_the_model_loads():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        busy = s.getsockname()[1]
        _refused(_serve("--model", STUB, "--port", str(busy)), f"--port {busy}", "in use")
        _refused(_serve("--model", STUB, "--port", str(free_port()), "--metrics-port", str(busy)),
                 f"--metrics-port {busy}", "in use")


def test_missing_unreadable_or_bad_tls_files_are_refused(tmp_path):
    missing = str(tmp_path / "missing.pem")
    _refused(_serve("--model", STUB, "--port", "0", "--tls-cert", missing, "--tls-key", missing),
             "--tls-cert", missing, "cannot read")
    _refused(_serve("--model", STUB, "--port", "0", "--tls-cert", str(tmp_path), "--tls-key", str(tmp_path)),
             "--tls-cert", "cannot read")  # a directory
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    _refused(_serve("--model", STUB, "--port", "0", "--tls-cert", str(junk), "--tls-key", str(junk)),
             "--tls-cert", "not a PEM certificate")
    _refused(_serve("--model", STUB, "--port", "0", "--tls-cert", str(junk)), "--tls-cert and --tls-key go together")
    _refused(_serve("--model", STUB, "--port", "0", "--auth-token-file", missing), "--auth-token-file", missing)


def test_boolean_switch_words_are_taken():
    """``FERRUM_NO_REFLECTION=true`` switches reflection off (it used to do nothing: only 1 counted)."""
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
    import grpc

    from .support.servers import ServerProcess

    for value, on in (("true", False), ("no", True)):
        with ServerProcess("--model", STUB, env={"FERRUM_NO_REFLECTION": value}) as srv, \
                grpc.insecure_channel(srv.target) as ch:
            db = ProtoReflectionDescriptorDatabase(ch)
            try:
                services = list(db.get_services())
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNIMPLEMENTED
                services = []
            assert bool(services) is on, (value, services)
