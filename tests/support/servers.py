"""Real servers on real loopback ports for the tests.

``InProcessServer`` runs the grpc.aio server on its own event loop in a background thread (fast to
start, and tests can look inside its registries for leaks); ``ServerProcess`` runs
``ferrum-service serve`` as a subprocess (for signals, CLI flags and process-level checks).
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

from ferrum_service.server import Server, ServerConfig, host_models
from ferrum_service.testing.server_process import ServerProcess as _ServerProcess
from ferrum_service.testing.server_process import free_port

REPO = Path(__file__).resolve().parents[2]


class InProcessServer:
    """``with InProcessServer([executor, ...]) as srv: Client(srv.target)``."""

    def __init__(self, executors, **cfg) -> None:
        cfg.setdefault("host", "127.0.0.1")
        cfg.setdefault("port", 0)
        cfg.setdefault("metrics_port", 0)
        cfg.setdefault("grace_period", 2.0)
        self.cfg = ServerConfig(**cfg)
        self.executors = executors
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="test-server")
        self.server: Server | None = None

    def __enter__(self) -> "InProcessServer":
        self.thread.start()

        async def start():
            self.server = Server(host_models(self.executors, self.cfg.max_batch), self.cfg)
            await self.server.start()

        asyncio.run_coroutine_threadsafe(start(), self.loop).result(30)
        return self

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @property
    def models(self):
        return self.server.models

    def run(self, coro, timeout: float = 30):
        """Run a coroutine on the server's loop (to inspect state consistently)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def live_caches(self) -> dict[str, int]:
        """Live caches per model, read on the server's loop."""
        async def count():
            await asyncio.sleep(0.05)
            for h in self.server.models:
                await h.drain_releases()
            return {h.model_id: len(h.executor.registry) for h in self.server.models}
        return self.run(count())

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            try:
                self.run(self.server.drain(0.5), timeout=30)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class ServerProcess(_ServerProcess):
    """``ferrum-service serve ARGS`` on a free port, waited on until SERVING (run from the repo, its
    log in ``$TMPDIR/ferrum-test-server-PORT.log``); see :mod:`ferrum_service.testing.server_process`."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, port: int | None = None,
                 ready_timeout: float = 120.0) -> None:
        port = port or free_port()
        super().__init__(args, env=env, port=port, cwd=REPO, ready_timeout=ready_timeout,
                         log_path=Path(os.environ.get("TMPDIR", "/tmp")) / f"ferrum-test-server-{port}.log")
