"""Whether this server still takes work: one small value that the server, its migrations and the
RPC guard share (the server sets it, the guard reads it on every call)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServingState:
    """The server's drain flags, read as plain attributes on every RPC."""

    #: SIGTERM or ``Shutdown``: every RPC is refused UNAVAILABLE.
    shutting_down: bool = False
    #: Drains by migration (``MigrateStreams{drain}``, ``--drain-to``): only reads, KV exports and
    #: moves are answered (``rpc_guard.WHILE_MIGRATING``).
    migrating: bool = False

    def paused(self) -> bool:
        """No new work is taken."""
        return self.shutting_down or self.migrating


__all__ = ["ServingState"]
