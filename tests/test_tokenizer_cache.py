"""The tokenizer bundle built while the server starts and kept on disk (``tokenizer_cache.py``),
on the real SmolLM2 GGUF served by llama.cpp (whose tokenizer transformers converts from the GGUF
in 12-15 s): the first ``GetTokenizer`` answers in milliseconds, a restart reads the bundle back,
and a cached bundle that was altered, or replaced by a symlink, is built again, never served."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from .support.packaged import smollm2_gguf
from .support.servers import ServerProcess

pytestmark = pytest.mark.slow

#: The first GetTokenizer after start, at most (16 ms measured here; 12.9-14.4 s before).
FIRST_ANSWER_S = 0.5


def _get_tokenizer(target: str) -> tuple[bytes, str, float]:
    with grpc.insecure_channel(target) as ch:
        eng = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        t0 = time.perf_counter()
        chunks = list(eng.GetTokenizer(cpb.GetTokenizerRequest(), timeout=120))
        took = time.perf_counter() - t0
    return b"".join(c.data for c in chunks), chunks[-1].sha256, took


def _serve(cache: Path) -> ServerProcess:
    w = ServerProcess("--model", "smollm2", env={"FERRUM_MODEL_CACHE": str(cache)}, ready_timeout=300)
    w.start()
    return w


def test_the_bundle_is_ready_at_start_cached_and_rebuilt_when_tampered(tmp_path):
    smollm2_gguf(llama_cpp=True)  # skips without the model package or llama_cpp
    w = _serve(tmp_path)
    try:
        data, digest, took = _get_tokenizer(w.target)
    finally:
        w.stop()
    print(f"\nfirst GetTokenizer after start: {took * 1000:.0f} ms (busy machine)")
    assert took < FIRST_ANSWER_S and hashlib.sha256(data).hexdigest() == digest
    (cached,) = list(tmp_path.glob("tokenizer-bundles/*.tokenizer.zip"))
    assert cached.read_bytes() == data and (cached.stat().st_mode & 0o077) == 0

    # a restart reads it back: no conversion
    w = _serve(tmp_path)
    try:
        same, _, took2 = _get_tokenizer(w.target)
    finally:
        w.stop()
    assert same == data and took2 < FIRST_ANSWER_S
    assert "converted once" not in w.log_path.read_text()

    # altered on disk (its sidecar unchanged): built again, the right bytes served
    cached.write_bytes(data[:-10] + b"tampered!!")
    w = _serve(tmp_path)
    try:
        again, digest2, _ = _get_tokenizer(w.target)
    finally:
        w.stop()
    assert again == data and digest2 == digest and cached.read_bytes() == data
    assert "cached tokenizer bundle is not valid" in w.log_path.read_text()

    # a symlink planted at its name: not followed (the target is left alone), replaced by the file
    victim = tmp_path / "victim.zip"
    victim.write_bytes(b"not a tokenizer")
    cached.unlink()
    os.symlink(victim, cached)
    w = _serve(tmp_path)
    try:
        third, _, _ = _get_tokenizer(w.target)
    finally:
        w.stop()
    assert third == data and victim.read_bytes() == b"not a tokenizer"
    assert not cached.is_symlink() and cached.read_bytes() == data


def test_without_transformers_gettokenizer_converts_torch_free(tmp_path):
    """The torch-free CPU image has no transformers (its GGUF reader imports torch): GetTokenizer
    is built by the torch-free converter (gguf + tokenizers, ``gguf_tokenizer.py``), cached under
    that converter's key, and its tokenizer.json encodes as transformers' conversion of the same
    file does; the model still generates. (A GGUF tokenizer type the converter does not support is a
    FAILED_PRECONDITION naming the type: tests/test_gguf_tokenizer.py.)"""
    import io
    import json
    import zipfile

    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    d, name = smollm2_gguf(llama_cpp=True)
    blocked = tmp_path / "no-transformers"
    (blocked / "transformers").mkdir(parents=True)
    (blocked / "transformers" / "__init__.py").write_text(
        "raise ImportError('transformers is blocked by this test (the torch-free image has none)')\n")
    cache = tmp_path / "cache"
    w = ServerProcess("--model", "smollm2", ready_timeout=300,
                      env={"FERRUM_MODEL_CACHE": str(cache),
                           "PYTHONPATH": os.pathsep.join(filter(None, [str(blocked), os.environ.get("PYTHONPATH")]))})
    w.start()
    try:
        data, digest, took = _get_tokenizer(w.target)
        from ferrum_client import Client, pb

        with Client(w.target) as c:
            evs = list(c.stub.Generate(pb.GenerateRequest(model_id="smollm2", text="Hello",
                                                          stop=pb.StopConditions(max_tokens=3, ignore_eos=True)),
                                       timeout=120))
        tokens = [ev.token.token_id for ev in evs if ev.WhichOneof("event") == "token"]
    finally:
        w.stop()
    log = w.log_path.read_text()
    assert hashlib.sha256(data).hexdigest() == digest and took < FIRST_ANSWER_S
    assert '"converter": "ferrum-gguf-' in log, log[-2000:]
    (cached,) = list(cache.glob("tokenizer-bundles/*.tokenizer.zip"))
    assert cached.read_bytes() == data
    zf = zipfile.ZipFile(io.BytesIO(data))
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(zf.namelist())
    ours = Tokenizer.from_str(zf.read("tokenizer.json").decode())
    ref = AutoTokenizer.from_pretrained(str(d), gguf_file=name)  # transformers is importable here
    texts = ["Hello, world!", "def f(x):\n    return x * 2\n", "  spaced   out\t\ttabs\n\n", "naïve café 日本語 😀",
             ref.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], tokenize=False,
                                     add_generation_prompt=True)]
    for text in texts:
        assert ours.encode(text).ids == ref.encode(text), text
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text
    cfg = json.loads(zf.read("tokenizer_config.json"))
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == (ref.bos_token, ref.eos_token, ref.pad_token)
    assert zf.read("chat_template.jinja").decode() == cfg["chat_template"] == ref.chat_template
    assert len(tokens) == 3, "the model still generates without transformers"


def test_a_cache_that_cannot_be_written_still_serves_the_bundle(tmp_path):
    """An image bakes the bundle at build into a folder its container cannot write (read-only root,
    another owner): a baked bundle is read back; without one the bundle is converted for this
    process only, never an error. Here the folder cannot be made (its parent is a file)."""
    from ferrum_service.wire import tokenizer_cache

    from .support import llama

    ex = llama.executor("tok")
    try:
        blocked = tmp_path / "a-file"
        blocked.write_bytes(b"")
        data, digest = tokenizer_cache.bundle(ex, blocked / "tokenizer-bundles")
        assert hashlib.sha256(data).hexdigest() == digest and data[:2] == b"PK"
        writable = tmp_path / "bundles"
        made = tokenizer_cache.bundle(ex, writable)
        assert made == (data, digest)  # the same bundle, now cached
        (cached,) = writable.glob("*.tokenizer.zip")
        writable.chmod(0o500)  # as the container sees a baked folder (root reads it anyway)
        assert tokenizer_cache.bundle(ex, writable) == (data, digest)
    finally:
        ex.shutdown()
