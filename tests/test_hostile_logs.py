"""Logs do not carry digests of bearer tokens that can be reversed offline (audit L5).

A caller's identity is the unsalted SHA-256 of its token (clients recompute it for prefix keys),
and it was logged as a cache's ``origin``: a low-entropy token could be brute-forced from the log.
Logs now show a keyed digest (a key drawn at process start). Real server on a loopback port with
bearer tokens; a quiet origin's cache is reclaimed and its log line read.
"""

from __future__ import annotations

import structlog.testing

from ferrum_client import Client
from ferrum_client.prefix_keys import token_caller
from ferrum_service.core.callers import log_id
from ferrum_service.executors import ConfigurableModelExecutor

from .support.servers import InProcessServer
from .support.waits import wait_until

TOKEN = "alice-1234"  # the kind of token a dictionary attack finds


def test_a_reclaimed_caches_log_line_does_not_carry_the_tokens_digest():
    with InProcessServer([ConfigurableModelExecutor.with_token_sequence(1000, [7], model_id="mock")],
                         auth_tokens=[TOKEN], cache_ttl=60, origin_idle_ttl=0.4) as srv, \
            Client(srv.target, token=TOKEN) as c, structlog.testing.capture_logs() as logs:
        c.prefill("mock", [1, 2])
        assert wait_until(lambda: srv.live_caches()["mock"] == 0, timeout=10)  # the origin went quiet
    lines = [x for x in logs if x.get("event") == "cache of a quiet origin reclaimed"]
    assert lines
    digest = token_caller(TOKEN).split(":", 1)[1]
    for line in lines:
        assert digest[:12] not in repr(line), line
        assert line["origin"].startswith(log_id(token_caller(TOKEN)).split("@")[0])  # grouped per caller


def test_log_ids_are_keyed_and_keep_the_host():
    a = log_id("token:" + "0" * 32 + "@ipv4:10.0.0.1")
    assert a.endswith("@ipv4:10.0.0.1") and "0" * 12 not in a
    assert log_id("token:" + "0" * 32) == a.split("@")[0]  # stable within the process
    assert log_id("token:" + "1" * 32) != log_id("token:" + "0" * 32)
    assert log_id("") == "" and log_id("@ipv4:10.0.0.1") == "@ipv4:10.0.0.1"
