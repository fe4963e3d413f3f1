"""Paged decode attention with fixed-shape metadata (``paged_decode.py``), checked on the CPU.

The reference reads exactly each row's tokens through the block table; every graph-safe
implementation must agree with it on scattered, shared and padded tables. The Triton kernel runs
under Triton's interpreter (``TRITON_INTERPRET=1``, in a subprocess: the flag is read when the
kernel is defined), so its indexing is checked here too, without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ferrum_service.executors.transformers import paged_decode as pd

REPO = Path(__file__).resolve().parents[1]


def _case(seed: int, dtype=torch.float32, rows: int = 5, hq: int = 6, hkv: int = 2, d: int = 16, bs: int = 4,
          blocks: int = 40, width: int = 8):
    """A pool with random K/V (the null block 0 zero), rows with scattered tables (two rows share
    blocks, one is padded past its length with junk ids) and lengths."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(blocks, bs, hkv, d, generator=g).to(dtype)
    v = torch.randn(blocks, bs, hkv, d, generator=g).to(dtype)
    k[0].zero_()
    v[0].zero_()
    table = torch.randint(1, blocks, (rows, width), generator=g, dtype=torch.int32)
    table[1, :3] = table[0, :3]  # shared prefix blocks
    lengths = torch.tensor([1 + (7 * r + seed) % (width * bs) for r in range(rows)], dtype=torch.int32)
    lengths[0] = width * bs  # a full table
    q = torch.randn(rows, hq, d, generator=g).to(dtype)
    return q, k, v, table, lengths


def test_token_slots_follow_the_block_table():
    table = torch.tensor([[3, 7], [5, 0]], dtype=torch.int32)
    slots, valid = pd.token_slots(table, torch.tensor([6, 2]), 4)
    assert slots[0].tolist() == [12, 13, 14, 15, 28, 29, 30, 31]
    assert slots[1, :2].tolist() == [20, 21]
    assert valid.sum(1).tolist() == [6, 2]


def _naive(q, k, v, table, lengths):
    """A literal loop over positions (no shared helper) to check the reference itself."""
    rows, hq, d = q.shape
    bs, hkv = k.shape[1], k.shape[2]
    out = torch.empty(rows, hq, d)
    for r in range(rows):
        L = int(lengths[r])
        ks = torch.stack([k[int(table[r, p // bs]), p % bs] for p in range(L)]).float()  # [L, Hkv, D]
        vs = torch.stack([v[int(table[r, p // bs]), p % bs] for p in range(L)]).float()
        for h in range(hq):
            kv = h // (hq // hkv)
            w = torch.softmax(ks[:, kv] @ q[r, h].float() * d ** -0.5, 0)
            out[r, h] = w @ vs[:, kv]
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_and_gathered_agree_with_a_literal_loop(seed):
    q, k, v, table, lengths = _case(seed)
    want = _naive(q, k, v, table, lengths)
    assert torch.allclose(pd.reference_decode(q, k, v, table, lengths), want, atol=1e-5)
    assert torch.allclose(pd.gathered_decode(q, k, v, table, lengths), want, atol=1e-5)


def test_gathered_ignores_what_lies_past_each_length():
    q, k, v, table, lengths = _case(3)
    a = pd.gathered_decode(q, k, v, table, lengths)
    t2 = table.clone()
    for r in range(table.shape[0]):
        used = -(-int(lengths[r]) // k.shape[1])
        t2[r, used:] = 1  # another block past the length: must not matter
    assert torch.equal(a, pd.gathered_decode(q, k, v, t2, lengths))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_op_agrees_with_the_reference(dtype):
    from ferrum_service.executors.transformers import cpu_paged_attention

    if not cpu_paged_attention.available():
        pytest.skip("the CPU op could not be built here")
    q, k, v, table, lengths = _case(4, dtype=dtype)
    ref = pd.reference_decode(q.float(), k, v, table, lengths)
    got = pd.cpu_op_decode(q, k, v, table, lengths).float()
    assert torch.allclose(got, ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-5)


_INTERPRETED = """
import torch, sys
sys.path[:0] = {paths!r}
from tests.test_paged_decode import _case
from ferrum_service.executors.transformers import paged_decode as pd
for seed in (0, 5):
    q, k, v, table, lengths = _case(seed, d=16, hq=6, hkv=2)
    ref = pd.reference_decode(q, k, v, table, lengths)
    got = pd.triton_decode(q, k, v, table, lengths)
    err = (got - ref).abs().max().item()
    assert err < 1e-4, err
    for split in (1, 3):  # several programs per row, some past a row's length
        err = (pd.triton_decode(q, k, v, table, lengths, blocks_per_split=split) - ref).abs().max().item()
        assert err < 1e-4, (split, err)
    assert (pd.triton_split_decode(q, k, v, table[:, :5], lengths.clamp(max=20)) -
            pd.reference_decode(q, k, v, table[:, :5], lengths.clamp(max=20))).abs().max().item() < 1e-4
print("triton-ok")
"""


def test_triton_kernel_under_the_interpreter():
    if not pd.triton_available():
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = _INTERPRETED.format(paths=[str(REPO), str(REPO / "clients" / "python")])
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert "triton-ok" in p.stdout, p.stderr[-3000:]
