"""llama.cpp KV layouts measured on their own (issue 39): one unified KV buffer against one stream
per sequence (``kv_unified`` false, llama-server's default with ``-np N``), on the low-level API.

    .venv/bin/python -m benchmarks.llama_cpp_layout [--gguf FILE] [--threads 2] [--seqs 16] [--rounds 4]

Both contexts are made from one loaded model with the same number of sequences; each holds
``--seqs`` live sequences of a 200-token prompt, and the unified one also holds retired sequences
(what the prefix cache keeps) up to ``--retired`` cells, as the executor's buffer does after a
while. Timed per layout, the sides alternated round by round (medians):

* ``decode``: one step of one token for every live sequence (ids 0..S-1, sorted);
* ``decode_shuffled``: the same rows in a shuffled order (streams only: llama.cpp cuts a ubatch at
  every id that is not the previous + 1);
* ``mixed``: the decodes plus a 100-token chunk of a new sequence.

Nothing here is a published row: it decides the executor's default layout, and says so in its
output together with the machine's load.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import numpy as np


def _ctx(L, model, *, unified: bool, seqs: int, cells: int, threads: int):
    cp = L.llama_context_default_params()
    cp.n_ctx = cells
    cp.n_batch = 2048
    cp.n_ubatch = 512
    cp.n_seq_max = seqs
    cp.n_threads = cp.n_threads_batch = threads
    cp.kv_unified = unified
    cp.no_perf = True
    return L.llama_init_from_model(model, cp)


def _decode(L, ctx, batch, rows: list[tuple[int, list[int], int]]) -> float:
    """One llama_decode of ``rows`` (seq id, tokens, first position); seconds."""
    i = 0
    for seq, toks, past in rows:
        for j, t in enumerate(toks):
            batch.token[i] = t
            batch.pos[i] = past + j
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = j == len(toks) - 1
            i += 1
    batch.n_tokens = i
    t0 = time.perf_counter()
    rc = L.llama_decode(ctx, batch)
    dt = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default="")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--retired", type=int, default=6000, help="cells of retired sequences in the unified buffer")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    import llama_cpp.llama_cpp as L

    path = a.gguf
    if not path:
        from ferrum_service.hosting.packaged_models import smollm2_gguf

        d, f = smollm2_gguf()
        path = str(d / f)
    quiet = L.llama_log_callback(lambda level, text, user: None)
    L.llama_log_set(quiet, None)
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = L.llama_model_load_from_file(path.encode(), mp)
    S, P = a.seqs, a.prompt
    per_seq = 512
    n_total = S + 2  # live + the mixed step's new sequence + one retired holder (unified)
    uni = _ctx(L, model, unified=True, seqs=n_total, cells=a.retired + n_total * per_seq, threads=a.threads)
    spl = _ctx(L, model, unified=False, seqs=n_total, cells=n_total * per_seq, threads=a.threads)
    batch = L.llama_batch_init(2048, 0, 1)
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(P)]
    # Retired sequences in the unified buffer first (the prefix cache keeps them), so the live
    # sequences' cells lie above them, as after a while of serving.
    for start in range(0, a.retired, P):
        _decode(L, uni, batch, [(S + 1, prompt, start)])
    lens = {}
    for name, ctx in (("unified", uni), ("streams", spl)):
        for s in range(S):
            _decode(L, ctx, batch, [(s, prompt, 0)])
        lens[name] = [P] * S
    times: dict[str, list[float]] = {}

    def record(key: str, dt: float) -> None:
        times.setdefault(key, []).append(dt)

    for r in range(a.rounds):
        for name, ctx in ((("unified", uni), ("streams", spl)) if r % 2 == 0 else (("streams", spl), ("unified", uni))):
            m = L.llama_get_memory(ctx)
            ln = lens[name]
            for _ in range(a.steps):
                record(f"{name}/decode", _decode(L, ctx, batch, [(s, [7], ln[s]) for s in range(S)]))
                for s in range(S):
                    ln[s] += 1
            if name == "streams":
                for _ in range(a.steps):
                    order = list(range(S))
                    rng.shuffle(order)
                    record(f"{name}/decode_shuffled", _decode(L, ctx, batch, [(s, [7], ln[s]) for s in order]))
                    for s in range(S):
                        ln[s] += 1
            for _ in range(max(1, a.steps // 4)):
                rows = [(s, [7], ln[s]) for s in range(S)] + [(S, prompt[:100], 0)]
                record(f"{name}/mixed", _decode(L, ctx, batch, rows))
                L.llama_memory_seq_rm(m, S, -1, -1)
                for s in range(S):
                    ln[s] += 1
    load = os.getloadavg()
    print(f"# busy machine: load average {load[0]:.1f} on {os.cpu_count()} cores; {a.threads} threads; "
          f"{S} live sequences of {P}+ tokens; unified buffer with ~{a.retired} retired cells; medians of "
          f"{a.rounds} alternated rounds x {a.steps} steps")
    for key in sorted(times):
        v = times[key]
        print(f"{key:26s} median {np.median(v) * 1e3:8.1f} ms   min {min(v) * 1e3:8.1f} ms   n={len(v)}")
    L.llama_batch_free(batch)
    L.llama_free(uni)
    L.llama_free(spl)
    L.llama_model_free(model)


if __name__ == "__main__":
    main()
