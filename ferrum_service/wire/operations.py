"""The contract's step operations, shared by the unary RPCs and the ``Session`` stream.

Each operation checks its request against the model (``validate.py``), admits its KV growth,
holds the caches it touches, runs the executor on the model's worker, applies the logits policies
and builds the response. Errors are :class:`FerrumError`; the servicer turns them into gRPC
statuses (unary) or in-band ``StepError``s (Session).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..core import errors
from ..core.guided import guides_of, mask_rows, refuse_broken
from ..core.sampling import encode_row, process_rows
from ..core.types import DecodeInput, KvSlotRequest, OutputMode, PrefillInput
from ..hosting.cache_quota import MAX_SLOT_REQUESTS
from ..hosting.retries import StepDeduper
from . import tracing
from .convert import handle_pb, logits_policy, pb, row_pb, tpb
from .validate import RequestChecks, admit, admit_decodes, admit_prefills, admit_unified

if TYPE_CHECKING:
    from ..hosting.models import ModelSet


def _timings(t_start: int, timed, sampling_ns: int) -> tpb.StepTimings:
    """The step's ``StepTimings`` (and its trace spans, when tracing is on)."""
    if tracing.enabled():
        tracing.step(timed.submitted_ns, timed.queued_ns, timed.forward_ns, sampling_ns)
    return tpb.StepTimings(
        queued_ns=timed.queued_ns,
        forward_ns=timed.forward_ns,
        sampling_ns=sampling_ns,
        total_ns=time.perf_counter_ns() - t_start,
    )


class Operations:
    """Step operations over the hosted models."""

    def __init__(self, models: "ModelSet", checks: RequestChecks | None = None) -> None:
        self.models = models
        self.checks = checks or RequestChecks(models)
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
    def _prefill_outputs(self, host, inputs: list[PrefillInput], outs) -> tuple[list[pb.PrefillOutput], int]:
        t0 = time.perf_counter_ns()
        rows = [o.logits for o in outs]
        reg = host.executor.registry
        entries = [reg.get(o.cache.cache_id) if o.cache.cache_id in reg else None for o in outs]
        refuse_broken(mask_rows(host.executor, entries, rows, [i.policy for i in inputs]), "inputs")
        res = process_rows(
            rows,
            [i.policy for i in inputs],
            [e.tokens if e is not None else [] for e in entries],
            [o.cache.num_tokens for o in outs],
        )
        msgs = []
        for inp, out, r in zip(inputs, outs, res):
            m = pb.PrefillOutput(cache=handle_pb(out.cache), cached_tokens=out.cached_tokens)
            if inp.policy.mode != OutputMode.NONE and out.logits is not None:
                m.output.CopyFrom(row_pb(r))
            if inp.all_positions and out.all_logits is not None:
                n = out.all_logits.shape[0]
                base = out.cache.num_tokens - n
                for pr in process_rows(out.all_logits, [inp.policy] * n, None, [base + j + 1 for j in range(n)]):
                    m.positions.append(row_pb(pr))
            if out.embedding is not None:
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

    def _adopt(self, host, created, owner: str) -> None:
        """Record who the caches a call created belong to: the caller, and the Session stream (if
        any) that frees them when it ends. Encoders keep no cache in the registry."""
        reg = host.executor.registry
        for o in created:
            if o.cache.cache_id in reg:
                self.checks.adopt(reg.get(o.cache.cache_id), owner)

    # ---- operations -------------------------------------------------------------------------------
    async def prefill(self, req: pb.PrefillRequest, owner: str = "") -> pb.PrefillResponse:
        t = time.perf_counter_ns()
        host = self.models.get(req.model_id)
        inp = self.checks.prefill_input(host, req.input, "input")
        if not inp.cache_id:
            self.checks.check_new_prompt("Prefill")
        self.checks.check_prefill_step(host, [inp], "input")
        await self.checks.compile(host, [(inp.policy.sampling, "input.logits.sampling.constraint")])
        with self.checks.quota.claim(host, 0 if inp.cache_id else 1, "input"):
            with host.hold([inp.cache_id], "input.cache_id"):
                timed = await host.call(self._run_prefill, host, [inp], on_orphan=self._orphaned(host, [inp]))
            outs, msgs, s_ns = timed.value
            self._adopt(host, [] if inp.cache_id else outs, owner)
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
        inputs = [self.checks.prefill_input(host, m, f"inputs[{i}]") for i, m in enumerate(req.inputs)]
        ids = [i.cache_id for i in inputs]
        if not all(ids):
            self.checks.check_new_prompt("BatchPrefill")
        self.checks.unique(ids, "inputs.cache_id")
        self.checks.check_prefill_step(host, inputs, "inputs")
        await self.checks.compile(host, [(x.policy.sampling, f"inputs[{k}].logits.sampling.constraint")
                                         for k, x in enumerate(inputs)])
        admit_prefills(host, inputs)
        with self.checks.quota.claim(host, sum(1 for c in ids if not c), "inputs"):
            with host.hold(ids, "inputs.cache_id"):
                timed = await host.call(self._run_prefill, host, inputs, on_orphan=self._orphaned(host, inputs))
            outs, msgs, s_ns = timed.value
            self._adopt(host, [o for inp, o in zip(inputs, outs) if not inp.cache_id], owner)
        return pb.BatchPrefillResponse(outputs=msgs, timings=_timings(t, timed, s_ns))

    async def decode(self, req: pb.DecodeRequest, owner: str = "") -> pb.DecodeResponse:
        t = time.perf_counter_ns()
        host = self.models.get(req.model_id)
        self.checks.require_generation(host, "Decode")
        self.checks.check_decode_role("Decode")
        inp = self.checks.decode_input(host, req.input, "input")
        admit_decodes(host, [inp], "input.cache_id")
        self.checks.check_decode_step(host, [inp], "input")
        await self.checks.compile(host, [(inp.policy.sampling, "input.logits.sampling.constraint")])
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
        self.checks.require_generation(host, "BatchDecode")
        self.checks.check_decode_role("BatchDecode")
        if not req.inputs:
            raise errors.invalid("inputs is empty: at least one decode input is required", field="inputs")
        inputs = [self.checks.decode_input(host, m, f"inputs[{i}]") for i, m in enumerate(req.inputs)]
        ids = [i.cache_id for i in inputs]
        self.checks.unique(ids, "inputs.cache_id")
        self.checks.check_decode_step(host, inputs, "inputs")
        await self.checks.compile(host, [(x.policy.sampling, f"inputs[{k}].logits.sampling.constraint")
                                         for k, x in enumerate(inputs)])
        admit_decodes(host, inputs)
        with host.hold(ids, "inputs.cache_id"):
            timed = await host.call(self._run_decode, host, inputs)
        outs, rows = timed.value
        return pb.BatchDecodeResponse(
            outputs=[pb.DecodeOutput(cache=handle_pb(o.cache), output=row_pb(r)) for o, r in zip(outs, rows)],
            timings=_timings(t, timed, 0),
        )

    async def unified_decode(self, req: pb.UnifiedDecodeRequest, owner: str = "") -> pb.UnifiedDecodeResponse:
        t = time.perf_counter_ns()
        host = self.models.get(req.model_id)
        self.checks.require_generation(host, "UnifiedDecode")
        self.checks.require_unified(host)
        if not req.items:
            raise errors.invalid("items is empty", field="items")
        items = [self.checks.unified_item(host, m, f"items[{i}]") for i, m in enumerate(req.items)]
        ids = [i.cache_id for i in items]
        if not all(ids):
            self.checks.check_new_prompt("UnifiedDecode")
        reg = host.executor.registry
        # A decode item: one final token continuing a cache that is not in the middle of a chunked
        # prompt (a prompt's last chunk, and longer extensions, are prompt work).
        if any(i.cache_id and i.is_final_chunk and len(i.q_tokens) == 1 and not reg.get(i.cache_id).chunking
               for i in items):
            self.checks.check_decode_role("UnifiedDecode (a decode item)")
        self.checks.unique(ids, "items.cache_id")
        self.checks.check_step(host, [(len(i.q_tokens), i.pos_offset) for i in items], len(items), "items",
                               sum(self.checks.row_bytes(host, i.policy) for i in items))
        await self.checks.compile(host, [(x.policy.sampling, f"items[{k}].logits.sampling.constraint")
                                         for k, x in enumerate(items)])
        admit_unified(host, items)
        with self.checks.quota.claim(host, sum(1 for c in ids if not c), "items"):
            with host.hold(ids, "items.cache_id"):
                timed = await host.call(self._run_unified, host, items, on_orphan=self._orphaned(host, items))
            results, by_k, s_ns = timed.value
            for r, it in zip(results, items):
                if r.cache.cache_id in reg:
                    reg.get(r.cache.cache_id).chunking = not it.is_final_chunk
            self._adopt(host, [r for r, it in zip(results, items) if not it.cache_id], owner)
        resp = pb.UnifiedDecodeResponse()
        for k, (it, r) in enumerate(zip(items, results)):
            m = resp.results.add(seq_id=it.seq_id, cache=handle_pb(r.cache), cached_tokens=r.cached_tokens)
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
        refuse_broken(mask_rows(host.executor, [reg.get(results[k].cache.cache_id) for k in final],
                                [results[k].logits for k in final], [items[k].policy for k in final]), "items")
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
        self.checks.require_generation(host, "ForwardVerify")
        self.checks.check_decode_role("ForwardVerify")
        entry = self.checks.live_entry(host, req.cache_id, "cache_id")
        ids = self.checks.tokens(host, req.token_ids, "token_ids")
        policy = logits_policy(req.logits, host.vocab_size, "logits")
        if policy.sampling.constraint is not None:
            raise errors.invalid("logits.sampling.constraint: ForwardVerify does not take a structured-output "
                                 "constraint (verify the drafts, then decode with it)", field="logits.sampling.constraint")
        if req.accept_greedy_prefix and policy.mode != OutputMode.SAMPLED_TOKEN:
            raise errors.invalid("accept_greedy_prefix needs logits.mode OUTPUT_MODE_SAMPLED_TOKEN",
                                 field="accept_greedy_prefix")
        self.checks.check_length(host, entry.num_tokens + len(ids), "token_ids")
        self.checks.check_step(host, [(len(ids), entry.num_tokens)], len(ids), "token_ids",
                               len(ids) * self.checks.row_bytes(host, policy))
        admit(host, "token_ids", grow=[(entry, entry.num_tokens + len(ids))])
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
        entry = self.checks.live_entry(host, req.cache_id, "cache_id")
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
        if not self.checks.is_live(host, req.cache_id, "cache_id"):
            return pb.ReleaseCacheResponse(released=False)
        with host.hold([req.cache_id], "cache_id"):
            timed = await host.call(host.executor.release_cache, req.cache_id)
        released, freed, tokens = timed.value
        return pb.ReleaseCacheResponse(released=released, freed_bytes=freed, freed_tokens=tokens)

    async def fork_cache(self, req: pb.ForkCacheRequest, owner: str = "") -> pb.ForkCacheResponse:
        """A new cache sharing ``cache_id``'s first ``keep_tokens`` tokens (copy-on-write); it
        belongs to the caller (and the Session stream, if any), like a prefill's."""
        host = self.models.get(req.model_id)
        self.checks.require_generation(host, "ForkCache")
        src = self.checks.live_entry(host, req.cache_id, "cache_id")
        keep = int(req.keep_tokens) if req.HasField("keep_tokens") else src.num_tokens
        if not 1 <= keep <= src.num_tokens:
            raise errors.out_of_range(
                f"keep_tokens = {keep} must be in [1, {src.num_tokens}] (cache {req.cache_id!r} holds "
                f"{src.num_tokens} tokens)", field="keep_tokens", num_tokens=src.num_tokens)
        self.checks.check_length(host, max(keep, int(req.reserve_tokens)), "reserve_tokens")
        with self.checks.quota.claim(host, 1, "cache_id"):
            with host.hold([req.cache_id], "cache_id"):
                timed = await host.call(self._run_fork, host, req.cache_id, keep, int(req.reserve_tokens),
                                        on_orphan=lambda v: host.release_soon(v[0].cache_id, "reclaimed"))
            handle, shared = timed.value
            self.checks.adopt(host.executor.registry.get(handle.cache_id), owner)
        return pb.ForkCacheResponse(cache=handle_pb(handle), shared_blocks=shared)

    @staticmethod
    def _run_fork(host, cache_id: str, keep: int, reserve: int):
        ex = host.executor
        entry, shared = ex.fork_cache(cache_id, keep, reserve)
        guide = ex.registry.get(cache_id).guide
        if guide is not None and keep >= guide.start:  # the fork continues the constrained output
            entry.guide = guide.spawn(guide.compiled if guide.compiled is not None
                                      else guides_of(ex).compile(guide.spec, "cache_id"))
        return ex.handle(entry), shared

    async def reserve_kv_slots(self, req: pb.ReserveKvSlotsRequest, owner: str = "") -> pb.ReserveKvSlotsResponse:
        """ferrum's paged admission: grow each named cache's block reservation, all or nothing. A
        ``new_sequence`` request names a sequence the server has never seen (ferrum's engine names
        a new sequence by its own KV allocation id): the executor creates an empty cache holding
        the reservation and its id comes back as ``created_cache_id``; it belongs to the caller
        like a cache made by a unary ``Prefill`` (the idle lease applies)."""
        host = self.models.get(req.model_id)
        if len(req.requests) > MAX_SLOT_REQUESTS:
            raise errors.invalid(f"requests: {len(req.requests)} requests; one call may carry at most "
                                 f"{MAX_SLOT_REQUESTS}", field="requests", limit=MAX_SLOT_REQUESTS)
        reqs = []
        for i, r in enumerate(req.requests):
            field = f"requests[{i}].cache_id"
            if r.new_sequence:
                # A decode server's sequences come from ImportKv (with reserve_tokens): an empty
                # cache it could then fill with a whole prompt is a new prompt.
                self.checks.check_new_prompt("ReserveKvSlots(new_sequence)")
                if not r.cache_id:
                    raise errors.invalid(f"{field} is empty: a new sequence needs the caller's name for it",
                                         field=field)
                host.check_up()
            else:
                self.checks.live_entry(host, r.cache_id, field)
            reqs.append(KvSlotRequest(r.cache_id, int(r.target_len),
                                      int(r.admission_target_len) if r.HasField("admission_target_len") else None,
                                      new_sequence=r.new_sequence, salt=self.checks.salt("", field)))
        self.checks.unique([r.cache_id for r in reqs], "requests.cache_id")
        known = [r.cache_id for r in reqs if not r.new_sequence]

        def orphaned(value) -> None:
            for a in (value.allocations if value is not None else []):
                if a.created_cache_id:
                    host.release_soon(a.created_cache_id, "reclaimed")

        with self.checks.quota.claim(host, sum(1 for r in reqs if r.new_sequence), "requests"):
            with host.hold(known, "requests.cache_id"):
                res = (await host.call(host.executor.reserve_kv_slots, reqs, on_orphan=orphaned)).value
            if res is not None:
                reg = host.executor.registry
                for a in res.allocations:
                    if a.created_cache_id and a.created_cache_id in reg:
                        self.checks.adopt(reg.get(a.created_cache_id), owner)
        resp = pb.ReserveKvSlotsResponse()
        if res is not None:
            resp.reservation.CopyFrom(tpb.KvSlotReservation(
                block_size=res.block_size, total_blocks=res.total_blocks,
                free_blocks_before=res.free_blocks_before, free_blocks_after=res.free_blocks_after,
                allocations=[tpb.KvSlotAllocation(cache_id=a.cache_id, blocks_before=a.blocks_before,
                                                  blocks_after=a.blocks_after, new_blocks=a.new_blocks,
                                                  created_cache_id=a.created_cache_id)
                             for a in res.allocations]))
        return resp

    async def forward(self, req: pb.ForwardRequest) -> pb.ForwardResponse:
        """ferrum's raw ``forward``: a [batch, seq] tensor of ids in, the model's output tensor out."""
        import numpy as np
        import torch

        host = self.models.get(req.model_id)
        t = req.input
        if t.dtype not in (tpb.DATA_TYPE_INT32, tpb.DATA_TYPE_INT64) or len(t.shape) != 2:
            raise errors.invalid("input must be an INT32 or INT64 tensor of shape [batch, seq]", field="input")
        np_dtype = np.dtype(np.int32 if t.dtype == tpb.DATA_TYPE_INT32 else np.int64)
        n = int(t.shape[0]) * int(t.shape[1])
        if n == 0 or len(t.data) != n * np_dtype.itemsize:
            raise errors.invalid(f"input.data has {len(t.data)} bytes; shape {list(t.shape)} needs "
                                 f"{n * np_dtype.itemsize}", field="input.data")
        batch, seq = int(t.shape[0]), int(t.shape[1])
        self.checks.check_length(host, seq, "input.shape")
        dtype = {tpb.DATA_TYPE_FP16: "fp16", tpb.DATA_TYPE_BF16: "bf16"}.get(req.logits_dtype, "fp32")
        width = host.info.vocab_size if host.supports_generation else host.info.hidden_size
        self.checks.check_step(host, [(seq, 0)] * batch, batch * seq, "input",
                               batch * seq * width * (4 if dtype == "fp32" else 2))
        ids = np.frombuffer(t.data, dtype=np_dtype.newbyteorder("<")).reshape(batch, seq)
        bad = np.flatnonzero((ids < 0) | (ids >= host.vocab_size))
        if bad.size:
            raise errors.invalid(f"input.data[{int(bad[0])}] = {int(ids.reshape(-1)[bad[0]])} is outside the "
                                 f"vocabulary [0, {host.vocab_size})", field="input.data")
        timed = await host.call(host.executor.forward, torch.from_numpy(ids.astype(np.int64)), dtype)
        out = timed.value
        resp = pb.ForwardResponse()
        resp.output.dtype = {"fp16": tpb.DATA_TYPE_FP16, "bf16": tpb.DATA_TYPE_BF16}.get(dtype, tpb.DATA_TYPE_FP32)
        resp.output.shape.extend(list(out.shape))
        resp.output.data = encode_row(out.reshape(-1), dtype)
        resp.timings.forward_ns = timed.forward_ns
        return resp


__all__ = ["Operations"]
