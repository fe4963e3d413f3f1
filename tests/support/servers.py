"""Real servers on real loopback ports for the tests.

``InProcessServer`` runs the grpc.aio server on its own event loop in a background thread (fast to
start, and tests can look inside its registries for leaks); ``ServerProcess`` runs
``ferrum-service serve`` as a subprocess (for signals, CLI flags and process-level checks).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from ferrum_client import Client

from ferrum_service.server import Server, ServerConfig, host_models

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class ServerProcess:
    """``ferrum-service serve ARGS`` on a free port, waited on until SERVING."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, port: int | None = None,
                 ready_timeout: float = 120.0) -> None:
        self.port = port or free_port()
        self.args = list(args)
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"ferrum-test-server-{self.port}.log"

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "ServerProcess":
        cmd = [sys.executable, "-m", "ferrum_service", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--log-format", "json", *self.args]
        if "--metrics-port" not in self.args:
            cmd += ["--metrics-port", "0"]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + self.ready_timeout
        with Client(self.target) as c:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    if c.health(timeout=1.0) == "SERVING":
                        return self
                except Exception:  # noqa: BLE001 - not up yet
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"server not SERVING after {self.ready_timeout}s:\n{self.log()}")
                time.sleep(0.1)

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-5000:]
        except OSError:
            return ""

    def terminate(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float = 30) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if getattr(self, "_log", None):
            self._log.close()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
