"""A paged KV block pool and the transformers ``Cache`` view that lets one forward use it.

Layout. Per layer, one K tensor and one V tensor of shape
``[num_blocks + 1, block_size, kv_heads, head_dim]``, allocated once for the executor's whole KV
budget. A sequence holds a list of block ids (its block table; :class:`.prefix_cache.SeqBlocks`,
where refcounts let tables share blocks); token ``p`` of a sequence lives in
slot ``p % block_size`` of block ``table[p // block_size]``. Block 0 is the *null block*: always
zero and never handed out.

One forward. :class:`PagedWriteCache` is built per forward from the new tokens' slots.
transformers calls ``cache.update(k, v, layer_idx)`` in every attention layer with the new
tokens' K/V; the cache scatters them into their slots (``index_copy_``: only the new tokens are
written) and hands them back unchanged. Reading the past is attention's job
(:mod:`.packed_attention`), which reads each row's own blocks in place.

See the package docstring (:mod:`ferrum_service.executors.transformers`) for why this layout was
chosen and what it costs.
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache


class BlockPool:
    """Fixed pool of KV blocks for every layer of one model."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        v_head_dim: int | None = None,
        spare_blocks: int = 0,
    ) -> None:
        """``spare_blocks`` (0 or 1): a block past the usable ones that is never handed out and
        counts in no figure but the pool's bytes; the static decode path's padding rows write
        their K/V there (:mod:`.decode_graphs`), so they never touch a cache's blocks."""
        if num_blocks < 1:
            raise ValueError("a KV pool needs at least one block")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.block_size = block_size
        self.num_blocks = num_blocks  # usable blocks (the null block comes on top)
        self.spare_block: int | None = num_blocks + 1 if spare_blocks else None
        self._extra = 1 + (1 if spare_blocks else 0)  # the null block, and the spare one
        self.dtype = dtype
        self.device = device
        # torch.empty: on CPU the pages of a large allocation are only committed when first
        # written, so an unused budget costs address space, not RAM. Blocks are zeroed when handed
        # out (stale or uninitialised values could be NaN, and 0 * NaN poisons masked attention).
        kshape = (num_blocks + self._extra, block_size, num_kv_heads, head_dim)
        vshape = (num_blocks + self._extra, block_size, num_kv_heads, self.v_head_dim)
        self.k = [torch.empty(kshape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(vshape, dtype=dtype, device=device) for _ in range(num_layers)]
        for t in (*self.k, *self.v):
            t[0].zero_()
            if self.spare_block is not None:
                t[self.spare_block].zero_()
        self._free = list(range(num_blocks, 0, -1))  # pop() hands out low ids first
        self.peak_used = 0

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers: 2 · layers · kv_heads · head_dim · dtype bytes."""
        return self.num_layers * self.num_kv_heads * (self.head_dim + self.v_head_dim) * self.element_size

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole pool, null (and spare) block included."""
        return (self.num_blocks + self._extra) * self.block_bytes

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size) if tokens > 0 else 0

    # ---- allocation ----------------------------------------------------------------------------
    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """``n`` zeroed blocks. The caller checked :attr:`free_blocks` (admission) first.

        Contiguous ids are preferred (a row whose blocks are one run of ids is read in place by
        attention): the run right after block ``after`` (a growing cache's last block) if free,
        else the lowest free run of ``n`` ids, else the lowest free ids."""
        if n <= 0:
            return []
        if n > len(self._free):
            raise RuntimeError(f"KV pool: {n} blocks asked, {len(self._free)} free (admission should have refused)")
        ids = self._contiguous(n, after)
        if ids:
            free = set(ids)
            self._free = [b for b in self._free if b not in free]
        else:
            ids = [self._free.pop() for _ in range(n)]
        idx = torch.tensor(ids, dtype=torch.long, device=self.device)
        for t in (*self.k, *self.v):
            t.index_fill_(0, idx, 0)
        self.peak_used = max(self.peak_used, self.used_blocks)
        return ids

    def _contiguous(self, n: int, after: int | None) -> list[int] | None:
        free = set(self._free)
        if after is not None and all(after + 1 + i in free for i in range(n)):
            return list(range(after + 1, after + 1 + n))
        if n == 1:
            return None
        run: list[int] = []
        for b in sorted(free):
            run = run + [b] if run and b == run[-1] + 1 else [b]
            if len(run) == n:
                return run
        return None

    def free(self, ids: list[int]) -> None:
        self._free.extend(reversed(ids))

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src``'s K/V into block ``dst`` in every layer (copy-on-write)."""
        for t in (*self.k, *self.v):
            t[dst].copy_(t[src])


def raw_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes as stored (row-major, native little-endian), copied to the host."""
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).cpu().numpy().tobytes()


class PagedWriteCache(Cache):
    """A one-forward ``transformers.Cache`` over a :class:`BlockPool` that only writes.

    ``update(k, v, layer)`` (called by every attention layer with the new tokens' K/V, shape
    ``[B, kv_heads, Q, D]``) copies them into their pool slots (``slots``: ``block * block_size +
    offset`` of every new token, row-major over ``[B, Q]``) and returns them unchanged. Attention
    then either uses them directly (a fresh prompt has no past) or reads each row's past from the
    pool itself (:mod:`.packed_attention`); nothing is gathered here.
    """

    def __init__(self, pool: BlockPool, *, slots: torch.Tensor, kv_length: int) -> None:
        super().__init__(layers=[])
        self.pool = pool
        self.slots = slots
        self.kv_length = kv_length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write the new K/V into the pool; return them as they are."""
        for pool, new in ((self.pool.k[layer_idx], key_states), (self.pool.v[layer_idx], value_states)):
            b, h, q, d = new.shape
            pool.view(-1, h, d).index_copy_(0, self.slots, new.transpose(1, 2).reshape(b * q, h, d).to(pool.dtype))
        return key_states, value_states

    # What transformers may ask of a cache during a forward (mask sizes; no mask is built for a
    # packed step, and the fast path's fresh prompts have no past).
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_length

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.kv_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    @property
    def is_compileable(self) -> bool:
        return False
