"""The KV manager of the transformers executor: every cache's blocks, over the prefix cache and the
block pool (after vLLM v1's ``kv_cache_manager.py``).

It plans what a step needs from the pool (new blocks, copies for copy-on-write, evictable blocks a
prefix hit takes back), admits it (RESOURCE_EXHAUSTED before anything is allocated), allocates it
(prefix hits first, then growth and reservations, then private copies of every block a row writes
into that is shared or cached), and afterwards either commits it (the registry's lengths, the
prefix index) or rolls it back (caches it created released, blocks it grew returned,
reservations put back). Besides steps it serves ``ReserveKvSlots``, truncation, forks and the
staging of imported K/V, and it records its own prefix-cache counters (lookups, hits, forks).

Admission. The pool is the only KV budget: a block shared by several caches counts once, and
cached-but-evictable blocks count as free. The registry still names caches, counts their tokens and
limits how many live at once.

It runs on the model's worker (one step at a time); nothing here computes.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from ...core import errors
from ...core.kv_registry import CacheEntry, CacheRegistry
from ...core.steps import StepRow, Want
from ...core.types import (
    KvCapacity,
    KvSlotAllocation,
    KvSlotCapacitySnapshot,
    KvSlotRequest,
    KvSlotReservation,
    PrefillInput,
)
from .paged_kv import BlockPool, raw_bytes
from .prefix_cache import PrefixCache, SeqBlocks


@dataclass
class StagedImport:
    """An import in flight: its tokens and the private blocks its chunks are written into."""

    tokens: list[int]
    reserve: int
    salt: str
    blocks: list[int] | None
    adapter: str = ""
    staged: int = 0  # tokens counted in the registry's staged imports until commit or abort


@dataclass
class PrefixHit:
    """What the prefix cache gives one row of a step: the hit blocks, their keys, the chain root
    the row's new blocks hang from, and the leading tokens it need not compute (``cached``)."""

    blocks: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    root: bytes = b""
    cached: int = 0


@dataclass
class StepKv:
    """A step's KV once allocated: per row its cache, tokens already there and tokens to compute,
    and what :meth:`KvManager.rollback` undoes."""

    entries: list[CacheEntry] = field(default_factory=list)
    pasts: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)  # leading tokens each row took from the prefix cache
    new_tokens: list[list[int]] = field(default_factory=list)
    created: list[CacheEntry] = field(default_factory=list)
    grown: list[tuple[CacheEntry, int, int]] = field(default_factory=list)  # (entry, blocks, reserved) before
    # Empty reserved caches that took a prefix hit: (entry, its blocks and keys before). The private
    # blocks the hit replaced are let go at commit, so a rollback can put the table back as it was.
    swapped: list[tuple[CacheEntry, SeqBlocks]] = field(default_factory=list)

    def blocks(self, i: int) -> list[int]:
        """Row ``i``'s block table."""
        return self.entries[i].payload.blocks


class KvManager:
    """Plans, admits, allocates, commits and rolls back the KV of one model's caches."""

    def __init__(self, pool: BlockPool, prefix: PrefixCache, registry: CacheRegistry, *, model_id: str,
                 max_sequence_length: int) -> None:
        self.pool = pool
        self.prefix = prefix
        self.registry = registry
        self.model_id = model_id
        self.max_sequence_length = max_sequence_length
        self.block_size = pool.block_size
        self.stats = prefix.stats  # the prefix-cache counters this manager records
        self.staged_adapters: collections.Counter[str] = collections.Counter()  # staged imports per adapter

    # ---- plan and admission ----------------------------------------------------------------------
    def plan(self, items: list[StepRow]) -> tuple[int, set[int], list[PrefixHit]]:
        """What a step over ``items`` needs from the pool: (new blocks, evictable blocks its prefix
        hits take back, per item its :class:`PrefixHit`). Reads the rows, never edits them.

        A new sequence looks its prompt up unless it bypasses the cache or wants every position's
        logits; at least its last token is computed, so a prompt that is all cached recomputes
        that token into a copy of its last block. An empty cache (made by ``ReserveKvSlots``,
        which ferrum's engine calls before a sequence's first step) looks its prompt up the same
        way, under its own salt and adapter; the hit blocks replace its first private ones. A
        continuing sequence needs blocks for its growth plus a copy of each block it writes into
        that is shared or cached."""
        pc, pool, bs = self.prefix, self.pool, self.block_size
        need = 0
        revived: set[int] = set()
        hits: list[PrefixHit] = []
        for it in items:
            if self.takes_prefix(it):
                seq = it.entry.payload
                root = pc.root(it.salt, seq.adapter)  # the step's salt picks the key space, as for a new cache
                hb, hk = pc.match(it.tokens, root)
                hb, hk = hb[:len(seq.blocks)], hk[:len(seq.blocks)]  # within what it reserved
                cached = min(len(hb) * bs, len(it.tokens) - 1)
                cow = 1 if cached < len(hb) * bs else 0
                need += max(0, pool.blocks_for(max(len(it.tokens), it.reserve)) - len(seq.blocks)) + cow
                revived.update(b for b in hb if b in pc.evictable)
                hits.append(PrefixHit(hb, hk, root, cached))
            elif it.entry is None:
                root = pc.root(it.salt, it.adapter)
                hb: list[int] = []
                hk: list[bytes] = []
                if not it.bypass and it.want != Want.ALL:
                    hb, hk = pc.match(it.tokens, root)
                cached = min(len(hb) * bs, len(it.tokens) - 1)
                cow = 1 if cached < len(hb) * bs else 0
                need += pool.blocks_for(max(len(it.tokens), it.reserve)) - len(hb) + cow
                revived.update(b for b in hb if b in pc.evictable)
                hits.append(PrefixHit(hb, hk, root, cached))
            else:
                blocks, past = it.entry.payload.blocks, it.entry.num_tokens
                end = past + len(it.tokens)
                need += max(0, pool.blocks_for(max(end, it.reserve)) - len(blocks))
                written = range(past // bs, min(len(blocks), pool.blocks_for(end)))
                need += sum(1 for i in written if pc.must_copy(blocks[i]))
                hits.append(PrefixHit())
        return need, revived, hits

    def takes_prefix(self, it: StepRow) -> bool:
        """Whether ``it`` is the first step of an empty reserved cache that looks its prompt up."""
        e = it.entry
        return (e is not None and e.num_tokens == 0 and isinstance(e.payload, SeqBlocks) and self.prefix.enabled
                and not it.bypass and it.want != Want.ALL and len(it.tokens) > 1)

    def admit(self, need_blocks: int, field: str, *, new_caches: int = 0, revived: int = 0) -> None:
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

    def admit_kv(self, grow: list[tuple[CacheEntry, int]], new: list[StepRow], field: str) -> None:
        """The pool's admission for a step the server is about to queue (see :meth:`plan`)."""
        items = [StepRow(e, [0] * max(0, n - e.num_tokens), Want.NONE) for e, n in grow] + list(new)
        need, revived, _ = self.plan(items)
        self.admit(need, field, new_caches=len(new), revived=len(revived))

    def cached_prefix(self, inp: PrefillInput) -> int:
        """Tokens a prefill of ``inp`` (a new prompt) would take from the prefix cache now."""
        if inp.cache_id or inp.bypass_prefix_cache or inp.all_positions or not self.prefix.enabled:
            return 0
        blocks, _ = self.prefix.match(inp.token_ids, self.prefix.root(inp.cache_salt, inp.adapter))
        return min(len(blocks) * self.block_size, len(inp.token_ids) - 1)

    # ---- a step ------------------------------------------------------------------------------------
    def allocate_step(self, items: list[StepRow], field: str) -> StepKv:
        """Plan, admit and allocate a step over ``items`` (their adapters already bound): every
        row's blocks for its new tokens and reservation, each block it writes into its own. On
        failure nothing is left allocated."""
        pc, pool, bs = self.prefix, self.pool, self.block_size
        need, revived, hits = self.plan(items)
        self.admit(need, field, new_caches=sum(1 for it in items if it.entry is None), revived=len(revived))
        step = StepKv()
        try:
            # Prefix hits are taken first, so that no allocation below can evict a hit block.
            for it, hit in zip(items, hits):
                hb, hk, root = hit.blocks, hit.keys, hit.root
                if it.entry is None:
                    e = self.registry.create(it.tokens, reserve_tokens=it.reserve, field=field)
                    e.adapter = it.adapter
                    step.created.append(e)
                    pc.take(hb)
                    e.payload = SeqBlocks(list(hb), list(hk), root, it.salt, it.adapter)
                    if it.want != Want.ALL and not it.bypass:
                        self._record_lookup(len(it.tokens), hit.cached)
                elif self.takes_prefix(it):
                    seq = it.entry.payload
                    step.swapped.append((it.entry, dataclasses.replace(seq, blocks=list(seq.blocks))))
                    pc.take(hb)
                    seq.blocks[:len(hb)] = hb
                    seq.keys, seq.root, seq.salt = list(hk), root, it.salt
                    self._record_lookup(len(it.tokens), hit.cached)
            fresh = iter(step.created)
            for it, hit in zip(items, hits):
                if it.entry is None:
                    e = next(fresh)
                    seq, past, new = e.payload, hit.cached, it.tokens[hit.cached:]
                    total = pool.blocks_for(max(len(it.tokens), it.reserve))
                    seq.blocks.extend(pc.allocate(total - len(seq.blocks), seq.blocks[-1] if seq.blocks else None))
                elif self.takes_prefix(it):
                    e, past, new = it.entry, hit.cached, it.tokens[hit.cached:]
                    seq = e.payload
                    step.grown.append((e, len(seq.blocks), e.reserved_total))
                    target = max(len(it.tokens), it.reserve)
                    seq.blocks.extend(pc.allocate(max(0, pool.blocks_for(target) - len(seq.blocks)),
                                                  seq.blocks[-1] if seq.blocks else None))
                    self.registry.set_reserved(e, max(e.reserved_total, it.reserve))
                else:
                    e, past, new = it.entry, it.entry.num_tokens, it.tokens
                    seq = e.payload
                    step.grown.append((e, len(seq.blocks), e.reserved_total))
                    target = max(past + len(new), it.reserve)
                    seq.blocks.extend(pc.allocate(pool.blocks_for(target) - len(seq.blocks),
                                                  seq.blocks[-1] if seq.blocks else None))
                    self.registry.set_reserved(e, max(e.reserved_total, it.reserve))
                # Copy-on-write: every block this row writes into must be its own.
                for i in range(past // bs, pool.blocks_for(past + len(new))):
                    pc.own(seq, i)
                step.entries.append(e)
                step.pasts.append(past)
                step.cached.append(hit.cached)
                step.new_tokens.append(new)
        except BaseException:
            self.rollback(step)
            raise
        return step

    def rollback(self, step: StepKv) -> None:
        """Undo :meth:`allocate_step` (its forward failed): created caches released, blocks a live
        cache grew by returned, its reservation put back."""
        for e in step.created:
            self.release(e.cache_id, reason="released")
        for e, n_blocks, reserved in step.grown:
            extra = e.payload.blocks[n_blocks:]
            if extra:
                self.prefix.release(extra)
                del e.payload.blocks[n_blocks:]
            self.registry.set_reserved(e, reserved)
        for e, before in reversed(step.swapped):
            hits = [b for b, was in zip(e.payload.blocks, before.blocks) if b != was]  # the hits, or their copies
            self.prefix.release(hits)
            e.payload = before

    def commit(self, items: list[StepRow], step: StepKv) -> None:
        """The step's forward ran: live caches take their new tokens, full blocks are keyed."""
        for e, before in step.swapped:  # the private blocks the hits replaced
            self.prefix.release([was for b, was in zip(e.payload.blocks, before.blocks) if b != was])
        for it, e in zip(items, step.entries):
            if it.entry is not None:
                self.registry.extend(e, it.tokens)
            self.prefix.commit(e.payload, e.tokens, e.cache_id)

    def bind_adapter(self, entry: CacheEntry, adapter: str) -> tuple[CacheEntry, str, bytes]:
        """Bind an empty cache to ``adapter`` (its prefix keys chain from the adapter's root);
        returns what :meth:`unbind_adapter` restores."""
        before = (entry, entry.adapter, entry.payload.root)
        entry.adapter = adapter
        entry.payload.root = self.prefix.root(entry.payload.salt, adapter)
        entry.payload.adapter = adapter
        return before

    @staticmethod
    def unbind_adapter(entry: CacheEntry, adapter: str, root: bytes) -> None:
        """Put back a binding :meth:`bind_adapter` made."""
        entry.adapter = adapter
        if isinstance(entry.payload, SeqBlocks):
            entry.payload.adapter, entry.payload.root = adapter, root

    # ---- caches -----------------------------------------------------------------------------------
    def release(self, cache_id: str, reason: str = "released") -> tuple[bool, int, int]:
        """Forget a cache and let go of its blocks: (released, freed bytes, freed tokens)."""
        entry = self.registry.release(cache_id, reason=reason)
        if entry is None:
            return False, 0, 0
        return True, self.free_payload(entry), entry.num_tokens

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
            reg.check_sequence_length(target, f"requests[{k}].target_len", self.max_sequence_length)
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
        self.admit(need_blocks, "requests", new_caches=new_caches)
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

    def truncate(self, entry: CacheEntry, new_len: int) -> int:
        """Roll ``entry`` back to ``new_len`` tokens (checked by the caller); blocks no longer needed
        are let go (to the pool, or, when cached, to the evictable list). A kept block that others
        share is copied when this cache next writes into it, so they never see the change. Returns
        the tokens removed."""
        removed = self.registry.truncate(entry, new_len)
        seq = entry.payload
        self.prefix.truncate_keys(seq, new_len)
        keep = self.pool.blocks_for(max(new_len, entry.reserved_total))
        if len(seq.blocks) > keep:
            self.prefix.release(seq.blocks[keep:])
            del seq.blocks[keep:]
        return removed

    def fork(self, src: CacheEntry, keep: int, reserve: int) -> tuple[CacheEntry, int]:
        """A new cache holding ``src``'s first ``keep`` tokens, sharing their blocks (copy-on-write),
        with room for ``reserve`` tokens. Returns (the new entry, blocks shared)."""
        self.registry.check_sequence_length(max(keep, reserve), "reserve_tokens", self.max_sequence_length)
        shared = src.payload.blocks[: self.pool.blocks_for(keep)]
        extra = self.pool.blocks_for(max(keep, reserve)) - len(shared)
        self.admit(extra, "cache_id", new_caches=1)
        entry = self.registry.create(src.tokens[:keep], reserve_tokens=reserve, field="cache_id", event="forked")
        entry.adapter = src.adapter
        entry.caller_supplied = src.caller_supplied
        self.prefix.take(shared)
        seq = SeqBlocks(list(shared), src.payload.keys[: keep // self.block_size], src.payload.root, src.payload.salt,
                        src.payload.adapter)
        seq.blocks.extend(self.prefix.allocate(extra, shared[-1] if shared else None))
        entry.payload = seq
        self.stats.forks += 1
        return entry, len(shared)

    # ---- K/V transfer -------------------------------------------------------------------------------
    def slots_of(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        """Pool slots of tokens [start, end) of a sequence with block table ``blocks``."""
        bs = self.block_size
        pos = torch.arange(start, end, dtype=torch.long)
        table = torch.tensor(blocks, dtype=torch.long)
        return (table[pos // bs] * bs + pos % bs).to(self.pool.device)

    @torch.inference_mode()
    def export_layer(self, entry: CacheEntry, start: int, end: int, layer: int) -> tuple[bytes, bytes]:
        """K and V of tokens [start, end) of ``layer`` (checked by the caller), read from the pool
        (``[n, kv_heads, dim]`` row-major, the pool's dtype, little-endian), as bytes on the host."""
        pool = self.pool
        slots = self.slots_of(entry.payload.blocks, start, end)
        out = []
        for t, d in ((pool.k[layer], pool.head_dim), (pool.v[layer], pool.v_head_dim)):
            out.append(raw_bytes(t.view(-1, pool.num_kv_heads, d).index_select(0, slots)))
        return out[0], out[1]

    def stage_import(self, tokens: list[int], reserve_tokens: int, cache_salt: str, adapter: str) -> StagedImport:
        """Admit ``len(tokens)`` (or ``reserve_tokens``) of KV and take its blocks now (private,
        zeroed, in no registry and no index): RESOURCE_EXHAUSTED before any byte is kept. The
        staged import binds ``adapter`` (it cannot be unloaded until the import ends)."""
        total = max(len(tokens), int(reserve_tokens or 0))
        self.registry.check_sequence_length(total, "reserve_tokens", self.max_sequence_length)
        need = self.pool.blocks_for(total)
        self.admit(need, "header", new_caches=1)
        self.registry.stage(total, "header")
        blocks = self.prefix.allocate(need)
        if adapter:
            self.staged_adapters[adapter] += 1
        return StagedImport(list(tokens), int(reserve_tokens or 0), cache_salt, blocks, adapter, total)

    @torch.inference_mode()
    def extend_import(self, staged: StagedImport, tokens: list[int]) -> None:
        """Append ``tokens`` to the staged import: their slots are in the blocks it took at
        :meth:`stage_import` (its reservation), so nothing is allocated here (OUT_OF_RANGE past it)."""
        if staged.blocks is None:
            raise errors.FerrumError(errors.ErrorKind.INTERNAL, "the import was aborted")
        n = len(staged.tokens) + len(tokens)
        if n > staged.staged or n > len(staged.blocks) * self.pool.block_size:
            raise errors.out_of_range(f"the staged import holds room for {staged.staged} tokens, not {n}",
                                      field="header.to_token", limit=staged.staged)
        staged.tokens.extend(tokens)

    def write_import(self, staged: StagedImport, layer: int, start: int, end: int, key: bytes, value: bytes) -> None:
        """Write one chunk (tokens [start, end) of ``layer``) into the staged blocks."""
        if staged.blocks is None:
            raise errors.FerrumError(errors.ErrorKind.INTERNAL, "the import was aborted")
        pool = self.pool
        slots = self.slots_of(staged.blocks, start, end)
        n, h = end - start, pool.num_kv_heads
        for t, d, data in ((pool.k[layer], pool.head_dim, key), (pool.v[layer], pool.v_head_dim, value)):
            with warnings.catch_warnings():  # read-only bytes: the tensor is only read
                warnings.simplefilter("ignore", UserWarning)
                src = torch.frombuffer(data, dtype=torch.uint8).view(pool.dtype).view(n, h, d)
            t.view(-1, h, d).index_copy_(0, slots, src.to(pool.device))

    def commit_import(self, staged: StagedImport) -> tuple[CacheEntry, int]:
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

    def abort_import(self, staged: StagedImport) -> None:
        """Give the staged blocks back (idempotent)."""
        self._unstage(staged)
        if staged.blocks:
            self.prefix.release(staged.blocks)
        staged.blocks = None

    def _unstage(self, staged: StagedImport) -> None:
        if staged.staged:
            self.registry.unstage(staged.staged)
            staged.staged = 0
            if staged.adapter:
                self.staged_adapters[staged.adapter] -= 1

    # ---- figures ----------------------------------------------------------------------------------
    def capacity(self, cap: KvCapacity) -> KvCapacity:
        """``cap`` (the registry's token figures) with free space and bytes from the pool (whole
        blocks; a shared block counts once; cached-but-evictable blocks are free)."""
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

    def slot_capacity(self) -> KvSlotCapacitySnapshot:
        """The block pool now (allocates nothing); evictable cached blocks count as free."""
        return KvSlotCapacitySnapshot(block_size=self.block_size, total_blocks=self.pool.num_blocks,
                                      free_blocks=self.prefix.available_blocks)

    def metrics(self) -> dict[str, Any]:
        """Prefix-cache counters (ferrum's ``cache_metrics_snapshot``: paged-KV prefix reuse)."""
        st, pc = self.stats, self.prefix
        return {"prefix_cache": {
            "enabled": pc.enabled, "block_size": self.block_size, "total_blocks": self.pool.num_blocks,
            "free_blocks": self.pool.free_blocks, "used_blocks": pc.used_blocks,
            "cached_blocks": pc.cached_blocks, "evictable_blocks": len(pc.evictable),
            "queried_tokens": st.queried_tokens, "hit_tokens": st.hit_tokens, "hit_rate": st.hit_rate,
            "lookups": st.lookups, "hits": st.hits, "evicted_blocks": st.evicted_blocks,
            "cow_copies": st.cow_copies, "forks": st.forks,
        }}

    def _record_lookup(self, queried: int, hit: int) -> None:
        st = self.stats
        st.lookups += 1
        st.queried_tokens += queried
        st.hit_tokens += hit
        st.hits += hit > 0


__all__ = ["KvManager", "StagedImport", "StepKv"]
