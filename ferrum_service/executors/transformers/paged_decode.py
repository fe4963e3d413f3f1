"""One-token (decode) attention over the paged KV pool with fixed-shape metadata (graph-safe).

Every function here takes the same inputs, all of which a captured CUDA graph can hold in fixed
buffers that each step refills:

* ``q``: ``[rows, Hq, D]`` — one query token per row;
* ``k_pool`` / ``v_pool``: one layer's pool tensors ``[blocks, block_size, Hkv, D]``
  (:class:`~.paged_kv.BlockPool`); query head ``i`` reads K/V head ``i // (Hq // Hkv)``;
* ``table``: ``[rows, width]`` block ids (entries past a row's length are ignored);
* ``lengths``: ``[rows]`` tokens of context per row (>= 1, the new token's K/V already written).

Token ``p`` of a row lives in slot ``p % block_size`` of block ``table[row, p // block_size]``
(:func:`token_slots`, the one rule every implementation follows). The implementations:

* :func:`reference_decode` — per row, exactly the row's tokens, in fp32 (tests' ground truth);
* :func:`gathered_decode` — all ``width`` blocks of every row gathered and masked by length:
  pure torch, fixed shapes, so it runs inside a graph on any device; its cost grows with
  ``width``, so callers key graphs by a width bucket;
* :func:`triton_decode` (CUDA, or Triton's interpreter) — one program per (row, K/V head) walks
  the row's blocks in place up to its length (read from memory), online softmax, the ``G`` query
  heads of a K/V head scored together; no copy, cost independent of ``width``;
* the CPU C++ op (:func:`.cpu_paged_attention.paged_decode`) takes the same arguments.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

Decode = Callable[..., torch.Tensor]


def token_slots(table: torch.Tensor, lengths: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool slots of every position ``[0, width * block_size)`` of every row, and which are real:
    ``(slots [rows, width * bs], valid [rows, width * bs])``."""
    rows, width = table.shape
    pos = torch.arange(width * block_size, device=table.device)
    slots = table.long().repeat_interleave(block_size, dim=1) * block_size + (pos % block_size)
    return slots, pos.view(1, -1) < lengths.long().view(-1, 1)


def reference_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                     lengths: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Row by row, exactly each row's tokens, fp32: ``softmax(q·Kᵀ·scale)·V`` -> ``[rows, Hq, Dv]``."""
    rows, hq, d = q.shape
    bs, hkv, dv = k_pool.shape[1], k_pool.shape[2], v_pool.shape[-1]
    g = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    slots, valid = token_slots(table, lengths, bs)
    out = torch.empty((rows, hq, dv), dtype=torch.float32, device=q.device)
    for r in range(rows):
        s = slots[r][valid[r]]
        k = k_pool.reshape(-1, hkv, d).index_select(0, s).float()  # [L, Hkv, D]
        v = v_pool.reshape(-1, hkv, dv).index_select(0, s).float()
        qr = q[r].float().view(hkv, g, d)
        att = torch.einsum("hgd,lhd->hgl", qr, k) * scale
        out[r] = torch.einsum("hgl,lhd->hgd", att.softmax(-1), v).reshape(hq, dv)
    return out.to(q.dtype)


def gathered_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                    lengths: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Every row's ``width`` blocks gathered (fixed shapes), masked by length, one SDPA call:
    graph-safe on any device. ``[rows, Hq, D]`` -> ``[rows, Hq, Dv]``."""
    rows, hq, d = q.shape
    width = table.shape[1]
    bs, hkv, dv = k_pool.shape[1], k_pool.shape[2], v_pool.shape[-1]
    idx = table.reshape(-1).long()
    k = k_pool.index_select(0, idx).view(rows, width * bs, hkv, d).transpose(1, 2)  # [rows, Hkv, W*bs, D]
    v = v_pool.index_select(0, idx).view(rows, width * bs, hkv, dv).transpose(1, 2)
    mask = (torch.arange(width * bs, device=q.device).view(1, -1) < lengths.long().view(-1, 1)).view(rows, 1, 1, -1)
    qg = q.reshape(rows, hkv, hq // hkv, d).to(k.dtype)  # the G query heads of a K/V head as G queries
    o = torch.nn.functional.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return o.reshape(rows, hq, dv).to(q.dtype)


@functools.cache
def _triton_kernel() -> Any:
    """The Triton kernel (built on first use; None when Triton is missing)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def paged_decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, out_ptr, m_ptr, l_ptr, scale, table_stride,
                            HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                            DV: tl.constexpr, BS: tl.constexpr, SPLIT: tl.constexpr):
        row = tl.program_id(0)
        h = tl.program_id(1)
        part = tl.program_id(2)
        gi = tl.arange(0, G_PAD)
        di = tl.arange(0, D)
        dvi = tl.arange(0, DV)
        ti = tl.arange(0, BS)
        gmask = gi < G
        heads = h * G + gi  # the query heads of K/V head h
        q = tl.load(q_ptr + (row * HKV * G + heads)[:, None] * D + di[None, :], mask=gmask[:, None], other=0.0)
        q = q.to(tl.float32) * scale
        length = tl.load(len_ptr + row)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        s_sum = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, DV], tl.float32)
        nblocks = (length + BS - 1) // BS
        first = 0
        if SPLIT > 0:  # this program's share of the blocks (flash-decoding); partial results
            first = part * SPLIT
            nblocks = tl.minimum(nblocks, first + SPLIT)
        for j in range(first, nblocks):
            blk = tl.load(table_ptr + row * table_stride + j).to(tl.int64)
            tok = j * BS + ti
            tmask = tok < length
            base = (blk * BS + ti) * HKV + h  # [BS] token rows of head h in this block
            k = tl.load(k_ptr + base[:, None] * D + di[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G_PAD, BS]
            s = tl.where(tmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            v = tl.load(v_ptr + base[:, None] * DV + dvi[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            s_sum = s_sum * alpha + tl.sum(p, axis=1)
            m = m_new
        if SPLIT > 0:  # [rows, HKV, parts, G_PAD] maxima and sums, [..., DV] unnormalised outputs
            cell = (row * HKV + h) * tl.num_programs(2) + part
            tl.store(m_ptr + cell * G_PAD + gi, m)
            tl.store(l_ptr + cell * G_PAD + gi, s_sum)
            tl.store(out_ptr + (cell * G_PAD + gi)[:, None] * DV + dvi[None, :], acc)
        else:
            o = acc / s_sum[:, None]
            tl.store(out_ptr + (row * HKV * G + heads)[:, None] * DV + dvi[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=gmask[:, None])

    return paged_decode_kernel


def triton_available() -> bool:
    """Whether :func:`triton_decode` can run here (Triton importable)."""
    return _triton_kernel() is not None


def triton_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                  lengths: torch.Tensor, scale: float | None = None, blocks_per_split: int = 0) -> torch.Tensor:
    """The Triton kernel: blocks read in place up to each row's length (see the module docstring).
    ``table`` / ``lengths`` int32 (a table's rows may be strided: a view of a wider buffer);
    head dims powers of two. ``[rows, Hq, D]`` -> ``[rows, Hq, Dv]`` in ``q``'s dtype.
    ``blocks_per_split`` > 0: each (row, K/V head) is split over ``ceil(width / blocks_per_split)``
    programs (a long context on few rows keeps more of the GPU busy), whose partial softmax
    results are merged with a few tensor ops (fixed shapes: graph-safe)."""
    kernel = _triton_kernel()
    if kernel is None:
        raise RuntimeError("triton is not installed")
    rows, hq, d = q.shape
    bs, hkv, dv = k_pool.shape[1], k_pool.shape[2], v_pool.shape[-1]
    g = hq // hkv
    g_pad = max(1, 1 << (g - 1).bit_length())
    sc = float(d ** -0.5 if scale is None else scale)
    meta = dict(HKV=hkv, G=g, G_PAD=g_pad, D=d, DV=dv, BS=bs, SPLIT=blocks_per_split)
    if blocks_per_split <= 0:
        out = torch.empty((rows, hq, dv), dtype=q.dtype, device=q.device)
        kernel[(rows, hkv, 1)](q.contiguous(), k_pool, v_pool, table, lengths, out, out, out, sc, table.stride(0),
                               **meta)
        return out
    parts = -(-table.shape[1] // blocks_per_split)
    acc = torch.empty((rows, hkv, parts, g_pad, dv), dtype=torch.float32, device=q.device)
    m = torch.empty((rows, hkv, parts, g_pad), dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    kernel[(rows, hkv, parts)](q.contiguous(), k_pool, v_pool, table, lengths, acc, m, l_sum, sc, table.stride(0),
                               **meta)
    w = torch.exp(m - m.amax(dim=2, keepdim=True))  # parts past a row's length: m = -inf, weight 0
    o = (acc * w[..., None]).sum(2) / (l_sum * w).sum(2)[..., None]  # [rows, hkv, g_pad, dv]
    return o[:, :, :g].reshape(rows, hq, dv).to(q.dtype)


def cpu_op_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                  lengths: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """The CPU C++ op (:mod:`.cpu_paged_attention`), same arguments (int32 table and lengths)."""
    from .cpu_paged_attention import paged_decode

    return paged_decode(q, k_pool, v_pool, table, lengths, scale)


#: The implementations by name (what the runner and the GPU check pick from).
def triton_split_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                        lengths: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """:func:`triton_decode` split into programs of :data:`SPLIT_BLOCKS` blocks."""
    return triton_decode(q, k_pool, v_pool, table, lengths, scale, blocks_per_split=SPLIT_BLOCKS)


#: Blocks per program of the split Triton kernel (8 blocks: 128 tokens of 16).
SPLIT_BLOCKS = 8

BACKENDS: dict[str, Decode] = {"gathered": gathered_decode, "triton": triton_decode, "cpu-op": cpu_op_decode,
                               "reference": reference_decode, "triton-split": triton_split_decode}

#: Whether a backend's cost grows with the table's width (its graphs are then keyed by width too).
WIDTH_BOUND = {"gathered": True, "reference": True, "triton": False, "cpu-op": False, "triton-split": False}


def default_backend(device: torch.device, pool_dtype: torch.dtype) -> str:
    """The backend a static decode step uses: Triton on CUDA, the C++ op on a CPU that built it,
    else the gathered torch path."""
    if device.type == "cuda" and triton_available():
        return "triton"
    if device.type == "cpu" and pool_dtype in (torch.float32, torch.bfloat16):
        from . import cpu_paged_attention

        if cpu_paged_attention.available():
            return "cpu-op"
    return "gathered"


__all__ = ["BACKENDS", "SPLIT_BLOCKS", "WIDTH_BOUND", "default_backend", "gathered_decode", "reference_decode",
           "token_slots", "triton_available", "triton_decode", "triton_split_decode"]
