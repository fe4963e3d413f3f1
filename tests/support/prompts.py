"""Token-id prompts for the tests: ``prompt_ids(n, seed)`` is ``n`` ids drawn uniformly from
``[lo, hi)`` by ``random.Random(seed)`` — the same seed gives the same prompt in every module.

The default range suits the tiny random-weight models (vocabulary 512); SmolLM2 tests draw from
``SMOLLM2`` (ordinary text ids, no special tokens)."""

from __future__ import annotations

import random

#: ``lo``/``hi`` of ordinary SmolLM2 ids (its specials are below 100).
SMOLLM2 = {"lo": 100, "hi": 40000}


def prompt_ids(n: int, seed: int = 0, *, lo: int = 1, hi: int = 500) -> list[int]:
    """``n`` token ids in ``[lo, hi)``, the same for the same ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(lo, hi) for _ in range(n)]
