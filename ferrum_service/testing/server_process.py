"""``ferrum-service serve`` as a subprocess on a free loopback port, for tests and benchmarks.

    with ServerProcess(["--model", "stub,id=stub"]) as srv:
        Client(srv.target).health()

``start()`` runs ``COMMAND serve --host 127.0.0.1 --port PORT ARGS...`` (``--metrics-port 0`` and
``--log-format json`` unless ARGS set them) with its output in a log file, and returns once
``grpc.health.v1.Health/Check`` (service "") answers SERVING. It fails fast (RuntimeError) if the
process exits first, and stops it and raises TimeoutError if it is not SERVING within
``ready_timeout``. ``stop()`` sends SIGTERM, waits ``stop_timeout`` seconds, then kills it.

This module imports only the standard library at import time (grpc when it polls health), so a
script can use it before it knows which Python has the server's dependencies.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_status(target: str, timeout: float = 1.0) -> str:
    """``grpc.health.v1`` status of the server (service ""): SERVING, NOT_SERVING, ..."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


class ServerProcess:
    """One ``ferrum-service serve`` subprocess.

    ``args``: the flags after ``serve`` (``--host``/``--port`` are added); ``command``: what runs
    ``serve`` (default ``python -m ferrum_service`` with this interpreter); ``env``: variables set
    over the current environment (with ``HF_HUB_OFFLINE=1`` and ``PYTHONUNBUFFERED=1``);
    ``port``: a free one when None; ``log_path``: the server's stdout and stderr (default a file in
    the temp directory named after the port).
    """

    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        command: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        port: int | None = None,
        host: str = "127.0.0.1",
        log_path: str | os.PathLike | None = None,
        cwd: str | os.PathLike | None = None,
        ready_timeout: float = 120.0,
        stop_timeout: float = 15.0,
    ) -> None:
        self.args = list(args)
        self.command = list(command) if command is not None else [sys.executable, "-m", "ferrum_service"]
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.port = port or free_port()
        self.host = host
        self.log_path = Path(log_path) if log_path is not None else (
            Path(tempfile.gettempdir()) / f"ferrum-server-{self.port}.log")
        self.cwd = cwd
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "the server is not started"
        return self.proc.pid

    @property
    def cmd(self) -> list[str]:
        """The full command line."""
        cmd = [*self.command, "serve", "--host", self.host, "--port", str(self.port), *self.args]
        if not any(a == "--metrics-port" or a.startswith("--metrics-port=") for a in self.args):
            cmd += ["--metrics-port", "0"]
        if not any(a == "--log-format" or a.startswith("--log-format=") for a in self.args):
            cmd += ["--log-format", "json"]
        return cmd

    def start(self) -> "ServerProcess":
        """Start the process and wait until it is SERVING (see the module docstring)."""
        cmd = self.cmd
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=self.env, cwd=self.cwd, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self) -> None:
        """Poll health until SERVING; RuntimeError if the process exits, TimeoutError at the deadline."""
        assert self.proc is not None, "the server is not started"
        deadline = time.monotonic() + self.ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {shlex.join(self.cmd)}\n"
                                   f"log {self.log_path}:\n{self.log()}")
            try:
                if health_status(self.target, 1.0) == "SERVING":
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not SERVING after {self.ready_timeout}s: {shlex.join(self.cmd)}\n"
                                   f"log {self.log_path}:\n{self.log()}")
            time.sleep(0.1)

    def log(self, tail: int = 5000) -> str:
        """The last ``tail`` characters of the server's output."""
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def terminate(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` if the process is still running."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float = 30) -> int:
        """Wait for the process to exit; its exit status."""
        assert self.proc is not None, "the server is not started"
        return self.proc.wait(timeout)

    def stop(self) -> None:
        """SIGTERM, wait ``stop_timeout`` seconds, then SIGKILL; closes the log. Idempotent."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
