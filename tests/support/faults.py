"""Faults injected into a real in-process server (no mocks: the server's own objects, wrapped)."""

from __future__ import annotations

from typing import Callable


def break_export(server, when: Callable[[object], bool] = lambda req: True, after: int = 2) -> None:
    """Make ``server``'s ExportKv die after ``after`` messages (the header and a chunk), as when the
    exporting server goes down mid-transfer, for the requests ``when(req)`` picks."""
    kv = server.servicer.kv
    real = kv.export

    async def breaking(req, metadata=None):
        n = 0
        async for msg in real(req, metadata):
            yield msg
            n += 1
            if n == after and when(req):
                raise RuntimeError("the exporting server went away")

    kv.export = breaking
