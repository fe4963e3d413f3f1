"""Turning logits rows into what each request's :class:`LogitsPolicy` asks for.

Runs on the rows' device. Rows on a GPU are sampled there as one batch with one copy to the host
(:mod:`.device_sampling`); on the CPU, the common case — every
row greedy with no penalty or mask — is one batched argmax + log-softmax gather and a single
device-to-host transfer. Every other sampled row goes through :func:`sample_rows`: masks,
repetition penalties, temperature, top-k, top-p and min-p as batched tensor ops over all such rows
at once (one vocabulary sort for the whole batch); only the seeded draws themselves stay per row,
each with its own generator, so seeded results are the same as one row at a time
(:func:`sample_row`, kept as the reference).

Seeds: a seeded draw for the token at position ``p`` uses a generator seeded with ``seed + p``,
so the same seed and the same token history give the same token, also when a step is retried.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from .device_sampling import device_choices
from .logits_filters import filtered_probs, shaped_logits
from .types import LogitsPolicy, OutputMode


@dataclass
class RowResult:
    """One row's output (converted to ``LogitsOutput`` by ``convert.py``)."""

    token_id: int | None = None
    logprob: float = 0.0
    top: list[tuple[int, float]] = field(default_factory=list)
    logits: bytes | None = None
    logits_dtype: str = "fp32"
    vocab: int = 0
    # Server-side speculation (``speculation.py``): the tokens the same step produced after this
    # one (accepted drafts, then the next sampled token) and how many drafts it verified.
    extra: list["RowResult"] = field(default_factory=list)
    drafted: int = 0


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


def _apply_repetition_penalty(x: torch.Tensor, ids: list[int], penalty: float) -> torch.Tensor:
    if penalty == 1.0 or not ids:
        return x
    idx = torch.tensor(sorted(set(ids)), device=x.device, dtype=torch.long)
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


def process_rows(
    rows: torch.Tensor | list[torch.Tensor | None],
    policies: list[LogitsPolicy],
    histories: list[list[int]] | None = None,
    positions: list[int] | None = None,
) -> list[RowResult]:
    """Apply ``policies[i]`` to ``rows[i]``. ``histories``: tokens each row's cache holds
    (repetition penalty); ``positions``: the position each sampled token will take (seeding)."""
    n = len(policies)
    if n == 0:
        return []
    histories = histories or [[] for _ in range(n)]
    positions = positions or [0] * n
    if isinstance(rows, torch.Tensor):
        row_list = list(rows.unbind(0)) if rows.dim() == 2 else [rows]
    else:
        row_list = list(rows)
    results: list[RowResult | None] = [None] * n

    on_device = [i for i, p in enumerate(policies) if p.mode == OutputMode.SAMPLED_TOKEN
                 and row_list[i] is not None and row_list[i].device.type != "cpu"]
    if on_device:  # a GPU's rows: chosen there, one copy to the host (device_sampling.py)
        block = torch.stack([row_list[i].reshape(-1) for i in on_device])
        for i, r in zip(on_device, sample_on_device(block, [policies[i] for i in on_device],
                                                    [histories[i] for i in on_device],
                                                    [positions[i] for i in on_device])):
            results[i] = r

    fast = [
        i
        for i, p in enumerate(policies)
        if p.mode == OutputMode.SAMPLED_TOKEN and p.sampling.is_plain_greedy and p.top_logprobs == 0
        and row_list[i] is not None and results[i] is None
    ]
    if len(fast) == 1 and row_list[fast[0]].device.type == "cpu":
        # One CPU row (a unary / Session step): numpy's argmax + exp-sum costs about a third of
        # the equivalent torch ops' dispatch on a vocabulary-sized row.
        a = row_list[fast[0]].reshape(-1).float().numpy()
        t = int(a.argmax())
        lse = float(np.log(np.exp(a - a[t]).sum()))
        results[fast[0]] = RowResult(token_id=t, logprob=-lse if math.isfinite(lse) else -1e30)
    elif fast:
        block = torch.stack([row_list[i] for i in fast]).float()
        tok = block.argmax(dim=-1)
        lp = block.gather(1, tok[:, None])[:, 0] - torch.logsumexp(block, dim=-1)
        for i, t, l in zip(fast, tok.tolist(), lp.tolist()):
            results[i] = RowResult(token_id=t, logprob=l)

    sampled: list[int] = []
    for i, p in enumerate(policies):
        if results[i] is not None:
            continue
        row = row_list[i]
        if row is None or p.mode == OutputMode.NONE:
            results[i] = RowResult()
            continue
        vocab = row.shape[-1]
        if p.mode == OutputMode.FULL_LOGITS:
            results[i] = RowResult(logits=encode_row(row, p.logits_dtype), logits_dtype=p.logits_dtype, vocab=vocab)
            continue
        if p.mode == OutputMode.TOP_LOGPROBS:
            logprobs = torch.log_softmax(row.float(), dim=-1)
            results[i] = RowResult(top=_top(logprobs, p.top_logprobs))
            continue
        sampled.append(i)
    if sampled:
        block = torch.stack([row_list[i].reshape(-1) for i in sampled])
        tokens, logprobs = sample_rows(block, [policies[i] for i in sampled], [histories[i] for i in sampled],
                                       [positions[i] for i in sampled])
        lps = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None])[:, 0].tolist()
        for j, (i, token, lp) in enumerate(zip(sampled, tokens, lps)):
            k = policies[i].top_logprobs
            results[i] = RowResult(token_id=token, logprob=lp if math.isfinite(lp) else -1e30,
                                   top=_top(logprobs[j], k) if k else [])
    return results  # type: ignore[return-value]


def sample_on_device(rows: torch.Tensor, policies: list[LogitsPolicy], histories: list[list[int]] | None = None,
                     positions: list[int] | None = None) -> list[RowResult]:
    """:class:`RowResult` per row of ``rows`` (``[B, V]``, sampled-token policies), every token
    chosen on the rows' device, one copy to the host (:func:`.device_sampling.device_choices`)."""
    out = []
    for token, lp, top in device_choices(rows, policies, histories, positions):
        out.append(RowResult(token_id=token, logprob=lp if math.isfinite(lp) else -1e30, top=top))
    return out


def _top(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    k = min(k, logprobs.shape[0])
    vals, idx = torch.topk(logprobs, k)
    return list(zip(idx.tolist(), vals.tolist()))
