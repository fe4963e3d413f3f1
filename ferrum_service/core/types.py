"""Python-side types of the executor interface (mirrors ferrum's ``ModelExecutor`` types).

Executors speak these dataclasses, never protobuf: ``convert.py`` translates between the two, so an
executor can be called in-process (benchmarks, tests) exactly as the server calls it.

Logits are rows of the executor's own kind (:data:`Rows`): ``torch.Tensor`` on the executor's device
for the torch executors, ``numpy.ndarray`` for the stub, configurable and llama.cpp executors (which
run without torch); ``sampling.py`` turns them into what each request's :class:`LogitsPolicy` asks for.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .modes import ExecutorState

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np
    import torch

    Rows = torch.Tensor | np.ndarray  # a logits row [V] or block [N, V], or an embedding [hidden]


class OutputMode(enum.IntEnum):
    """Mirrors the proto's ``OutputMode``."""

    SAMPLED_TOKEN = 1
    FULL_LOGITS = 2
    TOP_LOGPROBS = 3
    NONE = 4


@dataclass(frozen=True)
class ConstraintSpec:
    """A structured-output constraint (``OutputConstraint``): ``kind`` json_schema | regex |
    ebnf_grammar | lark_grammar (``text``) or choice (``choices``)."""

    kind: str
    text: str = ""
    choices: tuple[str, ...] = ()


@dataclass
class SamplingParams:
    """Server-side sampling. All defaults = greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # None = the cache's whole history. From a request: the sorted distinct ids as an int64 array,
    # made once (convert.penalty_token_ids), so a step never sorts them again.
    penalty_token_ids: np.ndarray | Sequence[int] | None = None
    seed: int | None = None
    token_mask: bytes | None = None  # one byte per token id; non-zero = allowed
    constraint: ConstraintSpec | None = None  # structured output (see guided.py)
    compiled: Any = field(default=None, compare=False, repr=False)  # the constraint, compiled for the model

    @property
    def is_plain_greedy(self) -> bool:
        return self.temperature == 0.0 and self.repetition_penalty == 1.0 and not self.token_mask


@dataclass
class LogitsPolicy:
    """What a step returns per logits row."""

    mode: OutputMode = OutputMode.SAMPLED_TOKEN
    sampling: SamplingParams = field(default_factory=SamplingParams)
    top_logprobs: int = 0
    logits_dtype: str = "fp32"  # fp32 | fp16 | bf16

    @property
    def needs_logits(self) -> bool:
        return self.mode != OutputMode.NONE


@dataclass
class CacheHandle:
    """A snapshot of a server-side KV cache (the proto's ``KvCacheHandle``)."""

    cache_id: str
    model_id: str
    num_tokens: int
    block_size: int = 16
    num_blocks: int = 0
    block_ids: list[int] = field(default_factory=list)
    memory_bytes: int = 0
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    adapter: str = ""  # the LoRA adapter the cache is bound to


@dataclass
class PrefillInput:
    """One prompt, or one chunk of one (``cache_id`` set = continue that cache)."""

    token_ids: list[int]
    cache_id: str = ""
    policy: LogitsPolicy = field(default_factory=LogitsPolicy)
    reserve_tokens: int = 0
    all_positions: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    request_id: str = ""
    cache_salt: str = ""  # prefix caching: only caches with the same salt share blocks
    bypass_prefix_cache: bool = False
    adapter: str = ""  # LoRA adapter: a new cache's, or (continuing) "" or the cache's own


@dataclass
class PrefillOutput:
    """``logits``: last-position row [V]; ``all_logits``: [S, V] when all positions were asked;
    ``embedding``: [hidden] for encoders."""

    cache: CacheHandle
    logits: Rows | None = None
    all_logits: Rows | None = None
    embedding: Rows | None = None
    cached_tokens: int = 0  # leading prompt tokens taken from the prefix cache


@dataclass
class DecodeInput:
    cache_id: str
    token_id: int
    policy: LogitsPolicy = field(default_factory=LogitsPolicy)
    position: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    # Server-side speculation (``speculation.py``): draft tokens fed after ``token_id`` in the same
    # row; the output's logits are then ``[1 + len(draft), V]``, row i the output after token i.
    draft: list[int] = field(default_factory=list)


@dataclass
class DecodeOutput:
    cache: CacheHandle
    logits: Rows | None = None  # [V]


@dataclass
class UnifiedItem:
    seq_id: str
    q_tokens: list[int]
    cache_id: str = ""
    pos_offset: int = 0
    is_final_chunk: bool = True
    policy: LogitsPolicy = field(default_factory=LogitsPolicy)
    metadata: dict[str, Any] = field(default_factory=dict)
    cache_salt: str = ""
    bypass_prefix_cache: bool = False
    adapter: str = ""


@dataclass
class UnifiedResult:
    seq_id: str
    cache: CacheHandle
    logits: Rows | None = None  # [V], present iff the item was final
    cached_tokens: int = 0


@dataclass
class VerifyOutput:
    """``rows``: [N+1, V]; ``cache``: after all N+1 tokens; ``base_len``: length before."""

    rows: Rows
    cache: CacheHandle
    base_len: int


@dataclass
class ModelInfo:
    model_id: str
    model_type: str = "custom"  # llama | mistral | qwen | phi | gemma | code | embedding | clip | custom
    model_type_detail: str = ""
    num_parameters: int = 0
    hidden_size: int = 0
    num_layers: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    vocab_size: int = 0
    max_sequence_length: int = 0
    dtype: str = "fp32"
    device: str = "cpu"
    version: str = ""
    license: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    head_dim: int = 0
    executor: str = ""
    eos_token_ids: list[int] = field(default_factory=list)
    has_tokenizer: bool = False
    has_chat_template: bool = False
    prefix_cache: dict[str, Any] | None = None  # the PrefixCacheRecipe, when the executor caches prefixes


@dataclass
class MemoryRequirements:
    parameter_memory_bytes: int = 0
    activation_memory_per_token_bytes: int = 0
    kv_cache_memory_per_token_bytes: int = 0
    overhead_memory_bytes: int = 0


@dataclass
class ExecutorCapabilities:
    max_batch_size: int = 0
    max_sequence_length: int = 0
    attention_mechanisms: list[str] = field(default_factory=lambda: ["multi_head"])
    supports_dynamic_batching: bool = False
    supports_continuous_batching: bool = False
    supports_speculative_decoding: bool = False
    supports_tensor_parallelism: bool = False
    supports_pipeline_parallelism: bool = False
    supported_dtypes: list[str] = field(default_factory=lambda: ["fp32"])
    supported_devices: list[str] = field(default_factory=lambda: ["cpu"])
    memory_requirements: MemoryRequirements = field(default_factory=MemoryRequirements)
    supports_native_unified_decode: bool = False
    supports_generation: bool = True
    supports_embeddings: bool = False
    supports_forward: bool = False
    supports_kv_truncation: bool = False
    supports_native_forward_verify: bool = False
    kv_block_size: int = 16
    supports_prefix_caching: bool = False
    supports_fork: bool = False
    supports_kv_transfer: bool = False
    supports_lora: bool = False
    max_adapters: int = 0


@dataclass
class ExecutorMemoryUsage:
    allocated_bytes: int = 0
    used_bytes: int = 0
    peak_bytes: int = 0
    utilization_percent: float = 0.0


@dataclass
class ExecutorStatus:
    state: ExecutorState = ExecutorState.READY
    is_ready: bool = True
    current_batch_size: int = 0
    prefill_operations: int = 0
    decode_operations: int = 0
    avg_prefill_time_ms: float = 0.0
    avg_decode_time_ms: float = 0.0
    memory_usage: ExecutorMemoryUsage = field(default_factory=ExecutorMemoryUsage)
    ns_since_last_operation: int | None = None
    active_caches: int = 0


@dataclass
class KvCapacity:
    per_request_tokens: int | None = None
    total_tokens: int = 0
    used_tokens: int = 0
    free_tokens: int = 0
    reserved_tokens: int = 0
    total_bytes: int = 0
    used_bytes: int = 0
    bytes_per_token: int = 0
    # paged executors: the block pool itself (see the proto's KvCapacity)
    block_size: int = 0
    total_blocks: int = 0
    free_blocks: int = 0
    evictable_blocks: int = 0
    cached_blocks: int = 0


@dataclass
class AdmissionLimits:
    maximum_active_sequences: int
    maximum_scheduled_tokens: int


@dataclass
class KvSlotRequest:
    cache_id: str
    target_len: int
    admission_target_len: int | None = None
    # True: ``cache_id`` is the caller's name for a sequence with no cache yet; the executor
    # creates an empty cache holding the reservation (``KvSlotAllocation.created_cache_id``).
    new_sequence: bool = False
    # The prefix-cache salt a new sequence's blocks are keyed under (the caller's key space).
    salt: str = ""


@dataclass
class KvSlotAllocation:
    cache_id: str
    blocks_before: int
    blocks_after: int
    new_blocks: int
    created_cache_id: str = ""  # the cache made for a ``new_sequence`` request


@dataclass
class KvSlotReservation:
    block_size: int
    total_blocks: int
    free_blocks_before: int
    free_blocks_after: int
    allocations: list[KvSlotAllocation] = field(default_factory=list)


@dataclass
class KvSlotCapacitySnapshot:
    block_size: int
    total_blocks: int
    free_blocks: int


@dataclass
class StepCost:
    """What one forward costs beyond the weights and the KV cache (see ``ModelExecutor.step_cost``)."""

    positions: int  # token positions computed, padding included
    scratch_bytes: int = 0  # transient memory: attention masks, activations, logits
