"""Server-side speculative decoding for ``Generate``: an n-gram (prompt-lookup) drafter and the
verification of its drafts.

Each step of a speculating stream feeds its last token plus up to ``max_draft`` draft tokens as one
multi-token row (``DecodeInput.draft``) of the batcher's ordinary step, next to the other streams'
one-token rows. Row ``i`` of its logits is the model's output after token ``i``; the token at each
position is drawn exactly as plain decoding draws it there (same policy, same history, same
position-seeded generator: :func:`sampling.process_rows`), and draft ``i`` is accepted while it
equals that token. The stream emits the accepted drafts plus the first drawn token that differs (or
the token after the last draft); the KV of the rejected drafts is truncated in the same worker call.

Why this is exact: a drafter that proposes one token ``d`` deterministically has ``q = δ_d``, and
the standard speculative rule (accept with probability ``min(1, p(d)/q(d)) = p(d)``, else draw from
``norm(max(0, p − q))`` = p without ``d``) is the same law as "draw x ~ p; accept iff x = d, else
emit x". Drawing x with plain decoding's own generator makes greedy output identical, seeded
sampled output token-identical (same seed, same tokens), and unseeded output distributed as plain
decoding.

The drafter (:class:`NgramDrafter`) looks the last ``n`` tokens of the sequence (prompt and output)
up in an index of every earlier n-gram, longest ``n`` first, and proposes the tokens that followed
its latest earlier occurrence — vLLM's n-gram proposer and llama.cpp's prompt-lookup decoding work
the same way. It costs O(number of sizes) per token.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from . import errors
from .sampling import RowResult, process_rows

if TYPE_CHECKING:
    from .kv_registry import CacheEntry
    from .types import LogitsPolicy

#: Most draft tokens one step verifies; larger requests are capped to it (a longer draft costs
#: more compute than the rare long acceptance returns).
MAX_DRAFT_TOKENS = 16
#: Longest n-gram looked up.
MAX_NGRAM = 8
DEFAULT_DRAFT_TOKENS = 4
DEFAULT_MIN_NGRAM = 1
DEFAULT_MAX_NGRAM = 3


@dataclass(frozen=True)
class SpeculationConfig:
    """One request's speculation: up to ``max_draft`` tokens per step, n-grams of
    ``min_ngram..max_ngram`` tokens."""

    max_draft: int = DEFAULT_DRAFT_TOKENS
    min_ngram: int = DEFAULT_MIN_NGRAM
    max_ngram: int = DEFAULT_MAX_NGRAM


def default_config(default_draft: int) -> SpeculationConfig | None:
    """The speculation of a request that asks for none: the server's default (0 = off)."""
    return SpeculationConfig(max_draft=min(default_draft, MAX_DRAFT_TOKENS)) if default_draft > 0 else None


def request_config(req: Any, default_draft: int, field: str = "speculation") -> SpeculationConfig | None:
    """The speculation a ``GenerateRequest`` asks for (None = off): its ``speculation`` option, or
    the server's default (``default_draft`` draft tokens, 0 = off) when it sets none.
    INVALID_ARGUMENT naming the field for n-gram sizes out of range; draft sizes past
    :data:`MAX_DRAFT_TOKENS` are capped."""
    if not req.HasField(field):
        return default_config(default_draft)
    opt = getattr(req, field)
    if opt.disabled:
        return None
    lo = opt.min_ngram or DEFAULT_MIN_NGRAM
    hi = opt.max_ngram or max(lo, DEFAULT_MAX_NGRAM)
    for name, v in (("min_ngram", lo), ("max_ngram", hi)):
        if not 1 <= v <= MAX_NGRAM:
            raise errors.invalid(f"{field}.{name} = {v} must be in [1, {MAX_NGRAM}]", field=f"{field}.{name}")
    if lo > hi:
        raise errors.invalid(f"{field}.min_ngram = {lo} exceeds {field}.max_ngram = {hi}", field=f"{field}.min_ngram")
    draft = opt.max_draft_tokens or (default_draft or DEFAULT_DRAFT_TOKENS)
    return SpeculationConfig(max_draft=min(draft, MAX_DRAFT_TOKENS), min_ngram=lo, max_ngram=hi)


def usable(policy: "LogitsPolicy", executor: Any) -> bool:
    """Whether a stream with this policy can speculate on this executor. A structured-output
    constraint cannot (its matcher would have to advance through every draft before the mask of
    the next position is known), nor an executor without multi-token decode rows."""
    return policy.sampling.constraint is None and executor.supports_draft_rows


class PromptIndex:
    """The n-gram index of a sequence's start (its prompt): per n, n-gram -> start of its latest
    occurrence that some token follows. Built once per request (off the event loop: it costs
    O(sizes x prompt length)) and shared, read-only, by the drafters of all its samples."""

    def __init__(self, cfg: SpeculationConfig, tokens: Sequence[int]) -> None:
        self.tokens: list[int] = [int(t) for t in tokens]
        ts = self.tokens
        self.index: dict[int, dict[tuple[int, ...], int]] = {}
        for n in range(cfg.min_ngram, cfg.max_ngram + 1):
            idx = self.index[n] = {}
            for end in range(n, len(ts)):  # the n-gram ending just before token ``end``
                idx[tuple(ts[end - n:end])] = end - n


class NgramDrafter:
    """Prompt-lookup drafts from one sequence's own tokens (see the module docstring). The prompt's
    n-grams live in a shared :class:`PromptIndex`; the drafter indexes only the n-grams its own
    output completes (always later than any prompt occurrence, so they are looked up first)."""

    def __init__(self, cfg: SpeculationConfig, prompt: "PromptIndex | Sequence[int]" = ()) -> None:
        self.cfg = cfg
        # Draft length now: shrinks by one after a rejection, grows by two after a full acceptance
        # (assisted generation's heuristic), so text with few repeats verifies short drafts.
        self.length = cfg.max_draft
        self._prompt = prompt if isinstance(prompt, PromptIndex) else PromptIndex(cfg, prompt)
        self._out: list[int] = []  # tokens after the prompt
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(cfg.min_ngram, cfg.max_ngram + 1)}

    def __len__(self) -> int:
        return len(self._prompt.tokens) + len(self._out)

    def _slice(self, a: int, b: int) -> list[int]:
        """Tokens ``a..b`` of the whole sequence (prompt then output)."""
        p = self._prompt.tokens
        if b <= len(p):
            return p[a:b]
        if a >= len(p):
            return self._out[a - len(p):b - len(p)]
        return p[a:] + self._out[:b - len(p)]

    def extend(self, tokens: Sequence[int]) -> None:
        """Append output tokens of the sequence."""
        for t in tokens:
            self._out.append(int(t))
            end = len(self) - 1  # the n-grams ending just before the new token now have a follower
            for n, idx in self._index.items():
                if end >= n:
                    idx[tuple(self._slice(end - n, end))] = end - n

    def feedback(self, drafted: int, accepted: int) -> None:
        """How the last draft did: adapts the next drafts' length (1..max_draft)."""
        if drafted:
            grow = 2 if accepted == drafted else -1
            self.length = max(1, min(self.cfg.max_draft, self.length + grow))

    def propose(self, limit: int) -> list[int]:
        """Up to ``min(limit, length)`` tokens that followed the latest earlier occurrence of the
        sequence's last n tokens (longest n first); [] when no n-gram recurs."""
        k = min(limit, self.length)
        total = len(self)
        if k <= 0:
            return []
        for n in range(self.cfg.max_ngram, self.cfg.min_ngram - 1, -1):
            if total <= n:
                continue
            key = tuple(self._slice(total - n, total))
            start = self._index[n].get(key)
            if start is None:
                start = self._prompt.index[n].get(key)
            if start is not None:
                return self._slice(start + n, min(start + n + k, total))
        return []


class SpeculationStats:
    """Per model: draft tokens verified, drafts accepted, speculative rows run (Prometheus
    ``ferrum_speculation_*_total``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.verify_rows = 0

    def record(self, drafted: int, accepted: int) -> None:
        with self._lock:
            self.draft_tokens += drafted
            self.accepted_tokens += accepted
            self.verify_rows += 1


def stats_of(host: Any) -> SpeculationStats:
    """The model's speculation counters (made on first use)."""
    st = getattr(host, "speculation_stats", None)
    if st is None:
        st = host.speculation_stats = SpeculationStats()
    return st


def sample_verified(executor: Any, logits: list, policies: list, entries: "list[CacheEntry]",
                    drafts: list[list[int]]) -> list[RowResult]:
    """Sample the decode rows of a step that carried drafts (on the worker, after the forward):
    row i's logits are ``[1 + len(drafts[i]), V]``, row j the output after its j-th token. The
    result is the first token, with ``extra`` = the accepted drafts and the token after them, and
    ``drafted``; each cache is truncated to drop its rejected drafts."""
    flat_logits: list = []
    flat_pol: list = []
    hist: list = []
    pos: list[int] = []
    for row, pol, e, draft in zip(logits, policies, entries, drafts):
        n = e.num_tokens
        base = n - len(draft)  # the position the first drawn token takes
        # the history is copied per position only when the penalty reads it (not given ids)
        penalty = pol.sampling.repetition_penalty != 1.0 and pol.sampling.penalty_token_ids is None
        for j in range(len(draft) + 1):
            flat_logits.append(row[j])
            flat_pol.append(pol)
            hist.append(e.tokens[:base + j] if penalty else [])
            pos.append(base + j)
    flat = process_rows(flat_logits, flat_pol, hist, pos)
    out: list[RowResult] = []
    start = 0
    for e, draft in zip(entries, drafts):
        drawn = flat[start:start + len(draft) + 1]
        start += len(draft) + 1
        accepted = 0
        while accepted < len(draft) and drawn[accepted].token_id == draft[accepted]:
            accepted += 1
        first = drawn[0]
        first.extra = drawn[1:accepted + 1]
        first.drafted = len(draft)
        if accepted < len(draft):  # drop the KV of the rejected drafts
            executor.truncate_kv(e.cache_id, e.num_tokens - (len(draft) - accepted))
        out.append(first)
    return out


__all__ = ["MAX_DRAFT_TOKENS", "MAX_NGRAM", "NgramDrafter", "PromptIndex", "SpeculationConfig", "SpeculationStats",
           "request_config", "sample_verified", "stats_of", "usable"]
