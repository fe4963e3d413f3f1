"""Server wiring: the grpc.aio server, health, reflection, auth, metrics, graceful drain.

``Server`` owns the hosted models and the gRPC server around them, and is the one place that
builds the request path's parts: request checks and step operations (``validate.py``,
``operations.py``), stream bookkeeping (``streams.py``), the KV event hub (``kv_events.py``),
cache leases (``leases.py``) and the servicer that serves them. ``serve()`` (used by the CLI)
runs it until SIGINT/SIGTERM, then drains: health turns NOT_SERVING for every service first, new
work is refused with UNAVAILABLE, in-flight streams get ``grace_period`` seconds, executors free
their caches, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import ipaddress
import signal
from dataclasses import dataclass, field

import grpc
import structlog
from ferrum_client._proto.ferrum.executor.v1 import executor_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2

from .core.callers import CallerActivity
from .core.modes import Role
from .core.serving_state import ServingState
from .core.settings import default
from .hosting.batcher import ContinuousBatcher
from .hosting.cache_quota import CacheQuota
from .hosting.constraint_compile import CompilePool
from .hosting.host import HostSettings, ModelHost
from .hosting.kv_events import KvEventHub
from .hosting.kv_peers import KvPeers
from .hosting.models import ModelSet
from .hosting.profiler import StepProfiler
from .hosting.progress import StallWatch
from .wire import tracing
from .wire.auth import AuthInterceptor, is_admin_call
from .wire.kv_export_pacing import ExportPacing
from .wire.kv_transfer import KvTransfer
from .wire.leases import LeaseReaper
from .wire.limits import add_guarded
from .wire.metrics import Metrics
from .wire.migration import Migrations
from .wire.operations import Operations
from .wire.reflection import enable_reflection
from .wire.rpc_guard import RpcGuard
from .wire.servicer import ModelExecutorServicer, ServerHooks
from .wire.serving_log import ServingLog
from .wire.streams import StreamRegistry
from .wire.validate import RequestChecks
from .wire.vllm_engine import SERVICE_NAME as VLLM_SERVICE_NAME
from .wire.vllm_engine import VllmEngineServicer, VllmParts
from .wire.vllm_limits import VLLM_LIMITS

log = structlog.get_logger("ferrum_service.server")

SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["ModelExecutor"].full_name
#: The health service a liveness probe asks: SERVING while the server runs (a stalled model turns
#: only "" NOT_SERVING, for readiness: a long legal step must not get the pod restarted).
LIVENESS_SERVICE = "liveness"


@dataclass
class ServerConfig:
    """Network and policy settings of one server: the CLI's ``serve`` settings, whose defaults
    (and meaning) are in ``core/settings.py``, plus what the CLI reads from files."""

    host: str = default("host")
    port: int = default("port")
    metrics_port: int = default("metrics_port")
    max_message_bytes: int = default("max_message_bytes")
    grace_period: float = default("grace_period")
    reflection: bool = default("reflection")
    tls_cert: str | None = default("tls_cert")
    tls_key: str | None = default("tls_key")
    tls_client_ca: str | None = default("tls_client_ca")
    auth_tokens: list[str] = field(default_factory=list)  # read from --auth-token-file / FERRUM_AUTH_TOKEN
    admin_tokens: list[str] = field(default_factory=list)  # read from --admin-token-file / FERRUM_ADMIN_TOKEN
    max_batch: int = default("max_batch")
    cache_ttl: float = default("cache_ttl")
    origin_idle_ttl: float = default("origin_idle_ttl")  # capped at cache_ttl; see leases.py
    max_queue: int = default("max_queue")
    speculation_draft_tokens: int = default("speculation_draft_tokens")  # speculation.py
    prefill_chunk_tokens: int = default("prefill_chunk_tokens")  # batcher.py
    prefill_tail_factor: float = default("prefill_tail_factor")  # batcher.py
    open_admin_rpcs: bool = default("open_admin_rpcs")
    vllm_shared_prefix_cache: bool = default("vllm_shared_prefix_cache")  # vllm_engine.py: request_salt
    pairing_protocol: str = default("pairing_protocol")  # vllm_engine.py: GetServerInfo
    max_step_bytes: int = default("max_step_bytes")
    max_text_bytes: int = default("max_text_bytes")
    role: Role = default("role")  # a plain string is taken too (Server checks it)
    kv_peers: list[str] = field(default_factory=list)  # --kv-peer: servers ImportKv may pull from (kv_peers.py)
    kv_peer_tokens: list[str] = field(default_factory=list)  # --kv-peer-token-file: first sent, all accepted
    kv_peer_ca: str | None = default("kv_peer_ca")
    kv_peer_cert: str | None = default("kv_peer_cert")
    kv_peer_key: str | None = default("kv_peer_key")
    kv_import_idle_timeout: float = default("kv_import_idle_timeout")
    kv_import_timeout: float = default("kv_import_timeout")
    stream_write_timeout: float = default("stream_write_timeout")  # write_deadline.py
    otlp_endpoint: str | None = default("otlp_endpoint")  # see tracing.py
    kv_event_replay_bytes: int = default("kv_event_replay_bytes")  # kv_events.py
    kv_events_zmq_endpoint: str = default("kv_events_zmq_endpoint")  # zmq_kv_events.py
    kv_events_zmq_replay_endpoint: str = default("kv_events_zmq_replay_endpoint")
    kv_events_zmq_topic: str = default("kv_events_zmq_topic")
    max_kv_event_subscribers: int = default("max_kv_event_subscribers")
    max_kv_event_subscribers_per_caller: int = default("max_kv_event_subscribers_per_caller")
    drain_to: str = default("drain_to")  # live migration (migration.py)
    advertise_address: str = default("advertise_address")
    migration_resume_s: float = default("migration_resume_s")
    migration_precopy_tokens: int = default("migration_precopy_tokens")  # migration.py
    # bounded work (docs/operating.md, "Multi-tenant deployment: bounded work")
    max_caches: int = default("max_caches")
    max_caches_per_caller: int = default("max_caches_per_caller")
    max_compile_seconds: float = default("max_compile_seconds")
    stall_timeout: float = default("stall_timeout")
    stats_log_interval: float = default("stats_log_interval")  # serving_log.py
    request_log: bool = default("request_log")
    profile_dir: str | None = default("profile_dir")  # vllm_profile.py: StartProfile / StopProfile
    profile_keep: int = default("profile_keep")
    profile_keep_bytes: int = default("profile_keep_bytes")

    @property
    def per_caller(self) -> bool:
        """Callers are told apart (bearer tokens or mutual TLS): caches, events and adapter
        details are per caller (callers.py)."""
        return bool(self.auth_tokens or self.tls_client_ca)


def grpc_options(cfg: ServerConfig) -> list[tuple[str, int]]:
    """Message limits and a keepalive policy that accepts the pings grpc-go, tonic and grpc-js
    clients send by default (no strikes for pings without data) and never closes an idle call."""
    return [
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.so_reuseport", 0),
    ]


class Server:
    """The hosted models behind a grpc.aio server."""

    def __init__(self, models: ModelSet, cfg: ServerConfig) -> None:
        self.models = models
        self.cfg = cfg
        if cfg.cache_ttl < 0:
            raise ValueError("cache_ttl must be >= 0 (0 = never reclaim)")
        if cfg.origin_idle_ttl < 0:
            raise ValueError("origin_idle_ttl must be >= 0 (0 = off)")
        if cfg.max_queue < 0:
            raise ValueError("max_queue must be >= 0 (0 = unbounded)")
        if cfg.speculation_draft_tokens < 0:
            raise ValueError("speculation_draft_tokens must be >= 0 (0 = off)")
        if cfg.prefill_chunk_tokens < 1 or not (cfg.prefill_tail_factor == 0 or cfg.prefill_tail_factor > 1):
            raise ValueError("prefill_chunk_tokens must be >= 1, prefill_tail_factor 0 (fixed chunks) or > 1")
        if min(cfg.max_caches, cfg.max_caches_per_caller, cfg.max_compile_seconds, cfg.stall_timeout) < 0:
            raise ValueError("max_caches, max_caches_per_caller, max_compile_seconds and stall_timeout must be >= 0")
        if cfg.profile_keep < 1 or cfg.profile_keep_bytes < 0:
            raise ValueError("profile_keep must be >= 1, profile_keep_bytes >= 0")
        if cfg.stream_write_timeout < 0:
            raise ValueError("stream_write_timeout must be >= 0 (0 = no limit)")
        for host in models:
            host.configure(host_settings(cfg))
        self.metrics = Metrics(models)
        self.activity = CallerActivity()
        self.leases = LeaseReaper(models, self.metrics, cfg.cache_ttl, origin_idle_ttl=cfg.origin_idle_ttl,
                                  activity=self.activity)
        self.serving = ServingState()  # the drain flags every RPC's guard reads
        self.health = health.aio.HealthServicer()
        self.streams = StreamRegistry(models, self.activity, serving=self.metrics.serving)
        self.serving_log = ServingLog(models, self.streams, self.metrics.serving, interval=cfg.stats_log_interval,
                                      request_log=cfg.request_log)
        self.metrics.model_server_protocol(models, self.streams)
        # Under per-caller auth each subscriber sees only its own caches' events, and block events
        # carry keys only (enough to route), not token ids (kv_events.py).
        self.events = KvEventHub(per_caller=cfg.per_caller, replay_bytes=cfg.kv_event_replay_bytes,
                                 max_subscribers=cfg.max_kv_event_subscribers,
                                 max_subscribers_per_caller=cfg.max_kv_event_subscribers_per_caller)
        for host in models:
            host.executor.registry.subscribe(
                lambda kind, e, hub=self.events: hub.publish(kind, e.model_id, e.cache_id, e.num_tokens, e.tenant))
            prefix = host.executor.prefix
            if prefix is not None:
                prefix.subscribe(lambda kind, data, hub=self.events, m=host.model_id: hub.publish_block(kind, m, data))
        self.zmq_events = None  # block events for llm-d on ZeroMQ (zmq_kv_events.py)
        if cfg.kv_events_zmq_endpoint:
            if cfg.per_caller:
                raise ValueError("kv_events_zmq_endpoint cannot be used with bearer tokens or mutual TLS: ZeroMQ has "
                                 "no authentication here, and block events name every caller's prompt blocks")
            from .wire.zmq_kv_events import ZmqKvEventPublisher
            self.zmq_events = ZmqKvEventPublisher(self.events, cfg.kv_events_zmq_endpoint,
                                                  cfg.kv_events_zmq_replay_endpoint, cfg.kv_events_zmq_topic)
        self.role = role = Role.parse(cfg.role)
        if cfg.kv_import_idle_timeout < 0:
            raise ValueError("kv_import_idle_timeout must be >= 0 (0 = no limit)")
        if cfg.kv_import_timeout < 0:
            raise ValueError("kv_import_timeout must be >= 0 (0 = no limit)")
        self.kv_peers = KvPeers(cfg.kv_peers, cfg.kv_peer_tokens, ca=cfg.kv_peer_ca, cert=cfg.kv_peer_cert,
                                key=cfg.kv_peer_key, max_message_bytes=cfg.max_message_bytes)
        checks = RequestChecks(models, role, compiler=CompilePool(max_seconds=cfg.max_compile_seconds),
                               quota=CacheQuota(cfg.max_caches_per_caller),
                               on_adopt=lambda e, hub=self.events: hub.adopt(e.model_id, e.cache_id, e.tenant))
        self.stalls = StallWatch(models, cfg.stall_timeout, self._set_progress_health)
        interceptors = []
        if cfg.auth_tokens or cfg.admin_tokens:
            interceptors.append(AuthInterceptor(cfg.auth_tokens, cfg.admin_tokens, peer_tokens=cfg.kv_peer_tokens))
        self.grpc = grpc.aio.server(options=grpc_options(cfg), interceptors=interceptors)
        self.port = self._bind()
        if cfg.advertise_address:
            advertise = cfg.advertise_address
        elif cfg.host not in ("0.0.0.0", "::", "[::]", ""):
            advertise = f"{cfg.host}:{self.port}"
        else:
            advertise = ""
        ops = Operations(models, checks)
        # the pre-copies' exports are paced against their streams' steps: Migrations marks them, KvTransfer paces
        pacing = ExportPacing()
        self.kv = KvTransfer(models, checks, max_message_bytes=cfg.max_message_bytes, metrics=self.metrics,
                             peers=self.kv_peers, import_idle_s=cfg.kv_import_idle_timeout,
                             import_total_s=cfg.kv_import_timeout, pacing=pacing)
        self.migrations = Migrations(models, checks, self.kv, self.kv_peers, self.streams, advertise,
                                     resume_s=cfg.migration_resume_s, precopy_tokens=cfg.migration_precopy_tokens,
                                     serving=self.serving, pacing=pacing)
        guard = RpcGuard(self.metrics, activity=self.activity, tokens_checked=bool(cfg.auth_tokens),
                         admin_open=bool(cfg.admin_tokens) or cfg.open_admin_rpcs,
                         serving=self.serving,
                         stream_write_timeout=cfg.stream_write_timeout)
        hooks = ServerHooks(is_admin=lambda metadata: is_admin_call(metadata, cfg.admin_tokens, cfg.open_admin_rpcs),
                            on_model_shutdown=self._model_down, start_drain=self._start_drain_by_migration)
        self.servicer = ModelExecutorServicer(models, ops, self.streams, self.events, self.metrics, self.kv,
                                              self.migrations, guard, role=role, hooks=hooks)
        # Every request is checked against the declared size limits before its handler runs (limits.py).
        add_guarded(self.grpc, self.servicer, executor_pb2.DESCRIPTOR.services_by_name["ModelExecutor"],
                    on_refusal=guard.refused)
        # vLLM's engine protocol on the same port, for gateways that drive vLLM workers (vllm_engine.py)
        parts = VllmParts(models, ops, self.streams, self.events, self.metrics, guard, self.kv, role, advertise,
                          migrations=self.migrations)
        self.vllm = VllmEngineServicer(parts, shared_prefix_cache=cfg.vllm_shared_prefix_cache,
                                       pairing_protocol=cfg.pairing_protocol,
                                       profiler=StepProfiler(cfg.profile_dir, cfg.profile_keep,
                                                             cfg.profile_keep_bytes))
        add_guarded(self.grpc, self.vllm, vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"], VLLM_LIMITS,
                    rpc_prefix="VllmEngine.", on_refusal=guard.refused)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        if cfg.reflection:
            enable_reflection(self.grpc, (SERVICE_NAME, VLLM_SERVICE_NAME,
                                          health_pb2.DESCRIPTOR.services_by_name["Health"].full_name))

    def _bind(self) -> int:
        addr = f"{self.cfg.host}:{self.cfg.port}"
        if self.cfg.tls_cert:
            with open(self.cfg.tls_cert, "rb") as f:
                cert = f.read()
            with open(self.cfg.tls_key or "", "rb") as f:
                key = f.read()
            ca = None
            if self.cfg.tls_client_ca:
                with open(self.cfg.tls_client_ca, "rb") as f:
                    ca = f.read()
            creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                                require_client_auth=ca is not None)
            port = self.grpc.add_secure_port(addr, creds)
        else:
            port = self.grpc.add_insecure_port(addr)
        if port == 0:
            raise OSError(f"could not bind {addr}")
        return port

    async def _set_progress_health(self, model_id: str, serving: bool) -> None:
        """The stall watch's verdict (``progress.py``): the model's health, and the server's overall
        "" (the probes' service) NOT_SERVING while any model is stalled."""
        if self.serving.shutting_down:
            return
        st = health_pb2.HealthCheckResponse
        await self.health.set(model_id, st.SERVING if serving else st.NOT_SERVING)
        await self.health.set("", st.NOT_SERVING if self.stalls.stalled else st.SERVING)

    def _model_down(self, model_id: str) -> None:
        asyncio.ensure_future(self.health.set(model_id, health_pb2.HealthCheckResponse.NOT_SERVING))

    async def start(self) -> None:
        # The tokenizer bundle before the port opens: SMG asks for it at once (tokenizer_cache.py).
        await self.vllm.prepare_tokenizer()
        await self.grpc.start()
        self.leases.start()
        self.stalls.start()
        self.serving_log.start()
        if self.zmq_events is not None:
            self.zmq_events.start()
        if tracing.configure(self.cfg.otlp_endpoint):
            log.info("tracing on", otlp_endpoint=self.cfg.otlp_endpoint or "(from OTEL_* environment)")
        if not (self.cfg.auth_tokens or self.cfg.tls_client_ca) and not _is_loopback(self.cfg.host):
            log.warning("serving without authentication on a non-loopback address: any caller that reaches "
                        "this port can use and release every cache; set --auth-token-file or mutual TLS",
                        host=self.cfg.host, port=self.port)
        if self.cfg.kv_peers and self.cfg.kv_peer_tokens and not self.kv_peers.tls:
            log.warning("the KV peer token goes to peers in plaintext unless a pull asks for TLS; set --kv-peer-ca",
                        kv_peers=sorted(self.kv_peers.targets))
        if self.cfg.metrics_port:
            self.metrics.serve(self.cfg.metrics_port, self.cfg.host)
        for host in self.models:
            await self.health.set(host.model_id, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(VLLM_SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving", port=self.port, models=[h.model_id for h in self.models], tls=bool(self.cfg.tls_cert),
                 auth=bool(self.cfg.auth_tokens), mtls=bool(self.cfg.tls_client_ca),
                 metrics_port=self.cfg.metrics_port or None, cache_ttl_s=self.cfg.cache_ttl or None,
                 origin_idle_ttl_s=self.leases.origin_idle_ttl or None, max_queue=self.cfg.max_queue or None,
                 role=self.role.value, kv_peers=sorted(self.kv_peers.targets) or None)

    async def _start_drain_by_migration(self) -> None:
        """No new work from now on (migration.py): health NOT_SERVING, ``ModelLoad.draining``."""
        if self.migrations.start_draining():
            await self.health.enter_graceful_shutdown()
            log.info("draining by migration", active_streams=len(self.streams.generations))

    async def drain(self, grace: float | None = None) -> None:
        """Graceful shutdown (see the module doc). With ``drain_to``, the running Generate streams
        move to that peer first (the ones it refuses get the grace period, as without it)."""
        grace = self.cfg.grace_period if grace is None else grace
        if self.cfg.drain_to and self.streams.generations:
            await self._start_drain_by_migration()
            try:
                out = await self.migrations.migrate(self.cfg.drain_to, wait_s=max(grace, 1.0))
                log.info("drain: streams moved", target=self.cfg.drain_to, migrated=sum(r.migrated for r in out),
                         refused=[(r.request_id, r.error_code) for r in out if not r.migrated])
            except Exception:  # noqa: BLE001 - a failed move leaves the streams to the ordinary drain
                log.exception("drain: moving the streams failed", target=self.cfg.drain_to)
        self.serving.shutting_down = True
        await self.health.enter_graceful_shutdown()  # every service -> NOT_SERVING
        log.info("draining", grace_period_s=grace, active_streams=len(self.streams.active))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.streams.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.streams.active:
            log.warning("grace period over; cancelling streams", active_streams=len(self.streams.active))
        await self.leases.stop()
        await self.stalls.stop()
        await self.serving_log.stop()
        self.servicer.ops.checks.compiler.close()
        self.migrations.close()
        await self.kv.close()
        await self.vllm.close()
        if self.zmq_events is not None:
            await self.zmq_events.close()
        # grpc.stop cancels the calls still running; their handlers' finally blocks free their caches.
        await self.grpc.stop(max(0.0, deadline - loop.time()))
        freed = 0
        for host in self.models:
            await host.drain_releases()
            try:
                freed += host.executor.shutdown()
            except Exception:  # noqa: BLE001
                log.exception("executor shutdown failed", model_id=host.model_id)
            host.shutdown_pool()
        self.metrics.stop()
        if self.cfg.otlp_endpoint or tracing.on:
            tracing.shutdown()
        log.info("stopped", released_caches=freed)

    async def wait(self) -> None:
        await self.grpc.wait_for_termination()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def host_settings(cfg: ServerConfig) -> HostSettings:
    """The settings each hosted model runs under."""
    return HostSettings(max_queue=cfg.max_queue, speculation_default=cfg.speculation_draft_tokens,
                        max_caches=cfg.max_caches, max_step_bytes=cfg.max_step_bytes,
                        max_response_bytes=cfg.max_message_bytes, max_text_bytes=cfg.max_text_bytes,
                        prefill_chunk_tokens=cfg.prefill_chunk_tokens, prefill_tail_factor=cfg.prefill_tail_factor)


def host_models(executors, max_batch: int = default("max_batch"), max_queue: int = 0, workers=None) -> ModelSet:
    """A ModelSet from executor instances (ids from their ``info()``), each with its step queue
    for Generate streams (``batcher.py``); ``workers[i]``: the worker executor ``i`` was loaded on
    (see ``host.new_worker``), else a new one."""
    models = ModelSet()
    for i, ex in enumerate(executors):
        host = ModelHost(ex.info().model_id, ex, max_batch=max_batch, max_queue=max_queue,
                         worker=workers[i] if workers else None)
        ContinuousBatcher(host)  # the Generate streams' step queue (it attaches itself to its host)
        models.add(host)
    return models


async def serve(executors, cfg: ServerConfig, workers=None) -> None:
    """Run until SIGINT/SIGTERM, then drain and return."""
    server = Server(host_models(executors, cfg.max_batch, cfg.max_queue, workers), cfg)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("signal received; shutting down")
    await server.drain()
