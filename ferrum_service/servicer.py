"""The ``ferrum.executor.v1.ModelExecutor`` gRPC servicer.

Thin by design: each RPC resolves its model, calls an :class:`Operations` method (steps) or the
executor (metadata), and converts. Errors leave as gRPC statuses with ``google.rpc`` details
(ErrorInfo always; BadRequest naming the field; RetryInfo for RESOURCE_EXHAUSTED / UNAVAILABLE);
an unexpected exception is logged with its traceback and answered INTERNAL.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc
import structlog
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from ferrum_client._proto.ferrum.executor.v1 import executor_pb2_grpc

from . import __version__, errors
from .convert import (
    capabilities_pb,
    handle_pb,
    check_tokens,
    dict_to_struct,
    kv_capacity_pb,
    model_info_pb,
    pb,
    status_pb,
    tpb,
)
from .generate import StreamState, generate
from .kv_events import KvEventHub, SubscriberDropped
from .metrics import Metrics
from .models import ModelSet
from .operations import Operations

log = structlog.get_logger("ferrum_service.servicer")
_session_ids = itertools.count(1)


def to_status(e: errors.FerrumError) -> status_pb2.Status:
    """A FerrumError as a ``google.rpc.Status`` with ErrorInfo / BadRequest / RetryInfo details."""
    st = status_pb2.Status(code=e.code.value[0], message=e.message)
    info = error_details_pb2.ErrorInfo(reason=e.kind.name, domain=errors.ERROR_DOMAIN, metadata=e.metadata)
    if e.field:
        info.metadata["field"] = e.field
    d = any_pb2.Any()
    d.Pack(info)
    st.details.append(d)
    if e.field and e.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                              grpc.StatusCode.FAILED_PRECONDITION):
        br = error_details_pb2.BadRequest()
        br.field_violations.add(field=e.field, description=e.message)
        d = any_pb2.Any()
        d.Pack(br)
        st.details.append(d)
    if e.retry_after_ms:
        ri = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(
            seconds=e.retry_after_ms // 1000, nanos=(e.retry_after_ms % 1000) * 1_000_000))
        d = any_pb2.Any()
        d.Pack(ri)
        st.details.append(d)
    return st


def to_step_error(e: errors.FerrumError) -> tpb.StepError:
    return tpb.StepError(code=e.code.value[0], message=e.message, kind=e.kind.value, field=e.field,
                         metadata=e.metadata, retry_after_ms=e.retry_after_ms)


def internal(exc: BaseException, rpc: str) -> errors.FerrumError:
    log.exception("unexpected error", rpc=rpc, error=repr(exc))
    return errors.FerrumError(errors.ErrorKind.INTERNAL, f"{rpc}: internal error: {type(exc).__name__}: {exc}")


class ModelExecutorServicer(executor_pb2_grpc.ModelExecutorServicer):
    """Serves every hosted model through the contract."""

    def __init__(self, models: ModelSet, metrics: Metrics | None = None, *, draining: Callable[[], bool] = lambda: False):
        self.models = models
        self.ops = Operations(models)
        self.metrics = metrics or Metrics(None)
        self.draining = draining
        self.active_streams: set[asyncio.Task] = set()
        self.generations: dict[str, StreamState] = {}
        self.events = KvEventHub()
        for host in models:
            host.executor.registry.on_event = (
                lambda kind, e, hub=self.events: hub.publish(kind, e.model_id, e.cache_id, e.num_tokens))

    # ---- plumbing -------------------------------------------------------------------------------
    async def _unary(self, rpc: str, context: grpc.aio.ServicerContext, fn: Callable[[], Awaitable[Any]]):
        t0 = time.perf_counter()
        code = "OK"
        try:
            if self.draining():
                raise errors.unavailable("the server is shutting down; retry on another replica")
            return await fn()
        except errors.FerrumError as e:
            code = e.code.name
            self._log_refusal(rpc, e)
            await context.abort_with_status(rpc_status.to_status(to_status(e)))
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, grpc.aio.AbortError):
                raise
            code = "INTERNAL"
            await context.abort_with_status(rpc_status.to_status(to_status(internal(exc, rpc))))
        finally:
            self.metrics.observe(rpc, code, time.perf_counter() - t0)

    def _log_refusal(self, rpc: str, e: errors.FerrumError) -> None:
        lvl = log.warning if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED else log.info
        lvl("request refused", rpc=rpc, code=e.code.name, kind=e.kind.name, field=e.field, message=e.message,
            **{k: v for k, v in e.metadata.items() if k in ("cache_id", "model_id")})
        if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self.metrics.admission_refusals.inc()

    # ---- metadata RPCs --------------------------------------------------------------------------
    async def Info(self, request, context):
        async def run():
            hosts = self.models.select(request.model_id)
            return pb.InfoResponse(models=[model_info_pb(h.executor.info()) for h in hosts],
                                   server_version=__version__, contract_version="ferrum.executor.v1")
        return await self._unary("Info", context, run)

    async def Capabilities(self, request, context):
        async def run():
            h = self.models.get(request.model_id)
            return pb.CapabilitiesResponse(model_id=h.model_id, capabilities=capabilities_pb(h.executor.capabilities()))
        return await self._unary("Capabilities", context, run)

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
        return await self._unary("Status", context, run)

    async def KvCapacity(self, request, context):
        async def run():
            h = self.models.get(request.model_id)
            return pb.KvCapacityResponse(model_id=h.model_id, capacity=kv_capacity_pb(h.executor.kv_capacity()))
        return await self._unary("KvCapacity", context, run)

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
        return await self._unary("AdmissionLimits", context, run)

    async def ReserveKvSlots(self, request, context):
        async def run():
            from .types import KvSlotRequest

            h = self.models.get(request.model_id)
            reqs = []
            for i, r in enumerate(request.requests):
                self.ops._entry(h, r.cache_id, f"requests[{i}].cache_id")
                reqs.append(KvSlotRequest(r.cache_id, int(r.target_len),
                                          int(r.admission_target_len) if r.HasField("admission_target_len") else None))
            res = (await h.call(h.executor.reserve_kv_slots, reqs)).value
            resp = pb.ReserveKvSlotsResponse()
            if res is not None:
                resp.reservation.CopyFrom(tpb.KvSlotReservation(
                    block_size=res.block_size, total_blocks=res.total_blocks,
                    free_blocks_before=res.free_blocks_before, free_blocks_after=res.free_blocks_after,
                    allocations=[tpb.KvSlotAllocation(cache_id=a.cache_id, blocks_before=a.blocks_before,
                                                      blocks_after=a.blocks_after, new_blocks=a.new_blocks)
                                 for a in res.allocations]))
            return resp
        return await self._unary("ReserveKvSlots", context, run)

    async def KvSlotCapacity(self, request, context):
        async def run():
            h = self.models.get(request.model_id)
            snap = h.executor.kv_slot_capacity()
            resp = pb.KvSlotCapacityResponse()
            if snap is not None:
                resp.snapshot.CopyFrom(tpb.KvSlotCapacitySnapshot(
                    block_size=snap.block_size, total_blocks=snap.total_blocks, free_blocks=snap.free_blocks))
            return resp
        return await self._unary("KvSlotCapacity", context, run)

    async def CacheMetrics(self, request, context):
        async def run():
            h = self.models.get(request.model_id)
            m = h.executor.cache_metrics()
            resp = pb.CacheMetricsResponse()
            if m is not None:
                resp.metrics.CopyFrom(dict_to_struct(m))
            return resp
        return await self._unary("CacheMetrics", context, run)

    async def LoraMetrics(self, request, context):
        async def run():
            h = self.models.get(request.model_id)
            m = h.executor.lora_metrics()
            resp = pb.LoraMetricsResponse()
            if m is not None:
                resp.metrics.CopyFrom(dict_to_struct(m))
            return resp
        return await self._unary("LoraMetrics", context, run)

    async def Warmup(self, request, context):
        async def run():
            t0 = time.perf_counter_ns()
            hosts = self.models.select(request.model_id)
            for h in hosts:
                await h.call(h.executor.warmup)
            return pb.WarmupResponse(model_ids=[h.model_id for h in hosts], duration_ns=time.perf_counter_ns() - t0)
        return await self._unary("Warmup", context, run)

    async def Shutdown(self, request, context):
        async def run():
            hosts = self.models.select(request.model_id)
            freed = 0
            for h in hosts:
                if h.executor.state != "shutdown":
                    freed += (await h.call(h.executor.shutdown)).value
                    self.on_model_shutdown(h.model_id)
            return pb.ShutdownResponse(model_ids=[h.model_id for h in hosts], released_caches=freed)
        return await self._unary("Shutdown", context, run)

    def on_model_shutdown(self, model_id: str) -> None:
        """Hook: the server flips the model's health to NOT_SERVING."""

    # ---- tokenization ---------------------------------------------------------------------------
    def _tokenizer(self, model_id: str):
        h = self.models.get(model_id)
        tok = h.executor.tokenizer
        if tok is None:
            raise errors.FerrumError(errors.ErrorKind.TOKENIZER, f"model {h.model_id!r} has no tokenizer",
                                     code=grpc.StatusCode.FAILED_PRECONDITION, field="model_id")
        return h, tok

    async def Tokenize(self, request, context):
        async def run():
            _, tok = self._tokenizer(request.model_id)
            return pb.TokenizeResponse(token_ids=tok.encode(request.text, add_special_tokens=request.add_special_tokens))
        return await self._unary("Tokenize", context, run)

    async def Detokenize(self, request, context):
        async def run():
            h, tok = self._tokenizer(request.model_id)
            ids = check_tokens(request.token_ids, h.vocab_size, "token_ids", allow_empty=True)
            return pb.DetokenizeResponse(text=tok.decode(ids, skip_special_tokens=request.skip_special_tokens))
        return await self._unary("Detokenize", context, run)

    async def ApplyChatTemplate(self, request, context):
        async def run():
            h, tok = self._tokenizer(request.model_id)
            if not request.messages:
                raise errors.invalid("messages is empty", field="messages")
            msgs = [{"role": m.role, "content": m.content} for m in request.messages]
            text = h.executor.apply_chat_template(msgs, request.add_generation_prompt)
            return pb.ApplyChatTemplateResponse(text=text, token_ids=tok.encode(text, add_special_tokens=False))
        return await self._unary("ApplyChatTemplate", context, run)

    # ---- steps ----------------------------------------------------------------------------------
    async def Prefill(self, request, context):
        return await self._unary("Prefill", context, lambda: self.ops.run_step("prefill", request))

    async def BatchPrefill(self, request, context):
        return await self._unary("BatchPrefill", context, lambda: self.ops.run_step("batch_prefill", request))

    async def Decode(self, request, context):
        return await self._unary("Decode", context, lambda: self.ops.run_step("decode", request))

    async def BatchDecode(self, request, context):
        return await self._unary("BatchDecode", context, lambda: self.ops.run_step("batch_decode", request))

    async def UnifiedDecode(self, request, context):
        return await self._unary("UnifiedDecode", context, lambda: self.ops.run_step("unified_decode", request))

    async def ForwardVerify(self, request, context):
        return await self._unary("ForwardVerify", context, lambda: self.ops.run_step("forward_verify", request))

    async def TruncateKv(self, request, context):
        return await self._unary("TruncateKv", context, lambda: self.ops.run_step("truncate_kv", request))

    async def ReleaseCache(self, request, context):
        return await self._unary("ReleaseCache", context, lambda: self.ops.run_step("release_cache", request))

    async def Forward(self, request, context):
        async def run():
            import numpy as np
            import torch

            from .sampling import encode_row

            h = self.models.get(request.model_id)
            t = request.input
            if t.dtype not in (tpb.DATA_TYPE_INT32, tpb.DATA_TYPE_INT64) or len(t.shape) != 2:
                raise errors.invalid("input must be an INT32 or INT64 tensor of shape [batch, seq]", field="input")
            np_dtype = np.int32 if t.dtype == tpb.DATA_TYPE_INT32 else np.int64
            n = int(t.shape[0]) * int(t.shape[1])
            if n == 0 or len(t.data) != n * np.dtype(np_dtype).itemsize:
                raise errors.invalid(f"input.data has {len(t.data)} bytes; shape {list(t.shape)} needs "
                                     f"{n * np.dtype(np_dtype).itemsize}", field="input.data")
            ids = np.frombuffer(t.data, dtype=np.dtype(np_dtype).newbyteorder("<")).reshape(list(t.shape))
            check_tokens(ids.reshape(-1).tolist(), h.vocab_size, "input.data")
            dtype = {tpb.DATA_TYPE_FP16: "fp16", tpb.DATA_TYPE_BF16: "bf16"}.get(request.logits_dtype, "fp32")
            timed = await h.call(h.executor.forward, torch.from_numpy(ids.astype(np.int64)), dtype)
            out = timed.value
            resp = pb.ForwardResponse()
            resp.output.dtype = {"fp16": tpb.DATA_TYPE_FP16, "bf16": tpb.DATA_TYPE_BF16}.get(dtype, tpb.DATA_TYPE_FP32)
            resp.output.shape.extend(list(out.shape))
            resp.output.data = encode_row(out.reshape(-1), dtype)
            resp.timings.forward_ns = timed.forward_ns
            return resp
        return await self._unary("Forward", context, run)

    # ---- streams --------------------------------------------------------------------------------
    async def Generate(self, request, context) -> AsyncIterator[pb.GenerateResponse]:
        t0 = time.perf_counter()
        code = "OK"
        owner = f"generate-{next(_session_ids)}"
        task = asyncio.current_task()
        self.active_streams.add(task)
        state = StreamState(owner)
        self.generations[owner] = state
        tokens = 0
        try:
            if self.draining():
                raise errors.unavailable("the server is shutting down; retry on another replica")
            async for ev in generate(self.ops, request, owner, state):
                if ev.WhichOneof("event") == "token":
                    tokens += 1
                yield ev
        except errors.FerrumError as e:
            code = e.code.name
            self._log_refusal("Generate", e)
            await context.abort_with_status(rpc_status.to_status(to_status(e)))
        except asyncio.CancelledError:
            code = "CANCELLED"
            self.metrics.cancelled_streams.inc()
            log.info("stream cancelled", rpc="Generate", owner=owner, tokens=tokens)
            raise
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, grpc.aio.AbortError):
                raise
            code = "INTERNAL"
            await context.abort_with_status(rpc_status.to_status(to_status(internal(exc, "Generate"))))
        finally:
            self.generations.pop(owner, None)
            self.active_streams.discard(task)
            self.metrics.tokens_generated.inc(tokens)
            self.metrics.observe("Generate", code, time.perf_counter() - t0)

    _SESSION_OPS = {
        "prefill": ("prefill", "Prefill"),
        "batch_prefill": ("batch_prefill", "BatchPrefill"),
        "decode": ("decode", "Decode"),
        "batch_decode": ("batch_decode", "BatchDecode"),
        "unified_decode": ("unified_decode", "UnifiedDecode"),
        "forward_verify": ("forward_verify", "ForwardVerify"),
        "truncate_kv": ("truncate_kv", "TruncateKv"),
        "release_cache": ("release_cache", "ReleaseCache"),
    }

    async def Session(self, request_iterator, context) -> AsyncIterator[pb.SessionResponse]:
        owner = f"session-{next(_session_ids)}"
        task = asyncio.current_task()
        self.active_streams.add(task)
        t0 = time.perf_counter()
        code = "OK"
        steps = 0
        log.info("session opened", owner=owner, peer=context.peer())
        try:
            async for req in request_iterator:
                which = req.WhichOneof("step")
                resp = pb.SessionResponse(step_id=req.step_id)
                ts = time.perf_counter()
                step_code = "OK"
                try:
                    if self.draining():
                        raise errors.unavailable("the server is shutting down; retry on another replica")
                    if which is None:
                        raise errors.invalid("step is not set", field="step")
                    method, rpc = self._SESSION_OPS[which]
                    result = await self.ops.run_step(method, getattr(req, which), owner)
                    getattr(resp, which).CopyFrom(result)
                except errors.FerrumError as e:
                    step_code = e.code.name
                    self._log_refusal(f"Session.{which}", e)
                    resp.error.CopyFrom(to_step_error(e))
                except Exception as exc:  # noqa: BLE001
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    step_code = "INTERNAL"
                    resp.error.CopyFrom(to_step_error(internal(exc, f"Session.{which}")))
                self.metrics.observe(f"Session.{self._SESSION_OPS.get(which, (None, 'Unknown'))[1]}", step_code,
                                     time.perf_counter() - ts)
                steps += 1
                yield resp
        except asyncio.CancelledError:
            code = "CANCELLED"
            self.metrics.cancelled_streams.inc()
            raise
        finally:
            freed = self.release_owned(owner, reason="reclaimed")
            self.active_streams.discard(task)
            self.metrics.observe("Session", code, time.perf_counter() - t0)
            log.info("session closed", owner=owner, steps=steps, released_caches=freed, code=code)

    def release_owned(self, owner: str, reason: str = "released") -> int:
        """Free every cache a Session / Generate stream created (it ended)."""
        n = 0
        for host in self.models:
            for entry in host.executor.registry.entries():
                if entry.owner == owner:
                    host.release_soon(entry.cache_id, reason)
                    n += 1
        return n

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
                held = sum(e.footprint for e in entries)
                free = max(0, reg.total_tokens - held)
                bs = reg.block_size or 1
                lat = h.executor.stats.latencies()
                running = min(h.running, 1)
                resp.loads.add(
                    model_id=h.model_id, active_caches=len(entries), resident_tokens=used, free_tokens=free,
                    free_blocks=free // bs, total_blocks=reg.total_tokens // bs, block_size=bs,
                    running_steps=running, queued_steps=max(0, h.running - running),
                    active_streams=len(self.active_streams), reserved_tokens=held - used,
                    prefill_latency=pb.LatencySummary(**lat["prefill"]),
                    decode_latency=pb.LatencySummary(**lat["decode"]),
                )
            return resp
        return await self._unary("Loads", context, run)

    async def ListCaches(self, request, context):
        async def run():
            hosts = self.models.select(request.model_id)
            # Read on the loop thread with the hub's seq first: events are absolute, so any that
            # land between the two reads and are replayed on top of the snapshot are harmless.
            seq = self.events.seq
            resp = pb.ListCachesResponse(as_of_seq=seq)
            for h in hosts:
                for e in h.executor.registry.entries():
                    resp.caches.append(handle_pb(h.executor.handle(e)))
            return resp
        return await self._unary("ListCaches", context, run)

    async def SubscribeKvEvents(self, request, context):
        if request.model_id:
            try:
                self.models.get(request.model_id)
            except errors.FerrumError as e:
                await context.abort_with_status(rpc_status.to_status(to_status(e)))
        from_seq = request.from_seq if request.HasField("from_seq") else None
        sub, gone, next_seq = self.events.subscribe(request.model_id, from_seq)
        task = asyncio.current_task()
        self.active_streams.add(task)
        try:
            if gone is not None:
                yield pb.SubscribeKvEventsResponse(resync_required=pb.ResyncRequired(
                    requested_seq=from_seq, oldest_available_seq=gone, next_seq=next_seq))
            while True:
                if self.draining():
                    return
                ev = await sub.next()
                yield pb.SubscribeKvEventsResponse(event=pb.KvEvent(
                    seq=ev.seq, kind=ev.kind, model_id=ev.model_id, cache_id=ev.cache_id,
                    num_tokens=ev.num_tokens, time_unix_ns=ev.time_unix_ns))
        except SubscriberDropped as d:
            log.warning("kv-event subscriber dropped", resume_from_seq=d.resume_from_seq, peer=context.peer())
            e = errors.exhausted(str(d), retry_after_ms=0, resume_from_seq=d.resume_from_seq)
            await context.abort_with_status(rpc_status.to_status(to_status(e)))
        finally:
            sub.close()
            self.active_streams.discard(task)

    async def Abort(self, request, context):
        async def run():
            host = self.models.get(request.model_id) if request.model_id or len(self.models) == 1 else None
            which = request.WhichOneof("target")
            if which is None:
                raise errors.invalid("target is not set: give request_id or cache_id", field="target")
            aborted = 0
            for st in list(self.generations.values()):
                if host is not None and st.model_id and st.model_id != host.model_id:
                    continue
                if (which == "request_id" and request.request_id and st.request_id == request.request_id) or \
                        (which == "cache_id" and st.cache_id == request.cache_id):
                    if not st.aborted:
                        st.aborted = True
                        aborted += 1
            released = False
            if which == "cache_id":
                hosts = [host] if host is not None else list(self.models)
                for h in hosts:
                    if request.cache_id in h.executor.registry:
                        released = await self._release_when_idle(h, request.cache_id)
            log.info("abort", target=which, value=getattr(request, which), aborted_streams=aborted,
                     released_cache=released)
            return pb.AbortResponse(aborted_streams=aborted, released_cache=released)
        return await self._unary("Abort", context, run)

    async def _release_when_idle(self, host, cache_id: str, timeout: float = 10.0) -> bool:
        """Release a cache once no step holds it (an aborted stream lets go within one step)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while host.is_busy(cache_id) and loop.time() < deadline:
            await asyncio.sleep(0.005)
        if cache_id not in host.executor.registry:
            return False
        with host.hold([cache_id], "cache_id"):
            return (await host.call(host.executor.release_cache, cache_id)).value[0]
