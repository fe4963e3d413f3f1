"""Paged decode attention candidates on a CUDA device (part of ``gpu_check``; runs alone too).

    python -m benchmarks.gpu_attention

One layer of SmolLM2-135M's shape (9 query heads, 3 K/V heads, head dim 64, bf16 pool, 16-token
blocks, scattered block tables), one query token per row, B = 1 and 32 at 512 and 2,048 tokens of
context. Candidates (same inputs, ``executors/transformers/paged_decode.py``): our Triton kernel
(blocks read in place up to each row's length; ``triton-split``: each row's blocks shared by
programs of 8 blocks, partial softmaxes merged), the gathered torch path (all table blocks copied
and masked: what a graph can hold without a kernel of ours) and torch ``flex_attention`` over the
pool with a block mask built from the block tables, compiled, at 2,048 tokens only (tried; its
error is reported when the installed torch refuses the shapes; checked on the CPU in eager mode). Each is checked against the fp32 reference and timed with
CUDA events (median of 50 after 10 warm-ups, and replayed from a CUDA graph: the launch gaps out).
"""

from __future__ import annotations

import statistics

import torch

HQ, HKV, D, BS = 9, 3, 64, 16


def _inputs(rows: int, context: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    width = -(-context // BS)
    blocks = rows * width + 8
    k = torch.randn(blocks, BS, HKV, D, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(blocks, BS, HKV, D, device="cuda", generator=g).to(torch.bfloat16)
    table = (torch.randperm(blocks - 1, device="cuda", generator=g)[: rows * width] + 1).view(rows, width)
    lengths = torch.full((rows,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(rows, HQ, D, device="cuda", generator=g).to(torch.bfloat16)
    return q, k, v, table.to(torch.int32).contiguous(), lengths


def _flex(q, k, v, table, lengths):
    """flex_attention over the whole pool as one K/V sequence, masked to each row's blocks."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    rows, width = table.shape
    nblocks = k.shape[0]
    owner = torch.full((rows, nblocks), -1, dtype=torch.int32, device=q.device)
    owner.scatter_(1, table.long(), torch.arange(width, dtype=torch.int32, device=q.device).expand(rows, width))

    def mask_mod(b, h, q_idx, kv_idx):
        logical = owner[b, kv_idx // BS]
        return (logical >= 0) & (logical * BS + kv_idx % BS < lengths[b])

    kv_num = torch.full((rows, 1, 1), width, dtype=torch.int32, device=q.device)
    mask = BlockMask.from_kv_blocks(kv_num, table.view(rows, 1, 1, width), BLOCK_SIZE=(BS, BS), mask_mod=mask_mod,
                                    seq_lengths=(BS, nblocks * BS))
    kk = k.view(1, -1, HKV, D).transpose(1, 2).expand(rows, -1, -1, -1)
    vv = v.view(1, -1, HKV, D).transpose(1, 2).expand(rows, -1, -1, -1)
    qq = torch.zeros(rows, HQ, BS, D, dtype=q.dtype, device=q.device)
    qq[:, :, 0] = q
    out = _compiled_flex()(qq, kk, vv, block_mask=mask, enable_gqa=True)
    return out[:, :, 0]


_FLEX = []


def _compiled_flex():
    """flex_attention compiled once (eager flex is a slow reference implementation)."""
    if not _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX.append(torch.compile(flex_attention, dynamic=False) if torch.cuda.is_available() else flex_attention)
    return _FLEX[0]


def _time(fn, reps: int = 50) -> dict:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    out = {"us": statistics.median(ts)}
    try:  # replayed from a graph: the kernel time without launch gaps
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3)
        out["graph_us"] = statistics.median(ts)
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        out["graph_error"] = f"{type(e).__name__}: {e}"[:200]
    return out


def compare() -> list[dict]:
    """Every candidate at every shape: error against the reference and times."""
    from ferrum_service.executors.transformers import paged_decode as pd

    cands = {"triton": pd.triton_decode, "triton-split": pd.triton_split_decode, "gathered": pd.gathered_decode,
             "flex": _flex}
    out = []
    for rows in (1, 32):
        for context in (512, 2048):
            q, k, v, table, lengths = _inputs(rows, context)
            ref = pd.reference_decode(q.float(), k, v, table, lengths)
            for name, fn in cands.items():
                if name == "flex" and context != 2048:  # each shape compiles anew (tens of seconds)
                    continue
                rec = {"candidate": name, "rows": rows, "context": context}
                try:
                    got = fn(q, k, v, table, lengths).float()
                    rec["rel_err"] = float((got - ref).norm() / ref.norm())
                    rec.update(_time(lambda: fn(q, k, v, table, lengths)))
                    kv_bytes = rows * context * HKV * D * 2 * 2
                    rec["kv_gb_s"] = kv_bytes / (rec.get("graph_us", rec["us"]) * 1e3)
                except Exception as e:  # noqa: BLE001 - a candidate that fails is reported
                    rec["error"] = f"{type(e).__name__}: {e}"[:300]
                out.append(rec)
    return out


def table_md(recs: list[dict]) -> str:
    lines = ["| candidate | B | context | rel. error | µs (launch) | µs (graph) | KV GB/s |", "|---|---|---|---|---|---|---|"]
    for r in recs:
        if "error" in r:
            lines.append(f"| {r['candidate']} | {r['rows']} | {r['context']} | {r['error'][:60]} | | | |")
            continue
        lines.append(f"| {r['candidate']} | {r['rows']} | {r['context']} | {r['rel_err']:.1e} | {r['us']:.1f} | "
                     f"{r.get('graph_us', float('nan')):.1f} | {r['kv_gb_s']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table_md(compare()))
