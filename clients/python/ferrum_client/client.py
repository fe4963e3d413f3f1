"""Typed clients for ``ferrum.executor.v1.ModelExecutor``: :class:`Client` (sync) and
:class:`AsyncClient` (asyncio).

Both return the contract's response messages (see ``protos/``); failures raise
:class:`FerrumRpcError` with the gRPC code, ferrum's error kind and the offending field. Every call
takes ``timeout`` (seconds; the call's deadline).

    with Client("localhost:50051") as c:
        out = c.prefill("tiny", [1, 2, 3]).output
        step = c.decode("tiny", out.cache.cache_id, out.output.token_id)
"""

from __future__ import annotations

import queue
import threading
from typing import Any, AsyncIterator, Iterable, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from . import messages as m
from ._proto.ferrum.executor.v1 import executor_pb2 as pb
from ._proto.ferrum.executor.v1 import executor_pb2_grpc as pb_grpc
from ._proto.ferrum.executor.v1 import types_pb2 as tpb
from .errors import FerrumRpcError

DEFAULT_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]

_STEP_FIELDS = {
    pb.PrefillRequest: "prefill",
    pb.BatchPrefillRequest: "batch_prefill",
    pb.DecodeRequest: "decode",
    pb.BatchDecodeRequest: "batch_decode",
    pb.UnifiedDecodeRequest: "unified_decode",
    pb.ForwardVerifyRequest: "forward_verify",
    pb.TruncateKvRequest: "truncate_kv",
    pb.ReleaseCacheRequest: "release_cache",
}


def _credentials(root_certificates: bytes | None, private_key: bytes | None, certificate_chain: bytes | None):
    return grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)


class _Requests:
    """Request construction shared by both clients (one place for argument conventions)."""

    @staticmethod
    def prefill(model_id, token_ids, cache_id="", policy=None, reserve_tokens=0, all_positions=False):
        return pb.PrefillRequest(model_id=model_id, input=m.prefill_input(
            token_ids, cache_id, policy, reserve_tokens, all_positions))

    @staticmethod
    def batch_prefill(model_id, prompts):
        inputs = [p if isinstance(p, pb.PrefillInput) else m.prefill_input(p) for p in prompts]
        return pb.BatchPrefillRequest(model_id=model_id, inputs=inputs)

    @staticmethod
    def decode(model_id, cache_id, token_id, policy=None, position=None):
        return pb.DecodeRequest(model_id=model_id, input=m.decode_input(cache_id, token_id, policy, position))

    @staticmethod
    def batch_decode(model_id, items):
        inputs = [i if isinstance(i, pb.DecodeInput) else m.decode_input(*i) for i in items]
        return pb.BatchDecodeRequest(model_id=model_id, inputs=inputs)

    @staticmethod
    def forward_verify(model_id, cache_id, token_ids, accept_greedy_prefix=False, policy=None):
        return pb.ForwardVerifyRequest(model_id=model_id, cache_id=cache_id, token_ids=list(token_ids),
                                       accept_greedy_prefix=accept_greedy_prefix, logits=policy)


class Client:
    """Synchronous client. ``target`` is ``host:port``; pass ``token`` for bearer auth and
    ``root_certificates`` (+ ``private_key``/``certificate_chain`` for mutual TLS) for TLS."""

    def __init__(self, target: str, *, token: str | None = None, root_certificates: bytes | None = None,
                 private_key: bytes | None = None, certificate_chain: bytes | None = None,
                 options: Sequence[tuple[str, Any]] = (), timeout: float | None = 60.0,
                 server_name: str | None = None) -> None:
        opts = list(DEFAULT_OPTIONS) + list(options)
        if server_name:
            opts.append(("grpc.ssl_target_name_override", server_name))
        if root_certificates is not None:
            self.channel = grpc.secure_channel(target, _credentials(root_certificates, private_key, certificate_chain),
                                               options=opts)
        else:
            self.channel = grpc.insecure_channel(target, options=opts)
        self.stub = pb_grpc.ModelExecutorStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.metadata = [("authorization", f"Bearer {token}")] if token else []
        self.timeout = timeout

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def _call(self, name: str, request, timeout: float | None = None):
        try:
            return getattr(self.stub, name)(request, timeout=timeout or self.timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise FerrumRpcError.from_rpc_error(e) from None

    # ---- health & metadata ----------------------------------------------------------------------
    def health(self, service: str = "", timeout: float = 5.0) -> str:
        """``grpc.health.v1`` status name: SERVING, NOT_SERVING, SERVICE_UNKNOWN."""
        try:
            r = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            raise FerrumRpcError.from_rpc_error(e) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until the channel connects and health says SERVING."""
        import time

        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.health(timeout=2.0) == "SERVING":
                    return
            except FerrumRpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not SERVING after {timeout}s")
            time.sleep(0.1)

    def info(self, model_id: str = "", **kw) -> pb.InfoResponse:
        return self._call("Info", pb.InfoRequest(model_id=model_id), **kw)

    def capabilities(self, model_id: str = "", **kw) -> tpb.ExecutorCapabilities:
        return self._call("Capabilities", pb.CapabilitiesRequest(model_id=model_id), **kw).capabilities

    def status(self, model_id: str = "", **kw) -> pb.StatusResponse:
        return self._call("Status", pb.StatusRequest(model_id=model_id), **kw)

    def kv_capacity(self, model_id: str = "", **kw) -> tpb.KvCapacity:
        return self._call("KvCapacity", pb.KvCapacityRequest(model_id=model_id), **kw).capacity

    def admission_limits(self, model_id: str = "", **kw) -> pb.AdmissionLimitsResponse:
        return self._call("AdmissionLimits", pb.AdmissionLimitsRequest(model_id=model_id), **kw)

    def reserve_kv_slots(self, model_id: str, requests: Iterable[tpb.KvSlotRequest], **kw) -> pb.ReserveKvSlotsResponse:
        return self._call("ReserveKvSlots", pb.ReserveKvSlotsRequest(model_id=model_id, requests=list(requests)), **kw)

    def kv_slot_capacity(self, model_id: str = "", **kw) -> pb.KvSlotCapacityResponse:
        return self._call("KvSlotCapacity", pb.KvSlotCapacityRequest(model_id=model_id), **kw)

    def cache_metrics(self, model_id: str = "", **kw) -> pb.CacheMetricsResponse:
        return self._call("CacheMetrics", pb.CacheMetricsRequest(model_id=model_id), **kw)

    def lora_metrics(self, model_id: str = "", **kw) -> pb.LoraMetricsResponse:
        return self._call("LoraMetrics", pb.LoraMetricsRequest(model_id=model_id), **kw)

    def warmup(self, model_id: str = "", **kw) -> pb.WarmupResponse:
        return self._call("Warmup", pb.WarmupRequest(model_id=model_id), **kw)

    def shutdown(self, model_id: str = "", **kw) -> pb.ShutdownResponse:
        return self._call("Shutdown", pb.ShutdownRequest(model_id=model_id), **kw)

    # ---- tokenization ---------------------------------------------------------------------------
    def tokenize(self, model_id: str, text: str, add_special_tokens: bool = False, **kw) -> list[int]:
        return list(self._call("Tokenize", pb.TokenizeRequest(model_id=model_id, text=text,
                                                               add_special_tokens=add_special_tokens), **kw).token_ids)

    def detokenize(self, model_id: str, token_ids: Sequence[int], skip_special_tokens: bool = False, **kw) -> str:
        return self._call("Detokenize", pb.DetokenizeRequest(model_id=model_id, token_ids=list(token_ids),
                                                             skip_special_tokens=skip_special_tokens), **kw).text

    def apply_chat_template(self, model_id: str, messages: Sequence[tuple[str, str]],
                            add_generation_prompt: bool = True, **kw) -> pb.ApplyChatTemplateResponse:
        req = pb.ApplyChatTemplateRequest(model_id=model_id, add_generation_prompt=add_generation_prompt)
        for role, content in messages:
            req.messages.add(role=role, content=content)
        return self._call("ApplyChatTemplate", req, **kw)

    # ---- steps ----------------------------------------------------------------------------------
    def prefill(self, model_id: str, token_ids: Sequence[int], cache_id: str = "",
                policy: tpb.LogitsPolicy | None = None, reserve_tokens: int = 0, all_positions: bool = False,
                **kw) -> pb.PrefillResponse:
        return self._call("Prefill", _Requests.prefill(model_id, token_ids, cache_id, policy, reserve_tokens,
                                                       all_positions), **kw)

    def batch_prefill(self, model_id: str, prompts: Sequence[Sequence[int] | pb.PrefillInput], **kw) -> pb.BatchPrefillResponse:
        return self._call("BatchPrefill", _Requests.batch_prefill(model_id, prompts), **kw)

    def decode(self, model_id: str, cache_id: str, token_id: int, policy: tpb.LogitsPolicy | None = None,
               position: int | None = None, **kw) -> pb.DecodeResponse:
        return self._call("Decode", _Requests.decode(model_id, cache_id, token_id, policy, position), **kw)

    def batch_decode(self, model_id: str, items: Sequence[tuple[str, int] | pb.DecodeInput], **kw) -> pb.BatchDecodeResponse:
        return self._call("BatchDecode", _Requests.batch_decode(model_id, items), **kw)

    def unified_decode(self, model_id: str, items: Sequence[pb.UnifiedBatchItem], **kw) -> pb.UnifiedDecodeResponse:
        return self._call("UnifiedDecode", pb.UnifiedDecodeRequest(model_id=model_id, items=list(items)), **kw)

    def forward(self, model_id: str, input_ids, logits_dtype: str = "fp32", **kw) -> pb.ForwardResponse:
        dt = {"fp32": tpb.DATA_TYPE_FP32, "fp16": tpb.DATA_TYPE_FP16, "bf16": tpb.DATA_TYPE_BF16}[logits_dtype]
        return self._call("Forward", pb.ForwardRequest(model_id=model_id, input=m.ids_tensor(input_ids),
                                                       logits_dtype=dt), **kw)

    def forward_verify(self, model_id: str, cache_id: str, token_ids: Sequence[int],
                       accept_greedy_prefix: bool = False, policy: tpb.LogitsPolicy | None = None,
                       **kw) -> pb.ForwardVerifyResponse:
        return self._call("ForwardVerify", _Requests.forward_verify(model_id, cache_id, token_ids,
                                                                    accept_greedy_prefix, policy), **kw)

    def truncate_kv(self, model_id: str, cache_id: str, new_len: int, **kw) -> pb.TruncateKvResponse:
        return self._call("TruncateKv", pb.TruncateKvRequest(model_id=model_id, cache_id=cache_id, new_len=new_len), **kw)

    def release_cache(self, model_id: str, cache_id: str, **kw) -> pb.ReleaseCacheResponse:
        return self._call("ReleaseCache", pb.ReleaseCacheRequest(model_id=model_id, cache_id=cache_id), **kw)

    # ---- scheduler-facing operations -----------------------------------------------------------
    def loads(self, model_id: str = "", **kw) -> pb.LoadsResponse:
        return self._call("Loads", pb.LoadsRequest(model_id=model_id), **kw)

    def list_caches(self, model_id: str = "", **kw) -> pb.ListCachesResponse:
        return self._call("ListCaches", pb.ListCachesRequest(model_id=model_id), **kw)

    def subscribe_kv_events(self, model_id: str = "", from_seq: int | None = None,
                            timeout: float | None = None) -> "GenerateStream":
        """Stream of ``SubscribeKvEventsResponse`` (iterate; ``.cancel()`` to stop)."""
        req = pb.SubscribeKvEventsRequest(model_id=model_id)
        if from_seq is not None:
            req.from_seq = from_seq
        return GenerateStream(self.stub.SubscribeKvEvents(req, timeout=timeout, metadata=self.metadata))

    def abort(self, model_id: str = "", *, request_id: str | None = None, cache_id: str | None = None,
              **kw) -> pb.AbortResponse:
        req = pb.AbortRequest(model_id=model_id)
        if request_id is not None:
            req.request_id = request_id
        if cache_id is not None:
            req.cache_id = cache_id
        return self._call("Abort", req, **kw)

    # ---- streams --------------------------------------------------------------------------------
    def generate(self, model_id: str, *, timeout: float | None = None, **kw) -> "GenerateStream":
        """Stream a generation (see :func:`ferrum_client.messages.generate_request` for the
        arguments). Iterate the result for ``GenerateResponse`` events; ``.cancel()`` stops it."""
        call = self.stub.Generate(m.generate_request(model_id, **kw), timeout=timeout, metadata=self.metadata)
        return GenerateStream(call)

    def session(self) -> "Session":
        """Open a ``Session`` stream: steps in, results out in order."""
        return Session(self)


class GenerateStream:
    """Iterator over a server-streaming call's messages (``Generate``, ``SubscribeKvEvents``)."""

    def __init__(self, call) -> None:
        self.call = call

    def __iter__(self) -> Iterator[pb.GenerateResponse]:
        try:
            yield from self.call
        except grpc.RpcError as e:
            raise FerrumRpcError.from_rpc_error(e) from None

    def tokens(self) -> list[int]:
        """Consume the stream; the generated token ids."""
        return [ev.token.token_id for ev in self if ev.WhichOneof("event") == "token"]

    def cancel(self) -> None:
        self.call.cancel()


class Session:
    """A ``Session`` stream used step by step from synchronous code.

    ``step(request)`` sends one step (any of the step request messages) and waits for its result;
    a failed step raises :class:`FerrumRpcError` and the session goes on. ``close()`` ends the
    stream, which frees every cache created on it.
    """

    _END = object()

    def __init__(self, client: Client) -> None:
        self._q: queue.Queue = queue.Queue()
        self._next_id = 0
        self._lock = threading.Lock()
        self._responses = client.stub.Session(iter(self._q.get, self._END), metadata=client.metadata)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def send(self, request) -> int:
        """Queue a step without waiting; returns its step id (results come back in order)."""
        with self._lock:
            self._next_id += 1
            sid = self._next_id
        msg = pb.SessionRequest(step_id=sid)
        getattr(msg, _STEP_FIELDS[type(request)]).CopyFrom(request)
        self._q.put(msg)
        return sid

    def receive(self):
        """The next result in order (the step's response message)."""
        try:
            resp = next(self._responses)
        except grpc.RpcError as e:
            raise FerrumRpcError.from_rpc_error(e) from None
        which = resp.WhichOneof("result")
        if which == "error":
            raise FerrumRpcError.from_step_error(resp.error)
        return getattr(resp, which)

    def step(self, request):
        self.send(request)
        return self.receive()

    def cancel(self) -> None:
        self._responses.cancel()

    def close(self) -> None:
        self._q.put(self._END)
        try:
            for _ in self._responses:
                pass
        except grpc.RpcError:
            pass


class AsyncClient:
    """asyncio client; the same methods as :class:`Client`, as coroutines."""

    def __init__(self, target: str, *, token: str | None = None, root_certificates: bytes | None = None,
                 private_key: bytes | None = None, certificate_chain: bytes | None = None,
                 options: Sequence[tuple[str, Any]] = (), timeout: float | None = 60.0) -> None:
        opts = list(DEFAULT_OPTIONS) + list(options)
        if root_certificates is not None:
            self.channel = grpc.aio.secure_channel(
                target, _credentials(root_certificates, private_key, certificate_chain), options=opts)
        else:
            self.channel = grpc.aio.insecure_channel(target, options=opts)
        self.stub = pb_grpc.ModelExecutorStub(self.channel)
        self.metadata = [("authorization", f"Bearer {token}")] if token else []
        self.timeout = timeout

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def _call(self, name: str, request, timeout: float | None = None):
        try:
            return await getattr(self.stub, name)(request, timeout=timeout or self.timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise FerrumRpcError.from_rpc_error(e) from None

    async def info(self, model_id: str = "", **kw) -> pb.InfoResponse:
        return await self._call("Info", pb.InfoRequest(model_id=model_id), **kw)

    async def kv_capacity(self, model_id: str = "", **kw) -> tpb.KvCapacity:
        return (await self._call("KvCapacity", pb.KvCapacityRequest(model_id=model_id), **kw)).capacity

    async def prefill(self, model_id: str, token_ids: Sequence[int], cache_id: str = "",
                      policy: tpb.LogitsPolicy | None = None, reserve_tokens: int = 0, all_positions: bool = False,
                      **kw) -> pb.PrefillResponse:
        return await self._call("Prefill", _Requests.prefill(model_id, token_ids, cache_id, policy, reserve_tokens,
                                                             all_positions), **kw)

    async def batch_prefill(self, model_id: str, prompts, **kw) -> pb.BatchPrefillResponse:
        return await self._call("BatchPrefill", _Requests.batch_prefill(model_id, prompts), **kw)

    async def decode(self, model_id: str, cache_id: str, token_id: int, policy: tpb.LogitsPolicy | None = None,
                     position: int | None = None, **kw) -> pb.DecodeResponse:
        return await self._call("Decode", _Requests.decode(model_id, cache_id, token_id, policy, position), **kw)

    async def batch_decode(self, model_id: str, items, **kw) -> pb.BatchDecodeResponse:
        return await self._call("BatchDecode", _Requests.batch_decode(model_id, items), **kw)

    async def forward_verify(self, model_id: str, cache_id: str, token_ids: Sequence[int],
                             accept_greedy_prefix: bool = False, policy: tpb.LogitsPolicy | None = None,
                             **kw) -> pb.ForwardVerifyResponse:
        return await self._call("ForwardVerify", _Requests.forward_verify(model_id, cache_id, token_ids,
                                                                          accept_greedy_prefix, policy), **kw)

    async def truncate_kv(self, model_id: str, cache_id: str, new_len: int, **kw) -> pb.TruncateKvResponse:
        return await self._call("TruncateKv", pb.TruncateKvRequest(model_id=model_id, cache_id=cache_id,
                                                                   new_len=new_len), **kw)

    async def release_cache(self, model_id: str, cache_id: str, **kw) -> pb.ReleaseCacheResponse:
        return await self._call("ReleaseCache", pb.ReleaseCacheRequest(model_id=model_id, cache_id=cache_id), **kw)

    async def generate(self, model_id: str, *, timeout: float | None = None, **kw) -> AsyncIterator[pb.GenerateResponse]:
        """Async iterator over a generation's events (break out of the loop to cancel it)."""
        call = self.stub.Generate(m.generate_request(model_id, **kw), timeout=timeout, metadata=self.metadata)
        try:
            async for ev in call:
                yield ev
        except grpc.RpcError as e:
            raise FerrumRpcError.from_rpc_error(e) from None
        finally:
            call.cancel()

    def session(self):
        """The raw bidirectional ``Session`` call (``await call.write(SessionRequest)``, ``await call.read()``)."""
        return self.stub.Session(metadata=self.metadata)
