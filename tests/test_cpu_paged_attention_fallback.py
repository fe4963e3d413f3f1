"""Without a C++ toolchain the CPU paged-attention op is not built: the transformers executor logs
one warning and decodes through the old path (block copy + SDPA), with the same greedy tokens.
Runs in a subprocess whose ``CXX`` names no compiler and whose build cache is empty."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from .conftest_models import tiny_llama_dir  # noqa: F401

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from ferrum_service.core.types import DecodeInput, LogitsPolicy, OutputMode, PrefillInput
    from ferrum_service.executors.transformers import HfCausalLmExecutor
    from ferrum_service.executors.transformers import cpu_paged_attention as cpa
    from ferrum_service.executors.transformers.packed_attention import build_step

    ex = HfCausalLmExecutor.from_path(sys.argv[1], model_id="tiny", device="cpu", kv_budget_tokens=2048)
    ids = [ex.prefill(PrefillInput(token_ids=list(range(5, 5 + n)),
                                   policy=LogitsPolicy(mode=OutputMode.NONE))).cache.cache_id for n in (3, 20, 40)]
    toks = [[7], [8], [9]]
    for _ in range(6):
        outs = ex.batch_decode([DecodeInput(cache_id=c, token_id=t[-1]) for c, t in zip(ids, toks)])
        for t, o in zip(toks, outs):
            t.append(int(o.logits.argmax()))
    step = build_step(ex.pool, [([1, 2], 20, 1), ([3], 5, 1)], ex.device)
    print("RESULT " + json.dumps({"available": cpa.available(), "error": cpa._error, "tokens": toks,
                                  "grouped": step.group_index is not None, "op": step.op_table is not None}))
""")


def _run(tiny_llama_dir, env_extra):
    env = {**os.environ, **env_extra}
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_llama_dir)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout + p.stderr
    line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), out


def test_without_a_compiler_the_executor_warns_once_and_uses_the_old_path(tiny_llama_dir, tmp_path):
    res, out = _run(tiny_llama_dir, {"CXX": str(tmp_path / "no-such-compiler"),
                                     "FERRUM_CACHE_DIR": str(tmp_path / "cache")})
    assert res["available"] is False and "no C++ compiler" in res["error"]
    assert out.count("cpu paged-attention op unavailable") == 1
    assert res["grouped"] and not res["op"]
    assert not (tmp_path / "cache" / "torch-ext").exists()
    # The same decode where the op can be built (the ordinary cache: built once): the same tokens.
    from ferrum_service.executors.transformers import cpu_paged_attention as cpa

    if cpa.toolchain_missing() is None:
        cpa.load()  # build it here first if this session has not yet (the subprocess then loads it)
        res_op, _ = _run(tiny_llama_dir, {})
        assert res_op["available"] is True and res_op["op"]
        assert res_op["tokens"] == res["tokens"]
