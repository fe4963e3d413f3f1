"""Prefix reuse for an executor whose KV lives in sequences, not blocks (llama.cpp).

llama.cpp keeps one unified KV buffer; a sequence id tags the cells that hold its positions, and
``llama_memory_seq_cp(src, dst, 0, n)`` tags ``src``'s first ``n`` positions with ``dst`` too
(the cells are shared, nothing is copied). So prefix caching here is an index from block keys to a
sequence that holds them:

- **Keys** are the contract's (``PrefixCacheRecipe``, :mod:`ferrum_client.prefix_keys`) over
  blocks of :data:`BLOCK` tokens, so a router computes the same keys for either executor family.
  A key names a block *and* every block before it, so the sequence holding block ``i`` under that
  key holds blocks ``0..i`` too: one ``seq_cp`` of ``(i + 1) * BLOCK`` positions shares them all.
- **Retired sequences.** A released cache whose sequence holds keyed blocks is not wiped: its
  sequence id and cells stay, evictable, least recently released first, until a new sequence
  needs an id or the cells (:meth:`SequencePrefixIndex.evict`).
- **Events** are the same block events as the paged pool's (stored / removed / cleared).

With ``kv=streams`` the "copy" is a real one (:meth:`.sequences.SequenceIds.copy`), and a retired
sequence is moved above the live ids (:meth:`SequencePrefixIndex.move`).

This class holds no llama.cpp handles: the executor passes ``seq_rm`` (wipe a sequence) and asks
it which sequence to copy from.
"""

from __future__ import annotations

import collections
from typing import Callable, Sequence

from ferrum_client.prefix_keys import ALGORITHM, EXTRA_KEYS, SEED, block_key, chain_root

from ...core.modes import BlockEvent
from ..base import PrefixStats

#: Tokens per keyed block (the recipe's block size for this executor family).
BLOCK = 16


class SequencePrefixIndex:
    """Block keys -> the sequence holding them; retired sequences kept for reuse (LRU)."""

    def __init__(self, model_id: str, *, enabled: bool, wipe: Callable[[int], None]) -> None:
        self.model_id = model_id
        self.enabled = enabled
        self.block_size = BLOCK
        self._wipe = wipe  # removes every cell of a sequence (llama_memory_seq_rm(seq, -1, -1))
        self.index: dict[bytes, int] = {}  # key -> a sequence holding that block (and all before it)
        self.keys: dict[int, list[bytes]] = {}  # sequence -> keys of its leading full blocks
        self.roots: dict[int, bytes] = {}  # sequence -> its chain root
        self.evictable: collections.OrderedDict[int, int] = collections.OrderedDict()  # retired seq -> length
        self.stats = PrefixStats()
        self.on_event: Callable[[str, dict], None] | None = None

    def subscribe(self, sink: Callable[[str, dict], None]) -> None:
        """Send this index's block events to ``sink`` (the server's KV event hub; one sink)."""
        self.on_event = sink

    @property
    def cached_blocks(self) -> int:
        return len(self.index)

    @property
    def retired_tokens(self) -> int:
        """Positions retired sequences hold (an upper bound on their cells: some are shared)."""
        return sum(self.evictable.values())

    def recipe(self) -> dict:
        return {"enabled": self.enabled, "algorithm": ALGORITHM, "block_size": BLOCK, "seed": SEED,
                "extra_keys": list(EXTRA_KEYS)}

    # ---- lookup ----------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], salt: str) -> tuple[int | None, int, list[bytes], bytes]:
        """(sequence to copy from, tokens to take from it, their keys, chain root) for a new
        prompt: the longest chain of its full blocks some sequence holds, never the whole prompt
        (its last token is computed, for its logits)."""
        root = chain_root(self.model_id, salt)
        if not self.enabled:
            return None, 0, [], root
        key, keys, src = root, [], None
        for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
            key = block_key(key, tokens[start:start + BLOCK])
            holder = self.index.get(key)
            if holder is None:
                break
            keys.append(key)
            src = holder
        take = max(0, min(len(keys) * BLOCK, len(tokens) - 1))
        keys = keys[: take // BLOCK]
        return (src if take else None), take, keys, root

    def touch(self, seq: int) -> None:
        """A retired sequence was just copied from: it becomes the most recently used."""
        if seq in self.evictable:
            self.evictable.move_to_end(seq)

    # ---- sequences -------------------------------------------------------------------------------
    def start(self, seq: int, root: bytes, keys: list[bytes]) -> None:
        """``seq`` begins holding the blocks named by ``keys`` (copied from another sequence)."""
        self.roots[seq] = root
        self.keys[seq] = list(keys)

    def commit(self, seq: int, tokens: Sequence[int], cache_id: str = "") -> None:
        """Key the blocks ``seq`` filled since its last commit and index new keys (``cache_id``:
        the cache holding ``seq``, named in the ``stored`` event for the server)."""
        if not self.enabled:
            return
        keys = self.keys.setdefault(seq, [])
        parent = keys[-1] if keys else self.roots.get(seq) or chain_root(self.model_id, "")
        first, first_parent, stored = len(keys), parent, []
        for i in range(len(keys), len(tokens) // BLOCK):
            parent = block_key(parent, tokens[i * BLOCK:(i + 1) * BLOCK])
            keys.append(parent)
            if parent not in self.index:
                self.index[parent] = seq
                stored.append(parent)
        if stored:
            # One event per commit: keys of other holders in between are re-announced harmlessly.
            self._emit(BlockEvent.STORED, {"block_hashes": keys[first:], "parent_block_hash": first_parent,
                                  "token_ids": list(tokens[first * BLOCK:len(keys) * BLOCK]), "block_size": BLOCK,
                                  "cache_id": cache_id})

    def truncate(self, seq: int, new_len: int) -> None:
        """``seq`` keeps its first ``new_len`` positions: its later keys stop naming it."""
        keys = self.keys.get(seq, [])
        self._drop(seq, keys[new_len // BLOCK:])
        del keys[new_len // BLOCK:]

    def retire(self, seq: int, length: int) -> bool:
        """A released cache's sequence: kept (True) when it holds keyed blocks the index points to,
        else the caller wipes it."""
        if self.enabled and any(self.index.get(k) == seq for k in self.keys.get(seq, ())):
            self.evictable[seq] = length
            return True
        self.forget(seq)
        return False

    def evict(self, keep: set[int] = frozenset()) -> int | None:
        """Wipe the least recently released sequence not in ``keep`` (sources of the running
        step); its id, or None when there is none."""
        seq = next((s for s in self.evictable if s not in keep), None)
        if seq is None:
            return None
        del self.evictable[seq]
        self._wipe(seq)
        self.stats.evicted_blocks += sum(1 for k in self.keys.get(seq, ()) if self.index.get(k) == seq)
        self.forget(seq)
        return seq

    def move(self, src: int, dst: int) -> None:
        """Retired ``src``'s cells were copied to ``dst`` (and ``src`` is wiped): ``dst`` holds its
        keys and its place in the eviction order."""
        for k in self.keys.get(src, ()):
            if self.index.get(k) == src:
                self.index[k] = dst
        self.keys[dst] = self.keys.pop(src, [])
        self.roots[dst] = self.roots.pop(src, b"")
        if src in self.evictable:
            self.evictable = collections.OrderedDict((dst if s == src else s, n) for s, n in self.evictable.items())

    def forget(self, seq: int) -> None:
        """``seq`` holds nothing any more (wiped or reused)."""
        self._drop(seq, self.keys.pop(seq, []))
        self.roots.pop(seq, None)

    def clear(self) -> list[int]:
        """Drop every retired sequence (wiped) and the index; the retired ids, to be freed."""
        seqs = list(self.evictable)
        for s in seqs:
            self._wipe(s)
        had = bool(self.index)
        self.evictable.clear()
        self.index.clear()
        self.keys.clear()
        self.roots.clear()
        if had:
            self._emit(BlockEvent.CLEARED, {})
        return seqs

    # ---- internals -------------------------------------------------------------------------------
    def _drop(self, seq: int, keys: Sequence[bytes]) -> None:
        gone = [k for k in keys if self.index.get(k) == seq]
        for k in gone:
            del self.index[k]
        if gone:
            self._emit(BlockEvent.REMOVED, {"block_hashes": gone})

    def _emit(self, kind: BlockEvent, data: dict) -> None:
        if self.on_event is not None:
            self.on_event(kind, data)


__all__ = ["BLOCK", "SequencePrefixIndex"]
