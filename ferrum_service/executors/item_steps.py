"""The step shape shared by executors that own per-sequence KV caches (transformers, llama.cpp).

Every compute method of such an executor becomes one list of :class:`StepRow` (a sequence's new
tokens, its cache or None for a new one, which logits rows to keep) run by the executor's own
``_step(items, field)`` as one forward, all or nothing, returning ``(entry, logits)`` per item.
:class:`ItemStepExecutor` builds the items from the interface's inputs (checking positions) and the
outputs from the results, so each executor only implements ``_step``.
"""

from __future__ import annotations

import abc

import torch

from ..core import errors
from ..core.kv_registry import CacheEntry
from ..core.steps import StepRow, Want
from ..core.types import (
    DecodeInput,
    DecodeOutput,
    LogitsPolicy,
    PrefillInput,
    PrefillOutput,
    UnifiedItem,
    UnifiedResult,
    VerifyOutput,
)
from .base import ModelExecutor


class ItemStepExecutor(ModelExecutor):
    """Prefill / decode / mixed / unified / verify steps as one ``_step`` over items."""

    #: A decode step may carry draft tokens (``DecodeInput.draft``): one multi-token row in the
    #: same forward as the other rows.
    supports_draft_rows = True

    @abc.abstractmethod
    def _step(self, items: list[StepRow], field: str) -> list[tuple[CacheEntry, torch.Tensor | None]]:
        """Admit, run one forward over ``items`` and commit them (nothing on failure)."""

    # ---- interface --------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, inp: PrefillInput) -> PrefillOutput:
        items = self._prefill_items([inp], "input")
        return self._prefill_outputs(items, self._step(items, "input"))[0]

    @torch.inference_mode()
    def batch_prefill(self, inputs: list[PrefillInput]) -> list[PrefillOutput]:
        """All prompts (new or continued caches) in one forward; all or nothing."""
        items = self._prefill_items(inputs, "inputs")
        return self._prefill_outputs(items, self._step(items, "inputs"))

    @torch.inference_mode()
    def decode(self, inp: DecodeInput) -> DecodeOutput:
        return self._decode_outputs(self._step(self._decode_items([inp], "input"), "input"))[0]

    @torch.inference_mode()
    def batch_decode(self, inputs: list[DecodeInput]) -> list[DecodeOutput]:
        """One token into each cache (any lengths) in one forward; all or nothing."""
        return self._decode_outputs(self._step(self._decode_items(inputs, "inputs"), "inputs"))

    @torch.inference_mode()
    def mixed_step(self, prefills: list[PrefillInput], decodes: list[DecodeInput]
                   ) -> tuple[list[PrefillOutput], list[DecodeOutput]]:
        """New prompts (or prompt chunks) and other sequences' decode steps in one forward."""
        items = self._prefill_items(prefills, "inputs") + self._decode_items(decodes, "inputs")
        results = self._step(items, "inputs")
        n = len(prefills)
        return self._prefill_outputs(items[:n], results[:n]), self._decode_outputs(results[n:])

    @torch.inference_mode()
    def unified_decode(self, items: list[UnifiedItem]) -> list[UnifiedResult]:
        """Prefill chunks and decode steps in one forward; logits only for final items."""
        work = []
        for k, it in enumerate(items):
            entry = self.registry.get(it.cache_id, field=f"items[{k}].cache_id") if it.cache_id else None
            have = entry.num_tokens if entry else 0
            if it.pos_offset != have:
                raise errors.failed_precondition(
                    f"items[{k}].pos_offset is {it.pos_offset} but the cache holds {have} tokens",
                    field=f"items[{k}].pos_offset")
            work.append(StepRow(entry, list(it.q_tokens),
                                 Want.LAST if it.is_final_chunk and it.policy.needs_logits else Want.NONE,
                                 salt=it.cache_salt, bypass=it.bypass_prefix_cache, adapter=it.adapter))
        results = self._step(work, "items")
        return [UnifiedResult(seq_id=it.seq_id, cache=self.handle(e), logits=l if it.is_final_chunk else None,
                              cached_tokens=w.cached)
                for it, w, (e, l) in zip(items, work, results)]

    @torch.inference_mode()
    def forward_verify(self, cache_id: str, token_ids: list[int], policy: LogitsPolicy) -> VerifyOutput:
        """N+1 tokens into one cache in one forward; row i is the output after ``token_ids[i]``."""
        entry = self.registry.get(cache_id)
        base = entry.num_tokens
        ((entry, rows),) = self._step([StepRow(entry, list(token_ids), Want.ALL)], "token_ids")
        return VerifyOutput(rows=rows, cache=self.handle(entry), base_len=base)

    def _fork_source(self, cache_id: str, keep_tokens: int | None) -> tuple[CacheEntry, int]:
        """The cache a fork copies and how many of its tokens (all when ``keep_tokens`` is None;
        OUT_OF_RANGE outside ``[1, its length]``)."""
        if self.state == "shutdown":
            raise errors.unavailable(f"model {self.model_id!r} is shut down")
        src = self.registry.get(cache_id)
        keep = src.num_tokens if keep_tokens is None else int(keep_tokens)
        if not 1 <= keep <= src.num_tokens:
            raise errors.out_of_range(f"keep_tokens must be in [1, {src.num_tokens}], not {keep}",
                                      field="keep_tokens", num_tokens=src.num_tokens)
        return src, keep

    # ---- items and outputs ------------------------------------------------------------------------
    def _prefill_items(self, inputs: list[PrefillInput], field: str) -> list[StepRow]:
        items = []
        for inp in inputs:
            entry = self.registry.get(inp.cache_id, field=f"{field}.cache_id") if inp.cache_id else None
            want = Want.NONE if not inp.policy.needs_logits else Want.ALL if inp.all_positions else Want.LAST
            items.append(StepRow(entry, list(inp.token_ids), want, reserve=int(inp.reserve_tokens or 0),
                                  salt=inp.cache_salt, bypass=inp.bypass_prefix_cache, adapter=inp.adapter))
        return items

    def _decode_items(self, inputs: list[DecodeInput], field: str) -> list[StepRow]:
        items = []
        for inp in inputs:
            entry = self.registry.get(inp.cache_id, field=f"{field}.cache_id")
            if inp.position is not None and inp.position != entry.num_tokens:
                raise errors.failed_precondition(
                    f"{field}.position: the cache holds {entry.num_tokens} tokens, so the token is written at "
                    f"{entry.num_tokens}, not {inp.position}", field=f"{field}.position")
            if inp.draft:  # a speculative row: every position's logits verify the drafts
                items.append(StepRow(entry, [int(inp.token_id)] + [int(t) for t in inp.draft], Want.ALL))
                continue
            items.append(StepRow(entry, [int(inp.token_id)], Want.LAST if inp.policy.needs_logits else Want.NONE))
        return items

    def _prefill_outputs(self, items: list[StepRow], results) -> list[PrefillOutput]:
        """Logits ``[n, vocab]`` (all positions asked for) give ``all_logits`` and their last row."""
        outs = []
        for it, (entry, logits) in zip(items, results):
            out = PrefillOutput(cache=self.handle(entry), cached_tokens=it.cached)
            if logits is not None and logits.dim() == 2:
                out.all_logits, out.logits = logits, logits[-1]
            else:
                out.logits = logits
            outs.append(out)
        return outs

    def _decode_outputs(self, results) -> list[DecodeOutput]:
        return [DecodeOutput(cache=self.handle(e), logits=l) for e, l in results]


__all__ = ["ItemStepExecutor"]
