"""``AsyncClient`` against real servers on real ports: every method called, its results checked and
compared with the sync ``Client`` making the same calls; failures raised as ``FerrumRpcError`` with
the right code; the asyncio Session helper; and the parity of the two classes itself."""

from __future__ import annotations

import asyncio
import inspect
from contextlib import aclosing

import grpc
import numpy as np
import pytest

from ferrum_client import AsyncClient, AsyncSession, Client, FerrumRpcError, Session, messages as m, pb, tpb

from .conftest import SEQ, contract_executors
from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.servers import InProcessServer
from .support.waits import wait_no_live_caches

C = grpc.StatusCode


def _public(cls) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n))}


def _params(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


# ---- parity -------------------------------------------------------------------------------------
def test_async_client_has_every_method_of_client_as_a_coroutine_with_the_same_parameters():
    names = _public(Client)
    assert len(names) >= 32 and {"prefill", "generate", "session", "health", "wait_ready"} <= names
    for name in sorted(names):
        sync_fn, async_fn = getattr(Client, name), getattr(AsyncClient, name, None)
        assert async_fn is not None, f"AsyncClient lacks {name}"
        assert _params(async_fn) == _params(sync_fn), name
        assert async_fn.__doc__, f"AsyncClient.{name} has no docstring"
        if name == "session":
            assert inspect.signature(async_fn, eval_str=True).return_annotation is AsyncSession
        elif name in ("generate", "subscribe_kv_events", "export_kv"):
            assert inspect.isasyncgenfunction(async_fn), name
        else:
            assert inspect.iscoroutinefunction(async_fn), name
    for name in _public(Session):
        fn = getattr(AsyncSession, name, None)
        assert fn is not None, f"AsyncSession lacks {name}"
        assert _params(fn) == _params(getattr(Session, name)), name
        assert name == "cancel" or inspect.iscoroutinefunction(fn), name


# ---- every method, sync and async side by side --------------------------------------------------
class SyncDriver:
    """The scenario's calls on the sync ``Client`` (blocking is fine: the server has its own loop)."""

    def __init__(self, client: Client) -> None:
        self.c = client

    async def call(self, name, *args, **kw):
        return getattr(self.c, name)(*args, **kw)

    async def take(self, name, until, *args, **kw) -> list:
        stream, got = getattr(self.c, name)(*args, **kw), []
        for msg in stream:
            got.append(msg)
            if until is not None and until(msg):
                break
        stream.cancel()
        return got


class AsyncDriver:
    """The scenario's calls on ``AsyncClient``, noting which methods were used."""

    def __init__(self, client: AsyncClient) -> None:
        self.c = client
        self.called: set[str] = set()

    async def call(self, name, *args, **kw):
        self.called.add(name)
        pending = getattr(self.c, name)(*args, **kw)
        assert inspect.iscoroutine(pending), name
        return await pending

    async def take(self, name, until, *args, **kw) -> list:
        self.called.add(name)
        got = []
        async with aclosing(getattr(self.c, name)(*args, **kw)) as stream:
            async for msg in stream:
                got.append(msg)
                if until is not None and until(msg):
                    break
        return got


async def _error(d, name, *args, **kw) -> tuple:
    with pytest.raises(FerrumRpcError) as e:
        await d.call(name, *args, **kw)
    return name, e.value.code, e.value.kind, e.value.field


async def scenario(d) -> list:
    """Every method once on the contract executors; real values asserted, a record returned."""
    rec: list = []
    info = await d.call("info")
    assert [x.model_id for x in info.models] == ["mock", "eos", "perseq", "stub"]
    rec.append([(x.model_id, x.vocab_size) for x in info.models])
    # any RPC by name with a request built by hand: the same answer as its helper
    raw = await d.call("call", "Info", pb.InfoRequest(model_id="eos"), timeout=10)
    assert [x.model_id for x in raw.models] == ["eos"] and raw.models[0] == info.models[1]
    caps = await d.call("capabilities", "mock")
    assert caps.max_batch_size == 256 and caps.supports_generation
    rec.append(caps)
    p = (await d.call("prefill", "mock", [1, 2, 3], reserve_tokens=10, timeout=10)).output
    assert p.output.token_id == SEQ[0] and p.cache.num_tokens == 3
    cid = p.cache.cache_id
    kv = await d.call("kv_capacity", "mock")
    assert (kv.used_tokens, kv.reserved_tokens) == (3, 7)
    dec = (await d.call("decode", "mock", cid, 10, position=3)).output
    assert (dec.output.token_id, dec.cache.num_tokens) == (SEQ[0], 4)
    v = await d.call("forward_verify", "mock", cid, [dec.output.token_id, 5, 6])
    assert v.cache.num_tokens == 7 and [o.token_id for o in v.outputs] == [SEQ[1], SEQ[2], SEQ[0]]
    t = await d.call("truncate_kv", "mock", cid, 4)
    assert (t.removed_tokens, t.cache.num_tokens) == (3, 4)
    bp = (await d.call("batch_prefill", "mock", [[1], [2, 3]])).outputs
    assert [o.cache.num_tokens for o in bp] == [1, 2]
    bd = (await d.call("batch_decode", "mock", [(o.cache.cache_id, 7) for o in bp])).outputs
    assert [(o.output.token_id, o.cache.num_tokens) for o in bd] == [(SEQ[1], 2), (SEQ[2], 3)]
    rec.append((p.output.token_id, dec.output.token_id, [o.token_id for o in v.outputs],
                [o.output.token_id for o in bd]))
    st = (await d.call("status", "mock")).status
    assert (st.prefill_operations, st.active_caches) == (2, 3)  # a prefill and a batch prefill
    rec.append((st.prefill_operations, st.decode_operations, st.active_caches))
    loads = await d.call("loads")
    mock = next(x for x in loads.loads if x.model_id == "mock")
    assert (mock.active_caches, mock.resident_tokens) == (3, 4 + 2 + 3)
    snap = await d.call("list_caches", "mock")
    assert sorted(c.num_tokens for c in snap.caches) == [2, 3, 4] and snap.as_of_seq == loads.kv_event_seq
    events = await d.take("subscribe_kv_events", lambda msg: msg.event.seq >= loads.kv_event_seq, "mock",
                          from_seq=1, timeout=10)
    kinds = [(pb.KvEventKind.Name(x.event.kind), x.event.num_tokens) for x in events]
    assert kinds[0] == ("KV_EVENT_KIND_CREATED", 3) and events[-1].event.seq == loads.kv_event_seq
    rec.append(kinds)
    assert not (await d.call("reserve_kv_slots", "mock", [tpb.KvSlotRequest(cache_id=cid, target_len=5)])
                ).HasField("reservation")
    assert not (await d.call("admission_limits", "mock")).HasField("limits")
    assert not (await d.call("kv_slot_capacity", "mock")).HasField("snapshot")
    assert not (await d.call("cache_metrics", "mock")).HasField("metrics")
    assert not (await d.call("lora_metrics", "mock")).HasField("metrics")
    # LoRA adapters: the scripted executors serve none (listing is empty, loading is UNIMPLEMENTED)
    assert not (await d.call("list_adapters", "mock")).adapters
    rec.append([await _error(d, "load_adapter", "a1", "/no/such/adapter", "mock"),
                await _error(d, "unload_adapter", "a1", model_id="mock")])
    assert [x[1] for x in rec[-1]] == [C.UNIMPLEMENTED, C.UNIMPLEMENTED], rec[-1]
    assert (await d.call("abort", "mock", cache_id=bp[0].cache.cache_id)).released_cache
    assert not (await d.call("abort", "mock", cache_id=bp[0].cache.cache_id)).released_cache
    # ForkCache of an unknown cache: refused (NOT_FOUND, or UNIMPLEMENTED where the executor cannot fork)
    rec.append(await _error(d, "fork_cache", "mock", "no-such-cache", keep_tokens=1))
    assert rec[-1][1] in (C.NOT_FOUND, C.UNIMPLEMENTED), rec[-1]
    assert (await d.call("release_cache", "mock", cid)).released
    assert (await d.call("release_cache", "mock", bp[1].cache.cache_id)).released
    gen = await d.take("generate", None, "mock", token_ids=[1, 2], max_tokens=3)
    toks = [e.token.token_id for e in gen if e.WhichOneof("event") == "token"]
    assert gen[0].WhichOneof("event") == "started" and gen[-1].finished.generated_tokens == 3
    assert len(toks) == 3 and toks[0] == SEQ[0]
    rec.append(toks)
    assert list((await d.call("warmup", "mock")).model_ids) == ["mock"]
    rec.append([
        await _error(d, "decode", "mock", "no-such-cache", 1),
        await _error(d, "forward", "mock", np.array([[1, 2]])),
        await _error(d, "unified_decode", "mock", [m.unified_item([1])]),
        await _error(d, "tokenize", "mock", "hi"),
        await _error(d, "detokenize", "mock", [1]),
        await _error(d, "apply_chat_template", "mock", [("user", "hi")]),
        await _error(d, "health", "nope"),
    ])
    assert [x[1] for x in rec[-1]] == [C.NOT_FOUND, C.UNIMPLEMENTED, C.UNIMPLEMENTED, C.FAILED_PRECONDITION,
                                      C.FAILED_PRECONDITION, C.FAILED_PRECONDITION, C.NOT_FOUND]
    assert rec[-1][1][2] == "UNSUPPORTED" and rec[-1][3][3] == "model_id"
    # KV handoff: the scripted executors cannot export or import (UNIMPLEMENTED); an empty import
    # stream is INVALID_ARGUMENT
    rec.append([await _error(d, "pull_kv", "mock", "127.0.0.1:1", "no-such-cache"),
                await _error(d, "import_kv", "mock", [])])
    with pytest.raises(FerrumRpcError) as e:
        await d.take("export_kv", None, "mock", "no-such-cache")
    rec[-1].append(e.value.code)
    assert [x[1] for x in rec[-1][:2]] + rec[-1][2:] == [C.UNIMPLEMENTED, C.INVALID_ARGUMENT, C.UNIMPLEMENTED]
    rec.append(await _error(d, "migrate_streams", "127.0.0.1:1"))  # no KV peers: nowhere to move to
    assert rec[-1][1] == C.PERMISSION_DENIED
    assert await d.call("wait_ready", timeout=5) is None
    assert await d.call("health") == "SERVING" and await d.call("health", "stub") == "SERVING"
    sd = await d.call("shutdown", "stub")
    assert list(sd.model_ids) == ["stub"] and sd.released_caches == 0
    assert await d.call("health", "stub") == "NOT_SERVING"
    assert (await d.call("status", "stub")).status.state == tpb.EXECUTOR_STATE_SHUTDOWN
    rec.append(await _error(d, "prefill", "stub", [1]))
    assert rec[-1][1] == C.UNAVAILABLE
    return rec


def test_every_async_method_gives_what_the_sync_client_gives():
    with InProcessServer(contract_executors(), open_admin_rpcs=True) as a, \
            InProcessServer(contract_executors(), open_admin_rpcs=True) as b:
        with Client(a.target) as c:
            sync_rec = asyncio.run(scenario(SyncDriver(c)))

        async def run_async():
            async with AsyncClient(b.target) as ac:
                d = AsyncDriver(ac)
                return await scenario(d), d.called

        async_rec, called = asyncio.run(run_async())
    assert async_rec == sync_rec
    # every method but session (below) and close (async with) was used
    assert called == _public(Client) - {"session", "close"}


# ---- streams: abort and early exit -------------------------------------------------------------
def _wait_no_caches(srv, model: str) -> int:
    return wait_no_live_caches(srv, timeout=5)[model]


def test_async_generate_abort_by_request_id_and_early_exit_cancels(fresh_server):
    async def run():
        async with AsyncClient(fresh_server.target) as ac:
            gen = ac.generate("mock", token_ids=[1], max_tokens=4000, request_id="req-a")
            assert (await anext(gen)).WhichOneof("event") == "started"
            assert (await ac.abort("mock", request_id="req-a")).aborted_streams == 1
            with pytest.raises(FerrumRpcError) as e:
                async for _ in gen:
                    pass
            assert e.value.code == C.CANCELLED
            n = 0
            async for ev in ac.generate("mock", token_ids=[1], max_tokens=4000):
                n += ev.WhichOneof("event") == "token"
                if n == 3:
                    break
            return n

    assert asyncio.run(run()) == 3
    assert _wait_no_caches(fresh_server, "mock") == 0


# ---- Session ------------------------------------------------------------------------------------
def _steps(cid: str = "", tok: int = 0) -> dict:
    return {
        "prefill": pb.PrefillRequest(model_id="perseq", input=m.prefill_input([1, 2])),
        "decode": pb.DecodeRequest(model_id="perseq", input=m.decode_input(cid, tok)),
        "missing": pb.DecodeRequest(model_id="perseq", input=m.decode_input("no-such-cache", 1)),
        "truncate": pb.TruncateKvRequest(model_id="perseq", cache_id=cid, new_len=3),
    }


def _sync_session(c: Client) -> list:
    with c.session() as s:
        p = s.step(_steps()["prefill"]).output
        st = _steps(p.cache.cache_id, p.output.token_id)
        d1 = s.step(st["decode"]).output
        with pytest.raises(FerrumRpcError) as e:
            s.step(st["missing"])
        ids = [s.send(st["decode"]), s.send(st["decode"])]
        pipelined = [s.receive().output, s.receive().output]
        t = s.step(st["truncate"])
        return [p.output.token_id, (d1.output.token_id, d1.cache.num_tokens), e.value.code, ids,
                [(x.output.token_id, x.cache.num_tokens) for x in pipelined], t.removed_tokens]


async def _async_session(ac: AsyncClient) -> list:
    async with ac.session() as s:
        p = (await s.step(_steps()["prefill"])).output
        st = _steps(p.cache.cache_id, p.output.token_id)
        d1 = (await s.step(st["decode"])).output
        with pytest.raises(FerrumRpcError) as e:
            await s.step(st["missing"])
        ids = [await s.send(st["decode"]), await s.send(st["decode"])]
        pipelined = [(await s.receive()).output, (await s.receive()).output]
        t = await s.step(st["truncate"])
        return [p.output.token_id, (d1.output.token_id, d1.cache.num_tokens), e.value.code, ids,
                [(x.output.token_id, x.cache.num_tokens) for x in pipelined], t.removed_tokens]


def test_async_session_steps_like_the_sync_session_and_frees_its_caches(fresh_server, client):
    want = _sync_session(client)
    assert _wait_no_caches(fresh_server, "perseq") == 0

    async def run():
        async with AsyncClient(fresh_server.target) as ac:
            got = await _async_session(ac)
            # the raw call's API still works on the helper (code that writes envelopes itself)
            call = ac.session()
            assert isinstance(call, AsyncSession)
            await call.write(pb.SessionRequest(step_id=7, prefill=_steps()["prefill"]))
            r = await call.read()
            await call.done_writing()
            with pytest.raises(EOFError):
                await call.receive()
            return got, r, await call.code()

    got, raw, code = asyncio.run(run())
    assert got == want
    assert want[0] == SEQ[0] and want[2] == C.NOT_FOUND and want[3] == [4, 5]
    assert want[1][1] == 3 and [n for _, n in want[4]] == [4, 5] and want[5] == 2
    assert raw.step_id == 7 and raw.prefill.output.cache.num_tokens == 2 and code == C.OK
    assert _wait_no_caches(fresh_server, "perseq") == 0


# ---- a real model: steps, tokenizer, forward, unified decode -------------------------------------
def test_async_steps_on_a_tiny_model_match_the_sync_client(tiny_llama_dir):  # noqa: F811
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    lm = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=4096)
    prompt = [5, 17, 42]

    def sync_run(c: Client) -> dict:
        p = c.prefill("tiny", prompt, policy=m.full_logits()).output
        tok = int(np.argmax(m.logits_array(p.output)))
        fork = c.fork_cache("tiny", p.cache.cache_id, keep_tokens=3)
        d = c.decode("tiny", p.cache.cache_id, tok, policy=m.full_logits()).output
        fd = c.decode("tiny", fork.cache.cache_id, tok, policy=m.full_logits()).output
        u = c.unified_decode("tiny", [m.unified_item([7], cache_id=p.cache.cache_id, pos_offset=4)]).results[0]
        c.release_cache("tiny", p.cache.cache_id)
        c.release_cache("tiny", fork.cache.cache_id)
        b = c.prefill("tiny", prompt, cache_salt="t", bypass_prefix_cache=True).output
        c.release_cache("tiny", b.cache.cache_id)
        n2 = [(ev.token.sample_index, ev.token.token_id) for ev in c.generate(
            "tiny", token_ids=prompt, max_tokens=3, ignore_eos=True, n=2, temperature=0.9, seed=3)
            if ev.WhichOneof("event") == "token"]
        return {"prefill": m.logits_array(p.output), "tok": tok, "decode": m.logits_array(d.output),
                "fork": (fork.cache.num_tokens, m.logits_array(fd.output)), "bypass": (b.cached_tokens, b.output.token_id),
                "n2": sorted(n2),
                "unified": (u.output.token_id, u.cache.num_tokens),
                "forward": m.tensor_array(c.forward("tiny", np.array([prompt + [tok]])).output),
                "tokens": c.tokenize("tiny", "hello world"), "text": c.detokenize("tiny", [5, 17, 42]),
                "chat": c.apply_chat_template("tiny", [("user", "hi")]),
                "generate": c.generate("tiny", token_ids=prompt, max_tokens=5, ignore_eos=True).tokens()}

    async def async_run(ac: AsyncClient) -> dict:
        p = (await ac.prefill("tiny", prompt, policy=m.full_logits())).output
        tok = int(np.argmax(m.logits_array(p.output)))
        fork = await ac.fork_cache("tiny", p.cache.cache_id, keep_tokens=3)
        d = (await ac.decode("tiny", p.cache.cache_id, tok, policy=m.full_logits())).output
        fd = (await ac.decode("tiny", fork.cache.cache_id, tok, policy=m.full_logits())).output
        u = (await ac.unified_decode("tiny", [m.unified_item([7], cache_id=p.cache.cache_id, pos_offset=4)])
             ).results[0]
        await ac.release_cache("tiny", p.cache.cache_id)
        await ac.release_cache("tiny", fork.cache.cache_id)
        b = (await ac.prefill("tiny", prompt, cache_salt="t", bypass_prefix_cache=True)).output
        await ac.release_cache("tiny", b.cache.cache_id)
        n2 = [(ev.token.sample_index, ev.token.token_id) async for ev in ac.generate(
            "tiny", token_ids=prompt, max_tokens=3, ignore_eos=True, n=2, temperature=0.9, seed=3)
            if ev.WhichOneof("event") == "token"]
        return {"prefill": m.logits_array(p.output), "tok": tok, "decode": m.logits_array(d.output),
                "fork": (fork.cache.num_tokens, m.logits_array(fd.output)), "bypass": (b.cached_tokens, b.output.token_id),
                "n2": sorted(n2),
                "unified": (u.output.token_id, u.cache.num_tokens),
                "forward": m.tensor_array((await ac.forward("tiny", np.array([prompt + [tok]]))).output),
                "tokens": await ac.tokenize("tiny", "hello world"),
                "text": await ac.detokenize("tiny", [5, 17, 42]),
                "chat": await ac.apply_chat_template("tiny", [("user", "hi")]),
                "generate": [ev.token.token_id async for ev in ac.generate("tiny", token_ids=prompt, max_tokens=5,
                                                                           ignore_eos=True)
                             if ev.WhichOneof("event") == "token"]}

    async def in_session(target: str) -> dict:
        async with AsyncClient(target) as ac:
            return await async_run(ac)

    with InProcessServer([lm]) as srv, Client(srv.target) as c:
        want = sync_run(c)
        got = asyncio.run(in_session(srv.target))
        assert _wait_no_caches(srv, "tiny") == 0
    # real results: the cached steps agree with a cache-less forward over the same tokens
    assert np.abs(got["forward"][0, -2] - got["prefill"]).max() < 1e-4
    assert np.abs(got["forward"][0, -1] - got["decode"]).max() < 1e-4
    assert got["unified"][1] == 5 and got["tokens"] and got["chat"].text and len(got["generate"]) == 5
    assert got["generate"][0] == got["tok"]
    for key in ("prefill", "decode", "forward"):
        assert np.abs(got[key] - want[key]).max() < 1e-5, key
    # a fork of the prompt decodes exactly like the prompt's own cache; n=2 gives 3 tokens per sample
    assert got["fork"][0] == 3 and np.abs(got["fork"][1] - got["decode"]).max() < 1e-4
    assert np.abs(got["fork"][1] - want["fork"][1]).max() < 1e-5
    assert got["bypass"] == (0, got["tok"]) and [i for i, _ in got["n2"]] == [0, 0, 0, 1, 1, 1]
    for key in ("tok", "unified", "tokens", "text", "chat", "generate", "bypass", "n2"):
        assert got[key] == want[key], key
