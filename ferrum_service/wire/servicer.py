"""The ``ferrum.executor.v1.ModelExecutor`` gRPC servicer.

Steps go through an :class:`Operations` method, ``Generate`` through ``generate``, streams and
Abort through the :class:`StreamRegistry`, KV handoff through ``kv_transfer``. Not thin: some RPCs
do their work here — the metadata RPCs read the executor directly, ``Loads`` sums the registries
and KV capacity per model, ``ListCaches`` filters caches by caller, the tokenizer RPCs run the
tokenizer on a thread, Warmup, Shutdown and the LoRA admin RPCs check admin rights, and ``SubscribeKvEvents`` and
``Session`` run their stream loops here.
Every RPC runs under the server's one guard (``rpc_guard.py``: draining, errors as statuses,
metrics, tracing). A Session step's error travels in band as a ``StepError``.
The server (``server.py``) builds the parts and hands them in.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc
import structlog
from ferrum_client._proto.ferrum.executor.v1 import executor_pb2_grpc
from grpc_status import rpc_status

from .. import __version__
from ..core import errors
from ..core.callers import current_caller, current_origin
from ..core.modes import CacheEvent, ExecutorState, Role
from ..core.request_limits import limit_of
from ..hosting.kv_events import KvEventHub, SubscriberDropped
from ..hosting.models import ModelSet
from . import tracing
from .convert import (
    adapter_pb,
    as_ferrum_error,
    block_event_pb,
    capabilities_pb,
    check_tokens,
    dict_to_struct,
    handle_pb,
    kv_capacity_pb,
    model_info_pb,
    pb,
    status_of,
    status_pb,
    step_error_pb,
    tpb,
)
from .generate import generate
from .kv_transfer import KvTransfer
from .metrics import Metrics
from .migration import Migrations
from .operations import Operations
from .rpc_guard import RpcGuard, request_ids
from .streams import StreamRegistry

log = structlog.get_logger("ferrum_service.wire.servicer")

_ROLES = {Role.BOTH: pb.SERVER_ROLE_BOTH, Role.PREFILL: pb.SERVER_ROLE_PREFILL, Role.DECODE: pb.SERVER_ROLE_DECODE}

#: Most token ids one Detokenize call may carry (declared in the contract).
MAX_DETOKENIZE_IDS = limit_of(pb.DetokenizeRequest, "token_ids")


@dataclasses.dataclass(frozen=True)
class ServerHooks:
    """What the servicer asks of the server around it (``server.py`` passes them in)."""

    is_admin: Callable[[Any], bool] = lambda metadata: False  # may this call use the admin RPCs
    on_model_shutdown: Callable[[str], None] = lambda model_id: None  # a model was shut down (health)
    start_drain: "Callable[[], Awaitable[None]] | None" = None  # stop taking new work (MigrateStreams drain)


class ModelExecutorServicer(executor_pb2_grpc.ModelExecutorServicer):
    """Serves every hosted model through the contract."""

    def __init__(self, models: ModelSet, ops: Operations, streams: StreamRegistry, events: KvEventHub,
                 metrics: Metrics, kv: KvTransfer, migrations: Migrations, guard: RpcGuard, *,
                 role: Role = Role.BOTH, hooks: "ServerHooks | None" = None) -> None:
        """``guard``: what every RPC runs under (draining, errors as statuses, metrics; shared with
        the vLLM protocol's service); ``hooks``: what the server around it does for it."""
        self.models = models
        self.hooks = hooks if hooks is not None else ServerHooks()
        self.guard = guard
        self.ops = ops
        self.streams = streams
        self.events = events
        self.metrics = metrics
        self.role = Role.parse(role)
        self.kv = kv
        self.migrations = migrations

    # ---- metadata RPCs --------------------------------------------------------------------------
    async def Info(self, request, context):
        async def run():
            hosts = self.models.select(request.model_id)
            return pb.InfoResponse(models=[model_info_pb(h.executor.info()) for h in hosts],
                                   server_version=__version__, contract_version="ferrum.executor.v1",
                                   role=_ROLES[self.role])
        return await self.guard.unary("Info", context, run)

    async def Capabilities(self, request, context):
        async def run():
            h = self.models.get(request.model_id)
            return pb.CapabilitiesResponse(model_id=h.model_id, capabilities=capabilities_pb(h.capabilities))
        return await self.guard.unary("Capabilities", context, run)

    async def Status(self, request, context):
        async def run():
            h = self.models.get(request.model_id)
            st = h.executor.status()
            s = h.executor.stats.snapshot()
            metrics = tpb.ExecutorMetrics(
                total_operations=s["prefill_ops"] + s["decode_ops"], prefill_operations=s["prefill_ops"],
                decode_operations=s["decode_ops"], avg_prefill_latency_ms=s["avg_prefill_ms"],
                avg_decode_latency_ms=s["avg_decode_ms"], p95_prefill_latency_ms=s["p95_prefill_ms"],
                p95_decode_latency_ms=s["p95_decode_ms"], throughput_tps=s["throughput_tps"],
            )
            return pb.StatusResponse(model_id=h.model_id, status=status_pb(st), metrics=metrics)
        return await self.guard.unary("Status", context, run)

    async def KvCapacity(self, request, context):
        async def run():
            h = self.models.get(request.model_id)
            return pb.KvCapacityResponse(model_id=h.model_id, capacity=kv_capacity_pb(h.executor.kv_capacity()))
        return await self.guard.unary("KvCapacity", context, run)

    async def AdmissionLimits(self, request, context):
        async def run():
            h = self.models.get(request.model_id)
            lim = h.executor.admission_limits()
            resp = pb.AdmissionLimitsResponse(model_id=h.model_id)
            if lim is not None:
                resp.limits.CopyFrom(tpb.ExecutorAdmissionLimits(
                    maximum_active_sequences=lim.maximum_active_sequences,
                    maximum_scheduled_tokens=lim.maximum_scheduled_tokens))
            return resp
        return await self.guard.unary("AdmissionLimits", context, run)

    async def ReserveKvSlots(self, request, context):
        return await self.guard.unary("ReserveKvSlots", context, lambda: self.ops.reserve_kv_slots(request))

    async def KvSlotCapacity(self, request, context):
        async def run():
            h = self.models.get(request.model_id)
            snap = h.executor.kv_slot_capacity()
            resp = pb.KvSlotCapacityResponse()
            if snap is not None:
                resp.snapshot.CopyFrom(tpb.KvSlotCapacitySnapshot(
                    block_size=snap.block_size, total_blocks=snap.total_blocks, free_blocks=snap.free_blocks))
            return resp
        return await self.guard.unary("KvSlotCapacity", context, run)

    async def CacheMetrics(self, request, context):
        async def run():
            h = self.models.get(request.model_id)
            m = h.executor.cache_metrics()
            resp = pb.CacheMetricsResponse()
            if m is not None:
                resp.metrics.CopyFrom(dict_to_struct(m))
            return resp
        return await self.guard.unary("CacheMetrics", context, run)

    async def LoraMetrics(self, request, context):
        async def run():
            h = self.models.get(request.model_id)
            m = h.executor.lora_metrics()
            resp = pb.LoraMetricsResponse()
            if m is not None:
                resp.metrics.CopyFrom(dict_to_struct(m))
            return resp
        return await self.guard.unary("LoraMetrics", context, run)

    async def Warmup(self, request, context):
        async def run():
            self.guard.check_admin("Warmup")
            t0 = time.perf_counter_ns()
            hosts = self.models.select(request.model_id)
            for h in hosts:
                await h.call(h.executor.warmup)
            return pb.WarmupResponse(model_ids=[h.model_id for h in hosts], duration_ns=time.perf_counter_ns() - t0)
        return await self.guard.unary("Warmup", context, run)

    async def Shutdown(self, request, context):
        async def run():
            self.guard.check_admin("Shutdown")
            hosts = self.models.select(request.model_id)
            freed = 0
            for h in hosts:
                if h.executor.state != ExecutorState.SHUTDOWN:
                    freed += (await h.call(h.executor.shutdown)).value
                    self.on_model_shutdown(h.model_id)
            return pb.ShutdownResponse(model_ids=[h.model_id for h in hosts], released_caches=freed)
        return await self.guard.unary("Shutdown", context, run)

    # ---- LoRA adapters ----------------------------------------------------------------------------
    async def LoadAdapter(self, request, context):
        async def run():
            self.guard.check_admin("LoadAdapter")
            h = self.models.get(request.model_id)
            if not request.path:
                raise errors.invalid("path is empty: name a PEFT adapter directory", field="path")
            t = await h.call(h.executor.load_adapter, request.name, request.path)
            adapter, loaded = t.value
            return pb.LoadAdapterResponse(adapter=adapter_pb(h, adapter, h.executor.adapter_bindings()),
                                          loaded=loaded, load_ns=t.forward_ns)
        return await self.guard.unary("LoadAdapter", context, run)

    async def UnloadAdapter(self, request, context):
        async def run():
            self.guard.check_admin("UnloadAdapter")
            h = self.models.get(request.model_id)
            unloaded, dropped = (await h.call(h.executor.unload_adapter, request.name)).value
            return pb.UnloadAdapterResponse(unloaded=unloaded, dropped_blocks=dropped)
        return await self.guard.unary("UnloadAdapter", context, run)

    def is_admin(self, metadata) -> bool:
        """Whether a call (its metadata) may use the admin RPCs (the server's ``auth.is_admin_call``)."""
        return self.hooks.is_admin(metadata)

    async def ListAdapters(self, request, context):
        """Open to every caller; an adapter's server path only to admin callers, and its live
        caches counted among the caller's own (under per-caller auth, also no step counts)."""
        async def run():
            admin = self.is_admin(context.invocation_metadata())
            caller = current_caller.get()
            out = []
            for h in self.models.select(request.model_id):
                if h.executor.adapters is not None:
                    if admin:
                        bound = h.executor.adapter_bindings()
                    else:
                        bound = {}
                        for e in h.executor.registry.entries():
                            if e.adapter and e.tenant == caller:
                                bound[e.adapter] = bound.get(e.adapter, 0) + 1
                    for a in list(h.executor.adapters.adapters.values()):
                        info = adapter_pb(h, a, bound)
                        if not admin:
                            info.path = ""
                            if self.events.per_caller:
                                info.steps = 0
                        out.append(info)
            return pb.ListAdaptersResponse(adapters=out)
        return await self.guard.unary("ListAdapters", context, run)

    def on_model_shutdown(self, model_id: str) -> None:
        """The server flips the model's health to NOT_SERVING."""
        self.hooks.on_model_shutdown(model_id)

    # ---- tokenization ---------------------------------------------------------------------------
    def _tokenizer(self, model_id: str):
        h = self.models.get(model_id)
        tok = h.executor.tokenizer
        if tok is None:
            raise errors.FerrumError(errors.ErrorKind.TOKENIZER, f"model {h.model_id!r} has no tokenizer",
                                     code=grpc.StatusCode.FAILED_PRECONDITION, field="model_id")
        return h, tok

    # Tokenizer work runs on a thread, not on the event loop (a long text would stall every call).
    async def Tokenize(self, request, context):
        async def run():
            h, tok = self._tokenizer(request.model_id)
            self.ops.checks.check_text(h, [request.text], "text")
            ids = await asyncio.to_thread(tok.encode, request.text, add_special_tokens=request.add_special_tokens)
            return pb.TokenizeResponse(token_ids=ids)
        return await self.guard.unary("Tokenize", context, run)

    async def Detokenize(self, request, context):
        async def run():
            h, tok = self._tokenizer(request.model_id)
            ids = check_tokens(request.token_ids, h.vocab_size, "token_ids", allow_empty=True,
                               max_len=MAX_DETOKENIZE_IDS)
            text = await asyncio.to_thread(tok.decode, ids, skip_special_tokens=request.skip_special_tokens)
            return pb.DetokenizeResponse(text=text)
        return await self.guard.unary("Detokenize", context, run)

    async def ApplyChatTemplate(self, request, context):
        async def run():
            h, tok = self._tokenizer(request.model_id)
            if not request.messages:
                raise errors.invalid("messages is empty", field="messages")
            msgs = [{"role": m.role, "content": m.content} for m in request.messages]
            self.ops.checks.check_text(h, [m["content"] for m in msgs] + [m["role"] for m in msgs], "messages")

            def render():
                text = h.executor.apply_chat_template(msgs, request.add_generation_prompt)
                return text, tok.encode(text, add_special_tokens=False)

            text, ids = await asyncio.to_thread(render)
            return pb.ApplyChatTemplateResponse(text=text, token_ids=ids)
        return await self.guard.unary("ApplyChatTemplate", context, run)

    # ---- steps ----------------------------------------------------------------------------------
    async def Prefill(self, request, context):
        return await self.guard.unary("Prefill", context, lambda: self.ops.run_step("prefill", request), request)

    async def BatchPrefill(self, request, context):
        return await self.guard.unary("BatchPrefill", context, lambda: self.ops.run_step("batch_prefill", request), request)

    async def Decode(self, request, context):
        return await self.guard.unary("Decode", context, lambda: self.ops.run_step("decode", request), request)

    async def BatchDecode(self, request, context):
        return await self.guard.unary("BatchDecode", context, lambda: self.ops.run_step("batch_decode", request), request)

    async def UnifiedDecode(self, request, context):
        return await self.guard.unary("UnifiedDecode", context, lambda: self.ops.run_step("unified_decode", request), request)

    async def ForwardVerify(self, request, context):
        return await self.guard.unary("ForwardVerify", context, lambda: self.ops.run_step("forward_verify", request), request)

    async def TruncateKv(self, request, context):
        return await self.guard.unary("TruncateKv", context, lambda: self.ops.run_step("truncate_kv", request), request)

    async def ReleaseCache(self, request, context):
        return await self.guard.unary("ReleaseCache", context, lambda: self.ops.run_step("release_cache", request), request)

    async def ForkCache(self, request, context):
        return await self.guard.unary("ForkCache", context, lambda: self.ops.run_step("fork_cache", request), request)

    async def Forward(self, request, context):
        return await self.guard.unary("Forward", context, lambda: self.ops.forward(request), request)

    # ---- streams --------------------------------------------------------------------------------
    async def Generate(self, request, context) -> None:
        await self.guard.stream("Generate", context, request, self._generate_stream(request, context))

    async def _generate_stream(self, request, context) -> AsyncIterator[pb.GenerateResponse]:
        """The stream's events, under the guard (``RpcGuard.stream`` entered the caller)."""
        # A KV peer relaying a stream it moved here resumes it on the caller's behalf (migration.py).
        relay = self.kv.peers.on_behalf(context.invocation_metadata())
        if relay is not None:
            current_caller.set(relay)
        tokens = 0
        with self.streams.generation("generate") as state:
            try:
                if relay is not None and not request.resume_token:
                    raise errors.permission_denied(
                        "a KV peer token opens Generate only to resume a stream it moved here in relay "
                        "mode (resume_token)")
                if request.resume_token:  # a resumed stream is no new prompt
                    self.ops.checks.check_decode_role("Generate")
                else:
                    self.ops.checks.check_role_generate(request)
                async for ev in generate(self.models, self.ops.checks, request, state, self.migrations,
                                         relay=relay is not None):
                    if ev.WhichOneof("event") == "token":
                        tokens += 1
                    yield ev
            except (asyncio.CancelledError, GeneratorExit):  # cancelled, or the stream closed on us (as Session)
                self.metrics.cancelled_streams.inc()
                log.info("stream cancelled", rpc="Generate", owner=state.owner, tokens=tokens)
                raise
            finally:
                self.metrics.tokens_generated.inc(tokens)

    _SESSION_OPS = {
        "prefill": ("prefill", "Prefill"),
        "batch_prefill": ("batch_prefill", "BatchPrefill"),
        "decode": ("decode", "Decode"),
        "batch_decode": ("batch_decode", "BatchDecode"),
        "unified_decode": ("unified_decode", "UnifiedDecode"),
        "forward_verify": ("forward_verify", "ForwardVerify"),
        "truncate_kv": ("truncate_kv", "TruncateKv"),
        "release_cache": ("release_cache", "ReleaseCache"),
        "fork_cache": ("fork_cache", "ForkCache"),
    }

    async def Session(self, request_iterator, context) -> None:
        await self.guard.send("Session", self._session_stream(request_iterator, context), context)

    async def _session_stream(self, request_iterator, context) -> AsyncIterator[pb.SessionResponse]:
        owner = self.streams.new_owner("session")
        t0 = time.perf_counter()
        code = "OK"
        steps = 0
        self.guard.enter(context)
        span = tracing.start_rpc("Session", context.invocation_metadata()) if tracing.on else None
        log.info("session opened", owner=owner, peer=context.peer())
        with self.streams.running():
            try:
                async for req in request_iterator:
                    steps += 1
                    yield await self._session_step(req, owner)
            except (asyncio.CancelledError, GeneratorExit):  # cancelled, or the stream closed on us
                code = "CANCELLED"
                self.metrics.cancelled_streams.inc()
                raise
            finally:
                if code == "OK" and context.cancelled():  # the call ended (cancel, deadline) while its
                    code = "CANCELLED"                     # request stream merely looked finished
                    self.metrics.cancelled_streams.inc()
                freed = self.streams.release_owned(owner, reason=CacheEvent.RECLAIMED)
                self.metrics.observe("Session", code, time.perf_counter() - t0)
                tracing.end(span, code)
                log.info("session closed", owner=owner, steps=steps, released_caches=freed, code=code)

    async def _session_step(self, req: pb.SessionRequest, owner: str) -> pb.SessionResponse:
        """One step of a Session: its result, or its error in band (the session goes on)."""
        which = req.WhichOneof("step")
        rpc = self._SESSION_OPS.get(which, (None, "Unknown"))[1]
        resp = pb.SessionResponse(step_id=req.step_id)
        ts = time.perf_counter()
        code = "OK"
        stream_span = tracing.current()
        span = tracing.start_child(f"Session.{rpc}", **request_ids(getattr(req, which))) if which and stream_span else None
        self.guard.activity.seen(current_origin.get())
        try:
            self.guard.check_serving()
            if which is None:
                raise errors.invalid("step is not set", field="step")
            result = await self.ops.run_step(self._SESSION_OPS[which][0], getattr(req, which), owner)
            getattr(resp, which).CopyFrom(result)
        except Exception as exc:  # noqa: BLE001 - CancelledError is not an Exception: it ends the stream
            e = as_ferrum_error(exc, f"Session.{which}")
            code = e.code.name
            if isinstance(exc, errors.FerrumError):
                self.guard.log_refusal(f"Session.{which}", e)
            resp.error.CopyFrom(step_error_pb(e))
        self.metrics.observe(f"Session.{rpc}", code, time.perf_counter() - ts)
        if span is not None:
            tracing.end(span, code, restore=stream_span)
        return resp

    # ---- scheduler-facing operations -----------------------------------------------------------
    async def Loads(self, request, context):
        async def run():
            hosts = self.models.select(request.model_id)
            seq = self.events.seq
            resp = pb.LoadsResponse(kv_event_seq=seq)
            for h in hosts:
                reg = h.executor.registry
                entries = reg.entries()
                used = sum(e.num_tokens for e in entries)
                held = sum(e.footprint for e in entries) + reg.staged_tokens  # staged imports hold KV too
                cap = h.executor.kv_capacity()
                if cap.total_blocks:  # a paged pool: blocks as the pool holds them (shared ones once)
                    bs, total_blocks = cap.block_size, cap.total_blocks
                    free_blocks = cap.free_blocks + cap.evictable_blocks
                    free = free_blocks * bs
                else:
                    bs = reg.block_size or 1
                    free = max(0, reg.total_tokens - held)
                    free_blocks, total_blocks = free // bs, reg.total_tokens // bs
                pm = (h.executor.cache_metrics() or {}).get("prefix_cache", {})
                lat = h.executor.stats.latencies()
                running = min(h.running, 1)
                resp.loads.add(
                    model_id=h.model_id, active_caches=len(entries), resident_tokens=used, free_tokens=free,
                    free_blocks=free_blocks, total_blocks=total_blocks, block_size=bs,
                    running_steps=running, queued_steps=max(0, h.running - running),
                    active_streams=len(self.streams.active), reserved_tokens=held - used,
                    prefill_latency=pb.LatencySummary(**lat["prefill"]),
                    decode_latency=pb.LatencySummary(**lat["decode"]),
                    evictable_blocks=cap.evictable_blocks, cached_blocks=cap.cached_blocks,
                    prefix_hit_tokens=pm.get("hit_tokens", 0), prefix_queried_tokens=pm.get("queried_tokens", 0),
                    draining=self.guard.paused(),
                )
            return resp
        return await self.guard.unary("Loads", context, run)

    async def ListCaches(self, request, context):
        async def run():
            hosts = self.models.select(request.model_id)
            # Read on the loop thread with the hub's seq first: events are absolute, so any that
            # land between the two reads and are replayed on top of the snapshot are harmless.
            seq = self.events.seq
            resp = pb.ListCachesResponse(as_of_seq=seq)
            for h in hosts:
                caller = current_caller.get()
                for e in h.executor.registry.entries():
                    if e.tenant == caller:
                        resp.caches.append(handle_pb(h.executor.handle(e)))
            return resp
        return await self.guard.unary("ListCaches", context, run)

    async def SubscribeKvEvents(self, request, context) -> None:
        await self.guard.send("SubscribeKvEvents", self._kv_events_stream(request, context), context)

    async def _kv_events_stream(self, request, context):
        """Cache (and block) events; under per-caller auth only the caller's own (kv_events.py)."""
        origin = self.guard.enter(context)
        caller = current_caller.get()
        from_seq = request.from_seq if request.HasField("from_seq") else None
        try:
            self.guard.check_serving()
            if request.model_id:
                self.models.get(request.model_id)
            # the per-caller cap counts identities; without them, client hosts
            key = caller if caller else origin.partition("@")[2]
            sub, gone, next_seq = self.events.subscribe(request.model_id, from_seq, request.include_block_events,
                                                        caller=caller, key=key)
        except errors.FerrumError as e:
            self.guard.log_refusal("SubscribeKvEvents", e)
            await context.abort_with_status(rpc_status.to_status(status_of(e)))
        with self.streams.running():
            try:
                if gone is not None:
                    yield pb.SubscribeKvEventsResponse(resync_required=pb.ResyncRequired(
                        requested_seq=from_seq, oldest_available_seq=gone, next_seq=next_seq))
                while True:
                    if self.guard.serving.shutting_down:
                        return
                    ev = await sub.next()
                    if ev.block_kind:
                        yield pb.SubscribeKvEventsResponse(block_event=block_event_pb(ev))
                        continue
                    yield pb.SubscribeKvEventsResponse(event=pb.KvEvent(
                        seq=ev.seq, kind=ev.kind, model_id=ev.model_id, cache_id=ev.cache_id,
                        num_tokens=ev.num_tokens, time_unix_ns=ev.time_unix_ns))
            except SubscriberDropped as d:
                log.warning("kv-event subscriber dropped", resume_from_seq=d.resume_from_seq, peer=context.peer())
                e = errors.exhausted(str(d), retry_after_ms=0, resume_from_seq=d.resume_from_seq)
                await context.abort_with_status(rpc_status.to_status(status_of(e)))
            finally:
                sub.close()

    # ---- KV handoff ---------------------------------------------------------------------------------
    async def ExportKv(self, request, context) -> None:
        await self.guard.send("ExportKv", self._export_kv_stream(request, context), context)

    async def _export_kv_stream(self, request, context):
        self.guard.enter(context)  # the origin is active while it runs
        with self.streams.running():
            async with self.guard.answer("ExportKv", context, request):
                async for msg in self.kv.export(request, context.invocation_metadata()):
                    yield msg

    async def ImportKv(self, request_iterator, context):
        self.guard.enter(context)  # the origin is active while it runs
        with self.streams.running():
            async with self.guard.answer("ImportKv", context):
                return await self.kv.import_(request_iterator, context.invocation_metadata())

    # ---- live migration (migration.py) ----------------------------------------------------------------
    async def MigrateStreams(self, request, context):
        async def run():
            self.guard.check_admin("MigrateStreams")
            if not request.target:
                raise errors.invalid("target is empty: name a KV peer (HOST:PORT)", field="target")
            target = await self.kv.peers.check(request.target)
            if request.drain:
                await self.start_drain_by_migration()
            out = await self.migrations.migrate(target, model_id=request.model_id, request_id=request.request_id)
            return pb.MigrateStreamsResponse(streams=out, migrated=sum(r.migrated for r in out),
                                             refused=sum(not r.migrated for r in out))
        return await self.guard.unary("MigrateStreams", context, run)

    async def AcceptMigration(self, request, context):
        async def run():
            return await self.migrations.accept(request, context.invocation_metadata())
        return await self.guard.unary("AcceptMigration", context, run)

    async def start_drain_by_migration(self) -> None:
        """No new work from now on: the server's hook (health NOT_SERVING too), else only the mark."""
        if self.hooks.start_drain is not None:
            await self.hooks.start_drain()
        else:
            self.migrations.start_draining()

    async def Abort(self, request, context):
        async def run():
            host = self.models.get(request.model_id) if request.model_id or len(self.models) == 1 else None
            which = request.WhichOneof("target")
            if which is None:
                raise errors.invalid("target is not set: give request_id or cache_id", field="target")
            aborted, released = await self.streams.abort(host, **{which: getattr(request, which)})
            log.info("abort", target=which, value=getattr(request, which), aborted_streams=aborted,
                     released_cache=released)
            return pb.AbortResponse(aborted_streams=aborted, released_cache=released)
        return await self.guard.unary("Abort", context, run)
