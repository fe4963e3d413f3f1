"""Live stream migration on the llama.cpp executor (the real SmolLM2 GGUF): its per-sequence state
travels as an opaque ``state_format``; a greedy and a seeded stream moved mid-decode give exactly
the tokens of unmoved runs, and B runs no prefill."""

from __future__ import annotations

import pytest

from ferrum_client import Client

from .support.servers import InProcessServer
from .support.llama import gguf as _gguf
from .test_migration import PEER, _run, _slow

pytest.importorskip("llama_cpp")
M = "smollm2"


def _llc(kv: str):
    from ferrum_service.executors.llama_cpp import LlamaCppExecutor
    return LlamaCppExecutor(_gguf(), model_id=M, threads=2, n_ctx=1024, n_seq=4, kv=kv)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 5}], ids=["greedy", "seeded"])
@pytest.mark.parametrize("kv", ["unified", "streams"])  # both KV layouts (issue 39)
def test_llama_cpp_moved_stream_equals_unmoved(sampling, kv):
    with InProcessServer([_llc(kv)], **PEER) as a, InProcessServer([_llc(kv)], **PEER) as b, \
            Client(a.target) as ca, Client(b.target) as cb:
        prompt = ca.tokenize(M, "Write a short story about a lighthouse keeper.")
        ref, _, _, _, _ = _run(ca, prompt, model=M, max_tokens=48, **sampling)
        _slow(a, model=M, gate=12)
        toks, idx, fin, res, stream = _run(ca, prompt, model=M, max_tokens=48, at=12,
                                           move=lambda: ca.migrate_streams(b.target), **sampling)
        assert res.migrated == 1 and stream.migrations == [b.target]
        assert toks == ref and idx == list(range(48))
        assert fin.generated_tokens == 48
        st = cb.status(M).metrics
        assert st.prefill_operations == 0 and st.decode_operations == 48 - 13  # moved at token 13
        assert a.live_caches() == {M: 0} and b.live_caches() == {M: 0}
