"""The sampler for torch logits rows (the transformers / BERT executors), on the rows' device.

Imported by :mod:`.sampling` only when a step's rows are torch tensors, so the server without torch
(the stub, configurable and llama.cpp executors, whose rows are numpy arrays: :mod:`.sampling_np`)
never imports it.

Every sampled row goes through :func:`sample_rows`: masks, repetition penalties, temperature, top-k,
top-p and min-p as batched tensor ops over all such rows at once (one vocabulary sort for the whole
batch); only the seeded draws themselves stay per row, each with its own generator, so seeded
results are the same as one row at a time (:func:`sample_row`, kept as the reference).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .device_sampling import device_choices
from .logits_filters import filtered_probs, penalized_ids, shaped_logits
from .types import LogitsPolicy


def encode_row(row: torch.Tensor, dtype: str) -> bytes:
    """A logits row as little-endian packed bytes in ``dtype`` (fp32 | fp16 | bf16)."""
    if dtype == "fp16":
        t = row.to(torch.float16)
    elif dtype == "bf16":
        t = row.to(torch.bfloat16).view(torch.int16)
    else:
        t = row.to(torch.float32)
    arr = t.detach().cpu().numpy()
    if arr.dtype.byteorder == ">":  # pragma: no cover - big-endian hosts
        arr = arr.byteswap()
    return arr.tobytes()


def _apply_repetition_penalty(x: torch.Tensor, ids, penalty: float) -> torch.Tensor:
    if penalty == 1.0 or ids is None or len(ids) == 0:
        return x
    idx = penalized_ids(ids).to(x.device)
    vals = x.index_select(0, idx)
    vals = torch.where(vals > 0, vals / penalty, vals * penalty)
    return x.index_copy(0, idx, vals)


def _mask(x: torch.Tensor, mask: bytes) -> torch.Tensor:
    allowed = torch.zeros(x.shape[0], dtype=torch.bool)
    m = np.frombuffer(mask, dtype=np.uint8)[: x.shape[0]]
    allowed[: len(m)] = torch.from_numpy(m != 0)
    return x.masked_fill(~allowed.to(x.device), float("-inf"))


def sample_row(row: torch.Tensor, policy: LogitsPolicy, history: list[int], position: int) -> tuple[int, torch.Tensor]:
    """Sample one token from ``row``; returns (token, raw log-probabilities)."""
    sp = policy.sampling
    raw = row.float()
    logprobs = torch.log_softmax(raw, dim=-1)
    x = raw
    if sp.token_mask:
        x = _mask(x, sp.token_mask)
    if sp.repetition_penalty != 1.0:
        ids = sp.penalty_token_ids if sp.penalty_token_ids is not None else history
        x = _apply_repetition_penalty(x, ids, sp.repetition_penalty)
    if sp.temperature == 0.0:
        return int(torch.argmax(x).item()), logprobs
    x = x / sp.temperature
    if sp.top_k and sp.top_k < x.shape[0]:
        kth = torch.topk(x, sp.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if sp.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = cum - sorted_p > sp.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
    if sp.min_p > 0.0:
        probs = probs.masked_fill(probs < sp.min_p * probs.max(), 0.0)
    if not torch.isfinite(probs).all() or probs.sum() <= 0:
        return int(torch.argmax(x).item()), logprobs
    gen = None
    if sp.seed is not None:
        gen = torch.Generator(device=probs.device)
        gen.manual_seed((sp.seed + position) % (1 << 63))
    token = int(torch.multinomial(probs, 1, generator=gen).item())
    return token, logprobs


def sample_rows(rows: torch.Tensor, policies: list[LogitsPolicy], histories: list[list[int]],
                positions: list[int]) -> tuple[list[int], torch.Tensor]:
    """:func:`sample_row` for a ``[B, V]`` block at once; returns (tokens, raw log-probabilities)."""
    b = rows.shape[0]
    logprobs = torch.log_softmax(rows.float(), dim=-1)
    x = shaped_logits(rows, policies, histories)
    sps = [p.sampling for p in policies]
    temps = [sp.temperature for sp in sps]
    tokens = [0] * b
    greedy = [i for i in range(b) if temps[i] == 0.0]
    if greedy:
        for i, t in zip(greedy, x[greedy].argmax(dim=-1).tolist()):
            tokens[i] = t
    hot = [i for i in range(b) if temps[i] != 0.0]
    if not hot:
        return tokens, logprobs
    xs, probs = filtered_probs(x[hot], [policies[i] for i in hot])
    bad = (~torch.isfinite(probs).all(dim=-1)) | (probs.sum(dim=-1) <= 0)
    fallback = xs.argmax(dim=-1).tolist()
    unseeded = []
    for j, (i, is_bad) in enumerate(zip(hot, bad.tolist())):
        if is_bad:
            tokens[i] = fallback[j]
        elif sps[i].seed is not None:
            gen = torch.Generator(device=probs.device)
            gen.manual_seed((sps[i].seed + positions[i]) % (1 << 63))
            tokens[i] = int(torch.multinomial(probs[j], 1, generator=gen).item())
        else:
            unseeded.append(j)
    if unseeded:
        drawn = torch.multinomial(probs[unseeded], 1)[:, 0].tolist()
        for j, t in zip(unseeded, drawn):
            tokens[hot[j]] = t
    return tokens, logprobs


def greedy(rows: list[torch.Tensor]) -> list[tuple[int, float]]:
    """(argmax, its log-probability) of each row: one batched argmax + log-softmax gather."""
    if len(rows) == 1 and rows[0].device.type == "cpu":
        # One CPU row (a unary / Session step): numpy's argmax + exp-sum costs about a third of
        # the equivalent torch ops' dispatch on a vocabulary-sized row.
        a = rows[0].reshape(-1).float().numpy()
        t = int(a.argmax())
        lse = float(np.log(np.exp(a - a[t]).sum()))
        return [(t, -lse if math.isfinite(lse) else -1e30)]
    block = torch.stack(rows).float()
    tok = block.argmax(dim=-1)
    lp = block.gather(1, tok[:, None])[:, 0] - torch.logsumexp(block, dim=-1)
    return list(zip(tok.tolist(), lp.tolist()))


def top_logprobs(row: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens of a raw logits row with their log-probabilities."""
    return _top(torch.log_softmax(row.float(), dim=-1), k)


def sample(rows: list[torch.Tensor], policies: list[LogitsPolicy], histories: list[list[int]],
           positions: list[int]) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """Per row (token, its log-probability, the policy's top log-probabilities). Rows on a GPU are
    chosen there as one batch, one copy to the host (``device_sampling.py``)."""
    block = torch.stack([r.reshape(-1) for r in rows])
    if block.device.type != "cpu":
        return device_choices(block, policies, histories, positions)
    tokens, logprobs = sample_rows(block, policies, histories, positions)
    lps = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None])[:, 0].tolist()
    return [(t, lp, _top(logprobs[j], p.top_logprobs) if p.top_logprobs else [])
            for j, (t, lp, p) in enumerate(zip(tokens, lps, policies))]


def _top(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    k = min(k, logprobs.shape[0])
    vals, idx = torch.topk(logprobs, k)
    return list(zip(idx.tolist(), vals.tolist()))
