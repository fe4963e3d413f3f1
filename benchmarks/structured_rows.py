"""Structured output (issue 17): Generate tok/s with a JSON-schema constraint ÷ the same Generate
without one, at 1 and 8 concurrent streams (target ≥ 0.85), on the default SmolLM2 executor
(llama.cpp on CPU), served as a subprocess.

    .venv/bin/python -m benchmarks.structured_rows [--quick] [--spec smollm2-llama] [--threads N]

Both sides sample (temperature 0.8, seeded) from the same chat prompt and generate exactly
``max_tokens`` tokens (``ignore_eos``: a finished JSON value then allows only the end token, which
is sampled again until the length is reached), so both sides run the same number of steps with all
streams in the batch and the ratio is the per-token cost of the masks. tok/s = generated tokens ÷ wall time of
the whole batch of streams; the two sides alternate, three rounds, median. Each row is timed
between two runs of ``reference_workload()`` (drift > 15 % = ``busy``). Writes
``results/structured_rows.json`` and prints a Markdown table and the load average.

Masks computed during the forward vs after it: ``benchmarks/structured_overlap.py`` (in one process;
a two-server A/B of that setting moved with which server ran second).
"""

from __future__ import annotations

import argparse
import os

from .common import Server, median, sampled_batch
from .llama_cpp_rows import timed_row
from .schema import row as result_row
from .schema import write_rows

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "items": {"type": "array", "maxItems": 40, "items": {"type": "string", "maxLength": 24}}},
    "required": ["title", "items"]}
PROMPT = "List many fruits and vegetables as JSON with a title and an items array."


def _run(target: str, streams: int, max_tokens: int, constrained: bool, seed0: int) -> tuple[int, float]:
    from ferrum_client import messages as m

    cons = m.constraint(json_schema=SCHEMA) if constrained else None
    return sampled_batch(target, "smollm2", PROMPT, streams, max_tokens, seed0, lambda i: {"constraint": cons})


def row(target: str, streams: int, max_tokens: int, rounds: int) -> dict:
    _run(target, streams, 8, True, 0)  # compile the schema and warm both paths
    rates = {True: [], False: []}
    toks = {True: [], False: []}
    for r in range(rounds):
        for constrained in ((True, False) if r % 2 else (False, True)):
            n, dt = _run(target, streams, max_tokens, constrained, 100 * r)
            rates[constrained].append(n / dt)
            toks[constrained].append(n / streams)
    return {"streams": streams, "constrained_tok_s": median(rates[True]), "plain_tok_s": median(rates[False]),
            "ratio": median(rates[True]) / median(rates[False]),
            "tokens_per_stream": {"constrained": median(toks[True]), "plain": median(toks[False])}}


TARGET = 0.85


def to_row(rec: dict, date: str | None = None) -> dict:
    """The results row of one measurement (``streams``, ``constrained_tok_s``, ``plain_tok_s``,
    ``ratio``, ``tokens_per_stream``, ``drift``)."""
    return result_row(f"Generate with a JSON-schema constraint ÷ without, {rec['streams']} streams",
                      rec["constrained_tok_s"], rec["plain_tok_s"], rec["ratio"], f"≥ {TARGET}", target_value=TARGET,
                      drift=rec["drift"], date=date, unit="tok/s", streams=rec["streams"],
                      tokens_per_stream=rec["tokens_per_stream"],
                      note="sampled, ignore_eos, sides alternated, median of the rounds")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--spec", default="smollm2-llama")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    max_tokens, rounds = (48, 1) if a.quick else (96, 3)
    results = []
    load_before = os.getloadavg()
    with Server(a.spec, threads=a.threads, name="structured_rows") as srv:
        for streams in (1, 8):
            out, drift = timed_row(lambda: row(srv.target, streams, max_tokens, rounds))
            out["drift"] = drift
            results.append(to_row(out))
    print("| streams | JSON schema tok/s | plain tok/s | ratio | target | drift |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['extra']['streams']} | {r['ours']:.1f} | {r['peer']:.1f} | {r['ratio']:.2f} | {r['target']} | "
              f"{100 * r['drift']:.0f} %{' (busy)' if r['busy'] else ''} |")
    write_rows("structured_rows", results, {"spec": a.spec, "max_tokens": max_tokens, "rounds": rounds,
                                            "load_before": load_before})


if __name__ == "__main__":
    main()
