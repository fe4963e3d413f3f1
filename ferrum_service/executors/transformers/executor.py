"""``HfCausalLmExecutor``: the contract's glue over a transformers causal LM with paged KV caches.

It owns the model, its :class:`~.kv_manager.KvManager` (blocks, admission, prefix cache) and its
:class:`~.forward.PagedForward`, and answers ferrum's ``ModelExecutor`` methods with them: a step
(:meth:`HfCausalLmExecutor._step`) binds adapters, has the KV manager allocate, runs one forward
and commits, or undoes all of it. Metadata, LoRA adapter admin and KV transfer are here too. How
the KV is laid out and what a step costs: the package docstring (:mod:`..transformers`).
"""

from __future__ import annotations

import collections
import math
import time
from pathlib import Path
from typing import Any, Callable

import structlog
import torch

from ...core import errors
from ...core.kv_registry import CacheEntry, CacheRegistry
from ...core.steps import StepRow, Want
from ...core.types import (
    AdmissionLimits,
    CacheHandle,
    ExecutorCapabilities,
    ExecutorMemoryUsage,
    ExecutorStatus,
    KvCapacity,
    KvSlotCapacitySnapshot,
    KvSlotRequest,
    KvSlotReservation,
    MemoryRequirements,
    ModelInfo,
    PrefillInput,
    StepCost,
)
from ..base import KvLayout
from ..item_steps import ItemStepExecutor
from . import model_facts
from .decode_graphs import DecodeRunner, max_table_blocks
from .forward import PagedForward, Row
from .kv_manager import KvManager, StagedImport
from .loading import DTYPES, device_name, dtype_name, load_causal_lm
from .lora import AdapterSet, AdapterWeights
from .packed_attention import base_implementation, install, use_paged_op
from .paged_kv import BlockPool
from .prefix_cache import PrefixCache, SeqBlocks

log = structlog.get_logger(__name__)

#: KV budget when none is configured (at least one full-length sequence always fits).
DEFAULT_KV_BUDGET_BYTES = 1 << 30


DECODE_MODES = ("auto", "off", "graphs", "static")


def decode_mode(name: str, device: torch.device) -> str:
    """``off`` | ``graphs`` (captured on CUDA, static-eager elsewhere) | ``static`` for a
    ``decode_graphs`` option (:class:`HfCausalLmExecutor`) on ``device``."""
    name = str(name or "auto").lower()
    if name not in DECODE_MODES:
        raise errors.FerrumError(errors.ErrorKind.CONFIG,
                                 f"decode_graphs={name!r} is not one of {', '.join(DECODE_MODES)}")
    if name == "auto":
        return "graphs" if device.type == "cuda" else "off"
    return name


class HfCausalLmExecutor(ItemStepExecutor):
    """A transformers causal LM with paged per-sequence KV caches (see the package docstring)."""

    kind = "hf-causal-lm"
    profiler = "torch"
    #: A lone stream's decode steps run back to back on the worker (the batcher's chain): on a GPU
    #: the next step starts without waiting for the event loop, whose work on the previous token
    #: overlaps the step (each row is posted as the next forward starts: ``StepPlan.on_forward``).
    chains_decodes = True

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
        decode_graphs: str = "auto",
    ) -> None:
        """Wrap a loaded model (use :meth:`from_path` to load one).

        ``kv_budget_tokens`` (or ``kv_budget_bytes``) sizes the KV pool over all caches, rounded up
        to whole blocks; default :data:`DEFAULT_KV_BUDGET_BYTES`, and never less than one
        full-length sequence. ``max_batch_size`` / ``max_batch_tokens`` bound one forward (rows /
        new tokens) and are what :meth:`admission_limits` reports. ``weight_format`` /
        ``num_parameters`` describe weights transformed after loading (``int8``: see
        ``int8_weights.py``). ``prefix_cache=False`` turns automatic prefix caching off (forks
        still share blocks). ``max_adapters``: LoRA adapters resident at once (0 = no LoRA).
        ``decode_graphs``: decode-only steps through static buffers (:mod:`.decode_graphs`):
        ``auto`` = captured as CUDA graphs on CUDA, off elsewhere; ``off``; ``graphs`` = as auto,
        and the static path eagerly on a CPU; ``static`` = the static path eagerly on any device.
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
        if self.device.type == "cuda":
            # The model's own attention (a prompt's fresh forward) off cuDNN's SDPA too: it builds
            # a graph for every new shape (see packed_attention._CUDA_SDPA).
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.dtype = param.dtype
        self.config = model.config
        self.block_size = block_size
        self.max_batch_size = max_batch_size

        shape = model_facts.probe_kv_shape(model, self.device)
        num_layers, kv_heads, k_dim, v_dim = shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.v_head_dim
        self.num_layers, self.num_kv_heads, self.head_dim, self.v_head_dim = num_layers, kv_heads, k_dim, v_dim
        self.max_sequence_length = model_facts.max_sequence_length(self.config, tokenizer, shape.sliding)
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
        mode = decode_mode(decode_graphs, self.device)
        self.pool = BlockPool(
            num_layers=num_layers,
            num_kv_heads=kv_heads,
            head_dim=k_dim,
            v_head_dim=v_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=self.dtype,
            device=self.device,
            spare_blocks=1 if mode != "off" else 0,
        )
        self.prefix = PrefixCache(self.pool, model_id=model_id, enabled=prefix_cache)
        self.adapters = (AdapterSet(model, device=self.device, dtype=self.dtype, max_resident=max_adapters)
                         if max_adapters > 0 else None)
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
        self.kv = KvManager(self.pool, self.prefix, self.registry, model_id=model_id,
                            max_sequence_length=self.max_sequence_length)
        self.forward_rows = PagedForward(model, self.pool, self.adapters)
        use_paged_op(self.pool, self.device)  # CPU: build (first time, then cached) or load the op now
        self._pad_id = model_facts.pad_id(self.config, tokenizer, self.vocab_size)
        self.decode_runner: DecodeRunner | None = None
        if mode != "off" and self.forward_rows.paged_op_ok:  # soft-capped attention stays on the packed path
            self.decode_runner = DecodeRunner(model, self.pool, max_rows=max_batch_size, pad_id=self._pad_id,
                                       max_blocks=max_table_blocks(self.max_sequence_length, block_size),
                                       capture=mode == "graphs")
            self.forward_rows.decode_runner = self.decode_runner
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
        decode_graphs: str = "auto",
    ) -> "HfCausalLmExecutor":
        """Load a local checkpoint directory, or a GGUF file (``gguf_file=`` inside ``path``, or
        ``path`` itself ending in ``.gguf``).

        ``device``: auto | cpu | cuda | cuda:N. ``dtype``: auto | fp32 | fp16 | bf16 | int8 (auto =
        fp32 on CPU, the checkpoint's half dtype or bf16 on CUDA; GGUF weights are dequantised to
        it; int8 = int8 weight-only linear layers with bf16 activations and KV, see
        ``int8_weights.py``). Remote code runs only with ``trust_remote_code=True``; pickled weights
        (``*.bin``: unpickling can run code) load only with ``allow_pickle=True``, otherwise only
        safetensors or GGUF. Nothing is downloaded (:func:`.loading.load_causal_lm`).
        """
        loaded = load_causal_lm(path, model_id=model_id, device=device, dtype=dtype, gguf_file=gguf_file,
                                trust_remote_code=trust_remote_code, allow_pickle=allow_pickle,
                                attn_implementation=attn_implementation)
        ex = cls(
            loaded.model,
            loaded.tokenizer,
            model_id=loaded.model_id,
            kv_budget_tokens=kv_budget_tokens,
            kv_budget_bytes=kv_budget_bytes,
            block_size=block_size,
            max_batch_size=max_batch_size,
            max_batch_tokens=max_batch_tokens,
            source=loaded.source,
            weight_format=loaded.weight_format,
            num_parameters=loaded.num_parameters,
            prefix_cache=prefix_cache,
            max_adapters=max_adapters,
            decode_graphs=decode_graphs,
        )
        i = ex._info
        log.info(
            "causal LM ready",
            model_id=loaded.model_id,
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
            seconds=round(time.perf_counter() - loaded.started, 2),
        )
        return ex

    @property
    def vocab_size(self) -> int:
        return model_facts.vocab_size(self.model)

    def _build_info(self) -> ModelInfo:
        cfg = self.config
        mt = getattr(cfg, "model_type", "") or ""
        tok = self._tokenizer
        return ModelInfo(
            model_id=self.model_id,
            model_type=model_facts.MODEL_TYPES.get(mt, "custom"),
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
            eos_token_ids=model_facts.eos_token_ids(self.model, tok),
            has_tokenizer=tok is not None,
            has_chat_template=bool(getattr(tok, "chat_template", None)),
            prefix_cache=self.prefix.recipe(),
        )

    # ---- metadata ------------------------------------------------------------------------------
    def info(self) -> ModelInfo:
        if self.decode_runner is not None:
            self._info.metadata.update(self.decode_runner.metadata())
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
        return self.kv.capacity(super().kv_capacity())

    def cache_metrics(self) -> dict[str, Any]:
        """Prefix-cache counters (ferrum's ``cache_metrics_snapshot``: paged-KV prefix reuse)."""
        return self.kv.metrics()

    def admission_limits(self) -> AdmissionLimits:
        return AdmissionLimits(
            maximum_active_sequences=self.max_batch_size, maximum_scheduled_tokens=self.max_batch_tokens
        )

    def step_cost(self, rows: list[tuple[int, int]], logits_rows: int) -> StepCost:
        """One forward (:class:`.forward.PagedForward`): the step's real tokens through the model
        (packed; fresh equal-length prompts are the same count as a batch), and per layer, at
        most, each row's own context copied once (scattered blocks), its attention scores over
        that context, and a chunk's small ``[n, past + n]`` mask; activations per token; fp32
        logits for the rows (or positions) asked for."""
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

    def adapter_bindings(self) -> "collections.Counter[str]":
        """Live caches per adapter, plus the staged imports bound to one."""
        return super().adapter_bindings() + self.kv.staged_adapters

    def adapter_digest(self, name: str) -> str:
        a = self.adapters.adapters.get(name) if self.adapters is not None else None
        return a.digest if a is not None else ""

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

    # ---- KV: admission, reservations, truncation, forks (the KV manager) --------------------------
    def cached_prefix(self, inp: PrefillInput) -> int:
        """Tokens a prefill of ``inp`` (a new prompt) would take from the prefix cache now."""
        return self.kv.cached_prefix(inp)

    def admit_kv(self, grow: list[tuple[CacheEntry, int]], new: list[StepRow], field: str) -> None:
        """The pool's admission for a step the server is about to queue (:meth:`.KvManager.plan`)."""
        self.kv.admit_kv(grow, new, field)

    def kv_slot_capacity(self) -> KvSlotCapacitySnapshot:
        """The block pool now (allocates nothing); evictable cached blocks count as free."""
        return self.kv.slot_capacity()

    def reserve_kv_slots(self, requests: list[KvSlotRequest]) -> KvSlotReservation:
        """Give each cache its blocks now, all or nothing (:meth:`.KvManager.reserve_kv_slots`)."""
        return self.kv.reserve_kv_slots(requests)

    def truncate_kv(self, cache_id: str, new_len: int) -> tuple[CacheHandle, int]:
        """Roll the cache back to ``new_len`` tokens; blocks no longer needed are let go (to the
        pool, or, when cached, to the evictable list). A kept block that others share is copied
        when this cache next writes into it, so they never see the change."""
        entry = self.registry.get(cache_id)
        if not 0 <= new_len <= entry.num_tokens:
            raise errors.out_of_range(
                f"new_len must be in [0, {entry.num_tokens}], not {new_len}", field="new_len", num_tokens=entry.num_tokens
            )
        removed = self.kv.truncate(entry, new_len)
        return self.handle(entry), removed

    def fork_cache(self, cache_id: str, keep_tokens: int | None = None, reserve_tokens: int = 0) -> tuple[CacheEntry, int]:
        """A new cache holding ``cache_id``'s first ``keep_tokens`` tokens, sharing their blocks
        (copy-on-write). Returns (the new entry, blocks shared)."""
        src, keep = self._fork_source(cache_id, keep_tokens)
        return self.kv.fork(src, keep, int(reserve_tokens or 0))

    def free_payload(self, entry: CacheEntry) -> int:
        """Let go of the cache's blocks (cached ones stay evictable); the bytes they held."""
        return self.kv.free_payload(entry)

    def shutdown(self) -> int:
        n = super().shutdown()
        self.clear_prefix_cache()
        return n

    def clear_prefix_cache(self) -> bool:
        self.prefix.clear()
        return True

    # ---- KV transfer (ExportKv / ImportKv) -------------------------------------------------------
    def kv_layout(self) -> KvLayout:
        """This model's K/V as the wire describes them; the fingerprint
        (:func:`.model_facts.weights_fingerprint`) is computed once, on first use, on the worker."""
        if self._kv_layout is None:
            self._kv_layout = KvLayout(
                model_id=self.model_id, fingerprint=model_facts.weights_fingerprint(self.kind, self.model),
                dtype=dtype_name(self.pool.dtype), num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim, v_head_dim=self.v_head_dim, executor=self.kind,
                element_size=self.pool.element_size)
        return self._kv_layout

    def known_kv_layout(self) -> KvLayout | None:
        return self._kv_layout

    def export_kv_layer(self, cache_id: str, start: int, end: int, layer: int) -> tuple[bytes, bytes]:
        """K and V of tokens [start, end) of ``layer``, read from the pool (``[n, kv_heads, dim]``
        row-major, the pool's dtype, little-endian), as bytes on the host."""
        entry = self.registry.get(cache_id)
        if not 0 <= start < end <= entry.num_tokens:
            raise errors.out_of_range(f"token range [{start}, {end}) is outside the cache's {entry.num_tokens} tokens",
                                      field="to_token")
        return self.kv.export_layer(entry, start, end, layer)

    def import_begin(self, tokens: list[int], reserve_tokens: int, cache_salt: str, adapter: str = "",
                     adapter_digest: str = "") -> StagedImport:
        """Admit ``len(tokens)`` (or ``reserve_tokens``) of KV and take its blocks now (private,
        zeroed, in no registry and no index): RESOURCE_EXHAUSTED before any byte is kept. K/V
        computed with a LoRA ``adapter`` need that adapter loaded here, with the same digest when
        the sender gives one (FAILED_PRECONDITION); the staged import binds the adapter (it cannot
        be unloaded until the import ends)."""
        self.check_up()
        if adapter and (self.adapters is None or adapter not in self.adapters.adapters):
            raise errors.failed_precondition(
                f"the K/V were computed with LoRA adapter {adapter!r}, which is not loaded on model "
                f"{self.model_id!r} here", field="header.adapter")
        if adapter and adapter_digest and adapter_digest != self.adapter_digest(adapter):
            raise errors.failed_precondition(
                f"the K/V were computed with another adapter {adapter!r} than this server's (their digests "
                "differ)", field="header.adapter_digest")
        return self.kv.stage_import(tokens, reserve_tokens, cache_salt, adapter)

    def import_write(self, staged: StagedImport, layer: int, start: int, end: int, key: bytes, value: bytes) -> None:
        """Write one chunk (tokens [start, end) of ``layer``) into the staged blocks."""
        self.kv.write_import(staged, layer, start, end, key, value)

    def import_extend(self, staged: StagedImport, tokens: list[int]) -> None:
        """Append ``tokens`` to the staged import (a migration's tail after its pre-copy)."""
        self.kv.extend_import(staged, tokens)

    def import_commit(self, staged: StagedImport) -> tuple[CacheEntry, int]:
        """Register the staged blocks as a new cache holding the imported tokens, then key its full
        blocks into the prefix cache (block events, as for a computed prompt)."""
        return self.kv.commit_import(staged)

    def import_abort(self, staged: StagedImport) -> None:
        """Give the staged blocks back (idempotent)."""
        self.kv.abort_import(staged)

    # ---- compute -------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, logits_dtype: str = "fp32") -> torch.Tensor:
        """A stateless full forward of ``[batch, seq]`` token ids; logits ``[batch, seq, vocab]``."""
        ids = torch.as_tensor(input_ids).to(device=self.device, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        out = self.model(input_ids=ids, use_cache=False)
        return out.logits.to(DTYPES.get(logits_dtype, torch.float32))

    @torch.inference_mode()
    def warmup(self) -> None:
        """One tiny prefill + decode through the paged path (allocates and frees one block); on
        CUDA, every decode bucket's graph is captured first."""
        if self.decode_runner is not None:
            self.decode_runner.capture_all()
        if self.prefix.available_blocks < 1:
            return
        ((entry, _, _),) = self._step([StepRow(None, [self._pad_id], Want.LAST, bypass=True)], "warmup")
        try:
            self._step([StepRow(entry, [self._pad_id], Want.LAST)], "warmup")
        finally:
            self.release_cache(entry.cache_id)

    @torch.inference_mode()
    def _step(self, items: list[StepRow], field: str, on_forward: Callable[[], None] | None = None
              ) -> list[tuple[CacheEntry, torch.Tensor | None, int]]:
        """Admit, allocate, run one forward over all items, commit. On failure the step leaves no
        trace: caches it created are released, blocks it grew are returned, reservations and the
        adapter bindings of empty caches are put back. ``on_forward``: called right before the
        forward (``StepPlan.on_forward``)."""
        self.check_up()
        if len(items) > self.max_batch_size:
            raise errors.invalid(
                f"{field}: {len(items)} sequences in one step; this executor's limit is {self.max_batch_size}",
                field=field,
                limit=self.max_batch_size,
            )
        new_tokens_in_step = sum(len(it.tokens) for it in items)
        if new_tokens_in_step > self.max_batch_tokens:
            raise errors.invalid(
                f"{field}: {new_tokens_in_step} tokens in one step; this executor's limit is {self.max_batch_tokens}",
                field=field,
                limit=self.max_batch_tokens,
            )

        bound: list[tuple[CacheEntry, str, bytes]] = []  # empty caches this step binds, to unbind on failure
        try:
            lora = self._adapters_of(items, field, bound)
            step = self.kv.allocate_step(items, field)
            if on_forward is not None:
                on_forward()
            try:
                logits = self.forward_rows([
                    Row(step.blocks(i), step.pasts[i], step.new_tokens[i], it.want,
                        lora[e.adapter] if e.adapter else None)
                    for i, (it, e) in enumerate(zip(items, step.entries))])
            except BaseException:
                self.kv.rollback(step)
                raise
        except BaseException:
            for e, adapter, root in reversed(bound):
                self.kv.unbind_adapter(e, adapter, root)
            raise
        self.kv.commit(items, step)
        return list(zip(step.entries, logits, step.cached))

    def _adapters_of(self, items: list[StepRow], field: str,
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
                    bound.append(self.kv.bind_adapter(e, it.adapter))
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


__all__ = ["DEFAULT_KV_BUDGET_BYTES", "HfCausalLmExecutor"]
