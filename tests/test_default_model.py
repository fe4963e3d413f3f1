"""The default model answers right: the ``smollm2`` preset on llama.cpp serves an F16 copy of the
packaged Q4_1 GGUF (``weight_cache.py``), sized its KV budget from memory, and every answer a
caller sees on the default path is checked end to end here.

* the README's own example (``ferrum-service generate "What is the capital of France?"``) says Paris;
* greedy ``Generate`` on the default preset equals llama.cpp's own greedy loop on the served file;
* 8 caches of 1,536-token prompts (1,600 tokens reserved each) are admitted at once;
* the F16 copy is made once, checked, made again when corrupt, and never read half-written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from ferrum_client import Client

from .support.llama import gguf
from .support.servers import REPO, ServerProcess

pytestmark = pytest.mark.slow

M = "smollm2"
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write one sentence about the sea.",
    "What is 12 plus 7?",
    "Give me a synonym for happy.",
]


@pytest.fixture(scope="module")
def default_server():
    """``serve --model smollm2`` on this machine (no CUDA: llama.cpp, the F16 copy)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("with CUDA the smollm2 preset runs on transformers")
    gguf()  # skips when llama_cpp or the model package is missing
    # --origin-idle-ttl 0: on a loaded machine eight 1,536-token prefills queued behind each other
    # take longer than the 60 s after which an origin with no new call counts as gone (calls in
    # flight do not count as activity yet), and the first cache would be reclaimed mid-test.
    with ServerProcess("--model", M, "--origin-idle-ttl", "0", ready_timeout=300) as srv:
        yield srv


def test_readme_generate_example_answers_paris(default_server):
    r = subprocess.run([sys.executable, "-m", "ferrum_service", "generate", "What is the capital of France?",
                        "--target", default_server.target], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout, r.stdout
    assert "FINISH_REASON_EOS" in r.stderr + r.stdout  # a short answer that ends, not 128 tokens of rambling


def test_default_serves_an_f16_copy_with_a_memory_sized_budget(default_server):
    with Client(default_server.target) as c:
        (info,) = [x for x in c.info().models if x.model_id == M]
        assert info.executor == "llama-cpp"
        assert info.metadata["source"].endswith(".f16.gguf"), info.metadata["source"]
        cap = c.kv_capacity(M)
        # 16 sequences of 2,048 tokens fit on a machine with the memory this one has (10% of
        # MemAvailable at load; the floor is 8,192 tokens where memory is short).
        from ferrum_service.executors.llama_cpp.backend import available_memory_bytes

        if (available_memory_bytes() or 0) > 12 * 2**30:
            assert cap.total_tokens >= 16 * 2048, cap
        assert cap.total_bytes == cap.total_tokens * cap.bytes_per_token
        assert int(info.metadata["kv_budget_bytes"]) == cap.total_bytes
        (load,) = c.loads(M).loads
        assert load.total_blocks * load.block_size == cap.total_tokens


def test_greedy_generate_equals_llama_cpps_own_loop_on_the_served_file(default_server):
    from llama_cpp import Llama

    n = 24
    with Client(default_server.target) as c:
        (info,) = [x for x in c.info().models if x.model_id == M]
        prompts = [list(c.apply_chat_template(M, [("user", p)]).token_ids) for p in CHAT_PROMPTS]
        got = []
        for ids in prompts:
            ev = list(c.generate(M, token_ids=ids, max_tokens=n, temperature=0.0, ignore_eos=True))
            got.append([e.token.token_id for e in ev if e.WhichOneof("event") == "token"])
    ref_llm = Llama(info.metadata["source"], n_ctx=2048, n_threads=2, flash_attn=True, verbose=False)
    try:
        for ids, mine in zip(prompts, got):
            ref = []
            for t in ref_llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
                ref.append(t)
                if len(ref) == n:
                    break
            assert mine == ref, (ref_llm.detokenize(ids), mine, ref)
    finally:
        ref_llm.close()


def test_eight_sessions_of_1536_tokens_are_admitted_at_once(default_server):
    with Client(default_server.target, timeout=600) as c:  # 12k prompt tokens on 2 cores
        # eight prompts that differ in their first block, so the prefix cache shares nothing
        prompts = [list(c.tokenize(M, f"Chapter {i}. " + "The history of the printing press in Europe. " * 200,
                                   False))[:1536] for i in range(8)]
        assert all(len(p) == 1536 for p in prompts)
        caches, errors = [], []

        def one(i: int) -> None:
            try:
                ids = prompts[i]
                out = c.prefill(M, ids, reserve_tokens=1600).output
                caches.append(out.cache.cache_id)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        try:
            assert not errors, errors
            assert len(caches) == 8
            cap = c.kv_capacity(M)
            assert cap.used_tokens == 8 * 1536 and cap.used_tokens + cap.reserved_tokens == 8 * 1600, cap
        finally:
            for cid in caches:
                c.release_cache(M, cid)


# ---- the F16 copy: made once, checked, atomic ----------------------------------------------------
def _convert_in_subprocess(folder, src: str) -> subprocess.Popen:
    code = ("import sys; from ferrum_service.hosting.weight_cache import converted_gguf; "
            "print(converted_gguf(sys.argv[1], 'f16'))")
    return subprocess.Popen([sys.executable, "-c", code, src], env={**os.environ, "FERRUM_MODEL_CACHE": str(folder)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def test_f16_copy_is_made_once_by_two_servers_starting_at_once(tmp_path):
    src = gguf()
    procs = [_convert_in_subprocess(tmp_path, src) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    paths = {o[0].strip().splitlines()[-1] for o in outs}  # the path is the last line (logs come first)
    assert len(paths) == 1, outs
    made = [o for o in outs if "converting weights once" in o[0] + o[1]]
    assert len(made) == 1, "the copy was made twice: the lock did not hold the second process"
    from ferrum_service.hosting.weight_cache import file_sha256

    out = paths.pop()
    meta = json.loads(open(out + ".json").read())
    assert meta["sha256"] == file_sha256(out) and meta["source_sha256"] == file_sha256(src)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        os.path.basename(out), os.path.basename(out) + ".json"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    # readable by other users: the image bakes the copy as root and serves it as uid 10001
    assert os.stat(out).st_mode & 0o044 == 0o044 and os.stat(out + ".json").st_mode & 0o044 == 0o044


def test_f16_copy_is_made_again_when_corrupt_or_missing(tmp_path):
    from ferrum_service.hosting.weight_cache import converted_gguf, file_sha256

    src = gguf()
    out = converted_gguf(src, "f16", folder=tmp_path)
    good = file_sha256(out)
    mtime = out.stat().st_mtime_ns
    assert converted_gguf(src, "f16", folder=tmp_path) == out and out.stat().st_mtime_ns == mtime  # reused
    with open(out, "r+b") as f:  # one flipped byte in the middle: same size, wrong checksum
        f.seek(out.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    assert converted_gguf(src, "f16", folder=tmp_path) == out and file_sha256(out) == good
    with open(out, "r+b") as f:  # a half-written file
        f.truncate(out.stat().st_size // 3)
    assert converted_gguf(src, "f16", folder=tmp_path) == out and file_sha256(out) == good
    out.with_name(out.name + ".json").unlink()  # no sidecar: cannot be trusted
    assert converted_gguf(src, "f16", folder=tmp_path) == out and file_sha256(out) == good


# ---- spec options: quant= and the byte budget ----------------------------------------------------
def test_quant_option_serves_the_packaged_q4_1_file_and_refuses_unknown_formats():
    from ferrum_service.hosting.model_specs import build_executor, parse_spec

    src = gguf()
    ex = build_executor(parse_spec("smollm2-llama,quant=q4_1,n_ctx=512,threads=2"), device="cpu")
    assert ex.info().metadata["source"] == src
    with pytest.raises(ValueError, match="quant='q3'"):
        build_executor(parse_spec("smollm2-llama,quant=q3"), device="cpu")
    with pytest.raises(ValueError, match="quant='q4_1'"):  # a plain llama-cpp spec has no packaged format
        build_executor(parse_spec(f"llama-cpp,path={src},quant=q4_1"), device="cpu")


def test_kv_budget_bytes_sizes_the_llama_cpp_buffer():
    from ferrum_service.hosting.model_specs import build_executor, parse_spec

    src = gguf()
    ex = build_executor(parse_spec(f"llama-cpp,id=b,path={src},threads=2"), device="cpu", kv_budget_bytes=23040 * 1000)
    bpt = ex.registry.bytes_per_token
    assert bpt == 2 * 30 * 3 * 64 * 2  # f16 K and V, 30 layers, 3 KV heads of 64
    assert 1000 <= ex.kv_capacity().total_tokens < 1000 + 256  # llama.cpp rounds cells up to its padding
    assert ex.kv_capacity().total_tokens == ex.n_ctx
    # a spec's budget in tokens wins over a server-wide one in bytes
    ex2 = build_executor(parse_spec(f"llama-cpp,id=c,path={src},threads=2,kv_budget_tokens=512"), device="cpu",
                         kv_budget_bytes=23040 * 1000)
    assert ex2.kv_capacity().total_tokens == 512
