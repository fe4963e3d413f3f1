"""Soak: 10,000 short sessions against a server process — most a short ``Session`` stream
(prefill, then decode, decode, release pipelined), the rest unary (prefill, decode, release), a
few abandoned mid-way (cancelled with their cache still live). No cache, file-descriptor or thread
leak in the server process (psutil), RSS growth reported (target < 5 %).

Run on the scripted model (``FERRUM_SOAK_SESSIONS``, default 10000), on the tiny real Llama
(``FERRUM_SOAK_SESSIONS_TINY``, default 400: real forwards on 2 CPU cores, kept bounded) and on
SmolLM2 on the llama.cpp executor (``FERRUM_SOAK_SESSIONS_LLAMA``, default 600), where the
executor's own books are read from /metrics at the end: no sequence id in use, no KV cell held by
llama.cpp (``ferrum_llama_cpp_sequence_ids_in_use``, ``ferrum_llama_cpp_kv_cells``).
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import grpc
import psutil

from ferrum_client import AsyncClient, Client, messages as m, pb

from .support import llama
from .support.servers import REPO, ServerProcess, free_port

import pytest

from .conftest_models import tiny_llama_dir  # noqa: F401

N = int(os.environ.get("FERRUM_SOAK_SESSIONS", "10000"))
N_TINY = int(os.environ.get("FERRUM_SOAK_SESSIONS_TINY", "400"))
N_LLAMA = int(os.environ.get("FERRUM_SOAK_SESSIONS_LLAMA", "600"))
CONCURRENCY = 32
VOCAB = {"mock": 1000, "tiny": 512, "llama": 49152}


def _sample(proc: psutil.Process) -> dict:
    return {"fds": proc.num_fds(), "threads": proc.num_threads(), "rss_mb": round(proc.memory_info().rss / 2**20, 2)}


async def _session(c: AsyncClient, i: int, MODEL: str) -> None:
    call = c.session()
    await call.write(pb.SessionRequest(step_id=1, prefill=pb.PrefillRequest(
        model_id=MODEL, input=m.prefill_input([1 + i % (VOCAB[MODEL] - 1), 2, 3]))))
    r = await call.read()
    assert r.WhichOneof("result") == "prefill", r
    cid = r.prefill.output.cache.cache_id
    if i % 97 == 0:  # abandoned: the client goes away with the cache still live
        call.cancel()
        return
    await call.write(pb.SessionRequest(step_id=2, decode=pb.DecodeRequest(model_id=MODEL, input=m.decode_input(cid, 5))))
    await call.write(pb.SessionRequest(step_id=3, decode=pb.DecodeRequest(model_id=MODEL, input=m.decode_input(cid, 6))))
    await call.write(pb.SessionRequest(step_id=4, release_cache=pb.ReleaseCacheRequest(model_id=MODEL, cache_id=cid)))
    await call.done_writing()
    got = []
    while (r := await call.read()) is not grpc.aio.EOF:
        got.append(r.WhichOneof("result"))
    assert got == ["decode", "decode", "release_cache"], got
    assert await call.code() == grpc.StatusCode.OK


async def _unary(c: AsyncClient, i: int, MODEL: str) -> None:
    out = (await c.prefill(MODEL, [1 + i % (VOCAB[MODEL] - 1), 2])).output
    cid = out.cache.cache_id
    await c.decode(MODEL, cid, out.output.token_id)
    assert (await c.release_cache(MODEL, cid)).released


async def _run(target: str, start: int, count: int, errors: list, MODEL: str) -> None:
    clients = [AsyncClient(target, timeout=30) for _ in range(4)]
    sem = asyncio.Semaphore(CONCURRENCY)

    async def one(i):
        async with sem:
            try:
                await (_unary if i % 5 == 4 else _session)(clients[i % len(clients)], i, MODEL)
            except Exception as e:  # noqa: BLE001 - every failure is reported
                errors.append(f"session {i}: {type(e).__name__}: {e}")

    await asyncio.gather(*(one(i) for i in range(start, start + count)))
    for c in clients:
        await c.close()


def _scrape(port: int) -> dict[str, float]:
    """``name{labels}`` -> value of the server's /metrics."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            out[k] = float(v)
    return out


@pytest.mark.parametrize("MODEL", ["mock", "tiny", "llama"])
def test_soak_short_sessions_no_leaks(MODEL, request):
    metrics_port = free_port()
    if MODEL == "mock":
        spec, N = f"configurable,id={MODEL},vocab_size=1000,token_sequence=10:20:30", globals()["N"]
    elif MODEL == "tiny":
        spec, N = f"hf-causal-lm,id=tiny,path={request.getfixturevalue('tiny_llama_dir')}", N_TINY
    else:
        spec, N = f"llama-cpp,id=llama,path={llama.gguf()},n_ctx=4096,n_seq=64,threads=2", N_LLAMA
    with ServerProcess("--model", spec, "--metrics-port", str(metrics_port),
                       env={"FERRUM_LOG_LEVEL": "warning"}) as srv, Client(srv.target) as c:
        proc = psutil.Process(srv.proc.pid)
        errors: list[str] = []
        t0 = time.monotonic()
        asyncio.run(_run(srv.target, 0, 100, errors, MODEL))
        time.sleep(0.3)
        first = _sample(proc)
        asyncio.run(_run(srv.target, 100, N - 100, errors, MODEL))
        wall = time.monotonic() - t0
        deadline = time.monotonic() + 10
        while c.status(MODEL).status.active_caches and time.monotonic() < deadline:
            time.sleep(0.05)  # abandoned sessions' caches are freed as the server notices
        time.sleep(0.3)
        end = _sample(proc)
        st = c.status(MODEL).status
        kv = c.kv_capacity(MODEL)
        scraped = _scrape(metrics_port)
    growth = (end["rss_mb"] - first["rss_mb"]) / first["rss_mb"] * 100
    report = {"sessions": N, "seconds": round(wall, 1), "sessions_per_s": round(N / wall, 1), "errors": len(errors),
              "after_100": first, "end": end, "rss_growth_pct": round(growth, 2),
              "active_caches_end": st.active_caches, "kv_used_tokens_end": kv.used_tokens,
              "prefills": st.prefill_operations}
    if MODEL == "llama":
        report["llama_cpp_end"] = {k.split("{")[0]: v for k, v in scraped.items() if k.startswith("ferrum_llama_cpp_")}
    out = REPO / "benchmarks" / "results" / "tmp"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"soak-{MODEL}.json").write_text(json.dumps(report, indent=2))
    print("\nsoak:", json.dumps(report))
    assert not errors, "\n".join(errors[:10])
    assert st.active_caches == 0 and kv.used_tokens == 0, "caches leaked"
    if MODEL == "llama":  # the executor's own books: its sequence-id pool and llama.cpp's KV cells
        assert scraped['ferrum_llama_cpp_sequence_ids_in_use{model="llama"}'] == 0, "sequence ids leaked"
        assert scraped['ferrum_llama_cpp_kv_cells{model="llama"}'] == 0, "llama.cpp still holds KV cells"
    assert st.prefill_operations == N
    assert end["fds"] <= first["fds"] + 2, f"fd leak: {first['fds']} -> {end['fds']}"
    assert end["threads"] <= first["threads"] + 1, f"thread leak: {first['threads']} -> {end['threads']}"
    assert growth < 5.0, f"RSS grew {growth:.1f}% over {N} sessions"
