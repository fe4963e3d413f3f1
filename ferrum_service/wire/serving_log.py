"""The serving log lines: a periodic stats line per model and a line per finished request.

Every ``--stats-log-interval`` seconds (0 = off) each model that did anything since the last line
(or still has streams) gets one ``serving stats`` line, as vLLM's "Avg prompt throughput ...
Running ... Waiting ... KV cache usage" line: prompt and generation tokens per second over the
interval, running and waiting ``Generate`` streams, and KV-cache use in percent. A model idle for
two lines in a row is not logged again until it moves.

With ``--no-request-log`` off (the default), every ``Generate`` stream that ends (either protocol)
logs ``request done`` with its request id, caller (the digest of its token, "" without auth),
model, prompt and generated tokens, time to first token and duration in ms, and finish reason.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog

from ..hosting.periodic import Periodic
from .metrics import kv_usage, requests_of

if TYPE_CHECKING:
    from ..hosting.models import ModelSet
    from .serving_metrics import Completion, ServingMetrics
    from .streams import StreamRegistry

log = structlog.get_logger("ferrum_service.wire.serving_log")


class ServingLog:
    """The stats line job and the completion line hook (see the module doc)."""

    def __init__(self, models: "ModelSet", streams: "StreamRegistry", serving: "ServingMetrics", *,
                 interval: float, request_log: bool) -> None:
        if interval < 0:
            raise ValueError("stats_log_interval must be >= 0 (0 = off)")
        self.models = models
        self.streams = streams
        self.serving = serving
        self.interval = interval
        if request_log:
            serving.on_complete = _log_completion
        self._job = Periodic("serving-stats-log", self.log_stats, lambda: self.interval) if interval else None
        self._last: dict[str, tuple[float, int, int]] = {}  # model -> (when, prompt, generation tokens)
        self._idle: set[str] = set()  # models whose last line showed nothing happening

    def start(self) -> None:
        if self._job is not None:
            now = time.monotonic()
            self._last = {h.model_id: (now, *self.serving.totals(h.model_id)) for h in self.models}
            self._job.start()

    async def stop(self) -> None:
        if self._job is not None:
            await self._job.stop()

    async def log_stats(self) -> None:
        """One stats line per model that was busy (see the module doc)."""
        now = time.monotonic()
        for host in self.models:
            mid = host.model_id
            prompt, gen = self.serving.totals(mid)
            then, prompt0, gen0 = self._last.get(mid, (now, prompt, gen))
            self._last[mid] = (now, prompt, gen)
            running, waiting = requests_of(host, self.streams)
            idle = not (running or waiting or prompt > prompt0 or gen > gen0)
            if idle and mid in self._idle:
                continue
            (self._idle.add if idle else self._idle.discard)(mid)
            dt = max(now - then, 1e-9)
            log.info("serving stats", model_id=mid, prompt_tokens_per_s=round((prompt - prompt0) / dt, 1),
                     generation_tokens_per_s=round((gen - gen0) / dt, 1), running=running, waiting=waiting,
                     kv_cache_usage_pct=round(100 * kv_usage(host), 1))


def _log_completion(c: "Completion") -> None:
    log.info("request done", request_id=c.request_id, caller=c.caller, model_id=c.model_id,
             prompt_tokens=c.prompt_tokens, generated_tokens=c.generated_tokens,
             ttft_ms=None if c.ttft_s is None else round(c.ttft_s * 1000, 1),
             duration_ms=round(c.duration_s * 1000, 1), finish=c.finish)


__all__ = ["ServingLog"]
