"""The worker's load as the vLLM engine protocol pushes it: the ``EngineLoad`` record of
smg-grpc-proto's ``common.proto`` on every ``KvEventBatch`` of ``SubscribeKvEvents``, ``load_only``
batches between them, and ``GetLoads`` answered from the same record.

A gateway (SMG) counts every record as contact with the worker and excludes a worker whose
records stop after its staleness threshold; its engine-silence veto and pending-prefill allowance
read ``engine_silence_ms`` / ``prefill_pending_tokens`` and apply only to workers that push them.
Without records it polls ``GetLoads`` (every 10 s by default) and never judges the engine's silence.

**The record** (:class:`LoadSampler`, one per served model, shared by every subscriber and by
``GetLoads``), sampled at most once per :data:`LOAD_TICK` (``age_ms`` says how old the sample is):

* running / waiting requests: the model's ``Generate`` streams of both protocols, waiting = those
  whose prompt is queued for the worker (as ``vllm:num_requests_*`` on /metrics);
* ``waiting_uncached_tokens``: prompt tokens of queued prompts that have not started, times
  (1 - the model's prefix-cache hit rate so far), as vLLM's reference servicer estimates it (a
  prompt's own hit is known only when it is scheduled);
* ``prefill_pending_tokens``: prompt tokens queued or in the step running now, not yet computed;
* ``token_usage`` (and, on a paged pool, ``active_token_usage``, the same figure: blocks that only
  the prefix cache retains count as free) as ``GetLoads`` and ``vllm:kv_cache_usage_perc``;
* ``gen_throughput``: tokens sent over the last :data:`THROUGHPUT_WINDOW_S` seconds;
* ``engine_silence_ms``: while streams are in flight, how long work has been queued on the model's
  worker with no executor call completing (the forward-progress watch, ``progress.py``; 0 while
  it moves); unset with no stream in flight. ``engine_reports_steps`` is true: the server is the
  engine, it sees every step;
* telemetry: ``cache_hit_rate``, ``num_used_tokens`` / ``max_total_num_tokens``, ``speculative``
  (acceptance of the server's n-gram drafts, once some were verified), ``lora`` (resident adapter
  slots, for a model that serves adapters), ``disaggregation.mode`` (a prefill or decode server).
  Sections the server cannot tell (``memory``, ``queues``, the PD queue depths) stay unset.

**Pacing** (:class:`LoadPacer`, one per subscriber): every event batch carries the record (the
routing core; the telemetry rides the stream's first record and the ``load_only`` batches); a
``load_only`` batch (no events, the last sequence sent repeated) goes out when the record changed
(:func:`load_changed`), else after :data:`HEARTBEAT_INTERVAL` of silence, backing off to
:data:`HEARTBEAT_BACKOFF` after two unchanged heartbeats while the model is idle (no stream in
flight: a busy worker's growing silence is sent every second). At most one ``load_only`` batch per
:data:`LOAD_TICK` per subscriber, whatever the load does. A subscriber that sets
``load_records_before_first_batch`` gets them numbered 0 from its subscription on (a batch numbered
0 moves no cursor); one that does not (it would take such a batch for a duplicate) gets its first
record with the first batch sent to it, and ``load_only`` batches only after that one.
"""

from __future__ import annotations

import collections
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Callable

from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from .. import __version__
from ..core.modes import Role
from ..core.speculation import stats_of
from .metrics import kv_usage, requests_of

if TYPE_CHECKING:
    from ..hosting.host import ModelHost
    from .serving_metrics import ServingMetrics
    from .streams import StreamRegistry

#: Seconds between two looks at the record (a sample is reused for this long).
LOAD_TICK = 0.1
#: Seconds of silence on a stream after which a ``load_only`` heartbeat goes out.
HEARTBEAT_INTERVAL = 1.0
#: The heartbeat interval of an idle model after two unchanged heartbeats.
HEARTBEAT_BACKOFF = 5.0
#: Window of the generation rate (``gen_throughput``).
THROUGHPUT_WINDOW_S = 2.0
#: What the record's telemetry is: sent on a stream's first record and its ``load_only`` batches.
TELEMETRY = ("cache_hit_rate", "num_used_tokens", "max_total_num_tokens", "speculative", "lora", "disaggregation")

_U32 = (1 << 32) - 1
_I32 = (1 << 31) - 1


def _u32(x: float) -> int:
    return max(0, min(_U32, int(x)))


def _i32(x: float) -> int:
    return max(0, min(_I32, int(x)))


class LoadSampler:
    """The load record of one served model (see the module doc), sampled at most once per
    ``tick`` seconds. ``clock``: monotonic seconds (tests pass their own)."""

    def __init__(self, host: "ModelHost", streams: "StreamRegistry", serving: "ServingMetrics | None",
                 role: Role = Role.BOTH, tick: float = LOAD_TICK,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.host = host
        self.streams = streams
        self.serving = serving
        self.role = role
        self.tick = tick
        self.clock = clock
        self._sample: cpb.EngineLoad | None = None
        self._taken = 0.0
        # (when, tokens sent so far) of recent samples, for the generation rate
        self._sent: collections.deque[tuple[float, int]] = collections.deque()

    def record(self) -> cpb.EngineLoad:
        """The current record (a copy; ``age_ms`` set, ``sample`` / ``load_only`` left to the pacer)."""
        now = self.clock()
        if self._sample is None or now - self._taken >= self.tick:
            self._sample, self._taken = self._build(now), now
        out = cpb.EngineLoad()
        out.CopyFrom(self._sample)
        out.age_ms = _u32((now - self._taken) * 1000)
        return out

    def busy(self, record: cpb.EngineLoad) -> bool:
        """Whether the record shows streams in flight."""
        return bool(record.running_requests or record.waiting_requests or record.HasField("engine_silence_ms"))

    def _build(self, now: float) -> cpb.EngineLoad:
        h = self.host
        running, waiting = requests_of(h, self.streams)
        pending, fresh, _ = h.batcher.prompt_work() if h.batcher is not None else (0, 0, 0)
        pm = (h.executor.cache_metrics() or {}).get("prefix_cache", {})
        queried = pm.get("queried_tokens", 0)
        hit_rate = min(1.0, pm.get("hit_tokens", 0) / queried) if queried else 0.0
        reg = h.executor.registry
        usage = kv_usage(h)
        rec = cpb.EngineLoad(
            running_requests=_u32(running), waiting_requests=_u32(waiting), token_usage=usage,
            gen_throughput=self._rate(now), max_running_requests=_u32(h.max_batch),
            waiting_uncached_tokens=_u32(round(fresh * (1.0 - hit_rate))), prefill_pending_tokens=_u32(pending),
            engine_reports_steps=True, cache_hit_rate=hit_rate,
            num_used_tokens=_i32(sum(e.num_tokens for e in reg.entries())),
            max_total_num_tokens=_i32(reg.total_tokens or 0))
        if h.executor.kv_capacity().total_blocks:
            rec.active_token_usage = usage
        if running or waiting or h.running:
            rec.engine_silence_ms = _u32(h.progress.stalled_for(h.running, now) * 1000)
        spec = stats_of(h)
        if spec.draft_tokens and spec.verify_rows:
            rec.speculative.accept_rate = spec.accepted_tokens / spec.draft_tokens
            rec.speculative.accept_length = (spec.accepted_tokens + spec.verify_rows) / spec.verify_rows
        adapters = h.executor.adapters
        if adapters is not None and adapters.max_resident:
            used = sum(1 for a in adapters.adapters.values() if a.resident)
            rec.lora.slots_used, rec.lora.slots_total = used, adapters.max_resident
            rec.lora.utilization = used / adapters.max_resident
        if self.role != Role.BOTH:
            rec.disaggregation.mode = self.role.value
        return rec

    def _rate(self, now: float) -> float:
        """Tokens sent per second over the last :data:`THROUGHPUT_WINDOW_S` (0 before two samples)."""
        sent = self.serving.totals(self.host.model_id)[1] if self.serving is not None else 0
        q = self._sent
        q.append((now, sent))
        while len(q) > 2 and now - q[1][0] >= THROUGHPUT_WINDOW_S:
            q.popleft()
        t0, n0 = q[0]
        return (sent - n0) / (now - t0) if now > t0 else 0.0

    def scheduler_load(self) -> vpb.GetLoadsResponse:
        """``GetLoads``' answer, from the same record the event stream pushes."""
        r = self.record()
        gens = r.running_requests + r.waiting_requests
        mx = self.host.max_batch
        load = vpb.SchedulerLoad(
            dp_rank=0, num_running_reqs=_i32(r.running_requests), num_waiting_reqs=_i32(r.waiting_requests),
            num_total_reqs=_i32(gens), num_used_tokens=r.num_used_tokens, max_total_num_tokens=r.max_total_num_tokens,
            token_usage=r.token_usage, gen_throughput=r.gen_throughput, cache_hit_rate=r.cache_hit_rate,
            utilization=min(1.0, gens / mx) if mx else 0.0, max_running_requests=_i32(r.max_running_requests),
            num_waiting_uncached_tokens=_i32(r.waiting_uncached_tokens))
        return vpb.GetLoadsResponse(timestamp=datetime.now(timezone.utc).isoformat(),
                                    version=f"ferrum-service {__version__}", dp_rank_count=1, loads=[load])


def load_changed(last: cpb.EngineLoad, now: cpb.EngineLoad) -> bool:
    """Whether the record moved enough for a ``load_only`` batch: a request count, the queued
    work or the admission window changed, KV usage moved by more than half a percent, the
    generation rate by more than 5 % or 50 tokens/s, or the engine's silence began or ended."""
    def waiting_work(r: cpb.EngineLoad) -> int | None:
        return r.waiting_uncached_tokens if r.HasField("waiting_uncached_tokens") else None

    if (last.running_requests, last.waiting_requests, last.max_running_requests, waiting_work(last)) != \
            (now.running_requests, now.waiting_requests, now.max_running_requests, waiting_work(now)):
        return True
    if abs(last.token_usage - now.token_usage) > 0.005:
        return True
    if last.HasField("engine_silence_ms") != now.HasField("engine_silence_ms"):
        return True
    a, b = last.gen_throughput, now.gen_throughput
    return abs(a - b) > min(50.0, 0.05 * max(a, b)) if max(a, b) else False


class LoadPacer:
    """One subscriber's records: numbered, the telemetry trimmed off event batches, and the
    ``load_only`` batches paced (see the module doc). ``before_first``: the subscriber set
    ``load_records_before_first_batch``."""

    def __init__(self, sampler: LoadSampler, *, before_first: bool = False, heartbeat: float = HEARTBEAT_INTERVAL,
                 backoff: float = HEARTBEAT_BACKOFF) -> None:
        self.sampler = sampler
        self.heartbeat_s = heartbeat
        self.backoff_s = backoff
        self.samples = 0
        self.last_seq: int | None = 0 if before_first else None  # what a load_only batch repeats
        self._last: cpb.EngineLoad | None = None
        self._sent_at = sampler.clock()
        self._unchanged = 0  # heartbeats in a row with an unchanged record

    def stamp(self, batch: cpb.KvEventBatch) -> cpb.KvEventBatch:
        """Attach the record to an event batch about to go out."""
        rec = self.sampler.record()
        self.last_seq = batch.sequence_number
        batch.load.CopyFrom(self._numbered(rec, load_only=False))
        self._sent_at, self._unchanged = self.sampler.clock(), 0
        return batch

    def due(self) -> cpb.KvEventBatch | None:
        """A ``load_only`` batch when one is due now, else None (call it every :data:`LOAD_TICK`)."""
        if self.last_seq is None:
            return None
        rec = self.sampler.record()
        changed = self._last is None or load_changed(self._last, rec)
        idle = not self.sampler.busy(rec)
        wait = self.backoff_s if idle and self._unchanged >= 2 else self.heartbeat_s
        now = self.sampler.clock()
        if not changed and now - self._sent_at < wait:
            return None
        self._unchanged = 0 if changed else self._unchanged + 1
        self._sent_at = now
        return cpb.KvEventBatch(sequence_number=self.last_seq, timestamp=time.time(),
                                load=self._numbered(rec, load_only=True))

    def _numbered(self, rec: cpb.EngineLoad, load_only: bool) -> cpb.EngineLoad:
        self._last = rec
        out = cpb.EngineLoad()
        out.CopyFrom(rec)
        self.samples += 1
        out.sample, out.load_only = self.samples, load_only
        if not load_only and self.samples > 1:
            for name in TELEMETRY:
                out.ClearField(name)
        return out


__all__ = ["HEARTBEAT_BACKOFF", "HEARTBEAT_INTERVAL", "LOAD_TICK", "LoadPacer", "LoadSampler", "load_changed"]
