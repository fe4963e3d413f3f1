"""Shaping a batch of logits rows before a token is chosen: the request's token mask and
repetition penalty (:func:`shaped_logits`), then temperature, top-k, top-p and min-p
(:func:`filtered_probs`), each as batched tensor ops on the rows' device. Used by the CPU
sampler (:mod:`.sampling`) and the device sampler (:mod:`.device_sampling`) alike."""

from __future__ import annotations

import numpy as np
import torch

from .sampling_np import distinct_ids
from .types import LogitsPolicy


def penalized_ids(ids) -> torch.Tensor:
    """The distinct ids a repetition penalty applies to, as a CPU int64 tensor: a request's array
    (already sorted and distinct, convert.penalty_token_ids) is used as it is, without a copy; a
    history (a list, bounded by the context) is deduplicated here."""
    if isinstance(ids, torch.Tensor):
        return ids
    return torch.from_numpy(distinct_ids(ids))


def shaped_logits(rows: torch.Tensor, policies: list[LogitsPolicy], histories: list[list[int]]) -> torch.Tensor:
    """``[B, V]`` fp32 logits with each row's token mask and repetition penalty applied (batched)."""
    b, v = rows.shape
    dev = rows.device
    x = rows.float()
    sps = [p.sampling for p in policies]
    masked = [i for i, sp in enumerate(sps) if sp.token_mask]
    if masked:
        allowed = torch.ones((b, v), dtype=torch.bool)
        for i in masked:
            m = np.frombuffer(sps[i].token_mask, dtype=np.uint8)[:v]
            allowed[i] = False
            allowed[i, : len(m)] = torch.from_numpy(m != 0)
        x = x.masked_fill(~allowed.to(dev), float("-inf"))
    r_idx: list[torch.Tensor] = []
    c_idx: list[torch.Tensor] = []
    for i, (sp, hist) in enumerate(zip(sps, histories)):
        if sp.repetition_penalty != 1.0:
            ids = penalized_ids(sp.penalty_token_ids if sp.penalty_token_ids is not None else hist)
            r_idx.append(torch.full((ids.numel(),), i, dtype=torch.long))
            c_idx.append(ids)
    if r_idx:
        r = torch.cat(r_idx).to(dev)
        c = torch.cat(c_idx).to(dev)
        pen = torch.tensor([sps[i].repetition_penalty for i in range(b)], dtype=torch.float32, device=dev)[r]
        vals = x[r, c]
        x = x.clone()
        x[r, c] = torch.where(vals > 0, vals / pen, vals * pen)
    return x


def filtered_probs(x: torch.Tensor, policies: list[LogitsPolicy]) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows that draw (temperature != 0): (logits over temperature, probabilities after
    top-k, top-p and min-p), batched."""
    v = x.shape[-1]
    dev = x.device
    sps = [p.sampling for p in policies]
    xs = x / torch.tensor([sp.temperature for sp in sps], dtype=torch.float32, device=dev)[:, None]
    ks = [sp.top_k if sp.top_k and sp.top_k < v else 0 for sp in sps]
    if any(ks):
        sorted_x = torch.sort(xs, dim=-1, descending=True).values
        kth = sorted_x.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=dev)[:, None])
        kth = torch.where(torch.tensor(ks, device=dev)[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
        xs = xs.masked_fill(xs < kth, float("-inf"))
    probs = torch.softmax(xs, dim=-1)
    tps = [sp.top_p for sp in sps]
    if any(tp < 1.0 for tp in tps):
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        limit = torch.tensor([tp if tp < 1.0 else float("inf") for tp in tps], dtype=torch.float32, device=dev)
        sorted_p = sorted_p.masked_fill(cum - sorted_p > limit[:, None], 0.0)
        probs = torch.zeros_like(probs).scatter(1, order, sorted_p)
    mps = [sp.min_p for sp in sps]
    if any(mp > 0.0 for mp in mps):
        floor = torch.tensor(mps, dtype=torch.float32, device=dev)[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return xs, probs


__all__ = ["filtered_probs", "shaped_logits"]
