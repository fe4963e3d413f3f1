"""The llama.cpp executor's rows (issue 14), each timed between two runs of a fixed reference
workload so a row measured while the machine's speed moved is flagged instead of published.

    .venv/bin/python -m benchmarks.llama_cpp_rows [--quick] [--threads N] [--only peers|grid] [--runs N]

Rows:

* Generate B=1 (llama-cpp executor, served) ÷ llama-cpp-python's own ``create_completion`` (same
  GGUF, same threads, same prompt, greedy, decode tok/s from token timestamps), target ≥ 0.9;
* aggregate steady-state tok/s of 8 / 16 / 32 Generate streams ÷ llama.cpp's own batched decode of
  as many sequences (low-level API here: one ``llama_batch`` of B sequence ids per step, greedy),
  target ≥ 0.9;
* Generate B=1 llama-cpp executor ÷ transformers executor (same file, same prompt), target ≥ 4×;
* both executors at 1 / 8 / 32 Generate streams and at 32 and 1,536 tokens of context (reported):
  steady-state aggregate decode tok/s of B streams whose prompts are C tokens long, the llama.cpp
  and transformers servers run alternately, run by run (``--runs``, default 2; median per side),
  each pair of runs between two probes of the reference workload. The prompts join the running
  decodes in chunks (the batcher's ``prefill_tokens_per_step``), so each stream decodes
  ⌈B·C / 512⌉ + ``steps`` tokens: the steady window (all B streams decoding) then holds about
  ``steps`` steps at a context of C + what was decoded so far.

Drift: the reference workload (a fixed float32 matmul loop) is timed before and after each row;
``drift`` = |after − before| ÷ before; rows with drift > 15 % are flagged ``busy``.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from .common import Server, median
from .remote import generate_streams
from .schema import DRIFT_LIMIT, row, write_rows  # noqa: F401 - DRIFT_LIMIT re-exported for the scripts


def reference_workload(repeats: int = 5) -> float:
    """Median seconds of a fixed CPU workload (256×256 float32 matmuls), a probe of machine speed."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((256, 256), dtype=np.float32)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x = a
        for _ in range(60):
            x = np.tanh(x @ a)
        times.append(time.perf_counter() - t0)
    return median(times)


#: Seconds a probe waits after llama.cpp work: its compute threads keep polling for work a while
#: after a step, and a probe taken at once read 40-80 % slow on a quiet machine (22.0 vs 13.7 ms).
SETTLE_S = 2.0


def settled_reference_workload() -> float:
    """:func:`reference_workload` once the llama.cpp work just run has gone quiet."""
    time.sleep(SETTLE_S)
    return reference_workload()


def timed_row(fn):
    """(result, drift): ``fn()`` between two reference-workload probes."""
    before = reference_workload()
    out = fn()
    after = settled_reference_workload()
    return out, abs(after - before) / before


def create_completion_b1(gguf: str, prompt: list[int], n: int, threads: int) -> dict:
    """llama-cpp-python's own high-level ``create_completion`` (stream), greedy, B=1."""
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False,
                flash_attn=True)
    rates = []
    for _ in range(2):
        stamps = []
        for _chunk in llm.create_completion(prompt, max_tokens=n, temperature=0.0, top_k=1, repeat_penalty=1.0,
                                            stream=True):
            stamps.append(time.perf_counter())
        if len(stamps) > 2:
            rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    del llm
    return {"decode_tok_s": median(rates)}


def llama_batched(gguf: str, prompt: list[int], b: int, steps: int, threads: int) -> dict:
    """llama.cpp's own batched decode: ``b`` sequences prefilled, then ``steps`` steps of one
    ``llama_decode`` holding one token of every sequence (greedy); steady-state aggregate tok/s."""
    import llama_cpp.llama_cpp as L

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(gguf.encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx = b * (len(prompt) + steps + 1)
    cp.n_batch = max(512, b)
    cp.n_seq_max = b
    cp.n_threads = cp.n_threads_batch = threads
    cp.kv_unified = True
    ctx = L.llama_init_from_model(model, cp)
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(max(len(prompt), b), 0, 1)

    def fill(items):  # items: (token, pos, seq, want_logits)
        for i, (t, p, s, w) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, p, 1
            batch.seq_id[i][0] = s
            batch.logits[i] = w
        batch.n_tokens = len(items)
        assert L.llama_decode(ctx, batch) == 0

    def argmax(i):
        return int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(vocab,)).argmax())

    last = []
    for s in range(b):
        fill([(t, p, s, int(p == len(prompt) - 1)) for p, t in enumerate(prompt)])
        last.append(argmax(len(prompt) - 1))
    t0 = time.perf_counter()
    for k in range(steps):
        fill([(last[s], len(prompt) + k, s, 1) for s in range(b)])
        last = [argmax(s) for s in range(b)]
    dt = time.perf_counter() - t0
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return {"b": b, "steps": steps, "tok_s": b * steps / dt}


CONTEXTS = (32, 1536)
STREAMS = (1, 8, 32)


def context_prompt(n: int, salt: int = 0) -> list[int]:
    """A fixed prompt of exactly ``n`` tokens (ordinary vocabulary ids of SmolLM2, BOS first)."""
    return [1] + [100 + (7919 * (i + salt) + 13 * salt) % 40000 for i in range(n - 1)]


def context_grid(gguf: str, th: int, steps: int, runs: int, add_grid, raw: dict,
                 contexts=CONTEXTS, streams=STREAMS) -> None:
    """Both executors at 1 / 8 / 32 streams × 32 / 1,536 tokens of context, alternated run by run."""
    budget = max(streams) * (max(contexts) + max(streams) * max(contexts) // 512 + steps + 64)
    llc_spec = f"llama-cpp,id=llc,path={gguf},threads={th},n_ctx={budget}"
    hf_spec = f"smollm2-hf,id=hf,kv_budget_tokens={budget}"
    with Server(llc_spec, threads=th, name="server-llama-cpp-grid") as llc, \
            Server(hf_spec, threads=th, name="server-hf-grid") as hf:
        sides = (("llama-cpp", llc.target, "llc"), ("transformers", hf.target, "hf"))
        for _, target, mid in sides:  # warm-up (first-call allocations, both contexts)
            for ctx in contexts:
                generate_streams(target, mid, context_prompt(ctx), 1, 2)
        for ctx in contexts:
            for b in streams:
                n = -(-b * ctx // 512) + steps
                prompt = context_prompt(ctx)
                got: dict[str, list[dict]] = {name: [] for name, _, _ in sides}

                def pair():
                    for r in range(runs):  # alternate the two sides, starting side swapped each run
                        order = sides if r % 2 == 0 else sides[::-1]
                        for name, target, mid in order:
                            got[name].append(generate_streams(target, mid, prompt, b, n))

                _, drift = timed_row(pair)
                cell = {}
                for name, _, _ in sides:
                    recs = got[name]
                    cell[name] = {"steady_tok_s": median([x["steady_tok_s"] for x in recs]),
                                  "runs": [round(x["steady_tok_s"], 1) for x in recs],
                                  "itl_p50_ms": median([x["itl_p50_ms"] for x in recs]),
                                  "ttft_p50_ms": median([x["ttft_p50_ms"] for x in recs]),
                                  "all_complete": all(x["all_complete"] for x in recs), "max_tokens": n}
                raw[f"grid_c{ctx}_b{b}"] = {**cell, "drift": drift}
                add_grid(ctx, b, cell["llama-cpp"], cell["transformers"], drift)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--only", choices=["peers", "grid"], default=None,
                    help="peers: the rows against llama.cpp's own API and transformers B=1; grid: streams × context")
    ap.add_argument("--runs", type=int, default=None, help="grid: runs per side and cell (default 2, --quick 1)")
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="grid: prompt lengths (comma-separated)")
    ap.add_argument("--streams", default=",".join(map(str, STREAMS)), help="grid: stream counts (comma-separated)")
    a = ap.parse_args(argv)
    from ferrum_service.hosting.packaged_models import smollm2_gguf

    d, f = smollm2_gguf()
    gguf = str(d / f)
    th = a.threads
    n = 24 if a.quick else 64
    steps = 12 if a.quick else 32
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
              8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
    rows, raw = [], {"threads": th, "load_before": os.getloadavg()}

    def add(name, ours, base, target, target_value, drift):
        x = row(name, ours, base, ours / base if base else None, target, target_value=target_value, drift=drift,
                unit="tok/s", note=f"{th} threads, greedy, same GGUF and prompt")
        rows.append(x)
        ratio = "—" if x["ratio"] is None else f"{x['ratio']:.2f}"
        print(f"| {name} | {ours:.1f} | {base:.1f} | {ratio} | {target} | {100 * drift:.0f} % | "
              f"{'busy' if x['busy'] else ''} |", flush=True)

    def add_grid(ctx, b, llc, hf, drift):
        ratio = llc["steady_tok_s"] / hf["steady_tok_s"] if hf["steady_tok_s"] else None
        rows.append(row(f"{b} Generate streams at {ctx:,} tokens of context: llama-cpp ÷ transformers executor",
                        llc["steady_tok_s"], hf["steady_tok_s"], ratio, drift=drift, unit="tok/s", context=ctx,
                        streams=b, itl_p50_ms={"llama-cpp": llc["itl_p50_ms"], "transformers": hf["itl_p50_ms"]},
                        note="steady-state aggregate decode tok/s, the two servers alternated run by run, median; "
                             "reported (no target)"))
        print(f"| {ctx:,} | {b} | {llc['steady_tok_s']:.1f} | {hf['steady_tok_s']:.1f} | "
              f"{'—' if ratio is None else f'{ratio:.2f}'} | {llc['itl_p50_ms']:.0f} / {hf['itl_p50_ms']:.0f} | "
              f"{100 * drift:.0f} % | {'busy' if drift > DRIFT_LIMIT else ''} |", flush=True)

    if a.only != "grid":
        peer_rows(gguf, th, n, steps, prompt, add, raw)
    if a.only != "peers":
        print("| context tokens | streams | llama-cpp tok/s | transformers tok/s | llama-cpp ÷ transformers "
              "| ITL p50 ms (llama-cpp / transformers) | drift | flag |\n|---|---|---|---|---|---|---|---|")
        context_grid(gguf, th, 16 if a.quick else 32, a.runs or (1 if a.quick else 2), add_grid, raw,
                     tuple(int(x) for x in a.contexts.split(",")), tuple(int(x) for x in a.streams.split(",")))
    write_rows("llama_cpp_rows" if a.only is None else f"llama_cpp_rows_{a.only}", rows, raw)
    return 0


def peer_rows(gguf, th, n, steps, prompt, add, raw) -> None:
    print("| row | ours tok/s | peer tok/s | ratio | target | drift | flag |\n|---|---|---|---|---|---|---|")
    with Server(f"llama-cpp,id=llc,path={gguf},threads={th},n_ctx=8192", threads=th, name="server-llama-cpp") as srv:
        generate_streams(srv.target, "llc", prompt, 1, 4)  # warm-up
        ours, d1 = timed_row(lambda: generate_streams(srv.target, "llc", prompt, 1, n))
        peer, d2 = timed_row(lambda: create_completion_b1(gguf, prompt, n, th))
        raw["b1"] = {"ours": ours, "peer": peer}
        llc_b1 = ours["steady_tok_s"]
        add("Generate B=1 ÷ llama-cpp-python create_completion", llc_b1, peer["decode_tok_s"], "≥ 0.9", 0.9,
            max(d1, d2))
        for b in (8, 16, 32):
            ours, d1 = timed_row(lambda: generate_streams(srv.target, "llc", prompt, b, steps + 8))
            peer, d2 = timed_row(lambda: llama_batched(gguf, prompt, b, steps, th))
            raw[f"b{b}"] = {"ours": ours, "peer": peer}
            add(f"{b} Generate streams ÷ llama.cpp batched decode of {b} sequences", ours["steady_tok_s"],
                peer["tok_s"], "≥ 0.9", 0.9, max(d1, d2))
    with Server("smollm2-hf,id=hf", threads=th, name="server-hf") as srv:
        generate_streams(srv.target, "hf", prompt, 1, 4)
        hf, d = timed_row(lambda: generate_streams(srv.target, "hf", prompt, 1, n))
        raw["hf_b1"] = hf
        add("Generate B=1 llama-cpp executor ÷ transformers executor", llc_b1, hf["steady_tok_s"], "≥ 4×", 4.0, d)


if __name__ == "__main__":
    raise SystemExit(main())
