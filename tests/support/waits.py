"""Waiting on a condition with a deadline, instead of a fixed sleep before an assertion.

Each wait returns the last value it saw, so the test asserts on it and a failure shows what was
there at the deadline: ``assert wait_no_live_caches(srv) == {"tiny": 0}``."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(read: Callable[[], T], done: Callable[[T], bool], timeout: float = 10.0, interval: float = 0.02) -> T:
    """``read()`` until ``done(value)`` or ``timeout`` seconds; the last value read."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if done(value) or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


def wait_until(pred: Callable[[], object], timeout: float = 10.0, interval: float = 0.02) -> bool:
    """True once ``pred()`` is true; False if it is still false after ``timeout`` seconds."""
    return bool(wait_for(pred, bool, timeout, interval))


def wait_no_live_caches(srv, timeout: float = 10.0) -> dict[str, int]:
    """An :class:`~tests.support.servers.InProcessServer`'s live caches per model, once none is
    left (releases run just after a stream or Session ends) or at the deadline."""
    return wait_for(srv.live_caches, lambda live: not any(live.values()), timeout, 0.0)


def wait_no_listed_caches(client, model_id: str = "", timeout: float = 10.0) -> list:
    """The caches ``ListCaches`` shows the client (its own), once there are none or at the deadline."""
    def read() -> list:
        return list((client.list_caches(model_id) if model_id else client.list_caches()).caches)

    return wait_for(read, lambda caches: not caches, timeout, 0.05)


def subscribe_from_now(client, model_id: str = "", include_block_events: bool = False):
    """A ``SubscribeKvEvents`` stream that misses nothing from this call on, whenever the server
    gets to registering it: it replays from the event sequence read first (``Loads``), so a test
    can act at once instead of sleeping until the subscription is live."""
    from ferrum_client import pb

    seq = client.stub.Loads(pb.LoadsRequest()).kv_event_seq
    return client.stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(
        model_id=model_id, include_block_events=include_block_events, from_seq=seq + 1))
