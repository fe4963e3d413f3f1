"""ferrum's ConfigurableModelExecutor semantics, through every path of the live server."""

from __future__ import annotations

import grpc
import pytest

from ferrum_client import FerrumRpcError, messages as m, pb

from .conftest import SEQ


def expected_stream(n: int, seq=SEQ) -> list[int]:
    """ferrum: prefill emits seq[0], then decode k biases seq[k % len] (counter shared)."""
    return [seq[0]] + [seq[k % len(seq)] for k in range(n - 1)]


def test_decode_follows_ferrum_sequence(client):
    p = client.prefill("mock", [1, 2, 3]).output
    assert p.output.token_id == SEQ[0]
    assert p.cache.num_tokens == 3
    toks, cid = [p.output.token_id], p.cache.cache_id
    for i in range(6):
        d = client.decode("mock", cid, toks[-1]).output
        toks.append(d.output.token_id)
        assert d.cache.num_tokens == 4 + i
    assert toks == expected_stream(7)  # [10, 10, 20, 30, 10, 20, 30]


def test_counter_is_shared_by_all_sequences(client):
    a = client.prefill("mock", [1]).output.cache.cache_id
    b = client.prefill("mock", [2]).output.cache.cache_id
    got = [client.decode("mock", cid, 5).output.output.token_id for cid in (a, b, a, b)]
    assert got == [10, 20, 30, 10]


def test_batch_decode_advances_counter_per_input(client):
    caches = [client.prefill("mock", [i]).output.cache.cache_id for i in range(1, 4)]
    out = client.batch_decode("mock", [(c, 7) for c in caches]).outputs
    assert [o.output.token_id for o in out] == [10, 20, 30]
    assert [o.cache.num_tokens for o in out] == [2, 2, 2]
    assert [o.cache.cache_id for o in out] == caches


def test_generate_matches_ferrum_stream(client):
    events = list(client.generate("mock", token_ids=[1, 2], max_tokens=6))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds == ["started"] + ["token"] * 6 + ["finished"]
    assert [e.token.token_id for e in events[1:-1]] == expected_stream(6)  # ferrum: [a,a,b,c,a,b]
    fin = events[-1].finished
    assert fin.finish_reason == pb.FINISH_REASON_LENGTH and fin.generated_tokens == 6


def test_eos_after_n_steps(client):
    # with_eos_after(V, 3, 2): 42 from prefill, 42 x 3, then EOS (2); Generate stops on it.
    toks = client.generate("eos", token_ids=[1], max_tokens=20).tokens()
    assert toks == [42, 42, 42, 42, 2]
    # ignore_eos keeps going: EOS forever after (counter continues from 4).
    more = client.generate("eos", token_ids=[1], max_tokens=4, ignore_eos=True).tokens()
    assert more == [42, 2, 2, 2]


def test_session_matches_ferrum_stream(client):
    with client.session() as s:
        r = s.step(pb.PrefillRequest(model_id="mock", input=m.prefill_input([4, 5, 6])))
        cid, toks = r.output.cache.cache_id, [r.output.output.token_id]
        for _ in range(4):
            d = s.step(pb.DecodeRequest(model_id="mock", input=m.decode_input(cid, toks[-1])))
            toks.append(d.output.output.token_id)
        bd = s.step(pb.BatchDecodeRequest(model_id="mock", inputs=[m.decode_input(cid, toks[-1])]))
        toks.append(bd.outputs[0].output.token_id)
    assert toks == expected_stream(6)


def test_session_pipelined_steps_answer_in_order(client):
    with client.session() as s:
        r = s.step(pb.PrefillRequest(model_id="mock", input=m.prefill_input([1])))
        a = r.output.cache.cache_id
        b = s.step(pb.PrefillRequest(model_id="mock", input=m.prefill_input([2]))).output.cache.cache_id
        ids = [s.send(pb.DecodeRequest(model_id="mock", input=m.decode_input(c, 1))) for c in (a, b, a)]
        outs = [s.receive() for _ in ids]
    assert [o.output.output.token_id for o in outs] == [10, 20, 30]
    assert [o.output.cache.cache_id for o in outs] == [a, b, a]


def test_truncate_then_decode_continues_from_truncated_position(client):
    # per-sequence counter: the script position is the cache's decoded length, so truncation
    # rewinds it: decoding after truncate(n) repeats what was decoded at position n.
    p = client.prefill("perseq", [1, 2]).output
    cid, toks = p.cache.cache_id, [p.output.token_id]
    for _ in range(5):
        toks.append(client.decode("perseq", cid, toks[-1]).output.output.token_id)
    assert toks == expected_stream(6)
    t = client.truncate_kv("perseq", cid, 4)
    assert t.cache.num_tokens == 4 and t.removed_tokens == 3
    d = client.decode("perseq", cid, toks[2]).output
    assert d.cache.num_tokens == 5
    assert d.output.token_id == toks[3]  # same as the first time through position 4


def test_truncate_is_idempotent_and_handle_tracks_length(client):
    cid = client.prefill("mock", [1, 2, 3, 4, 5]).output.cache.cache_id
    assert client.truncate_kv("mock", cid, 2).removed_tokens == 3
    again = client.truncate_kv("mock", cid, 2)
    assert again.removed_tokens == 0 and again.cache.num_tokens == 2
    assert client.decode("mock", cid, 1).output.cache.num_tokens == 3


def test_release_makes_handle_unknown(fresh_server, client):
    cid = client.prefill("mock", [1, 2]).output.cache.cache_id
    r = client.release_cache("mock", cid)
    assert r.released and r.freed_tokens == 2
    with pytest.raises(FerrumRpcError) as e:
        client.decode("mock", cid, 1)
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "was released" in e.value.message
    # release is idempotent
    assert client.release_cache("mock", cid).released is False
    assert fresh_server.live_caches()["mock"] == 0


def test_forward_verify_default_is_serial_decodes(client):
    p = client.prefill("mock", [1]).output
    v = client.forward_verify("mock", p.cache.cache_id, [10, 10, 20, 30])
    assert [o.token_id for o in v.outputs] == [10, 20, 30, 10]  # counter advanced N+1 times
    assert v.base_len == 1 and v.cache.num_tokens == 5


def test_forward_verify_server_side_acceptance(client):
    p = client.prefill("mock", [1]).output
    # feed [last=10, drafts 10, 20, 99]; rows predict 10, 20, 30, 10: drafts 10 and 20 match,
    # 99 does not (row 2 says 30), so 2 drafts are accepted and 30 is the next token.
    v = client.forward_verify("mock", p.cache.cache_id, [10, 10, 20, 99], accept_greedy_prefix=True)
    assert [o.token_id for o in v.outputs] == [10, 20, 30, 10]
    assert v.accepted_drafts == 2
    assert list(v.accepted_tokens) == [10, 20, 30]
    assert v.cache.num_tokens == 1 + 3  # base + last token + 2 accepted drafts


def test_unified_decode_unsupported_on_configurable(client):
    caps = client.capabilities("mock")
    assert caps.supports_native_unified_decode is False
    with pytest.raises(FerrumRpcError) as e:
        client.unified_decode("mock", [m.unified_item([1, 2])])
    assert e.value.code == grpc.StatusCode.UNIMPLEMENTED and e.value.kind == "UNSUPPORTED"
    # "unsupported shape" is its own answer (issue 40): told apart from other UNIMPLEMENTEDs ...
    assert e.value.unsupported_shape and e.value.metadata["reason"] == "UNSUPPORTED_SHAPE"
    # ... and nothing of the step ran
    assert [(i.index, i.state, i.reason) for i in e.value.progress.items] == [(0, 2, "UNSUPPORTED")]


def test_stub_returns_zero_logits(client):
    p = client.prefill("stub", [1, 2], policy=m.full_logits()).output
    row = m.logits_array(p.output)
    assert row.shape == (100,) and not row.any()
    caps = client.capabilities("stub")
    assert caps.max_batch_size == 32 and caps.max_sequence_length == 2048
    info = client.info("stub").models[0]
    assert info.version == "mvp-stub" and info.license == "Apache-2.0"


def test_default_mixed_step_is_all_or_nothing():
    """The base executor's ``mixed_step`` (prompts + other sequences' decodes, as the server's
    continuous batching joins them): a failing decode undoes the prompts — a new cache is released,
    a continued one is truncated back."""
    from ferrum_service.core.errors import FerrumError
    from ferrum_service.executors import ConfigurableModelExecutor
    from ferrum_service.core.types import DecodeInput, PrefillInput

    ex = ConfigurableModelExecutor.with_token_sequence(100, [7, 8, 9], model_id="mix")
    old = ex.prefill(PrefillInput(token_ids=[1, 2])).cache.cache_id
    running = ex.prefill(PrefillInput(token_ids=[3])).cache.cache_id
    pre, dec = ex.mixed_step([PrefillInput(token_ids=[4, 5, 6]), PrefillInput(token_ids=[1], cache_id=old)],
                             [DecodeInput(cache_id=running, token_id=9)])
    assert [o.cache.num_tokens for o in pre] == [3, 3] and dec[0].cache.num_tokens == 2
    live = {e.cache_id for e in ex.registry.entries()}
    with pytest.raises(FerrumError):
        ex.mixed_step([PrefillInput(token_ids=[4, 5]), PrefillInput(token_ids=[2], cache_id=old)],
                      [DecodeInput(cache_id="no-such-cache", token_id=9)])
    assert {e.cache_id for e in ex.registry.entries()} == live  # the new prompt's cache was released
    assert ex.registry.get(old).num_tokens == 3  # the continued prompt was truncated back


def test_per_sequence_script_counts_decoded_tokens_after_a_chunked_prompt(client):
    # ferrum 0.18's scripted executor: the decode script restarts per sequence and its step is the
    # decode position minus the whole prompt, however many chunks the prompt came in. The prompt's
    # later chunks are not decoded tokens.
    first = client.prefill("perseq", [1, 2, 3]).output
    cid = first.cache.cache_id
    last = client.prefill("perseq", [4, 5], cache_id=cid).output
    assert last.cache.num_tokens == 5 and last.output.token_id == SEQ[0]
    toks = [last.output.token_id]
    for _ in range(4):
        toks.append(client.decode("perseq", cid, toks[-1]).output.output.token_id)
    assert toks == expected_stream(5)  # as for an unchunked prompt: [10, 10, 20, 30, 10]
    client.release_cache("perseq", cid)
