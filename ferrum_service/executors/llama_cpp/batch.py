"""The step's one ``llama_decode``: a reusable ``llama_batch`` filled from a step's rows, with logits
requested only for the positions whose rows are wanted, and the logits rows read back as numpy
arrays (no torch on this path): copies, or for a step whose logits only its own sampling reads
(``StepPlan.transient``) zero-copy views of llama.cpp's buffer."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ...core import errors
from ...core.steps import StepRow, Want


class DecodeBatch:
    """One ``llama_batch`` of up to ``n_batch`` tokens for a context, filled and decoded per step."""

    def __init__(self, L: Any, ctx: Any, n_batch: int, vocab_size: int) -> None:
        self._L, self._ctx = L, ctx
        self.n_batch = n_batch
        self.vocab_size = vocab_size
        self.batch = L.llama_batch_init(n_batch, 0, 1)
        # numpy views of the batch's arrays, made once (a view per step costs more than a decode's
        # own Python work at B=1).
        b = self.batch
        self._tok = np.ctypeslib.as_array(b.token, shape=(n_batch,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(n_batch,))
        self._out = np.ctypeslib.as_array(b.logits, shape=(n_batch,))
        np.ctypeslib.as_array(b.n_seq_id, shape=(n_batch,))[:] = 1

    def free(self) -> None:
        """Give the batch's arrays back to llama.cpp (once, at teardown)."""
        self._L.llama_batch_free(self.batch)

    def decode(self, items: list[StepRow], placed: list[tuple[int, int]], views: bool = False,
               on_forward: Callable[[], None] | None = None) -> list[np.ndarray | None]:
        """One ``llama_decode`` of ``items`` (row ``i``'s tokens written into sequence
        ``placed[i][0]`` from position ``placed[i][1]``): per row its logits (``[vocab]``,
        ``[n, vocab]`` for :attr:`Want.ALL`, None for :attr:`Want.NONE`). RESOURCE_EXHAUSTED when
        llama.cpp finds no free KV cells. ``views``: a :attr:`Want.LAST` row is a zero-copy view of
        llama.cpp's logits buffer (``llama_get_logits_ith``), valid until the context's next
        decode (and writable: a structured-output mask is applied to it in place); else a copy.
        ``on_forward``: called right before ``llama_decode`` (``StepPlan.on_forward``)."""
        L, b = self._L, self.batch
        n = sum(len(it.tokens) for it in items)
        tok, pos, out = self._tok, self._pos, self._out
        out[:n] = 0
        rows: list[tuple[Want, int, int]] = [(Want.NONE, 0, 0)] * len(items)  # (want, first batch index, count)
        i = 0
        # Rows in sequence-id order: with KV streams llama.cpp puts only consecutive ids into one
        # ubatch (one pass over the weights), so an unsorted step would take several.
        for r in sorted(range(len(items)), key=lambda r: placed[r][0]):
            it, (seq, past) = items[r], placed[r]
            k = len(it.tokens)
            tok[i:i + k] = it.tokens
            pos[i:i + k] = np.arange(past, past + k)
            sid = b.seq_id
            for j in range(i, i + k):
                sid[j][0] = seq
            if it.want == Want.ALL:
                out[i:i + k] = 1
            elif it.want == Want.LAST:
                out[i + k - 1] = 1
            rows[r] = (it.want, i, k)
            i += k
        b.n_tokens = n
        if on_forward is not None:
            on_forward()
        rc = L.llama_decode(self._ctx, b)
        if rc == 1:
            raise errors.exhausted("llama.cpp found no free KV cells for the step", needed=n)
        if rc != 0:
            raise errors.FerrumError(errors.ErrorKind.BACKEND, f"llama_decode failed with code {rc}")
        V = self.vocab_size
        result: list[np.ndarray | None] = []
        for want, start, k in rows:
            if want == Want.NONE:
                result.append(None)
                continue
            if want == Want.LAST:
                row = np.ctypeslib.as_array(L.llama_get_logits_ith(self._ctx, start + k - 1), shape=(V,))
                result.append(row if views else row.copy())
                continue
            arr = np.stack([np.ctypeslib.as_array(L.llama_get_logits_ith(self._ctx, j), shape=(V,))
                            for j in range(start, start + k)])
            result.append(arr)
        return result


__all__ = ["DecodeBatch"]
