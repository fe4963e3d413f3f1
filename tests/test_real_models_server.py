"""Real models behind the live gRPC server: a tiny random-weight Llama (every run) and the real
SmolLM2 + MiniLM defaults (marked slow)."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
import torch

from ferrum_client import Client, FerrumRpcError, messages as m, pb

from .conftest_models import tiny_bert_dir, tiny_llama_dir  # noqa: F401 - fixtures
from .support.servers import InProcessServer, ServerProcess
from .support.waits import wait_no_live_caches


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_dir, tiny_bert_dir):  # noqa: F811
    from ferrum_service.executors.bert import BertModelExecutor
    from ferrum_service.executors.transformers import HfCausalLmExecutor

    lm = HfCausalLmExecutor.from_path(tiny_llama_dir, model_id="tiny", device="cpu", kv_budget_tokens=8192)
    bert = BertModelExecutor.from_path(tiny_bert_dir, model_id="enc", device="cpu")
    with InProcessServer([lm, bert]) as srv:
        yield srv


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):  # noqa: F811
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()


@pytest.fixture
def tc(tiny_server):
    with Client(tiny_server.target) as c:
        yield c
    assert tiny_server.live_caches()["tiny"] == 0, "a test leaked a cache"


def full_logits(hf_model, ids):
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float().numpy()


def test_generate_matches_transformers_greedy(tc, hf_model):
    prompt = [5, 17, 42, 99, 7]
    got = tc.generate("tiny", token_ids=prompt, max_tokens=12, ignore_eos=True).tokens()
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert got == ref[0, len(prompt):].tolist()


def test_prefill_decode_logits_match_a_full_forward(tc, hf_model):
    ids = [3, 14, 15, 92, 65]
    p = tc.prefill("tiny", ids[:3], policy=m.full_logits()).output
    rows = [m.logits_array(p.output)]
    cid = p.cache.cache_id
    for t in ids[3:]:
        rows.append(m.logits_array(tc.decode("tiny", cid, t, policy=m.full_logits()).output.output))
    ref = full_logits(hf_model, ids)[2:]
    assert np.abs(np.stack(rows) - ref).max() < 1e-4
    tc.release_cache("tiny", cid)


def test_batch_decode_equals_separate_decodes_over_grpc(tc):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    single = []
    for pr in prompts:
        p = tc.prefill("tiny", pr).output
        single.append(m.logits_array(tc.decode("tiny", p.cache.cache_id, 20, policy=m.full_logits()).output.output))
        tc.release_cache("tiny", p.cache.cache_id)
    outs = tc.batch_prefill("tiny", prompts).outputs
    b = tc.batch_decode("tiny", [m.decode_input(o.cache.cache_id, 20, m.full_logits()) for o in outs]).outputs
    assert [o.cache.num_tokens for o in b] == [4, 8, 2]
    assert np.abs(np.stack([m.logits_array(o.output) for o in b]) - np.stack(single)).max() < 1e-4
    for o in outs:
        tc.release_cache("tiny", o.cache.cache_id)


def test_truncate_verify_and_unified_over_grpc(tc, hf_model):
    ids = [9, 8, 7, 6, 5, 4, 3]
    p = tc.prefill("tiny", ids).output
    cid = p.cache.cache_id
    assert tc.truncate_kv("tiny", cid, 4).cache.num_tokens == 4
    v = tc.forward_verify("tiny", cid, [5, 4, 3], policy=m.full_logits())
    ref = full_logits(hf_model, ids)[4:]
    assert np.abs(np.stack([m.logits_array(o) for o in v.outputs]) - ref).max() < 1e-4
    assert v.base_len == 4 and v.cache.num_tokens == 7
    # a prompt in two unified chunks, next to a decode of the first cache
    u1 = tc.unified_decode("tiny", [m.unified_item([1, 2, 3], is_final_chunk=False, seq_id="new"),
                                    m.unified_item([2], cache_id=cid, pos_offset=7, seq_id="dec")]).results
    assert not u1[0].HasField("output") and u1[1].HasField("output")
    new = u1[0].cache.cache_id
    u2 = tc.unified_decode("tiny", [m.unified_item([4, 5], cache_id=new, pos_offset=3, seq_id="new",
                                                   policy=m.full_logits())]).results
    ref2 = full_logits(hf_model, [1, 2, 3, 4, 5])[-1]
    assert np.abs(m.logits_array(u2[0].output) - ref2).max() < 1e-4
    for c in (cid, new):
        tc.release_cache("tiny", c)


def test_tokenizer_rpcs_use_the_models_tokenizer(tc, tiny_llama_dir):  # noqa: F811
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    text = "hello world, hello grpc"
    ids = tc.tokenize("tiny", text)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert tc.detokenize("tiny", ids) == tok.decode(ids)
    chat = tc.apply_chat_template("tiny", [("user", "hi there")])
    assert chat.text == tok.apply_chat_template([{"role": "user", "content": "hi there"}], tokenize=False,
                                                add_generation_prompt=True)
    events = list(tc.generate("tiny", chat=[("user", "hi")], max_tokens=5, stream_text=True, ignore_eos=True))
    pieces = "".join(e.token.text for e in events if e.WhichOneof("event") == "token")
    assert pieces == events[-1].finished.text


def test_streamed_text_pieces_join_to_the_decoded_whole(tc, tiny_llama_dir):  # noqa: F811
    """stream_text decodes incrementally (a window of recent ids); the pieces still join to the
    tokenizer's decode of every generated id."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    events = list(tc.generate("tiny", text="hello world", max_tokens=48, stream_text=True, ignore_eos=True,
                              temperature=1.0, seed=7))
    tokens = [e.token for e in events if e.WhichOneof("event") == "token"]
    assert len(tokens) == 48
    whole = tok.decode([t.token_id for t in tokens], skip_special_tokens=True)
    # A character still incomplete at the end (random bytes) is not streamed, as documented.
    assert "".join(t.text for t in tokens) == whole.rstrip("\ufffd") == events[-1].finished.text


def test_kv_budget_refusal_and_release_give_memory_back(tc):
    before = tc.kv_capacity("tiny")
    p = tc.prefill("tiny", [1] * 100).output
    during = tc.kv_capacity("tiny")
    grown = during.used_bytes - before.used_bytes
    assert grown == -(-100 // 16) * 16 * during.bytes_per_token  # whole 16-token blocks
    assert during.used_tokens == before.used_tokens + 100
    with pytest.raises(FerrumRpcError) as e:
        tc.prefill("tiny", [1] * 10, reserve_tokens=during.free_tokens + 1)
    # docs/errors.md: a reservation one sequence could never hold is INVALID_ARGUMENT ("reserve
    # beyond the model"); one that fits the model but not the free budget is RESOURCE_EXHAUSTED
    limit = tc.capabilities("tiny").max_sequence_length
    want = grpc.StatusCode.INVALID_ARGUMENT if during.free_tokens + 1 > limit else grpc.StatusCode.RESOURCE_EXHAUSTED
    assert e.value.code == want, (e.value, limit, during.free_tokens)
    r = tc.release_cache("tiny", p.cache.cache_id)
    assert r.freed_bytes == grown
    assert tc.kv_capacity("tiny").used_bytes == before.used_bytes


def test_concurrent_generate_streams_share_batched_steps(tiny_server, tc):
    """Continuous batching inside the server: 4 concurrent streams give the same tokens as alone."""
    import threading

    prompts = [[1, 2], [3, 4, 5], [6], [7, 8, 9, 10]]
    alone = [tc.generate("tiny", token_ids=p, max_tokens=8, ignore_eos=True).tokens() for p in prompts]
    host = tiny_server.models.get("tiny")
    ops_before = host.executor.stats.decode_ops
    together: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i, p=p: together.__setitem__(
        i, tc.generate("tiny", token_ids=p, max_tokens=8, ignore_eos=True).tokens())) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [together[i] for i in range(4)] == alone
    # 4 streams x 7 decode steps: batching needs fewer forward calls than 28
    assert host.executor.stats.decode_ops - ops_before < 28


def test_new_streams_join_running_ones_in_the_same_forward(tiny_server, tc, tiny_llama_dir):  # noqa: F811
    """Streams that arrive while others decode: their prompts run in the same forwards as the
    running streams' next tokens (mixed steps), and every stream's tokens equal a solo run."""
    import threading
    import time

    from .conftest_models import ForwardCounter

    host = tiny_server.models.get("tiny")
    long_prompts = [[11, 12, 13], [14, 15]]
    new_prompts = [[20 + i, 30 + i, 40 + i] for i in range(6)]
    alone = {tuple(p): tc.generate("tiny", token_ids=p, max_tokens=48, ignore_eos=True).tokens()
             for p in long_prompts + new_prompts}
    mixed_before = host.batcher.mixed_steps
    got: dict[tuple, list[int]] = {}
    started = threading.Event()

    def run(p):
        toks = []
        for ev in tc.generate("tiny", token_ids=p, max_tokens=48, ignore_eos=True):
            if ev.WhichOneof("event") == "token":
                toks.append(ev.token.token_id)
                if len(toks) == 4:
                    started.set()
        got[tuple(p)] = toks

    with ForwardCounter(host.executor.model) as fc:
        first = [threading.Thread(target=run, args=(p,)) for p in long_prompts]
        for t in first:
            t.start()
        assert started.wait(30)
        time.sleep(0.05)
        later = [threading.Thread(target=run, args=(p,)) for p in new_prompts]
        for t in later:
            t.start()
        for t in first + later:
            t.join(60)
    assert got == alone
    assert host.batcher.mixed_steps > mixed_before, "no step joined a new prompt with running decodes"
    # 8 prompts + 8 x 47 decode steps, one forward each if nothing were batched
    assert fc.calls < (8 + 8 * 47) / 2, fc.calls


def test_generate_cancelled_around_its_prompt_step_leaves_no_cache(tiny_server, tc):
    """Deadlines that fall before, during and after the prompt's batched step: no cache survives
    (one made by a step whose stream is already gone is reclaimed, also when the stream is
    cancelled in the instant between the step setting its result and the stream resuming)."""
    prompt = list(range(1, 400))
    for k in range(60):  # deadlines every 1 ms from 0 to 59 ms (the prompt's step takes ~10-30 ms)
        try:
            for _ in tc.generate("tiny", token_ids=prompt, max_tokens=4, ignore_eos=True, timeout=0.001 * k):
                pass
        except FerrumRpcError as e:
            assert e.code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED), e
    assert wait_no_live_caches(tiny_server, timeout=10)["tiny"] == 0


def test_kv_slot_rpcs_report_and_reserve_the_paged_pool(tc):
    from ferrum_client import tpb

    before = tc.kv_slot_capacity("tiny").snapshot
    assert before.block_size == 16 and before.total_blocks == 512 and before.free_blocks == 512
    cid = tc.prefill("tiny", [1, 2, 3], policy=m.no_output()).output.cache.cache_id
    r = tc.reserve_kv_slots("tiny", [tpb.KvSlotRequest(cache_id=cid, target_len=100)]).reservation
    assert (r.free_blocks_before, r.free_blocks_after) == (511, 505)
    assert (r.allocations[0].blocks_before, r.allocations[0].new_blocks) == (1, 6)
    assert tc.kv_slot_capacity("tiny").snapshot.free_blocks == 505
    with pytest.raises(FerrumRpcError) as e:
        tc.reserve_kv_slots("tiny", [tpb.KvSlotRequest(cache_id=cid, target_len=20000)])
    # 20,000 tokens exceed the model's sequence limit: it can never fit, INVALID_ARGUMENT
    assert tc.capabilities("tiny").max_sequence_length < 20000
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, e.value
    tc.release_cache("tiny", cid)
    assert tc.kv_slot_capacity("tiny").snapshot.free_blocks == 512


def test_reserve_kv_slots_for_a_new_sequence_then_unified_decode_fills_it(tc):
    """Issue 15 (1), over the wire: ``new_sequence`` names a sequence the server has never seen;
    the created cache comes back in ``created_cache_id``, and the first UnifiedDecode item on it
    (pos_offset 0) is the prompt: the same token as Generate's first."""
    from ferrum_client import tpb

    free = tc.kv_slot_capacity("tiny").snapshot.free_blocks
    r = tc.reserve_kv_slots("tiny", [tpb.KvSlotRequest(cache_id="engine-7", target_len=40, new_sequence=True)])
    (a,) = r.reservation.allocations
    assert a.cache_id == "engine-7" and a.created_cache_id
    assert (a.blocks_before, a.new_blocks) == (0, 3) and tc.kv_slot_capacity("tiny").snapshot.free_blocks == free - 3
    prompt = [1, 100, 200, 300]
    item = pb.UnifiedBatchItem(seq_id="engine-7", q_tokens=prompt, cache_id=a.created_cache_id, pos_offset=0,
                               is_final_chunk=True, logits=m.greedy())
    (res,) = tc.unified_decode("tiny", [item]).results
    first = next(iter(tc.generate("tiny", token_ids=prompt, max_tokens=1).tokens()))
    assert res.cache.cache_id == a.created_cache_id and res.cache.num_tokens == 4
    assert res.output.token_id == first
    with pytest.raises(FerrumRpcError) as e:  # without new_sequence an unknown name is NOT_FOUND
        tc.reserve_kv_slots("tiny", [tpb.KvSlotRequest(cache_id="engine-8", target_len=4)])
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(FerrumRpcError) as e:  # a new sequence needs a name
        tc.reserve_kv_slots("tiny", [tpb.KvSlotRequest(target_len=4, new_sequence=True)])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    tc.release_cache("tiny", a.created_cache_id)
    assert tc.kv_slot_capacity("tiny").snapshot.free_blocks == free


def test_embedding_model_refuses_generation(tc):
    out = tc.prefill("enc", [1, 2, 3]).output
    assert len(out.embedding.shape) == 1 and out.embedding.shape[0] > 0
    assert tc.capabilities("enc").supports_generation is False
    for call in (lambda: tc.decode("enc", out.cache.cache_id, 1),
                 lambda: tc.generate("enc", token_ids=[1], max_tokens=2).tokens()):
        with pytest.raises(FerrumRpcError) as e:
            call()
        assert e.value.code == grpc.StatusCode.UNIMPLEMENTED and "embeddings" in e.value.message
    tc.release_cache("enc", out.cache.cache_id)


@pytest.mark.slow
def test_default_serve_hosts_smollm2_and_minilm():
    """`ferrum-service serve` with no model flags: the real defaults, real text, real embeddings."""
    import subprocess
    import sys

    from .support.servers import REPO

    with ServerProcess(ready_timeout=300) as srv, Client(srv.target) as c:
        models = {x.model_id: x for x in c.info().models}
        assert set(models) == {"smollm2", "minilm"}
        assert models["smollm2"].has_chat_template and models["smollm2"].vocab_size == 49152
        # On a machine without CUDA the default SmolLM2 runs on llama.cpp (an F16 copy of the packaged
        # Q4_1 file: tests/test_default_model.py), with CUDA on transformers.
        assert models["smollm2"].executor == ("hf-causal-lm" if torch.cuda.is_available() else "llama-cpp")
        ev = list(c.generate("smollm2", chat=[("user", "What is the capital of France?")], max_tokens=24))
        text = ev[-1].finished.text
        assert "Paris" in text, text
        e1 = m.tensor_array(c.prefill("minilm", c.tokenize("minilm", "A cat sits on the mat.", True)).output.embedding)
        e2 = m.tensor_array(c.prefill("minilm", c.tokenize("minilm", "A kitten rests on a rug.", True)).output.embedding)
        e3 = m.tensor_array(c.prefill("minilm", c.tokenize("minilm", "Quarterly tax filings are due.", True)).output.embedding)
        assert e1.shape == (384,)
        assert float(e1 @ e2) > float(e1 @ e3) + 0.2
        r = subprocess.run([sys.executable, "-m", "ferrum_service", "generate", "Say hello.", "--target", srv.target,
                            "--max-tokens", "8"], capture_output=True, text=True, cwd=REPO, timeout=120)
        assert r.returncode == 0 and r.stdout.strip(), r.stderr
