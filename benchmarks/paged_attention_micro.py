"""Micro-benchmark of CPU decode attention over the paged KV pool (issue 30), one process.

    python -m benchmarks.paged_attention_micro [--threads N] [--repeats R]

For SmolLM2-135M's attention shape (30 layers, 9 query heads, 3 K/V heads, head_dim 64, block 16)
and B one-token rows at a context of C tokens in scattered blocks, it times per step (all layers):
the old path's per-layer block copy (``index_select``), its batched SDPA over the copy, and the C++
op (:mod:`ferrum_service.executors.transformers.cpu_paged_attention`) reading the blocks in place,
next to the machine's read bandwidth and the bytes each side must read; sides alternate.
"""

from __future__ import annotations

import argparse
import json
import time
from statistics import median

import torch
import torch.nn.functional as F

LAYERS, HQ, HKV, D, BS = 30, 9, 3, 64, 16


def setup(b: int, ctx: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    nb = b * (-(-ctx // BS))
    perm = torch.randperm(nb, generator=g) + 1  # scattered: no row is a contiguous run
    kp = [torch.randn(nb + 1, BS, HKV, D, generator=g).to(dtype) for _ in range(LAYERS)]
    vp = [torch.randn(nb + 1, BS, HKV, D, generator=g).to(dtype) for _ in range(LAYERS)]
    tables = perm.view(b, -1)
    q = torch.randn(b, HQ, D, generator=g).to(dtype)
    return q, kp, vp, tables


def old_path(q, kp, vp, tables, ctx):
    """What packed_attention's grouped one-token path does per layer: copy the rows' blocks, SDPA."""
    b = q.shape[0]
    idx = tables.reshape(-1)
    mask = torch.arange(tables.shape[1] * BS).view(1, 1, 1, -1) < torch.full((b, 1, 1, 1), ctx)
    tg = ts = 0.0
    for layer in range(LAYERS):
        t0 = time.perf_counter()
        kg = kp[layer].index_select(0, idx).view(b, -1, HKV, D).transpose(1, 2)
        vg = vp[layer].index_select(0, idx).view(b, -1, HKV, D).transpose(1, 2)
        t1 = time.perf_counter()
        F.scaled_dot_product_attention(q.view(b, HKV, HQ // HKV, D), kg, vg, attn_mask=mask)
        t2 = time.perf_counter()
        tg += t1 - t0
        ts += t2 - t1
    return tg, ts


def op_path(q, kp, vp, tables, ctx):
    from ferrum_service.executors.transformers.cpu_paged_attention import paged_decode

    t32 = tables.to(torch.int32)
    lens = torch.full((q.shape[0],), ctx, dtype=torch.int32)
    t0 = time.perf_counter()
    for layer in range(LAYERS):
        paged_decode(q, kp[layer], vp[layer], t32, lens, D ** -0.5)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--b", type=int, default=8)
    p.add_argument("--contexts", default="32,1536")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from .inproc import bandwidth
    from ferrum_service.executors.transformers.cpu_paged_attention import load

    load()
    bw = bandwidth(0.5, 5)
    res = {"threads": torch.get_num_threads(), "bandwidth": bw, "rows": []}
    for dtype in (torch.float32, torch.bfloat16):
        for ctx in (int(c) for c in a.contexts.split(",")):
            q, kp, vp, tables = setup(a.b, ctx, dtype)
            kv_bytes = 2 * LAYERS * a.b * ctx * HKV * D * kp[0].element_size()
            old_p, copy, sd, op = [], [], [], []
            for r in range(a.repeats + 1):
                tg, ts = old_path(q, kp, vp, tables, ctx)
                to = op_path(q, kp, vp, tables, ctx)
                if r:
                    copy.append(tg); sd.append(ts); old_p.append(tg + ts); op.append(to)
            row = {"dtype": str(dtype).split(".")[-1], "b": a.b, "ctx": ctx, "kv_mb": kv_bytes / 1e6,
                   "old_ms": 1e3 * median(old_p), "copy_ms": 1e3 * median(copy), "sdpa_ms": 1e3 * median(sd),
                   "op_ms": 1e3 * median(op), "floor_ms": 1e3 * kv_bytes / (bw["read_gb_s"] * 1e9)}
            row["op_gb_s"] = kv_bytes / (row["op_ms"] / 1e3) / 1e9
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps({"bandwidth": bw, "threads": res["threads"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
