"""The model-server metrics llm-d's endpoint picker scrapes, under vLLM's names: queued and
running requests, KV-cache utilisation, LoRA adapters in use — on a real server over HTTP."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from ferrum_client import Client, pb
from ferrum_service.testing.server_process import free_port

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.servers import InProcessServer
from .support.waits import wait_no_live_caches

pytest.importorskip("peft")


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _one(samples: dict[str, float], prefix: str) -> tuple[str, float]:
    hits = [(k, v) for k, v in samples.items() if k.startswith(prefix)]
    assert len(hits) == 1, (prefix, samples)
    return hits[0]


def test_llm_d_metrics(tiny_llama_dir, tmp_path):  # noqa: F811
    from ferrum_service.executors.transformers import HfCausalLmExecutor
    from ferrum_service.testing.tiny_adapters import build_lora_adapter

    ad = build_lora_adapter(tiny_llama_dir, tmp_path / "a1", seed=1)
    ex = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=4096,
                                      max_adapters=2)
    port = free_port()
    with InProcessServer([ex], metrics_port=port, open_admin_rpcs=True) as srv, Client(srv.target) as c, \
            grpc.insecure_channel(srv.target) as ch:
        c.stub.LoadAdapter(pb.LoadAdapterRequest(model_id="tiny", name="a1", path=str(ad)))
        idle = _scrape(port)
        assert idle['vllm:num_requests_waiting{model_name="tiny"}'] == 0
        assert idle['vllm:num_requests_running{model_name="tiny"}'] == 0
        assert idle['vllm:kv_cache_usage_perc{model_name="tiny"}'] == 0
        assert idle['vllm:gpu_cache_usage_perc{model_name="tiny"}'] == 0
        name, ts = _one(idle, "vllm:lora_requests_info")
        assert 'max_lora="2"' in name and 'running_lora_adapters=""' in name and abs(ts - time.time()) < 60

        # one stream on the adapter (the contract's Generate), one on the vLLM protocol
        a = c.stub.Generate(pb.GenerateRequest(model_id="tiny", token_ids=pb.TokenIds(token_ids=list(range(5, 45))),
                                               adapter="a1", stop=pb.StopConditions(max_tokens=900, ignore_eos=True)))
        next(a)
        eng = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        b = eng.Generate(vpb.GenerateRequest(request_id="m", tokenized=vpb.TokenizedInput(input_ids=list(range(5, 30))),
                                             stream=True, sampling_params=vpb.SamplingParams(max_tokens=900,
                                                                                             ignore_eos=True)))
        next(b)
        busy = _scrape(port)
        assert busy['vllm:num_requests_running{model_name="tiny"}'] + \
            busy['vllm:num_requests_waiting{model_name="tiny"}'] == 2
        assert 0 < busy['vllm:kv_cache_usage_perc{model_name="tiny"}'] <= 1
        name, _ = _one(busy, "vllm:lora_requests_info")
        assert 'running_lora_adapters="a1"' in name
        a.cancel()
        b.cancel()
        assert wait_no_live_caches(srv, timeout=10) == {"tiny": 0}
        after = _scrape(port)
        assert after['vllm:num_requests_running{model_name="tiny"}'] == 0
        assert after['vllm:kv_cache_usage_perc{model_name="tiny"}'] == 0
