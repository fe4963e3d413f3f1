"""The SMG gateway's cost (issue 28): OpenAI streaming completions through SMG (``smg launch
--backend vllm``, its own venv from ``scripts/gateway_venv.sh``) in front of one worker, against
the same worker's own ``Generate`` called directly, side by side in one run.

    .venv/bin/python -m benchmarks.gateway_rows [--quick] [--threads N] [--executor llama-cpp|hf]

Rows, at 1, 8 and 32 concurrent requests of the same prompt (the 37-token chat prompt of
``engine_rows``: its ids to ``Generate``, its text, special tokens included, to SMG's
``/v1/completions``, which takes no token ids; the gateway's prompt token count is recorded), greedy, every request ``max_tokens``
long (EOS ignored on both sides): end-to-end aggregate tok/s through SMG ÷ the same number of
concurrent ``Generate`` streams (target ≥ 0.9), and the time-to-first-token p50 of each side. The
two sides alternate (gateway, Generate, gateway, ...; medians), and the fixed reference workload of
``llama_cpp_rows`` is timed before and after each row: a row whose drift exceeds 15 % is flagged
``busy`` (numbers measured while the machine is busy are not published).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

from ferrum_client import Client

from .common import Server, median, pct
from .engine_rows import PROMPT
from .llama_cpp_rows import timed_row
from .schema import row, write_rows
from .remote import generate_streams


def gateway_streams(port: int, model: str, prompt: str, b: int, max_tokens: int) -> dict:
    """``b`` concurrent streamed ``/v1/completions`` through the gateway: aggregate tok/s (the
    usage's completion tokens over the wall time of the whole batch) and TTFT (first text chunk)."""

    prompt_tokens = []

    def one(_i: int) -> tuple[int, float]:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        sent = time.perf_counter()
        c.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"gateway: HTTP {r.status}: {r.read()[:300]!r}")
        first, tokens = None, 0
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if first is None and ev.get("choices") and ev["choices"][0].get("text"):
                first = time.perf_counter() - sent
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
                prompt_tokens.append(ev["usage"]["prompt_tokens"])
        c.close()
        return tokens, first if first is not None else float("nan")

    t0 = time.perf_counter()
    with ThreadPoolExecutor(b) as pool:
        recs = list(pool.map(one, range(b)))
    wall = time.perf_counter() - t0
    total = sum(t for t, _ in recs)
    return {"b": b, "total_tokens": total, "prompt_tokens": sorted(set(prompt_tokens)), "all_complete": all(t == max_tokens for t, _ in recs),
            "e2e_tok_s": total / wall, "ttft_p50_ms": 1e3 * pct([f for _, f in recs], 50)}


_WORDS = ("river stone light paper garden window market silver engine forest winter number yellow doctor "
          "planet letter bridge summer violin island pocket button ladder copper mirror candle rocket tunnel "
          "orange pencil wizard harbor desert meadow falcon castle jacket puzzle lantern").split()


def _shared_prefix_requests(seed: int, prefixes: int, per_prefix: int, words: int) -> list[str]:
    """``prefixes`` long random texts of ``words`` words, each followed by ``per_prefix`` short
    distinct questions: the requests in order, a prefix's requests one after another."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(prefixes):
        head = " ".join(rng.choice(_WORDS) for _ in range(words))
        out += [f"{head}\nQuestion {q}: name the {q + 1}th word." for q in range(per_prefix)]
    return out


def routing_ttft(port: int, model: str, texts: list[str]) -> list[float]:
    """TTFT (ms) of each request sent one after another through the gateway (4 tokens each)."""
    ttfts = []
    for t in texts:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        body = {"model": model, "prompt": t, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True}
        sent = time.perf_counter()
        c.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"gateway: HTTP {r.status}: {r.read()[:300]!r}")
        first = None
        for line in iter(r.readline, b""):
            line = line.strip()
            if first is None and line.startswith(b"data:") and line != b"data: [DONE]":
                ev = json.loads(line[5:])
                if ev.get("choices") and ev["choices"][0].get("text"):
                    first = time.perf_counter() - sent
        c.close()
        ttfts.append(1e3 * first if first is not None else float("nan"))
    return ttfts


def routing_row(venv, spec: str, threads: int, rounds: int) -> tuple[dict, dict]:
    """Cache-aware vs round-robin routing over two workers on a shared-prefix workload (6 long
    prefixes x 3 questions, sent one at a time, fresh texts every round): TTFT p50 of each policy
    (SMG's own routing; the workers' prefix caches do the rest). Round-robin sends a prefix's three
    requests to both workers (two compute it), cache-aware to the one that holds it (one does). The policies alternate round by
    round; the ratio is round-robin ÷ cache-aware (target >= 2)."""
    from ferrum_service.testing.smg_gateway import Gateway

    res: dict[str, list[float]] = {"cache_aware": [], "round_robin": []}
    shared = ("--vllm-shared-prefix-cache",)  # the gateway's requests share prefixes (what routing is for)
    with Server(spec, threads=threads, name="server-routing-a", extra=shared) as w1, \
            Server(spec, threads=threads, name="server-routing-b", extra=shared) as w2:
        gws = {pol: Gateway(venv, [w1.target, w2.target], policy=pol).start("smollm2", timeout=300)
               for pol in res}
        try:
            for pol, gw in gws.items():  # warm both workers through each gateway
                routing_ttft(gw.port, "smollm2", _shared_prefix_requests(999 + len(pol), 1, 2, 20))
            for r in range(rounds):
                for pol in (("cache_aware", "round_robin") if r % 2 == 0 else ("round_robin", "cache_aware")):
                    res[pol] += routing_ttft(gws[pol].port, "smollm2",
                                             _shared_prefix_requests(100 * r + len(pol), 6, 3, 450))
        finally:
            for gw in gws.values():
                gw.stop()
    p50 = {k: pct(v, 50) for k, v in res.items()}
    return p50, res


def paired(port: int, target: str, model: str, text: str, b: int, n: int, runs: int) -> dict:
    gw, gen = [], []
    for _ in range(runs):
        gw.append(gateway_streams(port, model, text, b, n))
        gen.append(generate_streams(target, model, PROMPT, b, n))
    return {"gateway_tok_s": median([r["e2e_tok_s"] for r in gw]),
            "generate_tok_s": median([r["e2e_tok_s"] for r in gen]),
            "gateway_ttft_p50_ms": median([r["ttft_p50_ms"] for r in gw]),
            "generate_ttft_p50_ms": median([r["ttft_p50_ms"] for r in gen]),
            "gateway_runs": gw, "generate_runs": [{k: v for k, v in r.items() if k != "tokens0"} for r in gen]}


def main(argv=None) -> int:
    from ferrum_service.testing.smg_gateway import Gateway, gateway_venv

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--executor", choices=("llama-cpp", "hf"), default="llama-cpp")
    a = ap.parse_args(argv)
    n = 16 if a.quick else 32
    runs = 1 if a.quick else 3
    spec = (f"smollm2-llama,id=smollm2,threads={a.threads}" if a.executor == "llama-cpp"
            else "smollm2-hf,id=smollm2")
    rows, raw = [], {"threads": a.threads, "executor": a.executor, "max_tokens": n, "runs": runs,
                     "load_before": os.getloadavg()}
    print("| row | through SMG tok/s | Generate tok/s | ratio | target | TTFT p50 SMG / Generate (ms) | drift | flag |\n"
          "|---|---|---|---|---|---|---|---|", flush=True)
    venv = gateway_venv()
    # both paths take the same prompt from the prefix cache, as the native Generate does
    with Server(spec, threads=a.threads, name="server-gateway-rows", extra=("--vllm-shared-prefix-cache",)) as srv:
        gw = Gateway(venv, [srv.target], policy="round_robin").start("smollm2", timeout=300)
        try:
            with Client(srv.target) as c:
                text = c.detokenize("smollm2", PROMPT, skip_special_tokens=False)
            raw["gateway_prompt"] = text
            generate_streams(srv.target, "smollm2", PROMPT, 1, 4)  # warm-up, both paths
            gateway_streams(gw.port, "smollm2", text, 1, 4)
            for b in (1, 8, 32):
                r, drift = timed_row(lambda: paired(gw.port, srv.target, "smollm2", text, b, n, runs))
                raw[f"b{b}"] = r
                x = row(f"SMG gateway, {b} concurrent ÷ {b} Generate streams ({a.executor})", r["gateway_tok_s"],
                        r["generate_tok_s"], r["gateway_tok_s"] / r["generate_tok_s"], "≥ 0.9", target_value=0.9,
                        drift=drift, unit="tok/s", ttft_p50_ms={"gateway": r["gateway_ttft_p50_ms"],
                                                                "generate": r["generate_ttft_p50_ms"]},
                        note=f"streamed /v1/completions through SMG ÷ Generate on the same worker, {n} tokens, "
                             f"greedy, {runs} runs per side alternated, medians")
                rows.append(x)
                print(f"| {x['name']} | {x['ours']:.1f} | {x['peer']:.1f} | {x['ratio']:.2f} | {x['target']} | "
                      f"{r['gateway_ttft_p50_ms']:.0f} / {r['generate_ttft_p50_ms']:.0f} | {100 * drift:.0f} % | "
                      f"{'busy' if x['busy'] else ''} |", flush=True)
        finally:
            gw.stop()
    wthreads = max(1, a.threads // 2)  # two workers share the machine
    wspec = (f"smollm2-llama,id=smollm2,threads={wthreads}" if a.executor == "llama-cpp" else "smollm2-hf,id=smollm2")
    (p50, ttfts), drift = timed_row(lambda: routing_row(venv, wspec, wthreads, 1 if a.quick else 2))
    raw["routing"] = ttfts
    x = row(f"SMG cache-aware ÷ round-robin routing over two workers, shared-prefix requests ({a.executor}): "
            "TTFT p50", round(p50["cache_aware"], 1), round(p50["round_robin"], 1),
            p50["round_robin"] / p50["cache_aware"], "≥ 2", target_value=2.0, drift=drift, unit="ms",
            mean_ms={k: round(sum(v) / len(v), 1) for k, v in ttfts.items()},
            note="6 prefixes of ~450 words x 3 questions, one request at a time, fresh texts per round, "
                 "policies alternated; ratio = round-robin TTFT ÷ cache-aware TTFT")
    rows.append(x)
    print(f"| {x['name']} | {x['ours']:.0f} ms | {x['peer']:.0f} ms | {x['ratio']:.2f} | {x['target']} | | "
          f"{100 * drift:.0f} % | {'busy' if x['busy'] else ''} |", flush=True)
    write_rows("gateway_rows", rows, raw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
