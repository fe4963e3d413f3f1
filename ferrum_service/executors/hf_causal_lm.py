"""``HfCausalLmExecutor``: any transformers ``AutoModelForCausalLM`` with real, paged KV caches.

What it does
------------
Loads a local checkpoint directory (safetensors + config + tokenizer) or a GGUF file, and serves
ferrum's ``ModelExecutor`` methods with per-sequence KV caches that the executor owns and the
:class:`~ferrum_service.kv_registry.CacheRegistry` names. Every batched method is **one forward**:
``batch_prefill``, ``batch_decode``, ``unified_decode`` (prefill chunks and decode steps mixed) and
``forward_verify`` (N+1 tokens of one sequence) each call the model once.

KV layout, and why
------------------
A paged block pool (:mod:`.paged_kv`): per layer one K and one V tensor
``[num_blocks + 1, block_size, kv_heads, head_dim]`` sized to the configured KV budget, and a block
table (list of block ids) per cache in the registry payload. No per-sequence tensor is ever
allocated or grown (``DynamicCache.update`` ``torch.cat``-s the whole cache on every step); no
caches are left-padded and merged into a batch cache; truncation and release are metadata
operations (blocks go back to the free list).

What one step reads and writes
------------------------------
A step is one forward over rows (each: a cache, its ``past`` tokens, ``n`` new tokens).

* **Packed step** (any mix: decodes, prompt chunks continuing a cache, verify rows, new prompts of
  different lengths). The rows' new tokens are concatenated into one ``[1, T]`` input, ``T`` =
  the step's real tokens (no padding), with per-token RoPE positions. Per layer:

  - written: the ``T`` new tokens' K and V, into their slots (``index_copy_``,
    :class:`~.paged_kv.PagedWriteCache`);
  - read: each row's own ``past + n`` tokens of K/V from the pool, in place (a strided view of
    its blocks when they form one contiguous run of ids, as a prompt's do; otherwise its own
    blocks are copied once per layer into a buffer of exactly those blocks; decodes of similar
    lengths, within 25 % padding, share one batched call over a copy of their own blocks). A fresh row reads
    nothing from the pool (its new K/V are its whole context). Nothing is padded to the longest
    row of the step, no ``[B, Q, KV]`` mask is built, grouped K/V heads are not expanded
    (:mod:`.packed_attention`: per-row SDPA, one-token rows fold the query heads of a K/V head
    into the query length, longer rows use ``enable_gqa``).

  Compute is the step's ``T`` tokens through the MLPs and projections, plus each row's own
  ``n x (past + n)`` attention: a prompt joining decodes costs its own length.
* **Fast path** (every row a fresh prompt of the same length, e.g. a single prefill): a
  ``[B, Q]`` batch through the model's own attention (``sdpa``: the plain causal kernel); writes
  the new K/V to the pool and reads nothing from it.

The attention function is registered in transformers' attention interface, and the model's
``config._attn_implementation`` points at it; outside the executor's packed steps it delegates to
the model's original implementation, so the model stays a plain transformers model (a plain
``model(...)`` or ``generate()`` behaves as before). On CUDA the same step layout (row starts =
``cu_seqlens``, block tables, context lengths, slots) is what paged varlen kernels take
(flash-attn ``block_table``, FlashInfer / vLLM paged attention); see :mod:`.packed_attention`.

Memory: the pool holds exactly ``2 · layers · kv_heads · head_dim · dtype_bytes`` per token slot
(K and V, nothing else), plus one zero null block; a cache holds ``ceil(max(tokens, reserved) /
block_size)`` blocks, so the waste is below one block per cache. On CPU the pool is allocated with
``torch.empty``: the OS commits its pages when a block is first used, so an unused budget costs
address space, not RAM; on CUDA the budget is committed up front (as vLLM does). Reservations
(``reserve_tokens``) take their blocks at prefill time, so a reserved sequence can never run out.

Measured with the earlier padded-gather steps (SmolLM2-135M fp32, 2 CPU cores,
``python -m ferrum_service.testing.bench_causal_lm``; packed-step figures: ``benchmarks/``):
45 KiB of KV per token (2 · 30 · 3 · 64 · 4 = 46 080 B, exactly the theoretical figure; 720 KiB per
16-token block); decode 13-14 tok/s at B=1 (the model alone with a ``DynamicCache`` step: ~9 tok/s)
and 67-73 tok/s at B=8 (prompts of 16..128 tokens, one forward per step); a 128-token prefill
340-370 ms, the same as a bare ``model(ids, logits_to_keep=1)`` on this machine (±30 % noise).

Admission happens before any work: a step that needs more blocks than are available (free, or
cached but evictable) is refused with RESOURCE_EXHAUSTED, and nothing is allocated. The pool is
the only KV budget: blocks shared by several caches count once.

Prefix caching (:mod:`.prefix_cache`): a new sequence takes the leading full blocks that an
earlier sequence with the same tokens (and model, and ``cache_salt``) left in the index, and
computes only the rest; forks share blocks; a write into a shared or cached block copies it first.

Models with sliding-window attention layers are served with the full-attention mask, so their
context is capped at the window; models with linear-attention (recurrent) layers are refused.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from .. import errors
from ..kv_registry import CacheEntry, CacheRegistry
from ..types import (
    AdmissionLimits,
    CacheHandle,
    ExecutorCapabilities,
    ExecutorMemoryUsage,
    ExecutorStatus,
    KvCapacity,
    KvSlotAllocation,
    KvSlotCapacitySnapshot,
    KvSlotRequest,
    KvSlotReservation,
    MemoryRequirements,
    ModelInfo,
    PrefillInput,
    StepCost,
)
from .base import KvLayout
from .item_steps import ItemStepExecutor, StepItem
from .checkpoint_files import require_safe_weights
from .lora import AdapterSet, AdapterWeights, lora_step
from .packed_attention import base_implementation, build_step, install, packed_step
from .paged_kv import BlockPool, PagedWriteCache
from .prefix_cache import PrefixCache, SeqBlocks
from .torch_device import DTYPES, device_name, dtype_name, resolve_device, resolve_dtype

log = structlog.get_logger(__name__)

#: KV budget when none is configured (at least one full-length sequence always fits).
DEFAULT_KV_BUDGET_BYTES = 1 << 30

_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "mixtral": "mistral",
    "qwen2": "qwen",
    "qwen3": "qwen",
    "qwen2_moe": "qwen",
    "qwen3_moe": "qwen",
    "phi": "phi",
    "phi3": "phi",
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3_text": "gemma",
}


@dataclass
class _StagedImport:
    """An import in flight: its tokens and the private blocks its chunks are written into."""

    tokens: list[int]
    reserve: int
    salt: str
    blocks: list[int] | None
    adapter: str = ""
    staged: int = 0  # tokens counted in the registry's staged imports until commit or abort


def _raw_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes as stored (row-major, native little-endian), copied to the host."""
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).cpu().numpy().tobytes()


@dataclass
class _Row:
    blocks: list[int]
    past: int
    tokens: list[int]
    want: str
    lora: AdapterWeights | None = None


class HfCausalLmExecutor(ItemStepExecutor):
    """A transformers causal LM with paged per-sequence KV caches (see the module docstring)."""

    kind = "hf-causal-lm"

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        model_id: str,
        kv_budget_tokens: int | None = None,
        kv_budget_bytes: int | None = None,
        block_size: int = 16,
        max_batch_size: int = 32,
        max_batch_tokens: int | None = None,
        source: str = "",
        weight_format: str = "",
        num_parameters: int | None = None,
        prefix_cache: bool = True,
        max_adapters: int = 8,
    ) -> None:
        """Wrap a loaded model (use :meth:`from_path` to load one).

        ``kv_budget_tokens`` (or ``kv_budget_bytes``) sizes the KV pool over all caches, rounded up
        to whole blocks; default :data:`DEFAULT_KV_BUDGET_BYTES`, and never less than one
        full-length sequence. ``max_batch_size`` / ``max_batch_tokens`` bound one forward (rows /
        new tokens) and are what :meth:`admission_limits` reports. ``weight_format`` /
        ``num_parameters`` describe weights transformed after loading (``int8``: see
        ``int8_weights.py``). ``prefix_cache=False`` turns automatic prefix caching off (forks
        still share blocks). ``max_adapters``: LoRA adapters resident at once (0 = no LoRA).
        """
        super().__init__()
        self.model = model.eval()
        # Packed steps need the paged attention function; plain calls still use this one.
        self.base_attn_implementation = install(model)
        self.weight_format = weight_format
        self._num_parameters = num_parameters
        self._tokenizer = tokenizer
        self.model_id = model_id
        self.source = source
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        self.config = model.config
        self.block_size = block_size
        self.max_batch_size = max_batch_size

        num_layers, kv_heads, k_dim, v_dim, sliding = self._probe_kv_shape()
        self.num_layers, self.num_kv_heads, self.head_dim, self.v_head_dim = num_layers, kv_heads, k_dim, v_dim
        self.max_sequence_length = self._max_sequence_length(sliding)
        self.max_batch_tokens = max_batch_tokens or max(8192, self.max_sequence_length)

        bpt = num_layers * kv_heads * (k_dim + v_dim) * torch.empty((), dtype=self.dtype).element_size()
        if kv_budget_tokens is not None:
            budget = int(kv_budget_tokens)
        elif kv_budget_bytes is not None:
            budget = int(kv_budget_bytes) // bpt
        else:
            budget = max(DEFAULT_KV_BUDGET_BYTES // bpt, self.max_sequence_length)
        if budget < 1:
            raise errors.FerrumError(errors.ErrorKind.CONFIG, f"KV budget of {budget} tokens is too small")
        num_blocks = math.ceil(budget / block_size)
        self.pool = BlockPool(
            num_layers=num_layers,
            num_kv_heads=kv_heads,
            head_dim=k_dim,
            v_head_dim=v_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=self.dtype,
            device=self.device,
        )
        self.prefix = PrefixCache(self.pool, model_id=model_id, enabled=prefix_cache)
        self.adapters = (AdapterSet(model, device=self.device, dtype=self.dtype, max_resident=max_adapters)
                         if max_adapters > 0 else None)
        self._staged_adapters: collections.Counter[str] = collections.Counter()  # staged imports per adapter
        total_tokens = num_blocks * block_size
        self.registry = CacheRegistry(
            model_id,
            total_tokens=total_tokens,
            token_admission=False,  # the pool admits (shared blocks count once)
            block_size=block_size,
            bytes_per_token=bpt,
            per_request_tokens=total_tokens if total_tokens < self.max_sequence_length else None,
            id_prefix="hf",
        )
        self._pad_id = self._pick_pad_id()
        self._kv_layout: KvLayout | None = None
        self._info = self._build_info()
        log.info(
            "kv pool ready",
            model_id=model_id,
            blocks=num_blocks,
            block_size=block_size,
            budget_tokens=total_tokens,
            bytes_per_token=bpt,
            pool_bytes=self.pool.total_bytes,
        )

    # ---- loading -------------------------------------------------------------------------------
    @classmethod
    def from_path(
        cls,
        path: str | Path,
        *,
        model_id: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        gguf_file: str | None = None,
        kv_budget_tokens: int | None = None,
        kv_budget_bytes: int | None = None,
        block_size: int = 16,
        max_batch_size: int = 32,
        max_batch_tokens: int | None = None,
        trust_remote_code: bool = False,
        allow_pickle: bool = False,
        attn_implementation: str = "sdpa",
        prefix_cache: bool = True,
        max_adapters: int = 8,
    ) -> "HfCausalLmExecutor":
        """Load a local checkpoint directory, or a GGUF file (``gguf_file=`` inside ``path``, or
        ``path`` itself ending in ``.gguf``).

        ``device``: auto | cpu | cuda | cuda:N. ``dtype``: auto | fp32 | fp16 | bf16 | int8 (auto =
        fp32 on CPU, the checkpoint's half dtype or bf16 on CUDA; GGUF weights are dequantised to
        it; int8 = int8 weight-only linear layers with bf16 activations and KV, see
        ``int8_weights.py``). Remote code runs only with ``trust_remote_code=True``; pickled weights
        (``*.bin``: unpickling can run code) load only with ``allow_pickle=True``, otherwise only
        safetensors or GGUF. Nothing is downloaded.
        """
        from transformers import AutoModelForCausalLM

        p = Path(path).expanduser()
        if p.is_file() and p.suffix == ".gguf" and gguf_file is None:
            p, gguf_file = p.parent, p.name
        if not p.is_dir():
            raise errors.FerrumError(errors.ErrorKind.CONFIG, f"model path {str(path)!r} is not a directory or .gguf file")
        if gguf_file and not (p / gguf_file).is_file():
            raise errors.FerrumError(errors.ErrorKind.CONFIG, f"GGUF file {gguf_file!r} not found in {str(p)!r}")
        dev = resolve_device(device)
        int8 = str(dtype).strip().lower() == "int8"
        torch_dtype = torch.bfloat16 if int8 else resolve_dtype(dtype, dev, None if gguf_file else _checkpoint_dtype(p))
        safe_kwargs = {} if gguf_file else require_safe_weights(p, allow_pickle)
        model_id = model_id or (Path(gguf_file).stem if gguf_file else p.name)
        log.info(
            "loading causal LM",
            model_id=model_id,
            path=str(p),
            gguf_file=gguf_file,
            device=device_name(dev),
            dtype=dtype_name(torch_dtype),
        )
        t0 = time.perf_counter()
        kwargs: dict[str, Any] = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code}
        if gguf_file:
            kwargs["gguf_file"] = gguf_file
        kwargs.update(safe_kwargs)
        try:
            model = AutoModelForCausalLM.from_pretrained(p, attn_implementation=attn_implementation, **kwargs)
        except (ValueError, ImportError) as e:
            if attn_implementation == "eager":
                raise
            log.warning("attention implementation unavailable, using eager", wanted=attn_implementation, error=str(e))
            model = AutoModelForCausalLM.from_pretrained(p, attn_implementation="eager", **kwargs)
        t_weights = time.perf_counter() - t0
        log.info("weights loaded", model_id=model_id, seconds=round(t_weights, 2))
        model.to(dev)
        n_params = sum(x.numel() for x in model.parameters())
        if int8:
            from .int8_weights import quantize_linears

            t_q = time.perf_counter()
            n = quantize_linears(model)
            log.info("int8 weight-only", model_id=model_id, linear_layers=n, seconds=round(time.perf_counter() - t_q, 2))
        tokenizer = _load_tokenizer(p, gguf_file, trust_remote_code)
        ex = cls(
            model,
            tokenizer,
            model_id=model_id,
            kv_budget_tokens=kv_budget_tokens,
            kv_budget_bytes=kv_budget_bytes,
            block_size=block_size,
            max_batch_size=max_batch_size,
            max_batch_tokens=max_batch_tokens,
            source=str(p / gguf_file) if gguf_file else str(p),
            weight_format="int8" if int8 else "",
            num_parameters=n_params,
            prefix_cache=prefix_cache,
            max_adapters=max_adapters,
        )
        i = ex._info
        log.info(
            "causal LM ready",
            model_id=model_id,
            architecture=i.metadata.get("architecture"),
            parameters=i.num_parameters,
            layers=i.num_layers,
            hidden=i.hidden_size,
            heads=i.num_heads,
            kv_heads=i.num_kv_heads,
            head_dim=i.head_dim,
            vocab=i.vocab_size,
            max_seq_len=i.max_sequence_length,
            dtype=i.dtype,
            device=i.device,
            attn=i.metadata.get("attn_implementation"),
            has_tokenizer=i.has_tokenizer,
            seconds=round(time.perf_counter() - t0, 2),
        )
        return ex

    @torch.inference_mode()
    def _probe_kv_shape(self) -> tuple[int, int, int, int, bool]:
        """Layers, kv heads, K and V head dims, as the model's own cache stores them (one token)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        kinds = {type(layer).__name__ for layer in cache.layers}
        if any("Linear" in k for k in kinds):
            raise errors.FerrumError(
                errors.ErrorKind.CONFIG,
                f"{type(self.model).__name__} has linear-attention (recurrent) layers; the paged KV executor "
                "serves attention-only models",
            )
        keys, values = cache.layers[0].keys, cache.layers[0].values
        for layer in cache.layers:
            if layer.keys.shape != keys.shape or layer.values.shape != values.shape:
                raise errors.FerrumError(
                    errors.ErrorKind.CONFIG, "layers with different KV shapes are not supported by the paged pool"
                )
        sliding = any("Sliding" in k for k in kinds)
        return len(cache.layers), keys.shape[1], keys.shape[-1], values.shape[-1], sliding

    def _max_sequence_length(self, sliding: bool) -> int:
        cfg = self.config
        n = getattr(cfg, "max_position_embeddings", None) or 0
        tok_max = getattr(self._tokenizer, "model_max_length", 0) or 0
        if not n and 0 < tok_max < 10**7:
            n = tok_max
        n = n or 2048
        window = getattr(cfg, "sliding_window", None)
        if sliding and window:
            n = min(n, int(window))
        return int(n)

    def _pick_pad_id(self) -> int:
        for v in (getattr(self.config, "pad_token_id", None), getattr(self._tokenizer, "pad_token_id", None)):
            if isinstance(v, int) and 0 <= v < self.vocab_size:
                return v
        return 0

    @property
    def vocab_size(self) -> int:
        head = self.model.get_output_embeddings()
        if head is not None and hasattr(head, "out_features"):
            return int(head.out_features)
        return int(self.config.vocab_size)

    def _eos_token_ids(self) -> list[int]:
        ids: list[int] = []
        gen = getattr(self.model, "generation_config", None)
        for v in (getattr(gen, "eos_token_id", None), getattr(self.config, "eos_token_id", None)):
            for x in v if isinstance(v, (list, tuple)) else [v]:
                if isinstance(x, int) and x not in ids:
                    ids.append(x)
        tok_eos = getattr(self._tokenizer, "eos_token_id", None)
        if isinstance(tok_eos, int) and tok_eos not in ids:
            ids.append(tok_eos)
        return ids

    def _build_info(self) -> ModelInfo:
        cfg = self.config
        mt = getattr(cfg, "model_type", "") or ""
        tok = self._tokenizer
        return ModelInfo(
            model_id=self.model_id,
            model_type=_MODEL_TYPES.get(mt, "custom"),
            model_type_detail=mt,
            num_parameters=self._num_parameters or sum(p.numel() for p in self.model.parameters()),
            hidden_size=int(getattr(cfg, "hidden_size", 0) or 0),
            num_layers=self.num_layers,
            num_heads=int(getattr(cfg, "num_attention_heads", 0) or 0),
            num_kv_heads=self.num_kv_heads,
            vocab_size=self.vocab_size,
            max_sequence_length=self.max_sequence_length,
            dtype=dtype_name(self.dtype),
            device=device_name(self.device),
            metadata={
                "architecture": (getattr(cfg, "architectures", None) or [type(self.model).__name__])[0],
                "source": self.source,
                "attn_implementation": base_implementation(self.model),
                "batched_attention": "packed-paged",
                "kv_layout": "paged",
                "kv_block_size": self.block_size,
                "kv_budget_tokens": self.registry.total_tokens,
                "kv_bytes_per_token": self.registry.bytes_per_token,
                "weight_format": self.weight_format or dtype_name(self.dtype),
            },
            head_dim=self.head_dim,
            executor=self.kind,
            eos_token_ids=self._eos_token_ids(),
            has_tokenizer=tok is not None,
            has_chat_template=bool(getattr(tok, "chat_template", None)),
            prefix_cache=self.prefix.recipe(),
        )

    # ---- metadata ------------------------------------------------------------------------------
    def info(self) -> ModelInfo:
        return self._info

    def capabilities(self) -> ExecutorCapabilities:
        elt = torch.empty((), dtype=self.dtype).element_size()
        heads = self._info.num_heads
        if self.num_kv_heads == 1 and heads > 1:
            attn = "multi_query"
        elif self.num_kv_heads < heads:
            attn = "grouped_query"
        else:
            attn = "multi_head"
        hidden = self._info.hidden_size
        inter = int(getattr(self.config, "intermediate_size", 0) or 4 * hidden)
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        params += sum(b.numel() * b.element_size() for b in self.model.buffers())
        return ExecutorCapabilities(
            max_batch_size=self.max_batch_size,
            max_sequence_length=self.max_sequence_length,
            attention_mechanisms=[attn, "paged"],
            supports_dynamic_batching=True,
            supports_continuous_batching=True,
            supports_speculative_decoding=True,
            supported_dtypes=[dtype_name(self.dtype)],
            supported_devices=[device_name(self.device)],
            memory_requirements=MemoryRequirements(
                parameter_memory_bytes=params,
                # Rough transient per token of a forward: residual, attention and MLP activations.
                activation_memory_per_token_bytes=(4 * hidden + 2 * inter) * elt,
                # Per token per layer, K and V together (ferrum's convention).
                kv_cache_memory_per_token_bytes=self.num_kv_heads * (self.head_dim + self.v_head_dim) * elt,
                # The KV pool, allocated at start-up for the whole budget.
                overhead_memory_bytes=self.pool.total_bytes,
            ),
            supports_native_unified_decode=True,
            supports_generation=True,
            supports_embeddings=False,
            supports_forward=True,
            supports_kv_truncation=True,
            supports_native_forward_verify=True,
            kv_block_size=self.block_size,
            supports_prefix_caching=self.prefix.enabled,
            supports_fork=True,
            supports_kv_transfer=True,
            supports_lora=self.adapters is not None,
            max_adapters=self.adapters.max_resident if self.adapters is not None else 0,
        )

    def status(self) -> ExecutorStatus:
        st = super().status()
        used = self.prefix.used_blocks * self.pool.block_bytes
        total = self.pool.num_blocks * self.pool.block_bytes
        st.memory_usage = ExecutorMemoryUsage(
            allocated_bytes=self.pool.total_bytes,
            used_bytes=used,
            peak_bytes=self.pool.peak_used * self.pool.block_bytes,
            utilization_percent=100.0 * used / total if total else 0.0,
        )
        return st

    def kv_capacity(self) -> KvCapacity:
        """Tokens as the registry counts them (per cache); free space and bytes from the pool
        (whole blocks; a shared block counts once; cached-but-evictable blocks are free)."""
        cap = super().kv_capacity()
        pool, pc = self.pool, self.prefix
        cap.free_tokens = pc.available_blocks * self.block_size
        cap.total_bytes = pool.num_blocks * pool.block_bytes
        cap.used_bytes = pc.used_blocks * pool.block_bytes
        cap.bytes_per_token = pool.bytes_per_token
        cap.block_size = self.block_size
        cap.total_blocks = pool.num_blocks
        cap.free_blocks = pool.free_blocks
        cap.evictable_blocks = len(pc.evictable)
        cap.cached_blocks = pc.cached_blocks
        return cap

    def cache_metrics(self) -> dict[str, Any]:
        """Prefix-cache counters (ferrum's ``cache_metrics_snapshot``: paged-KV prefix reuse)."""
        st, pc = self.prefix.stats, self.prefix
        return {"prefix_cache": {
            "enabled": pc.enabled, "block_size": self.block_size, "total_blocks": self.pool.num_blocks,
            "free_blocks": self.pool.free_blocks, "used_blocks": pc.used_blocks,
            "cached_blocks": pc.cached_blocks, "evictable_blocks": len(pc.evictable),
            "queried_tokens": st.queried_tokens, "hit_tokens": st.hit_tokens, "hit_rate": st.hit_rate,
            "lookups": st.lookups, "hits": st.hits, "evicted_blocks": st.evicted_blocks,
            "cow_copies": st.cow_copies, "forks": st.forks,
        }}

    # ---- LoRA adapters ---------------------------------------------------------------------------
    def load_adapter(self, name: str, path: str):
        if self.adapters is None:
            return super().load_adapter(name, path)
        adapter, loaded = self.adapters.load(name, path)
        if loaded:
            log.info("adapter loaded", model_id=self.model_id, adapter=name, path=adapter.path, rank=adapter.rank,
                     modules=len(adapter.weights.modules), weight_bytes=adapter.weight_bytes)
        return adapter, loaded

    def unload_adapter(self, name: str) -> tuple[bool, int]:
        """FAILED_PRECONDITION while a live cache is bound to ``name``; its cached blocks go with it."""
        if self.adapters is None:
            return super().unload_adapter(name)
        if name not in self.adapters.adapters:
            return False, 0
        live = self.adapter_bindings()[name]
        if live:
            raise errors.failed_precondition(
                f"adapter {name!r} is used by {live} live cache(s); release them first", field="name",
                live_caches=live)
        self.adapters.unload(name)
        dropped = self.prefix.drop_adapter(name)
        log.info("adapter unloaded", model_id=self.model_id, adapter=name, dropped_blocks=dropped)
        return True, dropped

    def lora_metrics(self) -> dict[str, Any] | None:
        """ferrum's ``lora_metrics_snapshot`` fields, plus residency and per-adapter counters."""
        a = self.adapters
        if a is None:
            return None
        bound = self.adapter_bindings()
        # One snapshot of the table (a C-level copy, atomic under the GIL): this runs on the event
        # loop while LoadAdapter / UnloadAdapter may change the table on the worker.
        items = list(a.adapters.items())
        return {
            "enabled": bool(items), "adapter_count": len(items),
            "active_cache_bindings": sum(n for name, n in bound.items() if name),
            "projection_applications": a.projection_applications, "position": "real-inference",
            "source": "hf-causal-lm-stacked-lora", "max_resident": a.max_resident,
            "resident": sum(1 for _n, x in items if x.resident),
            "loads": a.loads, "evictions": a.evictions,
            "adapters": {n: {"rank": x.rank, "resident": x.resident, "steps": x.steps,
                             "live_caches": bound.get(n, 0)} for n, x in items},
        }

    def _lora_step(self, rows: list[_Row]):
        """The adapters of a forward over ``rows`` (None without LoRA or when no row uses one)."""
        return self.adapters.step([(r.lora, len(r.tokens)) for r in rows]) if self.adapters is not None else None

    def _count_lora(self, step) -> None:
        if step is not None:
            self.adapters.projection_applications += step.applications

    def admission_limits(self) -> AdmissionLimits:
        return AdmissionLimits(
            maximum_active_sequences=self.max_batch_size, maximum_scheduled_tokens=self.max_batch_tokens
        )

    def step_cost(self, rows: list[tuple[int, int]], logits_rows: int) -> StepCost:
        """One ``_forward_rows`` call (see "What one step reads and writes"): the step's real tokens
        through the model (packed; fresh equal-length prompts are the same count as a batch), and
        per layer, at most, each row's own context copied once (scattered blocks), its attention
        scores over that context, and a chunk's small ``[n, past + n]`` mask; activations per
        token; fp32 logits for the rows (or positions) asked for."""
        positions = sum(n for n, _ in rows)
        elem = torch.empty((), dtype=self.dtype).element_size()
        cfg = self.config
        hidden = int(getattr(cfg, "hidden_size", 0) or 0)
        inter = int(getattr(cfg, "intermediate_size", 0) or 4 * hidden)
        heads = int(getattr(cfg, "num_attention_heads", 0) or self.num_kv_heads)
        kv_row = self.num_kv_heads * (self.head_dim + self.v_head_dim) * elem
        attention = sum((c + n) * kv_row + n * heads * (c + n) * 4 + (n * (c + n) * elem if c and n > 1 else 0)
                        for n, c in rows)
        activations = positions * (4 * hidden + 3 * inter) * elem
        return StepCost(positions=positions, scratch_bytes=attention + activations + logits_rows * self.vocab_size * 4)

    @property
    def tokenizer(self) -> Any:
        """The model's own tokenizer (None when the checkpoint has none)."""
        return self._tokenizer

    def handle(self, entry: CacheEntry) -> CacheHandle:
        blocks = entry.payload.blocks if isinstance(entry.payload, SeqBlocks) else []
        h = self.registry.handle(entry, memory_bytes=len(blocks) * self.pool.block_bytes)
        h.block_ids = list(blocks[: h.num_blocks])
        h.num_layers = self.num_layers
        h.num_kv_heads = self.num_kv_heads
        h.head_dim = self.head_dim
        return h

    # ---- compute -------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, logits_dtype: str = "fp32") -> torch.Tensor:
        """A stateless full forward of ``[batch, seq]`` token ids; logits ``[batch, seq, vocab]``."""
        ids = torch.as_tensor(input_ids).to(device=self.device, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        out = self.model(input_ids=ids, use_cache=False)
        return out.logits.to(DTYPES.get(logits_dtype, torch.float32))

    def _admit(self, need_blocks: int, field: str, *, new_caches: int = 0, revived: int = 0) -> None:
        """RESOURCE_EXHAUSTED unless ``need_blocks`` new blocks can be had (free, or evicted from the
        prefix cache) after taking back ``revived`` evictable blocks for prefix hits, and the
        registry has room for ``new_caches``; allocates nothing."""
        avail = self.prefix.available_blocks - revived
        if need_blocks > avail:
            raise errors.exhausted(
                f"{field}: needs {need_blocks} more KV blocks ({self.block_size} tokens each) but only "
                f"{avail} of {self.pool.num_blocks} are free",
                field=field,
                needed_blocks=need_blocks,
                free_blocks=avail,
            )
        self.registry.admit(0, field, new_caches=new_caches)

    def cached_prefix(self, inp: PrefillInput) -> int:
        """Tokens a prefill of ``inp`` (a new prompt) would take from the prefix cache now."""
        if inp.cache_id or inp.bypass_prefix_cache or inp.all_positions or not self.prefix.enabled:
            return 0
        blocks, _ = self.prefix.match(inp.token_ids, self.prefix.root(inp.cache_salt, inp.adapter))
        return min(len(blocks) * self.block_size, len(inp.token_ids) - 1)

    def admit_kv(self, grow: list[tuple[CacheEntry, int]], new: list[StepItem], field: str) -> None:
        """The pool's admission for a step the server is about to queue (see :meth:`_plan`)."""
        items = [StepItem(e, [0] * max(0, n - e.num_tokens), "none") for e, n in grow] + list(new)
        need, revived, _ = self._plan(items)
        self._admit(need, field, new_caches=len(new), revived=len(revived))

    def kv_slot_capacity(self) -> KvSlotCapacitySnapshot:
        """The block pool now (allocates nothing); evictable cached blocks count as free."""
        return KvSlotCapacitySnapshot(block_size=self.block_size, total_blocks=self.pool.num_blocks,
                                      free_blocks=self.prefix.available_blocks)

    def reserve_kv_slots(self, requests: list[KvSlotRequest]) -> KvSlotReservation:
        """Paged admission at a batch boundary (ferrum's ``reserve_kv_slots``): give each cache the
        blocks for ``max(target_len, admission_target_len)`` tokens now, all or nothing; the
        reservation holds its blocks until the cache grows into them, is truncated or released.
        A ``new_sequence`` request gets a new empty cache holding its blocks (ferrum's executors
        create a sequence's KV at its first reservation). RESOURCE_EXHAUSTED (nothing allocated,
        nothing created) when the pool or the active-cache limit cannot cover it."""
        pool, reg = self.pool, self.registry
        plan: list[tuple[CacheEntry | None, int, int, str, str]] = []
        need_blocks = new_caches = 0
        for k, r in enumerate(requests):
            target = max(int(r.target_len), int(r.admission_target_len or 0))
            self.registry.check_sequence_length(target, f"requests[{k}].target_len", self.max_sequence_length)
            if r.new_sequence:
                entry, have = None, 0
                new_caches += 1
            else:
                entry = reg.get(r.cache_id, field=f"requests[{k}].cache_id")
                have = len(entry.payload.blocks)
            new = max(0, pool.blocks_for(target) - have)
            plan.append((entry, target, new, r.cache_id, r.salt))
            need_blocks += new
        free_before = self.prefix.available_blocks
        self._admit(need_blocks, "requests", new_caches=new_caches)
        allocations = []
        for entry, target, new, name, salt in plan:
            created = ""
            if entry is None:
                entry = reg.create([], reserve_tokens=target, field="requests")
                entry.payload = SeqBlocks([], [], self.prefix.root(salt), salt)
                created = entry.cache_id
            blocks = entry.payload.blocks
            before = len(blocks)
            blocks.extend(self.prefix.allocate(new, blocks[-1] if blocks else None))
            reg.set_reserved(entry, max(entry.reserved_total, target))
            allocations.append(KvSlotAllocation(cache_id=name, blocks_before=before, blocks_after=len(blocks),
                                                new_blocks=new, created_cache_id=created))
        return KvSlotReservation(block_size=self.block_size, total_blocks=pool.num_blocks,
                                 free_blocks_before=free_before, free_blocks_after=self.prefix.available_blocks,
                                 allocations=allocations)

    def truncate_kv(self, cache_id: str, new_len: int) -> tuple[CacheHandle, int]:
        """Roll the cache back to ``new_len`` tokens; blocks no longer needed are let go (to the
        pool, or, when cached, to the evictable list). A kept block that others share is copied
        when this cache next writes into it, so they never see the change."""
        entry = self.registry.get(cache_id)
        if not 0 <= new_len <= entry.num_tokens:
            raise errors.out_of_range(
                f"new_len must be in [0, {entry.num_tokens}], not {new_len}", field="new_len", num_tokens=entry.num_tokens
            )
        removed = self.registry.truncate(entry, new_len)
        seq = entry.payload
        self.prefix.truncate_keys(seq, new_len)
        keep = self.pool.blocks_for(max(new_len, entry.reserved_total))
        if len(seq.blocks) > keep:
            self.prefix.release(seq.blocks[keep:])
            del seq.blocks[keep:]
        return self.handle(entry), removed

    def fork_cache(self, cache_id: str, keep_tokens: int | None = None, reserve_tokens: int = 0) -> tuple[CacheEntry, int]:
        """A new cache holding ``cache_id``'s first ``keep_tokens`` tokens, sharing their blocks
        (copy-on-write). Returns (the new entry, blocks shared)."""
        src, keep = self._fork_source(cache_id, keep_tokens)
        reserve = int(reserve_tokens or 0)
        self.registry.check_sequence_length(max(keep, reserve), "reserve_tokens", self.max_sequence_length)
        shared = src.payload.blocks[: self.pool.blocks_for(keep)]
        extra = self.pool.blocks_for(max(keep, reserve)) - len(shared)
        self._admit(extra, "cache_id", new_caches=1)
        entry = self.registry.create(src.tokens[:keep], reserve_tokens=reserve, field="cache_id", event="forked")
        entry.adapter = src.adapter
        entry.caller_supplied = src.caller_supplied
        self.prefix.take(shared)
        seq = SeqBlocks(list(shared), src.payload.keys[: keep // self.block_size], src.payload.root, src.payload.salt,
                        src.payload.adapter)
        seq.blocks.extend(self.prefix.allocate(extra, shared[-1] if shared else None))
        entry.payload = seq
        self.prefix.stats.forks += 1
        return entry, len(shared)

    # ---- KV transfer (ExportKv / ImportKv) -------------------------------------------------------
    def kv_layout(self) -> KvLayout:
        """This model's K/V as the wire describes them; the fingerprint (SHA-256 over the executor
        kind, the config — less its path, library version and dtype keys — and every weight's name,
        shape, dtype and bytes, in name order) is computed once, on first use, on the worker thread."""
        if self._kv_layout is None:
            h = hashlib.sha256()
            h.update(f"{self.kind}\n".encode())
            # Where the files were and which library version wrote them do not change the K/V.
            cfg = {k: v for k, v in self.config.to_dict().items()
                   if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype")}
            h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
            with torch.inference_mode():
                tensors = dict(self.model.named_parameters())
                tensors.update(dict(self.model.named_buffers()))
                for name in sorted(tensors):
                    t = tensors[name].detach()
                    h.update(f"\n{name}:{tuple(t.shape)}:{t.dtype}\n".encode())
                    if t.numel():
                        h.update(_raw_bytes(t))
            self._kv_layout = KvLayout(
                model_id=self.model_id, fingerprint=h.hexdigest(), dtype=dtype_name(self.pool.dtype),
                num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                v_head_dim=self.v_head_dim, executor=self.kind, element_size=self.pool.element_size)
        return self._kv_layout

    def _slots_of(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        bs = self.block_size
        pos = torch.arange(start, end, dtype=torch.long)
        table = torch.tensor(blocks, dtype=torch.long)
        return (table[pos // bs] * bs + pos % bs).to(self.device)

    @torch.inference_mode()
    def export_kv_layer(self, cache_id: str, start: int, end: int, layer: int) -> tuple[bytes, bytes]:
        """K and V of tokens [start, end) of ``layer``, read from the pool (``[n, kv_heads, dim]``
        row-major, the pool's dtype, little-endian), as bytes on the host."""
        entry = self.registry.get(cache_id)
        if not 0 <= start < end <= entry.num_tokens:
            raise errors.out_of_range(f"token range [{start}, {end}) is outside the cache's {entry.num_tokens} tokens",
                                      field="to_token")
        slots = self._slots_of(entry.payload.blocks, start, end)
        out = []
        for pool, d in ((self.pool.k[layer], self.head_dim), (self.pool.v[layer], self.v_head_dim)):
            out.append(_raw_bytes(pool.view(-1, self.num_kv_heads, d).index_select(0, slots)))
        return out[0], out[1]

    def import_begin(self, tokens: list[int], reserve_tokens: int, cache_salt: str, adapter: str = "",
                     adapter_digest: str = "") -> "_StagedImport":
        """Admit ``len(tokens)`` (or ``reserve_tokens``) of KV and take its blocks now (private,
        zeroed, in no registry and no index): RESOURCE_EXHAUSTED before any byte is kept. K/V
        computed with a LoRA ``adapter`` need that adapter loaded here, with the same digest when
        the sender gives one (FAILED_PRECONDITION); the staged import binds the adapter (it cannot
        be unloaded until the import ends)."""
        if self.state == "shutdown":
            raise errors.unavailable(f"model {self.model_id!r} is shut down")
        if adapter and (self.adapters is None or adapter not in self.adapters.adapters):
            raise errors.failed_precondition(
                f"the K/V were computed with LoRA adapter {adapter!r}, which is not loaded on model "
                f"{self.model_id!r} here", field="header.adapter")
        if adapter and adapter_digest and adapter_digest != self.adapter_digest(adapter):
            raise errors.failed_precondition(
                f"the K/V were computed with another adapter {adapter!r} than this server's (their digests "
                "differ)", field="header.adapter_digest")
        total = max(len(tokens), int(reserve_tokens or 0))
        self.registry.check_sequence_length(total, "reserve_tokens", self.max_sequence_length)
        need = self.pool.blocks_for(total)
        self._admit(need, "header", new_caches=1)
        self.registry.stage(total, "header")
        blocks = self.prefix.allocate(need)
        if adapter:
            self._staged_adapters[adapter] += 1
        return _StagedImport(list(tokens), int(reserve_tokens or 0), cache_salt, blocks, adapter, total)

    @torch.inference_mode()
    def import_write(self, staged: "_StagedImport", layer: int, start: int, end: int, key: bytes, value: bytes) -> None:
        """Write one chunk (tokens [start, end) of ``layer``) into the staged blocks."""
        if staged.blocks is None:
            raise errors.FerrumError(errors.ErrorKind.INTERNAL, "the import was aborted")
        slots = self._slots_of(staged.blocks, start, end)
        n, h = end - start, self.num_kv_heads
        for pool, d, data in ((self.pool.k[layer], self.head_dim, key), (self.pool.v[layer], self.v_head_dim, value)):
            with warnings.catch_warnings():  # read-only bytes: the tensor is only read
                warnings.simplefilter("ignore", UserWarning)
                src = torch.frombuffer(data, dtype=torch.uint8).view(self.pool.dtype).view(n, h, d)
            pool.view(-1, h, d).index_copy_(0, slots, src.to(self.device))

    def import_extend(self, staged: "_StagedImport", tokens: list[int]) -> None:
        """Append ``tokens`` to the staged import: their slots are in the blocks it took at
        :meth:`import_begin` (its reservation), so nothing is allocated here."""
        if staged.blocks is None:
            raise errors.FerrumError(errors.ErrorKind.INTERNAL, "the import was aborted")
        n = len(staged.tokens) + len(tokens)
        if n > staged.staged or n > len(staged.blocks) * self.block_size:
            raise errors.out_of_range(f"the staged import holds room for {staged.staged} tokens, not {n}",
                                      field="header.to_token", limit=staged.staged)
        staged.tokens.extend(tokens)

    def import_commit(self, staged: "_StagedImport") -> tuple[CacheEntry, int]:
        """Register the staged blocks as a new cache holding the imported tokens, then key its full
        blocks into the prefix cache (block events, as for a computed prompt)."""
        if staged.blocks is None:
            raise errors.FerrumError(errors.ErrorKind.INTERNAL, "the import was aborted")
        self._unstage(staged)
        entry = self.registry.create(staged.tokens, reserve_tokens=staged.reserve, field="header")
        before = self.prefix.cached_blocks
        entry.adapter = staged.adapter
        entry.payload = SeqBlocks(staged.blocks, [], self.prefix.root(staged.salt, staged.adapter), staged.salt,
                                  staged.adapter)
        staged.blocks = None
        self.prefix.commit(entry.payload, entry.tokens, entry.cache_id)
        return entry, self.prefix.cached_blocks - before

    def import_abort(self, staged: "_StagedImport") -> None:
        """Give the staged blocks back (idempotent)."""
        self._unstage(staged)
        if staged.blocks:
            self.prefix.release(staged.blocks)
        staged.blocks = None

    def _unstage(self, staged: "_StagedImport") -> None:
        if staged.staged:
            self.registry.unstage(staged.staged)
            staged.staged = 0
            if staged.adapter:
                self._staged_adapters[staged.adapter] -= 1

    def adapter_bindings(self) -> "collections.Counter[str]":
        """Live caches per adapter, plus the staged imports bound to one."""
        return super().adapter_bindings() + self._staged_adapters

    def adapter_digest(self, name: str) -> str:
        a = self.adapters.adapters.get(name) if self.adapters is not None else None
        return a.digest if a is not None else ""

    def free_payload(self, entry: CacheEntry) -> int:
        """Let go of the cache's blocks (cached ones stay evictable); the bytes they held."""
        seq = entry.payload
        entry.payload = None
        if not isinstance(seq, SeqBlocks):
            return 0
        self.prefix.release(seq.blocks)
        freed = len(seq.blocks) * self.pool.block_bytes
        seq.blocks = []
        return freed

    def shutdown(self) -> int:
        n = super().shutdown()
        self.clear_prefix_cache()
        return n

    def clear_prefix_cache(self) -> bool:
        self.prefix.clear()
        return True

    @torch.inference_mode()
    def warmup(self) -> None:
        """One tiny prefill + decode through the paged path (allocates and frees one block)."""
        if self.prefix.available_blocks < 1:
            return
        ((entry, _),) = self._step([StepItem(None, [self._pad_id], "last", bypass=True)], "warmup")
        try:
            self._step([StepItem(entry, [self._pad_id], "last")], "warmup")
        finally:
            self.release_cache(entry.cache_id)

    # ---- the one forward -----------------------------------------------------------------------
    def _plan(self, items: list[StepItem]) -> tuple[int, set[int], list[tuple[list[int], list[bytes], bytes]]]:
        """What a step over ``items`` needs from the pool: (new blocks, evictable blocks its prefix
        hits take back, per item (hit blocks, their keys, chain root)). Sets ``item.cached``.

        A new sequence looks its prompt up unless it bypasses the cache or wants every position's
        logits; at least its last token is computed, so a prompt that is all cached recomputes
        that token into a copy of its last block. A continuing sequence needs blocks for its
        growth plus a copy of each block it writes into that is shared or cached."""
        pc, pool, bs = self.prefix, self.pool, self.block_size
        need = 0
        revived: set[int] = set()
        hits: list[tuple[list[int], list[bytes], bytes]] = []
        for it in items:
            if it.entry is None:
                root = pc.root(it.salt, it.adapter)
                hb: list[int] = []
                hk: list[bytes] = []
                if not it.bypass and it.want != "all":
                    hb, hk = pc.match(it.tokens, root)
                it.cached = min(len(hb) * bs, len(it.tokens) - 1)
                cow = 1 if it.cached < len(hb) * bs else 0
                need += pool.blocks_for(max(len(it.tokens), it.reserve)) - len(hb) + cow
                revived.update(b for b in hb if b in pc.evictable)
                hits.append((hb, hk, root))
            else:
                blocks, past = it.entry.payload.blocks, it.entry.num_tokens
                end = past + len(it.tokens)
                need += max(0, pool.blocks_for(max(end, it.reserve)) - len(blocks))
                written = range(past // bs, min(len(blocks), pool.blocks_for(end)))
                need += sum(1 for i in written if pc.must_copy(blocks[i]))
                hits.append(([], [], b""))
        return need, revived, hits

    def _step(self, items: list[StepItem], field: str) -> list[tuple[CacheEntry, torch.Tensor | None]]:
        """Admit, allocate, run one forward over all items, commit. On failure the step leaves no
        trace: caches it created are released, blocks it grew are returned, reservations and the
        adapter bindings of empty caches are put back."""
        if self.state == "shutdown":
            raise errors.unavailable(f"model {self.model_id!r} is shut down")
        if len(items) > self.max_batch_size:
            raise errors.exhausted(
                f"{field}: {len(items)} sequences in one step; this executor's limit is {self.max_batch_size}",
                field=field,
                limit=self.max_batch_size,
            )
        new_tokens_in_step = sum(len(it.tokens) for it in items)
        if new_tokens_in_step > self.max_batch_tokens:
            raise errors.exhausted(
                f"{field}: {new_tokens_in_step} tokens in one step; this executor's limit is {self.max_batch_tokens}",
                field=field,
                limit=self.max_batch_tokens,
            )

        bound: list[tuple[CacheEntry, str, bytes]] = []  # empty caches this step binds, to unbind on failure
        try:
            return self._step_bound(items, field, bound)
        except BaseException:
            for e, adapter, root in reversed(bound):
                e.adapter = adapter
                if isinstance(e.payload, SeqBlocks):
                    e.payload.adapter, e.payload.root = adapter, root
            raise

    def _step_bound(self, items: list[StepItem], field: str,
                    bound: list[tuple[CacheEntry, str, bytes]]) -> list[tuple[CacheEntry, torch.Tensor | None]]:
        """``_step`` after its limits: binds empty caches to their first step's adapter (recorded
        in ``bound``), admits, allocates, runs the forward and commits."""
        lora = self._adapters_of(items, field, bound)
        # Admission, before anything is allocated or computed.
        pc, pool, bs = self.prefix, self.pool, self.block_size
        need, revived, hits = self._plan(items)
        self._admit(need, field, new_caches=sum(1 for it in items if it.entry is None), revived=len(revived))

        created: list[CacheEntry] = []
        grown: list[tuple[CacheEntry, int, int]] = []
        entries: list[CacheEntry] = []
        rows: list[_Row] = []
        try:
            # Prefix hits are taken first, so that no allocation below can evict a hit block.
            for it, (hb, hk, root) in zip(items, hits):
                if it.entry is None:
                    e = self.registry.create(it.tokens, reserve_tokens=it.reserve, field=field)
                    e.adapter = it.adapter
                    created.append(e)
                    pc.take(hb)
                    e.payload = SeqBlocks(list(hb), list(hk), root, it.salt, it.adapter)
                    if it.want != "all" and not it.bypass:
                        pc.stats.lookups += 1
                        pc.stats.queried_tokens += len(it.tokens)
                        pc.stats.hit_tokens += it.cached
                        pc.stats.hits += it.cached > 0
            fresh = iter(created)
            for it in items:
                if it.entry is None:
                    e = next(fresh)
                    seq, past, new = e.payload, it.cached, it.tokens[it.cached:]
                    total = pool.blocks_for(max(len(it.tokens), it.reserve))
                    seq.blocks.extend(pc.allocate(total - len(seq.blocks), seq.blocks[-1] if seq.blocks else None))
                else:
                    e, past, new = it.entry, it.entry.num_tokens, it.tokens
                    seq = e.payload
                    grown.append((e, len(seq.blocks), e.reserved_total))
                    target = max(past + len(new), it.reserve)
                    seq.blocks.extend(pc.allocate(pool.blocks_for(target) - len(seq.blocks),
                                                  seq.blocks[-1] if seq.blocks else None))
                    self.registry.set_reserved(e, max(e.reserved_total, it.reserve))
                # Copy-on-write: every block this row writes into must be its own.
                for i in range(past // bs, pool.blocks_for(past + len(new))):
                    pc.own(seq, i)
                entries.append(e)
                rows.append(_Row(seq.blocks, past, new, it.want, lora[e.adapter] if e.adapter else None))
            logits = self._forward_rows(rows)
        except BaseException:
            for e in created:
                self.release_cache(e.cache_id, reason="released")
            for e, n_blocks, reserved in grown:
                extra = e.payload.blocks[n_blocks:]
                if extra:
                    pc.release(extra)
                    del e.payload.blocks[n_blocks:]
                self.registry.set_reserved(e, reserved)
            raise
        for it, e in zip(items, entries):
            if it.entry is not None:
                self.registry.extend(e, it.tokens)
            pc.commit(e.payload, e.tokens, e.cache_id)
        return list(zip(entries, logits))

    def _adapters_of(self, items: list[StepItem], field: str,
                     bound: list[tuple[CacheEntry, str, bytes]]) -> dict[str, AdapterWeights]:
        """The LoRA weights a step's rows use (resident now). A new cache takes its item's adapter;
        a live cache keeps its own (another one named is FAILED_PRECONDITION), except an empty cache
        (reserved by ``ReserveKvSlots``) that its first step binds: each such binding is appended
        to ``bound`` as (entry, previous adapter, previous chain root) so a failed step undoes it."""
        names = set()
        for it in items:
            e = it.entry
            if e is not None:
                if it.adapter and it.adapter != e.adapter:
                    e.check_adapter(it.adapter, f"{field}.adapter")
                    bound.append((e, e.adapter, e.payload.root))
                    e.adapter = it.adapter
                    e.payload.root = self.prefix.root(e.payload.salt, it.adapter)
                    e.payload.adapter = it.adapter
                name = e.adapter
            else:
                name = it.adapter
            if name:
                names.add(name)
        if not names:
            return {}
        if self.adapters is None:
            raise errors.unsupported(f"model {self.model_id!r} serves no LoRA adapters", field=f"{field}.adapter")
        return self.adapters.resolve(names, f"{field}.adapter")

    def _forward_rows(self, rows: list[_Row]) -> list[torch.Tensor | None]:
        """One model call over ``rows`` (each: its blocks, past length, new tokens, wanted logits)."""
        q = len(rows[0].tokens)
        if all(r.past == 0 and len(r.tokens) == q for r in rows):
            return self._forward_fresh(rows)
        return self._forward_packed(rows)

    def _slots(self, r: _Row) -> list[int]:
        bs = self.block_size
        return [r.blocks[p // bs] * bs + p % bs for p in range(r.past, r.past + len(r.tokens))]

    def _forward_fresh(self, rows: list[_Row]) -> list[torch.Tensor | None]:
        """Fresh prompts of one length as a ``[B, Q]`` batch: plain causal attention over their own
        new K/V (the model's own implementation; nothing is read from the pool), K/V written."""
        dev, b, q = self.device, len(rows), len(rows[0].tokens)
        ids = torch.tensor([r.tokens for r in rows], dtype=torch.long, device=dev)
        slots = torch.tensor([s for r in rows for s in self._slots(r)], dtype=torch.long, device=dev)
        cache = PagedWriteCache(self.pool, slots=slots, kv_length=q)
        wants = {r.want for r in rows}
        if wants == {"none"}:
            keep: int | torch.Tensor = torch.zeros((b, 0), dtype=torch.long, device=dev)  # lm_head skipped
        elif "all" in wants:
            keep = 0
        else:
            keep = 1
        pos = torch.arange(q, device=dev).expand(b, q)
        lora = self._lora_step(rows)
        with lora_step(lora):
            logits = self.model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True,
                                logits_to_keep=keep).logits
        self._count_lora(lora)
        out: list[torch.Tensor | None] = []
        for i, r in enumerate(rows):
            if r.want == "none":
                out.append(None)
            elif r.want == "all":
                out.append(logits[i].float())
            else:
                out.append(logits[i, -1].float())
        return out

    def _forward_packed(self, rows: list[_Row]) -> list[torch.Tensor | None]:
        """All rows' new tokens concatenated into one ``[1, T]`` sequence (no padding), per-token
        positions, and attention that keeps each row to its own context (:mod:`.packed_attention`)."""
        dev = self.device
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        keep: list[int] = []
        spans: list[tuple[int, int]] = []  # per row: where its logits start in the kept rows, how many
        start = 0
        for r in rows:
            n = len(r.tokens)
            ids += r.tokens
            pos += range(r.past, r.past + n)
            slots += self._slots(r)
            if r.want == "all":
                spans.append((len(keep), n))
                keep += range(start, start + n)
            elif r.want == "last":
                spans.append((len(keep), 1))
                keep.append(start + n - 1)
            else:
                spans.append((len(keep), 0))
            start += n
        step = build_step(self.pool, [(r.blocks, r.past, len(r.tokens)) for r in rows], dev)
        cache = PagedWriteCache(self.pool, slots=torch.tensor(slots, dtype=torch.long, device=dev), kv_length=start)
        lora = self._lora_step(rows)
        with packed_step(step), lora_step(lora):
            logits = self.model(
                input_ids=torch.tensor([ids], dtype=torch.long, device=dev),
                position_ids=torch.tensor([pos], dtype=torch.long, device=dev),
                cache=cache,
                use_cache=True,
                logits_to_keep=torch.tensor(keep, dtype=torch.long, device=dev),
            ).logits[0]
        self._count_lora(lora)
        out: list[torch.Tensor | None] = []
        for r, (k0, k) in zip(rows, spans):
            if r.want == "none":
                out.append(None)
            elif r.want == "all":
                out.append(logits[k0 : k0 + k].float())
            else:
                out.append(logits[k0].float())
        return out


def _checkpoint_dtype(path: Path) -> torch.dtype | None:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}.get(name)


def _load_tokenizer(path: Path, gguf_file: str | None, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    try:
        kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
        if gguf_file:
            kwargs["gguf_file"] = gguf_file
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except Exception as e:  # a checkpoint without a tokenizer still serves token ids
        log.warning("no tokenizer loaded", path=str(path), error=str(e))
        return None
