"""In-process throughput of ``HfCausalLmExecutor`` (greedy = argmax, no server, no sampling.py).

    python -m ferrum_service.testing.bench_causal_lm [--path DIR [--gguf-file F]] [--device cpu]
        [--batch 1 8] [--steps 32] [--prompt-len 128]

Without ``--path`` it benchmarks the packaged SmolLM2-135M-Instruct GGUF. Reports the median of
``--repeats`` runs: prefill latency of one ``--prompt-len`` prompt (last-row logits only), and
decode tokens/s at each batch size (B sequences with prompts of different lengths, one
``batch_decode`` forward per step).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from ..core.types import DecodeInput, LogitsPolicy, OutputMode, PrefillInput


def run(ex, *, batches: list[int], steps: int, prompt_len: int, repeats: int) -> dict[str, float]:
    vocab = ex.info().vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(100, vocab) for _ in range(prompt_len)]
    res: dict[str, float] = {}
    ex.warmup()
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        out = ex.prefill(PrefillInput(token_ids=prompt))
        times.append(time.perf_counter() - t)
        ex.release_cache(out.cache.cache_id)
    res[f"prefill_{prompt_len}_ms"] = 1e3 * statistics.median(times[1:])
    none = LogitsPolicy(mode=OutputMode.NONE)
    for b in batches:
        rates = []
        for _ in range(repeats):
            lens = [max(1, prompt_len * (i + 1) // b) for i in range(b)]  # different lengths
            outs = ex.batch_prefill([PrefillInput(token_ids=prompt[:n], policy=none) for n in lens])
            ids = [o.cache.cache_id for o in outs]
            tok = [prompt[0]] * b
            t = time.perf_counter()
            for _ in range(steps):
                dec = ex.batch_decode([DecodeInput(cache_id=c, token_id=x) for c, x in zip(ids, tok)])
                tok = [int(d.logits.argmax()) for d in dec]
            rates.append(b * steps / (time.perf_counter() - t))
            for c in ids:
                ex.release_cache(c)
        res[f"decode_B{b}_tok_s"] = statistics.median(rates)
    return res


def main(argv: list[str] | None = None) -> int:
    from ..executors.transformers import HfCausalLmExecutor

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--path")
    p.add_argument("--gguf-file")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    path, gguf = a.path, a.gguf_file
    if not path:
        from ..hosting.packaged_models import smollm2_gguf

        path, gguf = smollm2_gguf()
    ex = HfCausalLmExecutor.from_path(path, gguf_file=gguf, device=a.device, dtype=a.dtype, kv_budget_tokens=16384)
    res = run(ex, batches=a.batch, steps=a.steps, prompt_len=a.prompt_len, repeats=a.repeats)
    for k, v in res.items():
        print(f"{k}: {v:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
