"""The torch-free GGUF tokenizer converter (``ferrum_service/wire/gguf_tokenizer.py``) on the real
SmolLM2 GGUF, against the two references: llama.cpp's own tokenizer (the one the model runs with,
loaded vocabulary-only from the same file) and transformers' conversion of the same file
(``AutoTokenizer.from_pretrained(dir, gguf_file=...)``, the bundle's other converter).

Documented differences from transformers' bundle (asserted below, so a change shows):

* ``tokenizer.json``: only the pre-tokenizer. llama.cpp splits every digit off on its own for
  ``tokenizer.ggml.pre = "smollm"`` (as SmolLM2's own tokenizer.json does); transformers' GGUF
  conversion uses GPT-2's split alone. Both agree on ASCII digits (SmolLM2 has no merge across a
  digit), but not on other numerals after a space (``" ½"``, ``" ²"``): there the converter gives
  llama.cpp's ids and transformers' conversion does not.
* ``tokenizer_config.json``: ``tokenizer_class`` is ``PreTrainedTokenizerFast`` (loads in
  transformers 4 and 5; transformers 5 writes ``TokenizersBackend``), ``model_max_length`` is the
  GGUF's context length (transformers writes its "no limit" placeholder), and the file also carries
  ``add_bos_token`` / ``add_eos_token``, ``clean_up_tokenization_spaces: false`` and the chat
  template (transformers 5 writes the template only as ``chat_template.jinja``; both are here).
* ``special_tokens_map.json`` is written (transformers 5 no longer writes it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ferrum_service.wire import gguf_tokenizer as gt

from .support.packaged import smollm2_gguf
from .support.servers import REPO

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<file_sep>", "<jupyter_code>"]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in JSON."},
     {"role": "user", "content": "List 3 primes < 10 as {\"primes\": [...]}"},
     {"role": "assistant", "content": "{\"primes\": [2, 3, 5]}"},
     {"role": "user", "content": "Now 4 — and explain   why.\n\nThanks 🙏"}],
    [{"role": "user", "content": "def f(x):\n\treturn x ** 2  # ünïcode 日本語\n"}],
]


def _corpus() -> list[str]:
    """English, code, unicode, emoji, whitespace runs, numbers, special-token text."""
    return [
        "Hello world", "Hello, world! How are you today?", "The quick brown fox jumps over the lazy dog.",
        "it's we're I'll they've I'd can't WON'T", " leading space", "  two leading", "trailing   ",
        "a  b   c    d     e", "\n", "\n\n\n", "line one\nline two\r\nline three\n", "\ttab\t\tseparated\t",
        "   \n   \n", "mixed \t\n \r\n  whitespace", " ", "",
        "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
        "for (int i = 0; i < 10; ++i) { sum += a[i] * b[i]; }  // dot\n",
        "import numpy as np\nx = np.arange(12).reshape(3, 4)\nprint(x @ x.T)",
        "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;", "<div class=\"a\">&amp; &lt;</div>",
        "0 1 12 123 1234 12345 3.14159 -42 1,000,000 2024-01-31 0x1F 1e-9 v2.3.4", "x1y2z3 a1 B22 c333",
        "Ünïcödé façade naïve café Øresund straße", "Привет, мир! Как дела?", "日本語のテキストです。", "中文 123 abc",
        "한국어 텍스트", "مرحبا بالعالم", "Γειά σου Κόσμε", "emoji 😀🎉 family 👨‍👩‍👧 flag 🇫🇷 skin 👍🏽",
        "zero\u200bwidth", "\u00a0non-breaking\u00a0space", "combining e\u0301 and n\u0303",
        "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
        "text<|endoftext|>more<repo_name>x<file_sep>y", "<|im_start|><|im_end|>", "<|im_start", "|im_end|>",
        "a" * 300, "ab" * 200, "!!!???...;;;", "   \u3000ideographic space",
    ]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    d, n = smollm2_gguf(llama_cpp=True)
    return d / n


@pytest.fixture(scope="module")
def llama_vocab(gguf_path):
    """llama.cpp's tokenizer for the file (GgufTokenizer over a vocabulary-only load)."""
    import llama_cpp.llama_cpp as L

    from ferrum_service.executors.llama_cpp.tokenizer import GgufTokenizer

    L.llama_backend_init()
    params = L.llama_model_default_params()
    params.vocab_only = True
    model = L.llama_model_load_from_file(str(gguf_path).encode(), params)
    assert model, "llama.cpp could not load the vocabulary"
    yield GgufTokenizer(model)
    L.llama_model_free(model)


@pytest.fixture(scope="module")
def converted(gguf_path, tmp_path_factory):
    """The converter's files for SmolLM2, their folder, and the seconds the conversion took."""
    out = tmp_path_factory.mktemp("ferrum-gguf")
    t0 = time.perf_counter()
    names = gt.write_files(gguf_path, out)
    took = time.perf_counter() - t0
    return out, names, took


@pytest.fixture(scope="module")
def reference(gguf_path, tmp_path_factory):
    """transformers' conversion of the same file, saved, and the seconds it took."""
    from ferrum_service.wire.tokenizer_bundle import transformers_converts

    if not transformers_converts():
        pytest.skip("transformers (with torch) is not importable here")
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    hf = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    took = time.perf_counter() - t0
    out = tmp_path_factory.mktemp("transformers-gguf")
    hf.save_pretrained(out)
    return hf, out, took


def _mine(converted):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(converted[0] / "tokenizer.json"))


def test_smollm2_metadata_is_what_the_converter_supports(gguf_path):
    v = gt.read_vocab(gguf_path)
    assert (v.model, v.pre) == ("gpt2", "smollm")
    assert len(v.tokens) == len(v.token_types) == 49152 and len(v.merges) > 40000
    assert gt.check_supported(v) is gt.PRE_TOKENIZERS["smollm"]


def test_encodes_like_llama_cpp_and_transformers(converted, llama_vocab, reference):
    """Every text of a varied corpus, and chat conversations rendered with the GGUF's template,
    encode to llama.cpp's ids and transformers' ids, and decode back to the text."""
    mine, hf = _mine(converted), reference[0]
    texts = _corpus() + [llama_vocab.apply_chat_template(c, add_generation_prompt=True) for c in CONVERSATIONS]
    assert all("<|im_start|>" in t for t in texts[-len(CONVERSATIONS):])
    checked = 0
    for text in texts:
        ids = mine.encode(text).ids  # add_special_tokens on: SmolLM2 adds no BOS, as llama.cpp does
        assert ids == llama_vocab.encode(text, add_special_tokens=True), text
        assert ids == hf.encode(text, add_special_tokens=True), text
        assert mine.decode(ids, skip_special_tokens=False) == text == llama_vocab.decode(ids), text
        assert hf.decode(ids) == text
        checked += len(ids)
    # the special tokens stay whole, one id each, the ids llama.cpp gives them
    for s in SPECIALS:
        assert mine.encode(s).ids == llama_vocab.encode(s) and len(mine.encode(s).ids) == 1, s
    assert checked > 800  # tokens compared (943 for this corpus)


def test_numerals_split_as_llama_cpp_splits_them(converted, llama_vocab, reference):
    """``"smollm"`` splits each numeral off (llama.cpp's ``\\p{N}`` step): the converter follows
    llama.cpp on numerals beyond ASCII digits; transformers' conversion (GPT-2's split alone)
    gives other ids for a numeral after a space. The difference is printed, not asserted, for
    transformers: it is theirs to keep or fix."""
    mine, hf = _mine(converted), reference[0]
    texts = ["x1y2 ½ ² ٣ ⅷ 〇", "costs ½ of ¾", "E = mc²", " ٣٤٥", "Ⅻ o'clock", " 1 22 333"]
    differ = []
    for text in texts:
        assert mine.encode(text).ids == llama_vocab.encode(text), text
        if hf.encode(text) != llama_vocab.encode(text):
            differ.append(text)
    print(f"\ntransformers' GGUF conversion differs from llama.cpp on: {differ}")
    assert " 1 22 333" not in differ  # ASCII digits: all three agree


def test_bundle_files_against_transformers(converted, reference):
    """The converter's files beside transformers' for the same GGUF: the same vocabulary, merges,
    added tokens, decoder and post-processor; the same special tokens and chat template; the
    differences the module doc lists, and no others."""
    ours, names, _ = converted
    _, theirs, _ = reference
    assert sorted(names) == ["chat_template.jinja", "special_tokens_map.json", "tokenizer.json",
                             "tokenizer_config.json"]
    assert {p.name for p in theirs.iterdir()} <= set(names), "transformers wrote a file the converter does not"
    a = json.loads((ours / "tokenizer.json").read_text())
    b = json.loads((theirs / "tokenizer.json").read_text())
    assert [k for k in a if a[k] != b.get(k)] == ["pre_tokenizer"] and set(a) == set(b)
    assert a["pre_tokenizer"]["pretokenizers"][-1] == b["pre_tokenizer"]  # ours: digits first, then theirs
    assert a["pre_tokenizer"]["pretokenizers"][0]["pattern"] == {"Regex": r"\p{N}"}

    cfg = json.loads((ours / "tokenizer_config.json").read_text())
    ref = json.loads((theirs / "tokenizer_config.json").read_text())
    for k in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert cfg[k] == ref[k], k
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"], cfg["unk_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    template = (theirs / "chat_template.jinja").read_text()
    assert cfg["chat_template"] == template == (ours / "chat_template.jinja").read_text()
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and cfg["model_max_length"] == 8192
    assert cfg["add_bos_token"] is False and cfg["add_eos_token"] is False
    only_ours = set(cfg) - set(ref)
    assert only_ours == {"add_bos_token", "add_eos_token", "chat_template", "clean_up_tokenization_spaces"}, only_ours
    assert {k for k in set(cfg) & set(ref) if cfg[k] != ref[k]} == {"model_max_length", "tokenizer_class"}
    assert json.loads((ours / "special_tokens_map.json").read_text()) == {
        k: ref[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")}


def test_the_bundle_loads_in_transformers_and_renders_chat_the_same(converted, reference):
    """transformers, given the converter's folder, tokenizes and renders chat as its own conversion."""
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(str(converted[0]))
    hf = reference[0]
    for conv in CONVERSATIONS:
        a = ours.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        assert a == hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        assert ours.encode(a) == hf.encode(a)
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (hf.bos_token, hf.eos_token, hf.pad_token)


def test_conversion_time(converted, reference):
    """Measured, printed (the report's numbers); the converter is not slower than transformers."""
    ours, theirs = converted[2], reference[2]
    print(f"\nSmolLM2 GGUF tokenizer conversion: ferrum-gguf {ours:.2f} s, transformers {theirs:.2f} s")
    assert ours < theirs * 1.5 + 1


# ---- refusals ------------------------------------------------------------------------------------
def _tiny_gguf(path: Path, model: str, pre: str | None = None, merges: list[str] | None = None) -> Path:
    """A GGUF with tokenizer metadata only (no tensors): ``tokenizer.ggml.model`` = ``model``."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    tokens = ["<unk>", "<s>", "</s>", "a", "b", "ab"]
    w.add_token_list(tokens)
    w.add_token_types([2, 3, 3, 1, 1, 1])
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_merges(merges or ["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_tokenizer_types_are_refused_by_name(tmp_path):
    for model, pre, named in (("llama", None, "'llama'"), ("t5", None, "'t5'"), ("gpt2", "weird-pre", "'weird-pre'")):
        f = _tiny_gguf(tmp_path / f"{model}-{pre}.gguf", model, pre)
        with pytest.raises(gt.UnsupportedGguf, match=named):
            gt.write_files(f, tmp_path)
    assert not (tmp_path / "tokenizer.json").exists()
    # a byte-level file with a supported pre-tokenizer converts
    ok = _tiny_gguf(tmp_path / "ok.gguf", "gpt2", "gpt-2")
    out = tmp_path / "ok"
    out.mkdir()
    assert "tokenizer.json" in gt.write_files(ok, out)
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode("ab<s>a").ids == [5, 1, 3]
    # a vocabulary its merges do not fit: refused, not an internal error
    bad = _tiny_gguf(tmp_path / "bad.gguf", "gpt2", "gpt-2", merges=["a c"])
    with pytest.raises(gt.UnsupportedGguf, match="inconsistent"):
        gt.write_files(bad, out)


_TORCH_FREE_BUNDLE = """
import sys, types
sys.path.insert(0, "tests/support")
import no_torch
sys.meta_path.insert(0, no_torch.RefuseTorch())
from ferrum_service.wire import tokenizer_bundle as tb
exe = types.SimpleNamespace(tokenizer=object(), source=sys.argv[1],
                            info=lambda: types.SimpleNamespace(model_id="m"))
print("converter", tb.gguf_converter())
try:
    data = tb.tokenizer_zip(exe)
except Exception as e:
    print("error", type(e).__name__, getattr(getattr(e, "code", None), "name", None), e)
else:
    open(sys.argv[2], "wb").write(data)
    print("ok", len(data))
"""


def _torch_free_zip(src: Path, out: Path) -> str:
    r = subprocess.run([sys.executable, "-c", _TORCH_FREE_BUNDLE, str(src), str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_without_transformers_the_bundle_is_converted_or_refused_by_type(tmp_path, gguf_path):
    """With torch and transformers refused at import: SmolLM2's bundle is built by the converter;
    a SentencePiece GGUF's is a FAILED_PRECONDITION naming its type."""
    import io
    import zipfile

    out = _torch_free_zip(gguf_path, tmp_path / "smollm2.zip")
    assert f"converter {gt.CONVERTER_ID}" in out and "ok " in out, out
    names = zipfile.ZipFile(io.BytesIO((tmp_path / "smollm2.zip").read_bytes())).namelist()
    assert names == ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]

    out = _torch_free_zip(_tiny_gguf(tmp_path / "spm.gguf", "llama"), tmp_path / "spm.zip")
    assert "error" in out and "FAILED_PRECONDITION" in out and "'llama'" in out, out
    assert "torch-free" in out and not (tmp_path / "spm.zip").exists()
