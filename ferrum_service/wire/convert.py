"""Contract conversion: protobuf messages <-> the executor interface's dataclasses.

Also the request checks that depend only on a message and the model's shape (sampling parameters
in range, token ids inside the vocabulary). Every check raises a :class:`FerrumError` naming the
field, so a caller learns exactly what to fix. The last section turns errors into what leaves the
server: a ``google.rpc.Status`` (unary and streaming RPCs) or an in-band ``StepError`` (Session).
"""

from __future__ import annotations

import math
import secrets

import grpc
import numpy as np
import structlog
from ferrum_client._proto.ferrum.executor.v1 import executor_pb2 as pb
from ferrum_client._proto.ferrum.executor.v1 import types_pb2 as tpb
from google.protobuf import any_pb2, duration_pb2, json_format, struct_pb2
from google.rpc import error_details_pb2, status_pb2

from ..core import errors
from ..core.modes import BlockEvent, ExecutorState
from ..core.request_limits import limit_of
from ..core.sampling import RowResult
from ..core.types import (
    CacheHandle,
    ConstraintSpec,
    ExecutorCapabilities,
    ExecutorStatus,
    KvCapacity,
    LogitsPolicy,
    ModelInfo,
    OutputMode,
    SamplingParams,
)

MAX_TOP_LOGPROBS = 64
#: Longest structured-output constraint (schema, regex, grammar, all choices), in bytes (declared in the
#: contract, per string; here also for all choices together).
MAX_CONSTRAINT_BYTES = limit_of(tpb.OutputConstraint, "json_schema")

_DTYPE_TO_PB = {
    "fp32": tpb.DATA_TYPE_FP32,
    "fp16": tpb.DATA_TYPE_FP16,
    "bf16": tpb.DATA_TYPE_BF16,
    "fp8": tpb.DATA_TYPE_FP8,
    "int32": tpb.DATA_TYPE_INT32,
    "int64": tpb.DATA_TYPE_INT64,
    "int8": tpb.DATA_TYPE_INT8,
    "uint8": tpb.DATA_TYPE_UINT8,
    "bool": tpb.DATA_TYPE_BOOL,
}
_PB_TO_LOGITS_DTYPE = {
    tpb.DATA_TYPE_UNSPECIFIED: "fp32",
    tpb.DATA_TYPE_FP32: "fp32",
    tpb.DATA_TYPE_FP16: "fp16",
    tpb.DATA_TYPE_BF16: "bf16",
}
_MODEL_TYPES = {
    "llama": tpb.MODEL_TYPE_LLAMA,
    "mistral": tpb.MODEL_TYPE_MISTRAL,
    "qwen": tpb.MODEL_TYPE_QWEN,
    "phi": tpb.MODEL_TYPE_PHI,
    "gemma": tpb.MODEL_TYPE_GEMMA,
    "code": tpb.MODEL_TYPE_CODE,
    "embedding": tpb.MODEL_TYPE_EMBEDDING,
    "clip": tpb.MODEL_TYPE_CLIP,
    "custom": tpb.MODEL_TYPE_CUSTOM,
}
_ATTENTION = {
    "multi_head": tpb.ATTENTION_TYPE_MULTI_HEAD,
    "multi_query": tpb.ATTENTION_TYPE_MULTI_QUERY,
    "grouped_query": tpb.ATTENTION_TYPE_GROUPED_QUERY,
    "flash": tpb.ATTENTION_TYPE_FLASH,
    "paged": tpb.ATTENTION_TYPE_PAGED,
    "sliding_window": tpb.ATTENTION_TYPE_SLIDING_WINDOW,
}
_STATES = {
    ExecutorState.INITIALIZING: tpb.EXECUTOR_STATE_INITIALIZING,
    ExecutorState.READY: tpb.EXECUTOR_STATE_READY,
    ExecutorState.BUSY: tpb.EXECUTOR_STATE_BUSY,
    ExecutorState.ERROR: tpb.EXECUTOR_STATE_ERROR,
    ExecutorState.SHUTDOWN: tpb.EXECUTOR_STATE_SHUTDOWN,
}


def dtype_pb(name: str) -> int:
    return _DTYPE_TO_PB.get(name, tpb.DATA_TYPE_UNSPECIFIED)


# ---- requests -> interface ------------------------------------------------------------------------
def struct_to_dict(s: struct_pb2.Struct) -> dict:
    return json_format.MessageToDict(s) if s.fields else {}


def check_tokens(ids, vocab_size: int, field: str, *, allow_empty: bool = False, max_len: int = 0) -> list[int]:
    """The ids as a list; INVALID_ARGUMENT when there are more than ``max_len`` (checked first, so
    an oversized request costs nothing more) or naming the first id outside the vocabulary."""
    arr = _token_array(ids, vocab_size, field, allow_empty, max_len)
    return arr.tolist() if arr.size else []


def penalty_token_ids(ids, vocab_size: int, field: str) -> np.ndarray:
    """``penalty_token_ids`` as the sorted distinct ids (int64), made once when the request starts
    so no step sorts them again; INVALID_ARGUMENT when there are more ids than the vocabulary has
    tokens (counted before any is read) or one lies outside it."""
    return np.unique(_token_array(ids, vocab_size, field, False, vocab_size))


def _token_array(ids, vocab_size: int, field: str, allow_empty: bool, max_len: int) -> np.ndarray:
    n = len(ids)
    if not n and not allow_empty:
        raise errors.invalid(f"{field} is empty: at least one token id is required", field=field)
    if max_len and n > max_len:
        raise errors.invalid(f"{field} has {n} token ids; the limit is {max_len}", field=field,
                             limit=max_len, requested=n)
    if not n:
        return np.zeros(0, dtype=np.int64)
    arr = np.fromiter(ids, dtype=np.int64, count=n)
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        i, t = int(bad[0]), int(arr[bad[0]])
        raise errors.invalid(
            f"{field}[{i}] = {t} is outside the vocabulary [0, {vocab_size})",
            field=f"{field}[{i}]",
            vocab_size=vocab_size,
            token_id=t,
        )
    return arr


def check_token(t: int, vocab_size: int, field: str) -> int:
    """One token id; INVALID_ARGUMENT when outside the vocabulary."""
    if t < 0 or t >= vocab_size:
        raise errors.invalid(f"{field} = {t} is outside the vocabulary [0, {vocab_size})", field=field,
                             vocab_size=vocab_size, token_id=t)
    return int(t)


def sampling_params(msg: tpb.SamplingParams, vocab_size: int, field: str) -> SamplingParams:
    """Validate and convert ``SamplingParams``."""
    t = msg.temperature
    if not math.isfinite(t) or t < 0:
        raise errors.invalid(f"{field}.temperature = {t} must be finite and >= 0", field=f"{field}.temperature")
    top_p = msg.top_p if msg.HasField("top_p") else 1.0
    if not math.isfinite(top_p) or not (0.0 < top_p <= 1.0):
        raise errors.invalid(f"{field}.top_p = {top_p} must be in (0, 1]", field=f"{field}.top_p")
    if not math.isfinite(msg.min_p) or not (0.0 <= msg.min_p < 1.0):
        raise errors.invalid(f"{field}.min_p = {msg.min_p} must be in [0, 1)", field=f"{field}.min_p")
    rp = msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0
    if not math.isfinite(rp) or rp <= 0:
        raise errors.invalid(
            f"{field}.repetition_penalty = {rp} must be finite and > 0", field=f"{field}.repetition_penalty"
        )
    penalty_ids = None
    if msg.penalty_token_ids:
        penalty_ids = penalty_token_ids(msg.penalty_token_ids, vocab_size, f"{field}.penalty_token_ids")
    mask = bytes(msg.token_mask) or None
    if mask is not None and not any(mask[:vocab_size]):
        raise errors.invalid(f"{field}.token_mask allows no token of the vocabulary", field=f"{field}.token_mask")
    return SamplingParams(
        constraint=constraint_spec(msg, f"{field}.constraint"),
        temperature=float(t),
        top_k=int(msg.top_k),
        top_p=float(top_p),
        min_p=float(msg.min_p),
        repetition_penalty=float(rp),
        penalty_token_ids=penalty_ids,
        seed=msg.seed if msg.HasField("seed") else None,
        token_mask=mask,
    )


def constraint_spec(msg: tpb.SamplingParams, field: str) -> ConstraintSpec | None:
    """The message-level checks of ``OutputConstraint`` (compiling it needs the model: guided.py)."""
    if not msg.HasField("constraint"):
        return None
    c = msg.constraint
    kind = c.WhichOneof("kind")
    if kind is None:
        raise errors.invalid(f"{field} is set but names no kind (json_schema, regex, ebnf_grammar, lark_grammar, "
                             "choice)", field=field)
    if kind == "choice":
        if not c.choice.choices:
            raise errors.invalid(f"{field}.choice has no choices", field=f"{field}.choice")
        size = sum(len(x.encode()) for x in c.choice.choices)
        spec = ConstraintSpec(kind, choices=tuple(c.choice.choices))
    else:
        text = getattr(c, kind)
        if not text:
            raise errors.invalid(f"{field}.{kind} is empty", field=f"{field}.{kind}")
        size = len(text.encode())
        spec = ConstraintSpec(kind, text=text)
    if size > MAX_CONSTRAINT_BYTES:
        raise errors.invalid(f"{field}.{kind} is {size} bytes; the limit is {MAX_CONSTRAINT_BYTES}",
                             field=f"{field}.{kind}", limit=MAX_CONSTRAINT_BYTES)
    return spec


def logits_policy(msg: tpb.LogitsPolicy, vocab_size: int, field: str) -> LogitsPolicy:
    """Validate and convert ``LogitsPolicy``."""
    mode = OutputMode(msg.mode) if msg.mode in (1, 2, 3, 4) else None
    if msg.mode == tpb.OUTPUT_MODE_UNSPECIFIED:
        mode = OutputMode.SAMPLED_TOKEN
    if mode is None:
        raise errors.invalid(f"{field}.mode = {msg.mode} is not a known OutputMode", field=f"{field}.mode")
    if msg.top_logprobs > MAX_TOP_LOGPROBS:
        raise errors.invalid(
            f"{field}.top_logprobs = {msg.top_logprobs} exceeds the maximum {MAX_TOP_LOGPROBS}",
            field=f"{field}.top_logprobs",
        )
    if mode == OutputMode.TOP_LOGPROBS and msg.top_logprobs == 0:
        raise errors.invalid(
            f"{field}.top_logprobs must be > 0 in OUTPUT_MODE_TOP_LOGPROBS", field=f"{field}.top_logprobs"
        )
    if msg.logits_dtype not in _PB_TO_LOGITS_DTYPE:
        raise errors.invalid(
            f"{field}.logits_dtype must be FP32, FP16 or BF16", field=f"{field}.logits_dtype"
        )
    return LogitsPolicy(
        mode=mode,
        sampling=sampling_params(msg.sampling, vocab_size, f"{field}.sampling"),
        top_logprobs=int(msg.top_logprobs),
        logits_dtype=_PB_TO_LOGITS_DTYPE[msg.logits_dtype],
    )


# ---- interface -> responses -----------------------------------------------------------------------
def handle_pb(h: CacheHandle) -> tpb.KvCacheHandle:
    return tpb.KvCacheHandle(
        cache_id=h.cache_id,
        model_id=h.model_id,
        num_tokens=h.num_tokens,
        block_size=h.block_size,
        num_blocks=h.num_blocks,
        block_ids=h.block_ids,
        memory_bytes=h.memory_bytes,
        num_layers=h.num_layers,
        num_kv_heads=h.num_kv_heads,
        head_dim=h.head_dim,
        adapter=h.adapter,
    )


def adapter_pb(host, a, bound: dict[str, int]) -> pb.AdapterInfo:
    """A registered LoRA adapter (``lora.Adapter``) of ``host``'s model; ``bound``: live caches
    per adapter (``executor.adapter_bindings()``)."""
    return pb.AdapterInfo(model_id=host.model_id, name=a.name, path=a.path, rank=a.rank, alpha=a.alpha,
                          target_modules=a.target_modules, resident=a.resident, weight_bytes=a.weight_bytes,
                          live_caches=bound.get(a.name, 0), steps=a.steps,
                          loaded_unix_ms=a.loaded_unix_ms)


def row_pb(r: RowResult) -> tpb.LogitsOutput:
    out = tpb.LogitsOutput()
    if r.no_selectable_finite_logit:  # no token was selectable: say so, and return none
        out.no_selectable_finite_logit = True
    elif r.token_id is not None:
        out.token_id = r.token_id
        out.logprob = r.logprob
    for t, lp in r.top:
        out.top_logprobs.add(token_id=t, logprob=lp)
    if r.logits is not None:
        out.logits.dtype = dtype_pb(r.logits_dtype)
        out.logits.shape.append(r.vocab)
        out.logits.data = r.logits
    return out


def model_info_pb(i: ModelInfo) -> tpb.ModelInfo:
    m = tpb.ModelInfo(
        model_id=i.model_id,
        model_type=_MODEL_TYPES.get(i.model_type, tpb.MODEL_TYPE_CUSTOM),
        model_type_detail=i.model_type_detail,
        num_parameters=i.num_parameters,
        hidden_size=i.hidden_size,
        num_layers=i.num_layers,
        num_heads=i.num_heads,
        num_kv_heads=i.num_kv_heads,
        vocab_size=i.vocab_size,
        max_sequence_length=i.max_sequence_length,
        dtype=dtype_pb(i.dtype),
        device=i.device,
        version=i.version,
        license=i.license,
        head_dim=i.head_dim,
        executor=i.executor,
        eos_token_ids=i.eos_token_ids,
        has_tokenizer=i.has_tokenizer,
        has_chat_template=i.has_chat_template,
    )
    if i.prefix_cache:
        m.prefix_cache.CopyFrom(tpb.PrefixCacheRecipe(**i.prefix_cache))
    if i.metadata:
        m.metadata.update(i.metadata)
    return m


def capabilities_pb(c: ExecutorCapabilities) -> tpb.ExecutorCapabilities:
    mr = c.memory_requirements
    return tpb.ExecutorCapabilities(
        max_batch_size=c.max_batch_size,
        max_sequence_length=c.max_sequence_length,
        attention_mechanisms=[_ATTENTION.get(a, tpb.ATTENTION_TYPE_UNSPECIFIED) for a in c.attention_mechanisms],
        supports_dynamic_batching=c.supports_dynamic_batching,
        supports_continuous_batching=c.supports_continuous_batching,
        supports_speculative_decoding=c.supports_speculative_decoding,
        supports_tensor_parallelism=c.supports_tensor_parallelism,
        supports_pipeline_parallelism=c.supports_pipeline_parallelism,
        supported_dtypes=[dtype_pb(d) for d in c.supported_dtypes],
        supported_devices=c.supported_devices,
        memory_requirements=tpb.MemoryRequirements(
            parameter_memory_bytes=mr.parameter_memory_bytes,
            activation_memory_per_token_bytes=mr.activation_memory_per_token_bytes,
            kv_cache_memory_per_token_bytes=mr.kv_cache_memory_per_token_bytes,
            overhead_memory_bytes=mr.overhead_memory_bytes,
        ),
        supports_native_unified_decode=c.supports_native_unified_decode,
        supports_generation=c.supports_generation,
        supports_embeddings=c.supports_embeddings,
        supports_forward=c.supports_forward,
        supports_kv_truncation=c.supports_kv_truncation,
        supports_native_forward_verify=c.supports_native_forward_verify,
        kv_block_size=c.kv_block_size,
        supports_prefix_caching=c.supports_prefix_caching,
        supports_fork=c.supports_fork,
        supports_kv_transfer=c.supports_kv_transfer,
        supports_lora=c.supports_lora,
        max_adapters=c.max_adapters,
    )


def status_pb(s: ExecutorStatus) -> tpb.ExecutorStatus:
    m = tpb.ExecutorStatus(
        state=_STATES.get(s.state, tpb.EXECUTOR_STATE_UNSPECIFIED),
        is_ready=s.is_ready,
        current_batch_size=s.current_batch_size,
        prefill_operations=s.prefill_operations,
        decode_operations=s.decode_operations,
        avg_prefill_time_ms=s.avg_prefill_time_ms,
        avg_decode_time_ms=s.avg_decode_time_ms,
        memory_usage=tpb.ExecutorMemoryUsage(
            allocated_bytes=s.memory_usage.allocated_bytes,
            used_bytes=s.memory_usage.used_bytes,
            peak_bytes=s.memory_usage.peak_bytes,
            utilization_percent=s.memory_usage.utilization_percent,
        ),
        active_caches=s.active_caches,
    )
    if s.ns_since_last_operation is not None:
        m.ns_since_last_operation = s.ns_since_last_operation
    return m


def kv_capacity_pb(k: KvCapacity) -> tpb.KvCapacity:
    m = tpb.KvCapacity(
        total_tokens=k.total_tokens,
        used_tokens=k.used_tokens,
        free_tokens=k.free_tokens,
        reserved_tokens=k.reserved_tokens,
        total_bytes=k.total_bytes,
        used_bytes=k.used_bytes,
        bytes_per_token=k.bytes_per_token,
        block_size=k.block_size,
        total_blocks=k.total_blocks,
        free_blocks=k.free_blocks,
        evictable_blocks=k.evictable_blocks,
        cached_blocks=k.cached_blocks,
    )
    if k.per_request_tokens is not None:
        m.per_request_tokens = k.per_request_tokens
    return m


def dict_to_struct(d: dict | None) -> struct_pb2.Struct | None:
    if d is None:
        return None
    s = struct_pb2.Struct()
    s.update(d)
    return s


__all__ = [
    "pb",
    "tpb",
    "check_tokens",
    "sampling_params",
    "logits_policy",
    "handle_pb",
    "row_pb",
    "model_info_pb",
    "capabilities_pb",
    "status_pb",
    "kv_capacity_pb",
    "block_event_pb",
    "struct_to_dict",
    "dict_to_struct",
]


# ---- errors -> statuses ---------------------------------------------------------------------------
_log = structlog.get_logger("ferrum_service.core.errors")
_BAD_REQUEST_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                      grpc.StatusCode.FAILED_PRECONDITION)


def as_ferrum_error(exc: BaseException, rpc: str) -> errors.FerrumError:
    """``exc`` as the error the caller sees: a :class:`FerrumError` as it is; anything else is a
    bug, logged with its traceback and answered INTERNAL (call it in the ``except`` block)."""
    if isinstance(exc, errors.FerrumError):
        return exc
    # the exception's text (paths, shapes, library internals) stays in the server's log; the
    # caller gets an id to quote that finds it there
    error_id = secrets.token_hex(6)
    _log.exception("unexpected error", rpc=rpc, error=repr(exc), error_id=error_id)
    return errors.FerrumError(errors.ErrorKind.INTERNAL, f"{rpc}: internal error (error id {error_id}; the "
                              "server's log has the details)", metadata={"error_id": error_id})


def _packed(msg) -> any_pb2.Any:
    d = any_pb2.Any()
    d.Pack(msg)
    return d


def status_of(e: errors.FerrumError) -> status_pb2.Status:
    """A FerrumError as a ``google.rpc.Status``: ErrorInfo always (reason = ferrum's kind, the field
    in its metadata), BadRequest naming the field for argument errors, RetryInfo when the caller
    should retry later."""
    st = status_pb2.Status(code=e.code.value[0], message=e.message)
    info = error_details_pb2.ErrorInfo(reason=e.kind.name, domain=errors.ERROR_DOMAIN, metadata=e.metadata)
    if e.field:
        info.metadata["field"] = e.field
    st.details.append(_packed(info))
    if e.field and e.code in _BAD_REQUEST_CODES:
        br = error_details_pb2.BadRequest()
        br.field_violations.add(field=e.field, description=e.message)
        st.details.append(_packed(br))
    if e.retry_after_ms:
        st.details.append(_packed(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(
            seconds=e.retry_after_ms // 1000, nanos=(e.retry_after_ms % 1000) * 1_000_000))))
    if e.progress is not None:
        st.details.append(_packed(step_progress_pb(e.progress)))
    return st


def step_progress_pb(progress) -> tpb.StepProgress:
    """A failed step's per-item progress (``core/progress.py``) as the ``StepProgress`` detail."""
    return tpb.StepProgress(items=[tpb.ItemProgress(index=p.index, state=p.state.value, tokens_ran=p.tokens_ran,
                                                    reason=p.reason) for p in progress])


def step_error_pb(e: errors.FerrumError) -> tpb.StepError:
    """A FerrumError as a Session step's in-band ``StepError`` (the session goes on)."""
    err = tpb.StepError(code=e.code.value[0], message=e.message, kind=e.kind.value, field=e.field,
                        metadata=e.metadata, retry_after_ms=e.retry_after_ms)
    if e.progress is not None:
        err.progress.CopyFrom(step_progress_pb(e.progress))
    return err


def block_event_pb(ev) -> pb.KvBlockEvent:
    """A prefix-cache block event (``kv_events.KvEventRecord`` with ``block_kind``)."""
    m = pb.KvBlockEvent(seq=ev.seq, model_id=ev.model_id, time_unix_ns=ev.time_unix_ns)
    d = ev.block or {}
    if ev.block_kind == BlockEvent.STORED:
        m.stored.CopyFrom(pb.KvBlockStored(block_hashes=d["block_hashes"], parent_block_hash=d["parent_block_hash"],
                                           token_ids=d["token_ids"], block_size=d["block_size"],
                                           adapter=d.get("adapter", "")))
    elif ev.block_kind == BlockEvent.REMOVED:
        m.removed.CopyFrom(pb.KvBlockRemoved(block_hashes=d["block_hashes"]))
    else:
        m.cleared.CopyFrom(pb.KvBlocksCleared())
    return m

