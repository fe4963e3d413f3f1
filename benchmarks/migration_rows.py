"""Live stream migration's pause (issue 31), beside re-prefilling the same context.

    .venv/bin/python -m benchmarks.migration_rows [--quick] [--threads N] [--runs N] [--context N]

Two ``serve`` processes (SmolLM2 on transformers, fp32, CPU) that name each other as KV peers and
share a peer token. One measurement of each side, alternated run by run (the side that goes first
swaps every run):

* **pause**: a greedy ``Generate`` of a ``--context``-token prompt (default 1,024) runs on A; after
  8 tokens the operator's ``MigrateStreams`` moves it to B; the client (following ``migrated`` by
  hand, as ``ferrum_client`` does) times its last token event from A to its first from B.
  That span holds A's hand-off (B's pull of the KV) and B's first decode step.
* **re-prefill**: what a migration without KV costs instead (the Dynamo way): B computes the same
  context (prompt + the 8 tokens) again, prefix cache bypassed, to its first token.

The typical inter-token latency of the stream on A is reported too. Drift: the reference workload of
``llama_cpp_rows`` is timed before and after the whole row; drift > 15 % flags it ``busy`` (do not
publish a busy row). Target: pause p50 < 100 ms on this machine.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import threading
import time
from pathlib import Path

from .common import Server, median, write_rows
from .llama_cpp_rows import DRIFT_LIMIT, timed_row

MODEL = "hf"
MOVE_AT = 8


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def pause_once(a: str, b: str, prompt: list[int], max_tokens: int = 24) -> dict:
    """One moved stream: (pause s, median inter-token s on A, whether the tokens stayed whole)."""
    from ferrum_client import Client, pb

    with Client(a) as ca:
        stream = ca.generate(MODEL, token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, request_id="bench",
                             bypass_prefix_cache=True, follow_migrations=False)
        times, moved, mover = [], None, None
        for ev in stream:
            kind = ev.WhichOneof("event")
            if kind == "token":
                times.append(time.perf_counter())
                if len(times) == MOVE_AT:
                    mover = threading.Thread(target=lambda: ca.migrate_streams(b, request_id="bench"))
                    mover.start()
            elif kind == "migrated":
                moved = ev.migrated
        if moved is None:
            raise RuntimeError("the stream finished before it moved: raise max_tokens")
        t_last_a = times[-1]
        with Client(b) as cb:
            rest = 0
            t_first_b = None
            for ev in cb.stub.Generate(pb.GenerateRequest(model_id=MODEL, resume_token=moved.resume_token)):
                if ev.WhichOneof("event") == "token":
                    rest += 1
                    if t_first_b is None:
                        t_first_b = time.perf_counter()
        mover.join()
    itl = [y - x for x, y in zip(times, times[1:])]
    return {"pause_s": t_first_b - t_last_a, "itl_a_s": median(itl), "whole": len(times) + rest == max_tokens}


def reprefill_once(b: str, context: list[int]) -> float:
    """Seconds for B to compute ``context`` again to its first token (prefix cache bypassed)."""
    from ferrum_client import Client

    with Client(b) as cb:
        t0 = time.perf_counter()
        for ev in cb.generate(MODEL, token_ids=context, max_tokens=1, bypass_prefix_cache=True):
            if ev.WhichOneof("event") == "token":
                return time.perf_counter() - t0
    raise RuntimeError("no token")


def measure(a: str, b: str, context: int, runs: int) -> dict:
    pauses, itls, pre = [], [], []
    for r in range(runs):
        prompt = _prompt(context, r)
        sides = [lambda: pauses.append(pause_once(a, b, prompt)),
                 lambda: pre.append(reprefill_once(b, prompt + _prompt(MOVE_AT, 1000 + r)))]
        for side in (sides if r % 2 == 0 else sides[::-1]):
            side()
    assert all(p["whole"] for p in pauses), "a moved stream lost or repeated tokens"
    ps = [p["pause_s"] for p in pauses]
    return {"pause_p50_ms": 1e3 * _pct(ps, 0.5), "pause_p99_ms": 1e3 * _pct(ps, 0.99),
            "reprefill_p50_ms": 1e3 * _pct(pre, 0.5), "reprefill_p99_ms": 1e3 * _pct(pre, 0.99),
            "itl_a_p50_ms": 1e3 * median([p["itl_a_s"] for p in pauses]), "runs": runs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="5 runs")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads per server")
    ap.add_argument("--model", default="smollm2-hf,id=hf,device=cpu", help="the model spec both servers load")
    a = ap.parse_args(argv)
    runs = 5 if a.quick else a.runs
    raw: dict = {"threads": a.threads, "context": a.context, "load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        tok = Path(tmp) / "peer-token"
        tok.write_text("bench-peer-token\n")
        common = ("--kv-peer", "127.0.0.1:*", "--kv-peer-token-file", str(tok), "--open-admin-rpcs",
                  "--kv-budget-tokens", str(4 * (a.context + 64)))
        with Server(a.model, threads=a.threads, extra=common, name="server-migration-a") as sa, \
                Server(a.model, threads=a.threads, extra=common, name="server-migration-b") as sb:
            pause_once(sa.target, sb.target, _prompt(64, 99))  # warm both sides up
            res, drift = timed_row(lambda: measure(sa.target, sb.target, a.context, runs))
    raw["migration"] = {**res, "drift": drift}
    flag = "busy" if drift > DRIFT_LIMIT else ("met" if res["pause_p50_ms"] < 100 else "missed")
    rows = [(f"pause p50 / p99, {a.context}-token context: moved (last token on A → first from B) vs "
             "re-prefilled on B", f"{res['pause_p50_ms']:.0f} / {res['pause_p99_ms']:.0f} ms",
             f"{res['reprefill_p50_ms']:.0f} / {res['reprefill_p99_ms']:.0f} ms",
             f"{res['pause_p50_ms'] / res['reprefill_p50_ms']:.3f}", "p50 < 100 ms", f"{100 * drift:.0f} %", flag)]
    print("| row | moved | re-prefill | ratio (p50) | target | drift | flag |\n|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {' | '.join(row)} |")
    print(f"inter-token latency on A (p50 of the moved streams): {res['itl_a_p50_ms']:.1f} ms")
    write_rows("migration_rows", rows, raw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
