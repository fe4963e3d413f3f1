"""Shared fixtures: real servers on loopback ports (see ``tests/support/servers.py``)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from ferrum_client import Client  # noqa: E402

from ferrum_service.executors import ConfigurableModelExecutor, StubModelExecutor  # noqa: E402

from .support.servers import InProcessServer  # noqa: E402

VOCAB = 1000
SEQ = [10, 20, 30]


def contract_executors():
    """The contract executors most tests share: a scripted model, an EOS model, a stub."""
    return [
        ConfigurableModelExecutor.with_token_sequence(VOCAB, SEQ, model_id="mock"),
        ConfigurableModelExecutor.with_eos_after(VOCAB, 3, 2, model_id="eos"),
        ConfigurableModelExecutor.with_token_sequence(VOCAB, SEQ, model_id="perseq", counter="per_sequence"),
        StubModelExecutor("stub", 100),
    ]


@pytest.fixture
def fresh_server():
    """A new server per test (the configurable executor's step counter starts at 0); its admin
    RPCs are open (as with --open-admin-rpcs), the contract tests call them."""
    with InProcessServer(contract_executors(), open_admin_rpcs=True) as srv:
        yield srv


@pytest.fixture
def client(fresh_server):
    with Client(fresh_server.target) as c:
        yield c


# ---- the fast loop: ``pytest -m "not slow"`` ---------------------------------------------------------
#: Test modules that are slow as a whole: several servers or processes (migration, KV hand-off,
#: gateways, replicas), real packaged models, native builds, fuzzing and soak / load runs. Every
#: test in them is marked ``slow`` at collection (the files stay where they are).
SLOW_MODULES = frozenset({
    "test_migration", "test_migration_precopy", "test_migration_llama_cpp", "test_kv_transfer",
    "test_llama_cpp", "test_llama_cpp_fork", "test_llama_cpp_kv_transfer", "test_llama_cpp_prefix",
    "test_bert_llama_cpp",
    "test_hostile_kv_llama", "test_speculation_llama", "test_multi_replica", "test_prefix_mirror",
    "test_prefix_routing", "test_smg_gateway", "test_smg_gateway_auth", "test_server_process",
    "test_real_models_server", "test_default_model", "test_hub_models", "test_reliability_soak",
    "test_reliability_load", "test_reliability_shutdown", "test_fuzz", "test_fuzz_stateful",
    "test_conformance", "test_monitoring_prometheus", "test_torch_free", "test_cuda_graphs",
    "test_vllm_kv_snapshot_server", "test_gguf_tokenizer", "test_llama_cpu_variants", "test_async_client",
    # the slowest of the rest (measured): grammar compiles, the C++ paged-attention op's fallbacks
    "test_structured_output", "test_cpu_paged_attention_fallback",
})
#: Fixtures that load a real packaged model: a test that uses one is slow wherever it is.
SLOW_FIXTURES = frozenset({"smollm2", "minilm_path"})


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.path.stem if item.path is not None else ""
        if module in SLOW_MODULES or SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
