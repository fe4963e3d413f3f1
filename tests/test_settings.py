"""The settings table (``core/settings.py``): one default per setting, every environment variable
listed, the CLI, the config file, ``ServerConfig`` and the docs derived from it; and the mode enums."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import subprocess
import sys

import grpc
import pytest
from ferrum_client import Client, FerrumRpcError
from ferrum_client._proto.ferrum.executor.v1 import executor_pb2 as pb
from ferrum_client._proto.ferrum.executor.v1 import types_pb2 as tpb

from ferrum_service.cli import build_parser, main, resolve_serve_settings
from ferrum_service.core import settings
from ferrum_service.core.modes import BlockEvent, CacheEvent, ExecutorState, Role
from ferrum_service.core.settings import SETTINGS, STANDARD_ENV, SettingError

from .support.servers import REPO, ServerProcess

PACKAGE = REPO / "ferrum_service"
STUB = "stub,id=stub,vocab_size=16"


@pytest.fixture
def clean_env(monkeypatch):
    """No FERRUM_* variable of the table leaks in from the shell running the tests."""
    for st in SETTINGS:
        if st.env:
            monkeypatch.delenv(st.env, raising=False)
    return monkeypatch


def _resolve(*argv: str) -> dict:
    return resolve_serve_settings(build_parser().parse_args(["serve", *argv]))


# ---- the table itself ------------------------------------------------------------------------------
def test_every_name_flag_variable_and_key_is_used_once():
    for attr in ("name", "flag", "env", "yaml"):
        values = [getattr(st, attr) for st in SETTINGS if getattr(st, attr)]
        assert len(values) == len(set(values)), f"{attr} used twice: {sorted(v for v in values if values.count(v) > 1)}"
    assert not set(STANDARD_ENV) & {st.env for st in SETTINGS}
    for st in SETTINGS:
        assert st.help and st.command in ("serve", "server", "generate"), st.name
        assert st.flag is None or st.flag.startswith("--"), st.name
        assert st.env is None or re.fullmatch(r"FERRUM_[A-Z0-9_]+", st.env), st.name
        if st.default is not None:  # the default has the setting's type
            assert isinstance(st.default, tuple if st.type is list else st.type), st.name
        if st.is_switch:
            assert st.flag and st.env, f"{st.name}: a switch needs its flag and its =1 variable"


def test_server_config_defaults_are_the_table_defaults():
    from ferrum_service.server import ServerConfig

    fields = {f.name: f for f in dataclasses.fields(ServerConfig)}
    from_files = {"auth_tokens", "admin_tokens", "kv_peers", "kv_peer_tokens"}  # the CLI reads them from files
    assert set(fields) - from_files <= {st.name for st in SETTINGS}, set(fields) - from_files
    for name in set(fields) - from_files:
        assert fields[name].default == settings.default(name), name
    assert ServerConfig().role is Role.BOTH


def test_the_parts_the_server_configures_default_to_the_table():
    """Constructors and constants below the server read their defaults from the table too."""
    from ferrum_service.hosting.cache_quota import DEFAULT_MAX_CACHES, DEFAULT_MAX_CACHES_PER_CALLER
    from ferrum_service.hosting.constraint_compile import DEFAULT_MAX_COMPILE_SECONDS
    from ferrum_service.hosting.host import ModelHost, StepLimits
    from ferrum_service.hosting.kv_events import KvEventHub
    from ferrum_service.hosting.kv_peers import KvPeers
    from ferrum_service.hosting.model_specs import DEFAULT_MODELS
    from ferrum_service.hosting.progress import DEFAULT_STALL_TIMEOUT_S
    from ferrum_service.server import host_models
    from ferrum_service.wire.kv_transfer import DEFAULT_IMPORT_IDLE_S
    from ferrum_service.wire.migration import DEFAULT_RESUME_S
    from ferrum_service.wire.rpc_guard import RpcGuard
    from ferrum_service.wire.servicer import ModelExecutorServicer

    def param(fn, name):
        return inspect.signature(fn).parameters[name].default

    d = settings.default
    pairs = [
        (DEFAULT_MAX_CACHES, "max_caches"), (DEFAULT_MAX_CACHES_PER_CALLER, "max_caches_per_caller"),
        (DEFAULT_MAX_COMPILE_SECONDS, "max_compile_seconds"), (DEFAULT_STALL_TIMEOUT_S, "stall_timeout"),
        (DEFAULT_IMPORT_IDLE_S, "kv_import_idle_timeout"), (DEFAULT_RESUME_S, "migration_resume_s"),
        (DEFAULT_MODELS, "model"),
        (StepLimits().max_step_bytes, "max_step_bytes"), (StepLimits().max_response_bytes, "max_message_bytes"),
        (StepLimits().max_text_bytes, "max_text_bytes"),
        (param(ModelHost, "max_batch"), "max_batch"), (param(host_models, "max_batch"), "max_batch"),
        (param(KvEventHub, "replay_bytes"), "kv_event_replay_bytes"),
        (param(KvEventHub, "max_subscribers"), "max_kv_event_subscribers"),
        (param(KvEventHub, "max_subscribers_per_caller"), "max_kv_event_subscribers_per_caller"),
        (param(KvPeers, "max_message_bytes"), "max_message_bytes"),
        (param(RpcGuard, "stream_write_timeout"), "stream_write_timeout"),
        (param(ModelExecutorServicer, "role"), "role"),
    ]
    for value, name in pairs:
        assert value == d(name), name


def test_only_the_settings_module_reads_the_environment():
    """Every variable the package reads goes through the table's accessors, so it is listed
    (``ferrum_service.testing``, helpers for tests and benchmarks, is not the server)."""
    listed = {st.env for st in SETTINGS if st.env} | set(STANDARD_ENV)
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "core/settings.py" or rel.startswith("testing/"):
            continue
        text = path.read_text()
        assert not re.search(r"\bos\.environ\b|\bgetenv\(|\benviron\.get\(", text), f"{rel} reads the environment"
        for var in re.findall(r"\b(?:FERRUM|OTEL)_[A-Z0-9_]*[A-Z0-9]\b", text):
            assert var in listed or var.endswith("_*"), f"{rel} names {var}, which the settings table does not list"
    with pytest.raises(KeyError):
        settings.env("FERRUM_NOT_A_SETTING")


# ---- derived: --help and the docs ----------------------------------------------------------------
def test_help_lists_every_setting_with_its_default_and_variable():
    env = {**os.environ, "COLUMNS": "400"}
    out = {cmd: subprocess.run([sys.executable, "-m", "ferrum_service", cmd, "--help"], capture_output=True,
                               text=True, cwd=REPO, env=env, timeout=60) for cmd in ("serve", "generate")}
    for r in out.values():
        assert r.returncode == 0, r.stderr
    for st in SETTINGS:
        text = out["generate" if st.command == "generate" else "serve"].stdout
        if st.flag:  # the option's block: its line and the help lines under it
            blocks = {b.split()[0]: " ".join(b.split()) for b in re.split(r"\n(?=  -)", text) if b.startswith("  -")}
            assert st.flag in blocks, f"{st.flag} missing from --help"
            shown = f"(default: {st.default_text()})"
            assert shown in blocks[st.flag] or st.is_switch or not st.default_text(), f"{st.flag}: {shown} not shown"
        if st.env:
            assert st.env in text, f"{st.env} missing from {st.command} --help"


def test_docs_table_is_generated_from_the_settings():
    doc = REPO / "docs" / "settings.md"
    assert doc.read_text() == settings.markdown(), \
        "docs/settings.md is stale: python -m ferrum_service.core.settings > docs/settings.md"
    text = doc.read_text()
    for st in SETTINGS:
        assert f"| {st.name} |" in text
        for x in (st.flag, st.env, st.yaml):
            assert x is None or f"`{x}" in text, x
    for var in STANDARD_ENV:
        assert f"`{var}`" in text
    assert "settings.md" in (REPO / "docs" / "operating.md").read_text()


# ---- resolving: flag > environment > config > default ----------------------------------------------
def test_precedence_flag_environment_config_default(clean_env, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("port: 7001\ncache-ttl: 5\nkv_peer: a:1, b:2\nmodels:\n  - {executor: stub, id: y}\n")
    st = _resolve("--config", str(cfg))
    assert (st["port"], st["cache_ttl"], st["kv_peer"]) == (7001, 5.0, ["a:1", "b:2"])  # dashed key works too
    assert [s.model_id for s in st["specs"]] == ["y"]
    assert st["max_batch"] == 64 and st["role"] is Role.BOTH  # defaults
    clean_env.setenv("FERRUM_PORT", "7002")
    clean_env.setenv("FERRUM_MODEL", "stub,id=a;stub,id=b")
    clean_env.setenv("FERRUM_CONFIG", str(cfg))
    st = _resolve()
    assert st["port"] == 7002 and st["cache_ttl"] == 5.0 and [s.model_id for s in st["specs"]] == ["a", "b"]
    st = _resolve("--port", "7003", "--model", "stub,id=c")
    assert st["port"] == 7003 and [s.model_id for s in st["specs"]] == ["c"]
    clean_env.setenv("FERRUM_PORT", "")  # empty = unset
    assert _resolve()["port"] == 7001
    clean_env.delenv("FERRUM_CONFIG")
    clean_env.delenv("FERRUM_MODEL")
    st = _resolve()
    assert st["port"] == 50051 and [s.executor for s in st["specs"]] == ["smollm2", "minilm"]


@pytest.mark.parametrize("name", ["reflection", "prefix_cache", "trust_remote_code", "allow_pickle",
                                  "open_admin_rpcs"])
def test_switches_from_flag_variable_and_config(clean_env, tmp_path, name):
    st = settings.setting(name)
    off, on = st.default, not st.default
    assert _resolve()[name] is off
    assert _resolve(st.flag)[name] is on
    for value in ("0", "false", "no", "FALSE"):
        clean_env.setenv(st.env, value)
        assert _resolve()[name] is off, value
    for value in ("1", "true", "yes", "True"):
        clean_env.setenv(st.env, value)
        assert _resolve()[name] is on, value
    for value in ("on", "2", "ture", "enabled"):  # not a boolean: refused, naming the variable
        clean_env.setenv(st.env, value)
        with pytest.raises(SettingError, match=f"{st.env}='{value}'"):
            _resolve()
    clean_env.delenv(st.env)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"{name}: {str(on).lower()}\n")
    assert _resolve("--config", str(cfg))[name] is on
    cfg.write_text(f"{name}: \"no\"\n")  # a string is not a switch: refused, never read as true
    with pytest.raises(SettingError, match=name):
        _resolve("--config", str(cfg))


def test_bad_values_are_refused_naming_where_they_came_from(clean_env, tmp_path):
    clean_env.setenv("FERRUM_MAX_QUEUE", "lots")
    with pytest.raises(SettingError, match="FERRUM_MAX_QUEUE"):
        _resolve()
    clean_env.delenv("FERRUM_MAX_QUEUE")
    clean_env.setenv("FERRUM_ROLE", "decoder")
    with pytest.raises(SettingError, match="FERRUM_ROLE.*both, prefill, decode"):
        _resolve()
    clean_env.delenv("FERRUM_ROLE")
    cfg = tmp_path / "c.yaml"
    for text, where in (("port: [1]\n", "port in"), ("grace_period: true\n", "grace_period in"),
                        ("max_batch: 2.5\n", "max_batch in"), ("kv_peer: 3\n", "kv_peer in"),
                        ("tls_cert: [a.pem]\n", "tls_cert in"), ("log_level: true\n", "log_level in")):
        cfg.write_text(text)
        with pytest.raises(SettingError, match=where):
            _resolve("--config", str(cfg))
    for text in ("- a\n- b\n", "port: [\n"):
        cfg.write_text(text)
        with pytest.raises(SettingError, match=str(cfg)):
            _resolve("--config", str(cfg))
    with pytest.raises(SettingError):
        _resolve("--config", str(tmp_path / "missing.yaml"))
    # the CLI says so and exits 2 before loading any model
    assert main(["serve", "--role", "decoder", "--model", "stub"]) == 2
    assert main(["serve", "--config", str(cfg), "--model", "stub"]) == 2


def test_role_takes_strings_and_enum_members(clean_env):
    assert _resolve("--role", "decode")["role"] is Role.DECODE
    assert Role.parse("prefill") is Role.PREFILL and Role.PREFILL == "prefill"
    with pytest.raises(ValueError, match="role must be both, prefill, decode"):
        Role.parse("decoder")


def test_environment_only_settings_are_read_when_used(clean_env, tmp_path):
    from ferrum_service.core import guided
    from ferrum_service.hosting import weight_cache

    class On:
        def __init__(self, device):
            self.device = device

        def info(self):
            return self

    assert guided.overlapping(On("cuda:0")) and not guided.overlapping(On("cpu"))  # auto
    clean_env.setenv("FERRUM_GUIDED_OVERLAP", "1")
    assert guided.overlapping(On("cpu"))
    clean_env.setenv("FERRUM_GUIDED_OVERLAP", "0")
    assert not guided.overlapping(On("cuda:0"))
    clean_env.setenv("FERRUM_MODEL_CACHE", str(tmp_path / "w"))
    assert weight_cache.cache_dir() == tmp_path / "w"
    clean_env.setenv("FERRUM_TORCH_THREADS", "3")
    assert _resolve()["torch_threads"] == 3


# ---- the enums match the contract ------------------------------------------------------------------
def test_mode_enums_are_the_contracts_values():
    assert {f"SERVER_ROLE_{r.name}" for r in Role} == {v.name for v in pb.ServerRole.DESCRIPTOR.values} - {
        "SERVER_ROLE_UNSPECIFIED"}
    assert {f"EXECUTOR_STATE_{s.name}" for s in ExecutorState} == {
        v.name for v in tpb.ExecutorState.DESCRIPTOR.values} - {"EXECUTOR_STATE_UNSPECIFIED"}
    assert [s for s in ExecutorState if s.is_ready] == [ExecutorState.READY, ExecutorState.BUSY]
    from ferrum_service.hosting.kv_events import KINDS, TERMINAL

    assert {e: pb.KvEventKind.Value(f"KV_EVENT_KIND_{e.name}") for e in CacheEvent} == KINDS
    assert TERMINAL == {CacheEvent.RELEASED, CacheEvent.RECLAIMED, CacheEvent.EVICTED}
    # a member prints as its value (log fields, metric labels, messages) and equals the plain string
    for member in (Role.DECODE, ExecutorState.SHUTDOWN, CacheEvent.RECLAIMED, BlockEvent.STORED):
        assert str(member) == f"{member}" == member.value and member == member.value
        assert {member.value: 1}[member] == 1


# ---- end to end: environment-only settings reach a real server ----------------------------------------
def test_environment_reaches_the_server_process(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("role: prefill\nreflection: true\n")
    env = {"FERRUM_AUTH_TOKEN": "env-secret", "FERRUM_NO_REFLECTION": "1", "FERRUM_CONFIG": str(cfg),
           "FERRUM_MODEL": STUB}
    with ServerProcess(env=env) as srv:
        with Client(srv.target) as anon, pytest.raises(FerrumRpcError) as e:
            anon.info()
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        with Client(srv.target, token="env-secret") as c:
            assert c.info().role == pb.SERVER_ROLE_PREFILL  # from the config file
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        with grpc.insecure_channel(srv.target) as ch:  # reflection off: FERRUM_NO_REFLECTION=1 beats the file
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                               metadata=(("authorization", "Bearer env-secret"),), timeout=10))
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_serve_help_is_grouped_with_the_presets_and_an_example(clean_env):
    from ferrum_service.hosting.model_specs import EXECUTOR_KINDS, PRESETS

    env = {**os.environ, "COLUMNS": "120"}
    text = subprocess.run([sys.executable, "-m", "ferrum_service", "serve", "--help"], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=60).stdout
    headings = [line[:-1] for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert headings[1:1 + len(settings.HELP_GROUPS)] == [t for t, _ in settings.HELP_GROUPS], headings
    for title, first in settings.HELP_GROUPS:  # each group opens with its first setting's flag
        block = text.split(f"\n{title}:\n", 1)[1]
        assert block.lstrip().startswith(settings.setting(first).flag), title
    assert text.index("\nwork and limits:\n") < text.index("  --max-queue ") < text.index("\nKV events")
    for name in PRESETS + EXECUTOR_KINDS:
        assert re.search(rf"^    {re.escape(name)} +\S", text, re.M), f"{name} not listed"
    example = text.split("\nexample:\n", 1)[1].splitlines()[0].split()
    assert example[:2] == ["ferrum-service", "serve"]
    st = resolve_serve_settings(build_parser().parse_args(example[1:]))  # the example parses
    assert [s.executor for s in st["specs"]] == ["smollm2", "llama-cpp"]
