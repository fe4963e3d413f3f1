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
#: Single tests of the fast loop's modules that took over ~1.1 s each on a quiet run (2026-12-07,
#: ``pytest -m "not slow" --durations=60``: 1,139 tests in 5 min 3 s, these 56 calls 166 s of it):
#: a server process, a grammar compile, a flood, a TTL or keepalive wait. Named by module and
#: function (every parametrization of one); they run in the full suite.
SLOW_TESTS = frozenset({
    "test_health_progress::test_a_stalled_model_is_not_serving_until_a_step_completes",
    "test_health_progress::test_retry_info_follows_the_measured_service_rate",
    "test_hostile_cache_dirs::test_a_world_writable_cache_dir_is_not_built_in_or_loaded_from",
    "test_hostile_events::test_cli_flags_reach_the_server",
    "test_hostile_events::test_hub_owners_of_block_events_and_pending_caches",
    "test_hostile_events::test_lora_metrics_while_adapters_come_and_go",
    "test_hostile_hotpaths::test_vllm_embed_input_id_flood_is_refused_on_its_count",
    "test_hostile_limits::test_an_open_stream_keeps_its_origins_parked_caches",
    "test_hostile_limits::test_generate_n_cancelled_while_a_fork_runs_leaves_no_cache",
    "test_hostile_limits::test_loads_is_answered_within_a_second_while_a_slow_constraint_compiles",
    "test_hostile_limits::test_time_limit_deadline_full_pool_and_per_request_count",
    "test_hostile_quota::test_an_import_that_trickles_is_dropped_at_the_total_deadline",
    "test_hostile_requests::test_callers_cannot_see_or_touch_each_others_caches",
    "test_hostile_requests::test_floods_of_the_new_rpcs_are_bounded",
    "test_hostile_requests::test_new_rpcs_refuse_another_callers_ids",
    "test_hostile_requests::test_retry_ids_are_per_caller",
    "test_hostile_requests::test_slow_and_huge_transfers_do_not_stall_other_callers",
    "test_hostile_streams::test_generate_whose_client_stops_reading_is_ended_and_its_cache_freed",
    "test_hostile_streams::test_non_reading_exports_of_a_closed_sessions_caches_are_ended_and_the_caches_freed",
    "test_lora_rpcs::test_preload_from_the_command_line",
    "test_metrics::test_metrics_endpoint_exports_the_service_figures",
    "test_migration_relay::test_relay_pause_with_a_1024_token_context",
    "test_migration_relay::test_relayed_stream_equals_unmoved",
    "test_migration_relay::test_relays_past_the_cap_are_refused_and_the_stream_goes_on",
    "test_paged_decode::test_triton_kernel_under_the_interpreter",
    "test_prefix_cache_rpcs::test_no_prefix_cache_flag",
    "test_reliability_admission::test_full_model_queue_is_refused_at_once_and_releases_still_pass",
    "test_reliability_admission::test_refusals_are_logged_with_structured_fields",
    "test_reliability_cancel::test_cache_ttl_from_the_environment_and_the_reclaim_is_logged",
    "test_reliability_cancel::test_caches_of_a_quiet_origin_are_reclaimed_long_before_the_ttl",
    "test_reliability_cancel::test_idle_ownerless_caches_are_reclaimed_after_the_ttl_and_steps_renew_the_lease",
    "test_reliability_security::test_serve_refuses_pickled_weights_without_the_flag",
    "test_request_limits::test_a_64_mib_request_is_refused_without_stalling_another_caller",
    "test_scheduler_ops::test_long_unary_call_outlives_client_keepalive",
    "test_scheduler_ops::test_mirror_tracks_server_through_random_operations",
    "test_serving_metrics::test_a_prometheus_scrape_gets_the_colon_names_as_they_are",
    "test_serving_metrics::test_serving_log_lines_can_be_turned_off",
    "test_serving_metrics::test_serving_metrics_and_log_lines_from_a_live_server",
    "test_settings::test_environment_reaches_the_server_process",
    "test_speculation::test_concurrent_streams_share_steps_and_each_equals_its_plain_run",
    "test_speculation::test_speculation_draft_tokens_flag",
    "test_speculation::test_unseeded_verification_draws_from_the_target_distribution",
    "test_tls::test_cli_serves_mutual_tls_with_bearer_tokens",
    "test_typos_refused::test_boolean_switch_words_are_taken",
    "test_vllm_engine::test_flood_of_streams_and_aborts_leaves_nothing",
    "test_vllm_engine::test_unset_max_tokens_runs_to_the_end_of_the_context",
    "test_vllm_engine::test_unset_max_tokens_streams_share_a_budget_of_one_sequence",
    "test_vllm_load_push::test_a_wedged_step_shows_as_silence_and_pending_prefill",
    "test_vllm_load_push::test_no_record_before_the_first_batch_without_the_flag",
    "test_vllm_load_push::test_records_before_the_first_batch_and_the_heartbeat_pace",
})
#: Fixtures that load a real packaged model: a test that uses one is slow wherever it is.
SLOW_FIXTURES = frozenset({"smollm2", "minilm_path"})


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.path.stem if item.path is not None else ""
        test = f"{module}::{getattr(item, 'originalname', None) or item.name}"
        slow_fixture = SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if module in SLOW_MODULES or test in SLOW_TESTS or slow_fixture:
            item.add_marker(pytest.mark.slow)
