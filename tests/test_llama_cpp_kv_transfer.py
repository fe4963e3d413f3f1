"""KV handoff on the llama.cpp executor: llama.cpp's per-sequence state (``llama_state_seq_get_data``
/ ``set_data``) travels as an opaque ``state_format`` in checksummed chunks; prefill on A, pull on
B, decode on B continues as on A."""

from __future__ import annotations

import random

import grpc
import pytest

from ferrum_client import Client, messages as m, pb

from .support.servers import InProcessServer
from .support.packaged import smollm2_gguf_path
from .support.waits import wait_for

pytest.importorskip("llama_cpp")

M = "smollm2"


#: Both KV layouts (issue 39): one unified buffer, and one stream per sequence (``kv=streams``).
LAYOUTS = ["unified", "streams"]


def _llc(n_ctx: int = 1024, n_seq: int = 4, kv: str = "unified"):
    from ferrum_service.executors.llama_cpp import LlamaCppExecutor

    return LlamaCppExecutor(smollm2_gguf_path(), model_id=M, threads=2, n_ctx=n_ctx, n_seq=n_seq, kv=kv)


def _empty(ex) -> None:
    assert len(ex.registry) == 0 and ex.live_sequences() == 0 and ex.kv_cells_used() == 0


@pytest.mark.parametrize("kv", LAYOUTS)
def test_llama_cpp_handoff_pull_and_push(kv):
    a, b = _llc(kv=kv), _llc(kv=kv)
    rng = random.Random(0)
    p = [rng.randrange(100, 20000) for _ in range(40)]
    with InProcessServer([a]) as sa, InProcessServer([b], kv_peers=[sa.target]) as sb, Client(sa.target) as ca, \
            Client(sb.target) as cb:
        assert cb.capabilities(M).supports_kv_transfer
        ref = ca.prefill(M, p, policy=m.greedy()).output
        ref_toks, tok = [], ref.output.token_id
        for _ in range(6):
            tok = ca.decode(M, ref.cache.cache_id, tok).output.output.token_id
            ref_toks.append(tok)
        src = ca.prefill(M, p, policy=m.greedy()).output
        msgs = list(ca.export_kv(M, src.cache.cache_id, max_chunk_bytes=64 * 1024))
        h = msgs[0].header
        assert h.state_format == "llama.cpp/seq-state" and list(h.token_ids) == p and len(msgs) > 2
        assert h.total_bytes == sum(len(x.chunk.key) for x in msgs[1:])
        # a corrupted chunk is DATA_LOSS and leaves nothing
        bad = [pb.ExportKvResponse() for _ in msgs]
        for x, y in zip(bad, msgs):
            x.CopyFrom(y)
        bad[2].chunk.key = bytes([bad[2].chunk.key[0] ^ 1]) + bad[2].chunk.key[1:]
        with pytest.raises(Exception) as e:
            cb.import_kv(M, bad)
        assert "DATA_LOSS" in str(e.value)
        _empty(b)
        # a partial range is refused: llama.cpp's state is the whole sequence
        with pytest.raises(grpc.RpcError) as e:
            list(ca.stub.ExportKv(pb.ExportKvRequest(model_id=M, cache_id=src.cache.cache_id, to_token=20)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        for mode in ("pull", "push"):
            if mode == "pull":
                r = cb.pull_kv(M, sa.target, src.cache.cache_id, reserve_tokens=len(p) + 8)
            else:
                r = cb.import_kv(M, msgs, reserve_tokens=len(p) + 8)
            assert r.cache.num_tokens == len(p)
            toks, tok = [], src.output.token_id
            for _ in range(6):
                tok = cb.decode(M, r.cache.cache_id, tok).output.output.token_id
                toks.append(tok)
            assert toks == ref_toks
            cb.release_cache(M, r.cache.cache_id)
        # another executor kind (the tensor format) is refused
        h2 = pb.ImportKvRequest(model_id=M, header=h)
        h2.header.state_format = ""
        with pytest.raises(grpc.RpcError) as e:
            cb.stub.ImportKv(iter([h2]))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        ca.release_cache(M, src.cache.cache_id)
        ca.release_cache(M, ref.cache.cache_id)
    _empty(a)
    _empty(b)


def test_llama_cpp_import_refused_when_full():
    a, b = _llc(), _llc(n_ctx=256, n_seq=2)
    p = list(range(100, 400))
    with InProcessServer([a]) as sa, InProcessServer([b], kv_peers=[sa.target]) as sb, Client(sa.target) as ca, \
            Client(sb.target) as cb:
        filler = cb.prefill(M, p[:200], policy=m.greedy()).output  # 200 of B's 256 cells
        src = ca.prefill(M, p[:100], policy=m.greedy()).output
        with pytest.raises(Exception) as e:
            cb.pull_kv(M, sa.target, src.cache.cache_id)
        assert "RESOURCE_EXHAUSTED" in str(e.value)
        assert len(b.registry) == 1 and b.live_sequences() == 1
        cb.release_cache(M, filler.cache.cache_id)
        _empty(b)
        ca.release_cache(M, src.cache.cache_id)
    _empty(a)


@pytest.mark.parametrize("kv", LAYOUTS)
def test_llama_cpp_vllm_pd_handoff(kv):
    """SMG's two PD legs (vLLM engine protocol) on llama.cpp, which exports whole caches only: the
    prefill keeps the prompt's state cut to all but its last token, the decode worker pulls it
    whole and answers what a worker computing the prompt answers."""
    import json

    from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc

    rng = random.Random(1)
    p = [rng.randrange(100, 20000) for _ in range(40)]

    def req(**kw):
        params = kw.pop("params", None)
        r = vpb.GenerateRequest(request_id="pd", tokenized=vpb.TokenizedInput(input_ids=p),
                                sampling_params=vpb.SamplingParams(temperature=0.0, ignore_eos=True, **kw))
        if params:
            r.kv_transfer_params_json = params
        return r

    a, b = _llc(kv=kv), _llc(kv=kv)
    with InProcessServer([a], role="prefill") as sa, InProcessServer([b], role="decode", kv_peers=[sa.target]) as sb, \
            grpc.insecure_channel(sa.target) as cha, grpc.insecure_channel(sb.target) as chb:
        ea, eb = vllm_engine_pb2_grpc.VllmEngineStub(cha), vllm_engine_pb2_grpc.VllmEngineStub(chb)
        want = list(list(eb.Generate(req(max_tokens=5), timeout=120))[-1].complete.output_ids)  # computed on b
        params = list(ea.Generate(req(max_tokens=1, n=1), timeout=120))[-1].complete.kv_transfer_params_json
        assert json.loads(params)["ferrum_kv"]["num_tokens"] == len(p)
        c = list(eb.Generate(req(max_tokens=5, params=params), timeout=120))[-1].complete
        assert c.cached_tokens == len(p) - 1 and list(c.output_ids) == want
        for ex in (a, b):
            # the worker frees a released cache's sequence after the registry drops it (with
            # kv=streams it also moves a retired sequence up: a state copy): wait for all three
            wait_for(lambda ex=ex: (len(ex.registry), ex.live_sequences(), ex.kv_cells_used()),
                     lambda t: t == (0, 0, 0), 20, 0.05)
            _empty(ex)
