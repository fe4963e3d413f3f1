"""Modes passed around as values: a server's role, an executor's state, cache and block events.

They are ``StrEnum``s: a member equals its wire / config value (``Role.DECODE == "decode"``),
hashes like it and prints as it (in logs, labels and messages), so code that still passes the
plain strings keeps working. The step plan's logits mode is ``steps.Want``.
"""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
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


class ExecutorState(enum.StrEnum):
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


class CacheEvent(enum.StrEnum):
    """What happened to a cache (the registry's events; ``KvEventKind`` in the contract). The last
    three end the cache, and are the reasons ``release_cache`` takes."""

    CREATED = "created"
    EXTENDED = "extended"
    TRUNCATED = "truncated"
    FORKED = "forked"  # created as a copy of another cache
    RELEASED = "released"  # its owner let it go (Release, a finished stream)
    RECLAIMED = "reclaimed"  # the server freed it: its owner left, its lease expired, its step was orphaned
    EVICTED = "evicted"  # the executor dropped it for room

    @property
    def ends_cache(self) -> bool:
        return self in (CacheEvent.RELEASED, CacheEvent.RECLAIMED, CacheEvent.EVICTED)


class BlockEvent(enum.StrEnum):
    """What happened to prefix-cache blocks (``KvBlockStored`` / ``KvBlockRemoved`` / cleared)."""

    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"  # the model's whole prefix index went


__all__ = ["BlockEvent", "CacheEvent", "ExecutorState", "Role"]


class CudaGraphs(enum.StrEnum):
    """Decode steps as CUDA graphs on CUDA (``--cuda-graphs``; the transformers executor's
    ``decode_graphs`` option, ``executors/transformers/decode_graphs.py``)."""

    AUTO = "auto"  # captured per batch-size bucket on CUDA; off on CPU (the CPU path is unchanged)
    OFF = "off"  # every step eager
