"""The vLLM protocol's fleet fields on a real server with the tiny random Llama: GetServerInfo's PD
pairing factors (``--pairing-protocol``, ``attention_backend``), ``GenerateComplete``'s
speculation counts, the key space of stored block events (``cache_salt``: a digest, never the salt;
another request's space is another digest; the shared space has none) and
``vllm:cache_config_info`` on /metrics."""

from __future__ import annotations

import re
import threading
import time
import urllib.request

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from ferrum_client import Client, pb

from ferrum_service.core.settings import SettingError, setting
from ferrum_service.testing.server_process import free_port
from ferrum_service.wire.vllm_kv_events import NAMESPACE_PREFIX

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.servers import InProcessServer
from .support.vllm_calls import gen_request
from .support.waits import wait_for

pytest.importorskip("transformers")


def _server(path, **cfg):
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    return InProcessServer([HfCausalLmExecutor.from_path(path, model_id="tiny", device="cpu",
                                                         kv_budget_tokens=4096)], **cfg)


def _stored_salts(eng, run, n: int) -> list[str]:
    """``cache_salt`` of the stored events that come while ``run()`` runs (at least ``n``)."""
    call = eng.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(load_records_before_first_batch=True), timeout=60)
    got: list = []

    def read():
        try:
            for b in call:
                got.extend(e.stored for e in b.events if e.WhichOneof("data") == "stored")
        except grpc.RpcError:
            pass

    t = threading.Thread(target=read, daemon=True)
    t.start()
    time.sleep(0.3)
    try:
        run()
        wait_for(lambda: len(got), lambda k: k >= n, 10, 0.05)
    finally:
        call.cancel()
        t.join(5)
    return [s.cache_salt if s.HasField("cache_salt") else None for s in got]


def test_server_info_pairing_speculation_counts_and_cache_config(tiny_llama_dir):  # noqa: F811
    port = free_port()
    with _server(tiny_llama_dir, pairing_protocol="ferrum-kv-v1", speculation_draft_tokens=4,
                 metrics_port=port) as srv, grpc.insecure_channel(srv.target) as ch:
        eng = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        info = eng.GetServerInfo(vpb.GetServerInfoRequest())
        assert info.pairing_protocol == "ferrum-kv-v1"
        assert info.attention_backend == "hf-causal-lm/sdpa" and info.kv_cache_dtype == "fp32"
        # a repetitive prompt: the n-gram drafter proposes, the step verifies
        prompt = list(range(100, 140)) + list(range(100, 103)) + list(range(50, 60)) + list(range(100, 103))
        c = list(eng.Generate(gen_request(prompt, max_tokens=40, ignore_eos=True, temperature=0.0)))[-1].complete
        assert c.spec_draft_tokens > 0 and 0 <= c.spec_accepted_tokens <= c.spec_draft_tokens, c
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        m = re.search(r'vllm:cache_config_info\{([^}]*)\} 1\.0', text)
        assert m, text[:2000]
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        assert labels == {"model_name": "tiny", "block_size": str(info.block_size), "num_gpu_blocks": "256"}


def test_a_bad_pairing_protocol_is_refused_naming_the_setting():
    st = setting("pairing_protocol")
    assert st.parse("Ferrum-KV-v1", "--pairing-protocol") == "ferrum-kv-v1"
    for bad in ("has space", "x" * 129, "new\nline", "é"):
        with pytest.raises(SettingError, match="pairing-protocol"):
            st.parse(bad, "--pairing-protocol")


def test_stored_events_name_the_key_space_never_the_salt(tiny_llama_dir):  # noqa: F811
    prompt = list(range(200, 236))  # two full 16-token blocks
    with _server(tiny_llama_dir) as srv, grpc.insecure_channel(srv.target) as ch, Client(srv.target) as c:
        eng = vllm_engine_pb2_grpc.VllmEngineStub(ch)

        def run():
            for k in range(2):  # each unauthenticated vLLM request: a private space of its own
                list(eng.Generate(gen_request(prompt, rid=f"v{k}", max_tokens=1), timeout=30))
            # a contract caller's own salt: announced as a digest, never as itself
            list(c.stub.Generate(pb.GenerateRequest(model_id="tiny", token_ids=pb.TokenIds(token_ids=prompt),
                                                    cache_salt="secret-salt",
                                                    stop=pb.StopConditions(max_tokens=1))))
            # the shared space (no salt): no cache_salt
            list(c.stub.Generate(pb.GenerateRequest(model_id="tiny", token_ids=pb.TokenIds(token_ids=prompt),
                                                    stop=pb.StopConditions(max_tokens=1))))

        salts = _stored_salts(eng, run, 4)
    assert len(salts) >= 4, salts
    spaces = [s for s in salts if s is not None]
    assert None in salts  # the shared space
    assert all(re.fullmatch(re.escape(NAMESPACE_PREFIX) + "[0-9a-f]{16}", s) for s in spaces), spaces
    assert len(set(spaces)) >= 3  # two private requests and the salted caller: three spaces
    assert not any("secret" in s or "vllm-request" in s for s in spaces)
