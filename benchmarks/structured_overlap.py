"""Structured output: masks computed during the forward (``guided.prepare_masks`` on the mask
thread) vs after it, in one process, on the same model and caches.

    .venv/bin/python -m benchmarks.structured_overlap [--spec llama|hf] [--steps 48] [--rounds 4]

A two-server A/B of this setting moved ±15 % with which server ran second (llama.cpp's worker
threads spin a while after a step and take cores from the next process), so this measures the two
ways inside one server: ``steps.run`` of decode plans (the path Generate, Decode and
BatchDecode take) of 1 and 8 JSON-schema-constrained sequences of SmolLM2, sampling seeded, with
``guided.OVERLAP`` flipped between "1" and "0" every round. ms per step, medians; drift-probed.
Prints a Markdown table and writes ``results/structured_overlap.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from .llama_cpp_rows import reference_workload
from .schema import DRIFT_LIMIT, row, write_rows
from .structured_rows import PROMPT, SCHEMA


def _load(spec: str):
    from ferrum_service.hosting.packaged_models import smollm2_gguf

    d, f = smollm2_gguf()
    if spec == "hf":
        from ferrum_service.executors.transformers import HfCausalLmExecutor

        return HfCausalLmExecutor.from_path(str(d / f), model_id="smollm2", device="cpu")
    from ferrum_service.executors.llama_cpp import LlamaCppExecutor

    return LlamaCppExecutor(str(d / f), model_id="smollm2", threads=os.cpu_count() or 1, n_ctx=8192, n_seq=16)


def run(host, rows: int, steps: int, overlap: str, seed: int) -> float:
    """ms per constrained decode step of ``rows`` sequences (the prompt prefilled first)."""
    from ferrum_service.core import guided
    from ferrum_service.core.steps import StepPlan, StepRow
    from ferrum_service.core.steps import run as run_step
    from ferrum_service.core.types import ConstraintSpec, DecodeInput, LogitsPolicy, PrefillInput, SamplingParams

    ex = host.executor
    reg = ex.registry
    spec = ConstraintSpec("json_schema", json.dumps(SCHEMA))
    compiled = guided.guides_of(ex).compile(spec, "constraint")
    text = ex.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                            tokenize=False)
    prompt = list(ex.tokenizer.encode(text, add_special_tokens=False))
    policies = [LogitsPolicy(sampling=SamplingParams(temperature=0.8, seed=seed + i, constraint=spec,
                                                     compiled=compiled)) for i in range(rows)]
    res = run_step(ex, StepPlan([StepRow.prompt(PrefillInput(token_ids=prompt, policy=p, bypass_prefix_cache=True),
                                                 None) for p in policies]))
    caches = [o.cache.cache_id for o in res.outputs]
    toks = [r.token_id for r in res.rows]
    guided.OVERLAP = overlap
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            res = run_step(ex, StepPlan([StepRow.decode(DecodeInput(cache_id=c, token_id=t, policy=p), reg.get(c),
                                                        "inputs") for c, t, p in zip(caches, toks, policies)]))
            toks = [r.token_id for r in res.rows]
        return 1000 * (time.perf_counter() - t0) / steps
    finally:
        for c in caches:
            ex.release_cache(c)


def to_row(rec: dict, date: str | None = None) -> dict:
    """The results row of one measurement (``executor``, ``streams``, ``overlap_ms``,
    ``serial_ms``, ``ratio``, ``drift``, ``ms`` per setting). Reported only: no target."""
    return row(f"structured output, {rec['streams']} constrained sequences ({rec['executor']}): step with masks "
               "after the forward ÷ masks during it (ms per step)", rec["overlap_ms"], rec["serial_ms"], rec["ratio"],
               drift=rec["drift"], date=date, unit="ms/step", executor=rec["executor"], streams=rec["streams"],
               ms={"overlap": rec["ms"]["1"], "serial": rec["ms"]["0"]},
               note="ours = masks during the forward, peer = after it; ratio = after ÷ during; "
                    "steps.run decode plans in one process, the setting flipped every round, medians")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", choices=("llama", "hf"), default="llama")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    from ferrum_service.hosting.host import ModelHost

    host = ModelHost("smollm2", _load(a.spec))
    load_before = os.getloadavg()
    rows_out = []
    print("| executor | streams | masks during the forward ms/step | masks after it ms/step | after ÷ during | drift |")
    print("|---|---|---|---|---|---|")
    for rows in (1, 8):
        run(host, rows, 4, "1", 0)  # warm: compile, first masks
        ms = {"1": [], "0": []}
        before = reference_workload()
        for r in range(a.rounds):
            for ov in (("1", "0") if r % 2 else ("0", "1")):
                ms[ov].append(run(host, rows, a.steps, ov, 100 * r))
        drift = abs(reference_workload() - before) / before
        on, off = statistics.median(ms["1"]), statistics.median(ms["0"])
        rows_out.append(to_row({"executor": a.spec, "streams": rows, "overlap_ms": on, "serial_ms": off,
                                "ratio": off / on, "drift": drift, "ms": ms}))
        print(f"| {a.spec} | {rows} | {on:.1f} | {off:.1f} | {off / on:.2f} | {100 * drift:.0f} %"
              f"{' (busy)' if drift > DRIFT_LIMIT else ''} |", flush=True)
    write_rows(f"structured_overlap-{a.spec}", rows_out, {"steps": a.steps, "rounds": a.rounds,
                                                         "load_before": load_before})


if __name__ == "__main__":
    main()
