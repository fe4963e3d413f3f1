"""A router's copy of which prefix-cache blocks a replica holds, kept from its block events.

A ferrum-service replica with automatic prefix caching publishes, on ``SubscribeKvEvents`` with
``include_block_events``, one ``KvBlockEvent`` per change of its prefix cache:

* ``stored``: full blocks entered the cache (their 32-byte keys, in chain order) -> add the keys;
* ``removed``: blocks left it (evicted, or overwritten after a truncation) -> delete the keys;
* ``cleared``: every block of the model left it (the model shut down) -> empty the model's set.

:class:`PrefixMirror` applies those events to one set of keys per model. A router computes a new
prompt's block keys with :func:`ferrum_client.prefix_keys.block_keys` (block size and seed from the
replica's ``ModelInfo.prefix_cache``) and asks :meth:`PrefixMirror.cached_blocks` how many of the
leading ones the replica holds. :class:`BlockEventFollower` keeps a mirror current from a live
replica on a background thread: it replays the replica's event buffer from its start, follows live
events, and, whenever the stream breaks or the server says ``ResyncRequired``, empties the mirror
and starts over (the mirror may then under-report what the replica holds until new ``stored``
events arrive; it never reports a block the replica was not seen to store).

The mirror is a routing hint, never a correctness matter: a replica that no longer holds a block
the mirror lists simply computes it again.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterable, Sequence

from . import prefix_keys
from ._proto.ferrum.executor.v1 import executor_pb2 as pb
from ._proto.ferrum.executor.v1 import types_pb2 as tpb

__all__ = ["PrefixMirror", "BlockEventFollower", "recipe_usable"]


# Recipes this client computes: the current one (model_id, cache_salt, adapter), and the one a
# server from before LoRA adapters advertises (model_id, cache_salt), whose keys are the same for
# base-model sequences (an empty adapter adds nothing to the root).
_PRE_ADAPTER_KEYS = ("model_id", "cache_salt")
_KNOWN_EXTRA_KEYS = ((), _PRE_ADAPTER_KEYS, prefix_keys.EXTRA_KEYS)


def recipe_usable(recipe: tpb.PrefixCacheRecipe | None, adapter: str = "") -> bool:
    """True when a model's advertised recipe is one this client computes (and caching is on) for
    a sequence computed with LoRA ``adapter`` ("" = the base model): a recipe without the
    ``adapter`` key keys base-model sequences only."""
    if not (recipe is not None and recipe.enabled and recipe.block_size > 0
            and recipe.algorithm == prefix_keys.ALGORITHM and tuple(recipe.extra_keys) in _KNOWN_EXTRA_KEYS):
        return False
    return not adapter or "adapter" in recipe.extra_keys


class PrefixMirror:
    """The prefix-cache block keys one replica holds, per model, from its ``KvBlockEvent`` s.

    Thread-safe: a :class:`BlockEventFollower` applies events on its thread while a router reads.
    ``recipes`` holds the replica's ``PrefixCacheRecipe`` per model (from ``Info``), which
    :meth:`prompt_keys` uses to key a prompt the way that replica does.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: dict[str, set[bytes]] = {}
        self.recipes: dict[str, tpb.PrefixCacheRecipe] = {}
        self.last_seq = 0
        self.resyncs = 0
        self.events_applied = 0

    # ---- applying events ---------------------------------------------------------------------
    def apply(self, message: pb.SubscribeKvEventsResponse | pb.KvBlockEvent) -> bool:
        """Apply one stream message (cache events are ignored, ``resync_required`` empties the
        mirror). Returns True when the mirror changed or was resynchronised."""
        if isinstance(message, pb.SubscribeKvEventsResponse):
            which = message.WhichOneof("message")
            if which == "resync_required":
                self.clear()
                with self._lock:
                    self.resyncs += 1
                return True
            if which == "event":
                with self._lock:
                    self.last_seq = max(self.last_seq, message.event.seq)
                return False
            if which != "block_event":
                return False
            message = message.block_event
        ev = message
        which = ev.WhichOneof("data")
        with self._lock:
            self.last_seq = max(self.last_seq, ev.seq)
            self.events_applied += 1
            if which == "stored":
                self._blocks.setdefault(ev.model_id, set()).update(ev.stored.block_hashes)
            elif which == "removed":
                blocks = self._blocks.get(ev.model_id)
                if blocks:
                    blocks.difference_update(ev.removed.block_hashes)
            elif which == "cleared":
                self._blocks.pop(ev.model_id, None)
            else:
                return False
        return True

    def apply_all(self, messages: Iterable) -> None:
        for msg in messages:
            self.apply(msg)

    def clear(self, model_id: str | None = None) -> None:
        """Forget every block (of ``model_id`` only, when given)."""
        with self._lock:
            if model_id is None:
                self._blocks.clear()
                self.last_seq = 0
            else:
                self._blocks.pop(model_id, None)

    # ---- reading -------------------------------------------------------------------------------
    def keys(self, model_id: str) -> set[bytes]:
        """A copy of the keys held for ``model_id``."""
        with self._lock:
            return set(self._blocks.get(model_id, ()))

    def __len__(self) -> int:
        with self._lock:
            return sum(len(b) for b in self._blocks.values())

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return any(key in b for b in self._blocks.values())

    def cached_blocks(self, model_id: str, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` (a prompt's block keys in chain order) this replica holds."""
        with self._lock:
            return prefix_keys.longest_cached_prefix(keys, self._blocks.get(model_id, ()))

    def prompt_keys(self, model_id: str, tokens: Sequence[int], cache_salt: str = "",
                    adapter: str = "") -> list[bytes]:
        """The block keys of ``tokens`` (computed with LoRA ``adapter``, "" = the base model)
        under this replica's recipe for ``model_id`` ([] when the replica advertises no usable
        recipe for it)."""
        recipe = self.recipes.get(model_id)
        if not recipe_usable(recipe, adapter):
            return []
        return prefix_keys.block_keys(tokens, recipe.block_size, model_id=model_id, cache_salt=cache_salt,
                                      seed=recipe.seed or prefix_keys.SEED, adapter=adapter)

    def cached_tokens(self, model_id: str, tokens: Sequence[int], cache_salt: str = "", adapter: str = "") -> int:
        """Leading tokens of ``tokens`` whose blocks this replica holds (a multiple of its block size)."""
        keys = self.prompt_keys(model_id, tokens, cache_salt, adapter)
        if not keys:
            return 0
        return self.cached_blocks(model_id, keys) * self.recipes[model_id].block_size

    def set_recipes(self, info: pb.InfoResponse) -> None:
        """Take each model's ``prefix_cache`` recipe from an ``Info`` response."""
        recipes = {m.model_id: m.prefix_cache for m in info.models if m.HasField("prefix_cache")}
        with self._lock:
            self.recipes = recipes


class BlockEventFollower:
    """Keeps a :class:`PrefixMirror` current from one replica, on a daemon thread.

    ``client`` is a :class:`ferrum_client.Client` for the replica. Each connection: ``Info`` (the
    recipes), then ``SubscribeKvEvents(include_block_events=True, from_seq=1)`` — the replica's
    whole event history, then live events. When seq 1 has left the replay buffer (the answer is
    ``ResyncRequired``), it reconnects at once from the buffer's oldest event: the blocks stored
    since then are known, older ones are not (the mirror under-reports, never over-reports). When
    the stream ends or fails, or a ``ResyncRequired`` comes later, the mirror is emptied and (after
    ``retry_s``) the follower connects again from seq 1.
    ``on_error(exc)`` is told of each failure. ``stop()`` ends the thread.
    """

    def __init__(self, client, mirror: PrefixMirror | None = None, *, model_id: str = "", retry_s: float = 0.5,
                 on_error: Callable[[BaseException], None] | None = None, name: str = "") -> None:
        self.client = client
        self.mirror = mirror if mirror is not None else PrefixMirror()
        self.model_id = model_id
        self.retry_s = retry_s
        self.on_error = on_error
        self.connected = threading.Event()  # set while a stream is open
        self.connections = 0
        self._stop = threading.Event()
        self._stream = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"block-events-{name or id(self)}", daemon=True)

    def start(self) -> "BlockEventFollower":
        self._thread.start()
        return self

    def _run(self) -> None:
        from_seq = 1
        while not self._stop.is_set():
            window = None
            try:
                self.mirror.set_recipes(self.client.info(timeout=5.0))
                stream = self.client.subscribe_kv_events(self.model_id, from_seq=from_seq, include_block_events=True)
                with self._lock:
                    if self._stop.is_set():
                        stream.cancel()
                        return
                    self._stream = stream
                self.mirror.clear()
                self.connections += 1
                self.connected.set()
                first = True
                for msg in stream:
                    self.mirror.apply(msg)
                    if first and from_seq == 1 and msg.WhichOneof("message") == "resync_required":
                        # seq 1 has left the replay buffer: replay what it still holds instead
                        # (stored keys from that window are still valid; older ones stay unknown)
                        window = msg.resync_required.oldest_available_seq
                        stream.cancel()
                        break
                    first = False
            except Exception as e:  # noqa: BLE001 - any failure: start over from an empty mirror
                if self._stop.is_set():
                    return
                if self.on_error is not None and window is None:
                    self.on_error(e)
            finally:
                self.connected.clear()
                with self._lock:
                    self._stream = None
            if self._stop.is_set():
                return
            self.mirror.clear()
            if window is not None:
                from_seq = window  # reconnect at once, from the oldest event the buffer holds
                continue
            from_seq = 1
            self._stop.wait(self.retry_s)

    def wait_connected(self, timeout: float = 10.0) -> bool:
        """Wait until the event stream is open (True) or ``timeout`` passes (False)."""
        return self.connected.wait(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        with self._lock:
            if self._stream is not None:
                self._stream.cancel()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, poll_s: float = 0.02) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout`` passes (False); for tests and tools
    that need the mirror to catch up with a step they just made."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
