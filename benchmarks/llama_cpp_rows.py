"""The llama.cpp executor's rows (issue 14), each timed between two runs of a fixed reference
workload so a row measured while the machine's speed moved is flagged instead of published.

    .venv/bin/python -m benchmarks.llama_cpp_rows [--quick] [--threads N]

Rows:

* Generate B=1 (llama-cpp executor, served) ÷ llama-cpp-python's own ``create_completion`` (same
  GGUF, same threads, same prompt, greedy, decode tok/s from token timestamps), target ≥ 0.9;
* aggregate steady-state tok/s of 8 / 16 / 32 Generate streams ÷ llama.cpp's own batched decode of
  as many sequences (low-level API here: one ``llama_batch`` of B sequence ids per step, greedy),
  target ≥ 0.9;
* Generate B=1 llama-cpp executor ÷ transformers executor (same file, same prompt), target ≥ 4×.

Drift: the reference workload (a fixed float32 matmul loop) is timed before and after each row;
``drift`` = |after − before| ÷ before; rows with drift > 15 % are flagged ``busy``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time

import numpy as np

from .common import REPO, Server, median
from .remote import generate_streams

DRIFT_LIMIT = 0.15


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


def timed_row(fn):
    """(result, drift): ``fn()`` between two reference-workload probes."""
    before = reference_workload()
    out = fn()
    after = reference_workload()
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args(argv)
    from ferrum_service.packaged_models import smollm2_gguf

    d, f = smollm2_gguf()
    gguf = str(d / f)
    th = a.threads
    n = 24 if a.quick else 64
    steps = 12 if a.quick else 32
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
              8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
    rows, raw = [], {"threads": th, "load_before": os.getloadavg()}

    def add(name, ours, base, target, drift):
        ratio = ours / base if base else float("nan")
        flag = "busy" if drift > DRIFT_LIMIT else ""
        rows.append((name, f"{ours:.1f}", f"{base:.1f}", f"{ratio:.2f}", target, f"{100 * drift:.0f} %", flag))
        print(f"| {' | '.join(rows[-1])} |", flush=True)

    print("| row | ours tok/s | peer tok/s | ratio | target | drift | flag |\n|---|---|---|---|---|---|---|")
    with Server(f"llama-cpp,id=llc,path={gguf},threads={th},n_ctx=8192", threads=th, name="server-llama-cpp") as srv:
        generate_streams(srv.target, "llc", prompt, 1, 4)  # warm-up
        ours, d1 = timed_row(lambda: generate_streams(srv.target, "llc", prompt, 1, n))
        peer, d2 = timed_row(lambda: create_completion_b1(gguf, prompt, n, th))
        raw["b1"] = {"ours": ours, "peer": peer}
        llc_b1 = ours["steady_tok_s"]
        add("Generate B=1 ÷ llama-cpp-python create_completion", llc_b1, peer["decode_tok_s"], "≥ 0.9", max(d1, d2))
        for b in (8, 16, 32):
            ours, d1 = timed_row(lambda: generate_streams(srv.target, "llc", prompt, b, steps + 8))
            peer, d2 = timed_row(lambda: llama_batched(gguf, prompt, b, steps, th))
            raw[f"b{b}"] = {"ours": ours, "peer": peer}
            add(f"{b} Generate streams ÷ llama.cpp batched decode of {b} sequences", ours["steady_tok_s"],
                peer["tok_s"], "≥ 0.9", max(d1, d2))
    with Server("smollm2-hf,id=hf", threads=th, name="server-hf") as srv:
        generate_streams(srv.target, "hf", prompt, 1, 4)
        hf, d = timed_row(lambda: generate_streams(srv.target, "hf", prompt, 1, n))
        raw["hf_b1"] = hf
        add("Generate B=1 llama-cpp executor ÷ transformers executor", llc_b1, hf["steady_tok_s"], "≥ 4×", d)
    raw["load_after"] = os.getloadavg()
    out = REPO / "benchmarks" / "results" / "llama_cpp_rows.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "raw": raw}, indent=1, default=str))
    print(f"load average before {raw['load_before']}, after {raw['load_after']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
