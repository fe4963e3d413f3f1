"""``vllm.grpc.engine.VllmEngine``: vLLM's engine gRPC protocol, served beside the contract, so a
gateway that drives vLLM workers (the Shepherd Model Gateway, SMG; llm-d's endpoint picker) drives
ferrum-service workers: it tokenizes, renders chat, parses tool calls and serves the OpenAI API
itself, and sends token ids here.

The protocol's messages come from the published ``smg-grpc-proto`` package (pinned in
pyproject.toml), never from a copy. Every RPC runs on the existing operations: ``Generate`` is the
server-side decode loop of :mod:`.generate` (the contract's ``Generate``), ``Embed`` a ``Prefill``
of the BERT executor, ``Abort`` the stream registry's abort, ``GetTokenizer``
:mod:`.tokenizer_cache` (built at start), ``SubscribeKvEvents`` :mod:`.vllm_kv_events`. One server serves one
model on this protocol (it has no model field): the first hosted model that generates, else the
first one. Errors leave with the status the vLLM servicer answers: what a request asks that our
executors cannot do (frequency / presence penalties, logit_bias, min_tokens, prompt logprobs,
structural tags, multimodal inputs, vLLM's own KV-connector parameters, a DP rank) is
INVALID_ARGUMENT naming the field, as vLLM refuses a parameter its engine rejects. ``StartProfile``
/ ``StopProfile`` drive ``torch.profiler`` over the model's steps (:mod:`.vllm_profile`). SMG's prefill/decode mode hands KV over through our ``ExportKv`` / ``ImportKv``
(:mod:`.vllm_pd`). docs/operating.md ("The vLLM engine protocol") has the full mapping.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from typing import TYPE_CHECKING, AsyncIterator

import numpy as np
import structlog
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from ..core import errors
from ..core.speculation import default_config
from ..core.callers import current_caller
from ..core.modes import ExecutorState
from ..core.stop_conditions import MAX_STOP_TOKEN_IDS, check_stop_sequences
from . import vllm_profile
from .convert import MAX_TOP_LOGPROBS, check_tokens, pb, tpb
from .generate import Generation
from .generate_spec import DEFAULT_MAX_TOKENS as DEFAULT_GENERATE_MAX_TOKENS
from .generate_spec import GenerateSpec, Stops
from .metrics import cache_layout
from .tokenizer_cache import bundle as tokenizer_bundle
from .vllm_kv_events import BlockEventRelay
from .vllm_load import LOAD_TICK, LoadPacer, LoadSampler
from .vllm_pd import PdHandoffs
from .vllm_pd import parse as parse_handoff

if TYPE_CHECKING:
    from ..core.modes import Role
    from ..hosting.host import ModelHost
    from ..hosting.kv_events import KvEventHub
    from ..hosting.models import ModelSet
    from ..hosting.profiler import StepProfiler
    from .kv_transfer import KvTransfer
    from .metrics import Metrics
    from .migration import Migrations
    from .operations import Operations
    from .rpc_guard import RpcGuard
    from .streams import StreamRegistry

log = structlog.get_logger("ferrum_service.wire.vllm_engine")

SERVICE_NAME = vpb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
#: Output tokens reserved up front for a request that leaves ``max_tokens`` unset (which, as in
#: vLLM, means the rest of the model's context): as many as the contract's ``Generate`` reserves
#: by default. Reserving the whole context would admit one such request at a time on a worker whose
#: KV budget is one context; past the reservation the cache grows step by step, and a step the KV
#: budget cannot admit ends the stream with RESOURCE_EXHAUSTED (named, never a silent finish
#: "length": another caller's reservation must not look like the end of the context;
#: ``generate(reserve_output=)``).
UNSET_MAX_TOKENS_RESERVE = DEFAULT_GENERATE_MAX_TOKENS
#: Longest ``FlushCache`` waits for the live caches to go (``timeout_s`` above it is refused).
MAX_FLUSH_WAIT_S = 60.0
#: How often the one server-wide wait for "no live cache" looks (whatever the number of callers).
_FLUSH_POLL_S = 0.05
CHUNK_BYTES = 64 * 1024  # GetTokenizer chunk (the size SMG's client expects)
#: Start of the salt of an unauthenticated request's own prefix-cache key space (``request_salt``).
PRIVATE_SALT_PREFIX = "vllm-request:"
_FINISH = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_EOS: "stop",
           pb.FINISH_REASON_CANCELLED: "abort", pb.FINISH_REASON_ERROR: "error"}


@dataclasses.dataclass(frozen=True)
class VllmParts:
    """The server's parts the vLLM protocol's services use (``server.py`` builds them, once, and
    hands the contract's servicer the same ones)."""

    models: ModelSet
    ops: Operations  # Embed runs a Prefill step; ``ops.checks`` checks the requests
    streams: StreamRegistry  # running streams, their owners, Abort
    events: KvEventHub  # block events (SubscribeKvEvents) and its subscriber caps
    metrics: Metrics
    guard: RpcGuard  # every RPC runs under it; draining; admin rights
    kv: KvTransfer  # SMG's PD handoff pulls and exports (vllm_pd.py)
    role: Role
    advertise: str = ""  # HOST:PORT peers pull this server's KV from (a PD prefill leg names it)
    # Live migration (migration.py): a stream here moves in relay mode (a vLLM client follows no
    # GenerateMigrated); None = vLLM streams never move.
    migrations: "Migrations | None" = None


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    """The vLLM engine protocol over one hosted model (see the module doc)."""

    def __init__(self, parts: "VllmParts", shared_prefix_cache: bool = False, pairing_protocol: str = "",
                 profiler: "StepProfiler | None" = None) -> None:
        """``parts``: the server's parts this service uses (``server.py`` builds them);
        ``shared_prefix_cache``: unauthenticated callers' requests share one prefix-cache key
        space (``--vllm-shared-prefix-cache``; see :func:`request_salt`); ``pairing_protocol``:
        ``GetServerInfo``'s PD pairing protocol (``--pairing-protocol``); ``profiler``: the
        server's profiles (``--profile-dir``; None = profiling off)."""
        self.guard = parts.guard
        self.streams = parts.streams
        self.metrics = parts.metrics
        self.ops = parts.ops
        self.checks = parts.ops.checks
        self.events = parts.events
        self.shared_prefix_cache = shared_prefix_cache
        self.pairing_protocol = pairing_protocol
        self.models = parts.models
        self.migrations = parts.migrations
        hosts = list(self.models)
        self._host = next((h for h in hosts if h.supports_generation), hosts[0] if hosts else None)
        self.relay = BlockEventRelay(parts.events, self._host.model_id if self._host else "")
        self.load = (LoadSampler(self._host, parts.streams, parts.metrics.serving, parts.role)
                     if self._host else None)  # vllm_load.py
        self.started = time.time()
        self.last_request = 0.0
        self._tokenizer_zip: asyncio.Task | None = None  # (zip bytes, their SHA-256), built once
        self._flush_wait: asyncio.Task | None = None
        self._flush_waiters = 0
        self.pd = PdHandoffs(parts.kv, parts.role, parts.advertise)  # SMG's PD mode: vllm_pd.py
        if profiler is None:
            from ..hosting.profiler import StepProfiler
            profiler = StepProfiler(None)
        self.profiler = profiler

    @property
    def host(self) -> "ModelHost":
        """The model served on this protocol (UNAVAILABLE on a server that hosts none)."""
        if self._host is None:
            raise errors.unavailable("this server hosts no model")
        return self._host

    async def prepare_tokenizer(self) -> None:
        """Build (or read back from the disk cache) the tokenizer bundle now, at start, so the
        first ``GetTokenizer`` answers at once (``tokenizer_cache.py``). A failure is logged;
        ``GetTokenizer`` tries again and reports it."""
        h = self._host
        if h is None or h.executor.tokenizer is None:
            return
        t0 = time.perf_counter()
        self._tokenizer_zip = asyncio.ensure_future(asyncio.to_thread(tokenizer_bundle, h.executor))
        try:
            data, _ = await asyncio.shield(self._tokenizer_zip)
            log.info("tokenizer bundle ready", model_id=h.model_id, bytes=len(data),
                     seconds=round(time.perf_counter() - t0, 3))
        except Exception as e:  # noqa: BLE001 - GetTokenizer reports it
            log.warning("tokenizer bundle could not be built at start", model_id=h.model_id, error=str(e))

    async def close(self) -> None:
        self.pd.close()
        self.profiler.close()
        if self._flush_wait is not None:
            self._flush_wait.cancel()
        await self.relay.close()

    # ---- Generate ---------------------------------------------------------------------------------
    async def Generate(self, request, context) -> None:
        await self.guard.stream("VllmEngine.Generate", context, request, self._generate_stream(request, context))

    async def _generate_stream(self, request, context) -> AsyncIterator[vpb.GenerateResponse]:
        """The stream's responses, under the guard (``RpcGuard.stream`` entered the caller)."""
        self.last_request = time.time()
        tokens = 0
        with self.streams.generation("vllm") as state:
            try:
                asked = await self._request(request)
                handoff = parse_handoff(request)
                self._check_role(request)
                self._check_response_size(request, asked)
                async for out in self._responses(request, asked, state.owner, state, handoff,
                                                 context.invocation_metadata()):
                    if out.WhichOneof("response") == "chunk":
                        tokens += len(out.chunk.token_ids)
                    yield out
            except (asyncio.CancelledError, GeneratorExit):  # the client went away, or cancelled
                self.metrics.cancelled_streams.inc()
                log.info("stream cancelled", rpc="VllmEngine.Generate", request_id=request.request_id)
                raise
            finally:
                self.metrics.tokens_generated.inc(tokens)

    async def _request(self, v: vpb.GenerateRequest) -> "_Asked":
        """What a vLLM request asks, refusing what we cannot do (the rest is checked into a
        :class:`GenerateSpec` once its cache is known: :meth:`_spec`)."""
        host = self.host
        sp = v.sampling_params
        _refuse_unsupported(v)
        ctx = host.info.max_sequence_length
        keep = 0  # the prompt's last tokens kept (truncate_prompt_tokens; 0 = all)
        if sp.HasField("truncate_prompt_tokens"):
            k = sp.truncate_prompt_tokens
            if k < -1 or k == 0:
                raise errors.invalid(f"truncate_prompt_tokens = {k}: give -1 (the model's context) or >= 1",
                                     field="sampling_params.truncate_prompt_tokens")
            keep = ctx if k == -1 else k
        which = v.WhichOneof("input")
        if which == "tokenized":  # truncated, then counted, before any id is read
            raw = v.tokenized.input_ids
            ids = self.checks.tokens(host, raw[-keep:] if keep else raw, "tokenized.input_ids")
        elif which == "text":
            tok = host.executor.tokenizer
            if tok is None:
                raise errors.failed_precondition(f"model {host.model_id!r} has no tokenizer; send tokenized input",
                                                 field="text")
            self.checks.check_text(host, [v.text], "text")
            ids = list(await asyncio.to_thread(tok.encode, v.text, add_special_tokens=True))
            if keep:
                ids = ids[-keep:]
        else:
            raise errors.invalid("input is not set: send tokenized or text", field="input")
        if not ids:
            raise errors.invalid("the prompt has no tokens", field="tokenized.input_ids")
        if sp.HasField("max_tokens"):
            if sp.max_tokens < 1:
                raise errors.invalid("max_tokens must be >= 1", field="sampling_params.max_tokens")
            max_tokens = sp.max_tokens
        else:  # the rest of the context (a registry's per-request ceiling may make it shorter)
            limit = host.executor.registry.sequence_limit(ctx)
            max_tokens = limit - len(ids) if limit else UNSET_MAX_TOKENS_RESERVE
            if max_tokens < 1:
                raise errors.invalid(f"the prompt's {len(ids)} tokens leave no room in this model's {limit}-token "
                                     "context", field="tokenized.input_ids", limit=limit)
        stop_ids = check_tokens(sp.stop_token_ids, host.vocab_size, "sampling_params.stop_token_ids", allow_empty=True,
                                max_len=MAX_STOP_TOKEN_IDS)
        check_stop_sequences(sp.stop, "sampling_params.stop")
        top = 0
        if sp.HasField("logprobs"):
            if not 0 <= sp.logprobs <= MAX_TOP_LOGPROBS:
                raise errors.invalid(f"logprobs = {sp.logprobs}: at most {MAX_TOP_LOGPROBS} top log-probabilities per "
                                     "token (-1, the whole vocabulary, is not served)", field="sampling_params.logprobs")
            top = sp.logprobs
        return _Asked(tuple(ids), max_tokens, frozenset(stop_ids), top, request_salt(self.shared_prefix_cache))

    async def _spec(self, v: vpb.GenerateRequest, asked: "_Asked", imported: str, offer: bool) -> GenerateSpec:
        """The request checked into a :class:`GenerateSpec` (as the contract's ``Generate`` checks
        its request) once its cache is known: ``imported``, a cache pulled for it (then only the
        prompt's last token is computed), and ``offer``, a PD prefill leg that keeps its cache."""
        host, checks, sp = self.host, self.checks, v.sampling_params
        checks.require_generation(host, "Generate")
        policy = checks.sampling_policy(host, _sampling(sp), asked.top_logprobs, "sampling")
        n = checks.samples(host, max(1, sp.n), imported)
        salt = checks.salt(asked.salt, "cache_salt")
        draft = checks.speculation(host, policy, default_config(host.speculation_default))
        stops = Stops(asked.max_tokens, asked.stop_ids, checks.eos_ids(host, sp.ignore_eos), tuple(sp.stop),
                      checks.stop_strings(host, sp.stop, "stop.stop_sequences"))
        ids = asked.ids[-1:] if imported else asked.ids
        prompt = checks.tokens(host, ids, "token_ids.token_ids", allow_empty=bool(imported))
        entry = checks.live_entry(host, imported, "cache_id") if imported else None
        grow = 0 if sp.HasField("max_tokens") else UNSET_MAX_TOKENS_RESERVE
        spec = GenerateSpec(host, v.request_id, tuple(prompt), entry, policy, stops, n=n, salt=salt, speculation=draft,
                            keep_cache=offer, reserve_output=grow, adopt_cache=bool(imported),
                            request=_contract_request(host, v, asked))
        await checks.ready(spec)
        return spec

    async def _responses(self, v: vpb.GenerateRequest, asked: "_Asked", owner: str, state, handoff=None,
                         metadata=None) -> AsyncIterator[vpb.GenerateResponse]:
        """vLLM's answer: with ``stream`` a chunk per token and a Complete per sample when it ends
        (carrying the last chunk's token, as vLLM's delta outputs do); without, one Complete per
        sample, all at the end, in sample order. A PD prefill leg keeps its cache and names it in
        ``kv_transfer_params_json``; a decode leg given one pulls it first (``vllm_pd.py``)."""
        host = self.host
        grow = 0 if v.sampling_params.HasField("max_tokens") else UNSET_MAX_TOKENS_RESERVE
        imported = ""
        if handoff is not None:
            ids = list(asked.ids)
            imported = await self.pd.pull(host, handoff, ids, len(ids) + (grow or asked.max_tokens), metadata,
                                          salt=asked.salt)
        offer = not imported and handoff is None and self.pd.offers(host, v)
        kept = ""
        started = False
        try:
            state.bind(host.model_id, v.request_id, imported)
            spec = await self._spec(v, asked, imported, offer)
            async for out in self._events(v, spec, owner, state, bool(imported)):
                if isinstance(out, str):
                    started, kept = True, out
                    continue
                yield out
        finally:
            if imported and not started:  # refused before the stream took the pulled cache over
                host.release_soon(imported, "reclaimed")
            if offer and kept and not self.pd.is_offered(kept):  # a prefill leg that did not finish
                host.release_soon(kept, "reclaimed")

    async def _events(self, v: vpb.GenerateRequest, spec: GenerateSpec, owner: str, state, imported: bool):
        """The responses of :meth:`_responses`, after a str: the stream's cache id once it started."""
        want_lp = v.sampling_params.HasField("logprobs")
        top = spec.policy.top_logprobs
        offer = spec.keep_cache
        prompt_tokens = cached = 0
        out_ids: dict[int, list[int]] = {}
        lps: dict[int, vpb.OutputLogProbs] = {}
        last: dict[int, pb.TokenEvent] = {}
        done: list[vpb.GenerateResponse] = []
        async for ev in Generation(spec, self.checks, owner, state, self.migrations).events():
            kind = ev.WhichOneof("event")
            if kind == "started":
                prompt_tokens, cached = ev.started.prompt_tokens, ev.started.cached_tokens
                if imported:  # the pulled tokens were not computed here
                    cached += prompt_tokens - 1
                yield ev.started.cache.cache_id
            elif kind == "token":
                t = ev.token
                i = t.sample_index
                out_ids.setdefault(i, []).append(t.token_id)
                last[i] = t
                if want_lp:
                    _add_logprob(lps.setdefault(i, vpb.OutputLogProbs()), t, top)
                if v.stream:
                    chunk = vpb.GenerateStreamChunk(token_ids=[t.token_id], prompt_tokens=prompt_tokens,
                                                    completion_tokens=1, cached_tokens=cached, index=i)
                    if want_lp:
                        _add_logprob(chunk.output_logprobs, t, top)
                    yield vpb.GenerateResponse(chunk=chunk)
            elif kind == "finished":
                f = ev.finished
                i = f.sample_index
                ids = out_ids.get(i, [])
                c = vpb.GenerateComplete(finish_reason=_FINISH.get(f.finish_reason, "stop"),
                                         prompt_tokens=prompt_tokens, cached_tokens=cached, index=i,
                                         spec_draft_tokens=f.draft_tokens, spec_accepted_tokens=f.accepted_draft_tokens)
                if offer and f.HasField("cache") and prompt_tokens > 1:
                    handoff = await self.pd.offer(self.host, f.cache.cache_id, prompt_tokens)
                    if handoff is not None:
                        c.kv_transfer_params_json = handoff.to_json()
                if f.finish_reason == pb.FINISH_REASON_STOP:
                    if ids and ids[-1] in spec.stops.token_ids:
                        c.matched_token_id = ids[-1]
                    else:
                        hit = next((s for s in spec.stops.sequences if s and s in f.text), None)
                        if hit is not None:
                            c.matched_stop_str = hit
                if v.stream:  # the last delta, as vLLM's final delta output carries it
                    tail = [last[i]] if i in last else []
                    c.output_ids.extend(t.token_id for t in tail)
                    c.completion_tokens = len(tail)
                    if want_lp:
                        for t in tail:
                            _add_logprob(c.output_logprobs, t, top)
                    yield vpb.GenerateResponse(complete=c)
                else:
                    c.output_ids.extend(ids)
                    c.completion_tokens = len(ids)
                    if want_lp and i in lps:
                        c.output_logprobs.CopyFrom(lps[i])
                    done.append(vpb.GenerateResponse(complete=c))
        for c in sorted(done, key=lambda r: r.complete.index):
            yield c

    # ---- Embed ------------------------------------------------------------------------------------
    async def Embed(self, request, context):
        async def run():
            host = self.host
            if not host.capabilities.supports_embeddings:
                raise errors.invalid(f"model {host.model_id!r} does not embed (it is a generation model)",
                                     field="tokenized")
            if not request.HasField("tokenized"):
                raise errors.invalid("EmbedRequest requires tokenized input", field="tokenized")
            ids = self.checks.tokens(host, request.tokenized.input_ids, "tokenized.input_ids")
            step = pb.PrefillRequest(model_id=host.model_id, input=pb.PrefillInput(token_ids=ids))
            owner = self.streams.new_owner("vllm-embed")
            resp = await self.ops.run_step("prefill", step, owner)
            host.release_soon(resp.output.cache.cache_id)
            emb = resp.output.embedding
            if emb.dtype != tpb.DATA_TYPE_FP32:
                raise errors.FerrumError(errors.ErrorKind.INTERNAL, f"embedding dtype {emb.dtype} is not FP32")
            vec = np.frombuffer(emb.data, dtype="<f4")
            return vpb.EmbedResponse(embedding=vec.tolist(), prompt_tokens=len(ids), embedding_dim=int(vec.size))
        return await self.guard.unary("VllmEngine.Embed", context, run, request)

    # ---- management -------------------------------------------------------------------------------
    async def HealthCheck(self, request, context):
        if self._host is None:
            return vpb.HealthCheckResponse(healthy=False, message="this server hosts no model")
        if self.guard.serving.shutting_down:
            return vpb.HealthCheckResponse(healthy=False, message="the server is shutting down")
        if self.guard.serving.migrating:  # every new request is refused: the gateway must route elsewhere
            return vpb.HealthCheckResponse(healthy=False, message="the server drains (its streams move to a peer)")
        if self.host.executor.state == ExecutorState.SHUTDOWN:
            return vpb.HealthCheckResponse(healthy=False, message=f"model {self.host.model_id!r} is shut down")
        return vpb.HealthCheckResponse(healthy=True, message="Health")

    async def Abort(self, request, context):
        async def run():
            n = self.streams.abort_requests(request.request_ids, "request_ids")
            log.info("abort", rpc="VllmEngine.Abort", request_ids=list(request.request_ids[:16]), aborted_streams=n)
            return vpb.AbortResponse()
        return await self.guard.unary("VllmEngine.Abort", context, run)

    async def GetModelInfo(self, request, context):
        async def run():
            h = self.host
            info = h.info
            tok = h.executor.tokenizer
            return vpb.GetModelInfoResponse(
                model_path=h.model_id, served_model_name=h.model_id, is_generation=h.supports_generation,
                max_context_length=info.max_sequence_length, max_req_input_len=info.max_sequence_length,
                vocab_size=info.vocab_size, supports_vision=False,
                model_type=info.model_type_detail or info.model_type, architectures=[info.executor or h.executor.kind],
                eos_token_ids=list(info.eos_token_ids),
                bos_token_id=max(0, int(getattr(tok, "bos_token_id", None) or 0)),
                pad_token_id=max(0, int(getattr(tok, "pad_token_id", None) or 0)))
        return await self.guard.unary("VllmEngine.GetModelInfo", context, run)

    async def GetServerInfo(self, request, context):
        async def run():
            h = self.host
            return vpb.GetServerInfoResponse(
                active_requests=self._generations(), is_paused=self.guard.paused(),
                last_receive_timestamp=self.last_request, uptime_seconds=time.time() - self.started,
                server_type="ferrum-service", data_parallel_size=1, block_size=self._block_size(),
                model_dtype=h.info.dtype, kv_cache_dtype=h.info.dtype, max_num_seqs=h.max_batch,
                attention_backend=attention_backend(h), pairing_protocol=self.pairing_protocol)
        return await self.guard.unary("VllmEngine.GetServerInfo", context, run)

    async def GetLoads(self, request, context):
        async def run():
            self.host  # noqa: B018 - UNAVAILABLE on a server that hosts none
            return self.load.scheduler_load()  # the record the event stream pushes (vllm_load.py)
        return await self.guard.unary("VllmEngine.GetLoads", context, run)

    async def GetTokenizer(self, request, context) -> AsyncIterator[cpb.GetTokenizerChunk]:
        async with self.guard.answer("VllmEngine.GetTokenizer", context):
            if self._tokenizer_zip is None or (self._tokenizer_zip.done() and self._tokenizer_zip.exception()):
                self._tokenizer_zip = asyncio.ensure_future(asyncio.to_thread(tokenizer_bundle, self.host.executor))
            data, digest = await asyncio.shield(self._tokenizer_zip)
            for off in range(0, len(data), CHUNK_BYTES):
                end = min(off + CHUNK_BYTES, len(data))
                yield cpb.GetTokenizerChunk(data=data[off:end], sha256=digest if end == len(data) else "")

    async def SubscribeKvEvents(self, request, context) -> AsyncIterator[cpb.KvEventBatch]:
        # Not an active stream: the drain does not wait for subscribers (grpc.stop ends them).
        origin = self.guard.enter(context)
        async with self.guard.answer("VllmEngine.SubscribeKvEvents", context):
            host = self.host
            caller = current_caller.get()
            # The contract's subscriber caps (in all, per caller; without identities per client host).
            seat = self.events.seat(caller, caller if caller else origin.partition("@")[2])
            try:
                self.relay.start()
                nxt = self.relay.cursor(int(request.start_sequence_number))
                pacer = LoadPacer(self.load, before_first=request.load_records_before_first_batch)
                log.debug("vllm kv-event subscriber", model_id=host.model_id, start=nxt,
                          load_records_before_first_batch=request.load_records_before_first_batch)
                # Headers now: SMG takes a subscription whose headers do not come within 2 s for a
                # dead worker, and an idle worker may send no batch for a long time.
                await context.send_initial_metadata(())
                async for batch in self.relay.batches(nxt, tick=LOAD_TICK):
                    out = pacer.stamp(batch) if batch is not None else pacer.due()
                    if out is not None:
                        yield out
            finally:
                seat.close()

    async def FlushCache(self, request, context):
        """Admin only (it drops every tenant's cached prefix blocks): an admin token, or
        ``--open-admin-rpcs`` (the auth interceptor checks the token, as for the contract's)."""
        async def run():
            self.guard.check_admin("VllmEngine.FlushCache")
            h = self.host
            wait = request.timeout_s
            if not 0 <= wait <= MAX_FLUSH_WAIT_S:  # NaN too
                raise errors.invalid(f"timeout_s = {wait:g}: give 0 to {MAX_FLUSH_WAIT_S:g} seconds", field="timeout_s",
                                     limit=MAX_FLUSH_WAIT_S)
            if len(h.executor.registry) and wait:
                await self._until_no_cache(h, wait)
            if len(h.executor.registry):
                return cpb.FlushCacheResponse(success=False, message="caches are live (requests in flight); the "
                                              "prefix cache is flushed only when none is")
            ok = (await h.call(h.executor.clear_prefix_cache)).value
            return cpb.FlushCacheResponse(success=True, message="prefix cache flushed" if ok
                                          else f"model {h.model_id!r} keeps no prefix cache")
        return await self.guard.unary("VllmEngine.FlushCache", context, run)

    async def StartProfile(self, request, context):
        """Admin only (the trace records every tenant's steps): :mod:`.vllm_profile`."""
        async def run():
            self.guard.check_admin("VllmEngine.StartProfile")
            return await vllm_profile.start(self.profiler, self.host, request)
        return await self.guard.unary("VllmEngine.StartProfile", context, run, request)

    async def StopProfile(self, request, context):
        async def run():
            self.guard.check_admin("VllmEngine.StopProfile")
            return await vllm_profile.stop(self.profiler)
        return await self.guard.unary("VllmEngine.StopProfile", context, run, request)

    # ---- helpers ----------------------------------------------------------------------------------
    async def _until_no_cache(self, h: "ModelHost", timeout: float) -> None:
        """Wait up to ``timeout`` s for the model to hold no live cache. One look-up loop serves
        every waiting call (it ends when nobody waits), so concurrent calls add no wake-ups."""
        reg = h.executor.registry

        async def watch() -> None:
            while len(reg) and self._flush_waiters:
                await asyncio.sleep(_FLUSH_POLL_S)

        self._flush_waiters += 1
        try:
            if self._flush_wait is None or self._flush_wait.done():
                self._flush_wait = asyncio.ensure_future(watch())
            await asyncio.wait_for(asyncio.shield(self._flush_wait), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            self._flush_waiters -= 1

    def _check_role(self, v: vpb.GenerateRequest) -> None:
        """The server's role, as the contract's ``Generate`` checks it, where it applies: a prefill
        server runs only SMG's prefill legs (``max_tokens`` 1, one sample). A decode server still
        computes a prompt that comes without a usable handoff: SMG 1.13's PD mode sends such
        requests to decode workers (``execute_single``: seen in tests/test_smg_gateway.py), and
        vLLM computes the prompt after a failed KV load too."""
        sp = v.sampling_params
        if not (sp.HasField("max_tokens") and sp.max_tokens == 1 and sp.n <= 1):
            self.checks.check_decode_role("VllmEngine.Generate")

    def _check_response_size(self, v: vpb.GenerateRequest, asked: "_Asked") -> None:
        """A non-streamed answer is one message per sample holding every token (and its
        log-probabilities): refused before any work when it could pass the message limit, as the
        contract refuses a step whose answer could."""
        if v.stream:
            return
        limit = self.host.limits.max_response_bytes
        per_token = _TOKEN_BYTES + (_LOGPROB_BYTES + asked.top_logprobs * _TOP_LOGPROB_BYTES
                                    if v.sampling_params.HasField("logprobs") else 0)
        size = _COMPLETE_BYTES + asked.max_tokens * per_token
        if limit and size > limit:
            raise errors.invalid(
                f"a non-streamed answer of up to {asked.max_tokens} tokens with {asked.top_logprobs} top "
                f"log-probabilities each is up to {size} bytes per sample; this server's message limit is {limit} "
                "(--max-message-bytes): stream it, or lower sampling_params.max_tokens or logprobs",
                field="sampling_params.max_tokens", limit=limit)

    def _generations(self) -> int:
        return sum(1 for st in self.streams.generations.values() if st.model_id == self.host.model_id)

    def _block_size(self) -> int:
        return cache_layout(self.host)[0]


@dataclasses.dataclass(frozen=True)
class _Asked:
    """What a vLLM request asks, checked against what the protocol alone decides."""

    ids: tuple[int, ...]  # the prompt (truncated as asked)
    max_tokens: int
    stop_ids: frozenset[int]
    top_logprobs: int
    salt: str  # its prefix-cache key salt (:func:`request_salt`), before the caller is folded in


# Upper bounds of a non-streamed GenerateComplete's bytes: per token (its id twice, in output_ids
# and output_logprobs, as varints), per log-probability (a float), per top entry (a float and an
# id, plus the entry's framing counted per token), and the message's own fields.
_TOKEN_BYTES = 10
_LOGPROB_BYTES = 4 + 12
_TOP_LOGPROB_BYTES = 9
_COMPLETE_BYTES = 1024


def attention_backend(h: "ModelHost") -> str:
    """``GetServerInfo.attention_backend``, one of the PD pairing factors: the executor that holds
    the KV (caches move only between executors of one kind: ExportKv / ImportKv) and, on
    transformers, its attention implementation."""
    attn = (h.info.metadata or {}).get("attn_implementation") or ""
    return f"{h.executor.kind}/{attn}" if attn else h.executor.kind


def request_salt(shared: bool) -> str:
    """The ``cache_salt`` of a vLLM-protocol request, which carries no salt of its own.

    An authenticated caller: "" (the caller's own key space: its identity is folded in). An
    unauthenticated one (SMG sends workers no credential and nothing that tells its users apart):
    "" when ``shared`` (the one space every unauthenticated request of either protocol uses),
    else a fresh random salt, so the request takes no cached prefix another request left and
    leaves none another can take, and K/V pushed into the shared space never reach it."""
    if shared or current_caller.get():
        return ""
    return PRIVATE_SALT_PREFIX + secrets.token_hex(16)


def _contract_request(host: "ModelHost", v: vpb.GenerateRequest, asked: "_Asked") -> pb.GenerateRequest:
    """The vLLM request as the contract's ``GenerateRequest`` (prompt left out): what a move sends
    the target (``AcceptMigrationRequest.request``), which checks and runs it as this server does.
    Always ``MIGRATION_MODE_RELAY``: a vLLM client cannot follow ``GenerateMigrated``, so this server
    relays the moved stream's tokens on the client's own stream."""
    sp = v.sampling_params
    req = pb.GenerateRequest(model_id=host.model_id, request_id=v.request_id, sampling=_sampling(sp),
                             top_logprobs=asked.top_logprobs, cache_salt=asked.salt,
                             migration_mode=pb.MIGRATION_MODE_RELAY)
    req.stop.max_tokens = asked.max_tokens
    req.stop.stop_token_ids.extend(sorted(asked.stop_ids))
    req.stop.ignore_eos = sp.ignore_eos
    req.stop.stop_sequences.extend(sp.stop)
    return req


def _refuse_unsupported(v: vpb.GenerateRequest) -> None:
    """INVALID_ARGUMENT (vLLM's status for a request its engine rejects) for what no executor of
    ours does, naming the field."""
    sp = v.sampling_params
    refused = [
        (sp.frequency_penalty != 0, "sampling_params.frequency_penalty", "frequency penalty"),
        (sp.presence_penalty != 0, "sampling_params.presence_penalty", "presence penalty"),
        (bool(sp.logit_bias), "sampling_params.logit_bias", "logit_bias"),
        (sp.min_tokens > 0, "sampling_params.min_tokens", "min_tokens"),
        (sp.HasField("prompt_logprobs"), "sampling_params.prompt_logprobs", "prompt logprobs"),
        (sp.WhichOneof("constraint") == "structural_tag", "sampling_params.structural_tag", "structural tags"),
        (v.HasField("mm_inputs") or len(v.extra_mm_inputs) > 0 or v.HasField("media_refs"), "mm_inputs",
         "multimodal inputs"),
        (v.HasField("data_parallel_rank") and v.data_parallel_rank != 0, "data_parallel_rank",
         "data-parallel ranks (one rank per worker)"),
    ]
    for bad, field, what in refused:
        if bad:
            raise errors.invalid(f"{field}: {what} is not supported by ferrum-service", field=field)


def _sampling(sp: vpb.SamplingParams) -> tpb.SamplingParams:
    """vLLM's sampling parameters as the contract's (defaults as vLLM reads the proto: temperature
    unset = 1.0, top_p 0 = off, repetition_penalty 0 = off)."""
    out = tpb.SamplingParams(temperature=sp.temperature if sp.HasField("temperature") else 1.0, top_k=sp.top_k,
                             min_p=sp.min_p)
    if sp.top_p:
        out.top_p = sp.top_p
    if sp.repetition_penalty and sp.repetition_penalty != 1.0:
        out.repetition_penalty = sp.repetition_penalty
    if sp.HasField("seed"):
        out.seed = sp.seed % (1 << 64)
    # ``grammar_from_first_token``: our engine runs no reasoning parser, so a constraint always
    # applies from the first generated token, set or not (what the flag asks; vLLM's
    # ``reasoning_ended``). Nothing waits for a reasoning close to start it.
    which = sp.WhichOneof("constraint")
    c = out.constraint
    if which == "json_schema":
        c.json_schema = sp.json_schema
    elif which == "json_object":
        c.json_schema = '{"type": "object"}'
    elif which == "regex":
        c.regex = sp.regex
    elif which == "grammar":
        c.ebnf_grammar = sp.grammar
    elif which == "choice":
        c.choice.choices.extend(sp.choice.choices)
    else:
        out.ClearField("constraint")
    return out


def _add_logprob(dst: vpb.OutputLogProbs, t: pb.TokenEvent, top: int) -> None:
    dst.token_logprobs.append(t.logprob)
    dst.token_ids.append(t.token_id)
    if top:
        dst.top_logprobs.add(values=[x.logprob for x in t.top_logprobs], token_ids=[x.token_id for x in t.top_logprobs])


__all__ = ["SERVICE_NAME", "VllmEngineServicer", "VllmParts"]
