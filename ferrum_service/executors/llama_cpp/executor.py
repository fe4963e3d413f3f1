"""``LlamaCppExecutor``: a GGUF model run by llama.cpp (llama-cpp-python's low-level API).

Spec: ``llama-cpp,id=NAME,path=FILE.gguf[,kv_budget_bytes=..|n_ctx=..][,threads=..][,device=..][,n_seq=..]
[,kv=unified|streams]``.

KV layout
---------
``kv=unified`` (default): one llama.cpp context holds one KV buffer of ``n_ctx`` cells shared by
every sequence (``kv_unified``). ``kv=streams``: ``n_seq`` streams of ``n_ctx / n_seq`` cells, one
per sequence id, each sequence capped at its stream (:mod:`.sequences`: ids lowest first, prefix
hits and forks as state-byte copies). Each live cache owns one llama.cpp sequence id (recycled on
release) and its cells
are found by llama.cpp wherever they are free, so the KV budget is exactly ``n_ctx`` tokens (sized
from memory by default: :func:`.backend.default_kv_tokens`; llama.cpp allocates and clears it at load) and the
:class:`~ferrum_service.core.kv_registry.CacheRegistry` books it: a step that needs more tokens than are
free is refused with RESOURCE_EXHAUSTED before anything is decoded, and a step that fails inside
``llama_decode`` is rolled back (``llama_memory_seq_rm`` of the positions it added).

Every batched method is **one** ``llama_decode`` of one ``llama_batch``: prefills of several
sequences, decode steps, unified items and a verify's N+1 tokens, with logits requested only for
the positions whose rows are wanted. TruncateKv and ReleaseCache are ``llama_memory_seq_rm``.

Logits rows come back as numpy arrays (no torch on this path) and go through the project's sampler like every executor's.
Tokenizer and chat template come from the GGUF file (:mod:`.tokenizer`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import time
from pathlib import Path
from typing import Any

import structlog
import numpy as np

from ...core import errors
from ...core.kv_registry import CacheEntry, CacheRegistry
from ...core.steps import RowOutput, StepPlan, StepRow, Want
from ...core.types import (
    AdmissionLimits,
    CacheHandle,
    ExecutorCapabilities,
    KvCapacity,
    KvSlotAllocation,
    KvSlotCapacitySnapshot,
    KvSlotRequest,
    KvSlotReservation,
    MemoryRequirements,
    ModelInfo,
    PrefillInput,
)
from ..base import KvLayout
from ..item_steps import ItemStepExecutor
from .backend import ARCH_TYPES, DEFAULT_LAYOUT, DEFAULT_N_CTX, DEFAULT_N_SEQ, default_kv_tokens, init_backend, lib, meta
from .batch import DecodeBatch
from .prefix import SequencePrefixIndex
from .sequences import LAYOUTS, SequenceIds, stream_cells

log = structlog.get_logger(__name__)


class LlamaCppExecutor(ItemStepExecutor):
    """A GGUF causal LM served by llama.cpp (see the module docstring)."""

    kind = "llama-cpp"
    #: A lone Generate stream's decode steps may run back to back on the worker (the batcher's
    #: chain): on a CPU build the event-loop round trip between two steps is ~3 % of a step.
    chains_decodes = True

    def __init__(self, path: str | Path, *, model_id: str | None = None, n_ctx: int | None = None,
                 kv_budget_bytes: int | None = None, threads: int | None = None, device: str = "auto",
                 n_seq: int = DEFAULT_N_SEQ, n_ubatch: int = 512, flash_attn: bool | None = None,
                 prefix_cache: bool = True, kv: str = DEFAULT_LAYOUT) -> None:
        """Load ``path`` (a .gguf file). The KV budget: ``n_ctx`` KV cells over all sequences (in
        tokens), or ``kv_budget_bytes`` of K and V, or by default :data:`DEFAULT_KV_MEMORY_FRACTION`
        of the available memory, at most ``n_seq`` x the training context and at least
        :data:`DEFAULT_N_CTX` tokens (see :func:`default_kv_tokens`). ``threads``: llama.cpp threads
        (default: all cores); ``device``: auto | cpu | cuda (auto offloads every layer when the
        llama.cpp build supports a GPU); ``n_seq``: most live caches (llama.cpp sequence ids);
        ``flash_attn``: None = llama.cpp's choice (auto); ``prefix_cache``: reuse the KV of earlier
        prompts' full blocks (:mod:`.prefix`); ``kv``: the KV layout, ``streams`` (one stream of
        budget / ``n_seq`` cells per sequence, which caps a sequence's length) or ``unified`` (one
        buffer shared by all sequences), see :mod:`.sequences`."""
        super().__init__()
        if kv not in LAYOUTS:
            raise errors.FerrumError(errors.ErrorKind.CONFIG, f"kv={kv!r}: choose one of {', '.join(LAYOUTS)}")
        self._kv_layout: KvLayout | None = None
        L = self._L = lib()
        p = Path(path).expanduser()
        if not p.is_file():
            raise errors.FerrumError(errors.ErrorKind.CONFIG, f"GGUF file {str(path)!r} not found")
        init_backend(L)
        self.model_id = model_id or p.stem
        self.source = str(p)
        t0 = time.perf_counter()
        mp = L.llama_model_default_params()
        dev = (device or "auto").lower()
        gpu = dev.startswith("cuda") or (dev == "auto" and bool(L.llama_supports_gpu_offload()))
        mp.n_gpu_layers = 999 if gpu else 0
        self.device_name = "cuda" if gpu else "cpu"
        self._model = L.llama_model_load_from_file(str(p).encode(), mp)
        if not self._model:
            raise errors.FerrumError(errors.ErrorKind.CONFIG, f"llama.cpp could not load {str(p)!r}")
        m = self._model
        self.n_ctx_train = int(L.llama_model_n_ctx_train(m))
        self.threads = int(threads or os.cpu_count() or 1)
        self.n_seq = int(n_seq)
        self.n_layer = int(L.llama_model_n_layer(m))
        self.n_embd = int(L.llama_model_n_embd(m))
        self.n_head = int(L.llama_model_n_head(m))
        self.n_head_kv = int(L.llama_model_n_head_kv(m))
        self.head_dim = self.n_embd // max(1, self.n_head)
        # K and V in f16 (llama.cpp's default cache type) for every layer.
        bpt = 2 * self.n_layer * self.n_head_kv * self.head_dim * 2
        train_ctx = min(self.n_ctx_train or DEFAULT_N_CTX, 32768)
        if n_ctx:
            cells = int(n_ctx)
        elif kv_budget_bytes:
            cells = max(256, int(kv_budget_bytes) // bpt)
        else:
            cells = default_kv_tokens(bpt, self.n_seq, train_ctx)
        self.streams = kv == "streams"
        if self.streams:  # n_seq streams of equal size (llama.cpp pads each to 256 cells)
            cells = self.n_seq * stream_cells(cells, self.n_seq)
        cp = L.llama_context_default_params()
        cp.n_ctx = cells
        # One step's tokens: the training context (as before budgets grew past it), so a batch of
        # long prompts is still several steps, never one llama_decode of the whole budget.
        cp.n_batch = min(cells, max(DEFAULT_N_CTX, train_ctx))
        cp.n_ubatch = min(n_ubatch, cp.n_ctx)
        cp.n_seq_max = self.n_seq
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.kv_unified = not self.streams
        cp.no_perf = True
        if flash_attn is not None:
            cp.flash_attn_type = 1 if flash_attn else 0
        self._ctx = L.llama_init_from_model(m, cp)
        if not self._ctx:
            raise errors.FerrumError(errors.ErrorKind.CONFIG, f"llama.cpp could not create a context for {str(p)!r}")
        self._mem = L.llama_get_memory(self._ctx)
        self.n_ctx = int(L.llama_n_ctx(self._ctx))
        self.n_batch = int(L.llama_n_batch(self._ctx))
        self._free_seq = SequenceIds(L, self._ctx, self.n_seq, streams=self.streams)
        self.prefix = SequencePrefixIndex(self.model_id or p.stem, enabled=prefix_cache, wipe=self._free_seq.wipe)

        from .tokenizer import GgufTokenizer

        self._tokenizer = GgufTokenizer(m)
        self.vocab_size = self._tokenizer.vocab_size
        self._decode = DecodeBatch(L, self._ctx, self.n_batch, self.vocab_size)
        # A sequence's cells: the whole buffer, or its own stream.
        self.seq_cells = self.n_ctx // self.n_seq if self.streams else self.n_ctx
        self.max_sequence_length = min(self.seq_cells, self.n_ctx_train or self.seq_cells)
        self.registry = CacheRegistry(self.model_id, total_tokens=self.n_ctx, block_size=1, bytes_per_token=bpt,
                                      per_request_tokens=(self.seq_cells if self.seq_cells < self.max_sequence_length
                                                          or self.streams else None),
                                      max_active=self.n_seq, id_prefix="llc")
        self._info = self._build_info()
        log.info("llama.cpp model ready", model_id=self.model_id, path=str(p), n_ctx=self.n_ctx, n_seq=self.n_seq, kv=kv,
                 threads=self.threads, device=self.device_name, seconds=round(time.perf_counter() - t0, 2))

    # ---- metadata ------------------------------------------------------------------------------
    def _eog_ids(self) -> list[int]:
        L = self._L
        vocab = L.llama_model_get_vocab(self._model)
        ids = [t for t in (int(L.llama_vocab_eos(vocab)), int(L.llama_vocab_eot(vocab))) if t >= 0]
        ids += [t for t in range(self.vocab_size) if L.llama_vocab_is_eog(vocab, t) and t not in ids]
        return ids

    def _build_info(self) -> ModelInfo:
        L = self._L
        arch = meta(L, self._model, "general.architecture")
        return ModelInfo(
            model_id=self.model_id,
            model_type=ARCH_TYPES.get(arch, "custom"),
            model_type_detail=arch,
            num_parameters=int(L.llama_model_n_params(self._model)),
            hidden_size=self.n_embd,
            num_layers=self.n_layer,
            num_heads=self.n_head,
            num_kv_heads=self.n_head_kv,
            vocab_size=self.vocab_size,
            max_sequence_length=self.max_sequence_length,
            dtype=meta(L, self._model, "general.file_type") or "gguf",
            device=self.device_name,
            metadata={
                "architecture": arch,
                "source": self.source,
                "kv_layout": f"llama.cpp {'streams' if self.streams else 'unified'}",
                "kv_cells_per_sequence": self.seq_cells,
                "kv_budget_tokens": self.n_ctx,
                "kv_budget_bytes": self.n_ctx * self.registry.bytes_per_token,
                "kv_bytes_per_token": self.registry.bytes_per_token,
                "threads": self.threads,
                "n_seq_max": self.n_seq,
                "weight_format": "gguf",
            },
            head_dim=self.head_dim,
            executor=self.kind,
            eos_token_ids=self._eog_ids(),
            has_tokenizer=True,
            has_chat_template=bool(self._tokenizer.chat_template),
            prefix_cache=self.prefix.recipe(),
        )

    def info(self) -> ModelInfo:
        return self._info

    def capabilities(self) -> ExecutorCapabilities:
        heads = self.n_head
        attn = "multi_query" if self.n_head_kv == 1 < heads else "grouped_query" if self.n_head_kv < heads else "multi_head"
        return ExecutorCapabilities(
            max_batch_size=self.n_seq,
            max_sequence_length=self.max_sequence_length,
            attention_mechanisms=[attn],
            supports_dynamic_batching=True,
            supports_continuous_batching=True,
            supports_speculative_decoding=True,
            supported_dtypes=["gguf"],
            supported_devices=[self.device_name],
            memory_requirements=MemoryRequirements(
                parameter_memory_bytes=int(self._L.llama_model_size(self._model)),
                activation_memory_per_token_bytes=4 * 4 * self.n_embd,
                kv_cache_memory_per_token_bytes=self.n_head_kv * 2 * self.head_dim * 2,
                overhead_memory_bytes=self.n_ctx * self.registry.bytes_per_token,
            ),
            supports_native_unified_decode=True,
            supports_generation=True,
            supports_embeddings=False,
            supports_forward=True,
            supports_kv_truncation=True,
            supports_native_forward_verify=True,
            supports_fork=True,
            supports_prefix_caching=self.prefix.enabled,
            supports_kv_transfer=True,
            kv_block_size=1,
        )

    def admission_limits(self) -> AdmissionLimits:
        return AdmissionLimits(maximum_active_sequences=self.n_seq, maximum_scheduled_tokens=self.n_batch)

    @property
    def tokenizer(self) -> Any:
        """llama.cpp's tokenizer of the GGUF file."""
        return self._tokenizer

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        if not self._tokenizer.chat_template:
            raise errors.failed_precondition(f"model {self.model_id!r} has no chat template", field="model_id")
        return self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def live_sequences(self) -> int:
        """Sequence ids held by live caches (for leak checks: equals the live caches; retired
        sequences kept by the prefix cache are not counted)."""
        return self.n_seq - len(self._free_seq) - len(self.prefix.evictable)

    def kv_cells_used(self) -> int:
        """KV positions llama.cpp holds for sequences of live caches (from llama.cpp itself)."""
        L = self._L
        total = 0
        for s in range(self.n_seq):
            if s in self.prefix.evictable:
                continue
            pmax = int(L.llama_memory_seq_pos_max(self._mem, s))
            if pmax >= 0:
                total += pmax - int(L.llama_memory_seq_pos_min(self._mem, s)) + 1
        return total

    # ---- compute -------------------------------------------------------------------------------
    def forward(self, input_ids: np.ndarray, logits_dtype: str = "fp32") -> np.ndarray:
        """A stateless forward of ``[batch, seq]`` ids (one ``llama_decode`` over temporary
        sequences, removed after); logits ``[batch, seq, vocab]``. Needs the KV budget and free
        sequence ids for the whole batch (RESOURCE_EXHAUSTED otherwise)."""
        ids = np.asarray(input_ids)
        if ids.ndim == 1:
            ids = ids[None, :]
        b, n = ids.shape
        if self.state == "shutdown":
            raise errors.unavailable(f"model {self.model_id!r} is shut down")
        if b * n > self.n_batch:
            raise errors.invalid(f"input_ids: {b * n} tokens in one step; this executor's limit is {self.n_batch}",
                                   field="input_ids", limit=self.n_batch)
        self.registry.check_sequence_length(n, "input_ids", self.max_sequence_length)
        self.registry.admit(b * n, "input_ids")
        if b > len(self._free_seq) + len(self.prefix.evictable):
            raise errors.exhausted(f"input_ids: {b} sequences but only {len(self._free_seq)} sequence ids are free",
                                   field="input_ids")
        self._make_room(b * n)
        seqs = [self._take_seq() for _ in range(b)]
        try:
            rows = self._decode.decode([StepRow(None, ids[i].tolist(), Want.ALL) for i in range(b)],
                                       [(s, 0) for s in seqs])
        finally:
            for s in seqs:
                self._L.llama_memory_seq_rm(self._mem, s, -1, -1)
                self._free_seq.give(s)
        # fp32 rows (numpy has no bf16; the wire encoding rounds to the asked dtype), fp16 as asked
        return np.stack(rows).astype(np.float16 if logits_dtype == "fp16" else np.float32)

    def kv_slot_capacity(self) -> KvSlotCapacitySnapshot:
        """KV cells as slots of one token (llama.cpp places tokens cell by cell)."""
        return KvSlotCapacitySnapshot(block_size=1, total_blocks=self.n_ctx, free_blocks=self.registry.free_tokens)

    def reserve_kv_slots(self, requests: list[KvSlotRequest]) -> KvSlotReservation:
        """Promise each cache ``max(target_len, admission_target_len)`` tokens of KV, all or nothing
        (RESOURCE_EXHAUSTED, nothing reserved, when the budget cannot cover them). A
        ``new_sequence`` request gets a new empty cache (a free llama.cpp sequence id) holding its
        promise; RESOURCE_EXHAUSTED, nothing created, when no sequence id is free."""
        reg = self.registry
        plan = []
        need = new_caches = 0
        for k, r in enumerate(requests):
            target = max(int(r.target_len), int(r.admission_target_len or 0))
            reg.check_sequence_length(target, f"requests[{k}].target_len", self.max_sequence_length)
            if r.new_sequence:
                entry = None
                need += target
                new_caches += 1
            else:
                entry = reg.get(r.cache_id, field=f"requests[{k}].cache_id")
                need += reg.growth(entry, target)
            plan.append((entry, target, r.cache_id, r.salt))
        free_before = reg.free_tokens
        reg.admit(need, "requests", new_caches=new_caches)
        if new_caches > len(self._free_seq) + len(self.prefix.evictable):
            raise errors.exhausted(f"requests: {new_caches} new sequences but only {len(self._free_seq)} of "
                                   f"{self.n_seq} sequence ids are free", field="requests")
        self._make_room(need)
        allocations = []
        for entry, target, name, salt in plan:
            created = ""
            if entry is None:
                entry = reg.create([], field="requests")
                entry.payload = self._take_seq()
                self.prefix.start(entry.payload, self.prefix.match([], salt)[3], [])
                created = entry.cache_id
            before = entry.footprint
            reg.set_reserved(entry, max(entry.reserved_total, target))
            allocations.append(KvSlotAllocation(cache_id=name, blocks_before=before, blocks_after=entry.footprint,
                                                new_blocks=entry.footprint - before, created_cache_id=created))
        return KvSlotReservation(block_size=1, total_blocks=self.n_ctx, free_blocks_before=free_before,
                                 free_blocks_after=reg.free_tokens, allocations=allocations)

    def truncate_kv(self, cache_id: str, new_len: int) -> tuple[CacheHandle, int]:
        """Drop positions ``new_len..`` from the sequence (``llama_memory_seq_rm``)."""
        entry = self.registry.get(cache_id)
        if not 0 <= new_len <= entry.num_tokens:
            raise errors.out_of_range(f"new_len must be in [0, {entry.num_tokens}], not {new_len}", field="new_len",
                                      num_tokens=entry.num_tokens)
        if not self._L.llama_memory_seq_rm(self._mem, entry.payload, new_len, -1):
            raise errors.FerrumError(errors.ErrorKind.BACKEND, f"llama.cpp refused to truncate cache {cache_id!r}")
        self.prefix.truncate(entry.payload, new_len)
        removed = self.registry.truncate(entry, new_len)
        return self.handle(entry), removed

    def fork_cache(self, cache_id: str, keep_tokens: int | None = None, reserve_tokens: int = 0
                   ) -> tuple[CacheEntry, int]:
        """A new sequence holding ``cache_id``'s first ``keep_tokens`` positions
        (``llama_memory_seq_cp``: in the unified KV cache the cells are shared, each tagged with
        both sequence ids; later writes of either go to new cells, so neither sees the other's).
        The registry still counts the fork's tokens in full (the budget is conservative). Returns
        (the new entry, cells shared)."""
        src, keep = self._fork_source(cache_id, keep_tokens)
        if not self._free_seq and not self.prefix.evictable:
            raise errors.exhausted(f"cache_id: all {self.n_seq} sequence ids are in use", field="cache_id")
        self.registry.check_sequence_length(max(keep, int(reserve_tokens or 0)), "reserve_tokens",
                                            self.max_sequence_length)
        entry = self.registry.create(src.tokens[:keep], reserve_tokens=int(reserve_tokens or 0), field="cache_id",
                                     event="forked")
        entry.caller_supplied = src.caller_supplied
        seq = entry.payload = self._take_seq(keep={src.payload})
        try:
            self._free_seq.copy(src.payload, seq, keep)
        except BaseException:
            self.release_cache(entry.cache_id, reason="released")
            raise
        self.prefix.start(seq, self.prefix.roots.get(src.payload, b""),
                          self.prefix.keys.get(src.payload, [])[: keep // self.prefix.block_size])
        self.prefix.stats.forks += 1
        entry.payload = seq
        return entry, keep

    # ---- KV transfer: llama.cpp's per-sequence state (llama_state_seq_get_data / set_data) -------
    STATE_FORMAT = "llama.cpp/seq-state"

    def kv_layout(self) -> KvLayout:
        """The sequence state is llama.cpp's own bytes (f16 K/V of every layer, positions); the
        fingerprint is the SHA-256 of the executor kind and the GGUF file. Computed once."""
        if self._kv_layout is None:
            h = hashlib.sha256(f"{self.kind}\n".encode())
            with open(self.source, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    h.update(block)
            self._kv_layout = KvLayout(
                model_id=self.model_id, fingerprint=h.hexdigest(), dtype="fp16", num_layers=self.n_layer,
                num_kv_heads=self.n_head_kv, head_dim=self.head_dim, v_head_dim=self.head_dim, executor=self.kind,
                element_size=2, state_format=self.STATE_FORMAT)
        return self._kv_layout

    def known_kv_layout(self) -> KvLayout | None:
        return self._kv_layout

    def export_kv_state(self, cache_id: str) -> bytes:
        """The sequence's state (``llama_state_seq_get_data``), on the worker."""
        entry = self.registry.get(cache_id)
        L, seq = self._L, entry.payload
        size = int(L.llama_state_seq_get_size(self._ctx, seq))
        buf = (ctypes.c_uint8 * size)()
        n = int(L.llama_state_seq_get_data(self._ctx, buf, size, seq))
        if n == 0:
            raise errors.FerrumError(errors.ErrorKind.BACKEND, f"llama.cpp could not save cache {cache_id!r}")
        return bytes(buf)[:n]

    def import_begin(self, tokens: list[int], reserve_tokens: int, cache_salt: str, adapter: str = "",
                     adapter_digest: str = "") -> dict:
        """Admit the tokens (or the reservation) and a sequence id; the state is loaded at commit."""
        if self.state == "shutdown":
            raise errors.unavailable(f"model {self.model_id!r} is shut down")
        if adapter:
            raise errors.failed_precondition(f"the K/V were computed with LoRA adapter {adapter!r}; model "
                                             f"{self.model_id!r} ({self.kind}) serves no adapters",
                                             field="header.adapter")
        total = max(len(tokens), int(reserve_tokens or 0))
        self.registry.check_sequence_length(total, "reserve_tokens", self.max_sequence_length)
        self.registry.admit(total, "header", new_caches=1)
        if not self._free_seq:
            raise errors.exhausted(f"header: all {self.n_seq} sequence ids are in use", field="header")
        self.registry.stage(total, "header")
        return {"tokens": list(tokens), "reserve": int(reserve_tokens or 0), "seq": self._free_seq.take(),
                "data": bytearray(), "salt": cache_salt, "staged": total}

    def import_write_state(self, staged: dict, data: bytes) -> None:
        if staged.get("seq") is None:
            raise errors.FerrumError(errors.ErrorKind.INTERNAL, "the import was aborted")
        staged["data"] += data

    def import_commit(self, staged: dict) -> tuple[CacheEntry, int]:
        """Load the state into the staged sequence id (``llama_state_seq_set_data``) and register
        the cache; RESOURCE_EXHAUSTED (nothing kept) when llama.cpp finds no room for its cells."""
        seq, data = staged.get("seq"), staged["data"]
        if seq is None:
            raise errors.FerrumError(errors.ErrorKind.INTERNAL, "the import was aborted")
        buf = (ctypes.c_uint8 * len(data)).from_buffer(data)
        if int(self._L.llama_state_seq_set_data(self._ctx, buf, len(data), seq)) == 0:
            raise errors.exhausted("header: llama.cpp found no room for the sequence's KV cells", field="header")
        self._unstage(staged)
        entry = self.registry.create(staged["tokens"], reserve_tokens=staged["reserve"], field="header")
        entry.payload = seq
        staged["seq"] = None
        # Its blocks are keyed (at its next step) under the import's salt, as a prefill's would be.
        self.prefix.start(seq, self.prefix.match([], staged["salt"])[3], [])
        return entry, 0

    def _unstage(self, staged: dict) -> None:
        if staged.get("staged"):
            self.registry.unstage(staged["staged"])
            staged["staged"] = 0

    def import_abort(self, staged: dict) -> None:
        self._unstage(staged)
        seq = staged.get("seq")
        staged["seq"] = None
        if seq is not None:
            self._L.llama_memory_seq_rm(self._mem, seq, -1, -1)
            self._free_seq.give(seq)

    def free_payload(self, entry: CacheEntry) -> int:
        """Free the sequence's KV cells and recycle its sequence id."""
        seq = entry.payload
        entry.payload = None
        if seq is None:
            return 0
        if not self.prefix.retire(seq, entry.num_tokens):  # kept (evictable) when it holds cached blocks
            self._L.llama_memory_seq_rm(self._mem, seq, -1, -1)
            self._free_seq.give(seq)
        elif self.streams:
            self._move_up(seq, entry.num_tokens)
        return entry.num_tokens * self.registry.bytes_per_token

    def shutdown(self) -> int:
        n = super().shutdown()
        self.clear_prefix_cache()
        return n

    def clear_prefix_cache(self) -> bool:
        for seq in self.prefix.clear():
            self._free_seq.give(seq)
        return True

    def cached_prefix(self, inp: PrefillInput) -> int:
        """Tokens a prefill of ``inp`` (a new prompt) would take from the prefix cache now."""
        if inp.cache_id or inp.bypass_prefix_cache or inp.all_positions:
            return 0
        return self.prefix.match(inp.token_ids, inp.cache_salt)[1]

    def kv_capacity(self) -> KvCapacity:
        """The budget, with the prefix cache's keyed blocks (``Loads.cached_blocks``; it read 0 here)."""
        cap = super().kv_capacity()
        cap.cached_blocks = self.prefix.cached_blocks
        return cap

    def cache_metrics(self) -> dict[str, Any]:
        """Prefix-cache counters (ferrum's ``cache_metrics_snapshot``)."""
        st, pc = self.prefix.stats, self.prefix
        return {"prefix_cache": {
            "enabled": pc.enabled, "block_size": pc.block_size, "cached_blocks": pc.cached_blocks,
            "retired_sequences": len(pc.evictable), "retired_tokens": pc.retired_tokens,
            "queried_tokens": st.queried_tokens, "hit_tokens": st.hit_tokens, "hit_rate": st.hit_rate,
            "lookups": st.lookups, "hits": st.hits, "evicted_blocks": st.evicted_blocks, "forks": st.forks,
        }}

    def _take_seq(self, keep: set[int] = frozenset()) -> int:
        """A free sequence id, evicting the least recently retired sequence when none is free."""
        if not self._free_seq:
            seq = self.prefix.evict(keep)
            if seq is None:
                raise errors.exhausted(f"all {self.n_seq} sequence ids are in use")
            self._free_seq.give(seq)
        return self._free_seq.take()

    def _move_up(self, seq: int, length: int) -> None:
        """A retired sequence (streams) moves to the highest free id, so that the live ids below
        stay dense (a gap in a step's ids costs llama.cpp one more pass over the weights)."""
        top = self._free_seq.take_highest_above(seq)
        if top is None:
            return
        try:
            self._free_seq.copy(seq, top, length)
        except errors.FerrumError:
            self._free_seq.give(top)
            return
        self.prefix.move(seq, top)
        self._free_seq.wipe(seq)
        self._free_seq.give(seq)

    def _make_room(self, need: int, keep: set[int] = frozenset()) -> None:
        """Evict retired sequences until ``need`` more cells certainly fit next to the live caches'
        budget and what retired sequences hold (both counted in full: shared cells count twice, so
        llama.cpp never runs out of cells). With streams, a retired sequence holds only its own
        stream: nothing to evict for cells."""
        if self.streams:
            return
        while (self.registry.total_tokens - self.registry.free_tokens + need + self.prefix.retired_tokens
               > self.n_ctx and self.prefix.evictable):
            seq = self.prefix.evict(keep)
            if seq is None:
                return
            self._free_seq.give(seq)

    def handle(self, entry: CacheEntry) -> CacheHandle:
        h = self.registry.handle(entry)
        h.num_layers, h.num_kv_heads, h.head_dim = self.n_layer, self.n_head_kv, self.head_dim
        return h

    def warmup(self) -> None:
        """One tiny prefill + decode (allocates llama.cpp's compute buffers)."""
        if self.registry.free_tokens < 2 or not self._free_seq:
            return
        ((entry, _, _),) = self._step([StepRow(None, [0], Want.LAST, bypass=True)], "warmup")  # no prefix stats
        try:
            self._step([StepRow(entry, [0], Want.LAST)], "warmup")
        finally:
            self.release_cache(entry.cache_id)

    def __del__(self) -> None:  # pragma: no cover - interpreter teardown order varies
        try:
            L = self._L
            self._decode.free()
            L.llama_free(self._ctx)
            L.llama_model_free(self._model)
        except Exception:
            pass

    # ---- the one decode ------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> list[RowOutput]:
        """The plan's rows in one ``llama_decode``; a transient plan's (``StepPlan.transient``: the
        batcher's steps, sampled before the next decode) logits rows are views of llama.cpp's
        buffer, not copies."""
        return [RowOutput(self.handle(e), logits, cached=cached)
                for e, logits, cached in self._step(plan.rows, plan.field, views=plan.transient,
                                                    on_forward=plan.on_forward)]

    def _step(self, items: list[StepRow], field: str, views: bool = False, on_forward=None
              ) -> list[tuple[CacheEntry, np.ndarray | None, int]]:
        """Admit, run one ``llama_decode`` over all items, commit; undo everything on failure
        (``views``, ``on_forward``: see :meth:`DecodeBatch.decode`)."""
        if self.state == "shutdown":
            raise errors.unavailable(f"model {self.model_id!r} is shut down")
        n_tokens = sum(len(it.tokens) for it in items)
        if n_tokens > self.n_batch:
            raise errors.invalid(f"{field}: {n_tokens} tokens in one step; this executor's limit is {self.n_batch}",
                                   field=field, limit=self.n_batch)
        seen: set[str] = set()
        need_tokens = new_caches = 0
        for it in items:
            if not it.tokens:
                raise errors.invalid(f"{field}: a sequence of the step has no tokens", field=field)
            if it.entry is None:
                need_tokens += max(len(it.tokens), it.reserve)
                new_caches += 1
                total = len(it.tokens)
            else:
                if it.entry.cache_id in seen:
                    raise errors.invalid(f"{field}: cache {it.entry.cache_id!r} appears twice in one step", field=field)
                seen.add(it.entry.cache_id)
                total = it.entry.num_tokens + len(it.tokens)
                need_tokens += self.registry.growth(it.entry, max(total, it.reserve))
            self.registry.check_sequence_length(total, field, self.max_sequence_length)
        self.registry.admit(need_tokens, field, new_caches=new_caches)
        pc = self.prefix
        # A new cache, or an empty one (made by ReserveKvSlots, which ferrum's engine calls before a
        # sequence's first step), takes its prompt's cached prefix; its first chunk picks its salt.
        fresh = [it.entry is None or it.entry.num_tokens == 0 for it in items]
        # Per item: (sequence to copy a cached prefix from, tokens taken, their keys, chain root).
        hits = [pc.match(it.tokens if not it.bypass and it.want != Want.ALL else [], it.salt)
                if new else (None, 0, [], b"") for it, new in zip(items, fresh)]
        sources = {src for src, *_ in hits if src is not None}
        if new_caches > len(self._free_seq) + sum(1 for s in pc.evictable if s not in sources):
            raise errors.exhausted(f"{field}: {new_caches} new sequences but only {len(self._free_seq)} of "
                                   f"{self.n_seq} sequence ids are free", field=field)
        self._make_room(need_tokens, sources)

        created: list[CacheEntry] = []
        placed: list[tuple[int, int]] = []  # (seq id, first position written)
        undo: list[tuple[int, int]] = []  # (seq id, first position to remove) for rollback
        emptied: list[tuple[int, bytes | None]] = []  # empty caches' (seq id, chain root) before the step
        entries: list[CacheEntry] = []
        cached: list[int] = []  # per item: leading tokens taken from the prefix cache
        work: list[StepRow] = []  # what is decoded: a new sequence's tokens after its prefix hit
        try:
            for it, (src, take, keys, root), new in zip(items, hits, fresh):
                if new:
                    if it.entry is None:
                        e = self.registry.create(it.tokens, reserve_tokens=it.reserve, field=field)
                        created.append(e)
                        e.payload = self._take_seq(sources)
                    else:
                        e = it.entry
                        emptied.append((e.payload, pc.roots.get(e.payload)))
                        if it.reserve > e.reserved_total:
                            self.registry.set_reserved(e, it.reserve)
                    pc.start(e.payload, root, keys)
                    if src is not None:
                        self._free_seq.copy(src, e.payload, take)
                        pc.touch(src)
                    past = take
                    if it.want != Want.ALL and not it.bypass:
                        pc.stats.lookups += 1
                        pc.stats.queried_tokens += len(it.tokens)
                        pc.stats.hit_tokens += take
                        pc.stats.hits += take > 0
                    work.append(StepRow(e, it.tokens[take:], it.want))
                    undo.append((e.payload, past if it.entry is None else 0))
                else:
                    e, past = it.entry, it.entry.num_tokens
                    if it.reserve > e.reserved_total:
                        self.registry.set_reserved(e, it.reserve)
                    work.append(it)
                    undo.append((e.payload, past))
                entries.append(e)
                cached.append(take if new else 0)
                placed.append((e.payload, past))
            logits = self._decode.decode(work, placed, views, on_forward)
        except BaseException:
            for seq, past in undo:
                self._L.llama_memory_seq_rm(self._mem, seq, past, -1)
            for seq, root in emptied:
                pc.start(seq, root if root is not None else pc.match([], "")[3], [])
            for e in created:
                self.release_cache(e.cache_id, reason="released")
            raise
        for it, e in zip(items, entries):
            if it.entry is not None:
                self.registry.extend(e, it.tokens)
            pc.commit(e.payload, e.tokens, e.cache_id)
        # Status counters are recorded by the server around each step (operations.py, host.py), as for
        # every executor; recording here too counted each llama.cpp step twice.
        return list(zip(entries, logits, cached))
