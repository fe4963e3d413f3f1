from ferrum_client._proto.buf.validate import validate_pb2 as _validate_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_TYPE_UNSPECIFIED: _ClassVar[DataType]
    DATA_TYPE_FP32: _ClassVar[DataType]
    DATA_TYPE_FP16: _ClassVar[DataType]
    DATA_TYPE_BF16: _ClassVar[DataType]
    DATA_TYPE_FP8: _ClassVar[DataType]
    DATA_TYPE_INT32: _ClassVar[DataType]
    DATA_TYPE_INT16: _ClassVar[DataType]
    DATA_TYPE_INT8: _ClassVar[DataType]
    DATA_TYPE_INT4: _ClassVar[DataType]
    DATA_TYPE_UINT32: _ClassVar[DataType]
    DATA_TYPE_UINT16: _ClassVar[DataType]
    DATA_TYPE_UINT8: _ClassVar[DataType]
    DATA_TYPE_UINT4: _ClassVar[DataType]
    DATA_TYPE_BOOL: _ClassVar[DataType]
    DATA_TYPE_INT64: _ClassVar[DataType]

class ModelType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_TYPE_UNSPECIFIED: _ClassVar[ModelType]
    MODEL_TYPE_LLAMA: _ClassVar[ModelType]
    MODEL_TYPE_MISTRAL: _ClassVar[ModelType]
    MODEL_TYPE_QWEN: _ClassVar[ModelType]
    MODEL_TYPE_PHI: _ClassVar[ModelType]
    MODEL_TYPE_GEMMA: _ClassVar[ModelType]
    MODEL_TYPE_CODE: _ClassVar[ModelType]
    MODEL_TYPE_EMBEDDING: _ClassVar[ModelType]
    MODEL_TYPE_CLIP: _ClassVar[ModelType]
    MODEL_TYPE_CUSTOM: _ClassVar[ModelType]

class AttentionType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ATTENTION_TYPE_UNSPECIFIED: _ClassVar[AttentionType]
    ATTENTION_TYPE_MULTI_HEAD: _ClassVar[AttentionType]
    ATTENTION_TYPE_MULTI_QUERY: _ClassVar[AttentionType]
    ATTENTION_TYPE_GROUPED_QUERY: _ClassVar[AttentionType]
    ATTENTION_TYPE_FLASH: _ClassVar[AttentionType]
    ATTENTION_TYPE_PAGED: _ClassVar[AttentionType]
    ATTENTION_TYPE_SLIDING_WINDOW: _ClassVar[AttentionType]

class ExecutorState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXECUTOR_STATE_UNSPECIFIED: _ClassVar[ExecutorState]
    EXECUTOR_STATE_INITIALIZING: _ClassVar[ExecutorState]
    EXECUTOR_STATE_READY: _ClassVar[ExecutorState]
    EXECUTOR_STATE_BUSY: _ClassVar[ExecutorState]
    EXECUTOR_STATE_ERROR: _ClassVar[ExecutorState]
    EXECUTOR_STATE_SHUTDOWN: _ClassVar[ExecutorState]

class OutputMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_MODE_UNSPECIFIED: _ClassVar[OutputMode]
    OUTPUT_MODE_SAMPLED_TOKEN: _ClassVar[OutputMode]
    OUTPUT_MODE_FULL_LOGITS: _ClassVar[OutputMode]
    OUTPUT_MODE_TOP_LOGPROBS: _ClassVar[OutputMode]
    OUTPUT_MODE_NONE: _ClassVar[OutputMode]

class ErrorKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_KIND_UNSPECIFIED: _ClassVar[ErrorKind]
    ERROR_KIND_CONFIG: _ClassVar[ErrorKind]
    ERROR_KIND_MODEL: _ClassVar[ErrorKind]
    ERROR_KIND_TOKENIZER: _ClassVar[ErrorKind]
    ERROR_KIND_BACKEND: _ClassVar[ErrorKind]
    ERROR_KIND_DEVICE: _ClassVar[ErrorKind]
    ERROR_KIND_SCHEDULER: _ClassVar[ErrorKind]
    ERROR_KIND_REQUEST_VALIDATION: _ClassVar[ErrorKind]
    ERROR_KIND_RESOURCE_EXHAUSTED: _ClassVar[ErrorKind]
    ERROR_KIND_TIMEOUT: _ClassVar[ErrorKind]
    ERROR_KIND_AUTH: _ClassVar[ErrorKind]
    ERROR_KIND_RATE_LIMIT: _ClassVar[ErrorKind]
    ERROR_KIND_IO: _ClassVar[ErrorKind]
    ERROR_KIND_SERIALIZATION: _ClassVar[ErrorKind]
    ERROR_KIND_NETWORK: _ClassVar[ErrorKind]
    ERROR_KIND_INTERNAL: _ClassVar[ErrorKind]
    ERROR_KIND_CANCELLED: _ClassVar[ErrorKind]
    ERROR_KIND_NOT_FOUND: _ClassVar[ErrorKind]
    ERROR_KIND_ALREADY_EXISTS: _ClassVar[ErrorKind]
    ERROR_KIND_PERMISSION_DENIED: _ClassVar[ErrorKind]
    ERROR_KIND_UNSUPPORTED: _ClassVar[ErrorKind]
    ERROR_KIND_INVALID_FORMAT: _ClassVar[ErrorKind]
    ERROR_KIND_INVALID_PARAMETER: _ClassVar[ErrorKind]
    ERROR_KIND_UNAVAILABLE: _ClassVar[ErrorKind]

class ItemState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ITEM_STATE_UNSPECIFIED: _ClassVar[ItemState]
    ITEM_STATE_RAN: _ClassVar[ItemState]
    ITEM_STATE_NOT_RUN: _ClassVar[ItemState]
    ITEM_STATE_RAN_PARTIAL: _ClassVar[ItemState]
DATA_TYPE_UNSPECIFIED: DataType
DATA_TYPE_FP32: DataType
DATA_TYPE_FP16: DataType
DATA_TYPE_BF16: DataType
DATA_TYPE_FP8: DataType
DATA_TYPE_INT32: DataType
DATA_TYPE_INT16: DataType
DATA_TYPE_INT8: DataType
DATA_TYPE_INT4: DataType
DATA_TYPE_UINT32: DataType
DATA_TYPE_UINT16: DataType
DATA_TYPE_UINT8: DataType
DATA_TYPE_UINT4: DataType
DATA_TYPE_BOOL: DataType
DATA_TYPE_INT64: DataType
MODEL_TYPE_UNSPECIFIED: ModelType
MODEL_TYPE_LLAMA: ModelType
MODEL_TYPE_MISTRAL: ModelType
MODEL_TYPE_QWEN: ModelType
MODEL_TYPE_PHI: ModelType
MODEL_TYPE_GEMMA: ModelType
MODEL_TYPE_CODE: ModelType
MODEL_TYPE_EMBEDDING: ModelType
MODEL_TYPE_CLIP: ModelType
MODEL_TYPE_CUSTOM: ModelType
ATTENTION_TYPE_UNSPECIFIED: AttentionType
ATTENTION_TYPE_MULTI_HEAD: AttentionType
ATTENTION_TYPE_MULTI_QUERY: AttentionType
ATTENTION_TYPE_GROUPED_QUERY: AttentionType
ATTENTION_TYPE_FLASH: AttentionType
ATTENTION_TYPE_PAGED: AttentionType
ATTENTION_TYPE_SLIDING_WINDOW: AttentionType
EXECUTOR_STATE_UNSPECIFIED: ExecutorState
EXECUTOR_STATE_INITIALIZING: ExecutorState
EXECUTOR_STATE_READY: ExecutorState
EXECUTOR_STATE_BUSY: ExecutorState
EXECUTOR_STATE_ERROR: ExecutorState
EXECUTOR_STATE_SHUTDOWN: ExecutorState
OUTPUT_MODE_UNSPECIFIED: OutputMode
OUTPUT_MODE_SAMPLED_TOKEN: OutputMode
OUTPUT_MODE_FULL_LOGITS: OutputMode
OUTPUT_MODE_TOP_LOGPROBS: OutputMode
OUTPUT_MODE_NONE: OutputMode
ERROR_KIND_UNSPECIFIED: ErrorKind
ERROR_KIND_CONFIG: ErrorKind
ERROR_KIND_MODEL: ErrorKind
ERROR_KIND_TOKENIZER: ErrorKind
ERROR_KIND_BACKEND: ErrorKind
ERROR_KIND_DEVICE: ErrorKind
ERROR_KIND_SCHEDULER: ErrorKind
ERROR_KIND_REQUEST_VALIDATION: ErrorKind
ERROR_KIND_RESOURCE_EXHAUSTED: ErrorKind
ERROR_KIND_TIMEOUT: ErrorKind
ERROR_KIND_AUTH: ErrorKind
ERROR_KIND_RATE_LIMIT: ErrorKind
ERROR_KIND_IO: ErrorKind
ERROR_KIND_SERIALIZATION: ErrorKind
ERROR_KIND_NETWORK: ErrorKind
ERROR_KIND_INTERNAL: ErrorKind
ERROR_KIND_CANCELLED: ErrorKind
ERROR_KIND_NOT_FOUND: ErrorKind
ERROR_KIND_ALREADY_EXISTS: ErrorKind
ERROR_KIND_PERMISSION_DENIED: ErrorKind
ERROR_KIND_UNSUPPORTED: ErrorKind
ERROR_KIND_INVALID_FORMAT: ErrorKind
ERROR_KIND_INVALID_PARAMETER: ErrorKind
ERROR_KIND_UNAVAILABLE: ErrorKind
ITEM_STATE_UNSPECIFIED: ItemState
ITEM_STATE_RAN: ItemState
ITEM_STATE_NOT_RUN: ItemState
ITEM_STATE_RAN_PARTIAL: ItemState

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DataType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DataType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "model_type", "model_type_detail", "num_parameters", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size", "max_sequence_length", "dtype", "device", "version", "license", "metadata", "head_dim", "executor", "eos_token_ids", "has_tokenizer", "has_chat_template", "prefix_cache")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_DETAIL_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LICENSE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    model_type: ModelType
    model_type_detail: str
    num_parameters: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    max_sequence_length: int
    dtype: DataType
    device: str
    version: str
    license: str
    metadata: _struct_pb2.Struct
    head_dim: int
    executor: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_tokenizer: bool
    has_chat_template: bool
    prefix_cache: PrefixCacheRecipe
    def __init__(self, model_id: _Optional[str] = ..., model_type: _Optional[_Union[ModelType, str]] = ..., model_type_detail: _Optional[str] = ..., num_parameters: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_sequence_length: _Optional[int] = ..., dtype: _Optional[_Union[DataType, str]] = ..., device: _Optional[str] = ..., version: _Optional[str] = ..., license: _Optional[str] = ..., metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., head_dim: _Optional[int] = ..., executor: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., has_tokenizer: _Optional[bool] = ..., has_chat_template: _Optional[bool] = ..., prefix_cache: _Optional[_Union[PrefixCacheRecipe, _Mapping]] = ...) -> None: ...

class PrefixCacheRecipe(_message.Message):
    __slots__ = ("enabled", "algorithm", "block_size", "seed", "extra_keys")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    algorithm: str
    block_size: int
    seed: str
    extra_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, enabled: _Optional[bool] = ..., algorithm: _Optional[str] = ..., block_size: _Optional[int] = ..., seed: _Optional[str] = ..., extra_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class MemoryRequirements(_message.Message):
    __slots__ = ("parameter_memory_bytes", "activation_memory_per_token_bytes", "kv_cache_memory_per_token_bytes", "overhead_memory_bytes")
    PARAMETER_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_MEMORY_PER_TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_MEMORY_PER_TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    parameter_memory_bytes: int
    activation_memory_per_token_bytes: int
    kv_cache_memory_per_token_bytes: int
    overhead_memory_bytes: int
    def __init__(self, parameter_memory_bytes: _Optional[int] = ..., activation_memory_per_token_bytes: _Optional[int] = ..., kv_cache_memory_per_token_bytes: _Optional[int] = ..., overhead_memory_bytes: _Optional[int] = ...) -> None: ...

class ExecutorCapabilities(_message.Message):
    __slots__ = ("max_batch_size", "max_sequence_length", "attention_mechanisms", "supports_dynamic_batching", "supports_continuous_batching", "supports_speculative_decoding", "supports_tensor_parallelism", "supports_pipeline_parallelism", "supported_dtypes", "supported_devices", "memory_requirements", "supports_native_unified_decode", "supports_generation", "supports_embeddings", "supports_forward", "supports_kv_truncation", "supports_native_forward_verify", "kv_block_size", "supports_prefix_caching", "supports_fork", "supports_kv_transfer", "supports_lora", "max_adapters")
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_MECHANISMS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_DYNAMIC_BATCHING_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_CONTINUOUS_BATCHING_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_SPECULATIVE_DECODING_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_TENSOR_PARALLELISM_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_PIPELINE_PARALLELISM_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_DTYPES_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_DEVICES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_REQUIREMENTS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_NATIVE_UNIFIED_DECODE_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_GENERATION_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_FORWARD_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_KV_TRUNCATION_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_NATIVE_FORWARD_VERIFY_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_FORK_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_LORA_FIELD_NUMBER: _ClassVar[int]
    MAX_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    max_batch_size: int
    max_sequence_length: int
    attention_mechanisms: _containers.RepeatedScalarFieldContainer[AttentionType]
    supports_dynamic_batching: bool
    supports_continuous_batching: bool
    supports_speculative_decoding: bool
    supports_tensor_parallelism: bool
    supports_pipeline_parallelism: bool
    supported_dtypes: _containers.RepeatedScalarFieldContainer[DataType]
    supported_devices: _containers.RepeatedScalarFieldContainer[str]
    memory_requirements: MemoryRequirements
    supports_native_unified_decode: bool
    supports_generation: bool
    supports_embeddings: bool
    supports_forward: bool
    supports_kv_truncation: bool
    supports_native_forward_verify: bool
    kv_block_size: int
    supports_prefix_caching: bool
    supports_fork: bool
    supports_kv_transfer: bool
    supports_lora: bool
    max_adapters: int
    def __init__(self, max_batch_size: _Optional[int] = ..., max_sequence_length: _Optional[int] = ..., attention_mechanisms: _Optional[_Iterable[_Union[AttentionType, str]]] = ..., supports_dynamic_batching: _Optional[bool] = ..., supports_continuous_batching: _Optional[bool] = ..., supports_speculative_decoding: _Optional[bool] = ..., supports_tensor_parallelism: _Optional[bool] = ..., supports_pipeline_parallelism: _Optional[bool] = ..., supported_dtypes: _Optional[_Iterable[_Union[DataType, str]]] = ..., supported_devices: _Optional[_Iterable[str]] = ..., memory_requirements: _Optional[_Union[MemoryRequirements, _Mapping]] = ..., supports_native_unified_decode: _Optional[bool] = ..., supports_generation: _Optional[bool] = ..., supports_embeddings: _Optional[bool] = ..., supports_forward: _Optional[bool] = ..., supports_kv_truncation: _Optional[bool] = ..., supports_native_forward_verify: _Optional[bool] = ..., kv_block_size: _Optional[int] = ..., supports_prefix_caching: _Optional[bool] = ..., supports_fork: _Optional[bool] = ..., supports_kv_transfer: _Optional[bool] = ..., supports_lora: _Optional[bool] = ..., max_adapters: _Optional[int] = ...) -> None: ...

class ExecutorMemoryUsage(_message.Message):
    __slots__ = ("allocated_bytes", "used_bytes", "peak_bytes", "utilization_percent")
    ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    allocated_bytes: int
    used_bytes: int
    peak_bytes: int
    utilization_percent: float
    def __init__(self, allocated_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., peak_bytes: _Optional[int] = ..., utilization_percent: _Optional[float] = ...) -> None: ...

class ExecutorStatus(_message.Message):
    __slots__ = ("state", "is_ready", "current_batch_size", "prefill_operations", "decode_operations", "avg_prefill_time_ms", "avg_decode_time_ms", "memory_usage", "ns_since_last_operation", "active_caches")
    STATE_FIELD_NUMBER: _ClassVar[int]
    IS_READY_FIELD_NUMBER: _ClassVar[int]
    CURRENT_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_OPERATIONS_FIELD_NUMBER: _ClassVar[int]
    DECODE_OPERATIONS_FIELD_NUMBER: _ClassVar[int]
    AVG_PREFILL_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    AVG_DECODE_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USAGE_FIELD_NUMBER: _ClassVar[int]
    NS_SINCE_LAST_OPERATION_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_CACHES_FIELD_NUMBER: _ClassVar[int]
    state: ExecutorState
    is_ready: bool
    current_batch_size: int
    prefill_operations: int
    decode_operations: int
    avg_prefill_time_ms: float
    avg_decode_time_ms: float
    memory_usage: ExecutorMemoryUsage
    ns_since_last_operation: int
    active_caches: int
    def __init__(self, state: _Optional[_Union[ExecutorState, str]] = ..., is_ready: _Optional[bool] = ..., current_batch_size: _Optional[int] = ..., prefill_operations: _Optional[int] = ..., decode_operations: _Optional[int] = ..., avg_prefill_time_ms: _Optional[float] = ..., avg_decode_time_ms: _Optional[float] = ..., memory_usage: _Optional[_Union[ExecutorMemoryUsage, _Mapping]] = ..., ns_since_last_operation: _Optional[int] = ..., active_caches: _Optional[int] = ...) -> None: ...

class ExecutorMetrics(_message.Message):
    __slots__ = ("total_operations", "prefill_operations", "decode_operations", "avg_prefill_latency_ms", "avg_decode_latency_ms", "p95_prefill_latency_ms", "p95_decode_latency_ms", "throughput_tps", "memory_efficiency", "batch_utilization")
    TOTAL_OPERATIONS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_OPERATIONS_FIELD_NUMBER: _ClassVar[int]
    DECODE_OPERATIONS_FIELD_NUMBER: _ClassVar[int]
    AVG_PREFILL_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    AVG_DECODE_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    P95_PREFILL_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    P95_DECODE_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_TPS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_EFFICIENCY_FIELD_NUMBER: _ClassVar[int]
    BATCH_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    total_operations: int
    prefill_operations: int
    decode_operations: int
    avg_prefill_latency_ms: float
    avg_decode_latency_ms: float
    p95_prefill_latency_ms: float
    p95_decode_latency_ms: float
    throughput_tps: float
    memory_efficiency: float
    batch_utilization: float
    def __init__(self, total_operations: _Optional[int] = ..., prefill_operations: _Optional[int] = ..., decode_operations: _Optional[int] = ..., avg_prefill_latency_ms: _Optional[float] = ..., avg_decode_latency_ms: _Optional[float] = ..., p95_prefill_latency_ms: _Optional[float] = ..., p95_decode_latency_ms: _Optional[float] = ..., throughput_tps: _Optional[float] = ..., memory_efficiency: _Optional[float] = ..., batch_utilization: _Optional[float] = ...) -> None: ...

class KvCacheHandle(_message.Message):
    __slots__ = ("cache_id", "model_id", "num_tokens", "block_size", "num_blocks", "block_ids", "memory_bytes", "num_layers", "num_kv_heads", "head_dim", "adapter")
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    model_id: str
    num_tokens: int
    block_size: int
    num_blocks: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    memory_bytes: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    adapter: str
    def __init__(self, cache_id: _Optional[str] = ..., model_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., memory_bytes: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., adapter: _Optional[str] = ...) -> None: ...

class KvCapacity(_message.Message):
    __slots__ = ("per_request_tokens", "total_tokens", "used_tokens", "free_tokens", "reserved_tokens", "total_bytes", "used_bytes", "bytes_per_token", "block_size", "total_blocks", "free_blocks", "evictable_blocks", "cached_blocks")
    PER_REQUEST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    per_request_tokens: int
    total_tokens: int
    used_tokens: int
    free_tokens: int
    reserved_tokens: int
    total_bytes: int
    used_bytes: int
    bytes_per_token: int
    block_size: int
    total_blocks: int
    free_blocks: int
    evictable_blocks: int
    cached_blocks: int
    def __init__(self, per_request_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., used_tokens: _Optional[int] = ..., free_tokens: _Optional[int] = ..., reserved_tokens: _Optional[int] = ..., total_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., bytes_per_token: _Optional[int] = ..., block_size: _Optional[int] = ..., total_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., evictable_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ...) -> None: ...

class ExecutorAdmissionLimits(_message.Message):
    __slots__ = ("maximum_active_sequences", "maximum_scheduled_tokens")
    MAXIMUM_ACTIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAXIMUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    maximum_active_sequences: int
    maximum_scheduled_tokens: int
    def __init__(self, maximum_active_sequences: _Optional[int] = ..., maximum_scheduled_tokens: _Optional[int] = ...) -> None: ...

class KvSlotRequest(_message.Message):
    __slots__ = ("cache_id", "target_len", "admission_target_len", "new_sequence")
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_LEN_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_TARGET_LEN_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    target_len: int
    admission_target_len: int
    new_sequence: bool
    def __init__(self, cache_id: _Optional[str] = ..., target_len: _Optional[int] = ..., admission_target_len: _Optional[int] = ..., new_sequence: _Optional[bool] = ...) -> None: ...

class KvSlotAllocation(_message.Message):
    __slots__ = ("cache_id", "blocks_before", "blocks_after", "new_blocks", "created_cache_id")
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_AFTER_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CREATED_CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    blocks_before: int
    blocks_after: int
    new_blocks: int
    created_cache_id: str
    def __init__(self, cache_id: _Optional[str] = ..., blocks_before: _Optional[int] = ..., blocks_after: _Optional[int] = ..., new_blocks: _Optional[int] = ..., created_cache_id: _Optional[str] = ...) -> None: ...

class KvSlotReservation(_message.Message):
    __slots__ = ("block_size", "total_blocks", "free_blocks_before", "free_blocks_after", "allocations")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_AFTER_FIELD_NUMBER: _ClassVar[int]
    ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    total_blocks: int
    free_blocks_before: int
    free_blocks_after: int
    allocations: _containers.RepeatedCompositeFieldContainer[KvSlotAllocation]
    def __init__(self, block_size: _Optional[int] = ..., total_blocks: _Optional[int] = ..., free_blocks_before: _Optional[int] = ..., free_blocks_after: _Optional[int] = ..., allocations: _Optional[_Iterable[_Union[KvSlotAllocation, _Mapping]]] = ...) -> None: ...

class KvSlotCapacitySnapshot(_message.Message):
    __slots__ = ("block_size", "total_blocks", "free_blocks")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    total_blocks: int
    free_blocks: int
    def __init__(self, block_size: _Optional[int] = ..., total_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "penalty_token_ids", "seed", "token_mask", "constraint")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PENALTY_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MASK_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    penalty_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    token_mask: bytes
    constraint: OutputConstraint
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., penalty_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., token_mask: _Optional[bytes] = ..., constraint: _Optional[_Union[OutputConstraint, _Mapping]] = ...) -> None: ...

class OutputConstraint(_message.Message):
    __slots__ = ("json_schema", "regex", "ebnf_grammar", "choice", "lark_grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    EBNF_GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    LARK_GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    regex: str
    ebnf_grammar: str
    choice: ChoiceList
    lark_grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., ebnf_grammar: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., lark_grammar: _Optional[str] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class LogitsPolicy(_message.Message):
    __slots__ = ("mode", "sampling", "top_logprobs", "logits_dtype")
    MODE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGITS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    mode: OutputMode
    sampling: SamplingParams
    top_logprobs: int
    logits_dtype: DataType
    def __init__(self, mode: _Optional[_Union[OutputMode, str]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., top_logprobs: _Optional[int] = ..., logits_dtype: _Optional[_Union[DataType, str]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class LogitsOutput(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs", "logits", "no_selectable_finite_logit")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    NO_SELECTABLE_FINITE_LOGIT_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    logits: Tensor
    no_selectable_finite_logit: bool
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., logits: _Optional[_Union[Tensor, _Mapping]] = ..., no_selectable_finite_logit: _Optional[bool] = ...) -> None: ...

class StepTimings(_message.Message):
    __slots__ = ("queued_ns", "forward_ns", "sampling_ns", "total_ns")
    QUEUED_NS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    queued_ns: int
    forward_ns: int
    sampling_ns: int
    total_ns: int
    def __init__(self, queued_ns: _Optional[int] = ..., forward_ns: _Optional[int] = ..., sampling_ns: _Optional[int] = ..., total_ns: _Optional[int] = ...) -> None: ...

class StepProgress(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ItemProgress]
    def __init__(self, items: _Optional[_Iterable[_Union[ItemProgress, _Mapping]]] = ...) -> None: ...

class ItemProgress(_message.Message):
    __slots__ = ("index", "state", "tokens_ran", "reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_RAN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    state: ItemState
    tokens_ran: int
    reason: str
    def __init__(self, index: _Optional[int] = ..., state: _Optional[_Union[ItemState, str]] = ..., tokens_ran: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("code", "message", "kind", "field", "metadata", "retry_after_ms", "progress")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    kind: ErrorKind
    field: str
    metadata: _containers.ScalarMap[str, str]
    retry_after_ms: int
    progress: StepProgress
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., kind: _Optional[_Union[ErrorKind, str]] = ..., field: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., retry_after_ms: _Optional[int] = ..., progress: _Optional[_Union[StepProgress, _Mapping]] = ...) -> None: ...
