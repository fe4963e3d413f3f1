"""The derived-weights cache keeps each source's copy apart and follows no planted links (audit L3).

A copy was named ``<source stem>.<ftype>.gguf``: two different ``model.gguf`` files converted into
one cache directory shared one copy, and a server could load the other source's conversion under
its own model id. Its lock was opened with ``open(path, "a")``, following a symlink planted at that
predictable name. The copy's name now carries its source's digest, and the lock is opened without
following links. Real files in a temporary directory; copies are planted with valid sidecars so
that no conversion runs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from ferrum_service.hosting import weight_cache


def _plant_copy(folder: Path, src: Path, name: str) -> Path:
    """A converted copy as the cache writes it: the file and its sidecar."""
    out = folder / name
    out.write_bytes(b"converted " + src.read_bytes())
    meta = {"source": str(src), "source_sha256": weight_cache.file_sha256(src), "format": "f16",
            "sha256": hashlib.sha256(out.read_bytes()).hexdigest(), "size": out.stat().st_size}
    (folder / (name + ".json")).write_text(json.dumps(meta))
    return out


def _name(src: Path) -> str:
    return f"{src.stem}.{weight_cache.file_sha256(src)[:16]}.f16.gguf"


def test_two_sources_with_one_stem_get_their_own_copies(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    a, b = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for p, data in ((a, b"weights A"), (b, b"weights B")):
        p.parent.mkdir()
        p.write_bytes(data)
    copy_a = _plant_copy(cache, a, _name(a))
    copy_b = _plant_copy(cache, b, _name(b))
    assert weight_cache.converted_gguf(a, "f16", folder=cache) == copy_a
    assert weight_cache.converted_gguf(b, "f16", folder=cache) == copy_b
    assert copy_a != copy_b


def test_a_symlink_planted_at_the_lock_is_not_followed(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    src = tmp_path / "model.gguf"
    src.write_bytes(b"weights")
    victim = tmp_path / "victim-file"
    for name in (_name(src), "model.f16.gguf"):  # where the lock is, and where it was before
        (cache / f".{name}.lock").symlink_to(victim)
    with pytest.raises(OSError):
        weight_cache.converted_gguf(src, "f16", folder=cache)
    assert not victim.exists()  # nothing was created or written through the link
