"""The forward of a step: one model call over rows whose KV blocks are already allocated.

A row is one sequence's share: its block table, the tokens its cache holds (``past``), the new
tokens and which logits rows come back (:class:`~ferrum_service.core.steps.Want`), and its LoRA
adapter's weights.

* **Fresh** (every row a new prompt of the same length, e.g. a single prefill): a ``[B, Q]`` batch
  through the model's own attention (``sdpa``: the plain causal kernel); the new K/V are written
  to the pool and nothing is read from it.
* **Packed** (any mix: decodes, prompt chunks continuing a cache, verify rows, new prompts of
  different lengths): the rows' new tokens concatenated into one ``[1, T]`` input with per-token
  positions; attention keeps each row to its own context, read from the pool in place
  (:mod:`.packed_attention`).

Logits are computed only for the positions asked for (``logits_to_keep``), in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...core.steps import Want
from .lora import AdapterSet, AdapterWeights, LoraStep, lora_step
from .packed_attention import build_step, packed_step
from .paged_kv import BlockPool, PagedWriteCache


@dataclass
class Row:
    """One row of a forward: ``tokens`` written after the ``past`` tokens held in ``blocks``."""

    blocks: list[int]
    past: int
    tokens: list[int]
    want: Want
    lora: AdapterWeights | None = None


class PagedForward:
    """Runs a model over rows of a paged pool (see the module docstring)."""

    def __init__(self, model: Any, pool: BlockPool, adapters: AdapterSet | None) -> None:
        self.model = model
        self.pool = pool
        self.adapters = adapters
        self.device = pool.device
        self.block_size = pool.block_size
        # The CPU paged-attention op computes plain softmax attention (no logit soft-capping).
        self.paged_op_ok = not getattr(getattr(model, "config", None), "attn_logit_softcapping", None)
        # Decode-only steps through static buffers / CUDA graphs (decode_graphs.py), when set.
        self.decode_runner: Any = None

    def __call__(self, rows: list[Row]) -> list[torch.Tensor | None]:
        """One model call over ``rows``: per row its logits (``[vocab]``, ``[n, vocab]`` for
        :attr:`Want.ALL`, None for :attr:`Want.NONE`)."""
        if self.decode_runner is not None:
            out = self.decode_runner.run(rows)
            if out is not None:
                return out
        q = len(rows[0].tokens)
        if all(r.past == 0 and len(r.tokens) == q for r in rows):
            return self.fresh(rows)
        return self.packed(rows)

    def slots(self, r: Row) -> list[int]:
        """The pool slots ``r``'s new tokens are written into."""
        bs = self.block_size
        return [r.blocks[p // bs] * bs + p % bs for p in range(r.past, r.past + len(r.tokens))]

    def fresh(self, rows: list[Row]) -> list[torch.Tensor | None]:
        """Fresh prompts of one length as a ``[B, Q]`` batch: plain causal attention over their own
        new K/V (the model's own implementation; nothing is read from the pool), K/V written."""
        dev, b, q = self.device, len(rows), len(rows[0].tokens)
        ids = torch.tensor([r.tokens for r in rows], dtype=torch.long, device=dev)
        slots = torch.tensor([s for r in rows for s in self.slots(r)], dtype=torch.long, device=dev)
        cache = PagedWriteCache(self.pool, slots=slots, kv_length=q)
        wants = {r.want for r in rows}
        if wants == {Want.NONE}:
            keep: int | torch.Tensor = torch.zeros((b, 0), dtype=torch.long, device=dev)  # lm_head skipped
        elif Want.ALL in wants:
            keep = 0
        else:
            keep = 1
        pos = torch.arange(q, device=dev).expand(b, q)
        lora = self._lora_step(rows)
        with lora_step(lora):
            logits = self.model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True,
                                logits_to_keep=keep).logits
        self._count_lora(lora)
        out: list[torch.Tensor | None] = []
        for i, r in enumerate(rows):
            if r.want == Want.NONE:
                out.append(None)
            elif r.want == Want.ALL:
                out.append(logits[i].float())
            else:
                out.append(logits[i, -1].float())
        return out

    def packed(self, rows: list[Row]) -> list[torch.Tensor | None]:
        """All rows' new tokens concatenated into one ``[1, T]`` sequence (no padding), per-token
        positions, and attention that keeps each row to its own context (:mod:`.packed_attention`)."""
        dev = self.device
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        keep: list[int] = []
        spans: list[tuple[int, int]] = []  # per row: where its logits start in the kept rows, how many
        start = 0
        for r in rows:
            n = len(r.tokens)
            ids += r.tokens
            pos += range(r.past, r.past + n)
            slots += self.slots(r)
            if r.want == Want.ALL:
                spans.append((len(keep), n))
                keep += range(start, start + n)
            elif r.want == Want.LAST:
                spans.append((len(keep), 1))
                keep.append(start + n - 1)
            else:
                spans.append((len(keep), 0))
            start += n
        step = build_step(self.pool, [(r.blocks, r.past, len(r.tokens)) for r in rows], dev,
                          paged_op=None if self.paged_op_ok else False)
        cache = PagedWriteCache(self.pool, slots=torch.tensor(slots, dtype=torch.long, device=dev), kv_length=start)
        lora = self._lora_step(rows)
        with packed_step(step), lora_step(lora):
            logits = self.model(
                input_ids=torch.tensor([ids], dtype=torch.long, device=dev),
                position_ids=torch.tensor([pos], dtype=torch.long, device=dev),
                cache=cache,
                use_cache=True,
                logits_to_keep=torch.tensor(keep, dtype=torch.long, device=dev),
            ).logits[0]
        self._count_lora(lora)
        out: list[torch.Tensor | None] = []
        for r, (k0, k) in zip(rows, spans):
            if r.want == Want.NONE:
                out.append(None)
            elif r.want == Want.ALL:
                out.append(logits[k0 : k0 + k].float())
            else:
                out.append(logits[k0].float())
        return out

    def _lora_step(self, rows: list[Row]) -> LoraStep | None:
        """The adapters of a forward over ``rows`` (None without LoRA or when no row uses one)."""
        return self.adapters.step([(r.lora, len(r.tokens)) for r in rows]) if self.adapters is not None else None

    def _count_lora(self, step: LoraStep | None) -> None:
        if step is not None:
            self.adapters.projection_applications += step.applications


__all__ = ["PagedForward", "Row"]
