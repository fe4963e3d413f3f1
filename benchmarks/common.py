"""Shared helpers: statistics, machine info, a ``ferrum-service serve`` subprocess, and (from
:mod:`benchmarks.schema`) ``write_rows``, the one writer of results files."""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

from ferrum_service.testing.server_process import ServerProcess, free_port  # noqa: F401 - re-exported

from .schema import write_rows  # noqa: F401 - the one writer of results files, re-exported

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


class Server(ServerProcess):
    """``ferrum-service serve --model SPEC...`` as a subprocess on a free loopback port (log in
    ``benchmarks/results/NAME.log``); see :mod:`ferrum_service.testing.server_process`."""

    def __init__(self, *models: str, threads: int | None = None, extra: tuple[str, ...] = (), name: str = "server"):
        self.models = models
        self.threads = threads or os.cpu_count() or 1
        self.extra = extra
        args = ["--log-level", "warning", *extra]
        for m in models:
            args += ["--model", m]
        super().__init__(args, env={"FERRUM_TORCH_THREADS": str(self.threads)}, cwd=REPO,
                         log_path=REPO / "benchmarks" / "results" / f"{name}.log", ready_timeout=180, stop_timeout=20)


def sampled_batch(target: str, model: str, prompt: str, streams: int, max_tokens: int, seed0: int,
                  extra=lambda i: {}) -> tuple[int, float]:
    """``streams`` concurrent ``Generate`` calls of the chat ``prompt``, each sampling (temperature
    0.8, seed ``seed0 + i``) exactly ``max_tokens`` tokens (``ignore_eos``, prefix cache bypassed),
    with ``extra(i)`` as further keywords: (tokens generated, wall seconds of the whole batch)."""
    from concurrent.futures import ThreadPoolExecutor

    from ferrum_client import Client

    def one(i: int) -> int:
        with Client(target) as c:
            evs = list(c.generate(model, chat=[("user", prompt)], max_tokens=max_tokens, temperature=0.8,
                                  seed=seed0 + i, bypass_prefix_cache=True, ignore_eos=True, **extra(i)))
            return evs[-1].finished.generated_tokens

    t0 = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        tokens = sum(pool.map(one, range(streams)))
    return tokens, time.perf_counter() - t0

