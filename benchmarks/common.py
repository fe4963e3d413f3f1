"""Shared helpers: statistics, machine info, and a ``ferrum-service serve`` subprocess."""

from __future__ import annotations

import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def pct(xs, q: float) -> float:
    """The q-th percentile (0..100) of xs, nearest-rank on the sorted list."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, int(round(q / 100.0 * (len(s) - 1)))))
    return float(s[k])


def median(xs) -> float:
    return float(statistics.median(xs))


def machine_info() -> dict:
    import torch

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = ""
    try:
        txt = Path("/proc/cpuinfo").read_text()
        fl = next(l for l in txt.splitlines() if l.startswith("flags")).split()
        flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in fl)
    except (OSError, StopIteration):
        pass
    mem = 0
    try:
        import psutil

        mem = psutil.virtual_memory().total
    except ImportError:
        pass
    import transformers

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cpu_flags": flags,
        "memory_gib": round(mem / 2**30, 1),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``ferrum-service serve --model SPEC...`` as a subprocess on a free loopback port."""

    def __init__(self, *models: str, threads: int | None = None, extra: tuple[str, ...] = (), name: str = "server"):
        self.port = free_port()
        self.models = models
        self.threads = threads or os.cpu_count() or 1
        self.extra = extra
        self.log_path = REPO / "benchmarks" / "results" / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def __enter__(self) -> "Server":
        from ferrum_client import Client

        cmd = [sys.executable, "-m", "ferrum_service", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--metrics-port", "0", "--log-format", "json", "--log-level", "warning", *self.extra]
        for m in self.models:
            cmd += ["--model", m]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "FERRUM_TORCH_THREADS": str(self.threads)}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + 180
        with Client(self.target) as c:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log_path}")
                try:
                    if c.health(timeout=1.0) == "SERVING":
                        return self
                except Exception:  # noqa: BLE001 - not up yet
                    pass
                if time.monotonic() > deadline:
                    self.__exit__()
                    raise TimeoutError(f"server not SERVING; see {self.log_path}")
                time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if getattr(self, "_log", None):
            self._log.close()
