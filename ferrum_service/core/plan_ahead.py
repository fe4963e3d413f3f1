"""One step ahead: the bookkeeping of building (and launching) step t+1 while step t runs.

For a small model on a GPU a decode step is short, and a step whose inputs are built only after
the previous step's tokens reached the host leaves the GPU idle for the host's part. Fast engines
therefore prepare step t+1 while step t runs (vLLM's async scheduling, SGLang's overlap
scheduler): the rows that will continue are known — every row of step t, except those that reach
their token limit with it — and the token each feeds is step t's output, still on the device.

What the host learns only from step t's results (a row finished: EOS, a stop string, a
constraint; a row is aborted, migrates away, or starts verifying drafts) may then contradict the
plan. :class:`AheadPlanner` keeps the books so that no caller ever sees the difference:

* a row dropped while step t+1 is only **planned** is removed from it;
* a row dropped after step t+1 was **launched** ran one step too many: its cache is rolled back
  to the length step t left (:attr:`Settlement.rollback`) and that step's output for it is never
  emitted;
* every emitted token is therefore the next one of its stream, in order, and nothing is emitted
  after a row's last token.

Pure logic (no torch, no executor): the caller runs the steps, truncates caches and emits tokens.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Fate(enum.StrEnum):
    """What the host decided about a row after a step's output (or in between, by :meth:`AheadPlanner.mark`)."""

    CONTINUE = "continue"
    FINISHED = "finished"  # EOS, stop id or string, length, constraint done
    ABORTED = "aborted"
    MOVED = "moved"  # migrated to another server, or parked
    DRAFTING = "drafting"  # its next step verifies drafts: not a plain one-token row


@dataclass
class AheadRow:
    """A row of a planned step: ``length`` tokens in its cache before the step, ``budget`` tokens
    it may still produce (this step's included)."""

    key: str
    cache_id: str
    length: int
    budget: int


@dataclass
class PlannedStep:
    """A step built ahead: its rows, whether it was launched, and the rows whose output must not
    be emitted (rolled back after launch)."""

    index: int
    rows: list[AheadRow]
    launched: bool = False
    discarded: set[str] = field(default_factory=set)

    @property
    def keys(self) -> list[str]:
        return [r.key for r in self.rows]


@dataclass
class Settlement:
    """What settling a step's output tells the caller: the rows whose output to emit (in step
    order), the rows removed from the planned next step, and ``(cache_id, length)`` truncations
    for rows of an already launched next step that must not have run."""

    emit: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    rollback: list[tuple[str, int]] = field(default_factory=list)


class AheadPlanner:
    """The books of a one-step-ahead loop (see the module docstring)."""

    def __init__(self) -> None:
        self.current: PlannedStep | None = None  # launched, output not settled
        self.next: PlannedStep | None = None  # built from ``current``, maybe launched
        self._marks: dict[str, Fate] = {}
        self._count = 0

    def begin(self, rows: list[AheadRow]) -> PlannedStep:
        """Step ``t`` (launched now, nothing in flight)."""
        if self.current is not None:
            raise RuntimeError("a step is in flight: settle it first")
        self.current = PlannedStep(self._count, list(rows), launched=True)
        self._count += 1
        return self.current

    def mark(self, key: str, fate: Fate) -> None:
        """A host event between steps (abort, migration, drafts): the row is left out of any step
        planned from now on, and dropped from (or rolled back in) the next one when it is settled."""
        if fate is not Fate.CONTINUE:
            self._marks[key] = fate

    def plan_next(self, joining: list[AheadRow] = ()) -> PlannedStep:
        """Step t+1 from the step in flight: each row that may produce another token and is not
        marked, one token longer; plus ``joining`` rows."""
        cur = self.current
        if cur is None:
            raise RuntimeError("no step in flight")
        if self.next is not None:
            raise RuntimeError("the next step is already planned")
        rows = [AheadRow(r.key, r.cache_id, r.length + 1, r.budget - 1) for r in cur.rows
                if r.budget > 1 and r.key not in self._marks and r.key not in cur.discarded]
        self.next = PlannedStep(self._count, rows + [r for r in joining if r.key not in self._marks])
        self._count += 1
        return self.next

    def launch_next(self) -> PlannedStep:
        """The planned next step is launched (its rows now run, whatever the settlement says)."""
        if self.next is None:
            raise RuntimeError("nothing planned")
        self.next.launched = True
        return self.next

    def emitting(self) -> list[AheadRow]:
        """The rows of the step in flight whose output the caller emits (those not rolled back),
        in step order: row ``r``'s output is the token after ``r.length`` tokens."""
        cur = self.current
        return [r for r in cur.rows if r.key not in cur.discarded] if cur is not None else []

    def settle(self, fates: dict[str, Fate]) -> Settlement:
        """Step t's output is on the host and ``fates`` says what became of its rows (missing =
        continue). Drops or rolls back rows of step t+1, then makes t+1 the step in flight (when
        launched; else the caller launches it with :meth:`launch_next` and it becomes current then)."""
        cur = self.current
        if cur is None:
            raise RuntimeError("no step in flight")
        out = Settlement(emit=[r.key for r in self.emitting()])
        stopped = {k for k in cur.keys if fates.get(k, Fate.CONTINUE) is not Fate.CONTINUE}
        stopped |= set(self._marks) | cur.discarded
        nxt = self.next
        handled = set(cur.keys) | (set(nxt.keys) if nxt is not None else set())
        if nxt is not None:
            hit = [r for r in nxt.rows if r.key in stopped and r.key not in nxt.discarded]
            if nxt.launched:  # it ran: back to the length it found (step t's token stays)
                nxt.discarded.update(r.key for r in hit)
                out.rollback = [(r.cache_id, r.length) for r in hit]
            else:
                nxt.rows = [r for r in nxt.rows if r.key not in stopped]
                out.dropped = [r.key for r in hit]
        self._marks = {k: f for k, f in self._marks.items() if k not in handled}
        self.current, self.next = (nxt, None) if nxt is not None and nxt.launched else (None, nxt)
        return out

    def start_planned(self) -> PlannedStep | None:
        """Launch a step that was planned but not launched before the previous one settled."""
        nxt = self.next
        if nxt is None or self.current is not None:
            return None
        nxt.launched = True
        self.current, self.next = nxt, None
        return nxt


__all__ = ["AheadPlanner", "AheadRow", "Fate", "PlannedStep", "Settlement"]
