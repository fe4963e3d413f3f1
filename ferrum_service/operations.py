"""The contract's step operations, shared by the unary RPCs and the ``Session`` stream.

Each operation validates its request against the model (vocabulary, caches, positions,
lengths), holds the caches it touches, runs the executor on the model's worker, applies the
logits policies and builds the response. Errors are :class:`FerrumError`; the servicer turns them
into gRPC statuses (unary) or in-band ``StepError``s (Session).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from . import errors
from .convert import check_token, check_tokens, handle_pb, logits_policy, pb, row_pb, struct_to_dict, tpb
from .retries import StepDeduper
from .sampling import process_rows
from .types import DecodeInput, OutputMode, PrefillInput, UnifiedItem

if TYPE_CHECKING:
    from .host import ModelHost
    from .models import ModelSet


def _timings(t_start: int, timed, sampling_ns: int) -> tpb.StepTimings:
    return tpb.StepTimings(
        queued_ns=timed.queued_ns,
        forward_ns=timed.forward_ns,
        sampling_ns=sampling_ns,
        total_ns=time.perf_counter_ns() - t_start,
    )


def _require_generation(host: "ModelHost", rpc: str) -> None:
    if not host.supports_generation:
        raise errors.unsupported(
            f"{rpc}: model {host.model_id!r} is an encoder ({host.info.executor}) and does not support token "
            "generation; use Prefill to get embeddings",
            field="model_id",
            model_id=host.model_id,
        )


class Operations:
    """Step operations over the hosted models."""

    def __init__(self, models: "ModelSet") -> None:
        self.models = models
        self.deduper = StepDeduper()

    async def run_step(self, name: str, req, owner: str = ""):
        """Run step ``name`` ("prefill", "decode", ...) once per ``client_step_id``."""
        fn = getattr(self, name)
        step_id = getattr(req, "client_step_id", "")
        if not step_id:
            return await fn(req, owner)
        model_id = self.models.get(req.model_id).model_id
        return await self.deduper.run(model_id, step_id, req, lambda: fn(req, owner))

    # ---- helpers ----------------------------------------------------------------------------------
    def _entry(self, host: "ModelHost", cache_id: str, field: str):
        """The live cache, NOT_FOUND if unknown/released, INVALID_ARGUMENT if another model's."""
        if not cache_id:
            raise errors.invalid(f"{field} is empty", field=field)
        if cache_id not in host.executor.registry:
            other = self.models.owner_of(cache_id)
            if other is not None and other != host.model_id:
                raise errors.invalid(
                    f"{field}: cache {cache_id!r} belongs to model {other!r}, not {host.model_id!r}",
                    field=field,
                    cache_id=cache_id,
                    cache_model_id=other,
                )
        return host.executor.registry.get(cache_id, field)

    def _check_length(self, host: "ModelHost", total: int, field: str) -> None:
        host.executor.registry.check_sequence_length(total, field, host.info.max_sequence_length)

    def _prefill_input(self, host: "ModelHost", msg: pb.PrefillInput, field: str, owner: str) -> PrefillInput:
        ids = check_tokens(msg.token_ids, host.vocab_size, f"{field}.token_ids")
        policy = logits_policy(msg.logits, host.vocab_size, f"{field}.logits")
        prior = 0
        if msg.cache_id:
            prior = self._entry(host, msg.cache_id, f"{field}.cache_id").num_tokens
        total = max(prior + len(ids), msg.reserve_tokens)
        self._check_length(host, total, f"{field}.reserve_tokens" if msg.reserve_tokens > prior + len(ids) else f"{field}.token_ids")
        return PrefillInput(
            token_ids=ids,
            cache_id=msg.cache_id,
            policy=policy,
            reserve_tokens=int(msg.reserve_tokens),
            all_positions=msg.all_positions,
            metadata=struct_to_dict(msg.metadata) | ({"ferrum_owner": owner} if owner else {}),
            request_id=msg.request_id,
        )

    def _decode_input(self, host: "ModelHost", msg: pb.DecodeInput, field: str, *, admit: bool = True) -> DecodeInput:
        """Check one decode input; ``admit`` also checks its one token of growth against the free KV
        budget (batches pass ``admit=False`` and admit their total, see :meth:`_admit_decodes`)."""
        entry = self._entry(host, msg.cache_id, f"{field}.cache_id")
        check_token(msg.token_id, host.vocab_size, f"{field}.token_id")
        policy = logits_policy(msg.logits, host.vocab_size, f"{field}.logits")
        if msg.HasField("position") and msg.position != entry.num_tokens:
            raise errors.failed_precondition(
                f"{field}.position = {msg.position} but cache {msg.cache_id!r} holds {entry.num_tokens} tokens",
                field=f"{field}.position",
                num_tokens=entry.num_tokens,
            )
        self._check_length(host, entry.num_tokens + 1, f"{field}.cache_id")
        if admit:
            host.executor.registry.admit(host.executor.registry.growth(entry, entry.num_tokens + 1), f"{field}.cache_id")
        return DecodeInput(cache_id=msg.cache_id, token_id=msg.token_id, policy=policy,
                           position=entry.num_tokens, metadata=struct_to_dict(msg.metadata))

    @staticmethod
    def _unique(ids: list[str], field: str) -> None:
        seen: set[str] = set()
        for i, c in enumerate(ids):
            if c and c in seen:
                raise errors.invalid(f"{field}[{i}]: cache {c!r} appears twice in one batch", field=f"{field}[{i}]")
            seen.add(c)

    def _prefill_outputs(self, host, inputs: list[PrefillInput], outs) -> tuple[list[pb.PrefillOutput], int]:
        t0 = time.perf_counter_ns()
        rows = [o.logits for o in outs]
        res = process_rows(
            rows,
            [i.policy for i in inputs],
            [host.executor.registry.get(o.cache.cache_id).tokens if o.cache.cache_id in host.executor.registry else []
             for o in outs],
            [o.cache.num_tokens for o in outs],
        )
        msgs = []
        for inp, out, r in zip(inputs, outs, res):
            m = pb.PrefillOutput(cache=handle_pb(out.cache))
            if inp.policy.mode != OutputMode.NONE and out.logits is not None:
                m.output.CopyFrom(row_pb(r))
            if inp.all_positions and out.all_logits is not None:
                n = out.all_logits.shape[0]
                base = out.cache.num_tokens - n
                for pr in process_rows(out.all_logits, [inp.policy] * n, None, [base + j + 1 for j in range(n)]):
                    m.positions.append(row_pb(pr))
            if out.embedding is not None:
                from .sampling import encode_row

                m.embedding.dtype = tpb.DATA_TYPE_FP32
                m.embedding.shape.append(int(out.embedding.shape[-1]))
                m.embedding.data = encode_row(out.embedding, "fp32")
            msgs.append(m)
        return msgs, time.perf_counter_ns() - t0

    @staticmethod
    def _orphaned(host, inputs):
        """Frees the caches a step created for ``inputs`` (those without a ``cache_id``) when its
        caller is gone before it could hand them out."""
        def free(value) -> None:
            outs = value[0]
            for inp, o in zip(inputs, outs):
                if not inp.cache_id:
                    host.release_soon(o.cache.cache_id, "reclaimed")
        return free

    def _adopt(self, host, outs, owner: str) -> None:
        """Record the owner (Session / Generate stream) of caches a call created."""
        if not owner:
            return
        for o in outs:
            e = host.executor.registry._caches.get(o.cache.cache_id)
            if e is not None and not e.owner:
                e.owner = owner

    # ---- operations -------------------------------------------------------------------------------
    async def prefill(self, req: pb.PrefillRequest, owner: str = "") -> pb.PrefillResponse:
        t = time.perf_counter_ns()
        host = self.models.get(req.model_id)
        inp = self._prefill_input(host, req.input, "input", owner)
        with host.hold([inp.cache_id], "input.cache_id"):
            timed = await host.call(self._run_prefill, host, [inp], on_orphan=self._orphaned(host, [inp]))
        outs, msgs, s_ns = timed.value
        self._adopt(host, outs, owner if not inp.cache_id else "")
        return pb.PrefillResponse(output=msgs[0], timings=_timings(t, timed, s_ns))

    def _run_prefill(self, host, inputs: list[PrefillInput]):
        """The prefill and its outputs' logits processing, on the worker (all torch work of a step
        stays on the model's thread)."""
        t0 = time.perf_counter()
        outs = host.executor.batch_prefill(inputs) if len(inputs) > 1 else [host.executor.prefill(inputs[0])]
        host.executor.stats.record("prefill", time.perf_counter() - t0, len(inputs))
        msgs, s_ns = self._prefill_outputs(host, inputs, outs)
        return outs, msgs, s_ns

    async def batch_prefill(self, req: pb.BatchPrefillRequest, owner: str = "") -> pb.BatchPrefillResponse:
        t = time.perf_counter_ns()
        host = self.models.get(req.model_id)
        if not req.inputs:
            raise errors.invalid("inputs is empty: at least one prompt is required", field="inputs")
        inputs = [self._prefill_input(host, m, f"inputs[{i}]", owner) for i, m in enumerate(req.inputs)]
        ids = [i.cache_id for i in inputs]
        self._unique(ids, "inputs.cache_id")
        self._admit_new(host, inputs)
        with host.hold(ids, "inputs.cache_id"):
            timed = await host.call(self._run_prefill, host, inputs, on_orphan=self._orphaned(host, inputs))
        outs, msgs, s_ns = timed.value
        for inp, o in zip(inputs, outs):
            if not inp.cache_id:
                self._adopt(host, [o], owner)
        return pb.BatchPrefillResponse(outputs=msgs, timings=_timings(t, timed, s_ns))

    @staticmethod
    def _admit_new(host, inputs: list[PrefillInput]) -> None:
        """All-or-nothing admission for a batch of prompts, before any work."""
        reg = host.executor.registry
        need = 0
        new = 0
        for i in inputs:
            if i.cache_id:
                need += reg.growth(reg.get(i.cache_id), reg.get(i.cache_id).num_tokens + len(i.token_ids))
            else:
                new += 1
                need += max(len(i.token_ids), i.reserve_tokens)
        reg.admit(need, "inputs", new_caches=new)

    async def decode(self, req: pb.DecodeRequest, owner: str = "") -> pb.DecodeResponse:
        t = time.perf_counter_ns()
        host = self.models.get(req.model_id)
        _require_generation(host, "Decode")
        inp = self._decode_input(host, req.input, "input")
        with host.hold([inp.cache_id], "input.cache_id"):
            timed = await host.call(self._run_decode, host, [inp])
        outs, rows = timed.value
        return pb.DecodeResponse(
            output=pb.DecodeOutput(cache=handle_pb(outs[0].cache), output=row_pb(rows[0])),
            timings=_timings(t, timed, 0),
        )

    @staticmethod
    def _run_decode(host, inputs: list[DecodeInput]):
        return host.decode_and_sample(inputs)

    async def batch_decode(self, req: pb.BatchDecodeRequest, owner: str = "") -> pb.BatchDecodeResponse:
        t = time.perf_counter_ns()
        host = self.models.get(req.model_id)
        _require_generation(host, "BatchDecode")
        if not req.inputs:
            raise errors.invalid("inputs is empty: at least one decode input is required", field="inputs")
        inputs = [self._decode_input(host, m, f"inputs[{i}]", admit=False) for i, m in enumerate(req.inputs)]
        ids = [i.cache_id for i in inputs]
        self._unique(ids, "inputs.cache_id")
        self._admit_decodes(host, inputs)
        with host.hold(ids, "inputs.cache_id"):
            timed = await host.call(self._run_decode, host, inputs)
        outs, rows = timed.value
        return pb.BatchDecodeResponse(
            outputs=[pb.DecodeOutput(cache=handle_pb(o.cache), output=row_pb(r)) for o, r in zip(outs, rows)],
            timings=_timings(t, timed, 0),
        )

    @staticmethod
    def _admit_decodes(host, inputs: list[DecodeInput]) -> None:
        """All-or-nothing admission for a batch of decode steps (one token each), before any work."""
        reg = host.executor.registry
        need = 0
        for i in inputs:
            e = reg.get(i.cache_id)
            need += reg.growth(e, e.num_tokens + 1)
        reg.admit(need, "inputs")

    async def unified_decode(self, req: pb.UnifiedDecodeRequest, owner: str = "") -> pb.UnifiedDecodeResponse:
        t = time.perf_counter_ns()
        host = self.models.get(req.model_id)
        _require_generation(host, "UnifiedDecode")
        if not host.executor.capabilities().supports_native_unified_decode:
            raise errors.unsupported(
                f"UnifiedDecode: the {host.info.executor} executor has no native unified decode; "
                "use BatchPrefill + BatchDecode",
                model_id=host.model_id,
            )
        if not req.items:
            raise errors.invalid("items is empty", field="items")
        items = []
        for i, m in enumerate(req.items):
            f = f"items[{i}]"
            q = check_tokens(m.q_tokens, host.vocab_size, f"{f}.q_tokens")
            if m.cache_id:
                n = self._entry(host, m.cache_id, f"{f}.cache_id").num_tokens
            else:
                n = 0
            if m.pos_offset != n:
                raise errors.failed_precondition(
                    f"{f}.pos_offset = {m.pos_offset} but the cache holds {n} tokens", field=f"{f}.pos_offset",
                    num_tokens=n,
                )
            self._check_length(host, n + len(q), f"{f}.q_tokens")
            items.append(UnifiedItem(
                seq_id=m.seq_id, q_tokens=q, cache_id=m.cache_id, pos_offset=int(m.pos_offset),
                is_final_chunk=m.is_final_chunk, policy=logits_policy(m.logits, host.vocab_size, f"{f}.logits"),
                metadata=struct_to_dict(m.metadata),
            ))
        ids = [i.cache_id for i in items]
        self._unique(ids, "items.cache_id")
        reg = host.executor.registry
        need = sum(len(i.q_tokens) if not i.cache_id else reg.growth(reg.get(i.cache_id), i.pos_offset + len(i.q_tokens))
                   for i in items)
        reg.admit(need, "items", new_caches=sum(1 for i in items if not i.cache_id))
        with host.hold(ids, "items.cache_id"):
            timed = await host.call(self._run_unified, host, items, on_orphan=self._orphaned(host, items))
        results, by_k, s_ns = timed.value
        self._adopt(host, [r for r, it in zip(results, items) if not it.cache_id], owner)
        resp = pb.UnifiedDecodeResponse()
        for k, (it, r) in enumerate(zip(items, results)):
            m = resp.results.add(seq_id=it.seq_id, cache=handle_pb(r.cache))
            if k in by_k:
                m.output.CopyFrom(row_pb(by_k[k]))
        resp.timings.CopyFrom(_timings(t, timed, s_ns))
        return resp

    @staticmethod
    def _run_unified(host, items):
        """The unified forward and the final items' sampling, on the worker."""
        t0 = time.perf_counter()
        results = host.executor.unified_decode(items)
        host.executor.stats.record("decode", time.perf_counter() - t0, len(items))
        t_s = time.perf_counter_ns()
        reg = host.executor.registry
        final = [k for k, it in enumerate(items) if it.is_final_chunk and results[k].logits is not None]
        rows = process_rows(
            [results[k].logits for k in final],
            [items[k].policy for k in final],
            [reg.get(results[k].cache.cache_id).tokens for k in final],
            [results[k].cache.num_tokens for k in final],
        )
        return results, dict(zip(final, rows)), time.perf_counter_ns() - t_s

    async def forward_verify(self, req: pb.ForwardVerifyRequest, owner: str = "") -> pb.ForwardVerifyResponse:
        t = time.perf_counter_ns()
        host = self.models.get(req.model_id)
        _require_generation(host, "ForwardVerify")
        entry = self._entry(host, req.cache_id, "cache_id")
        ids = check_tokens(req.token_ids, host.vocab_size, "token_ids")
        policy = logits_policy(req.logits, host.vocab_size, "logits")
        if req.accept_greedy_prefix and policy.mode != OutputMode.SAMPLED_TOKEN:
            raise errors.invalid("accept_greedy_prefix needs logits.mode OUTPUT_MODE_SAMPLED_TOKEN",
                                 field="accept_greedy_prefix")
        self._check_length(host, entry.num_tokens + len(ids), "token_ids")
        reg = host.executor.registry
        reg.admit(reg.growth(entry, entry.num_tokens + len(ids)), "token_ids")
        with host.hold([req.cache_id], "cache_id"):
            timed = await host.call(self._run_verify, host, req.cache_id, ids, policy, req.accept_greedy_prefix)
        out, rows, accepted, cache = timed.value
        resp = pb.ForwardVerifyResponse(
            outputs=[row_pb(r) for r in rows], cache=handle_pb(cache), base_len=out.base_len,
            timings=_timings(t, timed, 0),
        )
        if req.accept_greedy_prefix:
            resp.accepted_drafts = accepted
            resp.accepted_tokens.extend([r.token_id for r in rows[: accepted + 1]])
        return resp

    @staticmethod
    def _run_verify(host, cache_id, ids, policy, accept: bool):
        t0 = time.perf_counter()
        ex = host.executor
        out = ex.forward_verify(cache_id, ids, policy)
        ex.stats.record("decode", time.perf_counter() - t0, len(ids))
        entry = ex.registry.get(cache_id)
        base = out.base_len
        hist = entry.tokens
        rows = process_rows(out.rows, [policy] * len(ids), [hist[: base + j + 1] for j in range(len(ids))],
                            [base + j + 1 for j in range(len(ids))])
        accepted = 0
        cache = out.cache
        if accept:
            while accepted < len(ids) - 1 and rows[accepted].token_id == ids[accepted + 1]:
                accepted += 1
            keep = base + accepted + 1
            if keep < entry.num_tokens:
                cache, _ = ex.truncate_kv(cache_id, keep)
        return out, rows, accepted, cache

    async def truncate_kv(self, req: pb.TruncateKvRequest, owner: str = "") -> pb.TruncateKvResponse:
        host = self.models.get(req.model_id)
        entry = self._entry(host, req.cache_id, "cache_id")
        if req.new_len < 0 or req.new_len > entry.num_tokens:
            raise errors.out_of_range(
                f"new_len = {req.new_len} must be in [0, {entry.num_tokens}] (cache {req.cache_id!r} holds "
                f"{entry.num_tokens} tokens)",
                field="new_len",
                num_tokens=entry.num_tokens,
            )
        with host.hold([req.cache_id], "cache_id"):
            timed = await host.call(host.executor.truncate_kv, req.cache_id, int(req.new_len))
        handle, removed = timed.value
        return pb.TruncateKvResponse(cache=handle_pb(handle), removed_tokens=removed)

    async def release_cache(self, req: pb.ReleaseCacheRequest, owner: str = "") -> pb.ReleaseCacheResponse:
        host = self.models.get(req.model_id)
        if not req.cache_id:
            raise errors.invalid("cache_id is empty", field="cache_id")
        if req.cache_id not in host.executor.registry:
            other = self.models.owner_of(req.cache_id)
            if other is not None and other != host.model_id:
                raise errors.invalid(
                    f"cache_id: cache {req.cache_id!r} belongs to model {other!r}, not {host.model_id!r}",
                    field="cache_id",
                )
            return pb.ReleaseCacheResponse(released=False)
        with host.hold([req.cache_id], "cache_id"):
            timed = await host.call(host.executor.release_cache, req.cache_id)
        released, freed, tokens = timed.value
        return pb.ReleaseCacheResponse(released=released, freed_bytes=freed, freed_tokens=tokens)


__all__ = ["Operations"]
