"""The served model's tokenizer bundle (``GetTokenizer``'s zip), ready before the first request.

SMG lists a worker's model as soon as it has read ``GetModelInfo`` and answers 503 "Tokenizer not
yet registered" until ``GetTokenizer`` returns. Building the bundle is fast for a transformers
tokenizer, but a model served on llama.cpp has only its GGUF file and transformers converts the
tokenizer from the GGUF's metadata: 12-15 s for SmolLM2 on this machine. So the server builds the
bundle while it starts (``VllmEngineServicer.prepare_tokenizer``, before health is SERVING) and
keeps a converted one on disk beside the F16 weight copies (``weight_cache.cache_dir()`` /
``tokenizer-bundles``), keyed by the GGUF file (resolved path, size, modification time) and the
converter (``tokenizer_bundle.gguf_converter``: transformers and its version, or the torch-free
converter and its version): a restart reads it back in milliseconds.

A cached bundle is served only if it is a regular file (not a symlink) of at most
:data:`MAX_BUNDLE_BYTES` whose SHA-256 matches its sidecar; anything else is built again. Files are
written to a fresh temporary name (0600) and renamed into place under a file lock, so two servers
starting at once build it once and never read half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog

from ..hosting.weight_cache import cache_dir, locked
from .tokenizer_bundle import gguf_converter, tokenizer_zip

log = structlog.get_logger("ferrum_service.wire.tokenizer_cache")

#: Largest cached bundle read back (SmolLM2's is 0.6 MiB; a 256k-token vocabulary ~ 20 MiB).
MAX_BUNDLE_BYTES = 64 << 20
#: Bumped when the bundle's contents change for the same source.
BUNDLE_FORMAT = 1


def bundle_folder() -> Path:
    """Where converted tokenizer bundles are kept."""
    return cache_dir() / "tokenizer-bundles"


def gguf_source(executor: Any) -> Path | None:
    """The GGUF file a tokenizer is converted from (a llama.cpp model), else None (a tokenizer
    that saves itself: nothing worth caching)."""
    if hasattr(executor.tokenizer, "save_pretrained"):  # a tokenizer that writes its own files
        return None
    src = Path(str(executor.source or ""))
    return src if src.suffix == ".gguf" and src.is_file() else None


def bundle(executor: Any, folder: Path | None = None) -> tuple[bytes, str]:
    """The executor's tokenizer bundle and its SHA-256 hex digest: from the disk cache for a
    converted GGUF tokenizer (made there if missing or invalid), else built now. Slow on a miss:
    run it off the event loop."""
    src = gguf_source(executor)
    if src is None:
        data = tokenizer_zip(executor)
        return data, hashlib.sha256(data).hexdigest()
    folder = Path(folder) if folder is not None else bundle_folder()
    out = bundle_path(src, folder)
    hit = _read_valid(out)  # an image bakes its bundle at build into a folder it cannot write at run time
    if hit is not None:
        return hit
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        with locked(folder / f".{out.name}.lock"):
            hit = _read_valid(out)  # another server made it while we waited
            if hit is not None:
                return hit
            data, digest = _convert(executor, src)
            _write(out, data, {"source": str(src), "sha256": digest, "size": len(data)})
            log.info("tokenizer bundle cached", path=str(out))
            return data, digest
    except OSError as e:  # a read-only cache (a container's root filesystem, another owner): serve it uncached
        log.warning("tokenizer bundle cannot be cached here; converting it for this process only",
                    folder=str(folder), reason=str(e))
        return _convert(executor, src)


def _convert(executor: Any, src: Path) -> tuple[bytes, str]:
    t0 = time.perf_counter()
    data = tokenizer_zip(executor)
    log.info("tokenizer bundle converted", source=str(src), bytes=len(data), converter=gguf_converter(),
             seconds=round(time.perf_counter() - t0, 2))
    return data, hashlib.sha256(data).hexdigest()


def prepare(specs: list[str]) -> list[Path]:
    """Convert and cache the tokenizer bundles of the models ``specs`` name (an image build runs
    ``python -m ferrum_service.wire.tokenizer_cache smollm2``, so the read-only container starts
    with its bundle); the bundles' paths."""
    from ..hosting.model_specs import build_executor, parse_spec

    made = []
    for text in specs:
        ex = build_executor(parse_spec(text))
        try:
            src = gguf_source(ex)
            if src is not None:
                bundle(ex)
                made.append(bundle_path(src, bundle_folder()))
        finally:
            ex.shutdown()
    return made


def bundle_path(src: Path, folder: Path) -> Path:
    """Where the bundle converted from ``src`` is kept in ``folder``."""
    return folder / f"{src.stem}.{_source_key(src)[:16]}.tokenizer.zip"


def _source_key(src: Path) -> str:
    """The cache key of the bundle converted from ``src``: the file (resolved path, size,
    modification time), the bundle format and the converter that runs here."""
    st = src.stat()
    ident = f"{BUNDLE_FORMAT}\0{src.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{gguf_converter()}"
    return hashlib.sha256(ident.encode()).hexdigest()


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _read_valid(path: Path) -> tuple[bytes, str] | None:
    """The cached bundle if it is a regular file within the size bound matching its sidecar."""
    side = _sidecar(path)
    try:
        if path.is_symlink() or side.is_symlink() or not path.is_file():
            return None
        meta = json.loads(side.read_text())
        size = path.stat().st_size
        if size > MAX_BUNDLE_BYTES or size != meta.get("size"):
            raise ValueError(f"size {size} (sidecar {meta.get('size')}, bound {MAX_BUNDLE_BYTES})")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_BUNDLE_BYTES + 1)
        digest = hashlib.sha256(data).hexdigest()
        if digest != meta.get("sha256"):
            raise ValueError("checksum mismatch")
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("cached tokenizer bundle is not valid; building it again", path=str(path), reason=str(e))
        return None
    return data, digest


def _write(out: Path, data: bytes, meta: dict) -> None:
    """``data`` at ``out`` and ``meta`` in its sidecar, each through a fresh temporary file."""
    for target, payload in ((out, data), (_sidecar(out), json.dumps(meta).encode())):
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=out.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
            os.replace(tmp, target)  # replaces a planted symlink itself, never its target
        finally:
            Path(tmp).unlink(missing_ok=True)


__all__ = ["MAX_BUNDLE_BYTES", "bundle", "bundle_folder", "gguf_source"]


if __name__ == "__main__":  # python -m ferrum_service.wire.tokenizer_cache SPEC...
    import sys

    for path in prepare(sys.argv[1:] or ["smollm2"]):
        print(path)
