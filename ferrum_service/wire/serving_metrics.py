"""Serving-latency metrics of ``Generate`` streams (the contract's and vLLM's protocol alike).

Each stream gets a :class:`StreamRecorder` (``StreamRegistry.generation``); the decode loop calls
it at the stream's start (prompt tokens), at every token it sends, and when a sample finishes;
the stream's end closes it. From that, per model (label ``model``):

* ``ferrum_time_to_first_token_seconds``: from the request's arrival to its first token sent;
* ``ferrum_inter_token_seconds``: between two tokens a sample sends (a step that accepted
  speculative drafts sends several at once: the later ones count as ~0);
* ``ferrum_e2e_request_seconds``: from arrival to the stream's end, labelled ``finish_reason``
  (stop, eos, length, cancelled, error, migrated);
* ``ferrum_queue_seconds``: how long a prompt waited in the model's batcher queue before its
  first chunk went into a step (``ContinuousBatcher.on_queue_wait``);
* ``ferrum_prompt_tokens_total`` / ``ferrum_generation_tokens_total``: prompt tokens taken
  (cached ones included) and tokens sent;
* ``ferrum_requests_finished_total{model,finish_reason}``;
* ``ferrum_stalled_seconds``: how long the model has had work queued with no step completing
  (0 when it moves or is idle; ``--stall-timeout`` turns health NOT_SERVING past it).

The recorder's ``close`` also hands a :class:`Completion` to ``on_complete`` (the per-request log
line, ``serving_log.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from ..hosting.models import ModelSet

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0)
QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Completion:
    """One finished stream, as the per-request log line reports it."""

    request_id: str
    caller: str
    model_id: str
    prompt_tokens: int
    generated_tokens: int
    ttft_s: float | None
    duration_s: float
    finish: str


class _ModelSeries:
    """One model's children of the serving metrics (labels resolved once)."""

    def __init__(self, m: "ServingMetrics", model_id: str) -> None:
        self.ttft = m.ttft.labels(model_id)
        self.itl = m.itl.labels(model_id)
        self.prompt = m.prompt_tokens.labels(model_id)
        self.generation = m.generation_tokens.labels(model_id)
        self.prompt_total = 0  # the same counts as plain ints, for the periodic stats line
        self.generation_total = 0


class ServingMetrics:
    """The serving-latency metrics on ``registry`` (see the module doc)."""

    def __init__(self, registry: CollectorRegistry, models: "ModelSet | None") -> None:
        r = registry
        self.ttft = Histogram("ferrum_time_to_first_token_seconds", "Generate: request arrival to first token",
                              ["model"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("ferrum_inter_token_seconds", "Generate: time between two tokens of a sample",
                             ["model"], buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("ferrum_e2e_request_seconds", "Generate: request arrival to the stream's end",
                             ["model", "finish_reason"], buckets=E2E_BUCKETS, registry=r)
        self.queue = Histogram("ferrum_queue_seconds", "Generate: a prompt's wait in the batcher queue",
                               ["model"], buckets=QUEUE_BUCKETS, registry=r)
        self.prompt_tokens = Counter("ferrum_prompt_tokens", "Generate: prompt tokens taken (cached ones included)",
                                     ["model"], registry=r)
        self.generation_tokens = Counter("ferrum_generation_tokens", "Generate: tokens sent", ["model"], registry=r)
        self.finished = Counter("ferrum_requests_finished", "Generate streams ended, by finish reason",
                                ["model", "finish_reason"], registry=r)
        self.on_complete: Callable[[Completion], None] | None = None
        self._series: dict[str, _ModelSeries] = {}
        if models is not None:
            stalled = Gauge("ferrum_stalled_seconds", "Seconds the model has had work queued and no step completed",
                            ["model"], registry=r)
            for host in models:
                self.series(host.model_id)  # every model's series exists from the first scrape
                if host.batcher is not None:
                    host.batcher.on_queue_wait = self.queue.labels(host.model_id).observe
                stalled.labels(host.model_id).set_function(
                    lambda host=host: host.progress.stalled_for(host.running))

    def series(self, model_id: str) -> _ModelSeries:
        s = self._series.get(model_id)
        if s is None:
            s = self._series[model_id] = _ModelSeries(self, model_id)
        return s

    def totals(self, model_id: str) -> tuple[int, int]:
        """(prompt, generation) tokens of a model so far."""
        s = self._series.get(model_id)
        return (s.prompt_total, s.generation_total) if s is not None else (0, 0)


class StreamRecorder:
    """One ``Generate`` stream's timings (see the module doc); made when the stream arrives.
    ``state``: the stream's ``StreamState`` (model, request id, caller, whether it was aborted)."""

    def __init__(self, metrics: ServingMetrics | None, state: Any) -> None:
        self.metrics = metrics
        self.state = state
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.last: dict[int, float] = {}  # sample index -> when its last token was sent
        self.prompt_tokens = 0
        self.generated = 0
        self.finish = ""
        self._series: _ModelSeries | None = None

    def started(self, prompt_tokens: int) -> None:
        """The prompt went through (``prompt_tokens`` of it); the model is ``state.model_id``."""
        self.prompt_tokens = prompt_tokens
        if self.metrics is not None:
            self._series = s = self.metrics.series(self.state.model_id)
            s.prompt.inc(prompt_tokens)
            s.prompt_total += prompt_tokens

    def token(self, sample: int) -> None:
        """A token of sample ``sample`` is being sent."""
        now = time.perf_counter()
        self.generated += 1
        s = self._series
        if self.first is None:
            self.first = now
            if s is not None:
                s.ttft.observe(now - self.t0)
        prev = self.last.get(sample)
        self.last[sample] = now
        if s is not None:
            if prev is not None:
                s.itl.observe(now - prev)
            s.generation.inc()
            s.generation_total += 1

    def finished(self, reason: str) -> None:
        """A sample ended normally with ``reason`` (a ``FinishReason`` name or "migrated"; the first
        sample's names the stream's)."""
        self.finish = self.finish or reason.removeprefix("FINISH_REASON_").lower()

    def close(self, error: BaseException | None) -> None:
        """The stream ended (``error``: what ended it abnormally)."""
        if error is not None:
            aborted = isinstance(error, GeneratorExit) or type(error).__name__ == "CancelledError"
            self.finish = "cancelled" if aborted or self.state.aborted else "error"
        finish = self.finish or "error"
        duration = time.perf_counter() - self.t0
        model = self.state.model_id
        m = self.metrics
        if m is None or not model:
            return
        m.e2e.labels(model, finish).observe(duration)
        m.finished.labels(model, finish).inc()
        if m.on_complete is not None:
            m.on_complete(Completion(self.state.request_id, self.state.tenant, model, self.prompt_tokens,
                                     self.generated, None if self.first is None else self.first - self.t0,
                                     duration, finish))


__all__ = ["Completion", "ServingMetrics", "StreamRecorder"]
