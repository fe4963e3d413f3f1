"""The sampler for numpy logits rows (the stub, configurable and llama.cpp executors), without torch.

The same policy steps as :mod:`.sampling_torch`, in the same order and with the same meaning:
token mask, repetition penalty, temperature, top-k, top-p (the smallest prefix of the sorted
distribution whose mass reaches ``top_p``), min-p, then one draw. These rows live on the CPU
already, so each is sampled on its own (a vocabulary-sized row costs microseconds in numpy).

Seeds: a seeded draw for the token at position ``p`` uses a numpy generator seeded with
``seed + p``, so the same seed and token history give the same token, also when a step is retried.
The stream is numpy's, not torch's: a seed picks the same token on every run of a numpy-row
executor, not the token a torch-row executor would pick from the same logits.
"""

from __future__ import annotations

import math

import numpy as np

from .types import LogitsPolicy

_NEG_INF = np.float32(-np.inf)


def _f32(row: np.ndarray) -> np.ndarray:
    return np.asarray(row, dtype=np.float32).reshape(-1)


def encode_row(row: np.ndarray, dtype: str) -> bytes:
    """A logits row as little-endian packed bytes in ``dtype`` (fp32 | fp16 | bf16; bf16 rounds to
    nearest even, as a cast to bfloat16 does)."""
    a = np.asarray(row)
    if dtype == "fp16":
        return a.astype("<f2").tobytes()
    if dtype == "bf16":
        bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
        rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        out = np.where(np.isnan(a), np.uint32(0x7FC0), rounded).astype("<u2")
        return out.tobytes()
    return a.astype("<f4").tobytes()


def log_softmax(x: np.ndarray) -> np.ndarray:
    """log-softmax of a 1-D row (float32)."""
    m = x.max()
    with np.errstate(invalid="ignore", over="ignore"):
        return (x - m - np.log(np.exp(x - m).sum())).astype(np.float32)


def _mask(x: np.ndarray, mask: bytes) -> np.ndarray:
    allowed = np.zeros(x.shape[0], dtype=bool)
    m = np.frombuffer(mask, dtype=np.uint8)[: x.shape[0]]
    allowed[: len(m)] = m != 0
    return np.where(allowed, x, _NEG_INF)


def distinct_ids(ids) -> np.ndarray:
    """The distinct ids a repetition penalty applies to, as an int64 array: a request's array
    (already sorted and distinct, convert.penalty_token_ids) is used as it is, without a copy; a
    history (a list, bounded by the context) is deduplicated here."""
    if isinstance(ids, np.ndarray):
        return ids
    return np.unique(np.asarray(ids, dtype=np.int64))


def _penalize(x: np.ndarray, ids, penalty: float) -> np.ndarray:
    if penalty == 1.0 or ids is None or len(ids) == 0:
        return x
    idx = distinct_ids(ids)
    out = x.copy()
    vals = out[idx]
    out[idx] = np.where(vals > 0, vals / np.float32(penalty), vals * np.float32(penalty))
    return out


def _draw(probs: np.ndarray, seed: int | None) -> int:
    """One token drawn with probability proportional to ``probs`` (zero-probability tokens never)."""
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(probs, dtype=np.float64)
    t = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    if t >= len(probs) or probs[t] <= 0:  # rounding at the very top of the cdf
        t = int(np.flatnonzero(probs > 0)[-1])
    return t


def sample_row(row: np.ndarray, policy: LogitsPolicy, history: list[int], position: int) -> tuple[int, np.ndarray]:
    """Sample one token from ``row``; returns (token, raw log-probabilities)."""
    sp = policy.sampling
    raw = _f32(row)
    logprobs = log_softmax(raw)
    x = raw
    if sp.token_mask:
        x = _mask(x, sp.token_mask)
    if sp.repetition_penalty != 1.0:
        ids = sp.penalty_token_ids if sp.penalty_token_ids is not None else history
        x = _penalize(x, ids, sp.repetition_penalty)
    if sp.temperature == 0.0:
        return int(x.argmax()), logprobs
    x = x / np.float32(sp.temperature)
    if sp.top_k and sp.top_k < x.shape[0]:
        kth = np.partition(x, -sp.top_k)[-sp.top_k]
        x = np.where(x < kth, _NEG_INF, x)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(x - x.max())
        probs = e / e.sum()
    if sp.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        sorted_p = probs[order]
        cum = np.cumsum(sorted_p)
        sorted_p = np.where(cum - sorted_p > sp.top_p, 0.0, sorted_p)  # keep the prefix reaching top_p
        probs = np.zeros_like(probs)
        probs[order] = sorted_p
    if sp.min_p > 0.0:
        probs = np.where(probs < sp.min_p * probs.max(), 0.0, probs)
    if not np.isfinite(probs).all() or probs.sum() <= 0:
        return int(x.argmax()), logprobs
    seed = None if sp.seed is None else (sp.seed + position) % (1 << 63)
    return _draw(probs, seed), logprobs


def greedy(rows: list[np.ndarray]) -> list[tuple[int, float]]:
    """(argmax, its log-probability) of each row."""
    out = []
    for r in rows:
        a = _f32(r)
        t = int(a.argmax())
        with np.errstate(invalid="ignore", over="ignore"):
            lse = float(np.log(np.exp(a - a[t]).sum()))
        out.append((t, -lse if math.isfinite(lse) else -1e30))
    return out


def _top(logprobs: np.ndarray, k: int) -> list[tuple[int, float]]:
    k = min(k, logprobs.shape[0])
    idx = np.argpartition(-logprobs, k - 1)[:k]
    idx = idx[np.argsort(-logprobs[idx], kind="stable")]
    return [(int(i), float(logprobs[i])) for i in idx]


def top_logprobs(row: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens of a raw logits row with their log-probabilities."""
    return _top(log_softmax(_f32(row)), k)


def sample(rows: list[np.ndarray], policies: list[LogitsPolicy], histories: list[list[int]],
           positions: list[int]) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """Per row (token, its log-probability, the policy's top log-probabilities)."""
    out = []
    for r, p, h, pos in zip(rows, policies, histories, positions):
        t, lp = sample_row(r, p, h, pos)
        out.append((t, float(lp[t]), _top(lp, p.top_logprobs) if p.top_logprobs else []))
    return out
