"""Modes passed around as values: a server's role and an executor's state.

They are ``str`` enums, so a member equals its wire / config value (``Role.DECODE == "decode"``),
hashes like it, and reads or compares against plain strings the way the strings did before. The
step plan's logits mode is ``steps.Want``.
"""

from __future__ import annotations

import enum


class Role(str, enum.Enum):
    """What a server is deployed for (``--role``; ``ServerRole`` in the contract)."""

    BOTH = "both"  # prefills and decodes
    PREFILL = "prefill"  # computes prompts and hands their caches over (ExportKv); runs no decode step
    DECODE = "decode"  # decodes caches imported from prefill servers (ImportKv); computes no new prompt

    @classmethod
    def parse(cls, value: object) -> Role:
        """``value`` as a Role; ValueError naming the roles otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"role must be {', '.join(r.value for r in cls)}, not {value!r}") from None


class ExecutorState(str, enum.Enum):
    """An executor's lifecycle (``ExecutorStatus.state``; ``ExecutorState`` in the contract)."""

    INITIALIZING = "initializing"
    READY = "ready"
    BUSY = "busy"
    ERROR = "error"
    SHUTDOWN = "shutdown"  # every cache freed; further work is refused

    @property
    def is_ready(self) -> bool:
        """Takes work (``ExecutorStatus.is_ready``)."""
        return self in (ExecutorState.READY, ExecutorState.BUSY)


__all__ = ["ExecutorState", "Role"]
