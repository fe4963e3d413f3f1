"""Server-sent events over plain ``http.client``: what the tests and benchmarks read from the HTTP
servers they drive (SMG's OpenAI routes, llama-server's ``/completion``)."""

from __future__ import annotations

import http.client
import json
from typing import Iterator


def sse_payloads(port: int, path: str, body: dict, timeout: float = 120.0) -> Iterator[str]:
    """POST ``body`` as JSON to ``127.0.0.1:port`` ``path`` and yield the ``data:`` payloads of the
    event-stream answer as they come; RuntimeError for a status other than 200. Closing the
    generator closes the connection (a client that goes away)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"{path}: HTTP {r.status}: {r.read()[:500]!r}")
        while True:
            line = r.readline()
            if not line:
                return
            line = line.strip()
            if line.startswith(b"data:"):
                yield line[5:].strip().decode()
    finally:
        c.close()


__all__ = ["sse_payloads"]
