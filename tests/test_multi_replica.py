"""Two real server processes behind the client-side StickyRouter (ferrum_client.routing).

Sessions are sticky: a session's KV cache lives on the replica whose Prefill created it. The router
spreads new sessions over both replicas, keeps every step of a session on its replica, and when a
replica dies (SIGKILL) fails that replica's sessions fast with UNAVAILABLE while new sessions go to
the survivor. Loopback only; every call has a deadline.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from ferrum_client import Client, FerrumRpcError
from ferrum_client.routing import NoReplicaAvailable, ReplicaLost, StickyRouter

from .support.servers import ServerProcess

pytestmark = pytest.mark.timeout(180)

MODEL = "mock"
SPEC = f"configurable,id={MODEL},vocab_size=1000,token_sequence=10:20:30"
PROMPT = [1, 2, 3, 4]
SESSIONS = 6
STEP_TIMEOUT = 5.0
FAIL_FAST_S = 2.0  # a lost replica's sessions must fail well inside the step deadline


@pytest.fixture
def replicas():
    servers = [ServerProcess("--model", SPEC, "--grace-period", "1", ready_timeout=90) for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:  # start both at once: each imports torch
        started = list(pool.map(lambda s: s.start(), servers))
    try:
        yield started
    finally:
        for s in started:
            s.stop()


def _cache_ids(target: str) -> set[str]:
    with Client(target, timeout=STEP_TIMEOUT) as c:
        return {h.cache_id for h in c.list_caches(MODEL).caches}


def test_sessions_are_sticky_and_fail_fast_when_a_replica_dies(replicas):
    a, b = replicas
    # Cache ids are unique per server only (the contract: "unique on this server for its
    # lifetime"), and two fresh servers hand out the same ones. Give replica B some history, as a
    # replica that has served before would have, so that a cache id from one replica names no live
    # cache on the other; the router itself never relies on this: it keys sessions by replica.
    with Client(b.target, timeout=STEP_TIMEOUT) as cb:
        for _ in range(SESSIONS):
            h = cb.prefill(MODEL, PROMPT).output.cache
            cb.release_cache(MODEL, h.cache_id)

    with StickyRouter([a.target, b.target], step_timeout=STEP_TIMEOUT) as router:
        # 1. New sessions spread over both replicas (least-loaded, round-robin on ties).
        sessions = []
        for _ in range(SESSIONS):
            s = router.new_session()
            out = s.prefill(MODEL, PROMPT).output
            sessions.append({"s": s, "target": s.target, "cache": out.cache.cache_id,
                             "next": out.output.token_id})
        per_target = {t: [x for x in sessions if x["target"] == t] for t in (a.target, b.target)}
        assert {t: len(v) for t, v in per_target.items()} == {a.target: SESSIONS // 2, b.target: SESSIONS // 2}

        # 2. Every step of a session goes to its replica: three decodes each, all succeed.
        for x in sessions:
            for _ in range(3):
                d = x["s"].decode(MODEL, x["cache"], x["next"]).output
                assert d.cache.cache_id == x["cache"]
                x["next"] = d.output.token_id
            assert d.cache.num_tokens == len(PROMPT) + 3

        # Each cache exists only on its own replica ...
        live = {a.target: _cache_ids(a.target), b.target: _cache_ids(b.target)}
        other = {a.target: b.target, b.target: a.target}
        for x in sessions:
            assert x["cache"] in live[x["target"]]
            assert x["cache"] not in live[other[x["target"]]]
        # ... and a step sent to the other replica is NOT_FOUND there.
        for x in sessions:
            with Client(other[x["target"]], timeout=STEP_TIMEOUT) as wrong:
                with pytest.raises(FerrumRpcError) as ei:
                    wrong.decode(MODEL, x["cache"], x["next"])
                assert ei.value.code == grpc.StatusCode.NOT_FOUND, ei.value

        # 3. Kill replica A without warning (no drain).
        a.terminate(signal.SIGKILL)
        a.wait(10)
        lost, kept = per_target[a.target], per_target[b.target]

        # Its sessions fail fast with UNAVAILABLE: the first call finds the connection gone ...
        t0 = time.monotonic()
        with pytest.raises(ReplicaLost) as ei:
            lost[0]["s"].decode(MODEL, lost[0]["cache"], lost[0]["next"])
        first = time.monotonic() - t0
        assert ei.value.code == grpc.StatusCode.UNAVAILABLE
        assert first < FAIL_FAST_S, f"first failure took {first:.2f}s"
        # ... and the rest fail at once, without a network round trip.
        for x in lost:
            t0 = time.monotonic()
            with pytest.raises(ReplicaLost) as ei:
                x["s"].decode(MODEL, x["cache"], x["next"])
            assert ei.value.code == grpc.StatusCode.UNAVAILABLE
            assert ei.value.target == a.target
            assert time.monotonic() - t0 < 0.1
            x["s"].close()

        # The survivor's sessions carry on where they were.
        for x in kept:
            d = x["s"].decode(MODEL, x["cache"], x["next"]).output
            assert d.cache.num_tokens == len(PROMPT) + 4

        # 4. New sessions all go to the survivor and work.
        fresh = [router.new_session() for _ in range(4)]
        assert {s.target for s in fresh} == {b.target}
        for s in fresh:
            out = s.prefill(MODEL, PROMPT).output
            d = s.decode(MODEL, out.cache.cache_id, out.output.token_id).output
            assert d.cache.num_tokens == len(PROMPT) + 1
            s.release_cache(MODEL, out.cache.cache_id)
            s.close()
        for x in kept:
            x["s"].release_cache(MODEL, x["cache"])
            x["s"].close()
        assert _cache_ids(b.target) == set()

        # 5. With no replica left, new sessions are refused at once.
        b.terminate(signal.SIGKILL)
        b.wait(10)
        assert router.check_health(timeout=1.0)[b.target] == "UNAVAILABLE"
        with pytest.raises(NoReplicaAvailable) as ei:
            router.new_session()
        assert ei.value.code == grpc.StatusCode.UNAVAILABLE


def test_router_refresh_follows_the_replica_set(replicas):
    """A resolver (a headless Service's DNS records) drives membership: a replica that leaves the
    set fails its sessions fast; one that joins takes new sessions."""
    a, b = replicas
    current = [a.target]
    with StickyRouter(resolver=lambda: list(current), step_timeout=STEP_TIMEOUT) as router:
        s1 = router.new_session()
        assert s1.target == a.target
        out = s1.prefill(MODEL, PROMPT).output
        current[:] = [b.target]  # pod A left the endpoints (e.g. deleted), pod B joined
        router.refresh()
        with pytest.raises(ReplicaLost):
            s1.decode(MODEL, out.cache.cache_id, out.output.token_id)
        s2 = router.new_session()
        assert s2.target == b.target
        s2.prefill(MODEL, PROMPT)
