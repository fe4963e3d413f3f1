"""A Generate with many samples, a long prompt and wide n-gram speculation does not stall other
callers (audit M4).

The prompt's n-gram index is built once per request on a thread and shared by every sample's
drafter; before, each of the n samples built its own over the whole prompt on the event loop
(n = 64 x 8 n-gram sizes x the prompt). Real server on a loopback port, tiny random-weight Llama
with 8,192 positions; another caller's ``Loads`` is timed every 50 ms meanwhile.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest

from ferrum_client import Client, pb
from ferrum_service.core import speculation
from ferrum_service.executors.transformers import HfCausalLmExecutor
from ferrum_service.testing.tiny_models import build_tiny_llama

from .support.servers import InProcessServer
from .support.stalls import LoadsWatch

PROMPT_TOKENS = 8000
SAMPLES = 64


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    path = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-8k"), seed=0, max_position_embeddings=8192)
    ex = HfCausalLmExecutor.from_path(path, model_id="tiny", device="cpu", kv_budget_tokens=SAMPLES * 8200)
    with InProcessServer([ex]) as s:
        yield s


class LoopLag:
    """The longest the server's event loop went without running a 10 ms timer (its lag)."""

    def __init__(self, srv: InProcessServer) -> None:
        self.srv = srv
        self.worst = 0.0
        self._stop = threading.Event()

    async def _probe(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            t0 = loop.time()
            await asyncio.sleep(0.01)
            self.worst = max(self.worst, loop.time() - t0 - 0.01)

    def __enter__(self) -> "LoopLag":
        # The server shares this process with every test before it: a full collection of that
        # heap stops every thread (0.4-0.8 s seen in CI's run of the whole suite, 20 ms alone), which
        # is not the server holding its loop. Collect it now and keep it out of later collections
        # while the block runs; the longest collection inside it is reported (``gc_worst``).
        gc.collect()
        gc.freeze()
        self.gc_worst, self._gc_t0 = 0.0, 0.0
        gc.callbacks.append(self._gc)
        self._fut = asyncio.run_coroutine_threadsafe(self._probe(), self.srv.loop)
        return self

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_worst = max(self.gc_worst, time.perf_counter() - self._gc_t0)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        try:
            self._fut.result(10)
        finally:
            gc.callbacks.remove(self._gc)
            gc.unfreeze()


def test_many_samples_with_wide_ngrams_on_a_long_prompt_do_not_stall_loads(srv):
    prompt = [(i * 7919) % 500 + 5 for i in range(PROMPT_TOKENS)]
    req = pb.GenerateRequest(model_id="tiny", token_ids=pb.TokenIds(token_ids=prompt), n=SAMPLES,
                             stop=pb.StopConditions(max_tokens=3, ignore_eos=True),
                             speculation=pb.SpeculationOptions(min_ngram=1, max_ngram=8, max_draft_tokens=4))
    with Client(srv.target) as bob, Client(srv.target) as alice_client, LoadsWatch(alice_client) as alice, \
            LoopLag(srv) as lag:
        events = list(bob.stub.Generate(req, timeout=300))
    finished = [e.finished for e in events if e.WhichOneof("event") == "finished"]
    assert sorted(f.sample_index for f in finished) == list(range(SAMPLES))
    assert all(f.generated_tokens == 3 for f in finished)
    assert alice.calls > 0
    print(f"n={SAMPLES} x {PROMPT_TOKENS}-token prompt x n-grams 1..8: alice's slowest Loads "
          f"{alice.worst * 1000:.0f} ms over {alice.calls} calls, longest event-loop turn {lag.worst * 1000:.0f} ms "
          f"(longest garbage collection {lag.gc_worst * 1000:.0f} ms)")
    assert alice.worst < 1.0, f"another caller's Loads waited {alice.worst:.2f} s"
    # the documented bound is 1 s; the loop itself must not be held for a large part of it
    # (the 64 drafters built on the loop held it for 1.0-1.1 s on the busy 2-core test VM)
    assert lag.worst < 0.4, (f"the server's event loop was held for {lag.worst:.2f} s (longest garbage "
                             f"collection meanwhile {lag.gc_worst:.2f} s)")
    assert srv.live_caches() == {"tiny": 0}


def test_shared_prompt_index_drafts_as_one_drafter_over_the_whole_sequence():
    """Drafters sharing one prompt index propose what a drafter over the whole sequence proposes:
    their own output's n-grams first (they are later), then the prompt's; each keeps its own output."""
    cfg = speculation.SpeculationConfig(max_draft=4, min_ngram=1, max_ngram=3)
    prompt = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5]
    shared = speculation.PromptIndex(cfg, prompt)
    a, b = speculation.NgramDrafter(cfg, shared), speculation.NgramDrafter(cfg, shared)
    a.extend([3])  # "3": latest in the prompt before "7 8 5"; then it spans prompt and output
    assert a.propose(10) == [7, 8, 5, 3]
    b.extend([4, 5])  # "5" last occurred at the prompt's end, followed by b's own "4 5"
    assert b.propose(10) == [4, 5]
    a.extend([7, 8, 5])  # "7 8 5" recurs: its occurrence at the prompt's end is followed by output
    assert a.propose(10) == [3, 7, 8, 5]
    whole = speculation.NgramDrafter(cfg, prompt + [3, 7, 8, 5])
    assert whole.propose(10) == a.propose(10)
    assert len(a) == len(prompt) + 4 and len(b) == len(prompt) + 2
