"""Pacing of a migration's pre-copy export against the model's steps (``migration.py``, ``kv_transfer.py``).

A pre-copy has the target pull a stream's KV (``ExportKv`` of tokens [0, k)) while the stream goes
on decoding here. Unpaced, the export reads, checksums and sends every layer back to back, and that
work competes with the stream's decode step for the cores and the GIL: measured with SmolLM2-135M
fp32 on CPU (1,024 tokens, 47 MB of KV in 30 layers), ~110 ms of the export's CPU against a 65 ms
step, and the stream's caller saw gaps of up to ~250 ms while it ran. Paced, the export reads at most
:data:`PACED_EXPORT_BYTES_PER_STEP` of K+V (at least one layer: a batch of layers) per model step:
it reads and sends a batch, then reads the next one only once a step of the host ended since the
batch began (``ModelHost.steps``, a future awaited on the event loop: no polling). The export's
work is so spread over the stream's steps, a bounded share on each; the pre-copy lasts at most
one step per layer, and the tail the pause pulls holds as many more tokens (a few hundred KB).

Paced: only the export of a pre-copy whose stream is live and decoding on this server.
``StreamMover`` registers the cache (:meth:`ExportPacing.start`) as it asks the target for the
pre-copy, and removes it (:meth:`ExportPacing.stop`) as soon as the pre-copy is answered, the stream
ends or the move is called off; an export under way then goes on unpaced at once. The tail pulled
in the pause, PD handoffs and every other ``ExportKv`` are never paced. A host that runs no step for
:data:`STEP_WAIT_S` (the stream waits on a slow caller, a wedged model) unpaces the export too, so
a pre-copy always finishes.
"""

from __future__ import annotations

import asyncio
import collections
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable, TypeVar

import structlog

if TYPE_CHECKING:
    from ..hosting.progress import StepClock

log = structlog.get_logger("ferrum_service.wire.kv_export_pacing")

#: K+V bytes a paced export reads, checksums and sends per step of its model (at least one layer a
#: step: a layer is what the export reads at once). 2 MiB is one layer of SmolLM2-135M's 1,024-token
#: fp32 cache, ~3 ms of the export's CPU next to its 65 ms step on the CPU where it was measured;
#: a GPU model's larger layers go one a step, so a pre-copy takes at most one step per layer.
PACED_EXPORT_BYTES_PER_STEP = 2 << 20
#: Seconds a paced export waits for its model's next step before it goes on unpaced (a decode step
#: takes tens of milliseconds; a host that runs none this long is idle or wedged).
STEP_WAIT_S = 2.0

T = TypeVar("T")


class ExportPacing:
    """The caches whose exports are paced, by (model id, cache id): ``Migrations`` owns it and marks
    the caches it pre-copies, ``KvTransfer`` reads it for each export. On the event loop only."""

    def __init__(self, bytes_per_step: int = PACED_EXPORT_BYTES_PER_STEP, step_wait_s: float = STEP_WAIT_S) -> None:
        self.bytes_per_step = bytes_per_step
        self.step_wait_s = step_wait_s
        self._live: dict[tuple[str, str], asyncio.Future] = {}  # resolved when its pacing stops
        #: exports paced, steps they waited for, and why pacing ended early ("stopped": the pre-copy
        #: was answered or its stream ended; "idle": no step for step_wait_s)
        self.stats: collections.Counter = collections.Counter()

    def start(self, model_id: str, cache_id: str) -> None:
        """Pace exports of this cache from now on (its stream decodes here while it is pre-copied)."""
        key = (model_id, cache_id)
        if key not in self._live:
            self._live[key] = asyncio.get_running_loop().create_future()

    def stop(self, model_id: str, cache_id: str) -> None:
        """No more pacing for this cache; an export of it under way goes on unpaced at once."""
        ended = self._live.pop((model_id, cache_id), None)
        if ended is not None and not ended.done():
            ended.set_result(None)

    def paced(self, model_id: str, cache_id: str) -> bool:
        return (model_id, cache_id) in self._live

    def close(self) -> None:
        for model_id, cache_id in list(self._live):
            self.stop(model_id, cache_id)

    def pacer(self, model_id: str, cache_id: str, clock: "StepClock", layer_bytes: int) -> "Pacer | None":
        """The pacing of one export of the cache (``layer_bytes`` of K+V a layer), None if unpaced."""
        ended = self._live.get((model_id, cache_id))
        if ended is None:
            return None
        self.stats["paced"] += 1
        return Pacer(self, clock, ended, max(1, self.bytes_per_step // max(1, layer_bytes)))


class Pacer:
    """One paced export: its layers go in batches of ``per_batch``, each after a step ended."""

    def __init__(self, pacing: ExportPacing, clock: "StepClock", ended: asyncio.Future, per_batch: int) -> None:
        self.pacing = pacing
        self.clock = clock
        self.ended = ended
        self.per_batch = per_batch
        self.active = True
        self.since = clock.count  # the step count when the batch being read began
        self.waits = 0

    def gates(self, layer: int) -> bool:
        """Whether ``layer`` starts a batch that waits for a step (its read is not run ahead)."""
        return self.active and layer > 0 and layer % self.per_batch == 0

    async def wait(self) -> None:
        """Return once a step ended since the last batch began (at once if one did, or if the
        pacing stopped), then begin the next batch."""
        if self.active and self.ended.done():
            self._unpace("stopped")
        if self.active and self.clock.count <= self.since:
            done, _ = await asyncio.wait({self.clock.next(), self.ended}, timeout=self.pacing.step_wait_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if self.ended.done():
                self._unpace("stopped")
            elif not done:
                self._unpace("idle")
            else:
                self.waits += 1
                self.pacing.stats["waits"] += 1
        self.since = self.clock.count

    def _unpace(self, why: str) -> None:
        self.active = False
        self.pacing.stats[why] += 1


async def layer_reads(read: Callable[[int], Awaitable[T]], num_layers: int,
                      pacer: Pacer | None) -> AsyncIterator[T]:
    """``read(layer)`` of each layer in order, the next layer's read under way while the caller
    sends this one; with a ``pacer``, a batch's first read waits for :meth:`Pacer.wait` (no read
    runs ahead of it). Close it (``contextlib.aclosing``): a read under way is then cancelled."""
    nxt: asyncio.Future | None = asyncio.ensure_future(read(0))
    try:
        for layer in range(num_layers):
            out = await nxt
            nxt = None
            gated = layer + 1 < num_layers and pacer is not None and pacer.gates(layer + 1)
            if layer + 1 < num_layers and not gated:
                nxt = asyncio.ensure_future(read(layer + 1))
            yield out
            if gated:
                await pacer.wait()
                nxt = asyncio.ensure_future(read(layer + 1))
        if pacer is not None and pacer.waits:
            log.info("pre-copy export paced", layers=num_layers, per_batch=pacer.per_batch, steps_waited=pacer.waits,
                     unpaced_early=not pacer.active)
    finally:
        if nxt is not None and not nxt.done():
            nxt.cancel()
            nxt.add_done_callback(lambda f: f.cancelled() or f.exception())


__all__ = ["ExportPacing", "PACED_EXPORT_BYTES_PER_STEP", "Pacer", "STEP_WAIT_S", "layer_reads"]
