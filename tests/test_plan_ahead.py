"""The one-step-ahead planner's books (``core/plan_ahead.py``): a simulated engine drives it with
random finishes, aborts, migrations and drafts, launching the next step early or not, and every
stream must come out exactly as a plain one-step-at-a-time loop gives it, every cache as long as
its emitted tokens, nothing emitted after a row's end."""

from __future__ import annotations

import random

import pytest

from ferrum_service.core.plan_ahead import AheadPlanner, AheadRow, Fate


def _truth(key: str, i: int) -> int:
    return hash((key, i)) % 1000


class _Stream:
    def __init__(self, key: str, prompt: int, budget: int, eos_at: int | None):
        self.key, self.budget, self.eos_at = key, budget, eos_at
        self.cache = prompt  # tokens in the cache
        self.prompt = prompt
        self.out: list[int] = []
        self.ended = False
        self.stopped_after: int | None = None  # tokens emitted when a host event stopped it

    def expected(self) -> list[int]:
        n = self.budget if self.eos_at is None else min(self.budget, self.eos_at + 1)
        if self.stopped_after is not None:
            n = min(n, self.stopped_after + 1)  # the step in flight at the event may still land
        return [_truth(self.key, i) for i in range(n)]


def _simulate(seed: int) -> dict[str, _Stream]:
    rng = random.Random(seed)
    streams = {f"s{i}": _Stream(f"s{i}", rng.randint(1, 40), rng.randint(1, 12),
                                rng.choice([None, rng.randint(0, 10)])) for i in range(rng.randint(1, 6))}
    later = [f"j{i}" for i in range(rng.randint(0, 3))]
    for k in later:
        streams[k] = _Stream(k, rng.randint(1, 40), rng.randint(1, 8), rng.choice([None, rng.randint(0, 6)]))
    p = AheadPlanner()

    def row(s: _Stream) -> AheadRow:
        return AheadRow(s.key, s.key, s.cache, s.budget - len(s.out))

    def run(step):  # the device: each row of a launched step writes one token into its cache
        for r in step.rows:
            s = streams[r.key]
            assert s.cache == r.length, "a row ran at another length than planned"
            s.cache += 1

    first = p.begin([row(streams[k]) for k in streams if not k.startswith("j")])
    run(first)
    for _ in range(100):
        cur = p.current
        if cur is None:
            break
        joining = [row(streams[later.pop()])] if later and rng.random() < 0.3 else []
        p.plan_next(joining)
        for k in cur.keys:  # host events while step t runs
            if rng.random() < 0.08:
                s = streams[k]
                if s.stopped_after is None:
                    s.stopped_after = len(s.out)
                p.mark(k, rng.choice([Fate.ABORTED, Fate.MOVED, Fate.DRAFTING]))
        if rng.random() < 0.6:
            run(p.launch_next())  # overlap: t+1 runs before t's tokens are seen
        fates = {}
        for r in p.emitting():  # step t's tokens on the host: emit, and see which rows ended
            s = streams[r.key]
            assert not s.ended, "a token after the row's end"
            s.out.append(_truth(r.key, r.length - s.prompt))
            if len(s.out) == s.budget or (s.eos_at is not None and len(s.out) - 1 == s.eos_at):
                s.ended = True
                fates[r.key] = Fate.FINISHED
        settled = p.settle(fates)
        for cache_id, length in settled.rollback:
            streams[cache_id].cache = length
        if p.current is None:
            nxt = p.start_planned()
            if nxt is not None:
                run(nxt)
    return streams


@pytest.mark.parametrize("seed", range(300))
def test_streams_equal_a_plain_loop(seed):
    for s in _simulate(seed).values():
        want = s.expected()
        assert s.out == want[: len(s.out)]
        if s.stopped_after is None:
            assert s.out == want  # every token, in order, nothing after the end
        assert s.cache == s.prompt + len(s.out)  # rolled back: the cache holds exactly what was emitted


def test_settle_drops_a_finished_row_from_a_planned_step_and_rolls_back_a_launched_one():
    p = AheadPlanner()
    p.begin([AheadRow("a", "ca", 10, 5), AheadRow("b", "cb", 20, 5), AheadRow("c", "cc", 7, 1)])
    nxt = p.plan_next()
    assert nxt.keys == ["a", "b"] and [r.length for r in nxt.rows] == [11, 21]  # c's budget ends with step t
    s = p.settle({"a": Fate.FINISHED})
    assert s.emit == ["a", "b", "c"] and s.dropped == ["a"] and s.rollback == []
    assert p.start_planned().keys == ["b"]
    p.plan_next()
    p.launch_next()
    s = p.settle({"b": Fate.FINISHED})
    assert s.rollback == [("cb", 22)] and p.current.discarded == {"b"}
    s = p.settle({})
    assert s.emit == []  # the rolled-back step's output is never emitted


def test_a_marked_row_is_not_planned_again():
    p = AheadPlanner()
    p.begin([AheadRow("a", "ca", 3, 9)])
    p.mark("a", Fate.MOVED)
    assert p.plan_next().keys == []
