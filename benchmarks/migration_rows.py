"""Live stream migration's pause (issue 31), with and without the KV pre-copy, beside
re-prefilling the same context.

    .venv/bin/python -m benchmarks.migration_rows [--quick] [--threads N] [--runs N] [--context N]

Three ``serve`` processes (SmolLM2 on transformers, fp32, CPU) that name each other as KV peers and
share a peer token: A1 pre-copies a moving stream's KV (the default, ``--migration-precopy-tokens
256``), A0 never does (``0``), B takes the streams of both. Each run measures three things, in an
order that rotates run by run:

* **pause, pre-copied**: a greedy ``Generate`` of a ``--context``-token prompt (default 1,024) runs
  on A1; after 8 tokens the operator's ``MigrateStreams`` moves it to B. B pulls the KV while the
  stream goes on at A1, and the stream pauses once that pre-copy is done: B then pulls only the
  tokens decoded meanwhile. The client (following ``migrated`` by hand, as ``ferrum_client`` does)
  times its last token event from A1 to its first from B.
* **pause, whole KV**: the same on A0: the stream pauses at once and B pulls all of the KV in the pause.
* **pause, relayed**: the pre-copied move of a stream in relay mode (``migration_mode="relay"``,
  what every ``VllmEngine.Generate`` stream gets): A resumes it on B and sends B's tokens on the
  caller's own stream; the client times the gap from the last token A made (known from the
  move's report: the tokens the cache held at the pause) to the first A relayed from B.
* **re-prefill**: what a migration without KV costs instead (the Dynamo way): B computes the same
  context (prompt + the 8 tokens) again, prefix cache bypassed, to its first token.

What the pause is made of is reported too: A's hand-off (``StreamMigration.handoff_ms``: the
``AcceptMigration`` call, B's pull of the tail and its commit), B's inter-token latency (B runs the
stream's first step as soon as it holds it, while the client reconnects, so at most what is left of
that step adds to the pause), the tokens pre-copied and pulled in the pause, A's inter-token
latency, and the longest gap from the move's request to the pause (A decoding while its KV is
exported; here B's import shares the two cores too). Drift: the reference workload of ``llama_cpp_rows`` is timed before and after
the whole measurement; drift > 15 % flags the rows ``busy`` (do not publish a busy row). Target:
pause p50 < 100 ms on this machine.
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
from .schema import row

MODEL = "hf"
MOVE_AT = 8


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _run_and_move(ca, b: str, prompt: list[int], max_tokens: int, **mode) -> tuple[list[float], object, list, threading.Thread]:
    """A ``Generate`` on ``ca`` moved to ``b`` after ``MOVE_AT`` tokens (``MigrateStreams`` from a
    thread): the caller's token stamps, the ``migrated`` event (None if none came), the move's
    answer (filled by the thread) and the thread."""
    stream = ca.generate(MODEL, token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, request_id="bench",
                         bypass_prefix_cache=True, follow_migrations=False, **mode)
    times, moved, mover, result = [], None, None, []
    for ev in stream:
        kind = ev.WhichOneof("event")
        if kind == "token":
            times.append(time.perf_counter())
            if len(times) == MOVE_AT:
                mover = threading.Thread(target=lambda: result.append(ca.migrate_streams(b, request_id="bench")))
                mover.start()
        elif kind == "migrated":
            moved = ev.migrated
    return times, moved, result, mover


def pause_once(a: str, b: str, prompt: list[int], max_tokens: int = 64) -> dict:
    """One moved stream: pause (s), A's and B's median inter-token s, the hand-off's report, and
    whether the tokens stayed whole."""
    from ferrum_client import Client, pb

    with Client(a) as ca:
        times, moved, result, mover = _run_and_move(ca, b, prompt, max_tokens)
        if moved is None:
            raise RuntimeError("the stream finished before it moved: raise max_tokens")
        t_last_a = times[-1]
        with Client(b) as cb:
            times_b = []
            for ev in cb.stub.Generate(pb.GenerateRequest(model_id=MODEL, resume_token=moved.resume_token)):
                if ev.WhichOneof("event") == "token":
                    times_b.append(time.perf_counter())
        mover.join()
    r = result[0].streams[0]
    itl = [y - x for x, y in zip(times, times[1:])]
    itl_b = [y - x for x, y in zip(times_b, times_b[1:])]
    return {"pause_s": times_b[0] - t_last_a, "itl_a_s": median(itl), "itl_b_s": median(itl_b),
            "precopy_gap_s": _precopy_gap(times, len(times)),
            "handoff_ms": r.handoff_ms, "precopied_tokens": r.precopied_tokens, "paused_tokens": r.paused_tokens,
            "paused_bytes": r.paused_bytes, "tokens_on_a": len(times),
            "whole": len(times) + len(times_b) == max_tokens}


def _precopy_gap(times: list[float], paused_at: int) -> float:
    """The longest gap between the caller's token events from the move's request to the pause
    (the stream decoding on A while its KV is pre-copied; 0 without a pre-copy)."""
    gaps = [y - x for x, y in zip(times[MOVE_AT - 1:paused_at], times[MOVE_AT:paused_at])]
    return max(gaps, default=0.0)


def relay_once(a: str, b: str, prompt: list[int], max_tokens: int = 64) -> dict:
    """One stream moved in relay mode: the caller's pause (from the last token A made to the first
    it relayed from B, as :func:`pause_once` times it), the longest gap while the KV was
    pre-copied, the median inter-token gap after the pause, the hand-off's report, and whether
    the tokens stayed whole."""
    from ferrum_client import Client

    with Client(a) as ca:
        times, moved, result, mover = _run_and_move(ca, b, prompt, max_tokens, migration_mode="relay")
        if moved is not None:
            raise RuntimeError("a relayed stream ended with migrated")
        if mover is not None:
            mover.join()
    if not result or result[0].migrated != 1:
        raise RuntimeError("the stream finished before it moved: raise max_tokens")
    r = result[0].streams[0]
    # The pause: from the last token A made to the first relayed from B. A made the tokens its
    # cache held at the pause (the pre-copied ones and those pulled in the pause) past the
    # prompt, plus the one it had sampled but not fed back.
    at = r.precopied_tokens + r.paused_tokens - len(prompt) + 1
    if not MOVE_AT <= at < len(times):
        raise RuntimeError(f"the pause falls after token {at} of {len(times)}")
    after = [y - x for x, y in zip(times[at:], times[at + 1:])]
    return {"pause_s": times[at] - times[at - 1],
            "itl_a_s": median([y - x for x, y in zip(times[:MOVE_AT], times[1:MOVE_AT])]),
            "itl_b_s": median(after), "precopy_gap_s": _precopy_gap(times, at), "handoff_ms": r.handoff_ms,
            "precopied_tokens": r.precopied_tokens, "paused_tokens": r.paused_tokens, "paused_bytes": r.paused_bytes,
            "tokens_on_a": at, "whole": len(times) == max_tokens}


def reprefill_once(b: str, context: list[int]) -> float:
    """Seconds for B to compute ``context`` again to its first token (prefix cache bypassed)."""
    from ferrum_client import Client

    with Client(b) as cb:
        t0 = time.perf_counter()
        for ev in cb.generate(MODEL, token_ids=context, max_tokens=1, bypass_prefix_cache=True):
            if ev.WhichOneof("event") == "token":
                return time.perf_counter() - t0
    raise RuntimeError("no token")


def _summary(ps: list[dict]) -> dict:
    assert all(p["whole"] for p in ps), "a moved stream lost or repeated tokens"
    pause = [p["pause_s"] for p in ps]
    return {"pause_p50_ms": 1e3 * _pct(pause, 0.5), "pause_p99_ms": 1e3 * _pct(pause, 0.99),
            "handoff_p50_ms": median([p["handoff_ms"] for p in ps]),
            "itl_a_p50_ms": 1e3 * median([p["itl_a_s"] for p in ps]),
            "itl_b_p50_ms": 1e3 * median([p["itl_b_s"] for p in ps]),
            "precopied_tokens_p50": median([p["precopied_tokens"] for p in ps]),
            "paused_tokens_p50": median([p["paused_tokens"] for p in ps]),
            "paused_tokens_max": max(p["paused_tokens"] for p in ps),
            "paused_bytes_p50": median([p["paused_bytes"] for p in ps]),
            "precopy_gap_p50_ms": 1e3 * median([p["precopy_gap_s"] for p in ps]),
            # what the move adds to an ordinary inter-token gap (B's first token costs one step anyway)
            "added_p50_ms": 1e3 * median([p["pause_s"] - p["itl_b_s"] for p in ps]), "runs": ps}


def measure(a1: str, a0: str, b: str, context: int, runs: int) -> dict:
    pre, whole, relayed, rep = [], [], [], []
    for r in range(runs):
        prompt = _prompt(context, r)
        sides = [lambda: pre.append(pause_once(a1, b, prompt)), lambda: whole.append(pause_once(a0, b, prompt)),
                 lambda: relayed.append(relay_once(a1, b, prompt)),
                 lambda: rep.append(reprefill_once(b, prompt + _prompt(MOVE_AT, 1000 + r)))]
        k = r % len(sides)
        for side in sides[k:] + sides[:k]:
            side()
    return {"precopied": _summary(pre), "whole": _summary(whole), "relayed": _summary(relayed),
            "reprefill_p50_ms": 1e3 * _pct(rep, 0.5), "reprefill_p99_ms": 1e3 * _pct(rep, 0.99), "reprefill_s": rep}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="5 runs")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads per server")
    ap.add_argument("--model", default="smollm2-hf,id=hf,device=cpu", help="the model spec the servers load")
    a = ap.parse_args(argv)
    runs = 5 if a.quick else a.runs
    raw: dict = {"threads": a.threads, "context": a.context, "load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        tok = Path(tmp) / "peer-token"
        tok.write_text("bench-peer-token\n")
        common = ("--kv-peer", "127.0.0.1:1024-65535", "--kv-peer-token-file", str(tok), "--open-admin-rpcs",
                  "--kv-budget-tokens", str(4 * (a.context + 64)))
        with Server(a.model, threads=a.threads, extra=common, name="server-migration-b") as sb, \
                Server(a.model, threads=a.threads, extra=(*common, "--migration-precopy-tokens", "256"),
                       name="server-migration-a1") as sa1, \
                Server(a.model, threads=a.threads, extra=(*common, "--migration-precopy-tokens", "0"),
                       name="server-migration-a0") as sa0:
            for sa in (sa1, sa0):  # warm every side up (a pre-copy too)
                pause_once(sa.target, sb.target, _prompt(300, 99))
            res, drift = timed_row(lambda: measure(sa1.target, sa0.target, sb.target, a.context, runs))
    raw["migration"] = {**res, "drift": drift}
    pre, whole, relayed = res["precopied"], res["whole"], res["relayed"]
    rep50, rep99 = res["reprefill_p50_ms"], res["reprefill_p99_ms"]
    ctx = f"{a.context:,}-token context"
    note = (f"{a.threads} threads per server, greedy, SmolLM2 fp32 on transformers, {runs} runs alternated; "
            "pause = last token event from A to first from B, as the client sees it")
    rows = [
        row(f"pause p50 / p99 of a moved stream, {ctx}, KV pre-copied (tail at the pause) ÷ re-prefilled on B",
            f"{pre['pause_p50_ms']:.0f} / {pre['pause_p99_ms']:.0f} ms", f"{rep50:.0f} / {rep99:.0f} ms",
            pre["pause_p50_ms"] / rep50, "p50 < 100 ms", met=pre["pause_p50_ms"] < 100, drift=drift, note=note,
            pause_p50_ms=pre["pause_p50_ms"], handoff_p50_ms=pre["handoff_p50_ms"], itl_b_p50_ms=pre["itl_b_p50_ms"],
            added_p50_ms=pre["added_p50_ms"],
            precopied_tokens_p50=pre["precopied_tokens_p50"], paused_tokens_p50=pre["paused_tokens_p50"],
            paused_bytes_p50=pre["paused_bytes_p50"], precopy_gap_p50_ms=pre["precopy_gap_p50_ms"]),
        row(f"pause p50 / p99 of a moved stream, {ctx}, whole KV pulled in the pause ÷ re-prefilled on B",
            f"{whole['pause_p50_ms']:.0f} / {whole['pause_p99_ms']:.0f} ms", f"{rep50:.0f} / {rep99:.0f} ms",
            whole["pause_p50_ms"] / rep50, "p50 < 100 ms", met=whole["pause_p50_ms"] < 100, drift=drift, note=note,
            pause_p50_ms=whole["pause_p50_ms"], handoff_p50_ms=whole["handoff_p50_ms"],
            itl_b_p50_ms=whole["itl_b_p50_ms"], added_p50_ms=whole["added_p50_ms"],
            paused_tokens_p50=whole["paused_tokens_p50"],
            paused_bytes_p50=whole["paused_bytes_p50"]),
        row(f"pause p50 / p99 of a stream moved in relay mode (A sends B's tokens), {ctx}, KV pre-copied "
            "÷ re-prefilled on B",
            f"{relayed['pause_p50_ms']:.0f} / {relayed['pause_p99_ms']:.0f} ms", f"{rep50:.0f} / {rep99:.0f} ms",
            relayed["pause_p50_ms"] / rep50, "p50 < 100 ms", met=relayed["pause_p50_ms"] < 100, drift=drift,
            note=note.replace("first from B", "first A relayed from B"),
            pause_p50_ms=relayed["pause_p50_ms"], handoff_p50_ms=relayed["handoff_p50_ms"],
            itl_b_p50_ms=relayed["itl_b_p50_ms"], added_p50_ms=relayed["added_p50_ms"],
            precopied_tokens_p50=relayed["precopied_tokens_p50"], paused_tokens_p50=relayed["paused_tokens_p50"],
            paused_bytes_p50=relayed["paused_bytes_p50"], precopy_gap_p50_ms=relayed["precopy_gap_p50_ms"]),
    ]
    print("| row | moved | re-prefill | ratio (p50) | target | drift | flag |\n|---|---|---|---|---|---|---|")
    for x in rows:
        flag = "busy" if x["busy"] else ("met" if x["met"] else "missed")
        print(f"| {x['name']} | {x['ours']} | {x['peer']} | {x['ratio']:.3f} | {x['target']} | "
              f"{100 * drift:.0f} % | {flag} |")
    for name, r in (("pre-copied", pre), ("whole KV", whole), ("relayed", relayed)):
        print(f"{name}: hand-off p50 {r['handoff_p50_ms']:.0f} ms (AcceptMigration: tail pull + commit), "
              f"B inter-token p50 {r['itl_b_p50_ms']:.0f} ms (pause − B's inter-token: {r['added_p50_ms']:.0f} ms), "
              f"A inter-token p50 {r['itl_a_p50_ms']:.0f} ms (longest gap from the move's request to the pause "
              f"p50 {r['precopy_gap_p50_ms']:.0f} ms), "
              f"tokens pre-copied p50 {r['precopied_tokens_p50']:.0f}, pulled in the pause p50 "
              f"{r['paused_tokens_p50']:.0f} (max {r['paused_tokens_max']}), {r['paused_bytes_p50'] / 1e6:.2f} MB")
    write_rows("migration_rows", rows, raw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
