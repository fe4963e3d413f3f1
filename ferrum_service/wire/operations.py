"""The contract's step operations, shared by the unary RPCs and the ``Session`` stream.

Each operation checks its request against the model (``validate.py``), admits its KV growth,
holds the caches it touches, runs the executor on the model's worker, applies the logits policies
and builds the response. Errors are :class:`FerrumError`; the servicer turns them into gRPC
statuses (unary) or in-band ``StepError``s (Session).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..core import errors, progress
from ..core.guided import guides_of
from ..core.sampling import encode_row
from ..core.steps import RowKind, StepPlan, StepResult, StepRow, Want, run
from ..core.types import KvSlotRequest, OutputMode
from ..hosting.cache_quota import MAX_SLOT_REQUESTS
from ..hosting.retries import StepDeduper
from . import tracing
from .convert import handle_pb, logits_policy, pb, row_pb, tpb
from .validate import RequestChecks, admit

if TYPE_CHECKING:
    from ..hosting.models import ModelSet


#: The operations that run a forward: a failure carries the StepProgress detail.
_FORWARD_STEPS = frozenset({"prefill", "decode", "batch_prefill", "batch_decode", "unified_decode", "forward_verify"})


def _n_items(req) -> int:
    """How many items a step request names (``inputs`` / ``items``; one for a single-input step)."""
    for name in ("inputs", "items"):
        if name in type(req).DESCRIPTOR.fields_by_name:
            return len(getattr(req, name))
    return 1


def _timings(t_start: int, timed, sampling_ns: int) -> tpb.StepTimings:
    """The step's ``StepTimings`` (and its trace spans, when tracing is on)."""
    if tracing.on:
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
        try:
            if not step_id:
                return await fn(req, owner)
            model_id = self.models.get(req.model_id).model_id
            return await self.deduper.run(model_id, step_id, req, lambda: fn(req, owner))
        except errors.FerrumError as e:  # refused before its rows were planned: nothing ran
            if name in _FORWARD_STEPS:
                progress.mark_rolled_back(e, _n_items(req))
            raise

    # ---- helpers ----------------------------------------------------------------------------------
    @staticmethod
    def _prompt_msgs(rows: list[StepRow], res: StepResult) -> list[pb.PrefillOutput]:
        """Each prompt row's ``PrefillOutput``: its cache, its output row (when a logits policy
        asked for one), every position's row (``all_positions``), an encoder's embedding."""
        msgs = []
        for k, (row, out) in enumerate(zip(rows, res.outputs)):
            m = pb.PrefillOutput(cache=handle_pb(out.cache), cached_tokens=out.cached)
            if res.rows[k] is not None:
                m.output.CopyFrom(row_pb(res.rows[k]))
            for pr in res.positions[k]:
                m.positions.append(row_pb(pr))
            if out.embedding is not None:
                m.embedding.dtype = tpb.DATA_TYPE_FP32
                m.embedding.shape.append(int(out.embedding.shape[-1]))
                m.embedding.data = encode_row(out.embedding, "fp32")
            msgs.append(m)
        return msgs

    @staticmethod
    def _orphaned(host, rows: list[StepRow]):
        """Frees the caches a step created (rows without a cache) when its caller is gone before
        it could hand them out."""
        def free(res: StepResult) -> None:
            for row, out in zip(rows, res.outputs):
                if row.entry is None:
                    host.release_soon(out.cache.cache_id, "reclaimed")
        return free

    def _adopt(self, host, rows: list[StepRow], res: StepResult, owner: str) -> None:
        """Record who the caches a step created belong to: the caller, and the Session stream (if
        any) that frees them when it ends. Encoders keep no cache in the registry."""
        reg = host.executor.registry
        for row, out in zip(rows, res.outputs):
            if row.entry is None and out.cache.cache_id in reg:
                self.checks.adopt(reg.get(out.cache.cache_id), owner)

    async def _run(self, host, plan: StepPlan, owner: str, quota_field: str):
        """Compile the plan's constraints, admit its KV, hold its caches and run it on the worker;
        the caches it creates count against the caller's cap and become the caller's."""
        rows = plan.rows
        await self.checks.compile(host, [(r.policy.sampling, f"{plan.field}[{k}].logits.sampling.constraint")
                                         for k, r in enumerate(rows) if r.policy is not None])
        admit(host, plan)
        ids = [r.entry.cache_id for r in rows if r.entry is not None]
        try:
            with self.checks.quota.claim(host, sum(1 for r in rows if r.entry is None), quota_field):
                with host.hold(ids, f"{plan.field}.cache_id"):
                    timed = await host.step(plan, on_orphan=self._orphaned(host, rows))
                self._adopt(host, rows, timed.value, owner)
        except errors.FerrumError as e:  # the StepProgress detail: what the step did to each row
            if e.committed:
                progress.mark_committed(e, [len(r.tokens) for r in rows])
            else:
                progress.mark_rolled_back(e, len(rows))
            raise
        return timed

    # ---- operations -------------------------------------------------------------------------------
    async def prefill(self, req: pb.PrefillRequest, owner: str = "") -> pb.PrefillResponse:
        t = time.perf_counter_ns()
        host = self.models.get(req.model_id)
        row = self.checks.prompt_row(host, req.input, "input")
        if row.entry is None:
            self.checks.check_new_prompt("Prefill")
        timed = await self._run(host, self.checks.plan(host, [row], "input"), owner, "input")
        res = timed.value
        return pb.PrefillResponse(output=self._prompt_msgs([row], res)[0], timings=_timings(t, timed, res.sampling_ns))

    async def batch_prefill(self, req: pb.BatchPrefillRequest, owner: str = "") -> pb.BatchPrefillResponse:
        t = time.perf_counter_ns()
        host = self.models.get(req.model_id)
        if not req.inputs:
            raise errors.invalid("inputs is empty: at least one prompt is required", field="inputs")
        rows = [self.checks.prompt_row(host, m, f"inputs[{i}]") for i, m in enumerate(req.inputs)]
        if any(r.entry is None for r in rows):
            self.checks.check_new_prompt("BatchPrefill")
        self.checks.unique([r.entry.cache_id for r in rows if r.entry is not None], "inputs.cache_id")
        timed = await self._run(host, self.checks.plan(host, rows, "inputs"), owner, "inputs")
        res = timed.value
        return pb.BatchPrefillResponse(outputs=self._prompt_msgs(rows, res), timings=_timings(t, timed, res.sampling_ns))

    async def decode(self, req: pb.DecodeRequest, owner: str = "") -> pb.DecodeResponse:
        """One token into a cache. A token the cache's structured-output constraint refuses is
        FAILED_PRECONDITION (after the step: the cache holds the token)."""
        t = time.perf_counter_ns()
        host = self.models.get(req.model_id)
        self.checks.require_generation(host, "Decode")
        self.checks.check_decode_role("Decode")
        row = self.checks.decode_row(host, req.input, "input")
        timed = await self._run(host, self.checks.plan(host, [row], "input"), owner, "input")
        res = timed.value
        return pb.DecodeResponse(output=pb.DecodeOutput(cache=handle_pb(res.outputs[0].cache),
                                                        output=row_pb(res.rows[0])),
                                 timings=_timings(t, timed, 0))

    async def batch_decode(self, req: pb.BatchDecodeRequest, owner: str = "") -> pb.BatchDecodeResponse:
        t = time.perf_counter_ns()
        host = self.models.get(req.model_id)
        self.checks.require_generation(host, "BatchDecode")
        self.checks.check_decode_role("BatchDecode")
        if not req.inputs:
            raise errors.invalid("inputs is empty: at least one decode input is required", field="inputs")
        rows = [self.checks.decode_row(host, m, f"inputs[{i}]") for i, m in enumerate(req.inputs)]
        self.checks.unique([r.entry.cache_id for r in rows], "inputs.cache_id")
        timed = await self._run(host, self.checks.plan(host, rows, "inputs"), owner, "inputs")
        res = timed.value
        return pb.BatchDecodeResponse(
            outputs=[pb.DecodeOutput(cache=handle_pb(o.cache), output=row_pb(r)) for o, r in zip(res.outputs, res.rows)],
            timings=_timings(t, timed, 0),
        )

    async def unified_decode(self, req: pb.UnifiedDecodeRequest, owner: str = "") -> pb.UnifiedDecodeResponse:
        t = time.perf_counter_ns()
        host = self.models.get(req.model_id)
        self.checks.require_generation(host, "UnifiedDecode")
        self.checks.require_unified(host)
        if not req.items:
            raise errors.invalid("items is empty", field="items")
        rows = [self.checks.unified_row(host, m, f"items[{i}]") for i, m in enumerate(req.items)]
        if any(r.entry is None for r in rows):
            self.checks.check_new_prompt("UnifiedDecode")
        # A decode item: one final token continuing a cache that is not in the middle of a chunked
        # prompt (a prompt's last chunk, and longer extensions, are prompt work).
        if any(r.kind is RowKind.DECODE and not r.entry.chunking for r in rows):
            self.checks.check_decode_role("UnifiedDecode (a decode item)")
        self.checks.unique([r.entry.cache_id for r in rows if r.entry is not None], "items.cache_id")
        timed = await self._run(host, self.checks.plan(host, rows, "items"), owner, "items")
        res = timed.value
        reg = host.executor.registry
        resp = pb.UnifiedDecodeResponse()
        for it, out, r in zip(req.items, res.outputs, res.rows):
            if out.cache.cache_id in reg:
                reg.get(out.cache.cache_id).chunking = not it.is_final_chunk
            m = resp.results.add(seq_id=it.seq_id, cache=handle_pb(out.cache), cached_tokens=out.cached)
            if r is not None:
                m.output.CopyFrom(row_pb(r))
        resp.timings.CopyFrom(_timings(t, timed, res.sampling_ns))
        return resp

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
        plan = self.checks.plan(host, [StepRow.verify(entry, ids, policy)], "token_ids")
        admit(host, plan)
        with host.hold([req.cache_id], "cache_id"):
            timed = await host.call(self._run_verify, host, plan, req.accept_greedy_prefix)
        res, accepted, cache = timed.value
        rows = res.positions[0]
        resp = pb.ForwardVerifyResponse(
            outputs=[row_pb(r) for r in rows], cache=handle_pb(cache), base_len=res.outputs[0].cache.num_tokens - len(ids),
            timings=_timings(t, timed, 0),
        )
        if req.accept_greedy_prefix:
            resp.accepted_drafts = accepted
            resp.accepted_tokens.extend([r.token_id for r in rows[: accepted + 1]])
        return resp

    @staticmethod
    def _run_verify(host, plan: StepPlan, accept: bool):
        """The verify step and, with ``accept``, the drafts' greedy acceptance: the cache keeps the
        accepted drafts and the token after them (on the worker)."""
        res = run(host.executor, plan)
        row = plan.rows[0]
        ids, cache = row.tokens, res.outputs[0].cache
        accepted = 0
        if accept:
            drawn = res.positions[0]
            while accepted < len(ids) - 1 and drawn[accepted].token_id == ids[accepted + 1]:
                accepted += 1
            keep = cache.num_tokens - len(ids) + accepted + 1
            if keep < cache.num_tokens:
                cache, _ = host.executor.truncate_kv(cache.cache_id, keep)
        return res, accepted, cache

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
        self.checks.plan(host, [StepRow(None, [0] * seq, Want.ALL) for _ in range(batch)], "input",
                         response_bytes=batch * seq * width * (4 if dtype == "fp32" else 2), raw=True)
        ids = np.frombuffer(t.data, dtype=np_dtype.newbyteorder("<")).reshape(batch, seq)
        bad = np.flatnonzero((ids < 0) | (ids >= host.vocab_size))
        if bad.size:
            raise errors.invalid(f"input.data[{int(bad[0])}] = {int(ids.reshape(-1)[bad[0]])} is outside the "
                                 f"vocabulary [0, {host.vocab_size})", field="input.data")
        timed = await host.call(host.executor.forward, ids.astype(np.int64), dtype)
        out = timed.value
        resp = pb.ForwardResponse()
        resp.output.dtype = {"fp16": tpb.DATA_TYPE_FP16, "bf16": tpb.DATA_TYPE_BF16}.get(dtype, tpb.DATA_TYPE_FP32)
        resp.output.shape.extend(list(out.shape))
        resp.output.data = encode_row(out.reshape(-1), dtype)
        resp.timings.forward_ns = timed.forward_ns
        return resp


__all__ = ["Operations"]
