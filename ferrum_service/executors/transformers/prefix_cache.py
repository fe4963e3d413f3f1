"""Automatic prefix caching over a paged block pool: refcounted blocks, a key index, LRU eviction.

Rooms (after vLLM v1's ``block_pool.py`` / ``kv_cache_manager.py``, written for this pool):

- **Keys.** Every *full* block of a sequence gets a key chained from its parent's
  (:mod:`ferrum_client.prefix_keys`, advertised as ``PrefixCacheRecipe``): the key names the
  block's tokens and everything before them, plus the model, the request's ``cache_salt`` and the
  LoRA adapter it was computed with (dropped with the adapter: :meth:`PrefixCache.drop_adapter`).
- **Refcounts.** A block may sit in several sequences' block tables (a prefix hit, a fork). Its
  refcount is the number of tables holding it. Nothing ever writes into a block whose refcount is
  above one: the writer copies it first (:meth:`PrefixCache.own`, copy-on-write).
- **Index.** ``key -> block`` for blocks whose content is exactly their key's tokens. A block
  leaves the index only when it is evicted.
- **Eviction.** A keyed block whose last owner is gone is *evictable*: it stays in the index (a
  later prompt can take it back) and in an LRU list; an allocation that finds too few free
  blocks evicts the least recently released first. Admission counts evictable blocks as free.
- **Events.** Keys entering the index (``stored``: keys, parent key, tokens), leaving it
  (``removed``) and a full clear go to ``on_event`` (the server's KV event hub), so a router can
  mirror which prefixes a replica holds.

This class holds no tensors: it hands block ids out and takes them back through the
:class:`~.paged_kv.BlockPool` (which owns the K/V tensors and the free list) and asks the pool to
copy a block for copy-on-write. Another executor family can keep the same index over its own
storage.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ferrum_client.prefix_keys import ALGORITHM, EXTRA_KEYS, SEED, block_key, chain_root

from ...core.modes import BlockEvent
from ..base import PrefixStats
from .paged_kv import BlockPool

BlockEventSink = Callable[[str, dict], None]


@dataclass
class SeqBlocks:
    """A sequence's block table and the keys of its leading full blocks."""

    blocks: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)  # keys[i] names blocks[i] (full blocks only)
    root: bytes = b""  # the chain root (model id + cache salt)
    salt: str = ""  # the salt of ``root`` (an empty reserved cache keeps it when its first step binds an adapter)
    adapter: str = ""  # the LoRA adapter of ``root`` ("" = the base model): its blocks go when it is unloaded


class PrefixCache:
    """Refcounts, the key index and LRU eviction over one :class:`BlockPool`."""

    def __init__(self, pool: BlockPool, *, model_id: str, enabled: bool = True) -> None:
        self.pool = pool
        self.model_id = model_id
        self.enabled = enabled
        self.block_size = pool.block_size
        self.refs: dict[int, int] = {}  # block -> tables holding it (absent = not in use)
        self.key_of: dict[int, bytes] = {}  # block -> its key, for blocks in the index
        self.index: dict[bytes, int] = {}  # key -> block
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.stats = PrefixStats()
        self.on_event: BlockEventSink | None = None
        # (salt, adapter) -> chain root, a bounded memo read by the event loop (admission) and the
        # worker (steps) at once: guarded by a lock.
        self._roots: dict[tuple[str, str], bytes] = {}
        self._roots_lock = threading.Lock()
        self.adapter_of: dict[int, str] = {}  # indexed block -> the adapter it was computed with

    # ---- sizes -----------------------------------------------------------------------------------
    def subscribe(self, sink: BlockEventSink) -> None:
        """Send this index's block events to ``sink`` (the server's KV event hub; one sink)."""
        self.on_event = sink

    @property
    def available_blocks(self) -> int:
        """Blocks an allocation can get: free ones plus evictable ones."""
        return self.pool.free_blocks + len(self.evictable)

    @property
    def cached_blocks(self) -> int:
        return len(self.index)

    @property
    def used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return len(self.refs)

    def recipe(self) -> dict:
        """The ``PrefixCacheRecipe`` this index keys blocks with."""
        return {"enabled": self.enabled, "algorithm": ALGORITHM, "block_size": self.block_size,
                "seed": SEED, "extra_keys": list(EXTRA_KEYS)}

    def root(self, cache_salt: str = "", adapter: str = "") -> bytes:
        """The chain root of (``cache_salt``, ``adapter``) on this model (safe from any thread)."""
        k = (cache_salt, adapter)
        with self._roots_lock:
            r = self._roots.get(k)
            if r is None:
                r = self._roots[k] = chain_root(self.model_id, cache_salt, adapter=adapter)
                if len(self._roots) > 4096:  # many tenants: keep the memo bounded
                    self._roots.pop(next(iter(self._roots)))
        return r

    # ---- lookup ----------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], root: bytes) -> tuple[list[int], list[bytes]]:
        """The longest chain of ``tokens``' leading full blocks held in the index: (blocks, keys).
        Takes nothing (see :meth:`take`)."""
        if not self.enabled:
            return [], []
        bs = self.block_size
        blocks: list[int] = []
        keys: list[bytes] = []
        key = root
        for start in range(0, len(tokens) - bs + 1, bs):
            key = block_key(key, tokens[start:start + bs])
            b = self.index.get(key)
            if b is None:
                break
            blocks.append(b)
            keys.append(key)
        return blocks, keys

    def revived(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` are evictable now (taking them makes them unavailable)."""
        return sum(1 for b in blocks if b in self.evictable)

    # ---- ownership -------------------------------------------------------------------------------
    def take(self, blocks: Sequence[int]) -> None:
        """One more table holds each of ``blocks`` (a hit or a fork)."""
        for b in blocks:
            n = self.refs.get(b, 0)
            if n == 0:
                self.evictable.pop(b, None)
            self.refs[b] = n + 1

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """``n`` zeroed private blocks, evicting least-recently-released cached blocks when the
        free list is short. The caller admitted ``n`` against :attr:`available_blocks`."""
        short = n - self.pool.free_blocks
        if short > 0:
            self._evict(short)
        ids = self.pool.allocate(n, after)
        for b in ids:
            self.refs[b] = 1
        return ids

    def release(self, blocks: Sequence[int]) -> None:
        """One table fewer holds each of ``blocks``. A block nobody holds goes back to the pool,
        or, when keyed, stays cached and becomes evictable (most recent last)."""
        freed: list[int] = []
        # Later blocks of a sequence are released first so that LRU eviction takes a chain's tail
        # before its head (a head block is worth more: every longer prefix needs it).
        for b in reversed(blocks):
            n = self.refs.get(b, 0) - 1
            if n > 0:
                self.refs[b] = n
                continue
            self.refs.pop(b, None)
            if b in self.key_of:
                self.evictable[b] = None
            else:
                freed.append(b)
        if freed:
            self.pool.free(freed)

    def shared(self, block: int) -> bool:
        return self.refs.get(block, 0) > 1

    def must_copy(self, block: int) -> bool:
        """Whether writing into ``block`` needs a copy first: another table shares it, or it is in
        the index (its content is a cached prefix that later prompts may take)."""
        return self.refs.get(block, 0) > 1 or block in self.key_of

    def own(self, seq: SeqBlocks, index: int) -> None:
        """Make ``seq.blocks[index]`` safe to write (copy-on-write): when it is shared or cached,
        give ``seq`` a private copy (one block the caller admitted) and drop its hold on the
        original, which keeps serving its other holders and the index."""
        b = seq.blocks[index]
        if not self.must_copy(b):
            return
        (copy,) = self.allocate(1)
        self.pool.copy_block(b, copy)
        seq.blocks[index] = copy
        self.release([b])
        self.stats.cow_copies += 1

    # ---- the index -------------------------------------------------------------------------------
    def commit(self, seq: SeqBlocks, tokens: Sequence[int], cache_id: str = "") -> None:
        """Key the blocks ``seq`` filled since its last commit (``tokens``: all of its tokens) and
        put them in the index, unless an equal block is there already. ``cache_id``: the cache
        ``seq`` belongs to (its ``stored`` events name it, so the server knows whose they are)."""
        if not self.enabled:
            return
        bs = self.block_size
        full = len(tokens) // bs
        parent = seq.keys[-1] if seq.keys else seq.root
        adapter = seq.adapter
        run: tuple[int, bytes] | None = None  # (first block, its parent) of the run being stored
        for i in range(len(seq.keys), full):
            before = parent
            parent = block_key(parent, tokens[i * bs:(i + 1) * bs])
            seq.keys.append(parent)
            b = seq.blocks[i]
            if parent not in self.index and b not in self.key_of:
                self.index[parent] = b
                self.key_of[b] = parent
                if adapter:
                    self.adapter_of[b] = adapter
                if run is None:
                    run = (i, before)
            elif run is not None:  # one event per unbroken run, so each event is one chain
                self._stored(seq, tokens, *run, i, cache_id)
                run = None
        if run is not None:
            self._stored(seq, tokens, *run, full, cache_id)

    def truncate_keys(self, seq: SeqBlocks, new_len: int) -> None:
        """Forget the keys of blocks no longer full after a truncation (the blocks stay indexed
        until somebody writes into them)."""
        del seq.keys[new_len // self.block_size:]

    def drop_adapter(self, adapter: str) -> int:
        """Drop every evictable cached block computed with ``adapter`` (it is being unloaded; no
        live sequence holds one then). Returns how many went."""
        victims = [b for b, a in self.adapter_of.items() if a == adapter and b in self.evictable]
        for b in victims:
            del self.evictable[b]
        self._unindex(victims)
        self.pool.free(victims)
        with self._roots_lock:
            self._roots = {k: r for k, r in self._roots.items() if k[1] != adapter}
        return len(victims)

    def clear(self) -> None:
        """Drop every evictable block and the whole index (the model shuts down)."""
        had = bool(self.index)
        self.pool.free(list(self.evictable))
        self.evictable.clear()
        self.index.clear()
        self.key_of.clear()
        self.adapter_of.clear()
        if had:
            self._emit(BlockEvent.CLEARED, {})

    def check(self) -> None:
        """Invariants (tests call this): free + in use + evictable = total, and the index agrees."""
        in_use = set(self.refs)
        ev = set(self.evictable)
        assert not in_use & ev, "a block is both in use and evictable"
        assert self.pool.free_blocks + len(in_use) + len(ev) == self.pool.num_blocks, (
            self.pool.free_blocks, len(in_use), len(ev), self.pool.num_blocks)
        assert all(self.index[k] == b for b, k in self.key_of.items()) and len(self.index) == len(self.key_of)
        assert ev <= set(self.key_of), "an evictable block is not cached"

    # ---- internals -------------------------------------------------------------------------------
    def _evict(self, n: int) -> None:
        victims = []
        while n > 0 and self.evictable:
            b, _ = self.evictable.popitem(last=False)
            victims.append(b)
            n -= 1
        if victims:
            self._unindex(victims)
            self.pool.free(victims)
            self.stats.evicted_blocks += len(victims)

    def _unindex(self, blocks: Sequence[int]) -> None:
        keys = []
        for b in blocks:
            k = self.key_of.pop(b, None)
            self.adapter_of.pop(b, None)
            if k is not None:
                self.index.pop(k, None)
                keys.append(k)
        if keys:
            self._emit(BlockEvent.REMOVED, {"block_hashes": keys})

    def _stored(self, seq: SeqBlocks, tokens: Sequence[int], first: int, parent: bytes, end: int,
                cache_id: str) -> None:
        bs = self.block_size
        self._emit(BlockEvent.STORED, {"block_hashes": seq.keys[first:end], "parent_block_hash": parent,
                              "token_ids": list(tokens[first * bs:end * bs]), "block_size": bs,
                              "adapter": seq.adapter, "cache_id": cache_id,
                              # the key space (salt) as its chain root's first bytes: names it, reveals
                              # no salt; "" = the shared space
                              "namespace": self.root(seq.salt)[:8].hex() if seq.salt else ""})

    def _emit(self, kind: BlockEvent, data: dict) -> None:
        if self.on_event is not None:
            self.on_event(kind, data)


__all__ = ["PrefixCache", "PrefixStats", "SeqBlocks"]
