"""Model loading is safe by default: code shipped with a checkpoint never runs and pickled weights
are not unpickled unless the operator opts in (``--trust-remote-code``, ``--allow-pickle``). Also: the bearer-token check covers every RPC kind (unary, server stream, bidi stream)
and constant-time comparison does not accept prefixes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import grpc
import pytest

from ferrum_client import Client, FerrumRpcError, messages as m, pb

from ferrum_service.executors import ConfigurableModelExecutor

from .conftest_models import tiny_llama_dir  # noqa: F401
from .support.servers import InProcessServer


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_checkpoint_code_never_runs_without_trust_remote_code(tiny_llama_dir, tmp_path):  # noqa: F811
    """A checkpoint whose config points at its own modelling code (``auto_map``): loading it
    without the opt-in runs none of that code."""
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    d = _copy(tiny_llama_dir, tmp_path / "evil")
    marker = tmp_path / "code-ran"
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig",
                       "AutoModelForCausalLM": "modeling_evil.EvilModel",
                       "AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (d / "config.json").write_text(json.dumps(cfg))
    payload = f"open({str(marker)!r}, 'w').write('ran')\n"
    for mod in ("configuration_evil", "modeling_evil", "tokenization_evil"):
        (d / f"{mod}.py").write_text(payload)
    try:
        ex = HfCausalLmExecutor.from_path(d, model_id="evil", device="cpu", kv_budget_tokens=64)
        assert ex.model.__class__.__name__ == "LlamaForCausalLM"  # the built-in class, not theirs
    except Exception:  # noqa: BLE001 - refusing the checkpoint is also acceptable
        pass
    assert not marker.exists(), "code shipped with the checkpoint ran without --trust-remote-code"


def test_cli_trust_remote_code_is_off_unless_asked(monkeypatch):
    from ferrum_service.cli import build_parser, resolve_serve_settings

    monkeypatch.delenv("FERRUM_TRUST_REMOTE_CODE", raising=False)
    args = build_parser().parse_args(["serve", "--model", "stub"])
    assert resolve_serve_settings(args)["trust_remote_code"] is False
    args = build_parser().parse_args(["serve", "--model", "stub", "--trust-remote-code"])
    assert resolve_serve_settings(args)["trust_remote_code"] is True


def test_pickled_weights_are_refused_unless_opted_in(tiny_llama_dir, tmp_path):  # noqa: F811
    import safetensors.torch
    import torch

    from ferrum_service.executors.transformers import HfCausalLmExecutor

    d = _copy(tiny_llama_dir, tmp_path / "pickled")
    sd = safetensors.torch.load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    torch.save(sd, d / "pytorch_model.bin")
    with pytest.raises(Exception) as e:  # noqa: PT011 - any refusal naming the reason
        HfCausalLmExecutor.from_path(d, model_id="pickled", device="cpu", kv_budget_tokens=64)
    assert "pickle" in str(e.value).lower() and "safetensors" in str(e.value).lower()
    ex = HfCausalLmExecutor.from_path(d, model_id="pickled", device="cpu", kv_budget_tokens=64, allow_pickle=True)
    assert ex.info().num_layers > 0  # the operator's opt-in loads it


def test_serve_refuses_pickled_weights_without_the_flag(tiny_llama_dir, tmp_path):  # noqa: F811
    import safetensors.torch
    import torch

    from ferrum_service.cli import build_parser, resolve_serve_settings

    d = _copy(tiny_llama_dir, tmp_path / "pickled")
    sd = safetensors.torch.load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    torch.save(sd, d / "pytorch_model.bin")
    assert resolve_serve_settings(build_parser().parse_args(["serve", "--model", "stub"]))["allow_pickle"] is False
    args = build_parser().parse_args(["serve", "--model", "stub", "--allow-pickle"])
    assert resolve_serve_settings(args)["allow_pickle"] is True
    r = subprocess.run([sys.executable, "-m", "ferrum_service", "serve", "--port", "0", "--metrics-port", "0",
                        "--model", f"hf-causal-lm,id=p,path={d}"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2, r.stdout + r.stderr
    assert "allow-pickle" in r.stdout + r.stderr


def test_tokens_gate_every_kind_of_rpc():
    ex = ConfigurableModelExecutor.with_token_sequence(1000, [7], model_id="mock")
    with InProcessServer([ex], auth_tokens=["s3cret"]) as srv:
        for token in (None, "s3cre", "s3cret-and-more", "S3CRET"):
            with Client(srv.target, token=token) as c:
                for call in (lambda: c.prefill("mock", [1]),
                             lambda: c.generate("mock", token_ids=[1], max_tokens=2).tokens(),
                             lambda: c.session().step(pb.PrefillRequest(model_id="mock",
                                                                        input=m.prefill_input([1])))):
                    with pytest.raises(FerrumRpcError) as e:
                        call()
                    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED, (token, e.value)
        assert srv.live_caches()["mock"] == 0  # nothing ran for the refused callers
        with Client(srv.target, token="s3cret") as c:
            assert c.generate("mock", token_ids=[1], max_tokens=2).tokens() == [7, 7]
            with c.session() as s:
                assert s.step(pb.PrefillRequest(model_id="mock", input=m.prefill_input([1]))).output.output.token_id == 7
