"""A short CUDA check of the transformers executor (run where a GPU is lent; nothing depends on it).

    python -m benchmarks.gpu_check [--out DIR] [--steps 32]

A random-weight Llama of SmolLM2-135M's shape (30 layers, hidden 576, 9 heads / 3 KV heads,
vocabulary 49,152) is written locally and loaded twice: on CUDA (bf16) and on the CPU (fp32). For
each, in one process and through the server's own step path (``core.steps.run`` of a
``StepPlan``, as Decode / BatchDecode and Generate's batcher run it): a 512-token prefill per row,
then ``--steps`` batched decode steps at B = 1, 8 and 32, timed per step (CUDA synchronised). The
two devices' greedy tokens over the same steps are compared (bf16 vs fp32: the share of equal
tokens is reported, not asserted). Prints a Markdown table and writes ``gpu_check.json`` (the results schema) into ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from .schema import row, write_rows


def _measure(ex, batch: int, prompt_len: int, steps: int, sync) -> dict:
    from ferrum_service.core.steps import StepPlan, StepRow, run
    from ferrum_service.core.types import DecodeInput, PrefillInput

    vocab = ex.info().vocab_size
    prompts = [[(97 * (i + 1) * (j + 3)) % (vocab - 10) + 5 for j in range(prompt_len)] for i in range(batch)]
    per_step = max(1, ex.admission_limits().maximum_scheduled_tokens // prompt_len)  # rows one forward takes
    caches, toks = [], []
    sync()
    t0 = time.perf_counter()
    for i in range(0, batch, per_step):
        res = run(ex, StepPlan([StepRow.prompt(PrefillInput(token_ids=p, bypass_prefix_cache=True,
                                                            reserve_tokens=prompt_len + steps + 1), None)
                                for p in prompts[i:i + per_step]]))
        caches += [o.cache.cache_id for o in res.outputs]
        toks += [r.token_id for r in res.rows]
    sync()
    prefill_s = time.perf_counter() - t0
    out = [list(toks)]
    times = []
    reg = ex.registry
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        r = run(ex, StepPlan([StepRow.decode(DecodeInput(cache_id=c, token_id=t), reg.get(c), "inputs")
                              for c, t in zip(caches, toks)]))
        sync()
        times.append(time.perf_counter() - t0)
        toks = [x.token_id for x in r.rows]
        out.append(list(toks))
    for c in caches:
        ex.release_cache(c)
    ms = statistics.median(times[2:] or times) * 1e3
    return {"batch": batch, "prefill_ms": prefill_s * 1e3, "decode_ms": ms, "tok_s": batch * 1e3 / ms,
            "tokens": out}


def _serve(ex, prompt_len: int) -> dict:
    """8 concurrent greedy ``Generate`` streams of 32 tokens through a real server (loopback gRPC)
    on ``ex``: aggregate tok/s and each stream's tokens."""
    from concurrent.futures import ThreadPoolExecutor

    from ferrum_client import Client
    from tests.support.servers import InProcessServer

    vocab = ex.info().vocab_size
    prompts = [[(31 * (i + 2) * (j + 7)) % (vocab - 10) + 5 for j in range(prompt_len)] for i in range(8)]
    with InProcessServer([ex]) as srv, Client(srv.target) as c:
        c.generate("", token_ids=prompts[0][:16], max_tokens=4).tokens()  # warm
        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            toks = list(pool.map(lambda p: c.generate("", token_ids=p, max_tokens=32, ignore_eos=True,
                                                      bypass_prefix_cache=True).tokens(), prompts))
        wall = time.perf_counter() - t0
        assert srv.live_caches() == {ex.info().model_id: 0}
    return {"tok_s": sum(len(t) for t in toks) / wall, "tokens": toks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--profile", action="store_true", help="profile B=1 decode steps on CUDA (top ops)")
    ap.add_argument("--serve", action="store_true", help="also 8 Generate streams through a real server per side")
    a = ap.parse_args()
    import torch

    from ferrum_service.executors.transformers import HfCausalLmExecutor
    from ferrum_service.testing.tiny_models import build_tiny_llama

    assert torch.cuda.is_available(), "no CUDA device"
    d = build_tiny_llama(Path(tempfile.mkdtemp()) / "smollm2-shape", seed=0, vocab_size=49152, hidden_size=576,
                         num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536,
                         max_position_embeddings=2048, initializer_range=0.02, tie_word_embeddings=True)
    sides = {
        "cuda bf16": (HfCausalLmExecutor.from_path(str(d), model_id="gpu", device="cuda", dtype="bf16",
                                                   kv_budget_tokens=64 * 1024), torch.cuda.synchronize),
        "cpu fp32": (HfCausalLmExecutor.from_path(str(d), model_id="cpu", device="cpu", dtype="fp32",
                                                  kv_budget_tokens=64 * 1024), lambda: None),
    }
    for ex, sync in sides.values():  # warm: kernels, allocator
        _measure(ex, 2, 32, 3, sync)
    rec = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": {}}
    print(f"GPU: {rec['device']}, torch {rec['torch']}; prompt {a.prompt} tokens, {a.steps} decode steps")
    print("| side | B | prefill ms | decode ms/step | decode tok/s |")
    print("|---|---|---|---|---|")
    for b in (1, 8, 32):
        for name, (ex, sync) in sides.items():
            r = _measure(ex, b, a.prompt, a.steps, sync)
            rec["rows"].setdefault(name, []).append(r)
            print(f"| {name} | {b} | {r['prefill_ms']:.1f} | {r['decode_ms']:.2f} | {r['tok_s']:.0f} |")
        g, c = rec["rows"]["cuda bf16"][-1]["tokens"], rec["rows"]["cpu fp32"][-1]["tokens"]
        same = sum(x == y for gs, cs in zip(g, c) for x, y in zip(gs, cs)) / sum(len(gs) for gs in g)
        rec.setdefault("same_tokens", {})[b] = same
        print(f"  B={b}: greedy tokens equal on both devices: {same:.1%} (bf16 vs fp32)")
    if a.serve:  # the whole server on CUDA: 8 greedy Generate streams over gRPC, beside the CPU's
        rec["serve"] = {name: _serve(ex, a.prompt) for name, (ex, _) in sides.items()}
        g, c = rec["serve"]["cuda bf16"], rec["serve"]["cpu fp32"]
        same = sum(x == y for gs, cs in zip(g.pop("tokens"), c.pop("tokens")) for x, y in zip(gs, cs))
        rec["serve"]["same_tokens"] = same / (8 * 32)
        print(f"Generate over gRPC, 8 greedy streams x 32 tokens: CUDA {g['tok_s']:.0f} tok/s, CPU {c['tok_s']:.0f} "
              f"tok/s; equal tokens {rec['serve']['same_tokens']:.1%}")
    if a.profile:  # where a B=1 decode step's time goes on CUDA
        from torch.profiler import ProfilerActivity, profile

        ex, sync = sides["cuda bf16"]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _measure(ex, 1, 64, 6, sync)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
        print(table)
        Path(a.out, "gpu_profile.txt").write_text(table)
    for ex, _ in sides.values():
        assert ex.kv_capacity().used_bytes == 0
    for name in sides:
        for r in rec["rows"][name]:
            r.pop("tokens")
    write_rows("gpu_check", to_rows(rec), rec, folder=Path(a.out))


def to_rows(rec: dict, date: str | None = None) -> list[dict]:
    """The results rows of one check (``rec``: the device, torch, per side the B = 1 / 8 / 32
    measurements): CUDA decode tok/s ÷ the CPU's, per batch size. Reported only: no target."""
    rows = []
    for g, c in zip(rec["rows"]["cuda bf16"], rec["rows"]["cpu fp32"]):
        b = g["batch"]
        rows.append(row(f"transformers executor, SmolLM2-shaped random weights, decode through steps.run, B={b}: "
                        f"{rec['device']} bf16 ÷ its host's CPU fp32 (tok/s)", round(g["tok_s"], 1),
                        round(c["tok_s"], 1), round(g["tok_s"] / c["tok_s"], 2), date=date, unit="tok/s",
                        prefill_ms={"cuda": round(g["prefill_ms"], 1), "cpu": round(c["prefill_ms"], 1)},
                        same_tokens=rec.get("same_tokens", {}).get(str(b), rec.get("same_tokens", {}).get(b)),
                        note="a lent GPU machine (16 CPU cores); 512-token prompts, 32 decode steps, median step; "
                             "no drift probe there"))
    return rows


if __name__ == "__main__":
    main()
