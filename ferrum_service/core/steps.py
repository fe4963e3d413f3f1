"""A step as data: what one forward is made of, what it costs, and how it is run.

Every forward the server runs — a unary Prefill / Decode / BatchPrefill / BatchDecode /
UnifiedDecode / ForwardVerify, or a batched step of the ``Generate`` streams — is one
:class:`StepPlan`: a list of :class:`StepRow` (a sequence's share of the forward: the cache it
continues or None for a new one, the tokens fed, which logits rows come back, how they are turned
into output, the KV it reserves, a new cache's prefix-cache options and adapter). The plan is built
once, from the request (``wire/validate.py``) or by the batcher (``hosting/batcher.py``), and then:

- :meth:`StepPlan.check` / :meth:`StepPlan.fits`: its cost against the model's one set of
  :class:`StepLimits` (INVALID_ARGUMENT: a step over a ceiling can never run; the batcher asks
  ``fits`` and splits instead);
- :meth:`StepPlan.admission`: the KV it adds, for the executor's admission before any work;
- :func:`run`: on the model's worker, masks → ``executor.execute(plan)`` → stats → sampling →
  refusal of rows whose fed token broke their constraint. Every executor implements one entry,
  ``execute(plan)``, all or nothing.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

from . import errors
from .guided import mask_rows, overlapping, prepare_masks, refuse_broken
from .kv_registry import CacheEntry
from .sampling import RowResult, process_rows
from .settings import default
from .speculation import sample_verified
from .types import CacheHandle, DecodeInput, LogitsPolicy, OutputMode, PrefillInput, StepCost, UnifiedItem

if TYPE_CHECKING:
    from .types import Rows

_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


class StepExecutor(Protocol):
    """What a step needs of an executor (``executors/base.py``'s ``ModelExecutor`` implements it)."""

    registry: Any
    stats: Any

    def step_cost(self, rows: list[tuple[int, int]], logits_rows: int) -> StepCost: ...

    def admit_kv(self, grow: list[tuple[CacheEntry, int]], new: list["StepRow"], field: str) -> None: ...

    def execute(self, plan: "StepPlan") -> list["RowOutput"]: ...


class Want(enum.StrEnum):
    """Which logits rows a step row returns."""

    NONE = "none"  # none: a prompt chunk in the middle of a prompt, or a caller who wants no output
    LAST = "last"  # the row after the last token fed
    ALL = "all"  # one row after each token fed (all positions, verification of drafts)


class RowKind(enum.StrEnum):
    """What a row is, for the model's counters and for how its logits rows are read."""

    PROMPT = "prompt"  # a prompt or a chunk of one (Prefill, a unified prompt chunk)
    DECODE = "decode"  # one fed token (plus drafts to verify, if any)
    VERIFY = "verify"  # ForwardVerify: N+1 tokens, every position's output


@dataclass(frozen=True)
class StepRow:
    """One sequence's share of a step: ``tokens`` appended to ``entry`` (None = a new cache).
    Frozen: admission and the executor read a plan, they never edit it; what the executor found
    (its prefix-cache hit) comes back in :attr:`RowOutput.cached`."""

    entry: CacheEntry | None
    tokens: list[int]
    want: Want
    policy: LogitsPolicy | None = None  # how the row's logits become output (None: returned as they are)
    kind: RowKind = RowKind.PROMPT
    reserve: int = 0  # a new cache's KV reservation (tokens it may reach)
    salt: str = ""  # a new cache's prefix-cache salt
    bypass: bool = False  # a new cache computes every token (no prefix-cache lookup)
    adapter: str = ""  # LoRA adapter: a new cache's; for a live cache "" or its own (checked by the executor)
    drafts: int = 0  # a decode row's trailing draft tokens, verified in this forward (speculation.py)
    cached: int = 0  # a new cache's leading tokens the prefix cache is expected to hold (the batcher's estimate, for the cost)

    def __post_init__(self) -> None:
        object.__setattr__(self, "want", Want(self.want))  # "last" and Want.LAST alike

    @property
    def past(self) -> int:
        """Tokens the row's cache holds before the step (a new row: its prefix-cache hit)."""
        return self.entry.num_tokens if self.entry is not None else self.cached

    @property
    def computed(self) -> int:
        """Tokens the forward computes for this row."""
        return len(self.tokens) - (self.cached if self.entry is None else 0)

    @property
    def logits_rows(self) -> int:
        return len(self.tokens) if self.want is Want.ALL else 1 if self.want is Want.LAST else 0

    # ---- built from the executor interface's inputs ----------------------------------------------
    @classmethod
    def prompt(cls, inp: PrefillInput, entry: CacheEntry | None, cached: int = 0) -> "StepRow":
        """A prompt (or a chunk of one) continuing ``entry`` or making a new cache (``cached``: the
        prefix-cache hit expected for a new one)."""
        want = Want.NONE if not inp.policy.needs_logits else Want.ALL if inp.all_positions else Want.LAST
        return cls(entry, list(inp.token_ids), want, inp.policy, RowKind.PROMPT, reserve=int(inp.reserve_tokens or 0),
                   salt=inp.cache_salt, bypass=inp.bypass_prefix_cache, adapter=inp.adapter,
                   cached=cached if entry is None else 0)

    @classmethod
    def decode(cls, inp: DecodeInput, entry: CacheEntry, field: str) -> "StepRow":
        """One token into ``entry`` (and the drafts to verify after it); FAILED_PRECONDITION when
        ``inp.position`` is not where the token is written."""
        if inp.position is not None and inp.position != entry.num_tokens:
            raise errors.failed_precondition(
                f"{field}.position = {inp.position} but cache {entry.cache_id!r} holds {entry.num_tokens} tokens",
                field=f"{field}.position", num_tokens=entry.num_tokens)
        if inp.draft:  # every position's logits verify the drafts
            return cls(entry, [int(inp.token_id)] + [int(t) for t in inp.draft], Want.ALL, inp.policy,
                       RowKind.DECODE, drafts=len(inp.draft))
        return cls(entry, [int(inp.token_id)], Want.LAST if inp.policy.needs_logits else Want.NONE, inp.policy,
                   RowKind.DECODE)

    @classmethod
    def unified(cls, it: UnifiedItem, entry: CacheEntry | None, field: str) -> "StepRow":
        """A unified-batch item: logits only for a final chunk; FAILED_PRECONDITION when
        ``pos_offset`` is not the cache's length."""
        have = entry.num_tokens if entry is not None else 0
        if it.pos_offset != have:
            raise errors.failed_precondition(f"{field}.pos_offset = {it.pos_offset} but the cache holds {have} tokens",
                                             field=f"{field}.pos_offset", num_tokens=have)
        final = it.is_final_chunk and it.policy.needs_logits
        kind = RowKind.DECODE if entry is not None and len(it.q_tokens) == 1 and it.is_final_chunk else RowKind.PROMPT
        return cls(entry, list(it.q_tokens), Want.LAST if final else Want.NONE, it.policy if final else None, kind,
                   salt=it.cache_salt, bypass=it.bypass_prefix_cache, adapter=it.adapter)

    @classmethod
    def verify(cls, entry: CacheEntry, tokens: list[int], policy: LogitsPolicy) -> "StepRow":
        """ForwardVerify: N+1 tokens into ``entry``; row i is the output after ``tokens[i]``."""
        return cls(entry, [int(t) for t in tokens], Want.ALL, policy, RowKind.VERIFY)


@dataclass
class StepLimits:
    """The per-step ceilings every step is checked against (request time and batcher alike)."""

    max_step_tokens: int = 0  # positions one forward may compute, padding included (0 = none)
    max_step_bytes: int = default("max_step_bytes")  # transient memory one forward may need (0 = none)
    max_response_bytes: int = default("max_message_bytes")  # one response (the message size limit)
    max_text_bytes: int = default("max_text_bytes")  # text one request asks to tokenize or template
    max_rows: int = 0  # sequences in one forward (the executor's batch size; 0 = none)


@dataclass
class StepPlan:
    """One forward: its rows, the request field they came from, and whether a row whose fed token
    broke its structured-output constraint fails the step (unary steps) or is left to its stream."""

    rows: list[StepRow]
    field: str = "inputs"
    refuse_broken: bool = True
    #: The rows' raw logits are read only by this step's own sampling (:func:`run`), before the
    #: executor's next forward (the batcher's steps: streams get tokens, never logits), so an
    #: executor may hand back views of its own output buffer instead of copies. Unary steps, whose
    #: callers may keep the logits, leave it False.
    transient: bool = False
    #: Called once on the worker right before the forward's native call starts (which releases
    #: the GIL), by an executor that supports it (llama.cpp's); the batcher's chained steps post
    #: the previous step's row to the event loop there, so the loop's work on it overlaps the
    #: forward instead of contending with the step's own Python. Whoever sets it checks that it ran.
    on_forward: Callable[[], None] | None = None

    # ---- cost -------------------------------------------------------------------------------------
    def cost(self, executor: "StepExecutor") -> StepCost:
        """What the forward costs on ``executor`` (positions with padding, transient memory)."""
        return executor.step_cost([(r.computed, r.past) for r in self.rows], sum(r.logits_rows for r in self.rows))

    def response_bytes(self, vocab_size: int) -> int:
        """Bytes of logits output the step's answer holds (full-logits rows dominate)."""
        total = 0
        for r in self.rows:
            if r.policy is None or r.want is Want.NONE:
                continue
            p = r.policy
            one = vocab_size * _DTYPE_BYTES.get(p.logits_dtype, 4) if p.mode == OutputMode.FULL_LOGITS \
                else 16 + 16 * p.top_logprobs
            total += one * (len(r.tokens) if r.kind is RowKind.VERIFY else
                            1 + len(r.tokens) if r.want is Want.ALL and r.kind is RowKind.PROMPT else 1)
        return total

    def too_big(self, limits: StepLimits, executor: "StepExecutor", vocab_size: int = 0,
                response_bytes: int | None = None) -> errors.FerrumError | None:
        """Why this step can never run within ``limits`` (INVALID_ARGUMENT), or None.
        ``response_bytes``: the answer's size when it is not the rows' outputs (0: the batcher's
        steps answer with tokens; the raw ``Forward`` answers with whole tensors)."""
        f = self.field
        if limits.max_rows and len(self.rows) > limits.max_rows:
            return errors.invalid(f"{f}: {len(self.rows)} sequences in one step; the limit per step is "
                                  f"{limits.max_rows}: send fewer rows", field=f, rows=len(self.rows),
                                  limit=limits.max_rows)
        cost = self.cost(executor)
        if limits.max_step_tokens and cost.positions > limits.max_step_tokens:
            return errors.invalid(
                f"{f}: this step would compute {cost.positions} token positions (rows padded to the longest); "
                f"the limit per step is {limits.max_step_tokens}: send fewer rows, rows of similar length, or "
                "split the prompt into chunks", field=f, positions=cost.positions, limit=limits.max_step_tokens)
        if limits.max_step_bytes and cost.scratch_bytes > limits.max_step_bytes:
            return errors.invalid(
                f"{f}: this step would need {cost.scratch_bytes} bytes of working memory; the limit per step "
                f"is {limits.max_step_bytes}: send fewer rows or rows of similar length", field=f,
                scratch_bytes=cost.scratch_bytes, limit=limits.max_step_bytes)
        n = self.response_bytes(vocab_size) if response_bytes is None else response_bytes
        if limits.max_response_bytes and n > limits.max_response_bytes:
            return errors.invalid(
                f"{f}: the response would hold {n} bytes of logits; the message limit is "
                f"{limits.max_response_bytes}: ask for fewer full-logits rows (or top-k log-probabilities)",
                field=f, response_bytes=n, limit=limits.max_response_bytes)
        return None

    def check(self, limits: StepLimits, executor: "StepExecutor", vocab_size: int,
              response_bytes: int | None = None) -> None:
        """INVALID_ARGUMENT when the step is over one of ``limits`` (see :meth:`too_big`)."""
        e = self.too_big(limits, executor, vocab_size, response_bytes)
        if e is not None:
            raise e

    def fits(self, limits: StepLimits, executor: "StepExecutor") -> bool:
        """Whether the forward stays within the per-step ceilings (the batcher's test)."""
        return self.too_big(limits, executor, response_bytes=0) is None

    # ---- KV ---------------------------------------------------------------------------------------
    def admission(self) -> tuple[list[tuple[CacheEntry, int]], list[StepRow]]:
        """The KV the step adds, for ``executor.admit_kv``: (live caches and the length each will
        reach, the rows that make new caches)."""
        grow = [(r.entry, r.entry.num_tokens + len(r.tokens)) for r in self.rows if r.entry is not None]
        return grow, [r for r in self.rows if r.entry is None]

    def admit(self, executor: "StepExecutor") -> None:
        """Admit the step's KV growth, all or nothing, before any work (RESOURCE_EXHAUSTED)."""
        grow, new = self.admission()
        executor.admit_kv(grow, new, self.field)


# ---- what a step returns ------------------------------------------------------------------------------
@dataclass
class RowOutput:
    """What the executor returns for one row: the cache after the step and the logits asked for
    (``[V]`` for :attr:`Want.LAST`, ``[n, V]`` for :attr:`Want.ALL`, None for :attr:`Want.NONE`);
    an encoder returns an ``embedding`` instead."""

    cache: CacheHandle
    logits: Rows | None = None
    embedding: Rows | None = None
    cached: int = 0  # leading tokens taken from the prefix cache


@dataclass
class StepResult:
    """A step's outputs, each row's output as the request's policy asked for it (None: no output
    asked), the per-position rows of all-positions prompts, and the time sampling took."""

    outputs: list[RowOutput]
    rows: list[RowResult | None]
    positions: list[list[RowResult]] = field(default_factory=list)
    sampling_ns: int = 0
    forward_s: float = 0.0


def _entry_after(reg, row: StepRow, out) -> CacheEntry | None:
    """The live cache a row's output is in: the row's own (no look-up), else the one it made."""
    if row.entry is not None and row.entry.cache_id == out.cache.cache_id:
        return None if row.entry.released else row.entry
    return reg.get(out.cache.cache_id) if out.cache.cache_id in reg else None


def _gone(reg, entry: CacheEntry, field: str) -> None:
    """NOT_FOUND for a row whose cache was released since the plan was made (the registry's own
    answer; "was replaced" when its id is live again with another entry)."""
    reg.get(entry.cache_id, field)  # NOT_FOUND naming it released
    raise errors.not_found(f"{field}: cache {entry.cache_id!r} was replaced", field=field)


def run(executor: "StepExecutor", plan: StepPlan) -> StepResult:
    """Run ``plan`` on the model's worker: structured-output masks (during the forward where that
    pays), the executor's one forward, the model's counters, then each row's output."""
    rows = plan.rows
    for k, r in enumerate(rows):  # planned on the event loop: each cache is still the one planned for
        if r.entry is not None and r.entry.released:  # the row holds its entry: no look-up while it lives
            _gone(executor.registry, r.entry, f"{plan.field}[{k}].cache_id")
    prepared = _prepare(executor, rows)
    t0 = time.perf_counter()
    try:
        outs = executor.execute(plan)
    except BaseException:
        if prepared is not None:  # let the mask thread finish with the matchers before anyone else uses them
            prepared[0].done.exception()
        raise
    dt = time.perf_counter() - t0
    try:
        return _after_forward(executor, plan, outs, prepared, dt)
    except errors.FerrumError as e:  # the forward committed: the rows' tokens are in their caches
        e.committed = True
        raise


def _after_forward(executor: "StepExecutor", plan: StepPlan, outs: list["RowOutput"], prepared, dt: float
                   ) -> StepResult:
    """A committed forward's counters, masks, refusals and each row's output."""
    reg = executor.registry
    rows = plan.rows
    _record(executor, rows, dt)
    t_s = time.perf_counter_ns()
    entries = [_entry_after(reg, r, o) for r, o in zip(rows, outs)]
    out_rows: list[Rows | None] = [o.logits if r.policy is not None else None for r, o in zip(rows, outs)]
    policies = [r.policy or LogitsPolicy(mode=OutputMode.NONE) for r in rows]
    # a prompt's all-positions logits: its last row is the output, masked and sampled as one
    last = [x[-1] if x is not None and r.kind is RowKind.PROMPT and r.want is Want.ALL else x
            for r, x in zip(rows, out_rows)]
    problems = mask_rows(executor, entries, [x if r.kind is not RowKind.VERIFY else None for r, x in zip(rows, last)],
                         policies, *(prepared or (None, 0)))
    if plan.refuse_broken:
        refuse_broken(problems, plan.field)
    result = StepResult(outs, [None] * len(rows), [[] for _ in rows], forward_s=dt)
    plain = [i for i, r in enumerate(rows) if r.policy is not None and r.policy.mode != OutputMode.NONE
             and last[i] is not None and r.kind is not RowKind.VERIFY and not r.drafts]
    sampled = process_rows([last[i] for i in plain], [policies[i] for i in plain],
                           [entries[i].tokens if entries[i] is not None else [] for i in plain],
                           [outs[i].cache.num_tokens for i in plain])
    for i, s in zip(plain, sampled):
        result.rows[i] = s
    drafted = [i for i, r in enumerate(rows) if r.drafts and r.policy is not None]
    if drafted:
        for i, s in zip(drafted, sample_verified(executor, [out_rows[i] for i in drafted],
                                                 [policies[i] for i in drafted], [entries[i] for i in drafted],
                                                 [rows[i].tokens[1:] for i in drafted])):
            result.rows[i] = s
    for i, r in enumerate(rows):
        if r.want is not Want.ALL or r.drafts or r.policy is None or out_rows[i] is None:
            continue
        n, end = len(r.tokens), outs[i].cache.num_tokens
        base = end - n
        if r.kind is RowKind.VERIFY:  # row j is drawn after token j, with the history up to it
            hist = entries[i].tokens
            result.positions[i] = process_rows(out_rows[i], [r.policy] * n, [hist[:base + j + 1] for j in range(n)],
                                               [base + j + 1 for j in range(n)])
        else:
            result.positions[i] = process_rows(out_rows[i], [r.policy] * n, None, [base + j + 1 for j in range(n)])
    result.sampling_ns = time.perf_counter_ns() - t_s
    return result


def _prepare(executor: Any, rows: list[StepRow]):
    """Masks of the decode rows computed during the forward (``guided.prepare_masks``), where
    that pays: (the prepared masks, the index of the first decode row), or None."""
    first = next((i for i, r in enumerate(rows) if r.kind is RowKind.DECODE), None)
    if first is None or not all(r.kind is RowKind.DECODE for r in rows[first:]):
        return None
    dec = rows[first:]
    if not any(r.policy is not None and r.policy.sampling.constraint is not None for r in dec):
        return None
    if not overlapping(executor):
        return None
    prepared = prepare_masks(executor, [r.entry for r in dec], [r.tokens[0] for r in dec], [r.policy for r in dec])
    return (prepared, first) if prepared is not None else None


def _record(executor: Any, rows: list[StepRow], seconds: float) -> None:
    """The model's step counters: prompts as prefill steps, decode and verify rows as decode."""
    prompts = sum(1 for r in rows if r.kind is RowKind.PROMPT)
    decoded = sum(1 if r.kind is RowKind.DECODE else len(r.tokens) for r in rows if r.kind is not RowKind.PROMPT)
    if prompts:
        executor.stats.record("prefill", seconds, prompts)
    if decoded:
        executor.stats.record("decode", seconds, decoded)


__all__ = ["RowKind", "RowOutput", "StepLimits", "StepPlan", "StepResult", "StepRow", "Want", "run"]
