"""The step entry of executors that own per-sequence KV caches (transformers, llama.cpp).

Such an executor runs a whole :class:`~ferrum_service.core.steps.StepPlan` as one forward over its
rows, all or nothing: its own ``_step(rows, field)`` admits, computes and commits, returning
``(entry, logits)`` per row. :class:`ItemStepExecutor` implements ``execute(plan)`` on it, and every
method of the executor interface (prefill, decode, their batches, unified decode, verify) as a plan
of rows built by :class:`~ferrum_service.core.steps.StepRow` — so each executor only implements
``_step``.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Callable

from ..core import errors
from ..core.kv_registry import CacheEntry
from ..core.steps import RowOutput, StepPlan, StepRow
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
from .base import ModelExecutor, prefill_outputs

if TYPE_CHECKING:
    from ..core.types import Rows


class ItemStepExecutor(ModelExecutor):
    """Every step as one ``_step`` over its rows."""

    #: A decode step may carry draft tokens (``DecodeInput.draft``): one multi-token row in the
    #: same forward as the other rows.
    supports_draft_rows = True

    @abc.abstractmethod
    def _step(self, items: list[StepRow], field: str, on_forward: Callable[[], None] | None = None
              ) -> list[tuple[CacheEntry, Rows | None, int]]:
        """Admit, run one forward over ``items`` and commit them (nothing on failure): per row its
        cache, its logits and the leading tokens it took from the prefix cache; ``on_forward``
        called right before the forward (``StepPlan.on_forward``). A torch executor runs it under
        ``torch.inference_mode``."""

    def execute(self, plan: StepPlan) -> list[RowOutput]:
        """The plan's rows in one forward (``_step``), all or nothing."""
        return [RowOutput(self.handle(e), logits, cached=cached)
                for e, logits, cached in self._step(plan.rows, plan.field, on_forward=plan.on_forward)]

    # ---- the interface, as plans ------------------------------------------------------------------
    def _prompts(self, inputs: list[PrefillInput], field: str) -> list[StepRow]:
        reg = self.registry
        return [StepRow.prompt(i, reg.get(i.cache_id, field=f"{field}.cache_id") if i.cache_id else None)
                for i in inputs]

    def _decodes(self, inputs: list[DecodeInput], field: str) -> list[StepRow]:
        return [StepRow.decode(i, self.registry.get(i.cache_id, field=f"{field}.cache_id"), field) for i in inputs]

    def prefill(self, inp: PrefillInput) -> PrefillOutput:
        rows = self._prompts([inp], "input")
        return prefill_outputs(rows, self.execute(StepPlan(rows, "input")))[0]

    def batch_prefill(self, inputs: list[PrefillInput]) -> list[PrefillOutput]:
        """All prompts (new or continued caches) in one forward; all or nothing."""
        rows = self._prompts(inputs, "inputs")
        return prefill_outputs(rows, self.execute(StepPlan(rows, "inputs")))

    def decode(self, inp: DecodeInput) -> DecodeOutput:
        return self.batch_decode([inp], "input")[0]

    def batch_decode(self, inputs: list[DecodeInput], field: str = "inputs") -> list[DecodeOutput]:
        """One token into each cache (any lengths) in one forward; all or nothing."""
        outs = self.execute(StepPlan(self._decodes(inputs, field), field))
        return [DecodeOutput(cache=o.cache, logits=o.logits) for o in outs]

    def unified_decode(self, items: list[UnifiedItem]) -> list[UnifiedResult]:
        """Prefill chunks and decode steps in one forward; logits only for final items."""
        reg = self.registry
        rows = [StepRow.unified(it, reg.get(it.cache_id, field=f"items[{k}].cache_id") if it.cache_id else None,
                                f"items[{k}]")
                for k, it in enumerate(items)]
        outs = self.execute(StepPlan(rows, "items"))
        return [UnifiedResult(seq_id=it.seq_id, cache=o.cache, logits=o.logits if it.is_final_chunk else None,
                              cached_tokens=o.cached)
                for it, o in zip(items, outs)]

    def forward_verify(self, cache_id: str, token_ids: list[int], policy: LogitsPolicy) -> VerifyOutput:
        """N+1 tokens into one cache in one forward; row i is the output after ``token_ids[i]``."""
        entry = self.registry.get(cache_id)
        base = entry.num_tokens
        (out,) = self.execute(StepPlan([StepRow.verify(entry, token_ids, policy)], "token_ids"))
        return VerifyOutput(rows=out.logits, cache=out.cache, base_len=base)

    def _fork_source(self, cache_id: str, keep_tokens: int | None) -> tuple[CacheEntry, int]:
        """The cache a fork copies and how many of its tokens (all when ``keep_tokens`` is None;
        OUT_OF_RANGE outside ``[1, its length]``)."""
        self.check_up()
        src = self.registry.get(cache_id)
        keep = src.num_tokens if keep_tokens is None else int(keep_tokens)
        if not 1 <= keep <= src.num_tokens:
            raise errors.out_of_range(f"keep_tokens must be in [1, {src.num_tokens}], not {keep}",
                                      field="keep_tokens", num_tokens=src.num_tokens)
        return src, keep


__all__ = ["ItemStepExecutor"]
