"""LoRA adapters (issue 17): Generate tok/s of a batch of streams mixing 4 adapters ÷ the same batch
without adapters (target ≥ 0.7), on SmolLM2-135M through the transformers executor (the one that
serves adapters), served as a subprocess.

    .venv/bin/python -m benchmarks.lora_rows [--quick] [--streams 8] [--rank 16] [--threads N]

The adapters are random rank-``--rank`` LoRAs on every linear layer of every decoder layer (q, k,
v, o, gate, up, down: the common fine-tuning target), written by PEFT into a temporary directory
and preloaded with ``--adapter``. The mixed side gives stream ``i`` adapter ``i % 4``; the plain side
runs the same streams on the base model. Both sample (temperature 0.8, seeded) exactly
``max_tokens`` tokens (``ignore_eos``) from the same prompt, so both run the same steps with every
stream in the batch. tok/s = generated tokens ÷ wall time of the whole batch; the two sides
alternate, three rounds, median. Each row is timed between two runs of ``reference_workload()``
(drift > 15 % = ``busy``). Writes ``results/lora_rows.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from .common import Server, median, sampled_batch
from .llama_cpp_rows import timed_row
from .schema import row as result_row
from .schema import write_rows

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
ADAPTERS = 4
TARGET = 0.7


def _run(target: str, streams: int, max_tokens: int, mixed: bool, seed0: int) -> tuple[int, float]:
    return sampled_batch(target, "smollm2", PROMPT, streams, max_tokens, seed0,
                         lambda i: {"adapter": f"a{i % ADAPTERS}"} if mixed else {})


def row(target: str, streams: int, max_tokens: int, rounds: int) -> dict:
    _run(target, streams, 4, True, 0)  # read every adapter's weights once and warm both paths
    _run(target, streams, 4, False, 0)
    rates = {True: [], False: []}
    for r in range(rounds):
        for mixed in ((True, False) if r % 2 else (False, True)):
            n, dt = _run(target, streams, max_tokens, mixed, 100 * r)
            rates[mixed].append(n / dt)
    return {"streams": streams, "mixed_tok_s": median(rates[True]), "plain_tok_s": median(rates[False]),
            "ratio": median(rates[True]) / median(rates[False]), "rates": rates}


def build_adapters(out: Path, rank: int) -> list[str]:
    from ferrum_service.hosting.packaged_models import smollm2_gguf
    from ferrum_service.testing.tiny_adapters import build_lora_adapter

    d, f = smollm2_gguf()
    flags = []
    for k in range(ADAPTERS):
        t0 = time.perf_counter()
        ad = build_lora_adapter(d, out / f"a{k}", seed=k, rank=rank, alpha=2.0 * rank, gguf_file=f)
        print(f"adapter a{k}: rank {rank}, written in {time.perf_counter() - t0:.1f} s", flush=True)
        flags += ["--adapter", f"smollm2:a{k}={ad}"]
    return flags


def to_row(rec: dict, date: str | None = None) -> dict:
    """The results row of one measurement (``streams``, ``mixed_tok_s``, ``plain_tok_s``,
    ``ratio``, ``rates`` per side, ``drift``)."""
    rates = {str(k).lower(): v for k, v in rec["rates"].items()}
    return result_row(f"Generate, {rec['streams']} streams mixing {ADAPTERS} LoRA adapters ÷ the same streams "
                      "without adapters", rec["mixed_tok_s"], rec["plain_tok_s"], rec["ratio"], f"≥ {TARGET}",
                      target_value=TARGET, drift=rec["drift"], date=date, unit="tok/s", streams=rec["streams"],
                      rates={"mixed": rates["true"], "plain": rates["false"]},
                      note="sampled, ignore_eos, sides alternated, median of the rounds")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--streams", type=int, nargs="*", default=[8])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    max_tokens, rounds = (16, 1) if a.quick else (64, 3)
    load_before = os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory(prefix="ferrum-lora-bench-") as tmp:
        flags = build_adapters(Path(tmp), a.rank)
        spec = f"smollm2-hf,id=smollm2,max_adapters={ADAPTERS}"
        with Server(spec, threads=a.threads, extra=tuple(flags), name="lora_rows") as srv:
            for streams in a.streams:
                out, drift = timed_row(lambda: row(srv.target, streams, max_tokens, rounds))
                out["drift"] = drift
                results.append(to_row(out))
    print(f"| streams | {ADAPTERS} adapters mixed tok/s | no adapters tok/s | ratio | target | drift |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['extra']['streams']} | {r['ours']:.1f} | {r['peer']:.1f} | {r['ratio']:.2f} | {r['target']} | "
              f"{100 * r['drift']:.0f} %{' (busy)' if r['busy'] else ''} |")
    write_rows("lora_rows", results, {"rank": a.rank, "max_tokens": max_tokens, "rounds": rounds,
                                      "threads": a.threads, "load_before": load_before})


if __name__ == "__main__":
    main()
