"""Decode-only steps through static buffers, one per batch-size bucket, captured as CUDA graphs.

A decode-only step (every row one new token on a cache that already holds tokens, no LoRA) is
padded to its **bucket** of rows (:func:`batch_buckets`: 1, 2, 4, …, up to the executor's batch
limit) and runs through a path where every tensor lives at a fixed address:

* the inputs sit in buffers allocated once (:class:`DecodeRunner`): token ids, positions, the
  new tokens' pool slots (``[3, rows]`` int64), block tables (``[rows, width]`` int32) and context
  lengths (``[rows]`` int32); a step fills their first rows (one host-to-device copy each);
* attention reads the block pool in place through those buffers (:mod:`.paged_decode`; the
  backend is chosen per device);
* padding rows feed the pad token at position 0, write their K/V into the pool's **spare block**
  (never handed to a cache: :class:`~.paged_kv.BlockPool` ``spare_blocks``) and attend to it alone,
  so they never touch a real cache's blocks.

On CUDA (``capture=True``) each (bucket, width) key is captured once with
``torch.cuda.CUDAGraph`` (on first use, or all buckets at :meth:`DecodeRunner.capture_all`) into
one shared memory pool, and later steps only refill the buffers and replay. Elsewhere the same
static path runs eagerly — what the CPU tests compare with the executor's packed path. A step
that is not decode-only, uses an adapter, or needs more rows or blocks than the buffers hold is
not taken (:meth:`DecodeRunner.run` returns None) and runs eagerly as before.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from ...core.steps import Want
from .packed_attention import packed_step
from .paged_decode import BACKENDS, WIDTH_BOUND, default_backend
from .paged_kv import BlockPool, PagedWriteCache

log = structlog.get_logger(__name__)


def batch_buckets(limit: int) -> list[int]:
    """Row counts a decode step is padded to: powers of two below ``limit``, then ``limit``."""
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit] if limit >= 1 else out


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding ``n`` rows (None: more rows than the largest)."""
    return next((b for b in buckets if b >= n), None)


def width_buckets(max_blocks: int, smallest: int = 8) -> list[int]:
    """Block-table widths for backends whose cost grows with the width: powers of two from
    ``smallest``, then ``max_blocks``."""
    return [w for w in batch_buckets(max_blocks) if w >= min(smallest, max_blocks)]


class _DecodeAttention:
    """What attention reads during a static decode step (set with ``packed_step``): the pool and
    the fixed table / length buffers; ``attend`` is called by every layer."""

    def __init__(self, pool: BlockPool, table: torch.Tensor, lengths: torch.Tensor, backend: str) -> None:
        self.pool, self.table, self.lengths, self.fn = pool, table, lengths, BACKENDS[backend]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None):
        """q ``[1, Hq, R, D]`` (the new K/V already in the pool) -> ``[1, R, Hq, Dv]``."""
        out = self.fn(q[0].transpose(0, 1), self.pool.k[layer], self.pool.v[layer], self.table, self.lengths, scaling)
        return out.unsqueeze(0)


@dataclass
class DecodeGraphStats:
    """Counters of the static decode path."""

    replays: int = 0  # steps replayed from a captured graph
    static_runs: int = 0  # steps run eagerly through the static buffers
    captures: int = 0
    capture_seconds: float = 0.0
    graph_bytes: int = 0  # device memory reserved while capturing (the graphs' shared pool)
    declined: dict[str, int] = field(default_factory=dict)  # steps left to the packed path, by reason


class DecodeRunner:
    """Decode-only steps through static buffers (see the module docstring)."""

    def __init__(self, model: Any, pool: BlockPool, *, max_rows: int, max_blocks: int, pad_id: int,
                 capture: bool, backend: str | None = None) -> None:
        if pool.spare_block is None:
            raise ValueError("the static decode path needs a pool with a spare block (padding rows write there)")
        self.model, self.pool, self.pad_id = model, pool, int(pad_id)
        self.device = pool.device
        self.capture = bool(capture) and self.device.type == "cuda"
        self.backend = backend or default_backend(self.device, pool.dtype)
        self.buckets = batch_buckets(max_rows)
        self.max_blocks = max_blocks
        self.widths = width_buckets(max_blocks) if WIDTH_BOUND[self.backend] else [max_blocks]
        rows = self.buckets[-1]
        self._long = torch.zeros((3, rows), dtype=torch.long, device=self.device)  # ids, positions, slots
        self._table = torch.zeros((rows, max_blocks), dtype=torch.int32, device=self.device)
        self._lengths = torch.ones(rows, dtype=torch.int32, device=self.device)
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self._mempool = torch.cuda.graph_pool_handle() if self.capture else None
        self.stats = DecodeGraphStats()

    # ---- which steps ---------------------------------------------------------------------------
    def key_for(self, rows: list[Any]) -> tuple[int, int] | str:
        """The (bucket, width) a step of ``rows`` (``forward.Row``) runs as, or why it is declined."""
        if not all(len(r.tokens) == 1 and r.past > 0 for r in rows):
            return "not decode-only"
        if any(r.lora is not None for r in rows):
            return "adapter"
        if any(r.want is Want.ALL for r in rows):
            return "all positions"
        bucket = bucket_for(len(rows), self.buckets)
        if bucket is None:
            return "rows"
        need = max(-(-(r.past + 1) // self.pool.block_size) for r in rows)
        width = bucket_for(need, self.widths)
        if width is None:
            return "blocks"
        return bucket, width

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, rows: list[Any]) -> list[torch.Tensor | None] | None:
        """Logits per row (``[vocab]`` fp32; None for :attr:`Want.NONE`), or None when the step is
        not one this path takes (the caller runs it eagerly)."""
        key = self.key_for(rows)
        if isinstance(key, str):
            self.stats.declined[key] = self.stats.declined.get(key, 0) + 1
            return None
        if self.capture and key not in self._graphs:
            self._capture(key)
        self._fill(rows, *key)
        if self.capture:
            graph, logits = self._graphs[key]
            graph.replay()
            self.stats.replays += 1
        else:
            logits = self._forward(*key)
            self.stats.static_runs += 1
        n = len(rows)
        real = logits[:n].to(torch.float32, copy=True)  # the buffers are refilled by the next step
        return [real[i] if r.want is not Want.NONE else None for i, r in enumerate(rows)]

    def _fill(self, rows: list[Any], bucket: int, width: int) -> None:
        """Write the step's inputs into the first ``bucket`` rows of the buffers; rows past
        ``len(rows)`` are padding (pad token at position 0, written into and reading only the
        spare block)."""
        bs, spare = self.pool.block_size, self.pool.spare_block
        n = len(rows)
        ids = [r.tokens[0] for r in rows] + [self.pad_id] * (bucket - n)
        pos = [r.past for r in rows] + [0] * (bucket - n)
        slots = [r.blocks[r.past // bs] * bs + r.past % bs for r in rows] + [spare * bs] * (bucket - n)
        lengths = [r.past + 1 for r in rows] + [1] * (bucket - n)
        table = []
        for r in rows:
            used = r.blocks[: -(-(r.past + 1) // bs)]
            table.append(used + [0] * (width - len(used)))
        table += [[spare] + [0] * (width - 1)] * (bucket - n)
        self._long[:, :bucket].copy_(torch.tensor([ids, pos, slots], dtype=torch.long), non_blocking=True)
        self._table[:bucket, :width].copy_(torch.tensor(table, dtype=torch.int32), non_blocking=True)
        self._lengths[:bucket].copy_(torch.tensor(lengths, dtype=torch.int32), non_blocking=True)

    def _forward(self, bucket: int, width: int) -> torch.Tensor:
        """The model over the buffers' first ``bucket`` rows: logits ``[bucket, vocab]`` (model dtype)."""
        table = self._table[:bucket, :width] if width < self.max_blocks else self._table[:bucket]
        step = _DecodeAttention(self.pool, table, self._lengths[:bucket], self.backend)
        cache = PagedWriteCache(self.pool, slots=self._long[2, :bucket], kv_length=bucket)
        with packed_step(step):
            out = self.model(input_ids=self._long[0, :bucket].view(1, bucket),
                             position_ids=self._long[1, :bucket].view(1, bucket), cache=cache, use_cache=True,
                             logits_to_keep=0)
        return out.logits[0]

    # ---- CUDA graphs -----------------------------------------------------------------------------
    def _capture(self, key: tuple[int, int]) -> None:
        bucket, width = key
        t0 = time.perf_counter()
        self._fill([], bucket, width)  # all padding: warm-up and capture write only the spare block
        before = torch.cuda.memory_reserved(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # compile kernels, create handles, outside the capture
            self._forward(bucket, width)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            logits = self._forward(bucket, width)
        torch.cuda.synchronize(self.device)
        self._graphs[key] = (graph, logits)
        st = self.stats
        st.captures += 1
        st.capture_seconds += time.perf_counter() - t0
        st.graph_bytes += max(0, torch.cuda.memory_reserved(self.device) - before)
        log.info("decode graph captured", rows=bucket, width=width, backend=self.backend,
                 seconds=round(time.perf_counter() - t0, 3), graph_bytes=st.graph_bytes)

    @torch.inference_mode()
    def capture_all(self) -> int:
        """Capture every batch bucket (largest first, so the shared pool is sized once) at the
        widest table; returns the graphs captured (0 without CUDA)."""
        if not self.capture:
            return 0
        n = 0
        for bucket in reversed(self.buckets):
            key = (bucket, self.widths[-1])
            if key not in self._graphs:
                self._capture(key)
                n += 1
        return n

    def metadata(self) -> dict[str, Any]:
        """What ``Info`` reports about this path."""
        return {"decode_graphs": "cuda-graphs" if self.capture else "static-eager",
                "decode_attention": self.backend,
                "decode_graph_buckets": ",".join(map(str, self.buckets)),
                "decode_graphs_captured": len(self._graphs),
                "decode_graph_bytes": self.stats.graph_bytes}


def max_table_blocks(max_sequence_length: int, block_size: int) -> int:
    """Blocks one row's table can need."""
    return max(1, math.ceil(max_sequence_length / block_size))


__all__ = ["DecodeGraphStats", "DecodeRunner", "batch_buckets", "bucket_for", "max_table_blocks", "width_buckets"]
