"""A live stream's pre-copy export paced against the model's steps (``kv_export_pacing.py``).

While A's stream decodes, the export B pulls for its pre-copy reads a batch of layers (here one:
the pacing's byte budget is set below a layer) per step of A's model, so the stream's steps and the
export's layer reads alternate; the tail pulled in the pause and any other ``ExportKv`` are read
back to back; a stream that ends mid pre-copy (or a host that runs no step) unpaces the export at
once, so the pre-copy finishes; and the moved stream's tokens are an unmoved run's. While a move
is under way A runs no step twice (no decode step is run ahead of the stream and undone).

Behaviour, not timings: A's decode steps are gated on the export's progress (each waits for one
more layer read), so a paced export's layer reads see the step count advance between them, and an
unpaced one reads its layers at one count. A 6-layer tiny llama, two in-process servers.
"""

from __future__ import annotations

import asyncio
import collections
import shutil
import time

import pytest

from ferrum_client import Client, pb
from ferrum_service.testing.tiny_models import build_tiny_llama

from .support.servers import InProcessServer
from .test_migration import PEER, M, _executor, _fast, _prompt
from .test_migration_precopy import _count_stagings, _nothing_on, _stream

LAYERS = 6


@pytest.fixture(scope="module")
def deep_llama_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-6"), seed=0, num_layers=LAYERS)


@pytest.fixture
def pair(deep_llama_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(deep_llama_dir, copy)
    with InProcessServer([_executor(deep_llama_dir)], **PEER) as a, InProcessServer([_executor(copy)], **PEER) as b:
        mig = a.server.servicer.migrations
        mig.precopy_tokens = 16
        assert a.server.servicer.kv.pacing is mig.pacing  # one registry: Migrations marks, KvTransfer paces
        mig.pacing.bytes_per_step = 1  # one layer a step
        mig.pacing.step_wait_s = 30.0  # a pacing that waited for a step that never comes would hang the test
        yield a, b


def _record_reads(srv) -> list[tuple[int, int, int, int]]:
    """(from token, to token, layer, the model's step count) of each layer ``srv`` reads for an
    export, recorded as the read begins (on the transfer thread)."""
    host = srv.models.get(M)
    ex = host.executor
    real, out = ex.export_kv_layer, []

    def read(cache_id, start, end, layer):
        out.append((start, end, layer, host.steps.count))
        return real(cache_id, start, end, layer)

    ex.export_kv_layer = read
    return out


def _count_steps(srv) -> list[int]:
    """One entry per forward ``srv``'s model runs from now on (rows in it)."""
    ex = srv.models.get(M).executor
    real, out = ex._step, []

    def step(items, field, on_forward=None):
        out.append(len(items))
        return real(items, field, on_forward)

    ex._step = step
    return out


def _gate_on_reads(srv, reads, done, gate: int) -> None:
    """``srv``'s decode steps: step number ``gate`` waits until a move of the stream was asked for,
    and each later one until the pre-copy's export began one more layer read than when the step
    before went, or ``done()`` (each at most 10 s). A step so never runs ahead of the export: the
    export's reads wait for steps only if it is paced."""
    host = srv.models.get(M)
    real = host.__dict__.setdefault("_test_real_decode", host.batcher.decode)
    counts: collections.Counter = collections.Counter()
    seen = [0]

    def precopy_reads() -> int:
        return sum(1 for start, *_ in reads if start == 0)

    async def decode(inp):
        counts[inp.cache_id] += 1
        until = time.monotonic() + 10
        if counts[inp.cache_id] == gate:
            st = next((s for s in srv.server.streams.generations.values() if s.cache_id == inp.cache_id), None)
            while st is not None and st.move_result is None and time.monotonic() < until:
                await asyncio.sleep(0.005)
        elif counts[inp.cache_id] > gate:
            while precopy_reads() <= seen[0] and not done() and time.monotonic() < until:
                await asyncio.sleep(0.005)
            seen[0] = precopy_reads()
        return await real(inp)

    host.batcher.decode = decode


@pytest.mark.parametrize("mode", ["greedy-follow", "seeded-relay"])
def test_paced_precopy_interleaves_with_the_streams_steps(pair, mode):
    a, b = pair
    kw = {"max_tokens": 40}
    if mode == "seeded-relay":
        kw.update(temperature=0.9, top_p=0.95, seed=1234, repetition_penalty=1.3, migration_mode="relay")
    prompt = _prompt(120, seed=41)
    pacing = a.server.servicer.migrations.pacing
    with Client(a.target) as ca:
        ref, _, ref_fin, _, _ = _stream(ca, prompt, at=0, **kw)
        staged = _count_stagings(b)
        reads = _record_reads(a)
        _gate_on_reads(a, reads, lambda: bool(staged), gate=12)
        steps = _count_steps(a)
        toks, idx, fin, res, _ = _stream(ca, prompt, move=lambda: ca.migrate_streams(b.target, request_id="mv"),
                                         at=12, **kw)
        _fast(a)
    assert res.migrated == 1, res
    assert toks == ref and idx == list(range(40)) and fin.finish_reason == ref_fin.finish_reason
    r = res.streams[0]
    assert r.precopied_tokens == (120 + 12) // 16 * 16 and staged == [r.precopied_tokens]
    pre = [(layer, n) for start, end, layer, n in reads if start == 0]
    tail = [(layer, n) for start, end, layer, n in reads if start > 0]
    # the pre-copy: one layer a step, the stream's steps advancing between the reads
    assert [layer for layer, _ in pre] == list(range(LAYERS))
    assert all(n1 > n0 for (_, n0), (_, n1) in zip(pre, pre[1:])), pre
    # the tail, in the pause (no step runs): read back to back, never paced
    assert [layer for layer, _ in tail] == list(range(LAYERS)) and len({n for _, n in tail}) == 1, tail
    assert pacing.stats["paced"] == 1 and not pacing.stats["idle"] and not pacing.stats["stopped"], pacing.stats
    assert not pacing._live  # unmarked once answered
    # A ran each step of the stream once: the ones that made the tokens it sent (the prompt's
    # included); the step its chain ran ahead when the move was asked is taken, not undone and run again
    sent_by_a = r.precopied_tokens + r.paused_tokens - 120 + 1
    assert len(steps) == sent_by_a, (len(steps), sent_by_a)
    assert a.live_caches() == {M: 0}


def test_stream_ending_mid_precopy_unpaces_its_export(pair):
    """The stream reaches max_tokens two or three steps into a six-layer paced pre-copy: its export goes
    on unpaced at once (not after the 30 s step wait), B stages the whole pre-copy, the move is
    FAILED_PRECONDITION, the tokens are whole, and B drops what it staged."""
    a, b = pair
    prompt = _prompt(40, seed=42)
    pacing = a.server.servicer.migrations.pacing
    with Client(a.target) as ca:
        ref = ca.generate(M, token_ids=prompt, max_tokens=12, ignore_eos=True).tokens()
        staged = _count_stagings(b)
        reads = _record_reads(a)
        _gate_on_reads(a, reads, lambda: bool(staged), gate=8)
        toks, idx, _, res, stream = _stream(ca, prompt, move=lambda: ca.migrate_streams(b.target), at=8,
                                            max_tokens=12)
        _fast(a)
    assert toks == ref and idx == list(range(12)) and not stream.migrations
    assert res.migrated == 0 and res.streams[0].error_code == "FAILED_PRECONDITION", res
    until = time.monotonic() + 10  # the move was answered at the stream's end; the pull goes on
    while not staged and time.monotonic() < until:
        time.sleep(0.01)
    assert staged == [48]  # the whole pre-copy arrived (unpaced, it did not wait 30 s for a step)
    pre = [(layer, n) for start, end, layer, n in reads if start == 0]
    assert [layer for layer, _ in pre] == list(range(LAYERS))
    # the stream's last steps came between the first layers, one a layer (two or three of them: the
    # pre-copy starts a boundary later when the worker had run a step ahead); the layers left when
    # the stream ended were read back to back
    end = pre[-1][1]
    during = sum(1 for _, n in pre if n < end)
    assert 2 <= during <= 3, pre
    assert all(n1 > n0 for (_, n0), (_, n1) in zip(pre[:during + 1], pre[1:during + 1])), pre
    assert all(n == end for _, n in pre[during:]), pre
    assert pacing.stats["paced"] == 1 and pacing.stats["stopped"] == 1 and not pacing.stats["idle"], pacing.stats
    assert not pacing._live
    assert a.live_caches() == {M: 0}
    _nothing_on(b)


def test_ordinary_exports_are_not_paced_and_an_idle_host_unpaces(pair):
    """An ``ExportKv`` of a cache no pre-copy marked is never paced, even while another cache is
    marked (its reads do not wait for the 30 s step wait); a marked cache on a host that runs no
    step waits ``step_wait_s`` once and goes on unpaced."""
    a, _ = pair
    host = a.models.get(M)
    pacing = a.server.servicer.migrations.pacing
    reads = _record_reads(a)
    with Client(a.target) as ca:
        cache = ca.prefill(M, _prompt(64, seed=43)).output.cache.cache_id
        other = ca.prefill(M, _prompt(20, seed=44)).output.cache.cache_id

        async def mark(cache_id: str) -> None:
            pacing.start(M, cache_id)

        a.run(mark(other))
        msgs = list(ca.export_kv(M, cache))
        assert sum(m.WhichOneof("message") == "chunk" for m in msgs) == LAYERS
        assert not pacing.stats["paced"] and len(reads) == LAYERS
        assert pacing.paced(M, other) and not pacing.paced(M, cache)

        pacing.step_wait_s = 0.2
        before = host.steps.count
        msgs = list(ca.export_kv(M, other))
        assert sum(m.WhichOneof("message") == "chunk" for m in msgs) == LAYERS
        assert pacing.stats["paced"] == 1 and pacing.stats["idle"] == 1 and host.steps.count == before
        ca.release_cache(M, cache)
        ca.release_cache(M, other)
    a.run(_stop(pacing, other))
    assert a.live_caches() == {M: 0}


async def _stop(pacing, cache_id: str) -> None:
    pacing.stop(M, cache_id)
