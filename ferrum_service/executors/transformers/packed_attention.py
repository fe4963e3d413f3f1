"""Packed (ragged) steps over the paged KV pool: the attention function transformers dispatches to.

A packed step runs every row of a batch as one sequence of ``T`` real tokens (``input_ids`` and
``position_ids`` of shape ``[1, T]``, no padding). Attention must then stay inside each row and
read each row's past from the block pool, which no stock transformers attention does. This module
registers one under :data:`ATTN_NAME` in transformers' attention and mask interfaces
(``ALL_ATTENTION_FUNCTIONS`` / ``ALL_MASK_ATTENTION_FUNCTIONS``) and switches a model to it with
:func:`install`; the model stays a plain transformers model.

* Outside a packed step (a plain ``model(...)``, ``generate()``, the executor's fresh-prompt fast
  path) both functions delegate to the model's original implementation (``sdpa`` or ``eager``),
  so results are those of the unmodified model.
* Inside ``with packed_step(step):`` the mask function returns ``None`` (no ``[T, T]`` or
  ``[B, Q, KV]`` mask is built) and the attention function computes, per row ``r`` of the step::

      fresh row (no past):  SDPA(q_r, k_new_r, v_new_r, causal)              reads only the new K/V
      row with a past:      SDPA(q_r, K_pool[blocks_r][:L_r], V_pool[...])   reads only its own blocks

  except that on CPU every one-token row (decode) with a past, scattered, contiguous or sharing
  blocks with other rows, is attended by one call of the C++ op of :mod:`.cpu_paged_attention`
  per layer, which reads each row's blocks in place through its block table (no copy; ``G``
  query heads per K/V head read each block once). Without the op (no compiler, switched off,
  CUDA, an fp16 pool, logit soft-capping), one-token rows of similar lengths (padding waste at most
  :data:`GROUP_MAX_PADDING`) are attended in one batched call over a copy of exactly their blocks,
  padded to the group's longest with the null block and masked by length: on a CPU with few K/V
  heads one call per row leaves cores idle and pays a parallel region per row, which costs more
  than the copy. A row whose blocks are one contiguous run of block ids is read **in place** (a strided
  view of the pool, no copy) and any other row's blocks are gathered once per layer into a buffer
  holding exactly the real blocks of those rows (no padding to the longest row). Grouped K/V heads
  are never expanded: a one-token row folds its ``G`` query heads per K/V head into the query
  length (``[1, kv_heads, G, D]``), longer rows use SDPA's ``enable_gqa``. A row of ``n`` tokens
  on a past of ``p`` uses an ``[n, p + n]`` boolean causal mask (bottom-right aligned), built once
  per step and shared by every layer.

The new tokens' K/V are written into their pool slots before attention by
:class:`~.paged_kv.PagedWriteCache` (``cache.update`` in every layer), so a row's pool blocks
already hold its whole context when its attention reads them.

On CUDA the same step layout (``cu_seqlens`` = row starts, per-row block tables and context
lengths, new-token slots) is exactly what paged varlen kernels take: flash-attn's
``flash_attn_varlen_func(..., block_table=...)`` or vLLM's ``paged_attention`` / FlashInfer's
``BatchPrefillWithPagedKVCacheWrapper``; a CUDA build of :func:`_packed_attention` would call one
of them once per layer instead of the per-row loop, with no other change to the executor.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

#: The name registered in transformers' attention and mask interfaces.
ATTN_NAME = "ferrum_paged"

_STEP: contextvars.ContextVar["PackedStep | None"] = contextvars.ContextVar("ferrum_packed_step", default=None)
_BASE_ATTR = "_ferrum_base_attn_implementation"


@dataclass
class PackedRow:
    """One row of a packed step: tokens ``[start, start + n)`` of the packed input, ``past``
    tokens already cached. ``run_start``: first block id when the row's blocks up to its new length
    are one contiguous run (read in place), else None (read from the step's gather buffer at
    ``gather_offset`` blocks). ``mask``: ``[n, past + n]`` causal mask, for rows with a past and
    ``n > 1``."""

    start: int
    n: int
    past: int
    num_blocks: int
    run_start: int | None = None
    gather_offset: int = 0
    mask: torch.Tensor | None = None
    grouped: bool = False

    @property
    def length(self) -> int:
        return self.past + self.n


@dataclass
class PackedStep:
    """What one packed forward's attention needs besides q/k/v: the pool and the rows."""

    pool: Any  # paged_kv.BlockPool
    rows: list[PackedRow]
    gather_index: torch.Tensor | None  # block ids of the rows read through the gather buffer
    # One-token rows of similar lengths, attended in one batched call (see build_step):
    group_pos: torch.Tensor | None = None  # their token positions in the packed input
    group_index: torch.Tensor | None = None  # [rows * max_blocks] their blocks, padded with the null block
    group_mask: torch.Tensor | None = None  # [rows, 1, 1, max_blocks * block_size] True = a real token
    # or, with the CPU op (:mod:`.cpu_paged_attention`), every one-token row read in place:
    op_table: torch.Tensor | None = None  # [rows, max_blocks] int32 block ids, padded with the null block
    op_lengths: torch.Tensor | None = None  # [rows] int32 context lengths (the new token included)


#: One-token rows are attended in one batched call over a copy of exactly their blocks (padded to
#: the group's longest by at most this fraction of waste) instead of one call per row; on a CPU
#: with few K/V heads one call per row leaves cores idle and pays a parallel region per row.
GROUP_MAX_PADDING = 0.25


def use_paged_op(pool: Any, device: torch.device) -> bool:
    """Whether one-token rows go through the CPU op: a CPU pool of fp32 / bf16 and the op built
    (and not switched off, :func:`.cpu_paged_attention.set_enabled`)."""
    if torch.device(device).type != "cpu" or pool.dtype not in (torch.float32, torch.bfloat16):
        return False
    from . import cpu_paged_attention

    return cpu_paged_attention.available()


def build_step(pool: Any, rows: list[tuple[list[int], int, int]], device: torch.device,
               paged_op: bool | None = None) -> PackedStep:
    """Lay out a packed step. ``rows``: (block table, past, new tokens) per row, in packed order.
    ``paged_op``: attend one-token rows with the CPU op (None: :func:`use_paged_op`; callers pass
    False for attention the op does not compute, e.g. logit soft-capping)."""
    if paged_op is None:
        paged_op = use_paged_op(pool, device)
    if paged_op:
        return _build_op_step(pool, rows, device)
    bs = pool.block_size
    out: list[PackedRow] = []
    gather: list[int] = []
    start = 0
    for blocks, past, n in rows:
        nb = -(-(past + n) // bs)
        r = PackedRow(start=start, n=n, past=past, num_blocks=nb)
        if past > 0:
            _read_past(r, blocks[:nb], gather, device)
        out.append(r)
        start += n
    step = PackedStep(pool=pool, rows=out, gather_index=None)
    ones = [k for k, r in enumerate(out) if r.n == 1 and r.past > 0]
    if len(ones) > 1:
        nbmax = max(out[k].num_blocks for k in ones)
        real = sum(out[k].num_blocks for k in ones)
        if real >= (1 - GROUP_MAX_PADDING) * len(ones) * nbmax:
            table: list[int] = []
            for k in ones:
                r = out[k]
                table += rows[k][0][: r.num_blocks] + [0] * (nbmax - r.num_blocks)
                r.grouped = True
            lengths = torch.tensor([out[k].length for k in ones], device=device).view(-1, 1, 1, 1)
            step.group_pos = torch.tensor([out[k].start for k in ones], dtype=torch.long, device=device)
            step.group_index = torch.tensor(table, dtype=torch.long, device=device)
            step.group_mask = torch.arange(nbmax * bs, device=device).view(1, 1, 1, -1) < lengths
            gather = [b for k, r in enumerate(out) if not r.grouped and r.run_start is None and r.past > 0
                      for b in rows[k][0][: r.num_blocks]]
            offset = 0
            for r in out:
                if not r.grouped and r.run_start is None and r.past > 0:
                    r.gather_offset, offset = offset, offset + r.num_blocks
    step.gather_index = torch.tensor(gather, dtype=torch.long, device=device) if gather else None
    return step


def _read_past(r: PackedRow, used: list[int], gather: list[int], device: torch.device) -> None:
    """How row ``r`` reads its past blocks ``used``: in place when they are one contiguous run,
    else from the step's gather buffer (appended to ``gather``); a row of several tokens also gets
    its causal mask."""
    if used == list(range(used[0], used[0] + len(used))):
        r.run_start = used[0]
    else:
        r.gather_offset = len(gather)
        gather += used
    if r.n > 1:
        i = torch.arange(r.n, device=device).view(r.n, 1)
        j = torch.arange(r.past + r.n, device=device).view(1, r.past + r.n)
        r.mask = j <= i + r.past


def _build_op_step(pool: Any, rows: list[tuple[list[int], int, int]], device: torch.device) -> PackedStep:
    """:func:`build_step` with every one-token row (scattered, contiguous or sharing blocks) read
    in place by the CPU op through its block table; longer rows as in :func:`build_step`."""
    bs = pool.block_size
    out: list[PackedRow] = []
    gather: list[int] = []
    ones: list[int] = []
    start = 0
    for k, (blocks, past, n) in enumerate(rows):
        nb = -(-(past + n) // bs)
        r = PackedRow(start=start, n=n, past=past, num_blocks=nb)
        if past > 0 and n == 1:
            r.grouped = True
            ones.append(k)
        elif past > 0:
            _read_past(r, blocks[:nb], gather, device)
        out.append(r)
        start += n
    step = PackedStep(pool=pool, rows=out, gather_index=None)
    if gather:
        step.gather_index = torch.tensor(gather, dtype=torch.long, device=device)
    if ones:
        nbmax = max(out[k].num_blocks for k in ones)
        table = [rows[k][0][: out[k].num_blocks] + [0] * (nbmax - out[k].num_blocks) for k in ones]
        step.op_table = torch.tensor(table, dtype=torch.int32, device=device)
        step.op_lengths = torch.tensor([out[k].length for k in ones], dtype=torch.int32, device=device)
        step.group_pos = torch.tensor([out[k].start for k in ones], dtype=torch.long, device=device)
    return step


@contextlib.contextmanager
def packed_step(step: PackedStep) -> Iterator[None]:
    """Run the model calls inside as packed steps over ``step`` (this thread / task only)."""
    token = _STEP.set(step)
    try:
        yield
    finally:
        _STEP.reset(token)


def install(model: Any) -> str:
    """Route ``model``'s attention through :data:`ATTN_NAME` (idempotent); returns the original
    implementation's name, which still serves every call outside a packed step."""
    _register()
    cfg = model.config
    current = cfg._attn_implementation
    if current != ATTN_NAME:
        setattr(cfg, _BASE_ATTR, current or "sdpa")
        cfg._attn_implementation = ATTN_NAME
    return getattr(cfg, _BASE_ATTR)


def base_implementation(model: Any) -> str:
    return getattr(model.config, _BASE_ATTR, model.config._attn_implementation)


_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, _attention)
    AttentionMaskInterface.register(ATTN_NAME, _mask)
    _registered = True


def _base_name(config: Any) -> str:
    return getattr(config, _BASE_ATTR, "sdpa")


def _mask(*args, config: Any = None, **kwargs):
    if _STEP.get() is not None:
        return None
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return ALL_MASK_ATTENTION_FUNCTIONS[_base_name(config)](*args, config=config, **kwargs)


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    step = _STEP.get()
    if step is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        base = _base_name(module.config)
        fn = ALL_ATTENTION_FUNCTIONS[base] if base in ALL_ATTENTION_FUNCTIONS else None
        if fn is None:
            import importlib

            fn = importlib.import_module(type(module).__module__).eager_attention_forward
        return fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    attend = getattr(step, "attend", None)  # a static decode step (decode_graphs.py) attends itself
    if attend is not None:
        return attend(module.layer_idx, query, key, value, scaling), None
    return _packed_attention(step, module.layer_idx, query, key, value, scaling, kwargs.get("softcap")), None


_CUDA_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa(q, k, v, *, attn_mask=None, is_causal: bool = False, scale=None, enable_gqa: bool = False,
          softcap: float | None = None):
    """``F.scaled_dot_product_attention``, or, with ``softcap`` (Gemma 2's attention-logit
    soft-capping: ``scores = softcap * tanh(scores / softcap)`` before the mask and softmax, as in
    transformers' eager attention), the same computed step by step in fp32."""
    if not softcap:
        if q.is_cuda:
            # Not cuDNN's kernel: it builds a graph per new shape, and a decode row's context grows
            # every step (measured on an H200: 1.5 ms of CPU per call, 59 ms per B=1 step of a
            # 30-layer model; benchmarks/gpu_check.py).
            with sdpa_kernel(_CUDA_SDPA):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                                      scale=scale, enable_gqa=enable_gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    s = torch.tanh(s / softcap) * softcap
    if is_causal:
        n, m = s.shape[-2], s.shape[-1]
        s = s.masked_fill(~torch.ones(n, m, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


def _packed_attention(step: PackedStep, layer: int, q, k, v, scaling, softcap: float | None = None):
    """q ``[1, Hq, T, D]``, k/v ``[1, Hkv, T, D]`` (the new tokens, already in the pool) ->
    ``[1, T, Hq, Dv]``, each row attending to its own context only (``softcap``: see :func:`_sdpa`)."""
    _, hq, t, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    g = hq // hkv
    pk, pv = step.pool.k[layer], step.pool.v[layer]  # [blocks + 1, block_size, Hkv, D]
    if step.gather_index is not None:
        gk, gv = pk.index_select(0, step.gather_index), pv.index_select(0, step.gather_index)
    out = q.new_empty((t, hq, dv))
    if step.op_table is not None:
        from .cpu_paged_attention import paged_decode

        m = step.op_table.shape[0]
        qg = q[0].transpose(0, 1) if m == t else q[0].index_select(1, step.group_pos).transpose(0, 1)
        og = paged_decode(qg, pk, pv, step.op_table, step.op_lengths, scaling)
        if m == t:  # a pure decode step: rows in packed order
            return og.unsqueeze(0)
        out.index_copy_(0, step.group_pos, og)
    elif step.group_index is not None:
        m = step.group_mask.shape[0]
        kg = pk.index_select(0, step.group_index).view(m, -1, hkv, d).transpose(1, 2)
        vg = pv.index_select(0, step.group_index).view(m, -1, hkv, dv).transpose(1, 2)
        qg = q[0].index_select(1, step.group_pos).transpose(0, 1).reshape(m, hkv, g, d)
        og = _sdpa(qg, kg, vg, attn_mask=step.group_mask, scale=scaling, softcap=softcap)
        out.index_copy_(0, step.group_pos, og.reshape(m, hq, dv))
    for r in step.rows:
        if r.grouped:
            continue
        s, n = r.start, r.n
        if r.past == 0:
            o = _sdpa(
                q[:, :, s : s + n], k[:, :, s : s + n], v[:, :, s : s + n], is_causal=n > 1, scale=scaling,
                enable_gqa=g > 1, softcap=softcap,
            )
            out[s : s + n] = o[0].transpose(0, 1)
            continue
        if r.run_start is not None:
            src_k, src_v, b0 = pk, pv, r.run_start
        else:
            src_k, src_v, b0 = gk, gv, r.gather_offset
        L = r.length
        # [nb, bs, H, D] -> [L, H, D] -> [1, H, L, D]: a strided view, no copy.
        kr = src_k[b0 : b0 + r.num_blocks].view(-1, hkv, d)[:L].permute(1, 0, 2).unsqueeze(0)
        vr = src_v[b0 : b0 + r.num_blocks].view(-1, hkv, dv)[:L].permute(1, 0, 2).unsqueeze(0)
        if n == 1:
            # The G query heads of one K/V head become G queries of that head (no K/V expansion).
            o = _sdpa(q[:, :, s].view(1, hkv, g, d), kr, vr, scale=scaling, softcap=softcap)
            out[s] = o.reshape(hq, dv)  # CUDA's SDPA may return it strided (a view would fail there)
        else:
            o = _sdpa(q[:, :, s : s + n], kr, vr, attn_mask=r.mask, scale=scaling, enable_gqa=g > 1, softcap=softcap)
            out[s : s + n] = o[0].transpose(0, 1)
    return out.unsqueeze(0)
