"""A cache directory other users can write to is not loaded from (audit L2).

``FERRUM_CACHE_DIR`` was trusted as it was: a built ``.so`` found under ``torch-ext/`` there is
loaded into the server, so a shared, world-writable directory in which another local user
pre-plants one meant code execution. The op's build directory (and every directory from the
cache root down to it) must now be owned by the server's user and writable by nobody else; when
it is not, the op is reported unavailable (the server keeps its fallback decode path) and nothing
is built or loaded there. The check runs in a fresh interpreter (the op is loaded once per process).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ferrum_service.core.private_dirs import untrusted_reason

REPO = Path(__file__).resolve().parents[1]

_PROBE = """
from ferrum_service.executors.transformers import cpu_paged_attention as op
print("available", op.available())
print("error", op._error)
"""


def _probe(cache_dir: Path) -> str:
    env = dict(os.environ, FERRUM_CACHE_DIR=str(cache_dir),
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "clients" / "python")]))
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=600)
    return out.stdout


def test_a_world_writable_cache_dir_is_not_built_in_or_loaded_from(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # a shared drop directory any local user can write to
    out = _probe(shared)
    assert "available False" in out and "writable by its group or by others" in out, out
    assert not (shared / "torch-ext").exists() or not any((shared / "torch-ext").rglob("*.so"))


def test_untrusted_reason_checks_the_chain_from_the_root(tmp_path):
    root = tmp_path / "cache"
    leaf = root / "torch-ext" / "build"
    leaf.mkdir(parents=True)
    for d in (root, root / "torch-ext", leaf):
        d.chmod(0o755)
    assert untrusted_reason(leaf, up_to=root) is None
    (root / "torch-ext").chmod(0o775)
    assert "group or by others" in untrusted_reason(leaf, up_to=root)
    (root / "torch-ext").chmod(0o755)
    link = root / "link"
    link.symlink_to(leaf)
    assert "symbolic link" in untrusted_reason(link, up_to=root)
    assert untrusted_reason(root / "not-yet", up_to=root) is None
