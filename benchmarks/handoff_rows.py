"""KV handoff rows (issue 16), measured side by side in one run against ``ferrum-service serve``
subprocesses (SmolLM2-135M on the transformers executor, fp32, CPU):

    .venv/bin/python -m benchmarks.handoff_rows [--quick] [--threads N]

Rows:

* handoff time for 1,000 tokens of context ÷ prefill time of the same 1,000 tokens, target ≤ 0.2.
  Prefill: a ``Prefill`` RPC of 1,000 fresh tokens on server A (prefix cache bypassed). Handoff:
  an ``ImportKv`` on server B pulling that cache from A (``source``: B calls ``ExportKv`` on A; the
  header, 30 layers of K/V in checksummed chunks, the import and the prefix-cache commit), as the
  client sees it. The two are measured alternately, ``n`` times each; medians.
* TTFT / ITL p50 and p99 of 16 concurrent streams with 1,024-token prompts (distinct prompts, 16
  generated tokens each): 1 prefill + 1 decode server (prefill on one, server pull, ``Generate``
  over the imported cache on the other) vs 2 plain servers (8 ``Generate`` streams each). TTFT is
  the first token (for the disaggregated pair: the prefill's answer); ITL covers every later gap,
  the handoff included; "decode ITL" leaves the gap after the first token out.

Drift: a fixed CPU workload is timed before and after each row; drift > 15 % flags it ``busy``.
The load average before and after is printed (the machine may be shared).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time

from ferrum_client import AsyncClient, Client, messages as m, pb

from .common import Server, median, pct
from .llama_cpp_rows import timed_row
from .schema import row, write_rows

MODEL = "hf"


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def handoff_vs_prefill(a: str, b: str, tokens: int, n: int) -> dict:
    """Alternating: prefill of ``tokens`` fresh tokens on ``a`` (timed), then ``b`` pulls the cache (timed)."""
    pre, hand, sizes = [], [], []
    with Client(a, timeout=600) as ca, Client(b, timeout=600) as cb:
        for i in range(n + 1):  # the first pair warms up (B and A compute their weights' fingerprint)
            ids = _prompt(tokens, 1000 + i)
            t0 = time.perf_counter()
            out = ca.stub.Prefill(pb.PrefillRequest(model_id=MODEL, input=pb.PrefillInput(
                token_ids=ids, logits=m.greedy(), bypass_prefix_cache=True))).output
            t1 = time.perf_counter()
            r = cb.pull_kv(MODEL, a, out.cache.cache_id)
            t2 = time.perf_counter()
            ca.release_cache(MODEL, out.cache.cache_id)
            cb.release_cache(MODEL, r.cache.cache_id)
            if i:
                pre.append(t1 - t0)
                hand.append(t2 - t1)
                sizes.append(r.bytes)
    return {"tokens": tokens, "prefill_s": pre, "handoff_s": hand, "bytes": sizes[0],
            "prefill_med_s": median(pre), "handoff_med_s": median(hand), "ratio": median(hand) / median(pre)}


async def _plain(targets: list[str], prompts: list[list[int]], max_tokens: int) -> list[dict]:
    clients = [AsyncClient(t, timeout=900) for t in targets]
    try:
        async def one(i):
            c = clients[i % len(clients)]
            rec = {"sent": time.perf_counter(), "stamps": []}
            async for ev in c.generate(MODEL, token_ids=prompts[i], max_tokens=max_tokens, ignore_eos=True):
                if ev.WhichOneof("event") == "token":
                    rec["stamps"].append(time.perf_counter())
            return rec
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))
    finally:
        for c in clients:
            await c.close()


async def _disaggregated(prefill: str, decode: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    async with AsyncClient(prefill, timeout=900) as cp, AsyncClient(decode, timeout=900) as cd:
        async def one(i):
            rec = {"sent": time.perf_counter(), "stamps": []}
            out = (await cp.prefill(MODEL, prompts[i], policy=m.greedy())).output
            rec["stamps"].append(time.perf_counter())
            r = await cd.pull_kv(MODEL, prefill, out.cache.cache_id, reserve_tokens=len(prompts[i]) + max_tokens)
            await cp.release_cache(MODEL, out.cache.cache_id)
            rec["handoff_done"] = time.perf_counter()
            async for ev in cd.generate(MODEL, cache_id=r.cache.cache_id, last_token_id=out.output.token_id,
                                        max_tokens=max_tokens - 1, ignore_eos=True):
                if ev.WhichOneof("event") == "token":
                    rec["stamps"].append(time.perf_counter())
            await cd.release_cache(MODEL, r.cache.cache_id)
            return rec
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))


def _latencies(recs: list[dict], max_tokens: int) -> dict:
    ttft = [r["stamps"][0] - r["sent"] for r in recs]
    itl = [y - x for r in recs for x, y in zip(r["stamps"], r["stamps"][1:])]
    dec = [y - x for r in recs for x, y in zip(r["stamps"][1:], r["stamps"][2:])]
    return {"streams": len(recs), "complete": all(len(r["stamps"]) == max_tokens for r in recs),
            "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
            "itl_p50_ms": 1e3 * pct(itl, 50), "itl_p99_ms": 1e3 * pct(itl, 99),
            "decode_itl_p50_ms": 1e3 * pct(dec, 50), "decode_itl_p99_ms": 1e3 * pct(dec, 99),
            "wall_s": max(r["stamps"][-1] for r in recs) - min(r["sent"] for r in recs)}


def _print(r: dict) -> None:
    ours, peer = f"{r['ours']:.0f} ms", f"{r['peer']:.0f} ms"
    flag = "busy" if r["busy"] else ("" if r["met"] is None else "met" if r["met"] else "missed")
    print(f"| {r['name']} | {ours} | {peer} | {r['ratio']:.3g} | {r['target'] or 'reported'} | "
          f"{100 * r['drift']:.0f} % | {flag} |", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repeats, 8 streams of 512 tokens")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads per server")
    ap.add_argument("--skip-streams", action="store_true", help="only the handoff ÷ prefill row")
    a = ap.parse_args(argv)
    th = a.threads
    n = 3 if a.quick else 5
    streams, plen, max_tokens = (8, 512, 8) if a.quick else (16, 1024, 16)
    raw: dict = {"threads": th, "load_before": os.getloadavg()}
    rows = []
    print("| row | ours | peer | ratio | target | drift | flag |\n|---|---|---|---|---|---|---|", flush=True)
    spec = "smollm2-hf,id=hf,device=cpu"
    budget = ("--kv-budget-tokens", str(streams * (plen + max_tokens + 32)))
    with Server(spec, threads=th, extra=("--role", "prefill", *budget), name="server-handoff-prefill") as sp, \
            Server(spec, threads=th, extra=("--role", "decode", *budget), name="server-handoff-decode") as sd:
        res, drift = timed_row(lambda: handoff_vs_prefill(sp.target, sd.target, 1000, n))
        raw["handoff"] = res
        rows.append(row("handoff ÷ prefill, 1,000 tokens of context (SmolLM2 fp32, "
                        f"{res['bytes'] / 2**20:.1f} MiB of K/V)", 1e3 * res["handoff_med_s"], 1e3 * res["prefill_med_s"],
                        res["ratio"], "≤ 0.2", target_value=0.2, lower_is_better=True, drift=drift, unit="ms",
                        note=f"median of {n} runs per side"))
        _print(rows[-1])
        if not a.skip_streams:
            prompts = [_prompt(plen, i) for i in range(streams)]
            dis, d1 = timed_row(lambda: _latencies(asyncio.run(_disaggregated(sp.target, sd.target, prompts,
                                                                                max_tokens)), max_tokens))
    if not a.skip_streams:
        with Server(spec, threads=th, extra=budget, name="server-plain-0") as s0, \
                Server(spec, threads=th, extra=budget, name="server-plain-1") as s1:
            prompts = [_prompt(plen, 100 + i) for i in range(streams)]
            plain, d2 = timed_row(lambda: _latencies(asyncio.run(_plain([s0.target, s1.target], prompts,
                                                                        max_tokens)), max_tokens))
        raw["disaggregated"], raw["plain"] = dis, plain
        for key, label in (("ttft", "TTFT"), ("itl", "ITL"), ("decode_itl", "decode ITL")):
            for q in ("p50", "p99"):
                x, y = dis[f"{key}_{q}_ms"], plain[f"{key}_{q}_ms"]
                rows.append(row(f"{label} {q}, {streams} streams × {plen}-token prompts: 1 prefill + 1 decode ÷ 2 plain",
                                x, y, x / y, drift=max(d1, d2), unit="ms", note="reported (no target)"))
                _print(rows[-1])
    write_rows("handoff_rows", rows, raw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
