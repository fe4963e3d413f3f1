"""Load: 64 concurrent sessions against a server process for a bounded time, half on ``Session``
streams and half on unary RPCs, each looping prefill -> decode x2 -> forward_verify -> truncate ->
decode -> release on a scripted model and on the tiny real Llama. Zero unexpected errors; every
cache is released at the end (each model's Status reports 0 active caches); p50/p99 latency per
operation is printed and written to ``benchmarks/results/tmp/load.json``.

``FERRUM_LOAD_SECONDS`` (default 12) and ``FERRUM_LOAD_SESSIONS`` (default 64) scale it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import defaultdict

import grpc

from ferrum_client import AsyncClient, Client, FerrumRpcError, messages as m, pb

from .conftest_models import tiny_llama_dir  # noqa: F401
from .support.servers import REPO, ServerProcess

SECONDS = float(os.environ.get("FERRUM_LOAD_SECONDS", "12"))
SESSIONS = int(os.environ.get("FERRUM_LOAD_SESSIONS", "64"))
MODELS = {"mock": 1000, "tiny": 512}


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] * 1e3 if s else 0.0


class Worker:
    def __init__(self, idx: int, client: AsyncClient, lat: dict, errors: list) -> None:
        self.idx = idx
        self.c = client
        self.lat = lat
        self.errors = errors
        self.rng = random.Random(idx)
        self.model = "tiny" if idx % 4 == 3 else "mock"
        self.iterations = 0

    async def timed(self, op: str, coro):
        t0 = time.perf_counter()
        try:
            return await coro
        finally:
            self.record(op, time.perf_counter() - t0)

    def record(self, op: str, secs: float) -> None:
        self.lat[op].append(secs)
        self.lat[f"{self.model}/{op}"].append(secs)

    def _prompt(self) -> list[int]:
        return [self.rng.randrange(5, MODELS[self.model]) for _ in range(self.rng.randrange(4, 17))]

    def _tok(self) -> int:
        return self.rng.randrange(5, MODELS[self.model])

    async def unary_iteration(self) -> None:
        c, mid = self.c, self.model
        out = (await self.timed("prefill", c.prefill(mid, self._prompt()))).output
        cid, n = out.cache.cache_id, out.cache.num_tokens
        try:
            tok = out.output.token_id
            for _ in range(2):
                d = (await self.timed("decode", c.decode(mid, cid, tok))).output
                tok, n = d.output.token_id, d.cache.num_tokens
            v = await self.timed("verify", c.forward_verify(mid, cid, [tok, self._tok(), self._tok()]))
            assert v.cache.num_tokens == n + 3
            t = await self.timed("truncate", c.truncate_kv(mid, cid, n))
            assert t.cache.num_tokens == n and t.removed_tokens == 3
            await self.timed("decode", c.decode(mid, cid, tok, position=n))
        finally:
            r = await self.timed("release", c.release_cache(mid, cid))
            assert r.released

    async def session_iteration(self, call) -> None:
        mid = self.model

        async def step(op: str, field: str, req):
            t0 = time.perf_counter()
            self.sid += 1
            msg = pb.SessionRequest(step_id=self.sid)
            getattr(msg, field).CopyFrom(req)
            await call.write(msg)
            resp = await call.read()
            self.record(op, time.perf_counter() - t0)
            assert resp.step_id == self.sid
            if resp.WhichOneof("result") == "error":
                raise FerrumRpcError.from_step_error(resp.error)
            return getattr(resp, field)

        out = (await step("prefill", "prefill", pb.PrefillRequest(model_id=mid, input=m.prefill_input(
            self._prompt())))).output
        cid, n, tok = out.cache.cache_id, out.cache.num_tokens, out.output.token_id
        try:
            for _ in range(2):
                d = (await step("decode", "decode", pb.DecodeRequest(
                    model_id=mid, input=m.decode_input(cid, tok)))).output
                tok, n = d.output.token_id, d.cache.num_tokens
            v = await step("verify", "forward_verify", pb.ForwardVerifyRequest(
                model_id=mid, cache_id=cid, token_ids=[tok, self._tok(), self._tok()]))
            assert v.cache.num_tokens == n + 3
            await step("truncate", "truncate_kv", pb.TruncateKvRequest(model_id=mid, cache_id=cid, new_len=n))
            await step("decode", "decode", pb.DecodeRequest(model_id=mid, input=m.decode_input(cid, tok, None, n)))
        finally:
            r = await step("release", "release_cache", pb.ReleaseCacheRequest(model_id=mid, cache_id=cid))
            assert r.released

    async def run(self, until: float) -> None:
        self.sid = 0
        use_session = self.idx % 2 == 0
        call = self.c.session() if use_session else None
        try:
            while time.monotonic() < until:
                try:
                    if use_session:
                        await self.session_iteration(call)
                    else:
                        await self.unary_iteration()
                    self.iterations += 1
                except (FerrumRpcError, grpc.RpcError, AssertionError) as e:
                    self.errors.append(f"worker {self.idx} ({self.model}, {'session' if use_session else 'unary'}): "
                                       f"{type(e).__name__}: {e}")
                    if len(self.errors) > 20:
                        return
        finally:
            if call is not None:
                await call.done_writing()
                while await call.read() is not grpc.aio.EOF:  # drain to the end of the stream
                    pass
                assert await call.code() == grpc.StatusCode.OK


def test_64_concurrent_sessions_mixed_steps(tiny_llama_dir):  # noqa: F811
    specs = ["configurable,id=mock,vocab_size=1000,token_sequence=10:20:30,counter=per_sequence",
             f"hf-causal-lm,id=tiny,path={tiny_llama_dir},device=cpu,kv_budget_tokens=8192"]
    args = [a for s in specs for a in ("--model", s)]
    lat: dict[str, list[float]] = defaultdict(list)
    errors: list[str] = []
    with ServerProcess(*args, env={"FERRUM_TORCH_THREADS": "1", "FERRUM_LOG_LEVEL": "warning"}) as srv:

        async def main():
            # a few channels shared by the sessions (as a scheduler would pool connections)
            clients = [AsyncClient(srv.target, timeout=30) for _ in range(8)]
            workers = [Worker(i, clients[i % len(clients)], lat, errors) for i in range(SESSIONS)]
            t0 = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*(w.run(t0 + SECONDS) for w in workers)), SECONDS + 60)
            wall = time.monotonic() - t0
            for c in clients:
                await c.close()
            return workers, wall

        workers, wall = asyncio.run(main())
        with Client(srv.target) as c:
            active = {mid: c.status(mid).status.active_caches for mid in MODELS}
            used = {mid: c.kv_capacity(mid).used_tokens for mid in MODELS}
    steps = sum(len(v) for k, v in lat.items() if "/" not in k)
    everything = [x for k, v in lat.items() if "/" not in k for x in v]
    report = {
        "sessions": SESSIONS, "seconds": round(wall, 2), "iterations": sum(w.iterations for w in workers),
        "steps": steps, "steps_per_s": round(steps / wall, 1), "errors": len(errors),
        "p50_ms": round(_pct(everything, 0.5), 2), "p99_ms": round(_pct(everything, 0.99), 2),
        "per_op": {op: {"n": len(v), "p50_ms": round(_pct(v, 0.5), 2), "p99_ms": round(_pct(v, 0.99), 2)}
                   for op, v in sorted(lat.items())},
        "active_caches_after": active,
    }
    out = REPO / "benchmarks" / "results" / "tmp"
    out.mkdir(parents=True, exist_ok=True)
    (out / "load.json").write_text(json.dumps(report, indent=2))
    print("\nload:", json.dumps(report))
    assert not errors, "\n".join(errors[:10])
    assert all(w.iterations > 0 for w in workers), "a session made no progress"
    assert active == {"mock": 0, "tiny": 0} and used == {"mock": 0, "tiny": 0}
