"""SMG (the real gateway, ``smg`` 1.13 from its own venv) taking a wedged or a drained
ferrum-service worker out of its routing set.

Wedged: two tiny-Llama workers run in this process (so the test can wedge one: its executor's
``execute`` blocks until released, the event loop and the gRPC server stay up), behind SMG with
its cache-aware policy (the policy that subscribes to KV events). One request is sent to worker A
and its step wedges. With no load records, SMG judges A only by its own pile of requests (four
deep): with one request in flight A keeps its place. With records (``vllm_load.py``),
``engine_silence_ms`` passes SMG's wedge bound (``--worker-wedge-secs``, 3 s) and SMG marks A
stalled (``smg_worker_stalled{reason="wedged"}``): new requests go to B. Released, A steps again
and SMG routes to it again. The time from A's silence beginning (its last completed step, or
the stuck request's arrival on an idle A) to its exclusion is measured
(busy machine).

Drained: after ``MigrateStreams{drain}`` A's vLLM ``HealthCheck`` answers not healthy, SMG's
health probe takes it out and B answers everything."""

from __future__ import annotations

import random
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from ferrum_service.testing.smg_gateway import Gateway
from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.servers import InProcessServer
from .support.waits import wait_for
from .test_smg_gateway import venv  # noqa: F401 - fixture (skips when the gateway venv cannot be built)

pytestmark = pytest.mark.slow

WEDGE_SECS = 3  # SMG's --worker-wedge-secs default, passed explicitly
#: The bound on (exclusion - last step): the issue's target, SMG's staleness threshold (15 s) + 2 s.
#: Measured: 3.3 and 4.2 s on an idle 2-core machine, 8.1 s under CI's load (the wedge bound, one
#: heartbeat, SMG's own check and a starved gateway); a worker that pushed no load is never excluded.
EXCLUSION_BOUND_S = 15.0 + 2.0
#: Bound on SMG listing the model -> its /readiness 200: 1.0 s measured here (SMG's readiness
#: checkpoint), 19.0 s when the worker converted the tokenizer on SMG's first GetTokenizer.
TOKENIZER_REGISTERED_S = 6.0
#: Bound on SMG listing the model -> the first chat answered (the issue's target: < 1 s). Measured
#: 0.08-0.26 s quiet (three runs) and 0.2-0.5 s on a busy machine once the worker warms up at start;
#: 3.0-3.6 s before (its first forward on the just-converted F16 file). The bound leaves CI's load
#: room; a build sharing the two cores made it 5 s (llama.cpp's spinning threads lose most when a
#: core is taken).
FIRST_CHAT_S = 1.5


def _worker(path, **cfg):
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    return InProcessServer([HfCausalLmExecutor.from_path(path, model_id="tiny", device="cpu",
                                                         kv_budget_tokens=4096)], **cfg)


def _stalled(gw: Gateway, target: str) -> bool:
    """SMG's own verdict: its ``smg_worker_stalled`` gauge for the worker."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{gw.metrics_port}/metrics", timeout=5).read().decode()
    return any(line.startswith("smg_worker_stalled{") and f'worker="grpc://{target}"' in line
               and line.rstrip().endswith(" 1") for line in text.splitlines())


def _chat(gw: Gateway, content: str, max_tokens: int = 1, timeout: float = 60.0):
    return gw.post("/v1/chat/completions", {"model": "tiny", "max_tokens": max_tokens, "ignore_eos": True,
                                            "messages": [{"role": "user", "content": content}]}, timeout=timeout)


_WORDS = ("amber", "birch", "cobalt", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper",
          "kelp", "lagoon", "maple", "nectar", "onyx", "pewter", "quartz", "russet", "sable", "tundra")


def _distinct(tag: str, i: int) -> str:
    """A prompt that shares (almost) no prefix with any other of this test's prompts: below SMG's
    cache-match threshold (0.3) the cache-aware policy places it on the worker with the smaller
    tree, so warm-ups alternate between A and B instead of all following the first one's worker
    (prompts like "warm 0", "warm 1" match each other by > 90 % and all stuck to one worker)."""
    rng = random.Random(f"{tag} {i}")
    return f"{' '.join(rng.choice(_WORDS) for _ in range(12))} {tag} {i}"


def _healthy(gw: Gateway, target: str) -> bool | None:
    """SMG's ``/workers`` view of the worker's health (None: not listed)."""
    st, body = gw.get("/workers")
    assert st == 200, body
    return next((w["is_healthy"] for w in body["workers"] if w["url"] == f"grpc://{target}"), None)


def _served(srv: InProcessServer) -> int:
    """Tokens the worker has sent so far."""
    return srv.server.metrics.serving.totals("tiny")[1]


def _generations(srv: InProcessServer) -> int:
    return len(srv.server.streams.generations)


def _warm_up(gw: Gateway, w1: InProcessServer, w2: InProcessServer) -> tuple[InProcessServer, InProcessServer, list[str]]:
    """Warm-up chats through SMG: ``(A, B, prompts A served)``, A being the worker SMG sends a
    fresh prompt to. With nothing cached anywhere its event-driven policy picks the least-loaded
    worker, ties to the one it lists first -- which of two workers registered at once that is
    varies from run to run, so the test names A after the fact instead of hoping for one."""
    first = None
    served: list[str] = []
    for i in range(4):
        before = (_served(w1), _served(w2))
        prompt = _distinct("warm", i)
        assert _chat(gw, prompt)[0] == 200
        now = (_served(w1), _served(w2))
        on = w1 if now[0] > before[0] else w2 if now[1] > before[1] else None
        assert on is not None, "neither worker served the warm-up"
        first = first or on
        if on is first:
            served.append(prompt)
    return first, (w2 if first is w1 else w1), served


def test_a_wedged_worker_leaves_smg_routing_and_comes_back(venv, tiny_llama_dir):  # noqa: F811 - fixtures
    with _worker(tiny_llama_dir) as w1, _worker(tiny_llama_dir) as w2:
        gw = Gateway(venv, [w1.target, w2.target], policy="cache_aware",
                     extra=["--worker-wedge-secs", str(WEDGE_SECS)]).start("tiny")
        release = threading.Event()
        ex = real = None
        try:
            # warm-ups, noting those A served: the cache-aware tree routes them back to A later
            a, b, on_a = _warm_up(gw, w1, w2)
            ex = a.models.get("tiny").executor
            real = ex.execute
            # One request that lands on A, whose step then never completes until released: a
            # prompt A holds the blocks of (SMG scores that overlap first; a fresh prompt would
            # go to whichever worker its min-load tie-break lists first)
            ex.execute = lambda plan: (release.wait(120), real(plan))[1]
            pool = ThreadPoolExecutor(4)
            stuck = []
            stuck_prompt = ""
            time.sleep(0.5)  # A's block events reach SMG
            for i in range(8):
                before = _generations(a)
                stuck_prompt = on_a[i % len(on_a)]
                stuck.append(pool.submit(_chat, gw, stuck_prompt, 4, 180))
                landed = wait_for(lambda: (_generations(a), _generations(b)), lambda g: sum(g) > 0, 5, 0.02)
                if _generations(a) > before:
                    break
                stuck.pop().result(30)  # it went to B and finished; try again
            assert _generations(a) == 1, ("no request landed on A", landed)
            # A's silence began at its last completed step or, if it sat idle before the stuck
            # request, when that request queued work (what engine_silence_ms counts from)
            progress = a.models.get("tiny").progress
            last_step = max(progress.last_done, progress.busy_since or 0.0)  # monotonic, this process
            assert not _stalled(gw, a.target)
            # SMG's verdict, with one request in flight on A (no pile for its own rule)
            t_excluded = wait_for(lambda: time.monotonic() if _stalled(gw, a.target) else None,
                                  lambda t: t is not None, 20, 0.05)
            assert t_excluded is not None, f"SMG never marked the wedged worker stalled; {gw.log_tail()}"
            took = t_excluded - last_step
            print(f"\nsilence began -> SMG exclusion: {took:.2f} s (wedge bound {WEDGE_SECS} s; busy machine)")
            assert took <= EXCLUSION_BOUND_S, took
            assert _generations(a) == 1  # A still holds only the stuck request
            # excluded: new requests (the same prompt included, which the cache-aware tree knows
            # on A) go to B and finish
            for i in range(4):
                st, body = _chat(gw, stuck_prompt if i == 0 else _distinct("while A is wedged", 40 + i))
                assert st == 200, body
            assert _generations(a) == 1
            release.set()
            assert stuck[-1].result(60)[0] == 200
            assert wait_for(lambda: _stalled(gw, a.target), lambda s: not s, 20, 0.1) is False
            # back in the routing set: A's own prompts (the cache-aware tree's matches on A, which B
            # never served) reach A again; fresh prompts may go either way
            served_a = 0
            for i in range(12):
                before = _served(a)
                prompt = on_a[i % len(on_a)] if i % 2 == 0 else _distinct("after release", 60 + i)
                assert _chat(gw, prompt)[0] == 200
                served_a += _served(a) > before
            assert served_a > 0, "A never served again after it came back"
        finally:
            release.set()
            if ex is not None:
                ex.execute = real
            gw.stop()


def test_a_drained_worker_leaves_smg_routing(venv, tiny_llama_dir):  # noqa: F811 - fixtures
    """``MigrateStreams{drain}`` on A: its vLLM ``HealthCheck`` answers not healthy, SMG's health
    check takes A out (``/workers`` is_healthy false) and every request goes to B, answered. SMG
    probes every ``--health-check-interval-secs`` (60 s by default; 1 s here)."""
    with _worker(tiny_llama_dir, open_admin_rpcs=True, kv_peers=["127.0.0.1:9"]) as a, \
            _worker(tiny_llama_dir) as b:
        gw = Gateway(venv, [a.target, b.target], policy="round_robin",
                     extra=["--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                            "--health-success-threshold", "1"]).start("tiny")
        try:
            served = [_served(a), _served(b)]
            for i in range(4):
                assert _chat(gw, f"before {i}")[0] == 200
            assert _served(a) > served[0] and _served(b) > served[1]  # both in the routing set
            from ferrum_client import Client, pb

            with Client(a.target) as c:
                t0 = time.monotonic()
                c.stub.MigrateStreams(pb.MigrateStreamsRequest(target="127.0.0.1:9", drain=True), timeout=30)
            assert wait_for(lambda: _healthy(gw, a.target), lambda h: h is False, 20, 0.1) is False, gw.log_tail()
            print(f"\ndrain -> SMG marks the worker unhealthy: {time.monotonic() - t0:.2f} s (probe every 1 s)")
            before_a = _served(a)
            for i in range(8):
                st, body = _chat(gw, f"after the drain {i}")
                assert st == 200, body
            assert _served(a) == before_a  # nothing more reached A
        finally:
            gw.stop()


def test_smg_registers_the_tokenizer_as_soon_as_it_lists_the_model(venv, tmp_path):  # noqa: F811 - fixture
    """A llama.cpp SmolLM2 worker on a fresh model cache: its tokenizer bundle (converted from the
    GGUF by transformers, 4-15 s here) is built and its model warmed up while the worker starts,
    so a chat sent the moment SMG lists the model is answered within a second (SMG registers the
    tokenizer ~0.2 s after listing, then the worker's first forward), where it waited 19 s when
    the bundle was built on SMG's first GetTokenizer and 3 s when the first forward faulted in
    the just-converted F16 weights."""
    from .support.packaged import smollm2_gguf
    from .support.servers import ServerProcess

    smollm2_gguf(llama_cpp=True)  # skips without the model package or llama_cpp
    w = ServerProcess("--model", "smollm2", env={"FERRUM_MODEL_CACHE": str(tmp_path)}, ready_timeout=300)
    w.start()
    gw = Gateway(venv, [w.target]).launch()
    try:
        def listed():
            try:
                st, body = gw.get("/v1/models", timeout=5)
            except OSError:
                return False
            return st == 200 and any(m["id"] == "smollm2" for m in body.get("data", []))

        assert wait_for(listed, bool, 120, 0.05), gw.log_tail()
        t_listed = time.monotonic()
        # chats from the moment the model is listed: SMG answers 503 "tokenizer not yet registered"
        # until its GetTokenizer returned (~0.2 s of SMG's own work), then the worker's first forward
        answered = wait_for(lambda: _first_chat(gw), lambda st: st == 200, 60, 0.02)
        t_chat = time.monotonic()
        # SMG's /readiness follows its tokenizer registry on a ~1 s checkpoint
        ready = wait_for(lambda: _status(gw, "/readiness"), lambda st: st == 200, 60, 0.02)
        t_ready = time.monotonic()
        print(f"\nSMG lists the model -> first chat answered: {t_chat - t_listed:.2f} s, /readiness 200: "
              f"{t_ready - t_listed:.2f} s")
        assert answered == 200 and t_chat - t_listed < FIRST_CHAT_S, (answered, t_chat - t_listed, w.log())
        assert ready == 200 and t_ready - t_listed < TOKENIZER_REGISTERED_S, (ready, t_ready - t_listed)
        assert list(tmp_path.glob("tokenizer-bundles/*.tokenizer.zip"))  # kept for the next start
    finally:
        gw.stop()
        w.stop()


def _status(gw: Gateway, path: str) -> int:
    try:
        return gw.get(path, timeout=5)[0]
    except OSError:
        return 0


def _first_chat(gw: Gateway) -> int:
    try:
        return gw.post("/v1/chat/completions", {"model": "smollm2", "max_tokens": 1, "temperature": 0,
                                                "messages": [{"role": "user", "content": "hi"}]}, timeout=30)[0]
    except OSError:
        return 0
