"""Request construction shared by :class:`~ferrum_client.Client` and
:class:`~ferrum_client.AsyncClient`: the argument conventions of every RPC live here, once.

``UNARY`` is the table of unary methods both clients expose: for each, the stub method, the request
builder (whose parameters are the method's parameters) and what the method returns.
:func:`unary_methods` puts them on a client class, sync or async. The server-streaming and
Session calls use the builders below (``kv_events``, ``health``, ``session_request``,
``step_result``) and :func:`ferrum_client.messages.generate_request`.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

from grpc_health.v1 import health_pb2

from . import messages as m
from ._proto.ferrum.executor.v1 import executor_pb2 as pb
from ._proto.ferrum.executor.v1 import types_pb2 as tpb
from .errors import FerrumRpcError


def _same(response):
    return response


@dataclass(frozen=True)
class Unary:
    """One unary RPC as a client method: the stub method ``rpc``, the request builder ``build``
    (its parameters are the method's, plus a keyword-only ``timeout``), the method's docstring
    ``doc``, its return type ``returns`` and the part of the response it returns (``result``)."""

    rpc: str
    build: Callable[..., Any]
    doc: str
    returns: Any
    result: Callable[[Any], Any] = _same


# ---- builders (one per RPC) ---------------------------------------------------------------------
def _model_only(request_type):
    """A builder for a request that carries only ``model_id`` ("" = every model / the sole one)."""

    def build(model_id: str = ""):
        return request_type(model_id=model_id)

    build.__doc__ = f"``{request_type.DESCRIPTOR.name}`` for ``model_id``."
    return build


def fork_cache(model_id: str, cache_id: str, keep_tokens: int | None = None,
               reserve_tokens: int = 0) -> pb.ForkCacheRequest:
    """``ForkCacheRequest``: a new cache sharing the first ``keep_tokens`` tokens of ``cache_id``
    (all of them when None), copy-on-write."""
    req = pb.ForkCacheRequest(model_id=model_id, cache_id=cache_id, reserve_tokens=reserve_tokens)
    if keep_tokens is not None:
        req.keep_tokens = keep_tokens
    return req


def reserve_kv_slots(model_id: str, requests: Iterable[tpb.KvSlotRequest]) -> pb.ReserveKvSlotsRequest:
    """``ReserveKvSlotsRequest`` for the given slot requests."""
    return pb.ReserveKvSlotsRequest(model_id=model_id, requests=list(requests))


def tokenize(model_id: str, text: str, add_special_tokens: bool = False) -> pb.TokenizeRequest:
    """``TokenizeRequest``."""
    return pb.TokenizeRequest(model_id=model_id, text=text, add_special_tokens=add_special_tokens)


def detokenize(model_id: str, token_ids: Sequence[int], skip_special_tokens: bool = False) -> pb.DetokenizeRequest:
    """``DetokenizeRequest``."""
    return pb.DetokenizeRequest(model_id=model_id, token_ids=list(token_ids), skip_special_tokens=skip_special_tokens)


def apply_chat_template(model_id: str, messages: Sequence[tuple[str, str]],
                        add_generation_prompt: bool = True) -> pb.ApplyChatTemplateRequest:
    """``ApplyChatTemplateRequest`` from ``(role, content)`` pairs."""
    req = pb.ApplyChatTemplateRequest(model_id=model_id, add_generation_prompt=add_generation_prompt)
    for role, content in messages:
        req.messages.add(role=role, content=content)
    return req


def prefill(model_id: str, token_ids: Sequence[int], cache_id: str = "", policy: tpb.LogitsPolicy | None = None,
            reserve_tokens: int = 0, all_positions: bool = False, *, cache_salt: str = "",
            bypass_prefix_cache: bool = False, adapter: str = "") -> pb.PrefillRequest:
    """``PrefillRequest`` (see :func:`ferrum_client.messages.prefill_input`); ``cache_salt`` and
    ``bypass_prefix_cache`` steer prefix caching of a new cache; ``adapter`` is the LoRA adapter
    a new cache is bound to ("" = the base model, or the cache's own when continuing one)."""
    return pb.PrefillRequest(model_id=model_id, input=m.prefill_input(
        token_ids, cache_id, policy, reserve_tokens, all_positions, cache_salt=cache_salt,
        bypass_prefix_cache=bypass_prefix_cache, adapter=adapter))


def batch_prefill(model_id: str, prompts: Sequence[Sequence[int] | pb.PrefillInput]) -> pb.BatchPrefillRequest:
    """``BatchPrefillRequest``; each prompt is token ids or a ready ``PrefillInput``."""
    inputs = [p if isinstance(p, pb.PrefillInput) else m.prefill_input(p) for p in prompts]
    return pb.BatchPrefillRequest(model_id=model_id, inputs=inputs)


def decode(model_id: str, cache_id: str, token_id: int, policy: tpb.LogitsPolicy | None = None,
           position: int | None = None) -> pb.DecodeRequest:
    """``DecodeRequest`` (see :func:`ferrum_client.messages.decode_input`)."""
    return pb.DecodeRequest(model_id=model_id, input=m.decode_input(cache_id, token_id, policy, position))


def batch_decode(model_id: str, items: Sequence[tuple[str, int] | pb.DecodeInput]) -> pb.BatchDecodeRequest:
    """``BatchDecodeRequest``; each item is ``(cache_id, token_id[, policy[, position]])`` or a
    ready ``DecodeInput``."""
    inputs = [i if isinstance(i, pb.DecodeInput) else m.decode_input(*i) for i in items]
    return pb.BatchDecodeRequest(model_id=model_id, inputs=inputs)


def unified_decode(model_id: str, items: Sequence[pb.UnifiedBatchItem]) -> pb.UnifiedDecodeRequest:
    """``UnifiedDecodeRequest`` (items from :func:`ferrum_client.messages.unified_item`)."""
    return pb.UnifiedDecodeRequest(model_id=model_id, items=list(items))


def forward(model_id: str, input_ids, logits_dtype: str = "fp32") -> pb.ForwardRequest:
    """``ForwardRequest`` for token ids ``[batch, seq]`` (any integer array); logits in
    ``fp32`` / ``fp16`` / ``bf16``."""
    return pb.ForwardRequest(model_id=model_id, input=m.ids_tensor(input_ids), logits_dtype=m.DTYPES[logits_dtype])


def forward_verify(model_id: str, cache_id: str, token_ids: Sequence[int], accept_greedy_prefix: bool = False,
                   policy: tpb.LogitsPolicy | None = None) -> pb.ForwardVerifyRequest:
    """``ForwardVerifyRequest``: the last accepted token, then the draft tokens."""
    return pb.ForwardVerifyRequest(model_id=model_id, cache_id=cache_id, token_ids=list(token_ids),
                                   accept_greedy_prefix=accept_greedy_prefix, logits=policy)


def truncate_kv(model_id: str, cache_id: str, new_len: int) -> pb.TruncateKvRequest:
    """``TruncateKvRequest``."""
    return pb.TruncateKvRequest(model_id=model_id, cache_id=cache_id, new_len=new_len)


def release_cache(model_id: str, cache_id: str) -> pb.ReleaseCacheRequest:
    """``ReleaseCacheRequest``."""
    return pb.ReleaseCacheRequest(model_id=model_id, cache_id=cache_id)


def pull_kv(model_id: str, target: str, cache_id: str, *, source_model_id: str = "", from_token: int = 0,
            to_token: int = 0, reserve_tokens: int = 0, cache_salt: str = "", tls: bool = False,
            max_chunk_bytes: int = 0, request_id: str = "") -> Iterator[pb.ImportKvRequest]:
    """The one-message ``ImportKv`` stream of a server pull: this server fetches ``cache_id`` from
    the server at ``target`` itself (``ExportKv``). ``target`` must be one of the server's
    configured KV peers; it authenticates with its own peer credentials on this caller's behalf."""
    return iter([pb.ImportKvRequest(
        model_id=model_id, reserve_tokens=reserve_tokens, cache_salt=cache_salt, request_id=request_id,
        source=pb.KvSource(target=target, cache_id=cache_id, model_id=source_model_id, from_token=from_token,
                           to_token=to_token, tls=tls, max_chunk_bytes=max_chunk_bytes))])


def export_kv(model_id: str, cache_id: str, from_token: int = 0, to_token: int = 0,
              max_chunk_bytes: int = 0) -> pb.ExportKvRequest:
    return pb.ExportKvRequest(model_id=model_id, cache_id=cache_id, from_token=from_token, to_token=to_token,
                              max_chunk_bytes=max_chunk_bytes)


def import_request(model_id: str, msg, first: bool, *, reserve_tokens: int = 0,
                   cache_salt: str = "") -> pb.ImportKvRequest:
    """One ``ExportKvResponse`` as the matching ``ImportKvRequest``: the first carries the header
    and the import's options, the rest their chunk."""
    if first:
        return pb.ImportKvRequest(model_id=model_id, reserve_tokens=reserve_tokens, cache_salt=cache_salt,
                                  header=msg.header)
    return pb.ImportKvRequest(chunk=msg.chunk)


def import_stream(model_id: str, exported, *, reserve_tokens: int = 0, cache_salt: str = ""):
    """``ExportKvResponse`` messages (from ``export_kv``) as an ``ImportKv`` request stream."""
    for i, msg in enumerate(exported):
        yield import_request(model_id, msg, i == 0, reserve_tokens=reserve_tokens, cache_salt=cache_salt)


def load_adapter(name: str, path: str, model_id: str = "") -> pb.LoadAdapterRequest:
    """``LoadAdapterRequest``: register the PEFT adapter directory ``path`` (on the server's
    filesystem) under ``name`` on ``model_id`` ("" = the only hosted model)."""
    return pb.LoadAdapterRequest(model_id=model_id, name=name, path=path)


def unload_adapter(name: str, model_id: str = "") -> pb.UnloadAdapterRequest:
    """``UnloadAdapterRequest`` for the adapter ``name`` of ``model_id``."""
    return pb.UnloadAdapterRequest(model_id=model_id, name=name)


def migrate_streams(target: str, *, request_id: str = "", model_id: str = "",
                    drain: bool = False) -> pb.MigrateStreamsRequest:
    """``MigrateStreamsRequest``: move streams to the peer ``target`` (HOST:PORT)."""
    return pb.MigrateStreamsRequest(target=target, request_id=request_id, model_id=model_id, drain=drain)


def abort(model_id: str = "", *, request_id: str | None = None, cache_id: str | None = None) -> pb.AbortRequest:
    """``AbortRequest`` for a ``Generate`` stream's ``request_id`` or a ``cache_id``."""
    req = pb.AbortRequest(model_id=model_id)
    if request_id is not None:
        req.request_id = request_id
    if cache_id is not None:
        req.cache_id = cache_id
    return req


def kv_events(model_id: str = "", from_seq: int | None = None,
              include_block_events: bool = False) -> pb.SubscribeKvEventsRequest:
    """``SubscribeKvEventsRequest``; ``from_seq`` resumes after a known event;
    ``include_block_events`` adds the prefix cache's block events (``KvBlockEvent``)."""
    req = pb.SubscribeKvEventsRequest(model_id=model_id, include_block_events=include_block_events)
    if from_seq is not None:
        req.from_seq = from_seq
    return req


def health(service: str = "") -> health_pb2.HealthCheckRequest:
    """``grpc.health.v1`` check for ``service`` ("" = the server, or a model id)."""
    return health_pb2.HealthCheckRequest(service=service)


def serving_status(response: health_pb2.HealthCheckResponse) -> str:
    """The status name of a health response: SERVING, NOT_SERVING, SERVICE_UNKNOWN."""
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


# ---- the unary methods of both clients ----------------------------------------------------------
_get = operator.attrgetter

UNARY: dict[str, Unary] = {
    # health & metadata
    "info": Unary("Info", _model_only(pb.InfoRequest), "The hosted models (or one) and the server's versions.",
                  pb.InfoResponse),
    "capabilities": Unary("Capabilities", _model_only(pb.CapabilitiesRequest), "The model's executor capabilities.",
                          tpb.ExecutorCapabilities, _get("capabilities")),
    "status": Unary("Status", _model_only(pb.StatusRequest), "The model's state, operation counts and metrics.",
                    pb.StatusResponse),
    "kv_capacity": Unary("KvCapacity", _model_only(pb.KvCapacityRequest), "The model's KV budget: used, reserved, "
                         "free tokens and bytes.", tpb.KvCapacity, _get("capacity")),
    "admission_limits": Unary("AdmissionLimits", _model_only(pb.AdmissionLimitsRequest),
                              "The model's admission limits (absent where the executor has none).",
                              pb.AdmissionLimitsResponse),
    "reserve_kv_slots": Unary("ReserveKvSlots", reserve_kv_slots, "Reserve KV slots for caches "
                              "(``KvSlotRequest`` messages).", pb.ReserveKvSlotsResponse),
    "kv_slot_capacity": Unary("KvSlotCapacity", _model_only(pb.KvSlotCapacityRequest),
                              "The model's KV slot snapshot (absent where the executor has none).",
                              pb.KvSlotCapacityResponse),
    "cache_metrics": Unary("CacheMetrics", _model_only(pb.CacheMetricsRequest), "The model's cache metrics.",
                           pb.CacheMetricsResponse),
    "lora_metrics": Unary("LoraMetrics", _model_only(pb.LoraMetricsRequest), "The model's LoRA metrics.",
                          pb.LoraMetricsResponse),
    "warmup": Unary("Warmup", _model_only(pb.WarmupRequest), "Warm the model (or every model) up.",
                    pb.WarmupResponse),
    "shutdown": Unary("Shutdown", _model_only(pb.ShutdownRequest), "Stop serving the model (or every model), "
                      "releasing its caches.", pb.ShutdownResponse),
    # tokenization
    "tokenize": Unary("Tokenize", tokenize, "The token ids of ``text`` (the model's tokenizer).", list[int],
                      lambda r: list(r.token_ids)),
    "detokenize": Unary("Detokenize", detokenize, "The text of ``token_ids`` (the model's tokenizer).", str,
                        _get("text")),
    "apply_chat_template": Unary("ApplyChatTemplate", apply_chat_template, "The model's chat template applied to "
                                 "``(role, content)`` messages: text and token ids.",
                                 pb.ApplyChatTemplateResponse),
    # steps
    "prefill": Unary("Prefill", prefill, "Prefill a prompt into a new (or, with ``cache_id``, an existing) cache.",
                     pb.PrefillResponse),
    "batch_prefill": Unary("BatchPrefill", batch_prefill, "Prefill several prompts (token ids or "
                           "``PrefillInput``), one output each.", pb.BatchPrefillResponse),
    "decode": Unary("Decode", decode, "One decode step on a cache (``position`` = the expected cache length).",
                    pb.DecodeResponse),
    "batch_decode": Unary("BatchDecode", batch_decode, "One decode step on several caches (``(cache_id, "
                          "token_id)`` tuples or ``DecodeInput``).", pb.BatchDecodeResponse),
    "unified_decode": Unary("UnifiedDecode", unified_decode, "A mixed step of prefill chunks and decode items "
                            "(``UnifiedBatchItem``).", pb.UnifiedDecodeResponse),
    "forward": Unary("Forward", forward, "A cache-less forward pass over token ids ``[batch, seq]``; "
                     "``logits_dtype`` is fp32, fp16 or bf16.", pb.ForwardResponse),
    "forward_verify": Unary("ForwardVerify", forward_verify, "Speculative verification: the last accepted token "
                            "then the draft tokens, written at the cache's end.", pb.ForwardVerifyResponse),
    "truncate_kv": Unary("TruncateKv", truncate_kv, "Cut a cache back to ``new_len`` tokens.",
                         pb.TruncateKvResponse),
    "release_cache": Unary("ReleaseCache", release_cache, "Free a cache.", pb.ReleaseCacheResponse),
    "fork_cache": Unary("ForkCache", fork_cache, "A new cache sharing the first ``keep_tokens`` tokens of "
                        "``cache_id`` (all when None), copy-on-write; ``reserve_tokens`` as for Prefill.",
                        pb.ForkCacheResponse),
    # scheduler-facing operations
    "loads": Unary("Loads", _model_only(pb.LoadsRequest), "Per-model load (caches, resident tokens, latencies) "
                   "and the last KV event's sequence number.", pb.LoadsResponse),
    "list_caches": Unary("ListCaches", _model_only(pb.ListCachesRequest), "A snapshot of the live caches, as of "
                         "a KV event sequence number.", pb.ListCachesResponse),
    "pull_kv": Unary("ImportKv", pull_kv, "KV handoff by server pull: this server imports ``cache_id`` from the "
                     "server at ``target``, one of its configured KV peers (it calls ExportKv there with its own "
                     "peer credentials, on this caller's behalf); the new cache is this caller's.",
                     pb.ImportKvResponse),
    # LoRA adapters
    "load_adapter": Unary("LoadAdapter", load_adapter, "Register a LoRA adapter (a PEFT directory on the server) under "
                          "``name``; requests name it in ``adapter=``. Loading the same name and path again is a "
                          "no-op (``loaded`` false); another path under a loaded name is ALREADY_EXISTS. An admin "
                          "RPC.", pb.LoadAdapterResponse),
    "unload_adapter": Unary("UnloadAdapter", unload_adapter, "Forget a LoRA adapter and drop its cached prefix "
                            "blocks; FAILED_PRECONDITION while a live cache is bound to it; an unknown name answers "
                            "``unloaded`` false. An admin RPC.", pb.UnloadAdapterResponse),
    "list_adapters": Unary("ListAdapters", _model_only(pb.ListAdaptersRequest), "The LoRA adapters registered on "
                           "the model (every model's when ``model_id`` is empty): ``.adapters``, ``AdapterInfo`` "
                           "messages.", pb.ListAdaptersResponse),
    "abort": Unary("Abort", abort, "Abort a ``Generate`` stream by ``request_id`` or release a cache by "
                   "``cache_id`` (idempotent).", pb.AbortResponse),
    "migrate_streams": Unary("MigrateStreams", migrate_streams, "Move running ``Generate`` streams (all, or those "
                             "of ``request_id``) to the KV peer ``target`` (admin; ``drain=True`` also stops new "
                             "work): ``.streams``, one ``StreamMigration`` each.", pb.MigrateStreamsResponse),
}


def _signature(spec: Unary) -> inspect.Signature:
    """The method's signature: ``self``, the builder's parameters, a keyword-only ``timeout``."""
    sig = inspect.signature(spec.build)
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    timeout = inspect.Parameter("timeout", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="float | None")
    return sig.replace(parameters=[self_param, *sig.parameters.values(), timeout], return_annotation=spec.returns)


def unary_methods(make: Callable[[Unary], Callable]):
    """Class decorator: one method per ``UNARY`` row, made by ``make(spec)`` (a function taking
    ``self``, the builder's arguments and ``timeout=``), named, documented and signed like the row."""

    def install(cls):
        for name, spec in UNARY.items():
            fn = make(spec)
            fn.__name__ = name
            fn.__qualname__ = f"{cls.__qualname__}.{name}"
            fn.__module__ = cls.__module__
            fn.__doc__ = (f"{spec.doc}\n\nRPC ``{spec.rpc}``; ``timeout`` is the call's deadline in seconds "
                          "(default: the client's).")
            fn.__signature__ = _signature(spec)
            setattr(cls, name, fn)
        return cls

    return install


# ---- Session steps ------------------------------------------------------------------------------
STEP_FIELDS = {
    pb.PrefillRequest: "prefill",
    pb.BatchPrefillRequest: "batch_prefill",
    pb.DecodeRequest: "decode",
    pb.BatchDecodeRequest: "batch_decode",
    pb.UnifiedDecodeRequest: "unified_decode",
    pb.ForwardVerifyRequest: "forward_verify",
    pb.TruncateKvRequest: "truncate_kv",
    pb.ReleaseCacheRequest: "release_cache",
    pb.ForkCacheRequest: "fork_cache",
}


def session_request(step_id: int, request) -> pb.SessionRequest:
    """A step request message (``PrefillRequest``, ``DecodeRequest``, ...) in its Session envelope."""
    msg = pb.SessionRequest(step_id=step_id)
    getattr(msg, STEP_FIELDS[type(request)]).CopyFrom(request)
    return msg


def step_result(response: pb.SessionResponse):
    """A Session response's step result; a failed step raises :class:`FerrumRpcError`."""
    which = response.WhichOneof("result")
    if which == "error":
        raise FerrumRpcError.from_step_error(response.error)
    return getattr(response, which)
