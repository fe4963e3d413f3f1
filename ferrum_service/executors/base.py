"""The executor interface: ferrum's ``ModelExecutor`` trait in Python.

Every executor (stub, configurable, transformers causal LM, BERT) subclasses :class:`ModelExecutor`.
The gRPC layer validates requests (token ids inside the vocabulary, caches that exist and are not
busy, positions that match) and converts messages; executors do the work. Defaults follow ferrum's
trait defaults: ``batch_prefill`` / ``batch_decode`` / ``forward_verify`` loop serially,
``unified_decode`` and ``forward`` are unsupported, ``truncate_kv`` only moves the length.

Threading: the server runs each executor's calls one at a time on that executor's own worker
thread (``inline = True`` executors run on the event loop: they do no heavy work), so an executor
needs no locking of its own model state.
"""

from __future__ import annotations

import abc
import collections
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..core import errors
from ..core.kv_registry import CacheEntry, CacheRegistry
from ..core.modes import CacheEvent, ExecutorState
from ..core.steps import RowKind, RowOutput, StepPlan, StepRow, Want
from ..core.types import (
    AdmissionLimits,
    CacheHandle,
    DecodeInput,
    DecodeOutput,
    ExecutorCapabilities,
    ExecutorStatus,
    KvCapacity,
    KvSlotCapacitySnapshot,
    KvSlotRequest,
    KvSlotReservation,
    LogitsPolicy,
    ModelInfo,
    OutputMode,
    PrefillInput,
    PrefillOutput,
    StepCost,
    UnifiedItem,
    UnifiedResult,
    VerifyOutput,
)

if TYPE_CHECKING:
    from ..core.types import Rows


def _stack(rows: list) -> Rows:
    """Rows of one kind (numpy arrays or torch tensors) stacked into one block."""
    if isinstance(rows[0], np.ndarray):
        return np.stack(rows)
    import torch

    return torch.stack(rows)


@dataclass
class KvLayout:
    """How an executor's K/V look on the wire (``KvTransferHeader``)."""

    model_id: str
    fingerprint: str  # hex SHA-256 of the executor kind, config and weights
    dtype: str  # fp32 | fp16 | bf16
    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    executor: str
    element_size: int
    # "" = per-layer K/V tensors (export_kv_layer / import_write); otherwise the executor's own
    # serialisation of a whole sequence (export_kv_state / import_write_state), e.g. llama.cpp's.
    state_format: str = ""


@dataclass
class PrefixStats:
    """Prefix-cache counters since start (reported by ``CacheMetrics``, ``Loads`` and Prometheus)."""

    queried_tokens: int = 0  # prompt tokens of new sequences that looked the cache up
    hit_tokens: int = 0  # of those, tokens taken from the cache instead of computed
    lookups: int = 0
    hits: int = 0  # lookups that took at least one block
    evicted_blocks: int = 0
    cow_copies: int = 0
    forks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class Tokenizer(Protocol):
    """What the server needs of a tokenizer (a transformers tokenizer fits)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class OperationStats:
    """Counters behind ``status()`` (ferrum's ``ExecutorStatus`` / ``ExecutorMetrics``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.prefill_ops = 0
        self.decode_ops = 0
        self.prefill_time_s = 0.0
        self.decode_time_s = 0.0
        self.decode_tokens = 0
        self.last_op: float | None = None
        self.current_batch_size = 0
        self._recent_prefill: list[float] = []
        self._recent_decode: list[float] = []

    def record(self, kind: str, seconds: float, rows: int = 1) -> None:
        with self._lock:
            self.last_op = time.monotonic()
            self.current_batch_size = rows
            if kind == "prefill":
                self.prefill_ops += 1
                self.prefill_time_s += seconds
                self._recent_prefill = (self._recent_prefill + [seconds])[-512:]
            else:
                self.decode_ops += 1
                self.decode_time_s += seconds
                self.decode_tokens += rows
                self._recent_decode = (self._recent_decode + [seconds])[-512:]

    @staticmethod
    def _p95(xs: list[float]) -> float:
        if not xs:
            return 0.0
        s = sorted(xs)
        return s[min(len(s) - 1, int(0.95 * len(s)))] * 1e3

    def latencies(self) -> dict[str, dict[str, int]]:
        """p50/p99 (ns) and count of the recent prefill and decode steps."""
        def summ(xs: list[float]) -> dict[str, int]:
            if not xs:
                return {"p50_ns": 0, "p99_ns": 0, "count": 0}
            s = sorted(xs)
            pick = lambda q: int(s[min(len(s) - 1, int(q * len(s)))] * 1e9)  # noqa: E731
            return {"p50_ns": pick(0.5), "p99_ns": pick(0.99), "count": len(s)}

        with self._lock:
            return {"prefill": summ(self._recent_prefill), "decode": summ(self._recent_decode)}

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "prefill_ops": self.prefill_ops,
                "decode_ops": self.decode_ops,
                "avg_prefill_ms": 1e3 * self.prefill_time_s / self.prefill_ops if self.prefill_ops else 0.0,
                "avg_decode_ms": 1e3 * self.decode_time_s / self.decode_ops if self.decode_ops else 0.0,
                "p95_prefill_ms": self._p95(self._recent_prefill),
                "p95_decode_ms": self._p95(self._recent_decode),
                "throughput_tps": self.decode_tokens / self.decode_time_s if self.decode_time_s else 0.0,
                "ns_since_last": None if self.last_op is None else int((time.monotonic() - self.last_op) * 1e9),
                "current_batch_size": self.current_batch_size,
            }


class ModelExecutor(abc.ABC):
    """ferrum's ``ModelExecutor``. Subclasses set ``self.registry`` in ``__init__``."""

    #: Executor kind as reported in ``ModelInfo.executor``.
    kind: str = "abstract"
    #: True = calls are cheap enough to run on the event loop thread (no worker-thread hop).
    inline: bool = False
    #: "torch": its steps run torch ops on its worker thread, which ``torch.profiler`` records
    #: (the vLLM protocol's StartProfile, ``hosting/profiler.py``); "" = no profiler applies.
    profiler: str = ""
    #: Decode steps may carry draft tokens (``DecodeInput.draft``) verified in the same forward.
    supports_draft_rows: bool = False
    #: A lone Generate stream's decode steps may run back to back on the worker (the batcher's
    #: chain, ``hosting/batcher.py``).
    chains_decodes: bool = False

    registry: CacheRegistry
    #: The LoRA adapters registered on this model (``lora.AdapterSet``); None = it serves none.
    adapters: Any = None
    #: The executor's prefix cache, None = it keeps none. The server reads ``stats``
    #: (:class:`PrefixStats`), ``cached_blocks``, ``evictable``, ``used_blocks`` and calls
    #: ``subscribe(sink)`` (its block events); a paged one also has ``pool`` (its blocks and bytes).
    prefix: Any = None
    #: Where the weights were read from (a model folder or a GGUF file); None = built in memory.
    source: Any = None
    #: Tokens per KV block: full blocks are what a migration pre-copies; 1 = no block structure.
    block_size: int = 1
    #: Structured-output compiled constraints of this model (``core.guided.Guides``), made by
    #: ``core.guided.guides_of`` on first use; None until then.
    guides: Any = None

    def __init__(self) -> None:
        self.stats = OperationStats()
        self.state = ExecutorState.READY

    # ---- metadata ------------------------------------------------------------------------------
    @abc.abstractmethod
    def info(self) -> ModelInfo:
        """``info()``."""

    @abc.abstractmethod
    def capabilities(self) -> ExecutorCapabilities:
        """``capabilities()``."""

    def status(self) -> ExecutorStatus:
        """``status()``, from the operation counters and the registry."""
        s = self.stats.snapshot()
        st = ExecutorStatus(
            state=self.state,
            is_ready=ExecutorState(self.state).is_ready,
            current_batch_size=s["current_batch_size"],
            prefill_operations=s["prefill_ops"],
            decode_operations=s["decode_ops"],
            avg_prefill_time_ms=s["avg_prefill_ms"],
            avg_decode_time_ms=s["avg_decode_ms"],
            ns_since_last_operation=s["ns_since_last"],
            active_caches=len(self.registry),
        )
        used = self.registry.used_tokens * self.registry.bytes_per_token
        total = self.registry.total_tokens * self.registry.bytes_per_token
        st.memory_usage.allocated_bytes = total
        st.memory_usage.used_bytes = used
        st.memory_usage.peak_bytes = self.registry.peak_tokens * self.registry.bytes_per_token
        st.memory_usage.utilization_percent = 100.0 * used / total if total else 0.0
        return st

    def kv_capacity(self) -> KvCapacity:
        """``kv_capacity()`` and the budget behind it."""
        r = self.registry
        used = r.used_tokens
        return KvCapacity(
            per_request_tokens=r.per_request_tokens,
            total_tokens=r.total_tokens,
            used_tokens=used,
            free_tokens=r.free_tokens,
            reserved_tokens=r.reserved_tokens,
            total_bytes=r.total_tokens * r.bytes_per_token,
            used_bytes=used * r.bytes_per_token,
            bytes_per_token=r.bytes_per_token,
        )

    def admission_limits(self) -> AdmissionLimits | None:
        """``admission_limits()``; None = no ceilings."""
        return None

    def step_cost(self, rows: list[tuple[int, int]], logits_rows: int) -> StepCost:
        """What one forward over ``rows`` — (new tokens, tokens already cached) per sequence —
        costs, keeping ``logits_rows`` rows of vocabulary logits. The server checks it against its
        per-step ceilings before any work. Default: no padding and no model (negligible scratch)."""
        return StepCost(positions=sum(q for q, _ in rows))

    # ---- compute -------------------------------------------------------------------------------
    @abc.abstractmethod
    def prefill(self, inp: PrefillInput) -> PrefillOutput:
        """``prefill()``: create (or continue, with ``inp.cache_id``) a cache."""

    def batch_prefill(self, inputs: list[PrefillInput]) -> list[PrefillOutput]:
        """``batch_prefill()``; default = serial prefills, undone on failure (all or nothing)."""
        outs: list[PrefillOutput] = []
        try:
            for inp in inputs:
                outs.append(self.prefill(inp))
        except Exception:
            for inp, out in zip(inputs, outs):
                if not inp.cache_id:
                    self.release_cache(out.cache.cache_id)
            raise
        return outs

    @abc.abstractmethod
    def decode(self, inp: DecodeInput) -> DecodeOutput:
        """``decode()``: feed one token, return the next row."""

    def batch_decode(self, inputs: list[DecodeInput]) -> list[DecodeOutput]:
        """``batch_decode()``; default = serial decodes (ferrum's default)."""
        return [self.decode(inp) for inp in inputs]

    def execute(self, plan: "StepPlan") -> "list[RowOutput]":
        """Run one step (``core/steps.py``): every row of ``plan`` in one call, all or nothing —
        the one entry the server calls. Default: the rows one by one through ``prefill`` /
        ``decode`` / ``forward_verify``; if one fails, the rows before it are undone (caches they
        created released, caches they continued truncated back). Executors with one forward for
        all rows override it."""
        done: list[tuple[StepRow, RowOutput, int]] = []
        try:
            for k, r in enumerate(plan.rows):
                before = r.entry.num_tokens if r.entry is not None else 0
                done.append((r, self._execute_row(r, f"{plan.field}[{k}]"), before))
        except Exception:
            for r, out, before in reversed(done):
                if r.entry is not None:
                    self.truncate_kv(r.entry.cache_id, before)
                else:
                    self.release_cache(out.cache.cache_id)
            raise
        return [out for _, out, _ in done]

    def _execute_row(self, r: "StepRow", field: str) -> "RowOutput":
        policy = r.policy or LogitsPolicy(mode=OutputMode.NONE)
        if r.kind is RowKind.VERIFY:
            v = self.forward_verify(r.entry.cache_id, r.tokens, policy)
            return RowOutput(v.cache, v.rows)
        if r.kind is RowKind.DECODE and r.entry is not None and len(r.tokens) == 1:
            d = self.decode(DecodeInput(cache_id=r.entry.cache_id, token_id=r.tokens[0], policy=policy))
            return RowOutput(d.cache, d.logits if r.want is not Want.NONE else None)
        p = self.prefill(PrefillInput(token_ids=list(r.tokens), cache_id=r.entry.cache_id if r.entry else "",
                                      policy=policy, reserve_tokens=r.reserve, all_positions=r.want is Want.ALL,
                                      cache_salt=r.salt, bypass_prefix_cache=r.bypass, adapter=r.adapter))
        logits = p.all_logits if r.want is Want.ALL else p.logits if r.want is Want.LAST else None
        return RowOutput(p.cache, logits, p.embedding, p.cached_tokens)

    def mixed_step(
        self, prefills: list[PrefillInput], decodes: list[DecodeInput]
    ) -> tuple[list[PrefillOutput], list[DecodeOutput]]:
        """Prompts and decode steps of *different* sequences in one :meth:`execute`, all or
        nothing (in-process callers; the server builds its plans itself)."""
        reg = self.registry
        rows = [StepRow.prompt(i, reg.get(i.cache_id, field="inputs.cache_id") if i.cache_id else None)
                for i in prefills]
        rows += [StepRow.decode(i, reg.get(i.cache_id, field="inputs.cache_id"), "inputs") for i in decodes]
        outs = self.execute(StepPlan(rows, "inputs"))
        n = len(prefills)
        return prefill_outputs(rows[:n], outs[:n]), [DecodeOutput(cache=o.cache, logits=o.logits) for o in outs[n:]]

    def unified_decode(self, items: list[UnifiedItem]) -> list[UnifiedResult]:
        """``unified_decode()``; default unsupported (ferrum's default)."""
        raise errors.unsupported(f"unified_decode is not implemented by the {self.kind} executor")

    def forward(self, input_ids: np.ndarray, logits_dtype: str = "fp32") -> Rows:
        """``forward()``; default unsupported (ferrum's default)."""
        raise errors.unsupported(f"forward is not supported by the {self.kind} executor")

    def forward_verify(self, cache_id: str, token_ids: list[int], policy: LogitsPolicy) -> VerifyOutput:
        """``forward_verify()``; default = N+1 serial decode steps ("correct but slow")."""
        base = self.registry.get(cache_id).num_tokens
        rows = []
        out = None
        for t in token_ids:
            out = self.decode(DecodeInput(cache_id=cache_id, token_id=t, policy=policy))
            rows.append(out.logits)
        assert out is not None
        return VerifyOutput(rows=_stack(rows), cache=out.cache, base_len=base)

    def truncate_kv(self, cache_id: str, new_len: int) -> tuple[CacheHandle, int]:
        """``truncate_kv()``; default moves the length only (executors with no KV tensors)."""
        entry = self.registry.get(cache_id)
        removed = self.registry.truncate(entry, new_len)
        return self.handle(entry), removed

    def fork_cache(self, cache_id: str, keep_tokens: int | None = None, reserve_tokens: int = 0) -> tuple[CacheEntry, int]:
        """Not in ferrum's trait: a new cache sharing ``cache_id``'s first tokens (copy-on-write).
        Returns (the new entry, blocks shared). Default unsupported."""
        raise errors.unsupported(f"ForkCache is not supported by the {self.kind} executor")

    # ---- KV transfer between servers (ExportKv / ImportKv; see ``kv_transfer.py``) ------------
    def kv_layout(self) -> "KvLayout":
        """What this executor's K/V are (model fingerprint, dtype, shape); may take long the first
        time (the fingerprint reads every weight): call it on the worker. Default unsupported."""
        raise errors.unsupported(f"KV transfer (ExportKv / ImportKv) is not supported by the {self.kind} executor")

    def known_kv_layout(self) -> "KvLayout | None":
        """:meth:`kv_layout` once it has been computed, else None; no work, safe from any thread."""
        return None

    def export_kv_state(self, cache_id: str) -> bytes:
        """The whole sequence as the executor serialises it (``KvLayout.state_format`` non-empty,
        e.g. llama.cpp's sequence state), instead of per-layer K/V. Default unsupported."""
        raise errors.unsupported(f"ExportKv of a sequence state is not supported by the {self.kind} executor")

    def export_kv_layer(self, cache_id: str, start: int, end: int, layer: int) -> tuple[bytes, bytes]:
        """K and V bytes of tokens [start, end) of one layer (``[n, kv_heads, head_dim]``, row-major)."""
        raise errors.unsupported(f"ExportKv is not supported by the {self.kind} executor")

    def import_begin(self, tokens: list[int], reserve_tokens: int, cache_salt: str, adapter: str = "",
                     adapter_digest: str = "") -> Any:
        """Admit and stage a new cache of ``tokens`` (RESOURCE_EXHAUSTED when it cannot fit); the
        staged state is written by :meth:`import_write` and becomes a cache at :meth:`import_commit`
        or is dropped by :meth:`import_abort`. ``adapter_digest`` (when given) must be the digest
        of this server's ``adapter`` (FAILED_PRECONDITION)."""
        raise errors.unsupported(f"ImportKv is not supported by the {self.kind} executor")

    def import_write(self, staged: Any, layer: int, start: int, end: int, key: bytes, value: bytes) -> None:
        """Write tokens [start, end) of one layer's K and V into a staged import."""
        raise errors.unsupported(f"ImportKv is not supported by the {self.kind} executor")

    def import_write_state(self, staged: Any, data: bytes) -> None:
        """Append ``data`` (a part of a sequence state, see :meth:`export_kv_state`) to a staged
        import; it is loaded at :meth:`import_commit`."""
        raise errors.unsupported(f"ImportKv of a sequence state is not supported by the {self.kind} executor")

    def import_extend(self, staged: Any, tokens: list[int]) -> None:
        """Append ``tokens`` to a staged (uncommitted) import, inside what :meth:`import_begin`
        admitted (OUT_OF_RANGE beyond it): :meth:`import_write` may then write their K/V. How a
        migration's tail follows its pre-copy (``migration.py``). Default unsupported."""
        raise errors.unsupported(f"extending a staged import is not supported by the {self.kind} executor")

    def import_commit(self, staged: Any) -> tuple[CacheEntry, int]:
        """The staged import as a live cache: (its entry, full blocks it added to the prefix cache)."""
        raise errors.unsupported(f"ImportKv is not supported by the {self.kind} executor")

    def import_abort(self, staged: Any) -> None:
        """Drop a staged import (idempotent): nothing of it is kept."""

    def cached_prefix(self, inp: PrefillInput) -> int:
        """Leading tokens of a new prompt the executor's prefix cache holds now (what a prefill of
        it would not compute); 0 without a prefix cache. Takes nothing."""
        return 0

    def admit_kv(self, grow: list[tuple[CacheEntry, int]], new: list, field: str) -> None:
        """Admission for a step the server is about to queue, before any work: ``grow`` = live
        caches and the length each will reach; ``new`` = the caches it creates (``StepRow``:
        tokens, reservation, prefix-cache options). Default: the registry's token budget."""
        reg = self.registry
        need = sum(reg.growth(e, n) for e, n in grow) + sum(max(len(i.tokens), i.reserve) for i in new)
        reg.admit(need, field, new_caches=len(new))

    def release_cache(self, cache_id: str, reason: CacheEvent = CacheEvent.RELEASED) -> tuple[bool, int, int]:
        """``release_cache()``: (released, freed_bytes, freed_tokens); idempotent."""
        entry = self.registry.release(cache_id, reason=reason)
        if entry is None:
            return False, 0, 0
        freed = self.free_payload(entry)
        return True, freed, entry.num_tokens

    def free_payload(self, entry: CacheEntry) -> int:
        """Drop an executor's tensors for a released cache; return the bytes given back."""
        entry.payload = None
        return entry.num_tokens * self.registry.bytes_per_token

    def reserve_kv_slots(self, requests: list[KvSlotRequest]) -> KvSlotReservation | None:
        """``reserve_kv_slots()``; None = no paged admission (ferrum's default ``Ok(None)``)."""
        return None

    def kv_slot_capacity(self) -> KvSlotCapacitySnapshot | None:
        """``kv_slot_capacity_snapshot()``; None by default."""
        return None

    def cache_metrics(self) -> dict[str, Any] | None:
        """``cache_metrics_snapshot()``; None by default."""
        return None

    def lora_metrics(self) -> dict[str, Any] | None:
        """``lora_metrics_snapshot()``; None by default."""
        return None

    # ---- LoRA adapters (LoadAdapter / UnloadAdapter / ListAdapters) -----------------------------
    def load_adapter(self, name: str, path: str) -> tuple[Any, bool]:
        """Register adapter ``name`` from a PEFT directory: (its ``lora.Adapter``, whether it was
        read now). Default unsupported."""
        raise errors.unsupported(f"model {self.registry.model_id!r} ({self.kind}) serves no LoRA adapters")

    def unload_adapter(self, name: str) -> tuple[bool, int]:
        """Forget adapter ``name``: (whether it was loaded, prefix blocks dropped with it)."""
        raise errors.unsupported(f"model {self.registry.model_id!r} ({self.kind}) serves no LoRA adapters")

    def adapter_digest(self, name: str) -> str:
        """The digest of loaded LoRA adapter ``name`` ("" when there is none)."""
        return ""

    def adapter_bindings(self) -> "collections.Counter[str]":
        """Live caches per adapter they are bound to ("" = the base model), in one pass."""
        return collections.Counter(e.adapter for e in self.registry.entries())

    def live_sequences(self) -> int | None:
        """Native sequence slots held by live caches (llama.cpp sequence ids), for leak checks;
        None when the executor has no such slots."""
        return None

    def kv_cells_used(self) -> int | None:
        """KV positions the native runtime holds for live caches (read from it: call on the
        worker, between steps); None when the executor has no native KV books."""
        return None

    def warmup(self) -> None:
        """``warmup()``; nothing by default."""

    def clear_prefix_cache(self) -> bool:
        """Drop every cached prefix block that no live cache holds and forget the index (the vLLM
        protocol's ``FlushCache``; call it with no live cache). False: this executor keeps no
        prefix cache."""
        return False

    @property
    def is_shut_down(self) -> bool:
        """Whether :meth:`shutdown` ran (the executor refuses work from then on)."""
        return self.state == ExecutorState.SHUTDOWN

    def check_up(self) -> None:
        """UNAVAILABLE once the executor is shut down."""
        if self.is_shut_down:
            raise errors.unavailable(f"model {self.registry.model_id!r} is shut down")

    def shutdown(self) -> int:
        """``shutdown()``: free every cache, refuse further work. Returns caches freed."""
        n = 0
        for entry in self.registry.entries():
            if self.release_cache(entry.cache_id)[0]:
                n += 1
        self.state = ExecutorState.SHUTDOWN
        return n

    # ---- tokenization ---------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer, or None (then Tokenize/Detokenize answer FAILED_PRECONDITION)."""
        return None

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise errors.failed_precondition(f"model {self.info().model_id!r} has no chat template", field="model_id")
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    # ---- helpers ----------------------------------------------------------------------------------
    def handle(self, entry: CacheEntry) -> CacheHandle:
        """The wire snapshot of ``entry`` (executors add real memory figures by overriding)."""
        h = self.registry.handle(entry)
        info = self.info()
        h.num_layers = info.num_layers
        h.num_kv_heads = info.num_kv_heads
        h.head_dim = info.head_dim
        return h


def prefill_outputs(rows: "list[StepRow]", outs: "list[RowOutput]") -> list[PrefillOutput]:
    """The interface's ``PrefillOutput`` of prompt rows: ``all_logits`` and its last row when every
    position was asked for."""
    res = []
    for r, o in zip(rows, outs):
        out = PrefillOutput(cache=o.cache, cached_tokens=o.cached, embedding=o.embedding)
        if o.logits is not None and r.want is Want.ALL and o.logits.ndim == 2:
            out.all_logits, out.logits = o.logits, o.logits[-1]
        else:
            out.logits = o.logits
        res.append(out)
    return res

