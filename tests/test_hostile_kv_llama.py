"""Hostile KV imports on the llama.cpp executor (issue 27: F5, F9, F1): state bytes bounded as they
arrive, imported sequences keyed under the import's salt, pushed K/V kept in the importer's own key
space. Real servers, the packaged SmolLM2 GGUF."""

from __future__ import annotations

import zlib

import grpc
import pytest

from ferrum_client import Client, messages as m, pb

from .support.prompts import prompt_ids
from .support.servers import InProcessServer
from .support.packaged import smollm2_gguf_path

pytest.importorskip("llama_cpp")

M = "smollm2"
ALICE, BOB = "tok-alice", "tok-bob"


def _llc(n_ctx: int = 1024, n_seq: int = 4):
    from ferrum_service.executors.llama_cpp import LlamaCppExecutor

    return LlamaCppExecutor(smollm2_gguf_path(), model_id=M, threads=2, n_ctx=n_ctx, n_seq=n_seq)


def _empty(ex) -> None:
    assert len(ex.registry) == 0 and ex.registry.staged_imports == 0 and ex.registry.staged_tokens == 0


def test_state_bytes_beyond_the_header_or_the_tokens_are_refused_at_once():
    a, b = _llc(), _llc()
    p = prompt_ids(40, lo=100, hi=20000)
    with InProcessServer([a]) as sa, InProcessServer([b]) as sb, Client(sa.target) as ca, Client(sb.target) as cb:
        src = ca.prefill(M, p, policy=m.greedy()).output
        msgs = list(ca.export_kv(M, src.cache.cache_id, max_chunk_bytes=64 * 1024))
        h = msgs[0].header
        # a header claiming more bytes than 40 tokens' state can hold: refused before any chunk
        big = pb.ImportKvRequest(model_id=M, header=h)
        big.header.total_bytes = 1 << 40
        with pytest.raises(grpc.RpcError) as e:
            cb.stub.ImportKv(iter([big]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "total_bytes" in e.value.details()
        # no total given: an endless stream is refused once past what the tokens can need
        sent = [0]

        def endless(first):
            yield first
            piece = bytes(64 * 1024)
            for i in range(300):  # 19 MiB; 40 tokens of SmolLM2 state are under 1 MiB
                sent[0] += 1
                yield pb.ImportKvRequest(chunk=pb.KvChunk(index=i, key=piece, checksum=zlib.crc32(piece)))

        open_ended = pb.ImportKvRequest(model_id=M, header=h)
        open_ended.header.total_bytes = 0
        open_ended.header.num_chunks = 0
        with pytest.raises(grpc.RpcError) as e:
            cb.stub.ImportKv(endless(open_ended))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert sent[0] < 100  # refused as the bytes arrived, not at the end of the stream
        # one chunk more than the header's total: refused at that chunk (not DATA_LOSS at the end)
        extra = [pb.ImportKvRequest(model_id=M, header=h)] + [pb.ImportKvRequest(chunk=x.chunk) for x in msgs[1:]]
        extra.append(pb.ImportKvRequest(chunk=pb.KvChunk(index=len(msgs) - 1, key=b"x", checksum=zlib.crc32(b"x"))))
        with pytest.raises(grpc.RpcError) as e:
            cb.stub.ImportKv(iter(extra))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "total_bytes" in e.value.details()
        _empty(b)
        ca.release_cache(M, src.cache.cache_id)
    _empty(a)


def test_imported_sequence_is_keyed_under_its_salt():
    a, b = _llc(), _llc()
    p = prompt_ids(40, 1, lo=100, hi=20000)
    with InProcessServer([a]) as sa, InProcessServer([b]) as sb, Client(sa.target) as ca, Client(sb.target) as cb:
        src = ca.prefill(M, p, policy=m.greedy(), cache_salt="tenant-secret").output
        r = cb.import_kv(M, list(ca.export_kv(M, src.cache.cache_id)), reserve_tokens=48,
                         cache_salt="tenant-secret")
        cb.decode(M, r.cache.cache_id, src.output.token_id)  # llama.cpp keys a sequence at its next step
        cb.release_cache(M, r.cache.cache_id)
        plain = cb.prefill(M, p, policy=m.greedy()).output
        assert plain.cached_tokens == 0
        cb.release_cache(M, plain.cache.cache_id)
        salted = cb.prefill(M, p, policy=m.greedy(), cache_salt="tenant-secret").output
        assert salted.cached_tokens == 32
        cb.release_cache(M, salted.cache.cache_id)
        ca.release_cache(M, src.cache.cache_id)
    _empty(a)
    _empty(b)


def test_pushed_state_stays_in_the_importers_key_space():
    a, ex = _llc(), _llc()
    p = prompt_ids(40, 2, lo=100, hi=20000)
    with InProcessServer([a]) as sa, InProcessServer([ex], auth_tokens=[ALICE, BOB]) as s, Client(sa.target) as ca, \
            Client(s.target, token=ALICE) as alice, Client(s.target, token=BOB) as bob:
        src = ca.prefill(M, p, policy=m.greedy()).output
        msgs = list(ca.export_kv(M, src.cache.cache_id))
        ca.release_cache(M, src.cache.cache_id)
        for salt in ("", "shared:team"):
            r = alice.import_kv(M, msgs, reserve_tokens=48, cache_salt=salt)
            alice.decode(M, r.cache.cache_id, src.output.token_id)  # keyed at its next step
            alice.release_cache(M, r.cache.cache_id)
        for bob_salt in ("", "shared:team"):
            got = bob.prefill(M, p, policy=m.greedy(), cache_salt=bob_salt).output
            assert got.cached_tokens == 0, bob_salt
            bob.release_cache(M, got.cache.cache_id)
        mine = alice.prefill(M, p, policy=m.greedy()).output
        assert mine.cached_tokens == 32  # the importer's own default space holds them
        alice.release_cache(M, mine.cache.cache_id)
    _empty(a)
    _empty(ex)
