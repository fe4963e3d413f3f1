"""What a failed step did to each of its items, for the ``StepProgress`` error detail.

This server's executors run a step all or nothing (``core/steps.py``): a step that fails before or
during its forward leaves every cache as it was (the executor restores what it touched), so every
item is NOT_RUN; a step refused after its forward committed (a fed token its structured-output
constraint refuses: ``guided.refuse_broken``) leaves every row's tokens in its cache, so every
item is RAN. Progress names items by their index in the request only — never a cache id or a
cache's length — so it tells a caller nothing about caches it does not own.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from . import errors

#: The reason of an item that was fine but shared the step with the one at fault.
STEP_FAILED = "STEP_FAILED"

_INDEX = re.compile(r"^(?:inputs|items)\[(\d+)\]")


class ItemState(enum.IntEnum):
    """Mirrors ``ItemState`` in types.proto."""

    RAN = 1
    NOT_RUN = 2
    RAN_PARTIAL = 3


@dataclass(frozen=True)
class ItemProgress:
    """One item's share of a failed step."""

    index: int
    state: ItemState
    tokens_ran: int = 0
    reason: str = ""


def faulty_index(e: errors.FerrumError) -> int | None:
    """The index of the item an error names (its field ``inputs[k]...`` / ``items[k]...``), if any."""
    m = _INDEX.match(e.field)
    return int(m.group(1)) if m else None


def none_ran(n_items: int, e: errors.FerrumError) -> list[ItemProgress]:
    """A step that failed before its forward committed: every item NOT_RUN; the item the error
    names has the error's kind as its reason, the others STEP_FAILED (or the kind, when the error
    names no item: the whole step was refused)."""
    at = faulty_index(e)
    return [ItemProgress(k, ItemState.NOT_RUN, 0,
                         e.kind.name if at is None or at == k else STEP_FAILED) for k in range(n_items)]


def all_ran(fed: list[int]) -> list[ItemProgress]:
    """A step refused after its forward committed: every item RAN, with the tokens it fed."""
    return [ItemProgress(k, ItemState.RAN, n) for k, n in enumerate(fed)]


def mark_committed(e: errors.FerrumError, fed: list[int]) -> None:
    """Record on ``e`` that the step's forward committed every row (raised after ``execute``)."""
    if e.progress is None:
        e.progress = all_ran(fed)


def mark_rolled_back(e: errors.FerrumError, n_items: int) -> None:
    """Record on ``e`` that nothing of the step ran, unless a later stage said otherwise."""
    if e.progress is None:
        e.progress = none_ran(n_items, e)


__all__ = ["ItemProgress", "ItemState", "STEP_FAILED", "all_ran", "faulty_index", "mark_committed",
           "mark_rolled_back", "none_ran"]
