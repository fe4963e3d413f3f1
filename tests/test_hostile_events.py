"""Multi-tenant hardening of KV events and LoRA adapters (issue 27: audit F10, F14, F18, F24, F25,
F26), through real gRPC with two authenticated callers.

- F10: under per-caller auth (bearer tokens, or mutual TLS) a ``SubscribeKvEvents`` stream gets only
  its caller's cache events and block events (blocks stored by another caller's steps are not
  visible), and block events carry no token ids — under mTLS as under bearer tokens.
- F14: the replay buffer is bounded by (estimated) bytes as well as by events.
- F26: open subscriptions are capped per caller and in all (RESOURCE_EXHAUSTED with a retry hint);
  other callers are answered at once meanwhile.
- F24: ``ListAdapters`` gives an adapter's server path only to admin callers and counts live caches
  among the caller's own.
- F18: an adapter read back from disk is checked against a digest of both files, config included.
- F25: ``lora_metrics`` reads the adapter table while adapters are loaded and unloaded.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time

import grpc
import pytest

from ferrum_client import Client, FerrumRpcError, pb
from ferrum_service.executors.transformers import HfCausalLmExecutor

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .lora_fixtures import adapters  # noqa: F401 - fixture
from .support.servers import InProcessServer
from .test_tls import CA

C = grpc.StatusCode
PA = [(7 * i + 3) % 500 + 1 for i in range(40)]  # alice's prompt: 2 full 16-token blocks
PB = [(11 * i + 5) % 500 + 1 for i in range(40)]  # bob's


def _tiny(path, **kw):
    return HfCausalLmExecutor.from_path(path, model_id="tiny", device="cpu", kv_budget_tokens=4096, **kw)


class Follower:
    """Reads one SubscribeKvEvents stream on a thread into ``messages``."""

    def __init__(self, client: Client, from_seq: int | None = None, blocks: bool = True) -> None:
        self.stream = client.subscribe_kv_events(from_seq=from_seq, include_block_events=blocks)
        self.messages: list = []
        self.error: Exception | None = None
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        try:
            for msg in self.stream:
                self.messages.append(msg)
        except FerrumRpcError as e:
            self.error = e

    def wait_for(self, pred, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(pred(x) for x in list(self.messages)):
            assert time.monotonic() < deadline, f"event not seen: {self.messages[-5:]}, error {self.error}"
            time.sleep(0.01)

    def cache_events(self) -> list:
        return [x.event for x in self.messages if x.WhichOneof("message") == "event"]

    def block_events(self) -> list:
        return [x.block_event for x in self.messages if x.WhichOneof("message") == "block_event"]

    def stop(self) -> None:
        self.stream.cancel()
        self.t.join(5)


def _released(cid: str):
    return lambda x: (x.WhichOneof("message") == "event" and x.event.cache_id == cid
                      and x.event.kind == pb.KV_EVENT_KIND_RELEASED)


def _two_tenants_then_check(srv, alice: Client, bob: Client) -> None:
    """Both callers follow events; each runs a prompt; each sees only its own events."""
    seq0 = alice.loads().kv_event_seq
    fa, fb = Follower(alice, seq0 + 1), Follower(bob, seq0 + 1)
    try:
        a = alice.prefill("tiny", PA).output.cache.cache_id
        b = bob.prefill("tiny", PB).output.cache.cache_id
        bob.decode("tiny", b, 9)
        alice.release_cache("tiny", a)
        bob.release_cache("tiny", b)
        # a marker after everything: when alice sees it, every earlier event has been through her filter
        mark = alice.prefill("tiny", [1]).output.cache.cache_id
        alice.release_cache("tiny", mark)
        fa.wait_for(_released(mark))
        fb.wait_for(_released(b))
        a_ids = {e.cache_id for e in fa.cache_events()}
        b_ids = {e.cache_id for e in fb.cache_events()}
        assert a_ids == {a, mark}, a_ids  # nothing of bob's
        assert b_ids == {b}, b_ids  # nothing of alice's (not even the marker that came later)
        kinds = [e.kind for e in fb.cache_events()]
        assert kinds == [pb.KV_EVENT_KIND_CREATED, pb.KV_EVENT_KIND_EXTENDED, pb.KV_EVENT_KIND_RELEASED], kinds
        a_keys = [k for ev in fa.block_events() if ev.HasField("stored") for k in ev.stored.block_hashes]
        b_keys = [k for ev in fb.block_events() if ev.HasField("stored") for k in ev.stored.block_hashes]
        assert len(a_keys) == 2 and len(b_keys) == 2, (a_keys, b_keys)  # each its own prompt's 2 blocks
        assert not set(a_keys) & set(b_keys)
        for ev in fa.block_events() + fb.block_events():
            if ev.HasField("stored"):
                assert list(ev.stored.token_ids) == [], "a block event carried token ids under per-caller auth"
        # the replay copies keep no token ids either
        assert all(not (r.block or {}).get("token_ids") for r in srv.server.events.replay)
    finally:
        fa.stop()
        fb.stop()


def test_events_are_per_caller_under_bearer_tokens(tiny_llama_dir):  # noqa: F811
    with InProcessServer([_tiny(tiny_llama_dir)], auth_tokens=["alice-secret", "bob-secret"]) as srv, \
            Client(srv.target, token="alice-secret") as alice, Client(srv.target, token="bob-secret") as bob:
        _two_tenants_then_check(srv, alice, bob)


@pytest.fixture(scope="module")
def mtls(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki-events")
    ca = CA("events-ca")
    crt, key = ca.issue("server", server=True)
    (d / "server.crt").write_bytes(crt)
    (d / "server.key").write_bytes(key)
    (d / "ca").write_bytes(ca.pem)
    return {"dir": d, "ca": ca.pem, "alice": ca.issue("alice", server=False), "bob": ca.issue("bob", server=False)}


def test_events_are_per_caller_under_mutual_tls(tiny_llama_dir, mtls):  # noqa: F811
    """Client certificates name the callers (no bearer tokens): the same isolation, and no token ids."""
    d = mtls["dir"]
    with InProcessServer([_tiny(tiny_llama_dir)], tls_cert=str(d / "server.crt"), tls_key=str(d / "server.key"),
                         tls_client_ca=str(d / "ca")) as srv:
        (ac, ak), (bc, bk) = mtls["alice"], mtls["bob"]
        with Client(srv.target, root_certificates=mtls["ca"], private_key=ak, certificate_chain=ac) as alice, \
                Client(srv.target, root_certificates=mtls["ca"], private_key=bk, certificate_chain=bc) as bob:
            _two_tenants_then_check(srv, alice, bob)


def test_without_auth_every_subscriber_sees_everything_with_token_ids(tiny_llama_dir):  # noqa: F811
    """The single-tenant default is unchanged: one caller's events reach every subscriber, and block
    events carry the prompt's token ids (what a router mirrors)."""
    with InProcessServer([_tiny(tiny_llama_dir)]) as srv, Client(srv.target) as c1, Client(srv.target) as c2:
        f = Follower(c2, c2.loads().kv_event_seq + 1)
        try:
            a = c1.prefill("tiny", PA).output.cache.cache_id
            c1.release_cache("tiny", a)
            f.wait_for(_released(a))
            (stored,) = [ev.stored for ev in f.block_events() if ev.HasField("stored")]
            assert list(stored.token_ids) == PA[:32]
        finally:
            f.stop()


def test_replay_buffer_is_bounded_by_bytes(tiny_llama_dir):  # noqa: F811
    """Long prompts' block events (512 token ids each) past a 32 KiB replay bound: the oldest go,
    though far fewer than 65,536 events were published; a subscriber asking for them resyncs."""
    limit = 32 * 1024
    with InProcessServer([_tiny(tiny_llama_dir)], kv_event_replay_bytes=limit) as srv, Client(srv.target) as c:
        for i in range(16):
            cid = c.prefill("tiny", [(i * 31 + j) % 500 + 1 for j in range(512)]).output.cache.cache_id
            c.release_cache("tiny", cid)
        hub = srv.server.events
        assert hub.seq < 200  # far below the event bound
        held_ids = sum(len((r.block or {}).get("token_ids") or ()) for r in hub.replay)
        assert 0 < held_ids * 4 <= limit, held_ids
        assert hub.replay_held_bytes <= limit
        first = next(iter(c.subscribe_kv_events(from_seq=1, include_block_events=True)))
        assert first.WhichOneof("message") == "resync_required"
        assert first.resync_required.oldest_available_seq > 1


def _opened(client: Client) -> Follower:
    """A subscription that replays from seq 1 (so it has an event to deliver at once)."""
    f = Follower(client, from_seq=1, blocks=False)
    f.wait_for(lambda x: True, timeout=10)
    return f


def test_subscribers_are_capped_per_caller_and_in_all(tiny_llama_dir):  # noqa: F811
    ex = _tiny(tiny_llama_dir)
    with InProcessServer([ex], auth_tokens=["alice-secret", "bob-secret", "carol-secret"],
                         max_kv_event_subscribers=5, max_kv_event_subscribers_per_caller=3) as srv, \
            Client(srv.target, token="alice-secret") as alice, Client(srv.target, token="bob-secret") as bob, \
            Client(srv.target, token="carol-secret") as carol:
        for c in (alice, bob, carol):
            c.release_cache("tiny", c.prefill("tiny", [1, 2, 3]).output.cache.cache_id)
        open_: list[Follower] = []
        try:
            open_ += [_opened(alice) for _ in range(3)]
            with pytest.raises(FerrumRpcError) as e:
                next(iter(alice.subscribe_kv_events(from_seq=1)))
            assert e.value.code == C.RESOURCE_EXHAUSTED and "per caller" in e.value.message
            assert e.value.retry_after_s and e.value.retry_after_s > 0
            open_ += [_opened(bob) for _ in range(2)]  # 5 open: the server's cap
            with pytest.raises(FerrumRpcError) as e:
                next(iter(carol.subscribe_kv_events(from_seq=1)))
            assert e.value.code == C.RESOURCE_EXHAUSTED and "limit is 5" in e.value.message
            t0 = time.perf_counter()
            assert carol.loads().loads[0].model_id == "tiny"  # other RPCs are answered at once
            assert time.perf_counter() - t0 < 1.0
            open_.pop(0).stop()  # one of alice's goes: carol may subscribe again
            deadline = time.monotonic() + 5
            while True:
                try:
                    next(iter(carol.subscribe_kv_events(from_seq=1)))
                    break
                except FerrumRpcError as e:
                    assert e.code == C.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                    time.sleep(0.05)
        finally:
            for f in open_:
                f.stop()


def test_default_cap_per_caller_is_16(tiny_llama_dir):  # noqa: F811
    """With the defaults, one caller cannot open a 17th subscription; another caller still can."""
    with InProcessServer([_tiny(tiny_llama_dir)], auth_tokens=["alice-secret", "bob-secret"]) as srv, \
            Client(srv.target, token="alice-secret") as alice, Client(srv.target, token="bob-secret") as bob:
        for c in (alice, bob):
            c.release_cache("tiny", c.prefill("tiny", [1, 2, 3]).output.cache.cache_id)
        open_ = [_opened(alice) for _ in range(16)]
        try:
            with pytest.raises(FerrumRpcError) as e:
                next(iter(alice.subscribe_kv_events(from_seq=1)))
            assert e.value.code == C.RESOURCE_EXHAUSTED
            open_.append(_opened(bob))
            assert open_[-1].error is None
        finally:
            for f in open_:
                f.stop()


# ---- LoRA ----------------------------------------------------------------------------------------
def test_list_adapters_hides_paths_and_other_tenants_caches(tiny_llama_dir, adapters):  # noqa: F811
    with InProcessServer([_tiny(tiny_llama_dir, max_adapters=2)], auth_tokens=["alice-secret", "bob-secret"],
                         admin_tokens=["admin-secret"]) as srv, \
            Client(srv.target, token="alice-secret") as alice, Client(srv.target, token="bob-secret") as bob, \
            Client(srv.target, token="admin-secret") as admin:
        path = str(adapters["a1"][0].resolve())
        admin.load_adapter("a1", path, model_id="tiny")
        cid = alice.prefill("tiny", PA, adapter="a1").output.cache.cache_id
        (seen_by_bob,) = bob.list_adapters().adapters
        assert seen_by_bob.name == "a1" and seen_by_bob.rank == 4
        assert seen_by_bob.path == "", "a non-admin caller was told the adapter's server path"
        assert seen_by_bob.live_caches == 0 and seen_by_bob.steps == 0  # alice's cache is not bob's business
        (seen_by_alice,) = alice.list_adapters().adapters
        assert seen_by_alice.path == "" and seen_by_alice.live_caches == 1
        (seen_by_admin,) = admin.list_adapters().adapters
        assert seen_by_admin.path == path and seen_by_admin.live_caches == 1 and seen_by_admin.steps >= 1
        alice.release_cache("tiny", cid)


def test_adapter_read_back_checks_its_config_too(tiny_llama_dir, adapters, tmp_path):  # noqa: F811
    """One adapter resident at a time: a1 is read back from disk when a step needs it. A changed
    adapter_config.json (lora_alpha doubled: other outputs) is refused, not applied silently."""
    a1 = shutil.copytree(adapters["a1"][0], tmp_path / "a1")
    with InProcessServer([_tiny(tiny_llama_dir, max_adapters=1)], auth_tokens=["alice-secret"],
                         admin_tokens=["admin-secret"]) as srv, \
            Client(srv.target, token="alice-secret") as alice, Client(srv.target, token="admin-secret") as admin:
        admin.load_adapter("a1", str(a1), model_id="tiny")
        admin.load_adapter("a2", str(adapters["a2"][0]), model_id="tiny")  # a1 leaves device memory
        out = alice.prefill("tiny", PA, adapter="a1", bypass_prefix_cache=True).output  # read back, unchanged: fine
        alice.release_cache("tiny", out.cache.cache_id)
        alice.release_cache("tiny", alice.prefill("tiny", PA, adapter="a2").output.cache.cache_id)  # a1 out again
        cfg = (a1 / "adapter_config.json").read_text()
        assert '"lora_alpha": 8' in cfg
        (a1 / "adapter_config.json").write_text(cfg.replace('"lora_alpha": 8', '"lora_alpha": 16'))
        with pytest.raises(FerrumRpcError) as e:
            alice.prefill("tiny", PA, adapter="a1", bypass_prefix_cache=True)
        assert e.value.code == C.FAILED_PRECONDITION and "changed since it was loaded" in e.value.message
        assert srv.live_caches()["tiny"] == 0


def test_lora_metrics_while_adapters_come_and_go(tiny_llama_dir, adapters):  # noqa: F811
    """``lora_metrics`` runs on the event loop while LoadAdapter / UnloadAdapter change the adapter
    table on the worker. Here two real threads do the same (the switch interval made tiny so
    that they interleave inside one metrics call); no call may fail."""
    ex = _tiny(tiny_llama_dir, max_adapters=2)
    for i in range(300):
        ex.load_adapter(f"keep{i}", str(adapters["a3"][0]))
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn():
        i = 0
        while not stop.is_set():
            ex.load_adapter(f"churn{i}", str(adapters["a3"][0]))
            ex.unload_adapter(f"churn{i}")
            i += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    t = threading.Thread(target=churn, daemon=True)
    t.start()
    calls = 0
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            try:
                m = ex.lora_metrics()
                assert m["adapter_count"] >= 300 and m["resident"] <= 2
            except RuntimeError as e:  # "dictionary changed size during iteration"
                errors.append(e)
                break
            calls += 1
    finally:
        stop.set()
        t.join(10)
        sys.setswitchinterval(old)
    assert not errors, f"lora_metrics failed after {calls} calls: {errors[0]!r}"
    assert calls > 10


def test_cli_flags_reach_the_server(tmp_path):
    """``--max-kv-event-subscribers-per-caller`` and ``--kv-event-replay-bytes`` on ``serve``."""
    from .support.servers import ServerProcess

    (tmp_path / "tokens").write_text("alice-secret\nbob-secret\n")
    with ServerProcess("--model", "configurable,id=mock,vocab_size=1000,token_sequence=10:20:30",
                       "--auth-token-file", str(tmp_path / "tokens"), "--max-kv-event-subscribers-per-caller", "1",
                       "--kv-event-replay-bytes", "4096") as srv, \
            Client(srv.target, token="alice-secret") as alice, Client(srv.target, token="bob-secret") as bob:
        for _ in range(40):  # ~260 estimated bytes per event: the oldest leave a 4 KiB replay buffer
            alice.release_cache("mock", alice.prefill("mock", [1, 2]).output.cache.cache_id)
        first = _opened(alice)
        try:
            assert first.messages[0].WhichOneof("message") == "resync_required"
            with pytest.raises(FerrumRpcError) as e:
                next(iter(alice.subscribe_kv_events(from_seq=1)))
            assert e.value.code == C.RESOURCE_EXHAUSTED and "limit per caller is 1" in e.value.message
            bob.release_cache("mock", bob.prefill("mock", [3]).output.cache.cache_id)
            second = _opened(bob)  # another caller is not held back by alice's
            second.stop()
        finally:
            first.stop()


def test_hub_owners_of_block_events_and_pending_caches(monkeypatch):
    """The hub on its own (a real asyncio loop, the llama.cpp executor's block index): stored blocks
    belong to the caller of the cache that stored them once it is adopted; a removed event is split
    per owner; cleared goes to everyone; a cache nobody adopts is shown to nobody."""
    import asyncio

    from ferrum_client.prefix_keys import chain_root
    from ferrum_service.hosting import kv_events
    from ferrum_service.executors.llama_cpp.prefix import SequencePrefixIndex

    monkeypatch.setattr(kv_events, "PENDING_OWNER_S", 0.2)

    async def drain(sub, n_max=20):
        out = []
        try:
            while len(out) < n_max:
                out.append(await asyncio.wait_for(sub.next(), 1.0))
        except asyncio.TimeoutError:
            pass
        return out

    async def scenario():
        hub = kv_events.KvEventHub(per_caller=True)
        idx = SequencePrefixIndex("m", enabled=True, wipe=lambda seq: None)
        idx.on_event = lambda kind, data: hub.publish_block(kind, "m", data)
        alice, _, _ = hub.subscribe("", None, blocks=True, caller="token:a")
        bob, _, _ = hub.subscribe("", None, blocks=True, caller="token:b")
        for cid, seq, base in (("c1", 1, 0), ("c2", 2, 100), ("c3", 3, 200)):
            hub.publish("created", "m", cid, 32)  # on the worker: nobody adopted it yet
            idx.start(seq, chain_root("m", ""), [])
            idx.commit(seq, list(range(base, base + 32)), cache_id=cid)
        hub.adopt("m", "c1", "token:a")
        hub.adopt("m", "c2", "token:b")  # c3: never (its step's caller went away)
        keys = {cid: list(idx.keys[seq]) for cid, seq in (("c1", 1), ("c2", 2), ("c3", 3))}
        hub.publish_block("removed", "m", {"block_hashes": keys["c1"] + keys["c2"] + keys["c3"]})
        hub.publish_block("cleared", "m", {})
        return await drain(alice), await drain(bob), keys, hub

    a_events, b_events, keys, hub = asyncio.run(scenario())

    def summary(events):
        return [(e.cache_id, e.kind) if not e.block_kind else (e.block_kind, tuple(e.block.get("block_hashes", ())))
                for e in events]

    assert summary(a_events) == [("c1", 1), ("stored", tuple(keys["c1"])), ("removed", tuple(keys["c1"])),
                                 ("cleared", ())]
    assert summary(b_events) == [("c2", 1), ("stored", tuple(keys["c2"])), ("removed", tuple(keys["c2"])),
                                 ("cleared", ())]
    assert all(not (e.block or {}).get("token_ids") for e in a_events + b_events)
    assert not hub._key_owner  # every indexed key's owner was forgotten with its key



def test_block_only_subscription_is_not_woken_for_cache_events():
    """A subscription for block events only (``cache_events=False``, the vLLM-protocol relay's)
    never gets the per-step cache events, and the hub does not even schedule a call on its loop
    for them (one wake-up of the event loop per decode step, for nothing); other subscribers
    still get every event, and a block event still reaches it."""
    import asyncio

    from ferrum_service.hosting import kv_events

    async def scenario():
        hub = kv_events.KvEventHub()
        blocks, _, _ = hub.subscribe("m", None, blocks=True, capped=False, cache_events=False)
        every, _, _ = hub.subscribe("m", None, blocks=True)
        other_model, _, _ = hub.subscribe("n", None, blocks=True)
        scheduled: list = []
        for sub in (blocks, every, other_model):  # what the hub hands each subscriber's loop
            sub._offer = lambda ev, sub=sub, real=sub._offer: (scheduled.append(sub), real(ev))[1]
        for k in range(50):  # from another thread, as the worker publishes them
            await asyncio.to_thread(hub.publish, "extended", "m", "c1", 10 + k)
        await asyncio.to_thread(hub.publish_block, "cleared", "m", {})
        got = {}
        for name, sub in (("blocks", blocks), ("every", every), ("other", other_model)):
            got[name] = []
            try:
                while True:
                    got[name].append(await asyncio.wait_for(sub.next(), 0.2))
            except asyncio.TimeoutError:
                pass
        return got, scheduled, (blocks, every, other_model)

    got, scheduled, (blocks, every, other_model) = asyncio.run(scenario())
    assert [e.block_kind for e in got["blocks"]] == ["cleared"]
    assert len(got["every"]) == 51 and got["every"][-1].block_kind == "cleared"
    assert got["other"] == []
    assert scheduled.count(blocks) == 1 and scheduled.count(every) == 51 and scheduled.count(other_model) == 0
