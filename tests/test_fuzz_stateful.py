"""Stateful fuzzing: sequences of *valid* steps on live caches, mixed with hostile ones.

``tests/test_fuzz.py`` generates requests field by field, so almost none of them is valid and the
executors themselves are barely reached. Here hypothesis' rule-based state machines keep a model of
the caches they created (id -> token count) and drive the real executors with valid steps —
Prefill, BatchPrefill, Decode, BatchDecode, UnifiedDecode (new sequences and cache items),
ForwardVerify (with and without server-side acceptance), TruncateKv, ReleaseCache, Session streams
on live caches, Generate with and without ``keep_cache`` — interleaved with hostile ones (tokens out
of the vocabulary, released caches, truncation past the end, prompts past the model's length,
padded batches of one long row and many short rows, large ``Forward`` tensors, long texts).
One machine runs against the tiny real Llama (paged KV), one against SmolLM2 on the llama.cpp
executor (one unified KV buffer of ``n_ctx`` cells, a pool of sequence ids) and one against the
scripted executor.

After every step the machine checks:

* no call ends INTERNAL or UNKNOWN, and no call runs past its deadline (``DEADLINE_EXCEEDED`` on a
  call we gave a generous deadline is a hang, and fails like INTERNAL);
* every valid step succeeds — or is RESOURCE_EXHAUSTED, and then only when the KV budget computed
  from the model of live caches (block-granular on the paged executor) really cannot hold it;
* a hostile step is refused with the documented code (docs/errors.md) and changes no cache;
* the server's cache registry equals the model: the same ids, the same token counts, and the
  token counts the responses report advance as the contract says (decode +1, verify +N+1 or
  the accepted prefix, truncate to ``new_len``, unified +len(q_tokens));
* the registry's running sums equal ``registry.recount()``;
* on llama.cpp, the executor's own books agree: sequence ids in use = live caches (every id free or
  held exactly once), llama.cpp's KV cells = the registry's tokens; after each run both are back
  at zero;
* the server process's RSS stays within ``RSS_BOUND_MIB`` of its level when the machine started.

The counts of successful steps of each kind are printed at the end (``-s`` shows them) and the
test asserts every kind of valid step succeeded at least once, so a reader can see the executors
were exercised. Derandomized; ``FERRUM_FUZZ_STATEFUL_SCALE`` (default 1.0) scales the number of
runs and steps; ``FERRUM_FUZZ_RANDOM=1`` explores new cases; ``FERRUM_FUZZ_SHRINK=1`` shrinks a
failing sequence (off by default to bound the time a failure takes to report).
"""

from __future__ import annotations

import collections
import math
import os
import queue

import grpc
import psutil
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from ferrum_client._proto.ferrum.executor.v1 import executor_pb2 as pb
from ferrum_client._proto.ferrum.executor.v1 import executor_pb2_grpc as pb_grpc
from ferrum_client._proto.ferrum.executor.v1 import types_pb2 as tpb
from ferrum_service.executors import ConfigurableModelExecutor

from .conftest_models import tiny_llama_dir  # noqa: F401
from .support import llama
from .support.servers import InProcessServer

SCALE = float(os.environ.get("FERRUM_FUZZ_STATEFUL_SCALE", "1.0"))
DERANDOMIZE = os.environ.get("FERRUM_FUZZ_RANDOM") != "1"
DEADLINE = 60.0  # seconds; a valid step of the tiny model takes far less: past it is a hang
RSS_BOUND_MIB = 1024  # growth of the server process's RSS over one whole machine run
BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED}
C = grpc.StatusCode

STATS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


class Target:
    """One in-process server hosting one model, with what the machine needs to know about it."""

    def __init__(self, srv: InProcessServer, model_id: str) -> None:
        self.srv = srv
        self.model_id = model_id
        self.channel = grpc.insecure_channel(srv.target, options=[("grpc.max_receive_message_length", 256 << 20),
                                                                   ("grpc.max_send_message_length", 256 << 20)])
        self.stub = pb_grpc.ModelExecutorStub(self.channel)
        h = next(h for h in srv.models if h.model_id == model_id)
        self.host = h
        self.executor = h.executor
        caps = self.stub.Capabilities(pb.CapabilitiesRequest(model_id=model_id), timeout=DEADLINE).capabilities
        self.max_len = caps.max_sequence_length
        self.max_rows = caps.max_batch_size or 0  # rows one step may carry (0: no limit)
        self.unified = caps.supports_native_unified_decode
        # Executors that fork share blocks between caches (and reuse cached prefixes): the machine's
        # budget model, which gives every cache its own blocks, is then an upper bound on the need.
        self.shares = caps.supports_fork
        self.transfers = caps.supports_kv_transfer
        self.lora = caps.supports_lora
        self.vocab = self.stub.Info(pb.InfoRequest(model_id=model_id), timeout=DEADLINE).models[0].vocab_size
        reg = self.executor.registry
        self.total_tokens = reg.total_tokens
        self.block_size = reg.block_size
        pool = getattr(self.executor, "pool", None)
        self.num_blocks = pool.num_blocks if pool is not None else None
        # llama.cpp: at most n_seq live sequences (each cache holds one sequence id)
        self.max_caches = self.executor.n_seq if llama.is_llama(self.executor) else None
        self.proc = psutil.Process()

    def registry(self) -> dict[str, int]:
        async def read():
            await self.host.drain_releases()
            return {e.cache_id: e.num_tokens for e in self.executor.registry.entries()}
        return self.srv.run(read())


class ExecutorMachine(RuleBasedStateMachine):
    target: Target = None  # set by the test
    name = "?"

    def __init__(self) -> None:
        super().__init__()
        t = self.target
        self.t = t
        self.stats = STATS[self.name]
        self.caches: dict[str, int] = {}  # cache id -> tokens, as the contract says they must be
        self.reserved: dict[str, int] = {}  # cache id -> tokens of budget Generate(keep_cache) reserved
        self.rss0 = t.proc.memory_info().rss
        assert t.registry() == {}, "a previous run left caches"

    # ---- helpers ---------------------------------------------------------------------------------
    def fits(self, new_lengths: dict[str | None, int], fresh: list[int] = ()) -> bool:
        """Whether the KV budget can hold the caches at ``new_lengths`` (None keys and ``fresh``:
        new caches). The token budget counts each cache's footprint (its tokens, or what a
        ``Generate(keep_cache)`` reserved for it if more); blocks count tokens; on llama.cpp at most
        ``n_seq`` caches live at once."""
        lengths = dict(self.caches)
        footprint = {k: max(n, self.reserved.get(k, 0)) for k, n in self.caches.items()}
        extra = list(fresh)
        for k, n in new_lengths.items():
            if k is None:
                extra.append(n)
            else:
                lengths[k] = max(lengths[k], n)
                footprint[k] = max(footprint[k], n)
        all_n = list(lengths.values()) + extra
        if sum(footprint.values()) + sum(extra) > self.t.total_tokens:
            return False
        if self.t.max_caches is not None and len(all_n) > self.t.max_caches:
            return False
        if self.t.num_blocks is not None:
            return sum(math.ceil(n / self.t.block_size) for n in all_n) <= self.t.num_blocks
        return True

    def valid(self, kind: str, fn, *, fits: bool = True):
        """A valid step: OK, or RESOURCE_EXHAUSTED only when the budget really cannot hold it."""
        try:
            r = fn()
        except grpc.RpcError as e:
            assert e.code() not in BAD, f"{kind}: {e.code().name} {e.details()}"
            if e.code() == C.RESOURCE_EXHAUSTED and not fits:
                self.stats[kind + ":exhausted"] += 1
                return None
            raise AssertionError(f"valid {kind} refused: {e.code().name} {e.details()} (fits={fits}, "
                                 f"caches={self.caches})") from None
        assert fits or self.t.shares, f"{kind} succeeded although the model says the budget cannot hold it ({self.caches})"
        self.stats[kind] += 1
        if not fits:
            self.stats["fit thanks to shared blocks"] += 1
        return r

    def hostile(self, kind: str, fn, codes: set) -> None:
        """A hostile step: refused with one of the documented ``codes`` (no cache changes: checked by
        the invariants)."""
        try:
            fn()
        except grpc.RpcError as e:
            assert e.code() not in BAD, f"hostile {kind}: {e.code().name} {e.details()}"
            assert e.code() in codes, f"hostile {kind}: {e.code().name} (expected {codes}): {e.details()}"
            self.stats["hostile:" + kind] += 1
            return
        raise AssertionError(f"hostile {kind} was accepted")

    def tokens(self, data, lo: int, hi: int) -> list[int]:
        n = data.draw(st.one_of(st.integers(lo, min(hi, lo + 8)), st.integers(lo, hi), st.just(hi)), label="n")
        seed = data.draw(st.integers(0, 2**16), label="seed")
        return [(seed + 7 * i) % self.t.vocab for i in range(n)]  # drawn cheaply; long lists stay fast

    def pick(self, data, k: int = 1) -> list[str]:
        ids = list(self.caches)  # creation order: the same on every replay (ids themselves differ)
        idx = data.draw(st.lists(st.integers(0, len(ids) - 1), min_size=k, max_size=k, unique=True), label="caches")
        return [ids[i] for i in idx]

    def room(self, cid: str) -> int:
        return self.t.max_len - self.caches[cid]

    @property
    def mid(self) -> str:
        return self.t.model_id

    # ---- valid steps -----------------------------------------------------------------------------
    @precondition(lambda self: len(self.caches) < 12)
    @rule(data=st.data())
    def prefill(self, data):
        toks = self.tokens(data, 1, self.t.max_len)
        r = self.valid("Prefill", lambda: self.t.stub.Prefill(pb.PrefillRequest(
            model_id=self.mid, input=pb.PrefillInput(token_ids=toks)), timeout=DEADLINE), fits=self.fits({None: len(toks)}))
        if r is not None:
            h = r.output.cache
            assert h.num_tokens == len(toks) and h.cache_id not in self.caches
            self.caches[h.cache_id] = len(toks)

    @precondition(lambda self: len(self.caches) < 10)
    @rule(data=st.data())
    def batch_prefill(self, data):
        rows = data.draw(st.integers(1, 8), label="rows")
        lens = [data.draw(st.integers(1, 48), label="len") for _ in range(rows)]
        inputs = [pb.PrefillInput(token_ids=[(i + j) % self.t.vocab for j in range(n)]) for i, n in enumerate(lens)]
        fits = self.fits({}, lens)
        r = self.valid("BatchPrefill", lambda: self.t.stub.BatchPrefill(pb.BatchPrefillRequest(
            model_id=self.mid, inputs=inputs), timeout=DEADLINE), fits=fits)
        if r is not None:
            assert [o.cache.num_tokens for o in r.outputs] == lens
            for o in r.outputs:
                self.caches[o.cache.cache_id] = o.cache.num_tokens

    @precondition(lambda self: self.caches)
    @rule(data=st.data())
    def decode(self, data):
        (cid,) = self.pick(data)
        if self.room(cid) < 1:
            return self.hostile("Decode past max length", lambda: self.t.stub.Decode(pb.DecodeRequest(
                model_id=self.mid, input=pb.DecodeInput(cache_id=cid, token_id=1)), timeout=DEADLINE),
                {C.INVALID_ARGUMENT, C.OUT_OF_RANGE})
        tok = data.draw(st.integers(0, self.t.vocab - 1), label="token")
        r = self.valid("Decode", lambda: self.t.stub.Decode(pb.DecodeRequest(
            model_id=self.mid, input=pb.DecodeInput(cache_id=cid, token_id=tok)), timeout=DEADLINE),
            fits=self.fits({cid: self.caches[cid] + 1}))
        if r is not None:
            assert r.output.cache.num_tokens == self.caches[cid] + 1
            self.caches[cid] += 1

    @precondition(lambda self: len(self.caches) >= 2)
    @rule(data=st.data())
    def batch_decode(self, data):
        k = data.draw(st.integers(2, len(self.caches)), label="k")
        cids = [c for c in self.pick(data, k) if self.room(c) >= 1]
        if not cids:
            return
        rows = lambda: self.t.stub.BatchDecode(pb.BatchDecodeRequest(  # noqa: E731
            model_id=self.mid, inputs=[pb.DecodeInput(cache_id=c, token_id=i % self.t.vocab) for i, c in enumerate(cids)]),
            timeout=DEADLINE)
        if self.t.max_rows and len(cids) > self.t.max_rows:  # past the declared rows per step: refused, nothing grows
            return self.hostile("BatchDecode past the rows per step", rows, {C.INVALID_ARGUMENT})
        new = {c: self.caches[c] + 1 for c in cids}
        r = self.valid("BatchDecode", rows, fits=self.fits(new))
        if r is not None:
            assert [o.cache.num_tokens for o in r.outputs] == [new[c] for c in cids]
            self.caches.update(new)

    @rule(data=st.data())
    def unified_decode(self, data):
        items, new, expect = [], {}, []
        for c in (self.pick(data, data.draw(st.integers(0, min(3, len(self.caches))), label="k")) if self.caches else []):
            q = self.tokens(data, 1, min(self.room(c), 16)) if self.room(c) >= 1 else []
            if not q:
                continue
            items.append(pb.UnifiedBatchItem(seq_id=c, q_tokens=q, cache_id=c, pos_offset=self.caches[c],
                                             is_final_chunk=True))
            new[c] = self.caches[c] + len(q)
            expect.append(new[c])
        fresh = []
        for i in range(data.draw(st.integers(0 if items else 1, 2), label="fresh")):
            q = self.tokens(data, 1, 64)
            items.append(pb.UnifiedBatchItem(seq_id=f"new{i}", q_tokens=q, is_final_chunk=data.draw(st.booleans())))
            fresh.append(len(q))
            expect.append(len(q))
        lengths = dict(new)
        fits = self.fits(lengths, fresh)
        if not self.t.unified:  # documented: UNIMPLEMENTED, nothing changes
            return self.hostile("UnifiedDecode unsupported", lambda: self.t.stub.UnifiedDecode(pb.UnifiedDecodeRequest(
                model_id=self.mid, items=items), timeout=DEADLINE), {C.UNIMPLEMENTED})
        r = self.valid("UnifiedDecode", lambda: self.t.stub.UnifiedDecode(pb.UnifiedDecodeRequest(
            model_id=self.mid, items=items), timeout=DEADLINE), fits=fits)
        if r is not None:
            assert [x.cache.num_tokens for x in r.results] == expect
            assert [x.HasField("output") for x in r.results] == [it.is_final_chunk for it in items]
            for x in r.results:
                self.caches[x.cache.cache_id] = x.cache.num_tokens

    @precondition(lambda self: self.caches)
    @rule(data=st.data())
    def forward_verify(self, data):
        (cid,) = self.pick(data)
        n1 = min(self.room(cid), data.draw(st.integers(1, 6), label="n+1"))
        if n1 < 1:
            return
        base = self.caches[cid]
        toks = [(base * 31 + i) % self.t.vocab for i in range(n1)]
        accept = data.draw(st.booleans(), label="accept")
        logits = tpb.LogitsPolicy(mode=tpb.OUTPUT_MODE_SAMPLED_TOKEN) if accept else None
        r = self.valid("ForwardVerify" + ("+accept" if accept else ""), lambda: self.t.stub.ForwardVerify(
            pb.ForwardVerifyRequest(model_id=self.mid, cache_id=cid, token_ids=toks, accept_greedy_prefix=accept,
                                    logits=logits), timeout=DEADLINE), fits=self.fits({cid: base + n1}))
        if r is not None:
            assert r.base_len == base and len(r.outputs) == n1
            want = base + 1 + r.accepted_drafts if accept else base + n1
            assert r.cache.num_tokens == want, (r.cache.num_tokens, want, r.accepted_drafts)
            if accept:
                assert 0 <= r.accepted_drafts <= n1 - 1 and len(r.accepted_tokens) == r.accepted_drafts + 1
            self.caches[cid] = want

    @precondition(lambda self: self.caches)
    @rule(data=st.data())
    def truncate(self, data):
        (cid,) = self.pick(data)
        new_len = data.draw(st.integers(0, self.caches[cid]), label="new_len")
        r = self.valid("TruncateKv", lambda: self.t.stub.TruncateKv(pb.TruncateKvRequest(
            model_id=self.mid, cache_id=cid, new_len=new_len), timeout=DEADLINE))
        assert r.cache.num_tokens == new_len and r.removed_tokens == self.caches[cid] - new_len
        self.caches[cid] = new_len

    @precondition(lambda self: self.caches and self.t.shares and len(self.caches) < 12)
    @rule(data=st.data())
    def fork(self, data):
        (cid,) = self.pick(data)
        n = self.caches[cid]
        if n == 0:
            return self.hostile("ForkCache of an empty cache", lambda: self.t.stub.ForkCache(pb.ForkCacheRequest(
                model_id=self.mid, cache_id=cid), timeout=DEADLINE), {C.OUT_OF_RANGE})
        keep = data.draw(st.integers(1, n), label="keep")
        r = self.valid("ForkCache", lambda: self.t.stub.ForkCache(pb.ForkCacheRequest(
            model_id=self.mid, cache_id=cid, keep_tokens=keep), timeout=DEADLINE))
        assert r.cache.num_tokens == keep and r.cache.cache_id not in self.caches
        assert r.shared_blocks == math.ceil(keep / self.t.block_size)
        self.caches[r.cache.cache_id] = keep

    @precondition(lambda self: self.caches)
    @rule(data=st.data())
    def release(self, data):
        (cid,) = self.pick(data)
        r = self.valid("ReleaseCache", lambda: self.t.stub.ReleaseCache(pb.ReleaseCacheRequest(
            model_id=self.mid, cache_id=cid), timeout=DEADLINE))
        assert r.released and r.freed_tokens == self.caches[cid]
        del self.caches[cid]
        self.reserved.pop(cid, None)

    @rule(data=st.data())
    def session(self, data):
        """A Session: a prefill on the stream, decodes on it and on a live cache, a verify, a
        truncate; the stream's own cache dies with it, the live cache keeps its growth."""
        S = pb.SessionRequest
        p = self.tokens(data, 1, 32)
        outer = self.pick(data)[0] if self.caches else None
        outer = outer if outer and self.room(outer) >= 2 else None
        ndec = data.draw(st.integers(1, 4), label="decodes")
        need = {None: len(p) + ndec}
        if outer:
            need[outer] = self.caches[outer] + 1
        fits = self.fits(need)
        steps = [S(step_id=1, prefill=pb.PrefillRequest(model_id=self.mid, input=pb.PrefillInput(token_ids=p)))]
        responses = []
        q: queue.Queue = queue.Queue()
        q.put(steps[0])
        call = self.t.stub.Session(iter(q.get, None), timeout=DEADLINE)
        try:
            first = next(call)
            responses.append(first)
            if first.WhichOneof("result") == "error":
                assert first.error.code == C.RESOURCE_EXHAUSTED.value[0] and not fits, first
                self.stats["Session:exhausted"] += 1
                q.put(None)
                list(call)
                return
            own = first.prefill.output.cache.cache_id
            assert first.prefill.output.cache.num_tokens == len(p)
            for i in range(ndec):
                q.put(S(step_id=2 + i, decode=pb.DecodeRequest(model_id=self.mid, input=pb.DecodeInput(
                    cache_id=own, token_id=i))))
            if outer:
                q.put(S(step_id=10, decode=pb.DecodeRequest(model_id=self.mid, input=pb.DecodeInput(
                    cache_id=outer, token_id=3))))
            q.put(S(step_id=11, truncate_kv=pb.TruncateKvRequest(model_id=self.mid, cache_id=own, new_len=1)))
            q.put(None)
            responses += list(call)
        except grpc.RpcError as e:
            raise AssertionError(f"Session ended {e.code().name}: {e.details()}") from None
        errs = [r for r in responses if r.WhichOneof("result") == "error"]
        if errs:
            assert not fits and all(r.error.code == C.RESOURCE_EXHAUSTED.value[0] for r in errs), errs
            self.stats["Session:exhausted"] += 1
            # which steps went through: account for the outer decode if it did
            for r in responses:
                if r.step_id == 10 and r.WhichOneof("result") == "decode":
                    self.caches[outer] += 1
            return
        assert [r.step_id for r in responses] == [1] + [2 + i for i in range(ndec)] + ([10] if outer else []) + [11]
        assert [r.decode.output.cache.num_tokens for r in responses[1:1 + ndec]] == [len(p) + i + 1 for i in range(ndec)]
        assert responses[-1].truncate_kv.cache.num_tokens == 1
        if outer:
            assert responses[-2].decode.output.cache.num_tokens == self.caches[outer] + 1
            self.caches[outer] += 1
        self.stats["Session"] += 1

    @rule(data=st.data())
    def generate(self, data):
        keep = data.draw(st.booleans(), label="keep")
        on_cache = self.caches and data.draw(st.booleans(), label="on_cache")
        max_tokens = data.draw(st.integers(1, 12), label="max_tokens")
        req = pb.GenerateRequest(model_id=self.mid, keep_cache=keep, stop=pb.StopConditions(max_tokens=max_tokens,
                                 ignore_eos=True), sampling=tpb.SamplingParams(temperature=0.0))
        if on_cache:
            cid = self.pick(data)[0]
            if self.room(cid) < max_tokens + 1:
                return
            req.cache_id = cid
            req.last_token_id = 1
            fits = self.fits({cid: self.caches[cid] + max_tokens})
        else:
            p = self.tokens(data, 1, min(64, self.t.max_len - max_tokens))
            req.token_ids.token_ids.extend(p)
            fits = self.fits({None: len(p) + max_tokens})
        try:
            events = list(self.t.stub.Generate(req, timeout=DEADLINE))
        except grpc.RpcError as e:
            assert e.code() not in BAD, f"Generate: {e.code().name} {e.details()}"
            assert e.code() == C.RESOURCE_EXHAUSTED and not fits, f"valid Generate refused: {e.code().name} {e.details()}"
            self.stats["Generate:exhausted"] += 1
            return
        fin = events[-1].finished
        assert events[-1].WhichOneof("event") == "finished", events[-1]
        assert fin.generated_tokens == max_tokens and fin.finish_reason == pb.FINISH_REASON_LENGTH, fin
        assert sum(e.WhichOneof("event") == "token" for e in events) == max_tokens
        started = events[0].started.cache
        if on_cache:
            assert started.cache_id == cid
            # the last sampled token is returned, not fed: the cache holds last_token + max_tokens-1 more
            assert fin.cache.cache_id == cid and fin.cache.num_tokens == self.caches[cid] + max_tokens, fin
            self.caches[cid] = fin.cache.num_tokens
            self.stats["Generate(cache_id)"] += 1
        elif keep:
            assert fin.cache.num_tokens == len(p) + max_tokens - 1, fin
            self.caches[fin.cache.cache_id] = fin.cache.num_tokens
            self.reserved[fin.cache.cache_id] = len(p) + max_tokens  # the stream's reservation stays with the cache
            self.stats["Generate(keep_cache)"] += 1
        self.stats["Generate"] += 1  # any completed stream; the two above count its variants too

    # ---- hostile steps ---------------------------------------------------------------------------
    @rule(data=st.data())
    def hostile_requests(self, data):
        kind = data.draw(st.sampled_from(["vocab", "released", "truncate", "too_long", "padded_batch", "forward",
                                          "long_text", "position", "verify_empty", "unified_offset",
                                          "fork_released", "fork_huge", "export_released", "export_range",
                                          "import_no_header", "import_cut", "adapter_admin", "adapter_unknown",
                                          "subscribe_unknown_model"]), label="hostile")
        s, m, I = self.t.stub, self.mid, {C.INVALID_ARGUMENT}
        cid = self.pick(data)[0] if self.caches else None
        if kind == "vocab" and cid:
            self.hostile("Decode token >= vocab", lambda: s.Decode(pb.DecodeRequest(model_id=m, input=pb.DecodeInput(
                cache_id=cid, token_id=self.t.vocab)), timeout=DEADLINE), I)
        elif kind == "released":
            self.hostile("Decode released cache", lambda: s.Decode(pb.DecodeRequest(model_id=m, input=pb.DecodeInput(
                cache_id=self.released_id(), token_id=1)), timeout=DEADLINE), {C.NOT_FOUND})
        elif kind == "truncate" and cid:
            self.hostile("TruncateKv past end", lambda: s.TruncateKv(pb.TruncateKvRequest(
                model_id=m, cache_id=cid, new_len=self.caches[cid] + 1), timeout=DEADLINE), {C.OUT_OF_RANGE})
        elif kind == "too_long":
            n = self.t.max_len + data.draw(st.integers(1, 64), label="over")
            self.hostile("Prefill past max length", lambda: s.Prefill(pb.PrefillRequest(model_id=m, input=pb.PrefillInput(
                token_ids=[1] * n)), timeout=DEADLINE), I)
        elif kind == "padded_batch":
            # one row at the model's length plus many one-token rows: refused (too much padding or
            # budget) or served; a success is a valid step and must be accounted.
            rows = data.draw(st.integers(2, 32), label="rows")
            inputs = [pb.PrefillInput(token_ids=[2] * self.t.max_len)] + [pb.PrefillInput(token_ids=[3])] * (rows - 1)
            try:
                r = s.BatchPrefill(pb.BatchPrefillRequest(model_id=m, inputs=inputs), timeout=DEADLINE)
            except grpc.RpcError as e:
                assert e.code() in {C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED}, f"padded batch: {e.code().name} {e.details()}"
                if e.code() == C.RESOURCE_EXHAUSTED:
                    self.stats["hostile:padded BatchPrefill exhausted"] += 1
                else:
                    self.stats["hostile:padded BatchPrefill refused"] += 1
                return
            self.stats["hostile:padded BatchPrefill served"] += 1
            for o in r.outputs:
                self.caches[o.cache.cache_id] = o.cache.num_tokens
        elif kind == "forward":
            rows = data.draw(st.sampled_from([1, 4, 64]), label="rows")
            cols = data.draw(st.sampled_from([1, 16, self.t.max_len, self.t.max_len * 4]), label="cols")
            tensor = tpb.Tensor(dtype=tpb.DATA_TYPE_INT32, shape=[rows, cols], data=b"\x01\x00\x00\x00" * (rows * cols))
            try:
                r = s.Forward(pb.ForwardRequest(model_id=m, input=tensor), timeout=DEADLINE)
                self.stats["hostile:Forward served"] += 1
                assert list(r.output.shape[:2]) == [rows, cols], r.output.shape
            except grpc.RpcError as e:
                assert e.code() not in BAD, f"Forward {rows}x{cols}: {e.code().name} {e.details()}"
                assert e.code() in {C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED, C.UNIMPLEMENTED}, e.details()
                self.stats["hostile:Forward refused"] += 1
        elif kind == "long_text":
            n = data.draw(st.sampled_from([1000, 100_000, 1_000_000]), label="chars")
            try:
                r = s.Tokenize(pb.TokenizeRequest(model_id=m, text="héllo wörld 日本 " * (n // 16)), timeout=DEADLINE)
                self.stats["hostile:Tokenize long text served"] += 1
            except grpc.RpcError as e:
                assert e.code() in {C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED, C.UNIMPLEMENTED, C.FAILED_PRECONDITION}, \
                    f"Tokenize {n} chars: {e.code().name} {e.details()}"
                self.stats["hostile:Tokenize long text refused"] += 1
        elif kind == "position" and cid:
            self.hostile("Decode wrong position", lambda: s.Decode(pb.DecodeRequest(model_id=m, input=pb.DecodeInput(
                cache_id=cid, token_id=1, position=self.caches[cid] + 5)), timeout=DEADLINE),
                {C.INVALID_ARGUMENT, C.FAILED_PRECONDITION, C.OUT_OF_RANGE})
        elif kind == "verify_empty" and cid:
            self.hostile("ForwardVerify no tokens", lambda: s.ForwardVerify(pb.ForwardVerifyRequest(
                model_id=m, cache_id=cid), timeout=DEADLINE), I)
        elif kind == "unified_offset" and cid:
            # A full cache (one more token passes the model's length) may be refused for its length first.
            codes = {C.FAILED_PRECONDITION} if self.t.unified else {C.UNIMPLEMENTED}
            if self.t.unified and self.t.max_len and self.caches[cid] + 1 > self.t.max_len:
                codes = codes | {C.INVALID_ARGUMENT}
            self.hostile("UnifiedDecode wrong pos_offset", lambda: s.UnifiedDecode(pb.UnifiedDecodeRequest(
                model_id=m, items=[pb.UnifiedBatchItem(seq_id="x", q_tokens=[1], cache_id=cid,
                                                       pos_offset=self.caches[cid] + 1, is_final_chunk=True)]),
                timeout=DEADLINE), codes)

        else:
            self.hostile_new_rpcs(kind, cid, data)

    def hostile_new_rpcs(self, kind: str, cid: str | None, data) -> None:
        """ForkCache, ExportKv, ImportKv, Load/UnloadAdapter and SubscribeKvEvents: unknown ids,
        huge numbers, cut or headerless streams, no admin rights (UNIMPLEMENTED where the executor
        has no such feature)."""
        s, m = self.t.stub, self.mid
        fork = set() if self.t.shares else {C.UNIMPLEMENTED}
        xfer = set() if self.t.transfers else {C.UNIMPLEMENTED}
        if kind == "fork_released":
            self.hostile("ForkCache of a released cache", lambda: s.ForkCache(pb.ForkCacheRequest(
                model_id=m, cache_id=self.released_id()), timeout=DEADLINE), {C.NOT_FOUND})
        elif kind == "fork_huge" and cid:
            big = data.draw(st.sampled_from([2**31, 2**63, 2**64 - 1]), label="big")
            keep = data.draw(st.booleans(), label="keep")
            req = (pb.ForkCacheRequest(model_id=m, cache_id=cid, keep_tokens=big) if keep
                   else pb.ForkCacheRequest(model_id=m, cache_id=cid, reserve_tokens=big))
            self.hostile("ForkCache huge " + ("keep_tokens" if keep else "reserve_tokens"),
                         lambda: s.ForkCache(req, timeout=DEADLINE),
                         fork | ({C.OUT_OF_RANGE} if keep else {C.INVALID_ARGUMENT}))  # checked before the feature
        elif kind == "export_released":
            self.hostile("ExportKv of a released cache", lambda: list(s.ExportKv(pb.ExportKvRequest(
                model_id=m, cache_id=self.released_id()), timeout=DEADLINE)), xfer or {C.NOT_FOUND})
        elif kind == "export_range" and cid:
            n = self.caches[cid]
            self.hostile("ExportKv past the end", lambda: list(s.ExportKv(pb.ExportKvRequest(
                model_id=m, cache_id=cid, from_token=n, to_token=2**64 - 1), timeout=DEADLINE)),
                xfer or {C.OUT_OF_RANGE})
        elif kind == "import_no_header":
            self.hostile("ImportKv without a header", lambda: s.ImportKv(iter([pb.ImportKvRequest(
                model_id=m, chunk=pb.KvChunk(layer=data.draw(st.integers(0, 2**32 - 1), label="layer")))]),
                timeout=DEADLINE), {C.INVALID_ARGUMENT} | xfer)
        elif kind == "import_cut" and cid and self.t.transfers and self.caches[cid] > 0:
            msgs = list(s.ExportKv(pb.ExportKvRequest(model_id=m, cache_id=cid), timeout=DEADLINE))
            keep = data.draw(st.integers(1, len(msgs) - 1), label="kept") if len(msgs) > 1 else 1
            reqs = [pb.ImportKvRequest(model_id=m, header=msgs[0].header)]
            reqs += [pb.ImportKvRequest(chunk=x.chunk) for x in msgs[1:keep]]
            self.hostile("ImportKv cut short", lambda: s.ImportKv(
                iter(reqs), timeout=DEADLINE), {C.DATA_LOSS, C.INVALID_ARGUMENT})
        elif kind == "adapter_admin":
            if data.draw(st.booleans(), label="load"):
                self.hostile("LoadAdapter without admin rights", lambda: s.LoadAdapter(pb.LoadAdapterRequest(
                    model_id=m, name="x", path="/"), timeout=DEADLINE), {C.PERMISSION_DENIED})
            else:
                self.hostile("UnloadAdapter without admin rights", lambda: s.UnloadAdapter(
                    pb.UnloadAdapterRequest(model_id=m, name="x"), timeout=DEADLINE), {C.PERMISSION_DENIED})
        elif kind == "adapter_unknown":
            self.hostile("Prefill with an unknown adapter", lambda: s.Prefill(pb.PrefillRequest(
                model_id=m, input=pb.PrefillInput(token_ids=[1, 2], adapter="no-such-adapter")), timeout=DEADLINE),
                {C.NOT_FOUND} if self.t.lora else {C.UNIMPLEMENTED})
        elif kind == "subscribe_unknown_model":
            self.hostile("SubscribeKvEvents of an unknown model", lambda: next(s.SubscribeKvEvents(
                pb.SubscribeKvEventsRequest(model_id=m + "-nope", include_block_events=True), timeout=DEADLINE)),
                {C.NOT_FOUND})

    @rule(data=st.data())
    def subscribe_replay(self, data):
        """SubscribeKvEvents with block events, replaying the last few events: every one arrives, in
        sequence order with no gap (no auth here: every event is visible), cache and block events alike."""
        seq = self.t.stub.Loads(pb.LoadsRequest(model_id=self.mid), timeout=DEADLINE).kv_event_seq
        if seq == 0:
            return
        back = data.draw(st.integers(0, 7), label="back")
        start = max(1, seq - back)
        call = self.t.stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(
            model_id=self.mid, from_seq=start, include_block_events=True), timeout=DEADLINE)
        got = []
        try:
            for msg in call:
                which = msg.WhichOneof("message")
                if which == "resync_required":  # only if the replay lost them meanwhile
                    assert msg.resync_required.requested_seq == start, msg
                    self.stats["SubscribeKvEvents:resync"] += 1
                    return
                got.append(msg.event.seq if which == "event" else msg.block_event.seq)
                if which == "block_event":
                    ev = msg.block_event
                    assert ev.WhichOneof("data") in ("stored", "removed", "cleared"), ev
                    if ev.HasField("stored"):
                        st_ = ev.stored
                        assert len(st_.token_ids) == st_.block_size * len(st_.block_hashes), ev
                        assert all(len(k) == 32 for k in st_.block_hashes)
                if len(got) == seq - start + 1:
                    break
        finally:
            call.cancel()
        assert got == list(range(start, seq + 1)), (got, start, seq)
        self.stats["SubscribeKvEvents"] += 1

    def released_id(self) -> str:
        r = self.t.stub.Prefill(pb.PrefillRequest(model_id=self.mid, input=pb.PrefillInput(token_ids=[1])), timeout=DEADLINE)
        cid = r.output.cache.cache_id
        assert self.t.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id=self.mid, cache_id=cid), timeout=DEADLINE).released
        return cid

    # ---- invariants ------------------------------------------------------------------------------
    @invariant()
    def registry_matches_the_model(self):
        assert self.t.registry() == self.caches

    @invariant()
    def running_sums_equal_a_recount(self):
        reg = self.t.executor.registry
        assert (reg.used_tokens, reg.used_tokens + reg.reserved_tokens) == reg.recount()
        prefix = getattr(self.t.executor, "prefix", None)
        if hasattr(prefix, "refs"):  # the paged pool: blocks held = the union of the block tables
            held: dict[int, int] = {}
            for e in reg.entries():
                for blk in e.payload.blocks:
                    held[blk] = held.get(blk, 0) + 1
            assert held == prefix.refs, "refcounts differ from the block tables"
            prefix.check()
        if llama.is_llama(self.t.executor):
            b = llama.assert_books(self.t.host)
            self.stats["peak sequence ids in use"] = max(self.stats["peak sequence ids in use"], b["seq_ids_in_use"])

    @invariant()
    def rss_bounded(self):
        grown = (self.t.proc.memory_info().rss - self.rss0) / 2**20
        self.stats["peak RSS growth MiB"] = max(self.stats["peak RSS growth MiB"], int(grown))
        assert grown < RSS_BOUND_MIB, f"server RSS grew {grown:.0f} MiB (bound {RSS_BOUND_MIB} MiB)"

    def teardown(self):
        for cid in list(self.caches):
            assert self.t.stub.ReleaseCache(pb.ReleaseCacheRequest(model_id=self.mid, cache_id=cid),
                                            timeout=DEADLINE).released
        assert self.t.registry() == {}
        if llama.is_llama(self.t.executor):
            llama.assert_books(self.t.host, idle=True)


def _run(machine_cls, examples: int, steps: int, required: set[str] = frozenset(), rounds: int = 3) -> None:
    """Run the machine; while a kind in ``required`` has not succeeded yet, another round with the
    next seed (at most ``rounds``). Seeds are fixed (0, 1, ...) unless FERRUM_FUZZ_RANDOM=1, so a run
    is reproducible and an edit of a rule does not silently reshuffle which kinds a run reaches."""
    for r in range(rounds):
        machine_cls._hypothesis_internal_use_seed = None if not DERANDOMIZE else r
        run_state_machine_as_test(machine_cls, settings=settings(
            max_examples=max(1, int(examples * SCALE)), stateful_step_count=max(2, int(steps * SCALE)),
            deadline=None, database=None, suppress_health_check=list(HealthCheck), print_blob=True,
            phases=[Phase.explicit, Phase.generate] + ([Phase.shrink] if os.environ.get("FERRUM_FUZZ_SHRINK") else [])))
        if not _missing(machine_cls.name, required):
            return


def _missing(name: str, required: set[str]) -> set[str]:
    return {k for k in required if not STATS[name][k]}


def _report(name: str, required: set[str]) -> None:
    s = STATS[name]
    print(f"\nstateful fuzz [{name}] successes: " + ", ".join(f"{k}={v}" for k, v in sorted(s.items())))
    missing = _missing(name, required)
    assert not missing, f"valid steps never succeeded on {name}: {missing} ({dict(s)})"


VALID_KINDS = {"Prefill", "BatchPrefill", "Decode", "BatchDecode", "ForwardVerify",
               "ForwardVerify+accept", "TruncateKv", "ReleaseCache", "Session", "Generate", "Generate(keep_cache)",
               "Generate(cache_id)"}
TINY_KINDS = VALID_KINDS | {"UnifiedDecode", "ForkCache"}
LLAMA_KINDS = VALID_KINDS | {"UnifiedDecode"}
MOCK_KINDS = VALID_KINDS | {"hostile:UnifiedDecode unsupported"}


def test_stateful_fuzz_tiny_real_model(tiny_llama_dir):  # noqa: F811
    """The tiny real Llama (paged KV, 1,024 positions, a 4,096-token budget: long prompts exhaust it)."""
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    ex = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=4096)
    with InProcessServer([ex], cache_ttl=0) as srv:
        ExecutorMachine.target = Target(srv, "tiny")
        ExecutorMachine.name = "tiny"
        _run(ExecutorMachine, examples=12, steps=25, required=TINY_KINDS)
    _report("tiny", TINY_KINDS)


def test_stateful_fuzz_llama_cpp():
    """SmolLM2 on the llama.cpp executor (1,024 KV cells = its longest sequence and its whole
    budget, 24 sequence ids: long prompts and wide batches exhaust it)."""
    ex = llama.executor("llama", n_ctx=1024, n_seq=24)
    with InProcessServer([ex], cache_ttl=0) as srv:
        ExecutorMachine.target = Target(srv, "llama")
        ExecutorMachine.name = "llama"
        _run(ExecutorMachine, examples=10, steps=25, required=LLAMA_KINDS)
        llama.assert_books(srv.models.get("llama"), idle=True)
    _report("llama", LLAMA_KINDS)


def test_stateful_fuzz_scripted_executor():
    """The scripted executor (4,096 positions, a 6,000-token budget)."""
    ex = ConfigurableModelExecutor.with_token_sequence(1000, [10, 20, 30], model_id="mock", kv_budget_tokens=6000)
    with InProcessServer([ex], cache_ttl=0) as srv:
        ExecutorMachine.target = Target(srv, "mock")
        ExecutorMachine.name = "mock"
        _run(ExecutorMachine, examples=15, steps=30, required=MOCK_KINDS)
    _report("mock", MOCK_KINDS)
