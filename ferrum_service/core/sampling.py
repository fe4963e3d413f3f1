"""Turning logits rows into what each request's :class:`LogitsPolicy` asks for.

Rows are torch tensors (transformers / BERT executors, on their device: sampling runs on the GPU
when the model is there; :mod:`.sampling_torch`) or numpy arrays (the stub, configurable and
llama.cpp executors, which run without torch; :mod:`.sampling_np`). This module sorts a step's rows
by what each policy asks and hands them to the sampler of their kind; torch is imported only when
a row is a torch tensor. The common case — every row greedy with no penalty or mask — is one
batched argmax + log-softmax gather.

Seeds: a seeded draw for the token at position ``p`` uses a generator seeded with ``seed + p``,
so the same seed and the same token history give the same token, also when a step is retried.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

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
    # ferrum's ``NoSelectableFiniteLogit``: the row's token mask / constraint left no finite logit.
    # ``token_id`` keeps the sampler's arbitrary pick (the Generate streams go on as before); the
    # step RPCs answer the flag instead of a token (``convert.row_pb``).
    no_selectable_finite_logit: bool = False


def _sampler(row: Any) -> ModuleType:
    """The sampler module for ``row``'s kind (numpy array or torch tensor)."""
    if isinstance(row, np.ndarray):
        from . import sampling_np

        return sampling_np
    from . import sampling_torch

    return sampling_torch


def encode_row(row: Any, dtype: str) -> bytes:
    """A logits row (torch tensor or numpy array) as little-endian packed bytes in ``dtype``
    (fp32 | fp16 | bf16)."""
    return _sampler(row).encode_row(row, dtype)


def process_rows(
    rows: Any,
    policies: list[LogitsPolicy],
    histories: list[list[int]] | None = None,
    positions: list[int] | None = None,
) -> list[RowResult]:
    """Apply ``policies[i]`` to ``rows[i]`` (a ``[B, V]`` tensor / array, or a list of ``[V]`` rows
    and Nones). ``histories``: tokens each row's cache holds (repetition penalty); ``positions``: the
    position each sampled token will take (seeding)."""
    n = len(policies)
    if n == 0:
        return []
    histories = histories or [[] for _ in range(n)]
    positions = positions or [0] * n
    if isinstance(rows, (list, tuple)):
        row_list = list(rows)
    else:
        row_list = list(rows) if rows.ndim == 2 else [rows]
    present = next((r for r in row_list if r is not None), None)
    if present is None:
        return [RowResult() for _ in range(n)]
    sampler = _sampler(present)
    results: list[RowResult | None] = [None] * n

    fast = [
        i
        for i, p in enumerate(policies)
        if p.mode == OutputMode.SAMPLED_TOKEN and p.sampling.is_plain_greedy and p.top_logprobs == 0
        and row_list[i] is not None
    ]
    if fast:
        for i, (t, lp) in zip(fast, sampler.greedy([row_list[i] for i in fast])):
            results[i] = RowResult(token_id=t, logprob=lp)

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
            results[i] = RowResult(logits=sampler.encode_row(row, p.logits_dtype), logits_dtype=p.logits_dtype,
                                   vocab=vocab)
            continue
        if p.mode == OutputMode.TOP_LOGPROBS:
            results[i] = RowResult(top=sampler.top_logprobs(row, p.top_logprobs))
            continue
        sampled.append(i)
    if sampled:
        drawn = sampler.sample([row_list[i] for i in sampled], [policies[i] for i in sampled],
                               [histories[i] for i in sampled], [positions[i] for i in sampled])
        for i, (token, lp, top) in zip(sampled, drawn):
            results[i] = RowResult(token_id=token, logprob=lp if math.isfinite(lp) else -1e30, top=top)
    for i, p in enumerate(policies):
        r = results[i]
        if p.mode == OutputMode.SAMPLED_TOKEN and r is not None and r.token_id is not None:
            r.no_selectable_finite_logit = _nothing_selectable(row_list[i], p, r)
    return results  # type: ignore[return-value]


def _nothing_selectable(row: Any, policy: LogitsPolicy, r: RowResult) -> bool:
    """Whether ``row`` (its constraint mask already applied in place) has no finite logit among
    the tokens ``policy``'s token mask allows. Penalties and top-k / top-p never remove every
    finite logit, so these are the only ways to lose them. Without a token mask only a row whose
    pick has a non-finite log-probability is read again (the hot path pays one comparison)."""
    mask = policy.sampling.token_mask
    if not mask and math.isfinite(r.logprob) and r.logprob > -1e30:
        return False
    if isinstance(row, np.ndarray):
        finite = np.isfinite(row.astype(np.float32, copy=False).reshape(-1))
    else:
        import torch

        finite = torch.isfinite(row.reshape(-1)).cpu().numpy()
    if mask:
        allowed = np.frombuffer(mask, dtype=np.uint8)[: finite.shape[0]] != 0
        finite = finite[: allowed.shape[0]] & allowed
    return not bool(finite.any())


def sample_on_device(rows: Any, policies: list[LogitsPolicy], histories: list[list[int]] | None = None,
                     positions: list[int] | None = None) -> list[RowResult]:
    """:class:`RowResult` per row of ``rows`` (a ``[B, V]`` torch tensor, sampled-token policies),
    every token chosen on the rows' device, one copy to the host (:func:`.device_sampling.device_choices`)."""
    from .device_sampling import device_choices

    return [RowResult(token_id=token, logprob=lp if math.isfinite(lp) else -1e30, top=top)
            for token, lp, top in device_choices(rows, policies, histories, positions)]
