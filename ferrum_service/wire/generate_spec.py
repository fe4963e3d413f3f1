"""``GenerateSpec``: one generation, checked once, as a frozen value.

Three producers build it: the contract's ``Generate`` (:meth:`RequestChecks.generate_spec
<ferrum_service.wire.validate.RequestChecks.generate_spec>`), the vLLM engine protocol's
``Generate`` (``vllm_engine.py``, with no contract message in between) and the resume of a stream
another server moved here (``migration.Parked.resume_spec``: built by this server, not checked
again). One :class:`~ferrum_service.wire.generate.Generation` runs it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..core.kv_registry import CacheEntry
from ..core.speculation import SpeculationConfig
from ..core.stop_conditions import StopStrings
from ..core.types import LogitsPolicy, PrefillInput

if TYPE_CHECKING:
    import asyncio

    from ..hosting.host import ModelHost
    from .convert import pb

#: Output tokens of a request that sets no ``stop.max_tokens``.
DEFAULT_MAX_TOKENS = 128
#: Most samples (``n``) one generation may ask for.
MAX_SAMPLES = 64


@dataclasses.dataclass(frozen=True)
class Stops:
    """When a sample ends: its token limit, stop tokens, EOS tokens and stop strings (compiled once)."""

    max_tokens: int
    token_ids: frozenset[int] = frozenset()
    eos_ids: frozenset[int] = frozenset()
    sequences: tuple[str, ...] = ()
    strings: StopStrings | None = None  # the automaton of ``sequences`` (None without any)


@dataclasses.dataclass(frozen=True)
class Resume:
    """A stream another server moved here (``migration.Parked``): what it sent before the move."""

    generated: tuple[int, ...]  # tokens sent before the move (the last one is fed first)
    prompt_tokens: int
    cache_tokens: int  # what the moved cache held when it was parked
    constraint_start: int  # where the constraint's matcher starts in the cache
    #: The step feeding the last token, run when the stream was parked (its row is sent first).
    first: "asyncio.Future | None" = None


@dataclasses.dataclass(frozen=True)
class GenerateSpec:
    """A checked generation: what to compute, on which cache, how to sample and when to stop."""

    host: "ModelHost"
    request_id: str
    prompt: tuple[int, ...]  # new tokens to compute (empty: ``last_token`` is fed into ``entry``)
    entry: CacheEntry | None  # the caller's cache it continues (None: a new one)
    policy: LogitsPolicy  # sampling with its compiled constraint, and top log-probabilities
    stops: Stops
    n: int = 1
    last_token: int | None = None
    salt: str = ""  # the prefix-cache key salt (the caller's identity folded in)
    adapter: str = ""
    bypass_prefix_cache: bool = False
    speculation: SpeculationConfig | None = None
    keep_cache: bool = False
    stream_text: bool = False
    #: Output tokens reserved up front when below ``max_tokens`` (0 = all of them; see ``generate``).
    reserve_output: int = 0
    adopt_cache: bool = False  # the stream takes ``entry`` over (a cache imported for it) and frees it
    resume: Resume | None = None  # a stream moved here (migration.py)
    #: The contract request it came from (a move sends it on to the target); None for other producers.
    request: "pb.GenerateRequest | None" = None
    prompt_field: str = "token_ids"  # the field a prompt too large for one step is blamed on
    # Derived once, when the spec is made (the cache grows once the generation runs):
    prior: int = dataclasses.field(init=False)  # tokens the continued cache holds (as parked, for a resume)
    cache_id: str = dataclasses.field(init=False)
    resumed: int = dataclasses.field(init=False)  # tokens generated before the stream moved here
    total: int = dataclasses.field(init=False)  # the longest the sequence can get
    grows: bool = dataclasses.field(init=False)  # only part of the output is reserved up front
    reserve: int = dataclasses.field(init=False)  # tokens reserved up front
    prompt_tokens: int = dataclasses.field(init=False)  # the prompt's length as GenerateStarted reports it
    prefill: PrefillInput | None = dataclasses.field(init=False)  # the prompt's step input (None without one)

    def __post_init__(self) -> None:
        entry, resume, max_tokens = self.entry, self.resume, self.stops.max_tokens
        prior = resume.cache_tokens if resume is not None else entry.num_tokens if entry is not None else 0
        resumed = len(resume.generated) if resume is not None else 0
        total = prior + len(self.prompt) + max_tokens - resumed + (1 if resumed else 0)
        grows = 0 < self.reserve_output < max_tokens - resumed
        reserve = prior + len(self.prompt) + self.reserve_output if grows else total
        cache_id = entry.cache_id if entry is not None else ""
        prefill = PrefillInput(token_ids=list(self.prompt), cache_id=cache_id, policy=self.policy,
                               reserve_tokens=reserve if entry is None else 0, request_id=self.request_id,
                               cache_salt=self.salt, bypass_prefix_cache=self.bypass_prefix_cache,
                               adapter=self.adapter) if self.prompt else None
        for name, value in (("prior", prior), ("cache_id", cache_id), ("resumed", resumed), ("total", total),
                            ("grows", grows), ("reserve", reserve), ("prefill", prefill),
                            ("prompt_tokens", resume.prompt_tokens if resume is not None else prior + len(self.prompt))):
            object.__setattr__(self, name, value)


__all__ = ["DEFAULT_MAX_TOKENS", "GenerateSpec", "MAX_SAMPLES", "Resume", "Stops"]
