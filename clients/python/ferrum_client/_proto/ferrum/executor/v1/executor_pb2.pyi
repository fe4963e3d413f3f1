from ferrum_client._proto.buf.validate import validate_pb2 as _validate_pb2
from ferrum_client._proto.ferrum.executor.v1 import types_pb2 as _types_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MigrationMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MIGRATION_MODE_UNSPECIFIED: _ClassVar[MigrationMode]
    MIGRATION_MODE_FOLLOW: _ClassVar[MigrationMode]
    MIGRATION_MODE_RELAY: _ClassVar[MigrationMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
    FINISH_REASON_CONTENT_FILTER: _ClassVar[FinishReason]

class KvEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_EVENT_KIND_UNSPECIFIED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_CREATED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_EXTENDED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_TRUNCATED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_RELEASED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_RECLAIMED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_EVICTED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_FORKED: _ClassVar[KvEventKind]

class ServerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVER_ROLE_UNSPECIFIED: _ClassVar[ServerRole]
    SERVER_ROLE_BOTH: _ClassVar[ServerRole]
    SERVER_ROLE_PREFILL: _ClassVar[ServerRole]
    SERVER_ROLE_DECODE: _ClassVar[ServerRole]
MIGRATION_MODE_UNSPECIFIED: MigrationMode
MIGRATION_MODE_FOLLOW: MigrationMode
MIGRATION_MODE_RELAY: MigrationMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ERROR: FinishReason
FINISH_REASON_CONTENT_FILTER: FinishReason
KV_EVENT_KIND_UNSPECIFIED: KvEventKind
KV_EVENT_KIND_CREATED: KvEventKind
KV_EVENT_KIND_EXTENDED: KvEventKind
KV_EVENT_KIND_TRUNCATED: KvEventKind
KV_EVENT_KIND_RELEASED: KvEventKind
KV_EVENT_KIND_RECLAIMED: KvEventKind
KV_EVENT_KIND_EVICTED: KvEventKind
KV_EVENT_KIND_FORKED: KvEventKind
SERVER_ROLE_UNSPECIFIED: ServerRole
SERVER_ROLE_BOTH: ServerRole
SERVER_ROLE_PREFILL: ServerRole
SERVER_ROLE_DECODE: ServerRole

class InfoRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("models", "server_version", "contract_version", "role")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[_types_pb2.ModelInfo]
    server_version: str
    contract_version: str
    role: ServerRole
    def __init__(self, models: _Optional[_Iterable[_Union[_types_pb2.ModelInfo, _Mapping]]] = ..., server_version: _Optional[str] = ..., contract_version: _Optional[str] = ..., role: _Optional[_Union[ServerRole, str]] = ...) -> None: ...

class CapabilitiesRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class CapabilitiesResponse(_message.Message):
    __slots__ = ("model_id", "capabilities")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    capabilities: _types_pb2.ExecutorCapabilities
    def __init__(self, model_id: _Optional[str] = ..., capabilities: _Optional[_Union[_types_pb2.ExecutorCapabilities, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("model_id", "status", "metrics")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    status: _types_pb2.ExecutorStatus
    metrics: _types_pb2.ExecutorMetrics
    def __init__(self, model_id: _Optional[str] = ..., status: _Optional[_Union[_types_pb2.ExecutorStatus, _Mapping]] = ..., metrics: _Optional[_Union[_types_pb2.ExecutorMetrics, _Mapping]] = ...) -> None: ...

class KvCapacityRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class KvCapacityResponse(_message.Message):
    __slots__ = ("model_id", "capacity")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    capacity: _types_pb2.KvCapacity
    def __init__(self, model_id: _Optional[str] = ..., capacity: _Optional[_Union[_types_pb2.KvCapacity, _Mapping]] = ...) -> None: ...

class AdmissionLimitsRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class AdmissionLimitsResponse(_message.Message):
    __slots__ = ("model_id", "limits")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    limits: _types_pb2.ExecutorAdmissionLimits
    def __init__(self, model_id: _Optional[str] = ..., limits: _Optional[_Union[_types_pb2.ExecutorAdmissionLimits, _Mapping]] = ...) -> None: ...

class PrefillInput(_message.Message):
    __slots__ = ("token_ids", "cache_id", "logits", "reserve_tokens", "all_positions", "metadata", "request_id", "cache_salt", "bypass_prefix_cache", "adapter")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    RESERVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALL_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    BYPASS_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_id: str
    logits: _types_pb2.LogitsPolicy
    reserve_tokens: int
    all_positions: bool
    metadata: _struct_pb2.Struct
    request_id: str
    cache_salt: str
    bypass_prefix_cache: bool
    adapter: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., cache_id: _Optional[str] = ..., logits: _Optional[_Union[_types_pb2.LogitsPolicy, _Mapping]] = ..., reserve_tokens: _Optional[int] = ..., all_positions: _Optional[bool] = ..., metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., request_id: _Optional[str] = ..., cache_salt: _Optional[str] = ..., bypass_prefix_cache: _Optional[bool] = ..., adapter: _Optional[str] = ...) -> None: ...

class PrefillOutput(_message.Message):
    __slots__ = ("cache", "output", "positions", "embedding", "cached_tokens")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cache: _types_pb2.KvCacheHandle
    output: _types_pb2.LogitsOutput
    positions: _containers.RepeatedCompositeFieldContainer[_types_pb2.LogitsOutput]
    embedding: _types_pb2.Tensor
    cached_tokens: int
    def __init__(self, cache: _Optional[_Union[_types_pb2.KvCacheHandle, _Mapping]] = ..., output: _Optional[_Union[_types_pb2.LogitsOutput, _Mapping]] = ..., positions: _Optional[_Iterable[_Union[_types_pb2.LogitsOutput, _Mapping]]] = ..., embedding: _Optional[_Union[_types_pb2.Tensor, _Mapping]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("model_id", "input", "client_step_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    input: PrefillInput
    client_step_id: str
    def __init__(self, model_id: _Optional[str] = ..., input: _Optional[_Union[PrefillInput, _Mapping]] = ..., client_step_id: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("output", "timings")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    output: PrefillOutput
    timings: _types_pb2.StepTimings
    def __init__(self, output: _Optional[_Union[PrefillOutput, _Mapping]] = ..., timings: _Optional[_Union[_types_pb2.StepTimings, _Mapping]] = ...) -> None: ...

class BatchPrefillRequest(_message.Message):
    __slots__ = ("model_id", "inputs", "client_step_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    inputs: _containers.RepeatedCompositeFieldContainer[PrefillInput]
    client_step_id: str
    def __init__(self, model_id: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[PrefillInput, _Mapping]]] = ..., client_step_id: _Optional[str] = ...) -> None: ...

class BatchPrefillResponse(_message.Message):
    __slots__ = ("outputs", "timings")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[PrefillOutput]
    timings: _types_pb2.StepTimings
    def __init__(self, outputs: _Optional[_Iterable[_Union[PrefillOutput, _Mapping]]] = ..., timings: _Optional[_Union[_types_pb2.StepTimings, _Mapping]] = ...) -> None: ...

class DecodeInput(_message.Message):
    __slots__ = ("cache_id", "token_id", "logits", "position", "metadata")
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    token_id: int
    logits: _types_pb2.LogitsPolicy
    position: int
    metadata: _struct_pb2.Struct
    def __init__(self, cache_id: _Optional[str] = ..., token_id: _Optional[int] = ..., logits: _Optional[_Union[_types_pb2.LogitsPolicy, _Mapping]] = ..., position: _Optional[int] = ..., metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class DecodeOutput(_message.Message):
    __slots__ = ("cache", "output")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    cache: _types_pb2.KvCacheHandle
    output: _types_pb2.LogitsOutput
    def __init__(self, cache: _Optional[_Union[_types_pb2.KvCacheHandle, _Mapping]] = ..., output: _Optional[_Union[_types_pb2.LogitsOutput, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("model_id", "input", "client_step_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    input: DecodeInput
    client_step_id: str
    def __init__(self, model_id: _Optional[str] = ..., input: _Optional[_Union[DecodeInput, _Mapping]] = ..., client_step_id: _Optional[str] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("output", "timings")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    output: DecodeOutput
    timings: _types_pb2.StepTimings
    def __init__(self, output: _Optional[_Union[DecodeOutput, _Mapping]] = ..., timings: _Optional[_Union[_types_pb2.StepTimings, _Mapping]] = ...) -> None: ...

class BatchDecodeRequest(_message.Message):
    __slots__ = ("model_id", "inputs", "client_step_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    inputs: _containers.RepeatedCompositeFieldContainer[DecodeInput]
    client_step_id: str
    def __init__(self, model_id: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[DecodeInput, _Mapping]]] = ..., client_step_id: _Optional[str] = ...) -> None: ...

class BatchDecodeResponse(_message.Message):
    __slots__ = ("outputs", "timings")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[DecodeOutput]
    timings: _types_pb2.StepTimings
    def __init__(self, outputs: _Optional[_Iterable[_Union[DecodeOutput, _Mapping]]] = ..., timings: _Optional[_Union[_types_pb2.StepTimings, _Mapping]] = ...) -> None: ...

class UnifiedBatchItem(_message.Message):
    __slots__ = ("seq_id", "q_tokens", "cache_id", "pos_offset", "is_final_chunk", "logits", "metadata", "cache_salt", "bypass_prefix_cache", "adapter")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    Q_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    POS_OFFSET_FIELD_NUMBER: _ClassVar[int]
    IS_FINAL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    BYPASS_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    q_tokens: _containers.RepeatedScalarFieldContainer[int]
    cache_id: str
    pos_offset: int
    is_final_chunk: bool
    logits: _types_pb2.LogitsPolicy
    metadata: _struct_pb2.Struct
    cache_salt: str
    bypass_prefix_cache: bool
    adapter: str
    def __init__(self, seq_id: _Optional[str] = ..., q_tokens: _Optional[_Iterable[int]] = ..., cache_id: _Optional[str] = ..., pos_offset: _Optional[int] = ..., is_final_chunk: _Optional[bool] = ..., logits: _Optional[_Union[_types_pb2.LogitsPolicy, _Mapping]] = ..., metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., cache_salt: _Optional[str] = ..., bypass_prefix_cache: _Optional[bool] = ..., adapter: _Optional[str] = ...) -> None: ...

class UnifiedDecodeRequest(_message.Message):
    __slots__ = ("model_id", "items", "client_step_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    items: _containers.RepeatedCompositeFieldContainer[UnifiedBatchItem]
    client_step_id: str
    def __init__(self, model_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[UnifiedBatchItem, _Mapping]]] = ..., client_step_id: _Optional[str] = ...) -> None: ...

class UnifiedItemResult(_message.Message):
    __slots__ = ("seq_id", "cache", "output", "cached_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    cache: _types_pb2.KvCacheHandle
    output: _types_pb2.LogitsOutput
    cached_tokens: int
    def __init__(self, seq_id: _Optional[str] = ..., cache: _Optional[_Union[_types_pb2.KvCacheHandle, _Mapping]] = ..., output: _Optional[_Union[_types_pb2.LogitsOutput, _Mapping]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class UnifiedDecodeResponse(_message.Message):
    __slots__ = ("results", "timings")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[UnifiedItemResult]
    timings: _types_pb2.StepTimings
    def __init__(self, results: _Optional[_Iterable[_Union[UnifiedItemResult, _Mapping]]] = ..., timings: _Optional[_Union[_types_pb2.StepTimings, _Mapping]] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("model_id", "input", "logits_dtype")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    LOGITS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    input: _types_pb2.Tensor
    logits_dtype: _types_pb2.DataType
    def __init__(self, model_id: _Optional[str] = ..., input: _Optional[_Union[_types_pb2.Tensor, _Mapping]] = ..., logits_dtype: _Optional[_Union[_types_pb2.DataType, str]] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("output", "timings")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    output: _types_pb2.Tensor
    timings: _types_pb2.StepTimings
    def __init__(self, output: _Optional[_Union[_types_pb2.Tensor, _Mapping]] = ..., timings: _Optional[_Union[_types_pb2.StepTimings, _Mapping]] = ...) -> None: ...

class ForwardVerifyRequest(_message.Message):
    __slots__ = ("model_id", "cache_id", "token_ids", "logits", "accept_greedy_prefix", "client_step_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_GREEDY_PREFIX_FIELD_NUMBER: _ClassVar[int]
    CLIENT_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    cache_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logits: _types_pb2.LogitsPolicy
    accept_greedy_prefix: bool
    client_step_id: str
    def __init__(self, model_id: _Optional[str] = ..., cache_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logits: _Optional[_Union[_types_pb2.LogitsPolicy, _Mapping]] = ..., accept_greedy_prefix: _Optional[bool] = ..., client_step_id: _Optional[str] = ...) -> None: ...

class ForwardVerifyResponse(_message.Message):
    __slots__ = ("outputs", "cache", "base_len", "accepted_drafts", "accepted_tokens", "timings")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    BASE_LEN_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[_types_pb2.LogitsOutput]
    cache: _types_pb2.KvCacheHandle
    base_len: int
    accepted_drafts: int
    accepted_tokens: _containers.RepeatedScalarFieldContainer[int]
    timings: _types_pb2.StepTimings
    def __init__(self, outputs: _Optional[_Iterable[_Union[_types_pb2.LogitsOutput, _Mapping]]] = ..., cache: _Optional[_Union[_types_pb2.KvCacheHandle, _Mapping]] = ..., base_len: _Optional[int] = ..., accepted_drafts: _Optional[int] = ..., accepted_tokens: _Optional[_Iterable[int]] = ..., timings: _Optional[_Union[_types_pb2.StepTimings, _Mapping]] = ...) -> None: ...

class TruncateKvRequest(_message.Message):
    __slots__ = ("model_id", "cache_id", "new_len", "client_step_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_LEN_FIELD_NUMBER: _ClassVar[int]
    CLIENT_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    cache_id: str
    new_len: int
    client_step_id: str
    def __init__(self, model_id: _Optional[str] = ..., cache_id: _Optional[str] = ..., new_len: _Optional[int] = ..., client_step_id: _Optional[str] = ...) -> None: ...

class TruncateKvResponse(_message.Message):
    __slots__ = ("cache", "removed_tokens")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    REMOVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cache: _types_pb2.KvCacheHandle
    removed_tokens: int
    def __init__(self, cache: _Optional[_Union[_types_pb2.KvCacheHandle, _Mapping]] = ..., removed_tokens: _Optional[int] = ...) -> None: ...

class ReleaseCacheRequest(_message.Message):
    __slots__ = ("model_id", "cache_id", "client_step_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    cache_id: str
    client_step_id: str
    def __init__(self, model_id: _Optional[str] = ..., cache_id: _Optional[str] = ..., client_step_id: _Optional[str] = ...) -> None: ...

class ReleaseCacheResponse(_message.Message):
    __slots__ = ("released", "freed_bytes", "freed_tokens")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    released: bool
    freed_bytes: int
    freed_tokens: int
    def __init__(self, released: _Optional[bool] = ..., freed_bytes: _Optional[int] = ..., freed_tokens: _Optional[int] = ...) -> None: ...

class ForkCacheRequest(_message.Message):
    __slots__ = ("model_id", "cache_id", "keep_tokens", "reserve_tokens", "client_step_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESERVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    cache_id: str
    keep_tokens: int
    reserve_tokens: int
    client_step_id: str
    def __init__(self, model_id: _Optional[str] = ..., cache_id: _Optional[str] = ..., keep_tokens: _Optional[int] = ..., reserve_tokens: _Optional[int] = ..., client_step_id: _Optional[str] = ...) -> None: ...

class ForkCacheResponse(_message.Message):
    __slots__ = ("cache", "shared_blocks")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    SHARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    cache: _types_pb2.KvCacheHandle
    shared_blocks: int
    def __init__(self, cache: _Optional[_Union[_types_pb2.KvCacheHandle, _Mapping]] = ..., shared_blocks: _Optional[int] = ...) -> None: ...

class ReserveKvSlotsRequest(_message.Message):
    __slots__ = ("model_id", "requests")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    requests: _containers.RepeatedCompositeFieldContainer[_types_pb2.KvSlotRequest]
    def __init__(self, model_id: _Optional[str] = ..., requests: _Optional[_Iterable[_Union[_types_pb2.KvSlotRequest, _Mapping]]] = ...) -> None: ...

class ReserveKvSlotsResponse(_message.Message):
    __slots__ = ("reservation",)
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    reservation: _types_pb2.KvSlotReservation
    def __init__(self, reservation: _Optional[_Union[_types_pb2.KvSlotReservation, _Mapping]] = ...) -> None: ...

class KvSlotCapacityRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class KvSlotCapacityResponse(_message.Message):
    __slots__ = ("snapshot",)
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    snapshot: _types_pb2.KvSlotCapacitySnapshot
    def __init__(self, snapshot: _Optional[_Union[_types_pb2.KvSlotCapacitySnapshot, _Mapping]] = ...) -> None: ...

class CacheMetricsRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class CacheMetricsResponse(_message.Message):
    __slots__ = ("metrics",)
    METRICS_FIELD_NUMBER: _ClassVar[int]
    metrics: _struct_pb2.Struct
    def __init__(self, metrics: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class LoraMetricsRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class LoraMetricsResponse(_message.Message):
    __slots__ = ("metrics",)
    METRICS_FIELD_NUMBER: _ClassVar[int]
    metrics: _struct_pb2.Struct
    def __init__(self, metrics: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class WarmupRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class WarmupResponse(_message.Message):
    __slots__ = ("model_ids", "duration_ns")
    MODEL_IDS_FIELD_NUMBER: _ClassVar[int]
    DURATION_NS_FIELD_NUMBER: _ClassVar[int]
    model_ids: _containers.RepeatedScalarFieldContainer[str]
    duration_ns: int
    def __init__(self, model_ids: _Optional[_Iterable[str]] = ..., duration_ns: _Optional[int] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class ShutdownResponse(_message.Message):
    __slots__ = ("model_ids", "released_caches")
    MODEL_IDS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_CACHES_FIELD_NUMBER: _ClassVar[int]
    model_ids: _containers.RepeatedScalarFieldContainer[str]
    released_caches: int
    def __init__(self, model_ids: _Optional[_Iterable[str]] = ..., released_caches: _Optional[int] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model_id", "text", "add_special_tokens")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    text: str
    add_special_tokens: bool
    def __init__(self, model_id: _Optional[str] = ..., text: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("model_id", "token_ids", "skip_special_tokens")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, model_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ApplyChatTemplateRequest(_message.Message):
    __slots__ = ("model_id", "messages", "add_generation_prompt")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    def __init__(self, model_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class ApplyChatTemplateResponse(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class StopConditions(_message.Message):
    __slots__ = ("max_tokens", "stop_token_ids", "ignore_eos", "stop_sequences")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    stop_sequences: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., stop_sequences: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model_id", "token_ids", "text", "chat", "cache_id", "last_token_id", "sampling", "stop", "top_logprobs", "keep_cache", "request_id", "stream_text", "cache_salt", "bypass_prefix_cache", "n", "adapter", "resume_token", "speculation", "migration_mode")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KEEP_CACHE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_TEXT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    BYPASS_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_MODE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    token_ids: TokenIds
    text: str
    chat: ChatMessages
    cache_id: str
    last_token_id: int
    sampling: _types_pb2.SamplingParams
    stop: StopConditions
    top_logprobs: int
    keep_cache: bool
    request_id: str
    stream_text: bool
    cache_salt: str
    bypass_prefix_cache: bool
    n: int
    adapter: str
    resume_token: str
    speculation: SpeculationOptions
    migration_mode: MigrationMode
    def __init__(self, model_id: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., cache_id: _Optional[str] = ..., last_token_id: _Optional[int] = ..., sampling: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., stop: _Optional[_Union[StopConditions, _Mapping]] = ..., top_logprobs: _Optional[int] = ..., keep_cache: _Optional[bool] = ..., request_id: _Optional[str] = ..., stream_text: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., bypass_prefix_cache: _Optional[bool] = ..., n: _Optional[int] = ..., adapter: _Optional[str] = ..., resume_token: _Optional[str] = ..., speculation: _Optional[_Union[SpeculationOptions, _Mapping]] = ..., migration_mode: _Optional[_Union[MigrationMode, str]] = ...) -> None: ...

class SpeculationOptions(_message.Message):
    __slots__ = ("disabled", "max_draft_tokens", "min_ngram", "max_ngram")
    DISABLED_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_NGRAM_FIELD_NUMBER: _ClassVar[int]
    MAX_NGRAM_FIELD_NUMBER: _ClassVar[int]
    disabled: bool
    max_draft_tokens: int
    min_ngram: int
    max_ngram: int
    def __init__(self, disabled: _Optional[bool] = ..., max_draft_tokens: _Optional[int] = ..., min_ngram: _Optional[int] = ..., max_ngram: _Optional[int] = ...) -> None: ...

class GenerateStarted(_message.Message):
    __slots__ = ("cache", "prompt_tokens", "request_id", "cached_tokens", "resumed_tokens")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cache: _types_pb2.KvCacheHandle
    prompt_tokens: int
    request_id: str
    cached_tokens: int
    resumed_tokens: int
    def __init__(self, cache: _Optional[_Union[_types_pb2.KvCacheHandle, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., request_id: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., resumed_tokens: _Optional[int] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs", "index", "text", "sample_index")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_types_pb2.TokenLogprob]
    index: int
    text: str
    sample_index: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[_types_pb2.TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ..., text: _Optional[str] = ..., sample_index: _Optional[int] = ...) -> None: ...

class GenerateFinished(_message.Message):
    __slots__ = ("finish_reason", "prompt_tokens", "generated_tokens", "cache", "text", "time_to_first_token_ns", "total_ns", "sample_index", "draft_tokens", "accepted_draft_tokens")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    prompt_tokens: int
    generated_tokens: int
    cache: _types_pb2.KvCacheHandle
    text: str
    time_to_first_token_ns: int
    total_ns: int
    sample_index: int
    draft_tokens: int
    accepted_draft_tokens: int
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., cache: _Optional[_Union[_types_pb2.KvCacheHandle, _Mapping]] = ..., text: _Optional[str] = ..., time_to_first_token_ns: _Optional[int] = ..., total_ns: _Optional[int] = ..., sample_index: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("started", "token", "finished", "migrated")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_FIELD_NUMBER: _ClassVar[int]
    started: GenerateStarted
    token: TokenEvent
    finished: GenerateFinished
    migrated: GenerateMigrated
    def __init__(self, started: _Optional[_Union[GenerateStarted, _Mapping]] = ..., token: _Optional[_Union[TokenEvent, _Mapping]] = ..., finished: _Optional[_Union[GenerateFinished, _Mapping]] = ..., migrated: _Optional[_Union[GenerateMigrated, _Mapping]] = ...) -> None: ...

class GenerateMigrated(_message.Message):
    __slots__ = ("target", "resume_token", "generated_tokens", "resume_deadline_ms")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUME_DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    target: str
    resume_token: str
    generated_tokens: int
    resume_deadline_ms: int
    def __init__(self, target: _Optional[str] = ..., resume_token: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., resume_deadline_ms: _Optional[int] = ...) -> None: ...

class MigrateStreamsRequest(_message.Message):
    __slots__ = ("model_id", "request_id", "target", "drain")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    request_id: str
    target: str
    drain: bool
    def __init__(self, model_id: _Optional[str] = ..., request_id: _Optional[str] = ..., target: _Optional[str] = ..., drain: _Optional[bool] = ...) -> None: ...

class StreamMigration(_message.Message):
    __slots__ = ("request_id", "model_id", "migrated", "error_code", "error_message", "handoff_ms", "precopied_tokens", "paused_tokens", "paused_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_MS_FIELD_NUMBER: _ClassVar[int]
    PRECOPIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAUSED_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    migrated: bool
    error_code: str
    error_message: str
    handoff_ms: int
    precopied_tokens: int
    paused_tokens: int
    paused_bytes: int
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., migrated: _Optional[bool] = ..., error_code: _Optional[str] = ..., error_message: _Optional[str] = ..., handoff_ms: _Optional[int] = ..., precopied_tokens: _Optional[int] = ..., paused_tokens: _Optional[int] = ..., paused_bytes: _Optional[int] = ...) -> None: ...

class MigrateStreamsResponse(_message.Message):
    __slots__ = ("streams", "migrated", "refused")
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    streams: _containers.RepeatedCompositeFieldContainer[StreamMigration]
    migrated: int
    refused: int
    def __init__(self, streams: _Optional[_Iterable[_Union[StreamMigration, _Mapping]]] = ..., migrated: _Optional[int] = ..., refused: _Optional[int] = ...) -> None: ...

class AcceptMigrationRequest(_message.Message):
    __slots__ = ("model_id", "source", "request", "generated_token_ids", "prompt_tokens", "constraint_start", "precopy", "precopy_id", "abandon", "relay")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_START_FIELD_NUMBER: _ClassVar[int]
    PRECOPY_FIELD_NUMBER: _ClassVar[int]
    PRECOPY_ID_FIELD_NUMBER: _ClassVar[int]
    ABANDON_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    source: KvSource
    request: GenerateRequest
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_tokens: int
    constraint_start: int
    precopy: bool
    precopy_id: str
    abandon: bool
    relay: bool
    def __init__(self, model_id: _Optional[str] = ..., source: _Optional[_Union[KvSource, _Mapping]] = ..., request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., prompt_tokens: _Optional[int] = ..., constraint_start: _Optional[int] = ..., precopy: _Optional[bool] = ..., precopy_id: _Optional[str] = ..., abandon: _Optional[bool] = ..., relay: _Optional[bool] = ...) -> None: ...

class AcceptMigrationResponse(_message.Message):
    __slots__ = ("resume_token", "imported_tokens", "resume_deadline_ms", "precopy_id", "imported_bytes")
    RESUME_TOKEN_FIELD_NUMBER: _ClassVar[int]
    IMPORTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUME_DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    PRECOPY_ID_FIELD_NUMBER: _ClassVar[int]
    IMPORTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    resume_token: str
    imported_tokens: int
    resume_deadline_ms: int
    precopy_id: str
    imported_bytes: int
    def __init__(self, resume_token: _Optional[str] = ..., imported_tokens: _Optional[int] = ..., resume_deadline_ms: _Optional[int] = ..., precopy_id: _Optional[str] = ..., imported_bytes: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("step_id", "prefill", "batch_prefill", "decode", "batch_decode", "unified_decode", "forward_verify", "truncate_kv", "release_cache", "fork_cache")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    BATCH_PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    BATCH_DECODE_FIELD_NUMBER: _ClassVar[int]
    UNIFIED_DECODE_FIELD_NUMBER: _ClassVar[int]
    FORWARD_VERIFY_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_KV_FIELD_NUMBER: _ClassVar[int]
    RELEASE_CACHE_FIELD_NUMBER: _ClassVar[int]
    FORK_CACHE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    prefill: PrefillRequest
    batch_prefill: BatchPrefillRequest
    decode: DecodeRequest
    batch_decode: BatchDecodeRequest
    unified_decode: UnifiedDecodeRequest
    forward_verify: ForwardVerifyRequest
    truncate_kv: TruncateKvRequest
    release_cache: ReleaseCacheRequest
    fork_cache: ForkCacheRequest
    def __init__(self, step_id: _Optional[int] = ..., prefill: _Optional[_Union[PrefillRequest, _Mapping]] = ..., batch_prefill: _Optional[_Union[BatchPrefillRequest, _Mapping]] = ..., decode: _Optional[_Union[DecodeRequest, _Mapping]] = ..., batch_decode: _Optional[_Union[BatchDecodeRequest, _Mapping]] = ..., unified_decode: _Optional[_Union[UnifiedDecodeRequest, _Mapping]] = ..., forward_verify: _Optional[_Union[ForwardVerifyRequest, _Mapping]] = ..., truncate_kv: _Optional[_Union[TruncateKvRequest, _Mapping]] = ..., release_cache: _Optional[_Union[ReleaseCacheRequest, _Mapping]] = ..., fork_cache: _Optional[_Union[ForkCacheRequest, _Mapping]] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("step_id", "prefill", "batch_prefill", "decode", "batch_decode", "unified_decode", "forward_verify", "truncate_kv", "release_cache", "fork_cache", "error")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    BATCH_PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    BATCH_DECODE_FIELD_NUMBER: _ClassVar[int]
    UNIFIED_DECODE_FIELD_NUMBER: _ClassVar[int]
    FORWARD_VERIFY_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_KV_FIELD_NUMBER: _ClassVar[int]
    RELEASE_CACHE_FIELD_NUMBER: _ClassVar[int]
    FORK_CACHE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    prefill: PrefillResponse
    batch_prefill: BatchPrefillResponse
    decode: DecodeResponse
    batch_decode: BatchDecodeResponse
    unified_decode: UnifiedDecodeResponse
    forward_verify: ForwardVerifyResponse
    truncate_kv: TruncateKvResponse
    release_cache: ReleaseCacheResponse
    fork_cache: ForkCacheResponse
    error: _types_pb2.StepError
    def __init__(self, step_id: _Optional[int] = ..., prefill: _Optional[_Union[PrefillResponse, _Mapping]] = ..., batch_prefill: _Optional[_Union[BatchPrefillResponse, _Mapping]] = ..., decode: _Optional[_Union[DecodeResponse, _Mapping]] = ..., batch_decode: _Optional[_Union[BatchDecodeResponse, _Mapping]] = ..., unified_decode: _Optional[_Union[UnifiedDecodeResponse, _Mapping]] = ..., forward_verify: _Optional[_Union[ForwardVerifyResponse, _Mapping]] = ..., truncate_kv: _Optional[_Union[TruncateKvResponse, _Mapping]] = ..., release_cache: _Optional[_Union[ReleaseCacheResponse, _Mapping]] = ..., fork_cache: _Optional[_Union[ForkCacheResponse, _Mapping]] = ..., error: _Optional[_Union[_types_pb2.StepError, _Mapping]] = ...) -> None: ...

class LoadsRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class LatencySummary(_message.Message):
    __slots__ = ("p50_ns", "p99_ns", "count")
    P50_NS_FIELD_NUMBER: _ClassVar[int]
    P99_NS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    p50_ns: int
    p99_ns: int
    count: int
    def __init__(self, p50_ns: _Optional[int] = ..., p99_ns: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class ModelLoad(_message.Message):
    __slots__ = ("model_id", "active_caches", "resident_tokens", "free_tokens", "free_blocks", "total_blocks", "block_size", "running_steps", "queued_steps", "active_streams", "prefill_latency", "decode_latency", "reserved_tokens", "evictable_blocks", "cached_blocks", "prefix_hit_tokens", "prefix_queried_tokens", "draining")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_CACHES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_STEPS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_STEPS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_STREAMS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LATENCY_FIELD_NUMBER: _ClassVar[int]
    DECODE_LATENCY_FIELD_NUMBER: _ClassVar[int]
    RESERVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    active_caches: int
    resident_tokens: int
    free_tokens: int
    free_blocks: int
    total_blocks: int
    block_size: int
    running_steps: int
    queued_steps: int
    active_streams: int
    prefill_latency: LatencySummary
    decode_latency: LatencySummary
    reserved_tokens: int
    evictable_blocks: int
    cached_blocks: int
    prefix_hit_tokens: int
    prefix_queried_tokens: int
    draining: bool
    def __init__(self, model_id: _Optional[str] = ..., active_caches: _Optional[int] = ..., resident_tokens: _Optional[int] = ..., free_tokens: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., running_steps: _Optional[int] = ..., queued_steps: _Optional[int] = ..., active_streams: _Optional[int] = ..., prefill_latency: _Optional[_Union[LatencySummary, _Mapping]] = ..., decode_latency: _Optional[_Union[LatencySummary, _Mapping]] = ..., reserved_tokens: _Optional[int] = ..., evictable_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., prefix_queried_tokens: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...

class LoadsResponse(_message.Message):
    __slots__ = ("loads", "kv_event_seq")
    LOADS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    loads: _containers.RepeatedCompositeFieldContainer[ModelLoad]
    kv_event_seq: int
    def __init__(self, loads: _Optional[_Iterable[_Union[ModelLoad, _Mapping]]] = ..., kv_event_seq: _Optional[int] = ...) -> None: ...

class ListCachesRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class ListCachesResponse(_message.Message):
    __slots__ = ("caches", "as_of_seq")
    CACHES_FIELD_NUMBER: _ClassVar[int]
    AS_OF_SEQ_FIELD_NUMBER: _ClassVar[int]
    caches: _containers.RepeatedCompositeFieldContainer[_types_pb2.KvCacheHandle]
    as_of_seq: int
    def __init__(self, caches: _Optional[_Iterable[_Union[_types_pb2.KvCacheHandle, _Mapping]]] = ..., as_of_seq: _Optional[int] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("seq", "kind", "model_id", "cache_id", "num_tokens", "time_unix_ns")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    kind: KvEventKind
    model_id: str
    cache_id: str
    num_tokens: int
    time_unix_ns: int
    def __init__(self, seq: _Optional[int] = ..., kind: _Optional[_Union[KvEventKind, str]] = ..., model_id: _Optional[str] = ..., cache_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., time_unix_ns: _Optional[int] = ...) -> None: ...

class SubscribeKvEventsRequest(_message.Message):
    __slots__ = ("model_id", "from_seq", "include_block_events")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_BLOCK_EVENTS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    from_seq: int
    include_block_events: bool
    def __init__(self, model_id: _Optional[str] = ..., from_seq: _Optional[int] = ..., include_block_events: _Optional[bool] = ...) -> None: ...

class KvBlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "adapter")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    adapter: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., adapter: _Optional[str] = ...) -> None: ...

class KvBlockRemoved(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KvBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvBlockEvent(_message.Message):
    __slots__ = ("seq", "model_id", "time_unix_ns", "stored", "removed", "cleared")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    model_id: str
    time_unix_ns: int
    stored: KvBlockStored
    removed: KvBlockRemoved
    cleared: KvBlocksCleared
    def __init__(self, seq: _Optional[int] = ..., model_id: _Optional[str] = ..., time_unix_ns: _Optional[int] = ..., stored: _Optional[_Union[KvBlockStored, _Mapping]] = ..., removed: _Optional[_Union[KvBlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[KvBlocksCleared, _Mapping]] = ...) -> None: ...

class ResyncRequired(_message.Message):
    __slots__ = ("requested_seq", "oldest_available_seq", "next_seq")
    REQUESTED_SEQ_FIELD_NUMBER: _ClassVar[int]
    OLDEST_AVAILABLE_SEQ_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    requested_seq: int
    oldest_available_seq: int
    next_seq: int
    def __init__(self, requested_seq: _Optional[int] = ..., oldest_available_seq: _Optional[int] = ..., next_seq: _Optional[int] = ...) -> None: ...

class SubscribeKvEventsResponse(_message.Message):
    __slots__ = ("event", "resync_required", "block_event")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    RESYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_EVENT_FIELD_NUMBER: _ClassVar[int]
    event: KvEvent
    resync_required: ResyncRequired
    block_event: KvBlockEvent
    def __init__(self, event: _Optional[_Union[KvEvent, _Mapping]] = ..., resync_required: _Optional[_Union[ResyncRequired, _Mapping]] = ..., block_event: _Optional[_Union[KvBlockEvent, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("model_id", "request_id", "cache_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    request_id: str
    cache_id: str
    def __init__(self, model_id: _Optional[str] = ..., request_id: _Optional[str] = ..., cache_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted_streams", "released_cache")
    ABORTED_STREAMS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_CACHE_FIELD_NUMBER: _ClassVar[int]
    aborted_streams: int
    released_cache: bool
    def __init__(self, aborted_streams: _Optional[int] = ..., released_cache: _Optional[bool] = ...) -> None: ...

class ExportKvRequest(_message.Message):
    __slots__ = ("model_id", "cache_id", "from_token", "to_token", "max_chunk_bytes")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TO_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    cache_id: str
    from_token: int
    to_token: int
    max_chunk_bytes: int
    def __init__(self, model_id: _Optional[str] = ..., cache_id: _Optional[str] = ..., from_token: _Optional[int] = ..., to_token: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class KvTransferHeader(_message.Message):
    __slots__ = ("model_id", "fingerprint", "kv_dtype", "num_layers", "num_kv_heads", "head_dim", "v_head_dim", "token_ids", "positions", "from_token", "to_token", "num_chunks", "total_bytes", "executor", "checksum_algorithm", "state_format", "adapter", "adapter_digest", "caller_supplied")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    V_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    FROM_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TO_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    STATE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CALLER_SUPPLIED_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    fingerprint: str
    kv_dtype: _types_pb2.DataType
    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    from_token: int
    to_token: int
    num_chunks: int
    total_bytes: int
    executor: str
    checksum_algorithm: str
    state_format: str
    adapter: str
    adapter_digest: str
    caller_supplied: bool
    def __init__(self, model_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., kv_dtype: _Optional[_Union[_types_pb2.DataType, str]] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., v_head_dim: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[int]] = ..., from_token: _Optional[int] = ..., to_token: _Optional[int] = ..., num_chunks: _Optional[int] = ..., total_bytes: _Optional[int] = ..., executor: _Optional[str] = ..., checksum_algorithm: _Optional[str] = ..., state_format: _Optional[str] = ..., adapter: _Optional[str] = ..., adapter_digest: _Optional[str] = ..., caller_supplied: _Optional[bool] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("index", "layer", "token_start", "token_end", "key", "value", "checksum")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    index: int
    layer: int
    token_start: int
    token_end: int
    key: bytes
    value: bytes
    checksum: int
    def __init__(self, index: _Optional[int] = ..., layer: _Optional[int] = ..., token_start: _Optional[int] = ..., token_end: _Optional[int] = ..., key: _Optional[bytes] = ..., value: _Optional[bytes] = ..., checksum: _Optional[int] = ...) -> None: ...

class ExportKvResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: KvTransferHeader
    chunk: KvChunk
    def __init__(self, header: _Optional[_Union[KvTransferHeader, _Mapping]] = ..., chunk: _Optional[_Union[KvChunk, _Mapping]] = ...) -> None: ...

class KvSource(_message.Message):
    __slots__ = ("target", "cache_id", "model_id", "from_token", "to_token", "tls", "max_chunk_bytes")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TO_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    target: str
    cache_id: str
    model_id: str
    from_token: int
    to_token: int
    tls: bool
    max_chunk_bytes: int
    def __init__(self, target: _Optional[str] = ..., cache_id: _Optional[str] = ..., model_id: _Optional[str] = ..., from_token: _Optional[int] = ..., to_token: _Optional[int] = ..., tls: _Optional[bool] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class ImportKvRequest(_message.Message):
    __slots__ = ("model_id", "reserve_tokens", "cache_salt", "source", "request_id", "header", "chunk")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    reserve_tokens: int
    cache_salt: str
    source: KvSource
    request_id: str
    header: KvTransferHeader
    chunk: KvChunk
    def __init__(self, model_id: _Optional[str] = ..., reserve_tokens: _Optional[int] = ..., cache_salt: _Optional[str] = ..., source: _Optional[_Union[KvSource, _Mapping]] = ..., request_id: _Optional[str] = ..., header: _Optional[_Union[KvTransferHeader, _Mapping]] = ..., chunk: _Optional[_Union[KvChunk, _Mapping]] = ...) -> None: ...

class ImportKvResponse(_message.Message):
    __slots__ = ("cache", "imported_tokens", "bytes", "chunks", "cached_blocks", "transfer_ns")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    IMPORTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_NS_FIELD_NUMBER: _ClassVar[int]
    cache: _types_pb2.KvCacheHandle
    imported_tokens: int
    bytes: int
    chunks: int
    cached_blocks: int
    transfer_ns: int
    def __init__(self, cache: _Optional[_Union[_types_pb2.KvCacheHandle, _Mapping]] = ..., imported_tokens: _Optional[int] = ..., bytes: _Optional[int] = ..., chunks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., transfer_ns: _Optional[int] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("model_id", "name", "path")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    name: str
    path: str
    def __init__(self, model_id: _Optional[str] = ..., name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("adapter", "loaded", "load_ns")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    LOAD_NS_FIELD_NUMBER: _ClassVar[int]
    adapter: AdapterInfo
    loaded: bool
    load_ns: int
    def __init__(self, adapter: _Optional[_Union[AdapterInfo, _Mapping]] = ..., loaded: _Optional[bool] = ..., load_ns: _Optional[int] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("model_id", "name")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    name: str
    def __init__(self, model_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ("unloaded", "dropped_blocks")
    UNLOADED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    unloaded: bool
    dropped_blocks: int
    def __init__(self, unloaded: _Optional[bool] = ..., dropped_blocks: _Optional[int] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("model_id", "name", "path", "rank", "alpha", "target_modules", "resident", "weight_bytes", "live_caches", "steps", "loaded_unix_ms")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LIVE_CACHES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    LOADED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    name: str
    path: str
    rank: int
    alpha: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    resident: bool
    weight_bytes: int
    live_caches: int
    steps: int
    loaded_unix_ms: int
    def __init__(self, model_id: _Optional[str] = ..., name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., alpha: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ..., resident: _Optional[bool] = ..., weight_bytes: _Optional[int] = ..., live_caches: _Optional[int] = ..., steps: _Optional[int] = ..., loaded_unix_ms: _Optional[int] = ...) -> None: ...
