"""Every setting the service reads, written once: name, type, default, flag, environment variable,
YAML key and help.

The ``serve`` and ``generate`` flags (``cli.py``), the YAML config file (``--config``), the
defaults of ``server.ServerConfig`` and of the parts it configures, and the environment variables
read deep in the package (``FERRUM_GUIDED_OVERLAP``, ``FERRUM_MODEL_CACHE``, the standard
``OTEL_*``) all come from :data:`SETTINGS`; no other module of the server reads ``os.environ``
(``tests/test_settings.py`` checks both; ``ferrum_service.testing`` is not the server).
``docs/settings.md`` is generated from it: ``python -m ferrum_service.core.settings > docs/settings.md``.

A setting's value: its flag > its environment variable > its key in the config file > its default
(:func:`resolve`). An empty environment variable counts as unset. A list setting takes a
repeated flag, and from the environment or a YAML string items separated by ``sep``. A switch (a
``bool`` setting: its flag takes no value, e.g. ``--no-reflection``) is switched by its flag or by
its environment variable set to ``1`` / ``true`` / ``yes`` (``0`` / ``false`` / ``no``: not
switched; anything else is refused); in the config file its key takes ``true`` / ``false``.

Typos are refused (SettingError, naming where the value came from): a config-file key no setting
has, a value outside a setting's ``options`` (or not matching its ``pattern``), a switch variable
that is not a boolean.
"""

from __future__ import annotations

import difflib
import enum
import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .modes import CudaGraphs, Role

MIB = 1024 * 1024


class SettingError(ValueError):
    """A setting's value cannot be read; the message names where it came from."""


@dataclass(frozen=True)
class Setting:
    """One setting. ``flag`` / ``env`` / ``yaml``: "" = derived from ``name`` (``--max-batch``,
    ``FERRUM_MAX_BATCH``, ``max_batch``; the config file also takes ``max-batch``), None = none.
    ``command``: the CLI command that takes it (``serve``, ``generate``), or ``server`` for one read
    inside the server from the environment only. ``shown``: the default as the help and docs say it
    when the value alone does not explain it."""

    name: str
    type: type
    default: Any
    help: str
    flag: str | None = ""
    env: str | None = ""
    yaml: str | None = ""
    command: str = "serve"
    sep: str = ","
    metavar: str | None = None
    shown: str = ""
    options: tuple[str, ...] = ()  # the values a str setting takes (compared in lower case)
    pattern: str = ""  # or a regular expression its value must match in full (lower case)

    def __post_init__(self) -> None:
        derived = {"flag": "--" + self.name.replace("_", "-"), "env": "FERRUM_" + self.name.upper(),
                   "yaml": self.name}
        for attr, value in derived.items():
            if getattr(self, attr) == "":
                object.__setattr__(self, attr, value if attr != "yaml" or self.command == "serve" else None)

    @property
    def is_switch(self) -> bool:
        return self.type is bool

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(m.value for m in self.type) if issubclass(self.type, enum.Enum) else self.options

    def default_text(self) -> str:
        """The default as help and docs show it ("" for none)."""
        if self.shown:
            return self.shown
        d = self.default
        if d is None or d == () or d == "":
            return ""
        if isinstance(d, enum.Enum):
            return d.value
        if isinstance(d, tuple):
            return self.sep.join(d)
        return str(d)

    def parse(self, value: Any, source: str) -> Any:
        """``value`` (from a flag, the environment or the config file, named by ``source``) as this
        setting's type; SettingError otherwise."""
        t = self.type
        try:
            if t is list:
                if isinstance(value, str):
                    return [x.strip() for x in value.split(self.sep) if x.strip()]
                if isinstance(value, (list, tuple)):
                    return list(value)
                raise ValueError("expected a list")
            if t is bool:
                if not isinstance(value, bool):
                    raise ValueError("expected true or false")
                return value
            if issubclass(t, enum.Enum):
                return t(str(value))
            if t in (int, float) and isinstance(value, bool):
                raise ValueError("expected a number")
            if t is int and isinstance(value, float) and not value.is_integer():
                raise ValueError("expected an integer")
            if t is str and (isinstance(value, bool) or not isinstance(value, (str, int, float))):
                raise ValueError("expected a string")
            if self.options or self.pattern:
                v = str(value).strip().lower()
                if v in self.options or (self.pattern and re.fullmatch(self.pattern, v)):
                    return v
                raise ValueError("not a choice")
            return t(value)
        except (TypeError, ValueError) as e:
            why = (f"one of {', '.join(self.choices)}" if self.choices else f"a value matching {self.pattern}"
                   if self.pattern else f"a value of type {t.__name__}")
            raise SettingError(f"{source}: expected {why}, not {value!r}") from e

    def parse_switch(self, raw: str, source: str) -> bool:
        """A switch's environment value: whether it switches (1/true/yes) or not (0/false/no)."""
        v = raw.strip().lower()
        if v in ("1", "true", "yes"):
            return True
        if v in ("0", "false", "no"):
            return False
        raise SettingError(f"{source}={raw!r}: a switch takes 1, true or yes (on) / 0, false or no (off)")

    def pick(self, flag_value: Any, environ: Mapping[str, str], config: Mapping[str, Any],
             config_name: str = "the config file") -> Any:
        """This setting's value: flag > environment > config > default (see the module doc)."""
        if flag_value is not None:
            return self.parse(flag_value, self.flag or self.name)
        raw = environ.get(self.env) if self.env else None
        if raw:
            if self.is_switch:
                if self.parse_switch(raw, self.env):
                    return not self.default
            else:
                return self.parse(raw, self.env)
        if self.yaml:
            for key in (self.yaml, self.yaml.replace("_", "-")):
                if config.get(key) is not None:
                    return self.parse(config[key], f"{key} in {config_name}")
        return list(self.default) if self.type is list else self.default


def _s(name: str, type_: type, default: Any, help_: str, **kw: Any) -> Setting:
    return Setting(name, type_, default, help_, **kw)


#: Every setting, in the order ``--help`` and the docs list them.
SETTINGS: tuple[Setting, ...] = (
    # ---- what to serve ---------------------------------------------------------------------------
    _s("config", str, None, "YAML config file: the settings' YAML keys and a `models:` list", yaml=None),
    _s("model", list, ("smollm2", "minilm"), "executor to host, EXECUTOR[,key=value...] (repeatable; FERRUM_MODEL: "
       "specs separated by `;`; config: a list of specs, or of mappings with a spec's keys)", yaml="models", sep=";",
       metavar="SPEC", shown="smollm2 (llama.cpp on CPU-only machines, transformers on CUDA) + minilm"),
    _s("adapter", list, (), "preload a LoRA adapter (a PEFT directory) on a model (MODEL may be left out when one "
       "causal LM is hosted); repeatable", env=None, yaml=None, metavar="[MODEL:]NAME=PATH"),
    _s("device", str, "auto", "auto | cpu | cuda | cuda:N, for models that do not set one",
       pattern=r"auto|cpu|cuda(:[0-9]+)?"),
    _s("dtype", str, "auto", "for models that do not set one (int8: weight-only, bf16 activations; causal LMs; "
       "float32, float16, half and bfloat16 are aliases)",
       options=("auto", "fp32", "fp16", "bf16", "int8", "float32", "float16", "half", "bfloat16")),
    _s("kv_budget_tokens", int, 0, "KV budget per model in tokens (0 = the executor's default)"),
    _s("kv_budget_bytes", int, 0, "KV budget per model in bytes of K and V (0 = the executor's default: 1 GiB on "
       "transformers; on llama.cpp 10% of the available memory, at most n_seq training contexts)"),
    _s("hub_token_file", str, None, "file whose first line is the Hugging Face token for hub model ids "
       "(`--model org/name`) of private or gated repositories (default: huggingface_hub's own, HF_TOKEN or a "
       "stored login)"),
    _s("trust_remote_code", bool, False, "allow models that ship code (off: such models are refused)"),
    _s("allow_pickle", bool, False, "allow pickled weights (*.bin; unpickling can run code) where a model has no "
       "safetensors"),
    _s("prefix_cache", bool, True, "turn automatic prefix caching off (every prompt is computed in full)",
       flag="--no-prefix-cache", env="FERRUM_NO_PREFIX_CACHE"),
    _s("cuda_graphs", CudaGraphs, CudaGraphs.AUTO, "transformers models on CUDA: decode-only steps replayed as CUDA "
       "graphs, one per batch-size bucket (auto); off = every step eager. No effect on CPU"),
    _s("warmup", bool, True, "turn the start-up warm-up off (each model runs one tiny prefill and decode before the "
       "port opens, so the first request does not pay for faulting in fresh weights, buffer allocation or CUDA graph "
       "capture)", flag="--no-warmup", env="FERRUM_NO_WARMUP"),
    _s("torch_threads", int, 0, "threads torch uses on CPU", flag=None, yaml=None, shown="the CPU count"),
    # ---- network ---------------------------------------------------------------------------------
    _s("host", str, "0.0.0.0", "bind address"),
    _s("port", int, 50051, "gRPC port (0 = pick a free one; the chosen port is logged)"),
    _s("metrics_port", int, 9090, "Prometheus /metrics HTTP port (0 = off)"),
    _s("max_message_bytes", int, 64 * MIB, "largest gRPC message accepted or sent"),
    _s("reflection", bool, True, "turn server reflection off", flag="--no-reflection", env="FERRUM_NO_REFLECTION"),
    _s("tls_cert", str, None, "PEM certificate chain (enables TLS)"),
    _s("tls_key", str, None, "PEM private key"),
    _s("tls_client_ca", str, None, "PEM CA bundle: require and verify client certificates (mutual TLS)"),
    _s("auth_token_file", str, None, "file with bearer tokens (one per line) callers must send"),
    _s("auth_token", str, None, "a bearer token callers must send (when --auth-token-file names none)",
       flag=None, yaml=None),
    _s("admin_token_file", str, None, "file with tokens allowed to call Warmup/Shutdown"),
    _s("admin_token", str, None, "a token allowed to call Warmup/Shutdown (when --admin-token-file names none)",
       flag=None, yaml=None),
    _s("vllm_shared_prefix_cache", bool, False, "vLLM-protocol requests of unauthenticated callers (every request "
       "of the SMG gateway, which sends workers no credential and no user identity) share one prefix-cache key "
       "space: one user's cached prompt prefix serves the others, and K/V pushed by any client reach them (off: each "
       "such request has a key space of its own, so nothing cached is shared between requests); authenticated "
       "callers keep their own space either way"),
    _s("pairing_protocol", str, "", "the prefill/decode pairing protocol vLLM-protocol GetServerInfo advertises "
       "(SMG pairs a prefill and a decode worker only when theirs are equal, as SMG_PAIRING_PROTOCOL on vLLM "
       "workers); at most 128 of A-Z a-z 0-9 . _ : / + -", pattern=r"[A-Za-z0-9._:/+-]{0,128}"),
    _s("open_admin_rpcs", bool, False, "let any caller call Warmup/Shutdown when no admin token is configured "
       "(default: PERMISSION_DENIED)"),
    _s("role", Role, Role.BOTH, "what this server is deployed for, advertised in Info (prefill: refuses decode "
       "steps; decode: refuses new prompts, decodes imported caches)"),
    # ---- work and limits -------------------------------------------------------------------------
    _s("max_batch", int, 64, "most Generate streams batched into one decode step"),
    _s("prefill_chunk_tokens", int, 512, "most prompt tokens one batched Generate step computes beside the running "
       "streams' decodes (chunked prefill; a prompt alone goes whole)"),
    _s("prefill_tail_factor", float, 0.0, "adaptive prompt chunks: while Generate streams decode, a step takes the "
       "prompt tokens that keep it within this many decode steps, from the measured costs (at least 16, at most "
       "--prefill-chunk-tokens); 0 = always --prefill-chunk-tokens. Arriving prompts, measured: 2 halved the "
       "running streams' ITL p99/p50 (7.3 to 4.0) and doubled the new ones' TTFT; 1.5 brought it to 1.9 for "
       "2.8x the TTFT (benchmarks/arrival_rows.py)"),
    _s("speculation_draft_tokens", int, 0, "server-side n-gram speculation for Generate requests that set no "
       "`speculation` option: draft tokens per step (0 = off; at most 16)"),
    _s("grace_period", float, 20.0, "seconds in-flight streams get on SIGTERM"),
    _s("cache_ttl", float, 600.0, "seconds an ownerless cache (made by unary RPCs) may sit idle before it is "
       "reclaimed (0 = never)"),
    _s("origin_idle_ttl", float, 60.0, "seconds after which the ownerless caches of an origin (caller@host) that "
       "has made no call for that long are reclaimed, before --cache-ttl (0 = off)"),
    _s("max_queue", int, 256, "steps that may wait for one model's worker before new ones get RESOURCE_EXHAUSTED "
       "(0 = unbounded)"),
    _s("max_step_bytes", int, 2 * 1024 * MIB, "transient memory one forward may need (masks, activations, logits); "
       "a request over it is INVALID_ARGUMENT (0 = no limit)"),
    _s("max_text_bytes", int, MIB, "UTF-8 bytes of text one request may ask to tokenize"),
    _s("max_caches", int, 2048, "live caches per model (forks and empty reservations included); more are "
       "RESOURCE_EXHAUSTED (0 = only the executor's own limit, e.g. llama.cpp's n_seq)"),
    _s("max_caches_per_caller", int, 512, "live caches one caller (token / client certificate; unauthenticated "
       "callers are one) may hold per model; more are RESOURCE_EXHAUSTED (0 = no cap)"),
    _s("max_compile_seconds", float, 10.0, "longest a structured-output constraint may take to compile (also "
       "bounded by the request's deadline); slower ones are INVALID_ARGUMENT (0 = deadline only)"),
    _s("stall_timeout", float, 120.0, "seconds a model may have work queued with no step completing before its "
       "gRPC health (and the server's \"\") turns NOT_SERVING (0 = never)"),
    _s("guided_overlap", str, "auto", "compute structured-output masks during the forward: auto (models on CUDA), "
       "1 (always) or 0 (never)", flag=None, yaml=None, command="server", options=("auto", "1", "0")),
    # ---- KV events, transfer and migration -------------------------------------------------------
    _s("kv_event_replay_bytes", int, 64 * MIB, "bytes (estimated) of KV events kept for SubscribeKvEvents replay, "
       "besides the 65,536-event bound (0 = events only)"),
    _s("max_kv_event_subscribers", int, 128, "open SubscribeKvEvents streams past which new ones get "
       "RESOURCE_EXHAUSTED (0 = no cap)"),
    _s("max_kv_event_subscribers_per_caller", int, 16, "open SubscribeKvEvents streams per caller identity (per "
       "client host without auth) (0 = no cap)"),
    _s("kv_events_zmq_endpoint", str, "", "ZeroMQ endpoint (e.g. tcp://*:5557) to publish prefix-cache block "
       "events on in vLLM's format, for llm-d's precise prefix scorer (off when empty; refused with bearer tokens or "
       "mutual TLS: ZeroMQ has no authentication here)"),
    _s("kv_events_zmq_replay_endpoint", str, "", "ZeroMQ ROUTER endpoint (e.g. tcp://*:5558) answering replay "
       "requests for the last published batches, as vLLM's replay endpoint (off when empty)"),
    _s("kv_events_zmq_topic", str, "", "topic of the ZeroMQ KV events; {model} is replaced by the model id "
       "(default: kv@<host name>@<model>; in a pod kv@$(POD_IP)@{model}, the form llm-d subscribes to)"),
    _s("kv_peer", list, (), "HOST:PORT of a server ImportKv may pull KV from (repeatable; env and config: a "
       "comma-separated list; HOST:LO-HI a port range; HOST:* every port, with a peer token only over TLS); "
       "no peer = every pull is refused"),
    _s("kv_peer_token_file", str, None, "file with KV peer tokens: the first is sent when pulling from a peer, "
       "every one lets a peer call ExportKv on its caller's behalf (and nothing else)"),
    _s("kv_peer_ca", str, None, "PEM CA bundle that peers' certificates must chain to (TLS for pulls)"),
    _s("kv_peer_cert", str, None, "PEM client certificate this server presents to peers (mutual TLS for pulls)"),
    _s("kv_peer_key", str, None, "PEM private key of --kv-peer-cert"),
    _s("kv_import_idle_timeout", float, 30.0, "seconds a staged ImportKv may wait for its next chunk before it is "
       "dropped and its KV given back (0 = no limit)"),
    _s("kv_import_timeout", float, 120.0, "seconds an ImportKv (or a migration's pull) may take in all, from its "
       "first chunk to its last, before it is dropped and its KV given back, however steadily chunks arrive "
       "(0 = no limit)"),
    _s("stream_write_timeout", float, 60.0, "seconds a server stream (Generate, Session, ExportKv, "
       "SubscribeKvEvents, vLLM Generate) may wait for its client to take the next message; past it the stream "
       "is ended (CANCELLED) and its caches and holds are released (0 = no limit)"),
    _s("drain_to", str, "", "HOST:PORT of a KV peer that a drain (SIGTERM) moves every running Generate stream to, "
       "instead of waiting for it (live migration; the peer must count this server as its KV peer)"),
    _s("advertise_address", str, "", "HOST:PORT peers reach this server at (default: --host:--port when --host "
       "is a concrete address); needed to move streams to peers"),
    _s("migration_resume_s", float, 30.0, "seconds a stream moved here waits for its caller's resume before it is "
       "dropped"),
    _s("migration_precopy_tokens", int, 256, "a stream whose cache holds this many tokens has its KV pre-copied to "
       "the target while it decodes on, so that its pause moves only the tail (0 = never)"),
    # ---- observability ---------------------------------------------------------------------------
    _s("log_format", str, "auto", "log line format (auto: console on a terminal, else json)",
       options=("json", "console", "auto")),
    _s("log_level", str, "info", "least severe log level written", options=("debug", "info", "warning", "error")),
    _s("stats_log_interval", float, 10.0, "seconds between the `serving stats` log lines (per model: prompt and "
       "generation tokens/s, running and waiting streams, KV-cache use; idle models are not repeated; 0 = off)"),
    _s("request_log", bool, True, "turn the per-request `request done` log line off (request id, caller, tokens, "
       "time to first token, duration, finish reason)", flag="--no-request-log", env="FERRUM_NO_REQUEST_LOG"),
    _s("otlp_endpoint", str, None, "OTLP/gRPC endpoint for OpenTelemetry traces (off when unset, unless the "
       "standard OTEL_* variables name one)"),
    _s("profile_dir", str, None, "directory the vLLM protocol's StartProfile / StopProfile (admin only) write torch "
       "profiler traces under (Chrome trace JSON; made 0700 and refused unless it is this process's own; a request's "
       "output_dir may only name one subdirectory of it); unset = profiling refused"),
    _s("profile_keep", int, 8, "profiler traces kept under --profile-dir: past it the oldest are deleted (at least 1)"),
    _s("profile_keep_bytes", int, 1024 * MIB, "bytes of profiler traces kept under --profile-dir: past it the oldest "
       "are deleted (the newest is always kept; 0 = --profile-keep alone)"),
    _s("model_cache", str, None, "folder for weight files the server derives (e.g. the F16 copy of a GGUF)",
       flag=None, yaml=None, command="server",
       shown="<venv>/var/ferrum-models where writable, else $XDG_CACHE_HOME/ferrum-service/models"),
    # ---- ferrum-service generate -----------------------------------------------------------------
    _s("target", str, "localhost:50051", "the server, HOST:PORT", command="generate"),
    _s("token", str, None, "bearer token", command="generate"),
)

#: ``serve --help``'s groups, in table order: (title, the setting that opens the group).
HELP_GROUPS: tuple[tuple[str, str], ...] = (
    ("what to serve", "config"), ("network and security", "host"), ("work and limits", "max_batch"),
    ("KV events, transfer and migration", "kv_event_replay_bytes"), ("logs, metrics and traces", "log_format"),
)


def help_group(s: Setting) -> str:
    """The ``--help`` group of a ``serve`` setting (see :data:`HELP_GROUPS`)."""
    starts = {name: title for title, name in HELP_GROUPS}
    title = HELP_GROUPS[0][0]
    for other in SETTINGS:
        title = starts.get(other.name, title)
        if other is s:
            return title
    raise KeyError(s.name)


#: Environment variables the package reads that are not settings: other standards' (OpenTelemetry's
#: are also read by its exporter, which reads more of them) and the build tooling's.
STANDARD_ENV: dict[str, str] = {
    "OTEL_TRACES_EXPORTER": "`otlp` turns tracing on (as --otlp-endpoint does)",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "set: tracing on, to this endpoint",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "set: tracing on, to this endpoint",
    "OTEL_SDK_DISABLED": "`true`: tracing off whatever else says",
    "OTEL_SERVICE_NAME": "the traces' service name (default ferrum-service)",
    "HF_HUB_OFFLINE": "`1`: hub model ids (`--model org/name`) are served only from the local cache (read by "
                      "huggingface_hub)",
    "HF_HUB_CACHE": "where huggingface_hub keeps hub models (default $HF_HOME/hub, ~/.cache/huggingface/hub)",
    "HF_TOKEN": "huggingface_hub's token when --hub-token-file names none",
    "XDG_CACHE_HOME": "where FERRUM_MODEL_CACHE's default lies when the venv is not writable",
    "FERRUM_CACHE_DIR": "where the CPU paged-attention op is built once and kept (`torch-ext/` in it; "
                        "default ~/.cache/ferrum-service)",
    "CXX": "the C++ compiler that builds the CPU paged-attention op (default `c++`; none: the op is off, "
           "one warning)",
    "LLAMA_CPP_LIB_PATH": "where llama-cpp-python loads its shared libraries from (read by llama-cpp-python; "
                          "the CPU-variant loader looks there too)",
}

_BY_NAME = {s.name: s for s in SETTINGS}


def setting(name: str) -> Setting:
    """The setting called ``name``; KeyError for none."""
    return _BY_NAME[name]


def default(name: str) -> Any:
    """The default of setting ``name`` (the one place it is written)."""
    return setting(name).default


def for_command(command: str) -> list[Setting]:
    return [s for s in SETTINGS if s.command == command]


def env(var: str) -> str | None:
    """The environment variable ``var``, which must be listed here (a setting's or a standard one)."""
    if var not in STANDARD_ENV and not any(s.env == var for s in SETTINGS):
        raise KeyError(f"{var} is not listed in ferrum_service.core.settings")
    return os.environ.get(var)


def from_env(name: str) -> Any:
    """Setting ``name`` from its environment variable, else its default (read at call time)."""
    s = setting(name)
    return s.pick(None, os.environ, {})


def load_config(path: str | Path) -> dict[str, Any]:
    """The YAML config file at ``path`` (a mapping); SettingError otherwise."""
    import yaml

    try:
        cfg = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise SettingError(f"{path}: {e}") from e
    if not isinstance(cfg, dict):
        raise SettingError(f"{path}: the config file must be a mapping")
    return cfg


def config_keys() -> set[str]:
    """Every key the config file takes (a setting's YAML key, also with ``-`` for ``_``)."""
    return {k for s in SETTINGS if s.yaml for k in (s.yaml, s.yaml.replace("_", "-"))}


def check_config_keys(config: Mapping[str, Any], config_name: str) -> None:
    """SettingError for a key no setting has (a typo would otherwise be ignored)."""
    known = config_keys()
    for key in config:
        if key not in known:
            near = difflib.get_close_matches(str(key), sorted(known), n=1)
            raise SettingError(f"{config_name}: unknown key {key!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
                               + "; the keys are the settings' YAML keys (docs/settings.md)")


def source_of(name: str, flags: Mapping[str, Any], environ: Mapping[str, str] | None, config_name: str) -> str:
    """Where setting ``name``'s value came from, as an error message names it."""
    s = setting(name)
    environ = os.environ if environ is None else environ
    if flags.get(name) is not None:
        return s.flag or name
    if s.env and environ.get(s.env):
        return s.env
    return f"{s.yaml} in {config_name}" if s.yaml else name


def resolve(command: str, flags: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Every setting of ``command`` by name: flag > environment > config file > default.
    ``flags``: the parsed flags by setting name (None or absent = not given); the config file is
    the ``config`` setting's (``serve``), whose raw mapping is returned under ``config_file``."""
    environ = os.environ if environ is None else environ
    path = setting("config").pick(flags.get("config"), environ, {}) if command == "serve" else None
    config = load_config(path) if path else {}
    check_config_keys(config, str(path))
    out = {s.name: s.pick(flags.get(s.name), environ, config, str(path)) for s in for_command(command)}
    if command == "serve":
        out["config_file"] = config
        for s in for_command("server"):  # read later inside the server: a bad value is refused now
            s.pick(None, environ, {})
    return out


def help_text(s: Setting) -> str:
    """A flag's ``--help`` line: help, default, environment variable (``%`` escaped for argparse)."""
    parts = [s.help]
    if s.choices:
        parts.append(f"({' | '.join(s.choices)})")
    if s.default_text() and not s.is_switch:
        parts.append(f"(default: {s.default_text()})")
    if s.env:
        parts.append(f"[{s.env}{'=1' if s.is_switch else ''}]")
    return " ".join(parts).replace("%", "%%")


def markdown(settings: Iterable[Setting] = SETTINGS) -> str:
    """``docs/settings.md``: every setting and every environment variable the service reads."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    def code(x: str | None) -> str:
        return f"`{x}`" if x else "—"

    lines = ["# Settings", "",
             "Generated from `ferrum_service/core/settings.py` (`python -m ferrum_service.core.settings > "
             "docs/settings.md`); a test checks it is current.", "",
             "A setting's value: its flag > its environment variable > its key in the `--config` YAML file "
             "(the key with `-` for `_` works too) > its default. An empty environment variable counts as unset. "
             "A switch (a flag without a value) is also switched by its environment variable set to `1`, `true` or "
             "`yes` (`0`, `false`, `no`: not switched; anything else is refused), and takes `true` / `false` in the "
             "config file. Typos exit 2 naming the place: an unknown config-file key, a value outside a setting's "
             "choices, an unknown `--model` option. Lists: a repeated flag; in the environment or a YAML "
             "string, items separated by `,` (`FERRUM_MODEL`: `;`).", ""]
    for command, title in (("serve", "`ferrum-service serve`"), ("server", "read inside the server"),
                           ("generate", "`ferrum-service generate`")):
        lines += [f"## {title}", "", "| setting | flag | environment | YAML key | default | what |",
                  "|---|---|---|---|---|---|"]
        for s in settings:
            if s.command == command:
                what = s.help + (f" ({' | '.join(s.choices)})" if s.choices else "")
                flag = s.flag + ("" if s.is_switch or not s.metavar else f" {s.metavar}") if s.flag else None
                lines.append(f"| {s.name} | {code(flag)} | {code(s.env and s.env + ('=1' if s.is_switch else ''))} "
                             f"| {code(s.yaml)} | {cell(s.default_text()) or '—'} | {cell(what)} |")
        lines.append("")
    lines += ["## Standard environment variables", "", "| variable | what |", "|---|---|"]
    lines += [f"| `{k}` | {cell(v)} |" for k, v in STANDARD_ENV.items()]
    return "\n".join(lines) + "\n"


__all__ = ["SETTINGS", "STANDARD_ENV", "Setting", "SettingError", "check_config_keys", "config_keys", "default", "env",
           "for_command", "from_env", "help_group", "help_text", "load_config", "markdown", "resolve", "setting", "source_of"]


if __name__ == "__main__":
    sys.stdout.write(markdown())
