"""Request checks against a hosted model, and KV admission before any work.

``convert.py`` checks what a message alone decides (ids inside the vocabulary, sampling parameters
in range). This module checks a request against the state of the model it names: the caches it
touches are live and belong to this model, positions match what a cache holds, sequences fit the
model's length limit, the model can generate at all, a batch names each cache once. It also builds
the executor-interface inputs from those checks; the step they make is a
:class:`~ferrum_service.core.steps.StepPlan`, checked once against the model's per-step ceilings
(:meth:`RequestChecks.plan`: a step over one can never run, so it is INVALID_ARGUMENT) and admitted
for KV, all or nothing, before it runs (:func:`admit`).

Caches belong to the caller that created them when calls are authenticated (``callers.py``):
another caller's cache is NOT_FOUND, exactly as an unknown one.

Every check raises a :class:`FerrumError` naming the field at fault.
"""

from __future__ import annotations

import asyncio
import dataclasses
import unicodedata
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from ferrum_client.prefix_keys import caller_salt

from ..core import errors, speculation
from ..core.callers import current_caller, current_origin
from ..core.kv_registry import CacheEntry
from ..core.modes import Role
from ..core.request_limits import limit_of
from ..core.steps import StepPlan, StepRow
from ..core.stop_conditions import MAX_STOP_TOKEN_IDS, StopStrings, check_stop_sequences
from ..core.types import DecodeInput, LogitsPolicy, OutputMode, PrefillInput, UnifiedItem
from ..hosting.cache_quota import CacheQuota
from ..hosting.constraint_compile import CompilePool, check_shape
from .convert import MAX_TOP_LOGPROBS, check_token, check_tokens, logits_policy, pb, sampling_params, tpb
from .generate_spec import DEFAULT_MAX_TOKENS, MAX_SAMPLES, GenerateSpec, Stops

#: Longest ``cache_salt`` accepted (it is hashed into every block key of the cache; declared in the contract).
MAX_CACHE_SALT_BYTES = limit_of(pb.PrefillInput, "cache_salt")

if TYPE_CHECKING:
    from ..hosting.host import ModelHost
    from ..hosting.models import ModelSet


class RequestChecks:
    """Checks of requests against the hosted models (one instance per server)."""

    def __init__(self, models: "ModelSet", role: Role = Role.BOTH, *, compiler: CompilePool | None = None,
                 quota: CacheQuota | None = None, on_adopt: "Callable[[CacheEntry], None] | None" = None) -> None:
        """``compiler``: the bounded pool structured-output constraints compile on; ``quota``: the
        per-caller cap on live caches; ``on_adopt``: told of each adopted cache (defaults: an
        unbounded pool, no cap, nobody)."""
        self.models = models
        self.role = Role.parse(role)  # the server's --role
        self.compiler = compiler if compiler is not None else CompilePool()
        self.quota = quota if quota is not None else CacheQuota()
        self.on_adopt = on_adopt  # called with each adopted entry (the server's KV event hub records whose it is)

    # ---- roles ------------------------------------------------------------------------------------
    def check_new_prompt(self, rpc: str) -> None:
        """A decode-role server computes no new prompts (they are imported: ImportKv)."""
        if self.role == Role.DECODE:
            raise errors.failed_precondition(
                f"{rpc}: this server has role decode; new prompts are computed on prefill servers and their "
                "caches imported here (ImportKv); continue a cache by its cache_id", field="role")

    def check_decode_role(self, rpc: str) -> None:
        """A prefill-role server runs no decode steps (caches are exported: ExportKv)."""
        if self.role == Role.PREFILL:
            raise errors.failed_precondition(
                f"{rpc}: this server has role prefill; decode on a decode server after handing the cache "
                "over (ImportKv with a source)", field="role")

    def check_role_generate(self, req) -> None:
        self.check_decode_role("Generate")
        if not req.cache_id:
            self.check_new_prompt("Generate")

    # ---- caches -----------------------------------------------------------------------------------
    def live_entry(self, host: "ModelHost", cache_id: str, field: str) -> CacheEntry:
        """The live cache; INVALID_ARGUMENT if empty or another model's, NOT_FOUND if unknown or
        released."""
        if not cache_id:
            raise errors.invalid(f"{field} is empty", field=field)
        host.check_up()
        reg = host.executor.registry
        if cache_id not in reg:
            self._not_another_models(host, cache_id, field)
        entry = reg.get(cache_id, field)
        if entry.tenant != current_caller.get():  # exactly the registry's answer for an unknown id
            raise errors.not_found(f"{field}: cache {cache_id!r} is unknown on model {host.model_id!r}",
                                   field=field, cache_id=cache_id, model_id=host.model_id)
        return entry

    def is_live(self, host: "ModelHost", cache_id: str, field: str) -> bool:
        """Whether ``cache_id`` is a live cache of ``host`` (releasing an unknown cache is not an
        error); INVALID_ARGUMENT if it is empty or another model's."""
        if not cache_id:
            raise errors.invalid(f"{field} is empty", field=field)
        host.check_up()
        if cache_id in host.executor.registry:
            return self.visible(host, cache_id)
        self._not_another_models(host, cache_id, field)
        return False

    @staticmethod
    def visible(host: "ModelHost", cache_id: str) -> bool:
        """Whether the current caller may see and touch this live cache."""
        try:
            return host.executor.registry.get(cache_id).tenant == current_caller.get()
        except errors.FerrumError:
            return False

    def adopt(self, entry: CacheEntry, owner: str = "") -> None:
        """Record who a new cache belongs to: the current caller, the stream that frees it, and
        where the call came from (for the idle-origin lease, ``leases.py``)."""
        host = self.models.hosts.get(entry.model_id)
        if host is not None:  # counted by the registry that holds it (held_by); it only assigns one it does not
            host.executor.registry.set_tenant(entry, current_caller.get())
        else:
            entry.tenant = current_caller.get()
        entry.origin = current_origin.get()
        if owner and not entry.owner:
            entry.owner = owner
        if self.on_adopt is not None:
            self.on_adopt(entry)

    def _not_another_models(self, host: "ModelHost", cache_id: str, field: str) -> None:
        other = self.models.owner_of(cache_id)
        if other is not None and other != host.model_id:
            raise errors.invalid(
                f"{field}: cache {cache_id!r} belongs to model {other!r}, not {host.model_id!r}",
                field=field,
                cache_id=cache_id,
                cache_model_id=other,
            )

    @staticmethod
    def unique(ids: Iterable[str], field: str) -> None:
        """INVALID_ARGUMENT when one batch names a cache twice (new caches, "", are not compared)."""
        seen: set[str] = set()
        for i, c in enumerate(ids):
            if c and c in seen:
                raise errors.invalid(f"{field}[{i}]: cache {c!r} appears twice in one batch", field=f"{field}[{i}]")
            seen.add(c)

    # ---- the model --------------------------------------------------------------------------------
    @staticmethod
    def token_limit(host: "ModelHost") -> int:
        """Most tokens one sequence may hold on this model (0 = no limit)."""
        return host.executor.registry.sequence_limit(host.info.max_sequence_length)

    def tokens(self, host: "ModelHost", ids, field: str, *, allow_empty: bool = False) -> list[int]:
        """Token ids of one sequence: the count against the model's limit first (an oversized
        request costs nothing more), then every id inside the vocabulary."""
        return check_tokens(ids, host.vocab_size, field, allow_empty=allow_empty, max_len=self.token_limit(host))

    @staticmethod
    def plan(host: "ModelHost", rows: list[StepRow], field: str, response_bytes: int | None = None,
             *, raw: bool = False) -> StepPlan:
        """The step of ``rows``, checked against the model's per-step ceilings (INVALID_ARGUMENT:
        positions computed with padding, transient memory, rows, response size; see
        ``StepPlan.too_big``). ``response_bytes``: the answer's size when it is not the rows' own
        outputs. ``raw``: the rows are a raw ``Forward``'s batch (one tensor, not the executor's
        sequences: its row limit does not apply)."""
        plan = StepPlan(rows, field)
        limits = dataclasses.replace(host.limits, max_rows=0) if raw else host.limits
        plan.check(limits, host.executor, host.vocab_size, response_bytes)
        return plan

    @staticmethod
    def check_text(host: "ModelHost", texts: list[str], field: str) -> None:
        """INVALID_ARGUMENT when texts to tokenize exceed ``host.limits.max_text_bytes`` (UTF-8)."""
        limit = host.limits.max_text_bytes
        n = sum(len(t.encode()) for t in texts)
        if limit and n > limit:
            raise errors.invalid(f"{field}: {n} bytes of text; the limit is {limit}", field=field,
                                 limit=limit, requested=n)

    @staticmethod
    def check_length(host: "ModelHost", total: int, field: str) -> None:
        """INVALID_ARGUMENT when one sequence of ``total`` tokens could never fit this model."""
        host.executor.registry.check_sequence_length(total, field, host.info.max_sequence_length)

    @staticmethod
    def require_generation(host: "ModelHost", rpc: str) -> None:
        """UNIMPLEMENTED for encoders (they embed, they do not generate)."""
        if not host.supports_generation:
            raise errors.unsupported(
                f"{rpc}: model {host.model_id!r} is an encoder ({host.info.executor}) and does not support token "
                "generation; use Prefill to get embeddings",
                field="model_id",
                model_id=host.model_id,
            )

    @staticmethod
    def require_unified(host: "ModelHost") -> None:
        """UNIMPLEMENTED with reason UNSUPPORTED_SHAPE when the executor has no native unified
        decode (ferrum's fallback signal)."""
        if not host.capabilities.supports_native_unified_decode:
            raise errors.unsupported_shape(
                f"UnifiedDecode: the {host.info.executor} executor has no native unified decode; "
                "use BatchPrefill + BatchDecode",
                model_id=host.model_id,
            )

    # ---- step inputs ------------------------------------------------------------------------------
    @staticmethod
    def policy(host: "ModelHost", msg: pb.LogitsPolicy, field: str) -> LogitsPolicy:
        """A checked logits policy; a structured-output constraint's shape is checked here (it is
        compiled later, off the event loop: :meth:`compile`)."""
        p = logits_policy(msg, host.vocab_size, field)
        RequestChecks.guide(host, p.sampling, f"{field}.sampling.constraint")
        return p

    @staticmethod
    def guide(host: "ModelHost", sp, field: str) -> None:
        """INVALID_ARGUMENT when ``sp.constraint`` (if any) is over a shape limit (size, nesting)."""
        if sp.constraint is not None:
            check_shape(sp.constraint, field)

    async def compile(self, host: "ModelHost", items) -> None:
        """Compile the constraints of one request's ``(sampling, field)`` pairs into
        ``sampling.compiled``, on the bounded compile pool (``constraint_compile.py``); call it
        after the request's other checks (a batch's inputs are all checked and counted first)."""
        await self.compiler.compile_all(host, items)
    @staticmethod
    def salt(salt: str, field: str, *, shared: bool = True) -> str:
        """The salt a request's prefix-cache keys use: at most :data:`MAX_CACHE_SALT_BYTES` bytes and
        no control characters (INVALID_ARGUMENT: a NUL would make the key recipe's root ambiguous),
        with the caller's identity folded in under per-caller auth (``caller_salt``: each caller
        has its own key space unless the salt opts into a shared one, and ``shared=False`` refuses
        that opt-in silently: the space stays the caller's own)."""
        if len(salt) > MAX_CACHE_SALT_BYTES or len(salt.encode()) > MAX_CACHE_SALT_BYTES:
            raise errors.invalid(f"{field} is longer than {MAX_CACHE_SALT_BYTES} bytes", field=field,
                                 limit=MAX_CACHE_SALT_BYTES)
        bad = next((i for i, ch in enumerate(salt) if unicodedata.category(ch) == "Cc"), None)
        if bad is not None:
            raise errors.invalid(f"{field} holds a control character (U+{ord(salt[bad]):04X} at {bad}); "
                                 "a salt is printable text", field=field)
        return caller_salt(current_caller.get(), salt, shared_allowed=shared)

    @staticmethod
    def adapter(host: "ModelHost", name: str, field: str, entry: CacheEntry | None = None) -> str:
        """A LoRA adapter name: UNIMPLEMENTED when the model serves none, NOT_FOUND when it is not
        loaded, FAILED_PRECONDITION when ``entry`` (a cache the step continues) is bound to another."""
        if not name:
            return ""
        ads = host.executor.adapters
        if ads is None:
            raise errors.unsupported(f"{field}: model {host.model_id!r} serves no LoRA adapters", field=field)
        ads.get(name, field)
        if entry is not None:
            entry.check_adapter(name, field)
        return name

    def prompt_row(self, host: "ModelHost", msg: pb.PrefillInput, field: str) -> StepRow:
        """A checked prompt as a step row: ids, the cache it extends (if any), the length it may reach."""
        ids = self.tokens(host, msg.token_ids, f"{field}.token_ids")
        policy = self.policy(host, msg.logits, f"{field}.logits")
        entry = self.live_entry(host, msg.cache_id, f"{field}.cache_id") if msg.cache_id else None
        prior = entry.num_tokens if entry else 0
        total = max(prior + len(ids), msg.reserve_tokens)
        self.check_length(host, total, f"{field}.reserve_tokens" if msg.reserve_tokens > prior + len(ids)
                          else f"{field}.token_ids")
        return StepRow.prompt(PrefillInput(
            token_ids=ids,
            cache_id=msg.cache_id,
            policy=policy,
            reserve_tokens=int(msg.reserve_tokens),
            all_positions=msg.all_positions,
            cache_salt=self.salt(msg.cache_salt, f"{field}.cache_salt"),
            bypass_prefix_cache=msg.bypass_prefix_cache,
            adapter=self.adapter(host, msg.adapter, f"{field}.adapter", entry),
        ), entry)

    def decode_row(self, host: "ModelHost", msg: pb.DecodeInput, field: str) -> StepRow:
        """A checked decode step as a step row: a live cache, a token, the position it must be at."""
        entry = self.live_entry(host, msg.cache_id, f"{field}.cache_id")
        check_token(msg.token_id, host.vocab_size, f"{field}.token_id")
        policy = self.policy(host, msg.logits, f"{field}.logits")
        self.check_length(host, entry.num_tokens + 1, f"{field}.cache_id")
        return StepRow.decode(DecodeInput(cache_id=msg.cache_id, token_id=msg.token_id, policy=policy,
                                          position=msg.position if msg.HasField("position") else None),
                              entry, field)

    def unified_row(self, host: "ModelHost", m: pb.UnifiedBatchItem, field: str) -> StepRow:
        """A checked unified-batch item (a prompt chunk or a decode step of one sequence) as a step row."""
        q = self.tokens(host, m.q_tokens, f"{field}.q_tokens")
        entry = self.live_entry(host, m.cache_id, f"{field}.cache_id") if m.cache_id else None
        self.check_length(host, (entry.num_tokens if entry else 0) + len(q), f"{field}.q_tokens")
        return StepRow.unified(UnifiedItem(
            seq_id=m.seq_id, q_tokens=q, cache_id=m.cache_id, pos_offset=int(m.pos_offset),
            is_final_chunk=m.is_final_chunk, policy=self.policy(host, m.logits, f"{field}.logits"),
            cache_salt=self.salt(m.cache_salt, f"{field}.cache_salt"), bypass_prefix_cache=m.bypass_prefix_cache,
            adapter=self.adapter(host, m.adapter, f"{field}.adapter", entry)), entry, field)


    # ---- Generate ---------------------------------------------------------------------------------
    async def generate_spec(self, host: "ModelHost", req: pb.GenerateRequest, *, reserve_output: int = 0,
                            adopt_cache: bool = False) -> GenerateSpec:
        """The contract's ``GenerateRequest`` checked into a :class:`GenerateSpec` (``reserve_output``
        and ``adopt_cache``: see ``generate.generate``)."""
        self.require_generation(host, "Generate")
        if req.migration_mode not in pb.MigrationMode.values():
            raise errors.invalid(f"migration_mode = {req.migration_mode} is not a known MigrationMode",
                                 field="migration_mode")
        policy = self.sampling_policy(host, req.sampling, int(req.top_logprobs), "sampling")
        n = self.samples(host, int(req.n), req.cache_id)
        salt = self.salt(req.cache_salt, "cache_salt")
        draft = self.speculation(host, policy, speculation.request_config(req, host.speculation_default))
        stop = req.stop
        stops = Stops(max_tokens=int(stop.max_tokens) or DEFAULT_MAX_TOKENS,
                      token_ids=frozenset(check_tokens(stop.stop_token_ids, host.vocab_size, "stop.stop_token_ids",
                                                       allow_empty=True, max_len=MAX_STOP_TOKEN_IDS)),
                      eos_ids=self.eos_ids(host, stop.ignore_eos), sequences=tuple(stop.stop_sequences),
                      strings=self.stop_strings(host, stop.stop_sequences, "stop.stop_sequences"))
        prompt = await self.prompt(host, req)
        entry = self.live_entry(host, req.cache_id, "cache_id") if req.cache_id else None
        adapter = self.adapter(host, req.adapter, "adapter", entry)
        if entry is not None and not prompt and not req.HasField("last_token_id"):
            raise errors.invalid("cache_id without a prompt needs last_token_id", field="last_token_id")
        last = check_token(req.last_token_id, host.vocab_size, "last_token_id") if req.HasField("last_token_id") \
            else None
        spec = GenerateSpec(host, req.request_id, tuple(prompt), entry, policy, stops, n=n, last_token=last, salt=salt,
                            adapter=adapter, bypass_prefix_cache=req.bypass_prefix_cache, speculation=draft,
                            keep_cache=req.keep_cache, stream_text=req.stream_text, reserve_output=reserve_output,
                            adopt_cache=adopt_cache, request=req,
                            prompt_field="token_ids" if req.token_ids.token_ids else "prompt")
        await self.ready(spec)
        return spec

    async def ready(self, spec: GenerateSpec) -> None:
        """The checks of a generation that need all of it: its length against the model, its
        prompt's step against the per-step ceilings, then its constraint compiled (last)."""
        host = spec.host
        self.check_length(host, spec.total, "stop.max_tokens")
        if spec.prompt:
            self.plan(host, [StepRow.prompt(spec.prefill, spec.entry)], spec.prompt_field)
        await self.compile(host, [(spec.policy.sampling, "sampling.constraint")])

    @staticmethod
    def sampling_policy(host: "ModelHost", msg: tpb.SamplingParams, top_logprobs: int, field: str) -> LogitsPolicy:
        """A generation's sampling (its constraint's shape checked) and top log-probabilities."""
        sp = sampling_params(msg, host.vocab_size, field)
        RequestChecks.guide(host, sp, f"{field}.constraint")
        if top_logprobs > MAX_TOP_LOGPROBS:
            raise errors.invalid(f"top_logprobs = {top_logprobs} exceeds the maximum {MAX_TOP_LOGPROBS}",
                                 field="top_logprobs")
        return LogitsPolicy(mode=OutputMode.SAMPLED_TOKEN, sampling=sp, top_logprobs=top_logprobs)

    @staticmethod
    def samples(host: "ModelHost", n: int, cache_id: str) -> int:
        """How many samples a generation draws (``n``; 0 means 1)."""
        count = max(1, n)
        if count > MAX_SAMPLES:
            raise errors.invalid(f"n = {n} exceeds the maximum {MAX_SAMPLES}", field="n")
        if count > 1 and cache_id:
            raise errors.invalid("n > 1 needs a new prompt, not a cache_id", field="n")
        if count > 1 and not host.capabilities.supports_fork:
            raise errors.unsupported(f"n > 1: model {host.model_id!r} cannot fork caches (ForkCache)")
        return count

    @staticmethod
    def speculation(host: "ModelHost", policy: LogitsPolicy, cfg: "speculation.SpeculationConfig | None"
                    ) -> "speculation.SpeculationConfig | None":
        """The speculation a stream runs: ``cfg`` where the policy and executor allow it, else
        None (the stream decodes plainly, as the contract documents)."""
        return cfg if cfg is not None and speculation.usable(policy, host.executor) else None

    @staticmethod
    def eos_ids(host: "ModelHost", ignore_eos: bool) -> frozenset[int]:
        return frozenset() if ignore_eos else frozenset(host.info.eos_token_ids)

    @staticmethod
    def stop_strings(host: "ModelHost", sequences: Sequence[str], field: str) -> StopStrings | None:
        """The stop strings' automaton (None without any); they need the model's tokenizer."""
        check_stop_sequences(sequences, field)
        if not sequences:
            return None
        if host.executor.tokenizer is None:
            raise errors.failed_precondition("stop.stop_sequences needs a tokenizer", field="stop.stop_sequences")
        return StopStrings(sequences)

    async def prompt(self, host: "ModelHost", req: pb.GenerateRequest) -> list[int]:
        """The prompt's token ids: given, or the text / chat tokenized off the event loop."""
        which = req.WhichOneof("prompt")
        if which == "token_ids":
            return self.tokens(host, req.token_ids.token_ids, "token_ids.token_ids", allow_empty=bool(req.cache_id))
        tok = host.executor.tokenizer
        if which in ("text", "chat") and tok is None:
            raise errors.failed_precondition(
                f"{which}: model {host.model_id!r} has no tokenizer; send token_ids", field=which
            )
        if which == "text":
            self.check_text(host, [req.text], "text")
            ids = list(await asyncio.to_thread(tok.encode, req.text, add_special_tokens=True))
            if not ids:
                raise errors.invalid("text tokenizes to no tokens", field="text")
            return self.tokens(host, ids, "text")
        if which == "chat":
            if not req.chat.messages:
                raise errors.invalid("chat.messages is empty", field="chat.messages")
            msgs = [{"role": m.role, "content": m.content} for m in req.chat.messages]
            self.check_text(host, [m["content"] for m in msgs] + [m["role"] for m in msgs], "chat.messages")

            def encode_chat() -> list[int]:
                text = host.executor.apply_chat_template(msgs, add_generation_prompt=True)
                return list(tok.encode(text, add_special_tokens=False))

            return self.tokens(host, await asyncio.to_thread(encode_chat), "chat.messages")
        if not req.cache_id:
            raise errors.invalid("prompt is not set: send token_ids, text or chat (or a cache_id)", field="prompt")
        return []


# ---- KV admission ---------------------------------------------------------------------------------
def admit(host: "ModelHost", plan: StepPlan | None = None, *, field: str = "",
          grow: Iterable[tuple[CacheEntry, int]] = ()) -> None:
    """Admit a step's KV growth, all or nothing, before any work: ``plan``'s rows, or ``grow``
    (live caches and the length each will reach: a ``Generate`` on a caller's cache reserves its
    whole output). RESOURCE_EXHAUSTED (with RetryInfo) when the executor's KV budget, or the
    active-cache limit, does not allow all of it now."""
    try:
        if plan is not None:
            plan.admit(host.executor)
        else:
            host.executor.admit_kv(list(grow), [], field)
    except errors.FerrumError as e:
        host.hint_retry(e)
        raise


__all__ = ["RequestChecks", "admit"]
