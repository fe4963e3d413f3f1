"""Where a B-stream Generate step's time goes on the llama.cpp executor, against llama.cpp's own
batched decode of B sequences, alternated round by round in one process (issue 39's "8 Generate
streams ÷ llama.cpp batched decode" row).

    python -m benchmarks.llama_cpp_step_split [--streams 8] [--steps 32] [--rounds 4] [--threads 2]

Ours: an in-process server (the scripted client shares the process, as in ``call_path``) with the
``llama-cpp`` executor on the packaged SmolLM2 GGUF (``n_ctx=8192`` as in ``llama_cpp_rows``);
``--streams`` concurrent greedy Generate streams of the same prompt. Every ``llama_decode``,
``execute`` and ``steps.run`` on the worker is timestamped; per B-row step (medians): the period
from one step's start to the next, ``steps.run`` (the executor's ``execute`` with its
``llama_decode``, then sampling and bookkeeping) and the worker's idle time between two steps (the
event loop's turn: the streams' token events and their next steps queued). The peer:
``llama_cpp_rows.llama_batched`` (one ``llama_decode`` of every sequence's token per step, argmax
in numpy). Steady-state aggregate tok/s per side, medians over rounds. A measurement of where the
time goes, not a published row.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients" / "python"))

from .llama_cpp_rows import llama_batched  # noqa: E402
from .remote import generate_streams  # noqa: E402

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
          8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]


class _Probe:
    """Timestamps of the executor's steps (worker side): ``execute`` spans with their
    ``llama_decode`` time and rows, and ``steps.run`` spans."""

    def __init__(self, ex) -> None:
        import ferrum_service.hosting.host as host_mod

        self.execs: list[tuple[float, float, float, int]] = []
        self.runs: list[tuple[float, float, int]] = []
        L, decode, execute, run = ex._decode._L, ex._decode._L.llama_decode, ex.execute, host_mod.run
        acc = [0.0]

        def timed_decode(ctx, batch):
            t = time.perf_counter()
            try:
                return decode(ctx, batch)
            finally:
                acc[0] += time.perf_counter() - t

        def timed_execute(plan):
            acc[0], t0 = 0.0, time.perf_counter()
            try:
                return execute(plan)
            finally:
                self.execs.append((t0, time.perf_counter(), acc[0], len(plan.rows)))

        def timed_run(executor, plan):
            t0 = time.perf_counter()
            try:
                return run(executor, plan)
            finally:
                self.runs.append((t0, time.perf_counter(), len(plan.rows)))

        L.llama_decode, ex.execute, host_mod.run = timed_decode, timed_execute, timed_run

    def clear(self) -> None:
        self.execs.clear()
        self.runs.clear()

    def split(self, rows: int) -> dict:
        """Medians (ms) over the steps of exactly ``rows`` rows."""
        med = statistics.median
        ex = [e for e in self.execs if e[3] == rows]
        rr = [r for r in self.runs if r[2] == rows]
        return {"steps": len(rr), "decode_ms": 1e3 * med(e[2] for e in ex),
                "execute_ms": 1e3 * med(e[1] - e[0] for e in ex), "run_ms": 1e3 * med(r[1] - r[0] for r in rr),
                "idle_ms": 1e3 * med(b[0] - a[1] for a, b in zip(rr, rr[1:])),
                "period_ms": 1e3 * med(b[0] - a[0] for a, b in zip(rr, rr[1:]))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    from ferrum_service.executors.llama_cpp import LlamaCppExecutor
    from ferrum_service.hosting.packaged_models import smollm2_gguf
    from tests.support.servers import InProcessServer

    d, f = smollm2_gguf()
    gguf = str(d / f)
    ex = LlamaCppExecutor(gguf, model_id="llc", threads=a.threads, n_ctx=8192)
    probe = _Probe(ex)
    ours: list[float] = []
    peer: list[float] = []
    splits: list[dict] = []
    with InProcessServer([ex]) as srv:
        generate_streams(srv.target, "llc", PROMPT, a.streams, 8)  # warm-up
        for r in range(a.rounds):
            for side in (("ours", "peer") if r % 2 == 0 else ("peer", "ours")):
                if side == "peer":
                    peer.append(llama_batched(gguf, PROMPT, a.streams, a.steps, a.threads)["tok_s"])
                    continue
                probe.clear()
                ours.append(generate_streams(srv.target, "llc", PROMPT, a.streams, a.steps + 8)["steady_tok_s"])
                splits.append(probe.split(a.streams))
    med = statistics.median
    o, p = med(ours), med(peer)
    s = {k: med(x[k] for x in splits) for k in splits[0]}
    print(f"{a.streams} streams, {a.threads} threads, {a.rounds} rounds alternated")
    print(f"ours {[round(x, 1) for x in ours]} tok/s (median {o:.1f}); peer {[round(x, 1) for x in peer]} "
          f"(median {p:.1f}); ours ÷ peer {o / p:.3f}")
    print(f"ours per {a.streams}-row step, ms: period {s['period_ms']:.2f} = steps.run {s['run_ms']:.2f} (execute "
          f"{s['execute_ms']:.2f}, of it llama_decode {s['decode_ms']:.2f}) + worker idle {s['idle_ms']:.2f}; "
          f"the peer's step {a.streams / p * 1e3:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
