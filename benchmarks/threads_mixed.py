"""Threads when llama.cpp and torch executors share one server (issue 14): measured, not guessed.

    .venv/bin/python -m benchmarks.threads_mixed [--runs N] [--seconds S]

Two servers hosting the default pair (SmolLM2 on llama.cpp + all-MiniLM-L6-v2 on torch):

* ``all cores`` — the default: llama.cpp ``threads`` = cores and ``FERRUM_TORCH_THREADS`` = cores;
* ``split``     — llama.cpp ``threads`` = cores // 2, ``FERRUM_TORCH_THREADS`` = cores - that.

For each: Generate B=1 and B=8 alone (steady decode tok/s), MiniLM embeddings alone (16 prompts of
64 tokens per BatchPrefill, prompts/s over ``--seconds``), then Generate B=1 / B=8 *while* the
embedding loop runs (both figures). The two servers are measured alternately, run by run, each
pair of runs between two probes of the reference workload (drift, flagged over 15 %). Writes
``results/threads_mixed.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

from ferrum_client import Client

from .common import Server, median
from .llama_cpp_rows import timed_row
from .schema import DRIFT_LIMIT, row, write_rows
from .remote import generate_streams

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
          8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]


def embed_loop(target: str, stop: threading.Event, seconds: float) -> float:
    """MiniLM BatchPrefills of 16 × 64-token prompts until ``stop`` or ``seconds``; prompts/s."""
    batch = [[101] + [1000 + (37 * i + j) % 20000 for j in range(62)] + [102] for i in range(16)]
    done = 0
    with Client(target, timeout=120) as c:
        t0 = time.perf_counter()
        while not stop.is_set() and time.perf_counter() - t0 < seconds:
            r = c.batch_prefill("minilm", batch)
            for o in r.outputs:
                c.release_cache("minilm", o.cache.cache_id)
            done += len(batch)
        return done / (time.perf_counter() - t0)


def measure(target: str, seconds: float, n: int) -> dict:
    out = {}
    for b in (1, 8):
        out[f"gen_b{b}_alone"] = generate_streams(target, "smollm2", PROMPT, b, n)["steady_tok_s"]
    out["embed_alone"] = embed_loop(target, threading.Event(), seconds)
    for b in (1, 8):
        stop, box = threading.Event(), {}
        t = threading.Thread(target=lambda: box.setdefault("e", embed_loop(target, stop, 600)))
        t.start()
        time.sleep(0.5)  # the embedding loop is running
        out[f"gen_b{b}_with_embed"] = generate_streams(target, "smollm2", PROMPT, b, n)["steady_tok_s"]
        stop.set()
        t.join()
        out[f"embed_with_gen_b{b}"] = box["e"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--tokens", type=int, default=48)
    a = ap.parse_args(argv)
    cores = os.cpu_count() or 1
    half = max(1, cores // 2)
    configs = {"all cores": (cores, cores), "split": (half, max(1, cores - half))}
    raw = {"cores": cores, "load_before": os.getloadavg(), "configs": {k: {"llama_threads": v[0], "torch_threads": v[1]}
                                                                       for k, v in configs.items()}}
    servers = {}
    try:
        for name, (lt, tt) in configs.items():
            s = Server(f"smollm2-llama,id=smollm2,threads={lt}", "minilm", threads=tt,
                       name=f"server-threads-{name.replace(' ', '-')}")
            s.__enter__()
            servers[name] = s
            generate_streams(s.target, "smollm2", PROMPT, 1, 4)  # warm-up
            embed_loop(s.target, threading.Event(), 0.5)
        got = {name: [] for name in configs}

        def runs():
            for r in range(a.runs):
                for name in (list(configs) if r % 2 == 0 else list(configs)[::-1]):
                    got[name].append(measure(servers[name].target, a.seconds, a.tokens))

        _, drift = timed_row(runs)
    finally:
        for s in servers.values():
            s.__exit__(None, None, None)
    raw["runs"] = got
    raw["drift"] = drift
    keys = list(got["all cores"][0])
    print(f"| figure | {' | '.join(f'{k} (llama {v[0]}, torch {v[1]})' for k, v in configs.items())} |")
    print("|---|" + "---|" * len(configs))
    for k in keys:
        unit = "prompts/s" if k.startswith("embed") else "tok/s"
        print(f"| {k} ({unit}) | " + " | ".join(f"{median([r[k] for r in got[n]]):.1f}" for n in configs) + " |")
    print(f"drift {100 * drift:.0f} %{' busy' if drift > DRIFT_LIMIT else ''}")
    (al, at), (sl, st) = configs["all cores"], configs["split"]
    rows = []
    for k in keys:
        ours, peer = median([r[k] for r in got["all cores"]]), median([r[k] for r in got["split"]])
        rows.append(row(f"{k}: every model on all cores ÷ cores split between llama.cpp and torch", ours, peer,
                        ours / peer if peer else None, drift=drift,
                        unit="prompts/s" if k.startswith("embed") else "tok/s", figure=k,
                        note=f"all cores: llama.cpp {al} threads, torch {at}; split: {sl} and {st}; "
                             f"{a.runs} runs per configuration alternated, median; reported (no target)"))
    write_rows("threads_mixed", rows, raw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
