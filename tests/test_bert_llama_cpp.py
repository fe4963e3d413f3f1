"""BERT embeddings on llama.cpp (issue 42): the torch-free converter (executors/llama_cpp/bert_gguf.py)
and LlamaBertEmbedder (executors/llama_cpp/embedder.py) against the transformers BertModelExecutor on
the packaged all-MiniLM-L6-v2, in process, through a real server, and with torch refused."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import numpy as np
import pytest

pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

from ferrum_client import Client, FerrumRpcError, messages as m  # noqa: E402

from ferrum_service.core.errors import ErrorKind, FerrumError  # noqa: E402
from ferrum_service.core.steps import StepPlan, StepRow, Want  # noqa: E402
from ferrum_service.core.types import DecodeInput, PrefillInput  # noqa: E402
from ferrum_service.executors.llama_cpp.bert_gguf import convert, read_safetensors  # noqa: E402
from ferrum_service.executors.llama_cpp.embedder import LlamaBertEmbedder  # noqa: E402
from ferrum_service.hosting.weight_cache import bert_gguf  # noqa: E402

from .conftest_models import minilm_path, tiny_bert_dir  # noqa: E402,F401
from .support.servers import REPO, InProcessServer  # noqa: E402

#: Twenty varied sentences: short, long, punctuation, accents, CJK, emoji, code, numbers, casing.
SENTENCES = [
    "The cat sits on the mat.",
    "Kittens are small cats.",
    "A",
    "gRPC uses HTTP/2 for its transport, with protobuf messages.",
    "Les modèles de langue prédisent le prochain mot, et ça marche plutôt bien.",
    "KV caches store keys and values of past tokens so that decoding does not recompute them.",
    "Quarterly tax filings are due on the fifteenth of April.",
    "東京は日本の首都です。",
    "I ❤️ embeddings 🙂 — don't you?",
    "def f(x): return x ** 2  # squares",
    "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG",
    "naïve café résumé coöperate façade",
    "3.14159 is approximately pi; e ≈ 2.71828.",
    "Unbelievably, the antidisestablishmentarianism debate continued.",
    "What is the capital of France? Paris, of course.",
    "   leading and trailing spaces   ",
    "email me at someone@example.com or visit https://example.org/a?b=c",
    "Ein Satz auf Deutsch über Straßenbahnen und Brötchen.",
    "Привет, как дела?",
    " ".join(["Long sentences repeat words to reach many tokens."] * 20),
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("bert-gguf-cache")


@pytest.fixture(scope="module")
def gguf_file(minilm_path, cache):  # noqa: F811
    return bert_gguf(minilm_path, "f16", cache=cache)


@pytest.fixture(scope="module")
def llama(gguf_file, minilm_path):  # noqa: F811
    return LlamaBertEmbedder(gguf_file, folder=minilm_path, model_id="minilm-llama", threads=2)


@pytest.fixture(scope="module")
def reference(minilm_path):  # noqa: F811
    from ferrum_service.executors.bert import BertModelExecutor

    return BertModelExecutor.from_path(minilm_path, model_id="minilm", device="cpu")


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


# ---- the converter -------------------------------------------------------------------------------------
def test_safetensors_reader_matches_the_safetensors_library(minilm_path):  # noqa: F811
    st = pytest.importorskip("safetensors.numpy")
    ours = dict(read_safetensors(minilm_path / "model.safetensors"))
    theirs = st.load_file(str(minilm_path / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    for k, v in theirs.items():
        assert ours[k].dtype == v.dtype and np.array_equal(ours[k], v), k


def test_gguf_has_llama_cpps_bert_names_and_metadata(gguf_file, minilm_path):  # noqa: F811
    r = gguf.GGUFReader(str(gguf_file))

    def val(key):
        f = r.fields[key]
        return f.contents()

    assert val("general.architecture") == "bert"
    assert (val("bert.context_length"), val("bert.embedding_length"), val("bert.feed_forward_length"),
            val("bert.block_count"), val("bert.attention.head_count")) == (512, 384, 1536, 6, 12)
    assert val("bert.attention.causal") is False and val("bert.pooling_type") == 1  # mean
    assert abs(val("bert.attention.layer_norm_epsilon") - 1e-12) < 1e-15
    assert val("tokenizer.ggml.model") == "bert" and val("tokenizer.ggml.token_type_count") == 2
    tokens = val("tokenizer.ggml.tokens")
    assert len(tokens) == 30522
    vocab = (minilm_path / "vocab.txt").read_text(encoding="utf-8").splitlines()
    cat, ing = vocab.index("cat"), vocab.index("##ing")
    assert tokens[cat] == "\u2581cat" and tokens[ing] == "ing" and tokens[101] == "[CLS]"
    types = val("tokenizer.ggml.token_type")
    assert [types[i] for i in (0, 100, 101, 102, 103)] == [3] * 5 and types[cat] == 1
    assert (val("tokenizer.ggml.bos_token_id"), val("tokenizer.ggml.seperator_token_id"),
            val("tokenizer.ggml.padding_token_id"), val("tokenizer.ggml.unknown_token_id"),
            val("tokenizer.ggml.mask_token_id")) == (101, 102, 0, 100, 103)
    names = {t.name: t.tensor_type.name for t in r.tensors}
    expected = {"token_embd.weight", "token_types.weight", "position_embd.weight", "token_embd_norm.weight",
                "token_embd_norm.bias"}
    for i in range(6):
        for t in ("attn_q", "attn_k", "attn_v", "attn_output", "attn_output_norm", "ffn_up", "ffn_down",
                  "layer_output_norm"):
            expected |= {f"blk.{i}.{t}.weight", f"blk.{i}.{t}.bias"}
    assert set(names) == expected  # no pooler, no position_ids
    assert names["token_embd.weight"] == "F16" and names["blk.0.attn_q.weight"] == "F16"
    assert names["blk.0.attn_q.bias"] == "F32" and names["position_embd.weight"] == "F32"


def test_conversion_is_cached_checked_and_remade(minilm_path, tmp_path):  # noqa: F811
    a = bert_gguf(minilm_path, "f16", cache=tmp_path)
    side = json.loads(a.with_name(a.name + ".json").read_text())
    assert side["format"] == "f16" and side["size"] == a.stat().st_size and side["converter"].startswith("bert_gguf")
    mtime = a.stat().st_mtime_ns
    assert bert_gguf(minilm_path, "f16", cache=tmp_path) == a and a.stat().st_mtime_ns == mtime  # reused
    with open(a, "r+b") as f:  # damaged: made again
        f.seek(-10, 2)
        f.write(b"\0" * 10)
    assert bert_gguf(minilm_path, "f16", cache=tmp_path) == a and a.stat().st_mtime_ns != mtime
    b = bert_gguf(minilm_path, "f32", cache=tmp_path)
    assert b != a and b.stat().st_size > a.stat().st_size


def test_a_non_bert_folder_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(FerrumError) as e:
        convert(tmp_path, tmp_path / "x.gguf")
    assert e.value.kind == ErrorKind.CONFIG and "not a BERT model" in e.value.message


# ---- the executor against transformers -----------------------------------------------------------------
def test_tokens_equal_the_transformers_tokenizer(llama, reference, gguf_file):
    from ferrum_service.executors.llama_cpp.tokenizer import GgufTokenizer

    for s in SENTENCES:
        assert llama.tokenizer.encode(s) == reference.tokenizer.encode(s), s
        assert llama.tokenizer.encode(s, add_special_tokens=False) == reference.tokenizer.encode(s, add_special_tokens=False)
    # llama.cpp's own WordPiece tokenizer of the file (used for a bare .gguf path) on plain text
    bare = LlamaBertEmbedder(gguf_file, model_id="bare", threads=2)
    assert isinstance(bare.tokenizer, GgufTokenizer)
    for s in SENTENCES:
        assert bare.tokenizer.encode(s) == reference.tokenizer.encode(s), s


def test_embeddings_match_transformers(llama, reference, capsys):
    ids = [reference.tokenizer.encode(s) for s in SENTENCES]
    ours = np.stack([llama.prefill(PrefillInput(token_ids=x)).embedding for x in ids])
    theirs = reference.embed_batch(ids).numpy()
    cos = cosines(ours, theirs)
    with capsys.disabled():
        print(f"\nllama.cpp vs transformers MiniLM, {len(cos)} sentences: cosine min {cos.min():.7f} "
              f"mean {cos.mean():.7f}")
    assert cos.min() >= 0.999, dict(zip(SENTENCES, cos))
    assert ours.shape == (20, 384) and ours.dtype == np.float32
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    # the weights are real: related sentences are closer than unrelated ones
    assert float(ours[0] @ ours[1]) > float(ours[0] @ ours[6]) + 0.2
    for cid in list(llama.registry.entries()):
        llama.release_cache(cid.cache_id)


def test_a_batch_is_one_encode_and_equals_one_by_one(llama, reference):
    ids = [reference.tokenizer.encode(s) for s in SENTENCES[:8]]
    calls = []
    real = llama._encode
    llama._encode = lambda seqs, out, rows: (calls.append(len(seqs)), real(seqs, out, rows))
    try:
        outs = llama.execute(StepPlan([StepRow(None, x, Want.LAST) for x in ids], "inputs"))
    finally:
        del llama._encode
    assert calls == [8]
    for x, o in zip(ids, outs):
        one = llama.get_embeddings(x)
        assert np.abs(o.embedding - one).max() < 2e-3 and float(o.embedding @ one) > 0.99999
        assert o.cache.num_tokens == len(x) and o.cache.memory_bytes == 0
        llama.release_cache(o.cache.cache_id)
    # more than one encode holds: groups of at most n_batch tokens and max_batch_size prompts
    many = [ids[k % 8] for k in range(70)]
    got = llama.embed_batch(many)
    assert np.abs(got[:8] - llama.embed_batch(ids)).max() < 2e-3 and np.abs(got[8:16] - got[:8]).max() < 2e-3


def test_bad_prompts_and_generation_are_refused_cleanly(llama):
    cases = [([], "every prompt needs at least one token"), ([101] + [1000] * 600, "longer than"),
             ([101, 40000], "outside the vocabulary")]
    for ids, text in cases:
        with pytest.raises(FerrumError) as e:
            llama.prefill(PrefillInput(token_ids=ids))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and text in e.value.message
        assert e.value.field == "token_ids"
    assert len(llama.embed_batch([[101] + [1000] * 510 + [102]])) == 1  # 512 tokens: the limit itself
    out = llama.prefill(PrefillInput(token_ids=[101, 102]))
    for call in (lambda: llama.decode(DecodeInput(cache_id=out.cache.cache_id, token_id=5)),
                 lambda: llama.prefill(PrefillInput(token_ids=[5], cache_id=out.cache.cache_id))):
        with pytest.raises(FerrumError) as e:
            call()
        assert e.value.code == grpc.StatusCode.UNIMPLEMENTED and "encoder" in e.value.message
    assert llama.release_cache(out.cache.cache_id)[0]


def test_tiny_bert_cls_pooling_without_normalize(tiny_bert_dir, tmp_path):  # noqa: F811
    from ferrum_service.executors.bert import BertModelExecutor

    ref = BertModelExecutor.from_path(tiny_bert_dir, model_id="tb", device="cpu")
    ex = LlamaBertEmbedder(bert_gguf(tiny_bert_dir, "f32", cache=tmp_path), folder=tiny_bert_dir, threads=2)
    assert ex.pooling == ["cls"] and ex.normalize is False
    ids = [ref.tokenizer.encode(s) for s in ("the cat sits on the mat", "a dog", "x")]
    assert [ex.tokenizer.encode(s) for s in ("the cat sits on the mat", "a dog", "x")] == ids
    ours, theirs = ex.embed_batch(ids), ref.embed_batch(ids).numpy()
    assert cosines(ours, theirs).min() > 0.9999 and np.allclose(ours, theirs, atol=1e-3)
    # pooling modes llama.cpp has not (max, concatenations) are pooled here from per-token rows
    both = LlamaBertEmbedder(ex.gguf_path, folder=tiny_bert_dir, pooling=["cls", "max"], threads=2)
    ref2 = BertModelExecutor.from_path(tiny_bert_dir, model_id="tb", device="cpu", pooling=["cls", "max"])
    assert cosines(both.embed_batch(ids), ref2.embed_batch(ids).numpy()).min() > 0.9999


# ---- through a real server -----------------------------------------------------------------------------
def test_embeddings_through_a_real_server(llama, reference):
    from ferrum_service.hosting.model_specs import build_executor, parse_spec

    with InProcessServer([llama]) as srv, Client(srv.target) as c:
        info = {x.model_id: x for x in c.info().models}["minilm-llama"]
        assert info.executor == "llama-bert" and c.capabilities("minilm-llama").supports_embeddings
        assert c.capabilities("minilm-llama").supports_generation is False
        for s in SENTENCES[:5]:
            ids = c.tokenize("minilm-llama", s, True)
            assert list(ids) == reference.tokenizer.encode(s)
            out = c.prefill("minilm-llama", ids).output
            e = m.tensor_array(out.embedding)
            assert e.shape == (384,)
            r = reference.get_embeddings(list(ids)).numpy()
            assert float(e @ r) / np.linalg.norm(r) >= 0.999
            c.release_cache("minilm-llama", out.cache.cache_id)
        for ids, field in (([], "input.token_ids"), ([101] + [1000] * 600, "input.token_ids")):
            with pytest.raises(FerrumRpcError) as e:
                c.prefill("minilm-llama", ids)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, e.value
            assert e.value.field.startswith(field), (e.value.field, e.value)
        with pytest.raises(FerrumRpcError) as e:
            c.generate("minilm-llama", token_ids=[101], max_tokens=2).tokens()
        assert e.value.code == grpc.StatusCode.UNIMPLEMENTED
        assert srv.live_caches()["minilm-llama"] == 0
    # vLLM's GetTokenizer bundle: the folder's own tokenizer files, no transformers needed
    import io
    import zipfile

    from ferrum_service.wire.tokenizer_bundle import tokenizer_zip

    names = zipfile.ZipFile(io.BytesIO(tokenizer_zip(llama))).namelist()
    assert "tokenizer.json" in names and "tokenizer_config.json" in names
    # the spec names it
    ex = build_executor(parse_spec(f"llama-bert,id=lb,path={llama.gguf_path},threads=2"))
    assert ex.kind == "llama-bert" and ex.model_id == "lb"


# ---- torch-free ------------------------------------------------------------------------------------------
TORCH_FREE = r"""
import json, sys
sys.path.insert(0, {repo!r})
from tests.support.no_torch import RefuseTorch
sys.meta_path.insert(0, RefuseTorch())
import os
os.environ["FERRUM_MODEL_CACHE"] = {cache!r}
from ferrum_service.hosting.model_specs import build_executor, parse_spec
ex = build_executor(parse_spec("minilm"))
texts = json.loads(sys.stdin.read())
ids = [ex.tokenizer.encode(t) for t in texts]
embs = ex.embed_batch(ids)
assert not any(m.partition(".")[0] in ("torch", "transformers") for m in sys.modules), "torch was imported"
print(json.dumps({{"kind": ex.kind, "file": ex.info().metadata["gguf_file"], "ids": ids, "embs": embs.tolist()}}))
"""


def test_the_minilm_preset_runs_torch_free_on_llama_cpp(reference, tmp_path):
    code = TORCH_FREE.format(repo=str(REPO), cache=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], input=json.dumps(SENTENCES[:6]), capture_output=True, text=True,
                       cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["kind"] == "llama-bert" and got["file"].startswith(str(tmp_path))  # converted there, torch-free
    assert got["ids"] == [reference.tokenizer.encode(s) for s in SENTENCES[:6]]
    theirs = reference.embed_batch(got["ids"]).numpy()
    assert cosines(np.array(got["embs"], dtype=np.float32), theirs).min() >= 0.999


def test_specs_name_the_llama_executor_and_refuse_its_typos(minilm_path, tmp_path, monkeypatch):  # noqa: F811
    from ferrum_service.hosting import model_specs, weight_cache
    from ferrum_service.hosting.model_specs import build_executor, parse_spec

    assert parse_spec("minilm-llama,threads=1,quant=f32").options == {"threads": "1", "quant": "f32"}
    for bad in ("minilm-llama,thread=1", "llama-bert,path=/x,n_ctx=5", "minilm,threads=1"):
        with pytest.raises(ValueError, match="unknown option"):
            parse_spec(bad)
    with pytest.raises(ValueError, match="quant='q4_0'"):
        build_executor(parse_spec("minilm-llama,quant=q4_0"))
    monkeypatch.setenv("FERRUM_MODEL_CACHE", str(tmp_path))
    assert weight_cache.prepare_minilm().parent == tmp_path  # what an image build bakes
    ex = build_executor(parse_spec("minilm-llama,threads=1,max_batch_size=4"))
    assert (ex.kind, ex.model_id, ex.threads, ex.max_batch_size) == ("llama-bert", "minilm", 1, 4)
    assert ex.info().metadata["gguf_file"].startswith(str(tmp_path))
    # minilm stays on transformers where it imports, and goes to llama.cpp where it does not
    assert build_executor(parse_spec("minilm")).kind == "bert"
    monkeypatch.setattr(model_specs, "_transformers_imports", lambda: False)
    assert build_executor(parse_spec("minilm")).kind == "llama-bert"
