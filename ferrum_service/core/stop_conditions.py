"""Stop conditions of a generation: the limits on a request's stop strings and stop token ids, and
the matcher that finds a stop string in the text a stream produces.

The stop strings are compiled once, when a stream starts, into an automaton over their characters
(Aho-Corasick: a trie whose failure links say where to go on in the other strings when a
character does not continue the current one). Each token's new text then moves one cursor over its
own characters, so the per-token cost depends on the length of that text only, never on how many
stop strings there are or how long they are. The limits below bound what compiling costs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from ferrum_client import pb

from . import errors
from .request_limits import declared, limit_of

_STOPS = declared(pb.StopConditions.DESCRIPTOR.fields_by_name["stop_sequences"])

MAX_STOP_SEQUENCES = _STOPS.count
"""Most stop strings one request may give (native ``stop.stop_sequences``, vLLM
``sampling_params.stop``, a migrated stream's ``request.stop.stop_sequences``), as the contract
declares it (``StopConditions.stop_sequences``). OpenAI's API takes 4; this leaves room for
gateways that add their own."""

MAX_STOP_SEQUENCE_CHARS = _STOPS.chars
"""Longest stop string, in characters (with :data:`MAX_STOP_SEQUENCES`, a bounded automaton per
stream), as the contract declares it."""

MAX_STOP_TOKEN_IDS = limit_of(pb.StopConditions, "stop_token_ids")
"""Most stop token ids one request may give (native ``stop.stop_token_ids``, vLLM
``sampling_params.stop_token_ids``); counted before any id is read."""


def check_stop_sequences(stops: Sequence[str], field: str) -> None:
    """INVALID_ARGUMENT naming ``field`` when there are more than :data:`MAX_STOP_SEQUENCES` stop
    strings (counted first: ``len`` of a repeated field costs nothing) or one is longer than
    :data:`MAX_STOP_SEQUENCE_CHARS`."""
    n = len(stops)
    if n > MAX_STOP_SEQUENCES:
        raise errors.invalid(f"{field} has {n} stop strings; the limit is {MAX_STOP_SEQUENCES}", field=field,
                             limit=MAX_STOP_SEQUENCES, requested=n)
    for i, s in enumerate(stops):
        if len(s) > MAX_STOP_SEQUENCE_CHARS:
            raise errors.invalid(f"{field}[{i}] is {len(s)} characters long; the limit is {MAX_STOP_SEQUENCE_CHARS}",
                                 field=f"{field}[{i}]", limit=MAX_STOP_SEQUENCE_CHARS, requested=len(s))


class StopStrings:
    """A set of stop strings compiled for matching (empty strings never match). Immutable once
    built: one per stream, shared by its samples, each with its own :meth:`cursor`."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._next: list[dict[str, int]] = [{}]  # state -> character -> state (the trie's edges)
        self._fail: list[int] = [0]  # state -> the longest proper suffix of its text that is a state
        self._hit: list[str | None] = [None]  # state -> a stop string its text ends with (None: none)
        for s in dict.fromkeys(stops):  # the distinct ones, in order
            if s:
                self._add(s)
        self._link()

    def _add(self, s: str) -> None:
        state = 0
        for ch in s:
            nxt = self._next[state].get(ch)
            if nxt is None:
                nxt = len(self._next)
                self._next[state][ch] = nxt
                self._next.append({})
                self._fail.append(0)
                self._hit.append(None)
            state = nxt
        if self._hit[state] is None:
            self._hit[state] = s

    def _link(self) -> None:
        """Failure links, breadth first (a state's link is shallower, so it is set before)."""
        queue = deque(self._next[0].values())
        while queue:
            state = queue.popleft()
            for ch, child in self._next[state].items():
                f = self._fail[state]
                while f and ch not in self._next[f]:
                    f = self._fail[f]
                link = self._next[f].get(ch, 0)
                self._fail[child] = link if link != child else 0
                if self._hit[child] is None:
                    self._hit[child] = self._hit[self._fail[child]]
                queue.append(child)

    def __bool__(self) -> bool:
        return len(self._next) > 1

    def cursor(self) -> "StopCursor":
        """A matcher at the start of a text."""
        return StopCursor(self)

    def step(self, state: int, text: str) -> tuple[int, str | None]:
        """Feed ``text`` from ``state``: (the state after it, the first stop string that ends
        inside it, or None). After a match the rest of ``text`` is not read (the stream stops)."""
        nxt, fail, hit = self._next, self._fail, self._hit
        for ch in text:
            while state and ch not in nxt[state]:
                state = fail[state]
            state = nxt[state].get(ch, 0)
            if hit[state] is not None:
                return state, hit[state]
        return state, None


class StopCursor:
    """Where one sample's text stands in a :class:`StopStrings` automaton."""

    def __init__(self, stops: StopStrings) -> None:
        self.stops = stops
        self.state = 0

    def feed(self, piece: str) -> str | None:
        """Append ``piece`` to the text; the first stop string that ends inside it, or None."""
        if not piece:
            return None
        self.state, found = self.stops.step(self.state, piece)
        return found


__all__ = ["MAX_STOP_SEQUENCES", "MAX_STOP_SEQUENCE_CHARS", "MAX_STOP_TOKEN_IDS", "StopCursor", "StopStrings",
           "check_stop_sequences"]
