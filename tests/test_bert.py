"""BertModelExecutor, in process: the real all-MiniLM-L6-v2 against transformers, and a tiny BERT."""

from __future__ import annotations

import grpc
import pytest
import torch

from ferrum_service.core.errors import ErrorKind, FerrumError
from ferrum_service.executors.bert import BertModelExecutor, read_sentence_transformers_config
from ferrum_service.core.types import DecodeInput, LogitsPolicy, PrefillInput, UnifiedItem

from .conftest_models import ForwardCounter, minilm_path, tiny_bert_dir  # noqa: F401

SENTENCES = [
    "The cat sits on the mat.",
    "Kittens are small cats.",
    "gRPC uses HTTP/2 for its transport, with protobuf messages.",
    "A",
    "Les modèles de langue prédisent le prochain mot, et ça marche plutôt bien.",
    "KV caches store keys and values of past tokens so that decoding does not recompute them.",
]


@pytest.fixture(scope="module")
def minilm(minilm_path):
    return BertModelExecutor.from_path(minilm_path, model_id="minilm", device="cpu")


@pytest.fixture(scope="module")
def reference(minilm_path):
    """Embeddings computed directly with transformers: mean pooling + L2 normalisation."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_path)
    model = AutoModel.from_pretrained(minilm_path).eval()
    enc = tok(SENTENCES, padding=True, return_tensors="pt")
    with torch.inference_mode():
        h = model(**enc).last_hidden_state
    m = enc["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1), tok


def test_minilm_config_is_read_from_the_sentence_transformers_files(minilm, minilm_path):
    assert read_sentence_transformers_config(minilm_path) == (["mean"], True, 256)
    i = minilm.info()
    assert (i.executor, i.model_type, i.hidden_size, i.num_layers) == ("bert", "embedding", 384, 6)
    assert i.metadata["pooling"] == "mean" and i.metadata["normalize"] is True and i.has_tokenizer
    c = minilm.capabilities()
    assert not c.supports_generation and c.supports_embeddings and c.supports_forward
    assert not c.supports_native_unified_decode and not c.supports_native_forward_verify


def test_minilm_prefill_matches_transformers(minilm, reference):
    ref, tok = reference
    for s, r in zip(SENTENCES, ref):
        out = minilm.prefill(PrefillInput(token_ids=tok.encode(s)))
        assert out.embedding.shape == (384,) and out.logits is None
        assert torch.nn.functional.cosine_similarity(out.embedding, r, dim=0).item() >= 0.999
        assert abs(out.embedding.norm().item() - 1.0) < 1e-5
        minilm.release_cache(out.cache.cache_id)
    # The weights are real: related sentences are closer than unrelated ones.
    e = [minilm.get_embeddings(tok.encode(s)) for s in SENTENCES[:3]]
    assert float(e[0] @ e[1]) > float(e[0] @ e[2]) + 0.2


def test_minilm_batch_is_one_forward_and_equals_single(minilm, reference):
    ref, tok = reference
    ids = [tok.encode(s) for s in SENTENCES]
    with ForwardCounter(minilm.model) as fc:
        outs = minilm.batch_prefill([PrefillInput(token_ids=x) for x in ids])
    assert fc.calls == 1
    for x, o, r in zip(ids, outs, ref):
        assert (o.embedding - minilm.get_embeddings(x)).abs().max().item() < 1e-5
        assert torch.nn.functional.cosine_similarity(o.embedding, r, dim=0).item() >= 0.999
        assert o.cache.num_tokens == len(x) and o.cache.memory_bytes == 0
        minilm.release_cache(o.cache.cache_id)


def test_generation_methods_are_unimplemented_with_a_clear_message(minilm, reference):
    _, tok = reference
    out = minilm.prefill(PrefillInput(token_ids=tok.encode("hello")))
    cid = out.cache.cache_id
    calls = [
        lambda: minilm.decode(DecodeInput(cache_id=cid, token_id=5)),
        lambda: minilm.batch_decode([DecodeInput(cache_id=cid, token_id=5)]),
        lambda: minilm.unified_decode([UnifiedItem(seq_id="a", q_tokens=[5], cache_id=cid, pos_offset=3)]),
        lambda: minilm.forward_verify(cid, [5, 6], LogitsPolicy()),
        lambda: minilm.prefill(PrefillInput(token_ids=[5], cache_id=cid)),
    ]
    for call in calls:
        with pytest.raises(FerrumError) as ei:
            call()
        assert ei.value.kind == ErrorKind.UNSUPPORTED and ei.value.code == grpc.StatusCode.UNIMPLEMENTED
        assert "encoder" in ei.value.message
    with pytest.raises(FerrumError, match="does not support token generation; use Prefill"):
        minilm.decode(DecodeInput(cache_id=cid, token_id=5))


def test_prefill_handles_are_real_and_released(minilm, reference):
    _, tok = reference
    out = minilm.prefill(PrefillInput(token_ids=tok.encode("hello world")))
    cid = out.cache.cache_id
    assert cid in minilm.registry and minilm.registry.get(cid).tokens == tok.encode("hello world")
    assert minilm.kv_capacity().used_bytes == 0
    assert minilm.release_cache(cid) == (True, 0, len(tok.encode("hello world")))
    assert cid not in minilm.registry and minilm.registry.was_released(cid)


def test_retained_handles_are_bounded(tiny_bert_dir):
    ex = BertModelExecutor.from_path(tiny_bert_dir, model_id="tb", device="cpu")
    ex.max_retained_handles = 3
    ids = [ex.prefill(PrefillInput(token_ids=[2, 10 + i, 3])).cache.cache_id for i in range(5)]
    assert len(ex.registry) == 3 and [c in ex.registry for c in ids] == [False, False, True, True, True]
    assert ex.registry.reclaimed_total == 2


def test_tiny_bert_cls_pooling_and_normalize_override(tiny_bert_dir):
    assert read_sentence_transformers_config(tiny_bert_dir) == (["cls"], False, 128)
    ex = BertModelExecutor.from_path(tiny_bert_dir, model_id="tb", device="cpu")
    ids = ex.tokenizer.encode("the cat sits on the mat")
    with torch.inference_mode():
        h = ex.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    emb = ex.get_embeddings(ids)
    assert (emb - h[0]).abs().max().item() < 1e-5  # CLS token, not normalised
    normed = BertModelExecutor.from_path(tiny_bert_dir, model_id="tb", device="cpu", normalize=True)
    assert abs(normed.get_embeddings(ids).norm().item() - 1.0) < 1e-5
    mean = BertModelExecutor.from_path(tiny_bert_dir, model_id="tb", device="cpu", pooling="mean")
    assert (mean.get_embeddings(ids) - h.mean(0)).abs().max().item() < 1e-5
    hidden = ex.forward(torch.tensor([ids]))
    assert hidden.shape == (1, len(ids), 32)
