"""What a batched step costs, measured: the model the batcher sizes its prompt chunks with.

A step's forward time is modelled as ``a + b * decode_rows + c * prompt_tokens`` (``a``: the
weights read once per forward; ``b``: each running stream's row; ``c``: each prompt token
computed), fitted by least squares over the last steps the batcher ran. Separate moving averages
of "decode-only" and "prompt" steps fed each other when they were measured at different batch
sizes (a decode step timed with 4 streams made later prompt tokens look many times dearer and the
chunks shrank step after step); one fit over all recent steps has no such loop.
"""

from __future__ import annotations

import collections

import numpy as np


class StepCostModel:
    """Forward time of a step from its decode rows and prompt tokens (see the module doc)."""

    def __init__(self, window: int = 64, min_steps: int = 8) -> None:
        self._steps: collections.deque[tuple[int, int, float]] = collections.deque(maxlen=window)
        self.min_steps = min_steps
        self.frozen = False  # keep the current fit (tests)
        self._fit: tuple[float, float, float] | None = None
        self._last: tuple[float, float, float] | None = None  # the last fit the window allowed

    def add(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        """Record one step's forward time."""
        if self.frozen:
            return
        self._steps.append((decode_rows, prompt_tokens, seconds))
        self._fit = None

    def set(self, fixed_s: float, row_s: float, token_s: float) -> None:
        """Use these costs and stop learning (tests, or a deployment that knows its costs)."""
        self._fit, self.frozen = (fixed_s, row_s, token_s), True

    def fit(self) -> tuple[float, float, float] | None:
        """(seconds per forward, per decode row, per prompt token), or None until enough steps are
        measured whose prompt tokens vary apart from their decode rows. A window that cannot be
        fitted (only decode steps lately) keeps the last fit it could."""
        if self._fit is not None or self.frozen:
            return self._fit
        obs = list(self._steps)
        if len(obs) < self.min_steps:
            return self._last
        x = np.array([[1.0, r, t] for r, t, _ in obs])
        # The prompt tokens must vary apart from the rows: decode-only steps, or every step with the
        # same chunk, cannot tell a prompt token's cost. Steps that all carry prompts can (a burst
        # of arriving prompts has no decode-only step until it has been taken in).
        if np.linalg.matrix_rank(x) <= np.linalg.matrix_rank(x[:, :2]):
            return self._last
        y = np.array([s for _, _, s in obs])
        a, b, c = (float(v) for v in np.linalg.lstsq(x, y, rcond=None)[0])
        if c <= 0:
            return self._last
        self._fit = self._last = (max(a, 0.0), max(b, 0.0), c)
        return self._fit

    def decode_s(self, rows: int) -> float | None:
        """A decode-only step of ``rows`` streams."""
        f = self.fit()
        return None if f is None else f[0] + f[1] * rows

    def token_s(self) -> float | None:
        """One more prompt token in a step."""
        f = self.fit()
        return None if f is None else f[2]


__all__ = ["StepCostModel"]
