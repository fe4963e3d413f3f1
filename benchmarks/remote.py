"""Measurements against a server subprocess (client and server in different processes)."""

from __future__ import annotations

import asyncio
import threading
import time

import psutil
from ferrum_client import AsyncClient, Client, messages as m, pb

from .common import median, pct


# ---- BatchDecode through gRPC --------------------------------------------------------------------
def batch_decode(target: str, model: str, prompts: list[list[int]], steps: int, repeats: int) -> dict:
    """The same loop as ``inproc.executor_decode`` (sampled-token mode), one BatchDecode RPC per step."""
    greedy = m.greedy()
    rates, trace = [], []
    with Client(target) as c:
        for r in range(repeats):
            resp = c.batch_prefill(model, [m.prefill_input(p[:-1] or p, policy=m.no_output()) for p in prompts])
            ids = [o.cache.cache_id for o in resp.outputs]
            tok = [p[-1] for p in prompts]
            toks = []
            t = time.perf_counter()
            for _ in range(steps):
                out = c.batch_decode(model, [m.decode_input(cid, x, greedy) for cid, x in zip(ids, tok)])
                tok = [o.output.token_id for o in out.outputs]
                toks.append(tok)
            rates.append(len(prompts) * steps / (time.perf_counter() - t))
            if r == 0:
                trace = toks
            for cid in ids:
                c.release_cache(model, cid)
    return {"tok_s": median(rates), "runs": rates, "tokens": trace}


# ---- stub round trips --------------------------------------------------------------------------
def stub_latency(target: str, model: str, n: int = 2000, per_cache: int = 500) -> dict:
    res = {}
    with Client(target) as c:
        # unary Decode
        lat = []
        cid = ""
        for k in range(n + 100):
            if k % per_cache == 0:
                if cid:
                    c.release_cache(model, cid)
                cid = c.prefill(model, [1, 2, 3]).output.cache.cache_id
            t = time.perf_counter_ns()
            c.decode(model, cid, 5)
            lat.append(time.perf_counter_ns() - t)
        c.release_cache(model, cid)
        lat = lat[100:]
        res["unary_p50_ms"], res["unary_p99_ms"] = pct(lat, 50) / 1e6, pct(lat, 99) / 1e6
        # Decode over one Session stream
        with c.session() as s:
            lat = []
            for k in range(n + 100):
                if k % per_cache == 0:
                    cid = s.step(pb.PrefillRequest(model_id=model, input=m.prefill_input([1, 2, 3]))).output.cache.cache_id
                req = pb.DecodeRequest(model_id=model, input=m.decode_input(cid, 5))
                t = time.perf_counter_ns()
                s.step(req)
                lat.append(time.perf_counter_ns() - t)
            lat = lat[100:]
        res["session_p50_ms"], res["session_p99_ms"] = pct(lat, 50) / 1e6, pct(lat, 99) / 1e6
    res["n"] = n
    return res


def session_floor(n: int = 2000) -> dict:
    """The Python client's Session round trip against ``benchmarks.floor_server`` (a grpc.aio
    server that does nothing): transport + grpc.aio + client cost, no executor, no server logic."""
    import subprocess
    import sys

    from .common import REPO, free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.floor_server", str(port)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
        with Client(f"127.0.0.1:{port}") as c, c.session() as s:
            lat = []
            for _ in range(n + 100):
                req = pb.DecodeRequest(model_id="floor", input=m.decode_input("c", 5))
                t = time.perf_counter_ns()
                s.step(req)
                lat.append(time.perf_counter_ns() - t)
        lat = lat[100:]
        return {"session_p50_ms": pct(lat, 50) / 1e6, "session_p99_ms": pct(lat, 99) / 1e6, "n": n}
    finally:
        proc.terminate()
        proc.wait(10)


def go_stub_latency(target: str, model: str, n: int = 2000) -> dict:
    """The same round trips from the Go client (``clients/go/cmd/latency``, built into the tools
    cache): the server's share of a step without the Python client's own per-call cost."""
    import json
    import os
    import shutil
    import subprocess
    from pathlib import Path

    go = shutil.which("go")
    if go is None:
        return {"error": "go is not installed"}
    repo = Path(__file__).resolve().parents[1]
    bin_dir = Path(os.environ.get("FERRUM_CACHE_DIR", Path.home() / ".cache" / "ferrum-service")) / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / "ferrum-go-latency"
    subprocess.run([go, "build", "-o", str(exe), "./cmd/latency"], cwd=repo / "clients" / "go", check=True,
                   env={**os.environ, "GOFLAGS": os.environ.get("GOFLAGS", "-buildvcs=false")}, timeout=600)
    out = subprocess.run([str(exe), "-target", target, "-model", model, "-n", str(n)], check=True,
                         capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout)


# ---- concurrent Generate streams ----------------------------------------------------------------
async def _streams(target: str, model: str, prompt: list[int], b: int, max_tokens: int) -> list[dict]:
    async with AsyncClient(target, timeout=600) as c:
        async def one(i):
            rec = {"sent": time.perf_counter(), "stamps": [], "tokens": []}
            async for ev in c.generate(model, token_ids=prompt, max_tokens=max_tokens, ignore_eos=True):
                if ev.WhichOneof("event") == "token":
                    rec["stamps"].append(time.perf_counter())
                    rec["tokens"].append(ev.token.token_id)
            return rec

        return await asyncio.gather(*(one(i) for i in range(b)))


def generate_streams(target: str, model: str, prompt: list[int], b: int, max_tokens: int) -> dict:
    """``b`` concurrent Generate streams of the same prompt. Reports end-to-end aggregate tok/s
    (prefills included), steady-state aggregate decode tok/s (tokens emitted while all ``b``
    streams were decoding ÷ that window), TTFT and inter-token latency percentiles, and the
    slowest stream's decode rate ÷ the median stream's (starvation check)."""
    t0 = time.perf_counter()
    recs = asyncio.run(_streams(target, model, prompt, b, max_tokens))
    t1 = time.perf_counter()
    total = sum(len(r["tokens"]) for r in recs)
    ttft = [r["stamps"][0] - r["sent"] for r in recs]
    itl = [y - x for r in recs for x, y in zip(r["stamps"], r["stamps"][1:])]
    w0 = max(r["stamps"][0] for r in recs)  # every stream has its first token
    w1 = min(r["stamps"][-1] for r in recs)  # no stream has finished yet
    in_window = sum(1 for r in recs for s in r["stamps"] if w0 < s <= w1)
    steady = in_window / (w1 - w0) if w1 > w0 and in_window else float("nan")
    per = [(len(r["stamps"]) - 1) / (r["stamps"][-1] - r["stamps"][0]) for r in recs if len(r["stamps"]) > 1]
    return {
        "b": b, "max_tokens": max_tokens, "total_tokens": total, "all_complete": all(len(r["tokens"]) == max_tokens for r in recs),
        "e2e_tok_s": total / (t1 - t0), "steady_tok_s": steady,
        "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
        "itl_p50_ms": 1e3 * pct(itl, 50), "itl_p99_ms": 1e3 * pct(itl, 99),
        "slowest_over_median": min(per) / median(per) if per else float("nan"),
        "tokens0": recs[0]["tokens"],
        "same_tokens": all(r["tokens"] == recs[0]["tokens"] for r in recs),
    }


# ---- prompt-lookup speculative decoding ---------------------------------------------------------
def _lookup(ctx: list[int], k: int, ngram_max: int = 3) -> list[int]:
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of the context's
    last n-gram (n = ngram_max..1), up to ``k`` of them."""
    for n in range(ngram_max, 0, -1):
        if len(ctx) <= n:
            continue
        tail = ctx[-n:]
        for i in range(len(ctx) - n - 1, -1, -1):
            if ctx[i:i + n] == tail:
                return ctx[i + n:i + n + k]
    return []


def speculative(target: str, model: str, prompt: list[int], n_tokens: int, k: int = 8) -> dict:
    """Client-driven prompt-lookup decoding over one Session: Prefill, then ForwardVerify
    ([last token] + draft, accept_greedy_prefix=True; the server truncates rejected drafts) until
    ``n_tokens`` are generated. Returns tokens, tok/s (prefill included), steps and acceptance."""
    with Client(target) as c, c.session() as s:
        t = time.perf_counter()
        out = s.step(pb.PrefillRequest(model_id=model, input=m.prefill_input(prompt, policy=m.greedy())))
        cid = out.output.cache.cache_id
        gen = [out.output.output.token_id]
        steps = drafted = accepted = 0
        while len(gen) < n_tokens:
            draft = _lookup(prompt + gen, min(k, n_tokens - len(gen) - 1))
            if draft:
                r = s.step(pb.ForwardVerifyRequest(model_id=model, cache_id=cid, token_ids=[gen[-1]] + draft,
                                                   accept_greedy_prefix=True, logits=m.greedy()))
                gen.extend(r.accepted_tokens)
                drafted += len(draft)
                accepted += r.accepted_drafts
            else:
                r = s.step(pb.DecodeRequest(model_id=model, input=m.decode_input(cid, gen[-1], m.greedy())))
                gen.append(r.output.output.token_id)
            steps += 1
        dt = time.perf_counter() - t
        s.step(pb.ReleaseCacheRequest(model_id=model, cache_id=cid))
    gen = gen[:n_tokens]
    return {"tok_s": n_tokens / dt, "tokens": gen, "steps": steps, "drafted": drafted, "accepted": accepted}


def plain_generate(target: str, model: str, prompt: list[int], n_tokens: int) -> dict:
    with Client(target, timeout=600) as c:
        t = time.perf_counter()
        toks = c.generate(model, token_ids=prompt, max_tokens=n_tokens, ignore_eos=True).tokens()
        dt = time.perf_counter() - t
    return {"tok_s": n_tokens / dt, "tokens": toks}


# ---- KV bytes ----------------------------------------------------------------------------------
def kv_bytes(target: str, model: str, tokens: int = 1000) -> dict:
    with Client(target) as c:
        info = c.info(model).models[0]
        cap = c.kv_capacity(model)
        before = cap.used_bytes
        cid = c.prefill(model, [1] * tokens, policy=m.no_output()).output.cache.cache_id
        after = c.kv_capacity(model).used_bytes
        c.release_cache(model, cid)
    return {"bytes_per_token": cap.bytes_per_token, "num_layers": info.num_layers, "num_kv_heads": info.num_kv_heads,
            "head_dim": getattr(info, "head_dim", 0) or 0, "dtype": info.dtype,
            "allocated_per_token": (after - before) / tokens, "tokens": tokens}


# ---- memory after many sessions -----------------------------------------------------------------
def sessions_rss(target: str, model: str, pid: int, n: int, first: int = 100, workers: int = 4) -> dict:
    """``n`` short Session streams (Prefill 16 tokens + 4 Decode steps each; closing the stream
    frees its caches), ``workers`` clients in parallel; server RSS after the first ``first`` and
    after all ``n``."""
    from concurrent.futures import ThreadPoolExecutor

    proc = psutil.Process(pid)

    def one_session(c: Client) -> None:
        with c.session() as s:
            cid = s.step(pb.PrefillRequest(model_id=model, input=m.prefill_input(list(range(1, 17))))).output.cache.cache_id
            for j in range(4):
                s.step(pb.DecodeRequest(model_id=model, input=m.decode_input(cid, 7 + j)))

    def batch(count: int) -> None:
        per = [count // workers + (1 if i < count % workers else 0) for i in range(workers)]

        def work(k: int) -> None:
            with Client(target) as c:
                for _ in range(k):
                    one_session(c)

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(work, per))

    t = time.perf_counter()
    batch(first)
    time.sleep(0.2)
    rss = {first: proc.memory_info().rss}
    done = first
    while done < n:
        k = min(n - done, max(1000, first))
        batch(k)
        done += k
        time.sleep(0.05)
        rss[done] = proc.memory_info().rss
    time.sleep(0.2)
    rss[n] = proc.memory_info().rss
    with Client(target) as c:
        live = c.loads(model).loads[0].active_caches
    return {"rss_first": rss[first], "rss_last": rss[n], "ratio": rss[n] / rss[first], "n": n, "first": first,
            "curve": rss, "seconds": time.perf_counter() - t, "live_caches_after": live, "workers": workers}


# ---- scheduler-facing: Loads cost, KV-event lag -------------------------------------------------
def loads_cost(target: str, n: int = 1000) -> dict:
    lat = []
    with Client(target) as c:
        for _ in range(n + 50):
            t = time.perf_counter_ns()
            c.loads()
            lat.append(time.perf_counter_ns() - t)
    lat = lat[50:]
    return {"p50_ms": pct(lat, 50) / 1e6, "p99_ms": pct(lat, 99) / 1e6, "n": n}


def kv_event_lag(target: str, model: str, n_ops: int = 500) -> dict:
    """Subscribe to KV events, drive Prefill/Decode/Release steps; lag = client receipt wall clock
    − the event's ``time_unix_ns`` (same host, same clock)."""
    lags: list[int] = []
    ready = threading.Event()
    with Client(target) as sub_client, Client(target) as c:
        stream = sub_client.subscribe_kv_events(model)

        def reader():
            try:
                for ev in stream:
                    if ev.WhichOneof("message") == "event":
                        lags.append(time.time_ns() - ev.event.time_unix_ns)
            except Exception:  # noqa: BLE001 - cancelled at the end
                pass

        th = threading.Thread(target=reader, daemon=True)
        th.start()
        time.sleep(0.3)
        for _ in range(n_ops):
            cid = c.prefill(model, [1, 2, 3, 4]).output.cache.cache_id
            c.decode(model, cid, 5)
            c.release_cache(model, cid)
        time.sleep(0.5)
        stream.cancel()
        th.join(5)
    return {"p50_ms": pct(lags, 50) / 1e6, "p99_ms": pct(lags, 99) / 1e6, "events": len(lags)}
