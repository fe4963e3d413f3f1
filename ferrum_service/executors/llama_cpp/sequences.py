"""llama.cpp sequence ids and their KV, in either layout of the executor (``kv=``).

- ``unified``: one KV buffer of ``n_ctx`` cells shared by every sequence; a sequence's cells are
  tagged with its id, and copying a prefix into another sequence tags the same cells with both ids
  (``llama_memory_seq_cp(src, dst, 0, n)``: nothing is copied).
- ``streams``: one KV stream of ``n_ctx / n_seq`` cells per sequence id (``kv_unified`` false, as
  llama-server runs with ``-np N``), so a step's attention reads only each row's own stream. A
  partial ``llama_memory_seq_cp`` across streams aborts the process in llama.cpp, and a whole-stream
  one is applied lazily (at the next decode), so a prefix is copied here as llama.cpp's own
  sequence state bytes (``llama_state_seq_get_data`` / ``set_data``, synchronous) and then cut.

Ids are handed out lowest first (a heap), so the live ids stay dense from 0: with streams,
llama.cpp runs only sequences whose ids are consecutive in batch order in one ubatch (one pass over
the weights), and the step's rows are sorted by id (:mod:`.batch`).
"""

from __future__ import annotations

import ctypes
import heapq
from typing import Any

from ...core import errors

#: The executor's KV layouts (``kv=`` of a llama-cpp model spec).
LAYOUTS = ("streams", "unified")
#: llama.cpp pads a stream's cells to a multiple of this.
STREAM_PAD = 256


def stream_cells(total: int, n_seq: int) -> int:
    """Cells per stream for a budget of ``total`` cells over ``n_seq`` streams: a multiple of
    :data:`STREAM_PAD`, at least one."""
    return max(STREAM_PAD, (total // max(1, n_seq)) // STREAM_PAD * STREAM_PAD)


class SequenceIds:
    """The free sequence ids (lowest first) and the copy of a sequence's leading positions into
    another, legal in the context's layout."""

    def __init__(self, L: Any, ctx: Any, n_seq: int, *, streams: bool) -> None:
        self._L, self._ctx = L, ctx
        self._mem = L.llama_get_memory(ctx)
        self.streams = streams
        self.free: list[int] = list(range(n_seq))  # a heap: free[0] is the lowest free id

    def __len__(self) -> int:
        return len(self.free)

    def __iter__(self):
        """The free ids (in no particular order)."""
        return iter(list(self.free))

    def take(self) -> int:
        """The lowest free id (IndexError when none is free)."""
        return heapq.heappop(self.free)

    def give(self, seq: int) -> None:
        """``seq`` is free again (its cells already wiped)."""
        heapq.heappush(self.free, seq)

    def take_highest_above(self, seq: int) -> int | None:
        """The highest free id above ``seq``, taken; None when there is none."""
        top = max((s for s in self.free if s > seq), default=None)
        if top is not None:
            self.free.remove(top)
            heapq.heapify(self.free)
        return top

    def wipe(self, seq: int) -> None:
        """Remove every cell of ``seq``."""
        self._L.llama_memory_seq_rm(self._mem, seq, -1, -1)

    def copy(self, src: int, dst: int, n: int) -> None:
        """``dst`` (empty) holds ``src``'s first ``n`` positions after this."""
        L = self._L
        if not self.streams:
            L.llama_memory_seq_cp(self._mem, src, dst, 0, n)
            return
        self.wipe(dst)
        size = int(L.llama_state_seq_get_size(self._ctx, src))
        buf = (ctypes.c_uint8 * size)()
        got = int(L.llama_state_seq_get_data(self._ctx, buf, size, src))
        if got == 0 or int(L.llama_state_seq_set_data(self._ctx, buf, got, dst)) == 0:
            self.wipe(dst)
            raise errors.FerrumError(errors.ErrorKind.BACKEND, f"llama.cpp could not copy sequence {src} to {dst}")
        L.llama_memory_seq_rm(self._mem, dst, n, -1)


__all__ = ["LAYOUTS", "STREAM_PAD", "SequenceIds", "stream_cells"]
