"""Hub model ids (``--model org/name[@revision]``, ``hosting/hub_models.py``) served offline from a
huggingface_hub cache this test lays out itself (blobs, refs and snapshots, as the library writes
them) with the tiny random Llama: the id, a tag and a commit resolve to their snapshots, a model
missing from the cache is refused naming the id, and options are checked against the executor
the files choose."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ferrum_client import Client

from .conftest_models import tiny_llama_dir  # noqa: F401 - fixture
from .support.servers import REPO, ServerProcess

pytest.importorskip("transformers")
REPO_ID = "test-org/tiny-llama"


def _snapshot(cache: Path, repo: str, files: Path, refs: list[str], config_patch: dict | None = None) -> str:
    """Add a snapshot of ``files`` to the cache under ``refs``; returns its commit hash."""
    root = cache / ("models--" + repo.replace("/", "--"))
    blobs, snaps = root / "blobs", root / "snapshots"
    blobs.mkdir(parents=True, exist_ok=True)
    contents = {}
    for f in sorted(files.iterdir()):
        data = f.read_bytes()
        if f.name == "config.json" and config_patch:
            data = json.dumps({**json.loads(data), **config_patch}).encode()
        contents[f.name] = data
    commit = hashlib.sha1(b"".join(contents[n] for n in sorted(contents))).hexdigest()
    snap = snaps / commit
    snap.mkdir(parents=True)
    for name, data in contents.items():
        blob = hashlib.sha256(data).hexdigest()
        (blobs / blob).write_bytes(data)
        os.symlink(os.path.relpath(blobs / blob, snap), snap / name)
    (root / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)
    return commit


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_llama_dir):  # noqa: F811
    cache = tmp_path_factory.mktemp("hf-hub")
    main = _snapshot(cache, REPO_ID, Path(tiny_llama_dir), ["main"])
    tagged = _snapshot(cache, REPO_ID, Path(tiny_llama_dir), ["v1"], {"max_position_embeddings": 96})
    return cache, main, tagged


def _env(cache: Path) -> dict[str, str]:
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_TOKEN": ""}


def test_hub_ids_load_offline_from_the_cache(hub_cache):
    cache, main, tagged = hub_cache
    specs = [f"{REPO_ID},device=cpu", f"{REPO_ID}@v1,id=tagged,device=cpu", f"{REPO_ID}@{main},id=pinned,device=cpu"]
    args = [a for s in specs for a in ("--model", s)]
    with ServerProcess(*args, env=_env(cache)) as srv, Client(srv.target) as c:
        info = {m.model_id: m for m in c.info().models}
        assert set(info) == {REPO_ID, "tagged", "pinned"}
        assert {m.executor for m in info.values()} == {"hf-causal-lm"}
        default_len = info[REPO_ID].max_sequence_length
        assert info["tagged"].max_sequence_length == 96 != default_len  # the tag's snapshot, not main's
        assert info["pinned"].max_sequence_length == default_len
        assert len(c.generate(REPO_ID, token_ids=[1, 2, 3], max_tokens=3, ignore_eos=True).tokens()) == 3


def _serve(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("FERRUM_")}
    return subprocess.run([sys.executable, "-m", "ferrum_service", "serve", "--host", "127.0.0.1", "--port", "0",
                           "--metrics-port", "0", "--log-format", "json", *args], capture_output=True, text=True,
                          cwd=REPO, env={**full, **env}, timeout=180)


def test_a_hub_id_missing_offline_or_with_a_wrong_option_exits_2(hub_cache):
    cache, _, _ = hub_cache
    r = _serve("--model", "test-org/not-there@v2", env=_env(cache))
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "Traceback" not in out, out[-1500:]
    assert "test-org/not-there@v2" in out and "offline" in out and str(cache) in out
    r = _serve("--model", f"{REPO_ID},n_ctx=64,device=cpu", env=_env(cache))  # a llama.cpp option
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "Traceback" not in out and "'n_ctx'" in out and "hf-causal-lm" in out, out[-1500:]
    r = _serve("--model", f"{REPO_ID},n_kontext=64", env=_env(cache))  # a typo: refused before any loading
    assert r.returncode == 2 and "'n_kontext'" in r.stderr and "loading model" not in r.stderr + r.stdout


def test_a_gguf_repository_chooses_llama_cpp(tmp_path):
    from ferrum_service.hosting.hub_models import executor_for

    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    assert executor_for(tmp_path) == ("llama-cpp", {"path": str(tmp_path / "a.gguf")})
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="gguf_file="):
        executor_for(tmp_path)
    assert executor_for(tmp_path, "b.gguf") == ("llama-cpp", {"path": str(tmp_path / "b.gguf")})
    shutil.rmtree(tmp_path)
    tmp_path.mkdir()
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    assert executor_for(tmp_path)[0] == "bert"
