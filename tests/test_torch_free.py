"""A base install (no ``models`` extra) serves without torch: the stub, configurable and llama.cpp
executors, their sampling (numpy rows, ``core/sampling_np.py``) and the server around them.

Each server here runs under ``tests/support/no_torch.py``, which refuses ``torch`` and
``transformers`` at import even though this venv has them, and answers real RPCs on loopback.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from ferrum_client import Client
from ferrum_client import messages as m
from ferrum_service.testing.server_process import ServerProcess

from .support.servers import REPO

NO_TORCH = [sys.executable, str(REPO / "tests" / "support" / "no_torch.py")]


def test_the_refusing_runner_really_refuses_torch():
    import subprocess

    r = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'tests/support'); import no_torch;"
                        "sys.meta_path.insert(0, no_torch.RefuseTorch()); import torch"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "refused: torch-free check" in r.stderr, r.stderr


def test_stub_and_configurable_serve_every_output_kind_without_torch():
    args = ["--model", "stub,id=stub,vocab_size=100", "--model",
            "configurable,id=mock,vocab_size=1000,token_sequence=10:20:30"]
    with ServerProcess(args, command=NO_TORCH, cwd=REPO) as srv, Client(srv.target) as c:
        assert c.health() == "SERVING"
        out = c.prefill("mock", [1, 2, 3]).output
        assert out.output.token_id == 10
        cid = out.cache.cache_id
        # the configurable rows: 10.0 at the scripted token (10, then 10, 20, 30 per decode step)
        assert c.decode("mock", cid, 10).output.output.token_id == 10
        full = c.decode("mock", cid, 10, policy=m.full_logits("bf16")).output.output
        row = m.logits_array(full)
        assert row[20] == 10.0 and np.count_nonzero(row) == 1
        top = c.prefill("mock", [1], policy=m.top_logprobs(2)).output.output
        assert [t.token_id for t in top.top_logprobs][0] == 10
        # seeded sampling over the stub's uniform rows: reproducible, and it does draw
        scid = c.prefill("stub", [1]).output.cache.cache_id
        pol = m.sampled(m.sampling(temperature=1.0, seed=5, top_k=50))
        draws = [c.decode("stub", scid, 1, policy=pol).output.output.token_id for _ in range(12)]
        c.truncate_kv("stub", scid, 1)
        again = [c.decode("stub", scid, 1, policy=pol).output.output.token_id for _ in range(12)]
        assert draws == again and len(set(draws)) > 3 and max(draws) < 100
        events = list(c.generate("mock", token_ids=[1, 2], max_tokens=4))
        tokens = [e.token.token_id for e in events if e.WhichOneof("event") == "token"]
        assert len(tokens) == 4 and set(tokens) <= {10, 20, 30}, tokens  # the script (its counter is shared)


def test_llama_cpp_serves_without_torch():
    from .support.llama import gguf

    path = gguf()  # skips when llama_cpp or the model package is missing
    spec = f"llama-cpp,id=llama,path={path},n_ctx=512,threads=2"
    prompt = [1, 504, 3458, 282, 4649, 314]
    with ServerProcess(["--model", spec, "--device", "cpu"], command=NO_TORCH, cwd=REPO,
                       ready_timeout=300) as srv, Client(srv.target) as c:
        greedy = [e.token.token_id for e in c.generate("llama", token_ids=prompt, max_tokens=6)
                  if e.WhichOneof("event") == "token"]
        assert len(greedy) == 6
        seeded = m.sampled(m.sampling(temperature=0.8, seed=11, top_p=0.9))
        a = c.prefill("llama", prompt, policy=seeded).output.output.token_id
        b = c.prefill("llama", prompt, policy=seeded).output.output.token_id
        assert a == b
    # the same greedy tokens as the server with torch importable
    with ServerProcess(["--model", spec, "--device", "cpu"], cwd=REPO, ready_timeout=300) as srv, \
            Client(srv.target) as c:
        ref = [e.token.token_id for e in c.generate("llama", token_ids=prompt, max_tokens=6)
               if e.WhichOneof("event") == "token"]
    assert greedy == ref
