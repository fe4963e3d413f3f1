"""Tail latency while prompts arrive (issue 30): adaptive prompt chunks vs a fixed budget.

    .venv/bin/python -m benchmarks.arrival_rows [--model smollm2] [--streams 32] [--gap-ms 100]
                                                [--prompt 200] [--tokens 64] [--rounds 2]

Two ``serve`` processes on the same model: one with ``--prefill-tail-factor 0`` (every step may take
a fixed 512-token chunk of arriving prompts beside the running streams: the old batcher) and one
with ``--prefill-tail-factor 2`` (``--factor``): a step takes the prompt tokens that keep it within
two decode steps of its rows, from the measured costs (``hosting/step_costs.py``). The workload: ``--streams`` Generate streams whose fresh
``--prompt``-token prompts arrive ``--gap-ms`` apart, ``--tokens`` tokens each (greedy,
``ignore_eos``, prefix cache bypassed). Per side: inter-token latency p50 / p99 over every stream,
TTFT p50, aggregate tok/s. The sides alternate run by run (the side that goes first swaps every
round); the reference workload is timed before and after (drift > 15 %: busy, not to publish).
Target: ITL p99 ÷ p50 ≤ 3 with the adaptive budget.

Both servers run with ``--log-level debug``: the batcher logs every step (decode rows, prompt
tokens, forward time, what its cost model expected). A second table splits the tail: how much
longer than a decode-only step of their rows the steps that took prompt tokens ran (the budget
aims at ``--factor``), and how far the cost model's expectation was off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

from .common import Server, median, pct
from .llama_cpp_rows import DRIFT_LIMIT, reference_workload
from .schema import row, write_rows


async def _workload(target: str, model: str, streams: int, gap_s: float, prompt_len: int, tokens: int,
                    seed: int, vocab: int = 40000) -> dict:
    from ferrum_client import AsyncClient

    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(streams)]
    async with AsyncClient(target, timeout=600) as c:
        async def one(i: int) -> dict:
            await asyncio.sleep(i * gap_s)
            sent, stamps = time.perf_counter(), []
            async for ev in c.generate(model, token_ids=prompts[i], max_tokens=tokens, ignore_eos=True,
                                       bypass_prefix_cache=True):
                if ev.WhichOneof("event") == "token":
                    stamps.append(time.perf_counter())
            return {"sent": sent, "stamps": stamps}

        t0 = time.perf_counter()
        recs = await asyncio.gather(*(one(i) for i in range(streams)))
        wall = time.perf_counter() - t0
    itl = [y - x for r in recs for x, y in zip(r["stamps"], r["stamps"][1:])]
    return {"itl_p50_ms": 1e3 * pct(itl, 50), "itl_p99_ms": 1e3 * pct(itl, 99),
            "ttft_p50_ms": 1e3 * median([r["stamps"][0] - r["sent"] for r in recs]),
            "tok_s": sum(len(r["stamps"]) for r in recs) / wall,
            "complete": all(len(r["stamps"]) == tokens for r in recs)}


def _step_lines(log_path) -> list[dict]:
    """The server's ``batched step`` debug lines (JSON log), in order."""
    out = []
    for line in open(log_path, encoding="utf-8", errors="replace"):
        if '"batched step"' in line:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def step_stats(log_path, skip: int = 0) -> dict:
    """What the steps of the timed rounds cost: decode-only forwards, how much longer a step that
    took prompt tokens ran than a decode-only step of its rows (``mixed_stretch``: the adaptive
    budget aims at ``--prefill-tail-factor``), and how far the cost model's expectation was off
    (``error`` = forward ÷ expected). Steps before the fit exists carry no expectation."""
    st = [x for x in _step_lines(log_path)[skip:] if x["decode_rows"]]
    only = [x["forward_ms"] for x in st if not x["prompt_tokens"]]
    mixed = [x for x in st if x["prompt_tokens"] and x.get("decode_only_ms")]
    stretch = [x["forward_ms"] / x["decode_only_ms"] for x in mixed]
    err = [x["forward_ms"] / x["expected_ms"] for x in st if x.get("expected_ms")]
    nan = float("nan")
    return {"steps": len(st), "mixed": len(mixed),
            "decode_only_p50_ms": median(only) if only else nan,
            "mixed_stretch_p50": median(stretch) if stretch else nan,
            "mixed_stretch_p99": pct(stretch, 99) if stretch else nan,
            "error_p50": median(err) if err else nan, "error_p99": pct(err, 99) if err else nan,
            "forward_p99_ms": pct([x["forward_ms"] for x in st], 99) if st else nan}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--gap-ms", type=float, default=100.0)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=40000, help="prompt ids are drawn below this")
    ap.add_argument("--factor", type=float, default=2.0, help="the adaptive side's --prefill-tail-factor")
    a = ap.parse_args()
    sides = {"fixed": ("--prefill-tail-factor", "0"),
             "adaptive": ("--prefill-tail-factor", str(a.factor))}
    servers = {k: Server(a.model, extra=("--max-batch", str(max(64, a.streams)), "--log-level", "debug", *extra),
                         name=f"arrival-{k}").start()
               for k, extra in sides.items()}
    try:
        for s in servers.values():
            asyncio.run(_workload(s.target, "", 4, 0.0, 32, 8, 0, a.vocab))  # warm: graphs, first steps
        warm_steps = {k: len(_step_lines(s.log_path)) for k, s in servers.items()}
        before = reference_workload()
        recs: dict[str, list[dict]] = {k: [] for k in sides}
        for r in range(a.rounds):
            for k in (("fixed", "adaptive") if r % 2 == 0 else ("adaptive", "fixed")):
                recs[k].append(asyncio.run(_workload(servers[k].target, "", a.streams, a.gap_ms / 1e3, a.prompt,
                                                     a.tokens, 1000 * r + (k == "fixed"), a.vocab)))
    finally:
        for s in servers.values():
            s.stop()
    after = reference_workload()  # with the servers gone (llama.cpp's threads spin a while after a step)
    drift = abs(after - before) / before
    agg = {k: {m: median([x[m] for x in v]) for m in ("itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "tok_s")}
           for k, v in recs.items()}
    tail = {k: v["itl_p99_ms"] / v["itl_p50_ms"] for k, v in agg.items()}
    steps = {k: step_stats(servers[k].log_path, skip=warm_steps[k]) for k in sides}
    print(f"| {a.streams} streams, {a.prompt}-token prompts {a.gap_ms:.0f} ms apart, {a.tokens} tokens | ITL p50 ms "
          "| ITL p99 ms | p99 ÷ p50 | TTFT p50 ms | tok/s |")
    print("|---|---|---|---|---|---|")
    for k in sides:
        v = agg[k]
        print(f"| {k} | {v['itl_p50_ms']:.0f} | {v['itl_p99_ms']:.0f} | {tail[k]:.2f} | {v['ttft_p50_ms']:.0f} "
              f"| {v['tok_s']:.1f} |")
    print("| steps (timed rounds) | decode-only forward p50 ms | mixed forward ÷ decode-only p50 / p99 "
          "| forward ÷ expected p50 / p99 | forward p99 ms |")
    print("|---|---|---|---|---|")
    for k, st in steps.items():
        print(f"| {k} ({st['steps']} steps, {st['mixed']} mixed) | {st['decode_only_p50_ms']:.0f} "
              f"| {st['mixed_stretch_p50']:.2f} / {st['mixed_stretch_p99']:.2f} "
              f"| {st['error_p50']:.2f} / {st['error_p99']:.2f} | {st['forward_p99_ms']:.0f} |")
    print(f"drift {drift:.1%}{' (busy: do not publish)' if drift > DRIFT_LIMIT else ''}; every stream complete: "
          f"{all(x['complete'] for v in recs.values() for x in v)}")
    name = (f"{a.streams} Generate streams, {a.prompt}-token prompts arriving {a.gap_ms:.0f} ms apart "
            f"({a.model}): ITL p99 ÷ p50, adaptive prompt chunks (peer: fixed 512-token chunks)")
    rows = [row(name, round(tail["adaptive"], 2), round(tail["fixed"], 2), round(tail["adaptive"], 2), "≤ 3",
                target_value=3.0, lower_is_better=True, drift=round(drift, 3), unit="p99/p50",
                ms={k: {m: round(x, 1) for m, x in v.items()} for k, v in agg.items()}, steps=steps,
                note=f"ours = adaptive budget (--prefill-tail-factor {a.factor:g}), peer = --prefill-tail-factor 0; "
                     "ratio = ours; sides alternated, medians of the rounds")]
    write_rows("arrival", rows, {"args": vars(a), "runs": recs, "drift": drift})


if __name__ == "__main__":
    main()
