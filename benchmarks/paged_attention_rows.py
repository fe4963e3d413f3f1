"""Long-context decode on CPU (issue 30): the transformers executor's BatchDecode step with the CPU
paged-attention op beside the old path (per-layer block copy + batched SDPA), alternated in one run.

    .venv/bin/python -m benchmarks.paged_attention_rows [--quick] [--threads N] [--repeats N]

SmolLM2-135M (fp32, CPU), in-process. Rows:

* **B=8 step at 1,536 tokens of context ÷ at 32** with the op (target ≤ 1.6), the old path's ratio
  beside it: 8 caches per context prefilled once, then ``--steps`` greedy ``batch_decode`` steps per
  context per side, sides alternated run by run (the order rotating), caches truncated back after
  each run so every run sees the same context; p50 step time.
* **n=4 samples of one 512-token prompt**: 4 forks sharing the prompt's blocks (``fork_cache``), one
  ``batch_decode`` step of the 4, op ÷ old path.

Also reported (``raw``): the machine's read bandwidth, the bytes a step must read (fp32 weights +
the rows' KV) and the ratio those bytes alone would give (the bytes floor), and the micro-benchmark
of :mod:`benchmarks.paged_attention_micro` (old path split into copy and SDPA, the op) at the same
shapes. Drift: the reference workload of ``llama_cpp_rows`` before and after; > 15 % flags the rows
``busy`` (do not publish a busy row).
"""

from __future__ import annotations

import argparse
import os
import time
from statistics import median

import torch

from .common import write_rows
from .llama_cpp_rows import DRIFT_LIMIT, reference_workload
from .schema import row


def _decode_runs(ex, ids: list[str], ctx: int, steps: int) -> list[float]:
    from ferrum_service.core.types import DecodeInput

    tok, out = [101] * len(ids), []
    for _ in range(steps):
        t = time.perf_counter()
        dec = ex.batch_decode([DecodeInput(cache_id=c, token_id=x) for c, x in zip(ids, tok)])
        out.append(1e3 * (time.perf_counter() - t))
        tok = [int(d.logits.argmax()) for d in dec]
    for c in ids:
        ex.truncate_kv(c, ctx)
    return out


@torch.inference_mode()
def measure(ex, b: int, contexts: tuple[int, int], steps: int, repeats: int, fork_prompt: int = 512) -> dict:
    """Step times per side (``op`` / ``old``) and context, alternated; see the module docstring."""
    from ferrum_service.core.types import LogitsPolicy, OutputMode, PrefillInput
    from ferrum_service.executors.transformers import cpu_paged_attention as cpa

    vocab = ex.info().vocab_size
    none = LogitsPolicy(mode=OutputMode.NONE)
    caches = {}
    for ctx in contexts:
        prompts = [[100 + (7 * i + 13 * j) % (vocab - 100) for j in range(ctx)] for i in range(b)]
        per = max(1, ex.max_batch_tokens // ctx)
        caches[ctx] = [o.cache.cache_id for k in range(0, b, per)
                       for o in ex.batch_prefill([PrefillInput(token_ids=p, policy=none) for p in prompts[k:k + per]])]
    root = ex.prefill(PrefillInput(token_ids=[100 + (5 * j) % (vocab - 100) for j in range(fork_prompt)],
                                   policy=none)).cache.cache_id
    forks = [ex.fork_cache(root)[0].cache_id for _ in range(4)]
    times = {side: {**{ctx: [] for ctx in contexts}, "forks": []} for side in ("op", "old")}
    prev = cpa.set_enabled(True)
    try:
        for r in range(repeats + 1):  # r = 0: untimed warm-up
            for side in (("op", "old") if r % 2 else ("old", "op")):
                cpa.set_enabled(side == "op")
                for ctx in contexts:
                    t = _decode_runs(ex, caches[ctx], ctx, steps)
                    if r:
                        times[side][ctx] += t
                t = _decode_runs(ex, forks, fork_prompt, max(2, steps // 2))
                if r:
                    times[side]["forks"] += t
    finally:
        cpa.set_enabled(prev)
    for c in [c for ids in caches.values() for c in ids] + forks + [root]:
        ex.release_cache(c)
    short, long = contexts
    out = {"b": b, "steps": steps, "repeats": repeats, "contexts": list(contexts), "fork_prompt": fork_prompt}
    for side, ts in times.items():
        p50 = {str(k): median(v) for k, v in ts.items()}
        out[side] = {"step_ms": p50, "ratio": p50[str(long)] / p50[str(short)],
                     "runs_ms": {str(k): v for k, v in ts.items()}}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="4 steps, 2 repeats (a smoke run)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--b", type=int, default=8)
    ap.add_argument("--contexts", default="32,1536")
    a = ap.parse_args(argv)
    if a.quick:
        a.steps, a.repeats = 4, 2
    torch.set_num_threads(a.threads)
    from ferrum_service.executors.transformers import cpu_paged_attention as cpa

    from . import inproc, paged_attention_micro as micro

    if not cpa.available():
        raise SystemExit(f"the CPU paged-attention op is not available: {cpa._error}")
    contexts = tuple(int(x) for x in a.contexts.split(","))
    ex = inproc.load_smollm2()
    load_before = os.getloadavg()
    probe = reference_workload()
    bw = inproc.bandwidth(0.5, 5)
    res = measure(ex, a.b, contexts, a.steps, a.repeats)
    mic = []
    for ctx in contexts:
        q, kp, vp, tables = micro.setup(a.b, ctx, torch.float32)
        copy, sd, op = [], [], []
        for r in range(4):
            tg, ts = micro.old_path(q, kp, vp, tables, ctx)
            to = micro.op_path(q, kp, vp, tables, ctx)
            if r:
                copy.append(tg)
                sd.append(ts)
                op.append(to)
        del kp, vp
        mic.append({"ctx": ctx, "copy_ms": 1e3 * median(copy), "sdpa_ms": 1e3 * median(sd),
                    "op_ms": 1e3 * median(op)})
    drift = abs(reference_workload() - probe) / probe
    weights = inproc.weight_bytes(ex.model)
    kv_tok = ex.pool.bytes_per_token
    short, long = contexts
    step_bytes = {c: weights + a.b * c * kv_tok for c in contexts}
    floor = {"weight_bytes": weights, "kv_bytes_per_token": kv_tok, "step_bytes": step_bytes,
             "bytes_ratio": step_bytes[long] / step_bytes[short],
             "kv_read_ms_at_bandwidth": 1e3 * a.b * long * kv_tok / (bw["read_gb_s"] * 1e9)}
    op, old = res["op"], res["old"]
    note = (f"executor in-process, SmolLM2-135M fp32, {a.threads} threads; {a.b} caches per context prefilled "
            f"once, {a.steps} greedy batch_decode steps per run, op / old path alternated over {a.repeats} runs; "
            f"p50. Bytes floor of the ratio (fp32 weights {weights / 1e6:.0f} MB + KV {kv_tok / 1e3:.1f} kB/token "
            f"read per step): {floor['bytes_ratio']:.2f}; read bandwidth {bw['read_gb_s']:.1f} GB/s (issue 30)")
    rows = [
        row(f"BatchDecode B={a.b} step at {long:,} tokens of context ÷ at {short}, CPU paged-attention op",
            f"{op['step_ms'][str(long)]:.1f} / {op['step_ms'][str(short)]:.1f} ms",
            f"old path {old['step_ms'][str(long)]:.1f} / {old['step_ms'][str(short)]:.1f} ms (ratio {old['ratio']:.2f})",
            op["ratio"], "≤ 1.6", target_value=1.6, lower_is_better=True, drift=drift, note=note),
        row(f"BatchDecode B={a.b} step at {long:,} tokens: op ÷ old path (copy + SDPA)",
            f"{op['step_ms'][str(long)]:.1f} ms", f"{old['step_ms'][str(long)]:.1f} ms",
            op["step_ms"][str(long)] / old["step_ms"][str(long)], None, drift=drift, note=note),
        row(f"n=4 forks of one {res['fork_prompt']}-token prompt, BatchDecode step: op ÷ old path",
            f"{op['step_ms']['forks']:.1f} ms", f"{old['step_ms']['forks']:.1f} ms",
            op["step_ms"]["forks"] / old["step_ms"]["forks"], None, drift=drift,
            note="the 4 rows share the prompt's blocks (fork_cache); the old path copies them per row per layer"),
    ]
    raw = {"measure": res, "bandwidth": bw, "bytes_floor": floor, "micro": mic, "drift": drift,
           "load_before": load_before, "load_after": os.getloadavg(), "threads": a.threads}
    write_rows("paged_attention_rows", rows, raw)
    print("| row | ours | peer | ratio | drift |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['ours']} | {r['peer']} | {r['ratio']:.2f} | {100 * drift:.0f} %"
              f"{' busy' if drift > DRIFT_LIMIT else ''} |")
    print(f"bandwidth {bw['read_gb_s']:.1f} GB/s read; bytes floor of the ratio {floor['bytes_ratio']:.2f}; "
          f"micro (ms per step, all layers): {mic}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
