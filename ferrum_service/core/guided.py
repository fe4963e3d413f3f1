"""Structured output on the server: constraint masks with xgrammar (see ``OutputConstraint``).

Why xgrammar: measured here on SmolLM2's 49k vocabulary (random logits, one JSON-schema row at a
time, 2 cores, compact whitespace): xgrammar 0.2.9 takes 0.38 ms per token for mask + apply and
9 ms to compile the schema; llguidance 1.9.1 took 2 s for its first mask and ~17 ms per token after
that. The end-to-end cost is a row in the benchmark table.

Rooms:

- :class:`Guides`, one per hosted model (on its executor): the vocabulary as xgrammar sees it (from
  the model's own tokenizer: transformers or llama.cpp's), a grammar compiler with its cache, and
  :meth:`Guides.compile` (INVALID_ARGUMENT naming the field when a constraint does not compile).
- :class:`GuideState`, one per cache (``CacheEntry.guide``): the matcher, where the constrained
  output starts and the tokens it accepted. It follows the cache lazily: before each masked row it
  compares its tokens with the cache's (after ``start``), rolls back what the cache no longer holds
  (TruncateKv) and accepts what it gained (the tokens fed back). A fork gets a fresh matcher at the
  same start, which replays the fork's tokens the same way.
- :func:`mask_rows`: the masks of every constrained row of a step, filled into one bitmask and
  applied in place, before the logits policies run.
- :func:`prepare_masks`: the same masks computed *while the forward runs*, for the rows whose
  next mask is known before it (a decode step on a cache whose constraint is under way: its
  matcher only needs the token the step feeds). On a thread of its own; :func:`mask_rows` then
  only applies them. Where it pays: on this project's 2-core CPU machine it does not
  (``benchmarks/structured_overlap.py``, SmolLM2, in one process: a step with the masks after the
  forward takes 0.93-0.97x the time of one with them during it, on both executors, 1 and 8
  streams: the mask thread takes a core from a forward that uses both), so it is on by default only
  for models on CUDA, whose forward leaves the CPU free; ``FERRUM_GUIDED_OVERLAP=1|0`` forces it.
"""

from __future__ import annotations

import collections
import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from . import errors
from .kv_registry import CacheEntry
from .settings import from_env
from .types import ConstraintSpec, LogitsPolicy

if TYPE_CHECKING:  # xgrammar's bitmasks are torch tensors: torch comes with it (the ``models`` extra)
    import torch

    from .types import Rows


@dataclass
class GuideState:
    """A cache's constraint: the matcher, the cache length it started at, the tokens it accepted."""

    spec: ConstraintSpec
    start: int
    matcher: Any
    accepted: list[int] = field(default_factory=list)
    broken: str = ""  # why the cache's tokens left the constraint ("" = they did not)
    refused: int = -1  # the token that broke it (at ``start + len(accepted)``), while ``broken``
    after_end: int = 0  # end tokens taken after the matcher terminated (ignore_eos): not in the matcher
    compiled: Any = field(default=None, repr=False, compare=False)  # what the matcher runs (forks reuse it)

    def spawn(self, compiled: Any = None) -> "GuideState":
        """The state for a fork of this cache: same constraint and start, a fresh matcher (it
        replays the fork's tokens at its next row)."""
        compiled = compiled if compiled is not None else self.compiled
        return GuideState(self.spec, self.start, new_matcher(compiled), compiled=compiled)


def new_matcher(compiled: Any) -> Any:
    """A fresh xgrammar matcher over a compiled constraint (rolls back any number of tokens)."""
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)


class Guides:
    """One model's vocabulary for xgrammar, its compiler and a bounded cache of compiled
    constraints (LRU, at most :attr:`cache_entries` and :attr:`cache_bytes`; xgrammar's own cache,
    unbounded, is off). Thread-safe: compiles run on the server's compile pool
    (``constraint_compile.py``), lookups on the event loop."""

    #: Compiled constraints kept per model, and their bytes (xgrammar's ``memory_size_bytes``).
    cache_entries = 256
    cache_bytes = 256 * 1024 * 1024

    def __init__(self, executor: Any) -> None:
        self.executor = executor
        self.vocab_size = int(executor.info().vocab_size)
        self._compiler = None
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[ConstraintSpec, tuple[Any, int]] = collections.OrderedDict()
        self._cached_bytes = 0

    def _compiler_for(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                self._compiler = xgr.GrammarCompiler(_tokenizer_info(self.executor, self.vocab_size), max_threads=2,
                                                     cache_enabled=False)
            return self._compiler

    def check_tokenizer(self, field: str) -> None:
        """FAILED_PRECONDITION when the model has no tokenizer (nothing to constrain)."""
        if self.executor.tokenizer is None:
            raise errors.failed_precondition(f"{field}: model {self.executor.info().model_id!r} has no tokenizer, so it "
                                             "cannot constrain text", field=field)

    def cached(self, spec: ConstraintSpec) -> Any:
        """The compiled constraint if it is in the cache (it becomes the most recent), else None."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is None:
                return None
            self._cache.move_to_end(spec)
            return hit[0]

    def _keep(self, spec: ConstraintSpec, compiled: Any) -> None:
        size = int(getattr(compiled, "memory_size_bytes", 0) or 0)
        with self._lock:
            old = self._cache.pop(spec, None)
            if old is not None:
                self._cached_bytes -= old[1]
            self._cache[spec] = (compiled, size)
            self._cached_bytes += size
            while len(self._cache) > 1 and (len(self._cache) > self.cache_entries
                                            or self._cached_bytes > self.cache_bytes):
                _, (_, b) = self._cache.popitem(last=False)
                self._cached_bytes -= b

    def compile(self, spec: ConstraintSpec, field: str, keep: Callable[[], bool] | None = None) -> Any:
        """The compiled constraint (from the cache, or compiled now: blocks for as long as that
        takes, so the server calls it on its compile pool); INVALID_ARGUMENT when it does not compile.
        ``keep``: asked once compiled whether to cache the result (a compile past its time limit is not)."""
        self.check_tokenizer(field)
        hit = self.cached(spec)
        if hit is not None:
            return hit
        comp = self._compiler_for()
        try:
            if spec.kind == "json_schema":
                # xgrammar's own default is ", " / ": "; the contract promises no insignificant whitespace
                out = comp.compile_json_schema(spec.text, any_whitespace=False, separators=(",", ":"))
            elif spec.kind == "regex":
                out = comp.compile_regex(spec.text)
            elif spec.kind == "ebnf_grammar":
                out = comp.compile_grammar(spec.text)
            elif spec.kind == "lark_grammar":
                out = comp.compile_lark(spec.text)
            else:
                out = comp.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choices))
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with the parser's message
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            msg = msg.split(" is false: ", 1)[-1]  # drop xgrammar's "[time] file.cc:N: Check failed: (..)" prefix
            raise errors.invalid(f"{field}.{spec.kind} does not compile: {msg[:300]}", field=f"{field}.{spec.kind}") from None
        if keep is None or keep():
            self._keep(spec, out)
        return out


def guides_of(executor: Any) -> Guides:
    """The executor's :class:`Guides` (its ``guides`` attribute, made on first use)."""
    g = executor.guides
    if g is None:
        g = executor.guides = Guides(executor)
    return g


def _tokenizer_info(executor: Any, vocab_size: int):
    import xgrammar as xgr

    tok = executor.tokenizer
    stops = list(executor.info().eos_token_ids)
    if hasattr(tok, "backend_tokenizer") or hasattr(tok, "get_vocab"):  # a transformers tokenizer
        return xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size, stop_token_ids=stops or None)
    # llama.cpp's tokenizer: each token's raw bytes (control tokens have none and count as special)
    pieces = [tok.token_bytes(i) for i in range(tok.vocab_size)]
    return xgr.TokenizerInfo(pieces, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops or None)


def sync(state: GuideState, tokens: Sequence[int]) -> None:
    """Bring the matcher to a cache's tokens (all of them): roll back what the cache dropped,
    accept what it gained. A token the constraint refuses marks the state broken."""
    hist = tokens[state.start:]
    acc = state.accepted
    c = 0
    for a, b in zip(acc, hist):
        if a != b:
            break
        c += 1
    if c < len(acc):
        drop = len(acc) - c
        past_end = min(drop, state.after_end)  # the last tokens taken were end tokens past the end
        state.after_end -= past_end
        if drop > past_end:
            state.matcher.rollback(drop - past_end)
        del acc[c:]
        state.broken = ""
    if state.broken:
        if len(hist) > len(acc) and int(hist[len(acc)]) == state.refused:
            return
        state.broken = ""  # the refused token is gone (truncated away, or replaced): go on from here
    for t in hist[c:]:
        if state.matcher.is_terminated() and int(t) in state.matcher.stop_token_ids:
            state.after_end += 1  # generation goes on past the end (ignore_eos): more end tokens
            acc.append(int(t))
            continue
        if not state.matcher.accept_token(int(t)):
            state.broken = f"token {t} at position {state.start + len(acc)} is not allowed by the constraint"
            state.refused = int(t)
            return
        acc.append(int(t))


def _fill(st: GuideState, tokens: Sequence[int], bitmask: torch.Tensor, j: int) -> str:
    """Sync ``st`` to ``tokens`` and fill ``bitmask[j]`` with its next mask; "" or why the tokens
    left the constraint (then only end tokens are allowed)."""
    sync(st, tokens)
    if st.broken or st.matcher.is_terminated():  # off the constraint, or done: end tokens only
        bitmask[j].zero_()
        for t in st.matcher.stop_token_ids:
            bit = 1 << (t % 32)
            bitmask[j, t // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 words
        return st.broken
    st.matcher.fill_next_token_bitmask(bitmask, j)
    return ""


_pool: ThreadPoolExecutor | None = None


def overlapping(executor: Any) -> bool:
    """Whether this model's masks are computed during the forward (``prepare_masks``): the
    ``guided_overlap`` setting (``FERRUM_GUIDED_OVERLAP``, read at each call): "auto" for models on
    CUDA, or forced "1" / "0"."""
    mode = from_env("guided_overlap")
    return mode == "1" or (mode != "0" and str(executor.info().device).startswith("cuda"))


@dataclass
class PreparedMasks:
    """Masks being computed during a forward: ``rows`` (decode-row index -> bitmask row)."""

    rows: dict[int, int]
    bitmask: torch.Tensor
    done: Future

    def result(self) -> list[str]:
        return self.done.result()


def prepare_masks(executor: Any, entries: Sequence[CacheEntry], fed: Sequence[int],
                  policies: Sequence[LogitsPolicy]) -> PreparedMasks | None:
    """Start computing, on the mask thread, the masks of the decode rows whose constraint is under
    way (``entries[i]`` holds a matching state; ``fed[i]``: the token the step appends). Call before
    the forward, where :func:`overlapping` says so; :func:`mask_rows` with ``prepared`` applies
    them after it."""
    jobs = []
    for i, (e, p) in enumerate(zip(entries, policies)):
        sp = p.sampling
        st = e.guide
        if sp.constraint is not None and st is not None and st.spec == sp.constraint and e.num_tokens >= st.start:
            jobs.append((i, st, list(e.tokens) + [int(fed[i])]))
    if not jobs:
        return None
    import xgrammar as xgr

    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(1, thread_name_prefix="ferrum-masks")
    bitmask = xgr.allocate_token_bitmask(len(jobs), guides_of(executor).vocab_size)
    done = _pool.submit(lambda: [_fill(st, toks, bitmask, j) for j, (_i, st, toks) in enumerate(jobs)])
    return PreparedMasks({i: j for j, (i, _st, _t) in enumerate(jobs)}, bitmask, done)


def mask_rows(executor: Any, entries: Sequence[CacheEntry | None], rows: Sequence[Rows | None],
              policies: Sequence[LogitsPolicy], prepared: PreparedMasks | None = None,
              prepared_offset: int = 0) -> list[str]:
    """Apply each constrained row's mask in place (rows are the logits each entry's next token is
    drawn from). Returns per row "" or why its cache left its constraint (that row is then
    restricted to the model's end tokens). ``prepared`` (from :func:`prepare_masks`, its rows
    numbered from ``prepared_offset`` here) supplies the masks already computed."""
    idx = [i for i, p in enumerate(policies)
           if p.sampling.constraint is not None and rows[i] is not None and entries[i] is not None]
    problems = [""] * len(policies)
    if not idx and prepared is None:
        return problems
    import torch
    import xgrammar as xgr

    guides = guides_of(executor)
    ready = {}
    if prepared is not None:
        for i, why in zip(prepared.rows, prepared.result()):
            problems[i + prepared_offset] = why
        ready = {i + prepared_offset: j for i, j in prepared.rows.items()}
    todo = [i for i in idx if i not in ready]
    bitmask = xgr.allocate_token_bitmask(max(1, len(todo)), guides.vocab_size)
    where = {}
    for j, i in enumerate(todo):
        entry, sp = entries[i], policies[i].sampling
        st = entry.guide
        if st is None or st.spec != sp.constraint or entry.num_tokens < st.start:
            st = entry.guide = GuideState(sp.constraint, entry.num_tokens, new_matcher(sp.compiled), compiled=sp.compiled)
        problems[i] = _fill(st, entry.tokens, bitmask, j)
        where[i] = (bitmask, j)
    for i, j in ready.items():
        where[i] = (prepared.bitmask, j)
    for i in idx:
        mask, j = where[i]
        row = rows[i]
        if not isinstance(row, torch.Tensor):  # a numpy row (llama.cpp): a tensor on its memory, masked in place
            row = torch.from_numpy(row)
        view = row.view(1, -1) if row.dim() == 1 else row[-1:]
        xgr.apply_token_bitmask_inplace(view, mask[j:j + 1].to(row.device), vocab_size=guides.vocab_size)
    return problems


def refuse_broken(problems: Sequence[str], field: str) -> None:
    """FAILED_PRECONDITION for the first row whose cache left its constraint (see :func:`mask_rows`)."""
    first = next((p for p in problems if p), "")
    if first:
        raise errors.failed_precondition(f"{field}: {first} (the cache holds it: truncate it to go on)", field=field)


__all__ = ["GuideState", "Guides", "PreparedMasks", "guides_of", "mask_rows", "new_matcher", "overlapping",
           "prepare_masks", "refuse_broken", "sync"]
