"""A paged KV block pool and the transformers ``Cache`` view that lets one forward use it.

Layout. Per layer, one K tensor and one V tensor of shape
``[num_blocks + 1, block_size, kv_heads, head_dim]``, allocated once for the executor's whole KV
budget. A sequence owns a list of block ids (its block table); token ``p`` of a sequence lives in
slot ``p % block_size`` of block ``table[p // block_size]``. Block 0 is the *null block*: always
zero, never handed out, used to pad the block tables of shorter rows in a batch.

One forward over a batch. :class:`PagedBatchCache` is built per forward from the rows' block
tables. transformers calls ``cache.update(k, v, layer_idx)`` in every attention layer with the
new tokens' K/V; the view

1. scatters the new tokens' K/V into their slots (``index_copy_``: only the new tokens are written),
2. gathers the batch's blocks (``index_select`` over the padded block table) and returns them as
   ``[B, kv_heads, max_blocks * block_size, head_dim]`` (a free view of the gathered tensor),

and the executor passes an explicit 4-D additive mask ``[B, 1, Q, max_blocks * block_size]`` that
encodes every row's own length and causality (transformers returns a 4-D mask as is).

See the module docstring of ``hf_causal_lm`` for why this layout was chosen and what it costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache


@dataclass
class PagedSeq:
    """Payload of one registry entry: the blocks that back the sequence, in position order."""

    blocks: list[int] = field(default_factory=list)


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
    ) -> None:
        if num_blocks < 1:
            raise ValueError("a KV pool needs at least one block")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.block_size = block_size
        self.num_blocks = num_blocks  # usable blocks (the null block comes on top)
        self.dtype = dtype
        self.device = device
        # torch.empty: on CPU the pages of a large allocation are only committed when first
        # written, so an unused budget costs address space, not RAM. Blocks are zeroed when handed
        # out (stale or uninitialised values could be NaN, and 0 * NaN poisons masked attention).
        kshape = (num_blocks + 1, block_size, num_kv_heads, head_dim)
        vshape = (num_blocks + 1, block_size, num_kv_heads, self.v_head_dim)
        self.k = [torch.empty(kshape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(vshape, dtype=dtype, device=device) for _ in range(num_layers)]
        for t in (*self.k, *self.v):
            t[0].zero_()
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
        """Bytes of the whole pool, null block included."""
        return (self.num_blocks + 1) * self.block_bytes

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size) if tokens > 0 else 0

    # ---- allocation ----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` zeroed blocks. The caller checked :attr:`free_blocks` (admission) first."""
        if n <= 0:
            return []
        if n > len(self._free):
            raise RuntimeError(f"KV pool: {n} blocks asked, {len(self._free)} free (admission should have refused)")
        ids = [self._free.pop() for _ in range(n)]
        idx = torch.tensor(ids, dtype=torch.long, device=self.device)
        for t in (*self.k, *self.v):
            t.index_fill_(0, idx, 0)
        self.peak_used = max(self.peak_used, self.used_blocks)
        return ids

    def free(self, ids: list[int]) -> None:
        self._free.extend(reversed(ids))


class PagedBatchCache(Cache):
    """A one-forward view of a :class:`BlockPool` for a batch of rows (see the module docstring).

    ``slots``: pool slot (``block * block_size + offset``) of every real new token, in row-major
    order of the padded ``[B, Q]`` input; ``valid``: those tokens' flat indices in ``[B * Q]``
    (None when no row is padded); ``table``: ``[B, max_blocks]`` block ids padded with 0.
    """

    def __init__(
        self,
        pool: BlockPool,
        *,
        slots: torch.Tensor,
        valid: torch.Tensor | None,
        table: torch.Tensor,
        kv_length: int,
        passthrough: bool = False,
    ) -> None:
        super().__init__(layers=[])
        self.passthrough = passthrough
        self.pool = pool
        self.slots = slots
        self.valid = valid
        self.table_flat = table.reshape(-1)
        self.batch = table.shape[0]
        self.kv_length = kv_length  # max_blocks * block_size

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write the new K/V ``[B, kv_heads, Q, D]`` into the pool; return the batch's K/V."""
        return self._update_one(self.pool.k[layer_idx], key_states), self._update_one(
            self.pool.v[layer_idx], value_states
        )

    def _update_one(self, pool: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        b, h, q, d = new.shape
        rows = new.transpose(1, 2).reshape(b * q, h, d)
        if self.valid is not None:
            rows = rows.index_select(0, self.valid)
        pool.view(-1, h, d).index_copy_(0, self.slots, rows.to(pool.dtype))
        if self.passthrough:
            return new
        gathered = pool.index_select(0, self.table_flat)  # [B * max_blocks, block_size, h, d]
        return gathered.view(self.batch, self.kv_length, h, d).transpose(1, 2)

    # What transformers may ask of a cache during a forward with an explicit 4-D mask.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_length

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.kv_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    @property
    def is_compileable(self) -> bool:
        return False
