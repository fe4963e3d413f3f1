"""A step as data: what one forward is made of.

A step is a list of :class:`StepRow` — one sequence's share of a forward: the cache it continues
(or None for a new one), the tokens fed, which logits rows come back (:class:`Want`), the KV it
reserves and a new cache's prefix-cache options and adapter. Every executor that owns
per-sequence caches runs a step as one forward over its rows, all or nothing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .kv_registry import CacheEntry


class Want(str, enum.Enum):
    """Which logits rows a step row returns."""

    NONE = "none"  # none: a prompt chunk in the middle of a prompt, or a caller who wants no output
    LAST = "last"  # the row after the last token fed
    ALL = "all"  # one row after each token fed (all positions, speculative verification)


@dataclass
class StepRow:
    """One sequence's share of a step: ``tokens`` appended to ``entry`` (None = a new cache)."""

    entry: CacheEntry | None
    tokens: list[int]
    want: Want
    reserve: int = 0  # a new cache's KV reservation (tokens it may reach)
    salt: str = ""  # a new cache's prefix-cache salt
    bypass: bool = False  # a new cache computes every token (no prefix-cache lookup)
    adapter: str = ""  # LoRA adapter: a new cache's; for a live cache "" or its own (checked by the executor)
    cached: int = 0  # set by the executor: leading tokens taken from the prefix cache


__all__ = ["StepRow", "Want"]
