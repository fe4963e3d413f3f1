"""The client's prefix-cache mirror (``ferrum_client.prefix_mirror``) and the prefix-aware routing
rule of ``StickyRouter``, fed with real contract messages.

* ``PrefixMirror`` applies ``KvBlockEvent`` s (stored adds, removed deletes, cleared empties one
  model; ``ResyncRequired`` empties everything) and answers "how many leading blocks of this prompt
  does the replica hold" with keys from ``ferrum_client.prefix_keys``.
* ``BlockEventFollower`` against a scripted replica on a real port (a ``ModelExecutor`` servicer
  that serves ``Info`` and a fixed ``SubscribeKvEvents`` script per connection): a broken stream
  and a ``ResyncRequired`` both start the mirror over.
* ``StickyRouter(prefix_aware=True)`` over two real servers: the longest cached prefix wins, ties go
  to the fewest sessions, salts and recipes are honoured.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from concurrent import futures

import grpc
import pytest

from ferrum_client import Client, pb, tpb
from ferrum_client import prefix_keys as pk
from ferrum_client._proto.ferrum.executor.v1 import executor_pb2_grpc
from ferrum_client.prefix_mirror import BlockEventFollower, PrefixMirror, recipe_usable, wait_until
from ferrum_client.routing import StickyRouter

from .conftest import contract_executors
from .support.servers import InProcessServer

pytestmark = pytest.mark.timeout(120)

BS = 4
MODEL = "mock"


def recipe(block_size: int = BS, enabled: bool = True, **kw) -> tpb.PrefixCacheRecipe:
    fields = dict(enabled=enabled, algorithm=pk.ALGORITHM, block_size=block_size, seed=pk.SEED,
                  extra_keys=list(pk.EXTRA_KEYS))
    fields.update(kw)
    return tpb.PrefixCacheRecipe(**fields)


def stored(seq: int, tokens, *, model: str = MODEL, salt: str = "", parent: bytes | None = None,
           bs: int = BS) -> pb.SubscribeKvEventsResponse:
    """The ``stored`` event a replica sends for the full blocks of ``tokens`` (continuing ``parent``)."""
    keys = pk.block_keys(tokens, bs, model_id=model, cache_salt=salt, parent=parent)
    root = parent if parent is not None else pk.chain_root(model, salt)
    return pb.SubscribeKvEventsResponse(block_event=pb.KvBlockEvent(
        seq=seq, model_id=model, time_unix_ns=time.time_ns(),
        stored=pb.KvBlockStored(block_hashes=keys, parent_block_hash=root,
                                token_ids=list(tokens[:len(keys) * bs]), block_size=bs)))


def removed(seq: int, keys, model: str = MODEL) -> pb.SubscribeKvEventsResponse:
    return pb.SubscribeKvEventsResponse(block_event=pb.KvBlockEvent(
        seq=seq, model_id=model, removed=pb.KvBlockRemoved(block_hashes=list(keys))))


def cleared(seq: int, model: str = MODEL) -> pb.SubscribeKvEventsResponse:
    return pb.SubscribeKvEventsResponse(block_event=pb.KvBlockEvent(seq=seq, model_id=model,
                                                                   cleared=pb.KvBlocksCleared()))


def cache_event(seq: int) -> pb.SubscribeKvEventsResponse:
    return pb.SubscribeKvEventsResponse(event=pb.KvEvent(seq=seq, kind=pb.KV_EVENT_KIND_CREATED, model_id=MODEL,
                                                         cache_id="c1", num_tokens=9))


def resync() -> pb.SubscribeKvEventsResponse:
    return pb.SubscribeKvEventsResponse(resync_required=pb.ResyncRequired(requested_seq=1, oldest_available_seq=50,
                                                                          next_seq=60))


PROMPT = list(range(100, 114))  # 14 tokens: 3 full blocks of 4 and 2 tokens over


# ---- the mirror ---------------------------------------------------------------------------------
def test_mirror_applies_stored_removed_cleared_and_resync():
    mir = PrefixMirror()
    mir.recipes[MODEL] = recipe()
    keys = pk.block_keys(PROMPT, BS, model_id=MODEL)
    assert len(keys) == 3
    assert mir.cached_tokens(MODEL, PROMPT) == 0

    # a cache event moves the sequence number only
    assert not mir.apply(cache_event(1)) and mir.last_seq == 1 and len(mir) == 0
    # two blocks stored, then the third as a continuation of the chain
    assert mir.apply(stored(2, PROMPT[:8]))
    assert mir.keys(MODEL) == set(keys[:2]) and mir.cached_tokens(MODEL, PROMPT) == 8
    mir.apply(stored(3, PROMPT[8:12], parent=keys[1]))
    assert mir.cached_tokens(MODEL, PROMPT) == 12 and mir.cached_blocks(MODEL, keys) == 3
    # a prompt that diverges inside block 1 matches block 0 only
    other = PROMPT[:5] + [7] + PROMPT[6:]
    assert mir.cached_tokens(MODEL, other) == 4
    # removing the middle block cuts the chain there, whatever follows it
    mir.apply(removed(4, [keys[1]]))
    assert mir.cached_tokens(MODEL, PROMPT) == 4 and keys[2] in mir
    # another model's blocks, and its cleared event, leave this model alone
    mir.apply(stored(5, PROMPT, model="other"))
    assert len(mir.keys("other")) == 3
    mir.apply(cleared(6, model="other"))
    assert mir.keys("other") == set() and mir.keys(MODEL) == {keys[0], keys[2]}
    assert mir.last_seq == 6 and mir.events_applied == 5
    # removing keys never stored is harmless; cleared empties the model
    mir.apply(removed(7, [b"\0" * 32]))
    mir.apply(cleared(8))
    assert len(mir) == 0
    # ResyncRequired: the mirror starts over
    mir.apply(stored(9, PROMPT))
    assert mir.apply(resync()) and len(mir) == 0 and mir.resyncs == 1 and mir.last_seq == 0
    # a bare KvBlockEvent is accepted too
    mir.apply(stored(10, PROMPT).block_event)
    assert mir.cached_tokens(MODEL, PROMPT) == 12


def test_mirror_keys_follow_the_salt_and_the_advertised_recipe():
    mir = PrefixMirror()
    mir.recipes[MODEL] = recipe()
    mir.apply(stored(1, PROMPT, salt="tenant-a"))
    assert mir.cached_tokens(MODEL, PROMPT, cache_salt="tenant-a") == 12
    assert mir.cached_tokens(MODEL, PROMPT) == 0  # the shared space has a different root
    assert mir.cached_tokens(MODEL, PROMPT, cache_salt="tenant-b") == 0
    # a model without a usable recipe is never matched
    for bad in (recipe(enabled=False), recipe(algorithm="sha1-chain"), recipe(block_size=0),
                recipe(extra_keys=["model_id", "cache_salt", "lora"])):
        assert not recipe_usable(bad)
        mir.recipes[MODEL] = bad
        assert mir.cached_tokens(MODEL, PROMPT, cache_salt="tenant-a") == 0
    assert not recipe_usable(None) and recipe_usable(recipe())
    # a different block size keys different blocks
    mir.recipes[MODEL] = recipe(block_size=2)
    assert mir.cached_tokens(MODEL, PROMPT, cache_salt="tenant-a") == 0


def test_mirror_takes_recipes_from_an_info_response():
    info = pb.InfoResponse(models=[tpb.ModelInfo(model_id=MODEL, prefix_cache=recipe(16)),
                                   tpb.ModelInfo(model_id="emb")])
    mir = PrefixMirror()
    mir.set_recipes(info)
    assert set(mir.recipes) == {MODEL} and mir.recipes[MODEL].block_size == 16


def test_prefix_keys_worked_example_is_stable():
    """The worked example of docs/contract.md ("Prefix caching"): keep the two in step."""
    root = pk.chain_root("smollm2", "")
    assert root == hashlib.sha256(b"ferrum-prefix-v1\0smollm2\0").digest()
    assert root.hex() == "42f0d7cf020f325f572088850dcb15f8086fc9cbc6166a08be27b2f4f30436b8"
    keys = pk.block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, model_id="smollm2")  # token 9: a partial block, no key
    assert [k.hex() for k in keys] == ["6ca1cad3a871b386fed1e475e5704a24c428fdeb58c35ff9a81a66fcf3fa3b41",
                                       "861f5665b136067cc488ff5e261f6c3c42623694612bb91a241609a2d663aff3"]
    assert keys[0] == hashlib.sha256(root + struct.pack("<4I", 1, 2, 3, 4)).digest()
    assert keys[1] == hashlib.sha256(keys[0] + struct.pack("<4I", 5, 6, 7, 8)).digest()
    salted = pk.block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, model_id="smollm2", cache_salt="tenant-a")
    assert salted[0].hex() == "2e9a24adfecc331a0d589fd35f2da790a94658fe1b89d5bc1d6f42c40bc39143"


# ---- the follower, against a scripted replica ---------------------------------------------------
class ScriptedReplica(executor_pb2_grpc.ModelExecutorServicer):
    """A ``ModelExecutor`` on a real port serving ``Info`` (one model with a recipe) and, per
    ``SubscribeKvEvents`` connection, the next script: messages to send, then ``"break"`` (the
    stream fails UNAVAILABLE) or ``"hold"`` (it stays open until the client leaves)."""

    def __init__(self, scripts) -> None:
        self.scripts = list(scripts)
        self.requests: list[pb.SubscribeKvEventsRequest] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        executor_pb2_grpc.add_ModelExecutorServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    def Info(self, request, context):
        return pb.InfoResponse(models=[tpb.ModelInfo(model_id=MODEL, prefix_cache=recipe())])

    def SubscribeKvEvents(self, request, context):
        self.requests.append(request)
        script = self.scripts.pop(0) if self.scripts else ["hold"]
        for item in script:
            if item == "break":
                context.abort(grpc.StatusCode.UNAVAILABLE, "scripted break")
            elif item == "hold":
                while context.is_active():
                    time.sleep(0.02)
                return
            else:
                yield item

    def __enter__(self):
        self.server.start()
        return self

    def __exit__(self, *exc):
        self.server.stop(0)


def test_follower_replays_from_the_start_and_starts_over_on_a_break_and_on_resync():
    keys = pk.block_keys(PROMPT, BS, model_id=MODEL)
    scripts = [
        [stored(1, PROMPT), "break"],                       # connection 1: 3 blocks, then the stream fails
        [stored(1, PROMPT[:4]), "hold"],                    # connection 2: replays block 0 only
    ]
    errors: list[BaseException] = []
    with ScriptedReplica(scripts) as rep, Client(f"127.0.0.1:{rep.port}") as c:
        f = BlockEventFollower(c, retry_s=0.05, on_error=errors.append).start()
        try:
            assert wait_until(lambda: f.connections == 2 and f.mirror.events_applied >= 2)
            assert wait_until(lambda: f.mirror.keys(MODEL) == {keys[0]})  # block 1-2 of the broken stream are gone
            assert f.mirror.recipes[MODEL].block_size == BS
            assert [e.code for e in errors] == [grpc.StatusCode.UNAVAILABLE]
            assert all(r.include_block_events and r.HasField("from_seq") and r.from_seq == 1 for r in rep.requests)
        finally:
            f.stop()
        assert not f._thread.is_alive()

    scripts = [[stored(1, PROMPT), resync(), stored(61, PROMPT[:8]), "hold"]]
    with ScriptedReplica(scripts) as rep, Client(f"127.0.0.1:{rep.port}") as c:
        f = BlockEventFollower(c, retry_s=0.05).start()
        try:
            assert wait_until(lambda: f.mirror.resyncs == 1 and f.mirror.last_seq == 61)
            assert f.mirror.keys(MODEL) == set(keys[:2]) and f.connections == 1
        finally:
            f.stop()


def test_follower_replays_the_buffer_window_when_seq_1_is_gone():
    keys = pk.block_keys(PROMPT, BS, model_id=MODEL)
    scripts = [[resync(), "hold"], [stored(51, PROMPT[:8]), removed(52, keys[:1]), "hold"]]
    errors: list = []
    with ScriptedReplica(scripts) as rep, Client(f"127.0.0.1:{rep.port}") as c:
        f = BlockEventFollower(c, retry_s=5.0, on_error=errors.append).start()  # no retry delay expected
        try:
            assert wait_until(lambda: f.mirror.last_seq == 52, timeout=4)
            assert f.mirror.keys(MODEL) == {keys[1]} and f.connections == 2 and not errors
            assert [r.from_seq for r in rep.requests] == [1, 50]
        finally:
            f.stop()


def test_follower_survives_a_replica_that_is_down_and_comes_up():
    from ferrum_service.testing.server_process import free_port

    port = free_port()
    with Client(f"127.0.0.1:{port}", timeout=1.0) as c:
        errors: list = []
        f = BlockEventFollower(c, retry_s=0.1, on_error=errors.append).start()
        try:
            assert wait_until(lambda: len(errors) >= 1)  # nothing listens yet
            assert not f.connected.is_set()
            rep = ScriptedReplica([[stored(1, PROMPT), "hold"]])
            rep.server.add_insecure_port(f"127.0.0.1:{port}")
            with rep:
                assert wait_until(lambda: f.mirror.cached_tokens(MODEL, PROMPT) == 12, timeout=20)
        finally:
            f.stop()


# ---- the routing rule over two real servers -----------------------------------------------------
@pytest.fixture
def two_servers():
    with InProcessServer(contract_executors()) as a, InProcessServer(contract_executors()) as b:
        yield a, b


def _feed(router: StickyRouter, target: str, *msgs) -> None:
    r = next(x for x in router.replicas() if x.target == target)
    r.mirror.recipes[MODEL] = recipe()
    for msg in msgs:
        r.mirror.apply(msg)


def test_prefix_aware_router_picks_the_longest_cached_prefix_then_the_fewest_sessions(two_servers):
    a, b = (s.target for s in two_servers)
    with StickyRouter([a, b], prefix_aware=True, step_timeout=5.0) as router:
        assert router.wait_following(10)
        # the contract executors advertise no recipe: every prompt is cold, plain least-sessions rule
        assert router.prefix_matches(PROMPT, MODEL) == {a: 0, b: 0}
        s1 = router.new_session(prompt_tokens=PROMPT, model_id=MODEL)
        s2 = router.new_session(prompt_tokens=PROMPT, model_id=MODEL)
        assert {s1.target, s2.target} == {a, b} and s1.expected_cached_tokens == 0
        s1.close(), s2.close()

        # A holds 1 block of the prompt, B holds 3: B wins even with more sessions
        _feed(router, a, stored(1, PROMPT[:4]))
        _feed(router, b, stored(1, PROMPT))
        busy = [router.new_session() for _ in range(2)]
        assert sorted(x.target for x in busy) == sorted([a, b])
        busy.append(router.new_session())  # 3 sessions: one replica has two
        assert router.prefix_matches(PROMPT, MODEL) == {a: 4, b: 12}
        for _ in range(3):
            with router.new_session(prompt_tokens=PROMPT, model_id=MODEL) as s:
                assert s.target == b and s.expected_cached_tokens == 12
            rb = next(r for r in router.replicas() if r.target == b)
            assert router.any_client(prompt_tokens=PROMPT, model_id=MODEL) is rb.client  # for a Generate, say
        # another tenant's salt matches nothing: fewest sessions decides
        least = min((a, b), key=lambda t: len(next(r for r in router.replicas() if r.target == t).sessions))
        with router.new_session(prompt_tokens=PROMPT, model_id=MODEL, cache_salt="tenant-x") as s:
            assert s.target == least and s.expected_cached_tokens == 0
        # a prompt sharing only block 0 ties between A and B: fewest sessions decides
        other = PROMPT[:4] + [1] * 8
        assert router.prefix_matches(other, MODEL) == {a: 4, b: 4}
        with router.new_session(prompt_tokens=other, model_id=MODEL) as s:
            assert s.target == least and s.expected_cached_tokens == 4
        # B evicts blocks 1-2: now the replicas tie on the prompt
        kb = pk.block_keys(PROMPT, BS, model_id=MODEL)
        _feed(router, b, removed(2, kb[1:]))
        assert router.prefix_matches(PROMPT, MODEL) == {a: 4, b: 4}
        # a draining or lost replica is never chosen, whatever it holds
        _feed(router, b, stored(3, PROMPT))
        next(r for r in router.replicas() if r.target == b).draining = True
        with router.new_session(prompt_tokens=PROMPT, model_id=MODEL) as s:
            assert s.target == a
        next(r for r in router.replicas() if r.target == b).draining = False
        router.mark_down(b, "test")
        with router.new_session(prompt_tokens=PROMPT, model_id=MODEL) as s:
            assert s.target == a
        assert next(r for r in router.replicas() if r.target == b).mirror.keys(MODEL) == set()
        for x in busy:
            x.close()


def test_router_without_prefix_mode_starts_no_followers(two_servers):
    a, b = (s.target for s in two_servers)
    with StickyRouter([a, b]) as router:
        assert all(r.follower is None and r.mirror is None for r in router.replicas())
        s = router.new_session(prompt_tokens=PROMPT, model_id=MODEL)  # accepted, ignored
        assert s.expected_cached_tokens == 0
        s.close()
    live = [t for t in threading.enumerate() if t.name.startswith("block-events-")]
    assert not live
