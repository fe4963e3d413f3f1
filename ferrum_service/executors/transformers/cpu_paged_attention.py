"""One-token attention that reads the paged KV pool in place on CPU: a small C++ op.

Why. A decode row's context lives in scattered blocks of :class:`~.paged_kv.BlockPool`
(``[num_blocks + 1, block_size, kv_heads, head_dim]`` per layer), shared by every sequence that
holds the same prompt. torch's SDPA needs the row's K/V as one strided tensor, so rows that are not
one contiguous run of block ids (scattered rows, n samples sharing a prompt's blocks) had to be
copied out per layer before attending, and SDPA for one-token queries reads at a fraction of the
machine's bandwidth. This op reads each row's blocks straight from the pool through its block table,
once per layer: work items over ``at::parallel_for`` are rows (split into runs of blocks, merged at
the end, only when there are fewer rows than about twice the threads); a row walks its blocks in
order, every K/V head of a block together (the block's bytes read once, sequentially, the next
block prefetched), the ``G`` query heads of a K/V head scored together (grouped-query attention
folded, no K/V expansion), with an online softmax (no score matrix, no copy). Pool dtypes: float32
and bfloat16 (accumulation in fp32).

Build. The source (``cpu_paged_attention.cpp`` beside this module) is compiled once with
``torch.utils.cpp_extension.load`` (``-O3 -fopenmp -march=native``; needs a C++ compiler and
ninja) into ``~/.cache/ferrum-service/torch-ext/<name>`` (``$FERRUM_CACHE_DIR/torch-ext`` when
set), where ``name`` hashes the source, the torch version, the Python version and the CPU's
flags; later processes load the cached library. When it cannot be built, :func:`available`
returns False after one warning log line and callers keep their own path.

Switch. :func:`set_enabled` (``False``: callers use their previous path) exists for tests and
the side-by-side benchmark.
"""

from __future__ import annotations

import hashlib
import platform
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import structlog
import torch

from ...core import settings
from ...core.private_dirs import make_private_dir

log = structlog.get_logger(__name__)

_SOURCE = Path(__file__).with_suffix(".cpp")
_CFLAGS = ("-O3", "-fopenmp", "-march=native")
_lock = threading.Lock()
_module: Any = None
_error: str | None = None
_enabled = True


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_key() -> str:
    """What the cached build depends on: the source and flags, torch, Python, the CPU (``-march=native``)."""
    h = hashlib.sha256()
    parts = (_SOURCE.read_bytes(), " ".join(_CFLAGS).encode(), torch.__version__.encode(), sys.version.encode(),
             platform.machine().encode(), _cpu_flags().encode())
    for part in parts:
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def cache_root() -> Path:
    """``FERRUM_CACHE_DIR``, else ``~/.cache/ferrum-service``."""
    return Path(settings.env("FERRUM_CACHE_DIR") or Path.home() / ".cache" / "ferrum-service")


def build_dir() -> Path:
    """Where the op is built and cached."""
    return cache_root() / "torch-ext" / f"ferrum_paged_decode_{build_key()}"


def toolchain_missing() -> str | None:
    """Why the op cannot be built here (no C++ compiler, no ninja), or None."""
    from torch.utils.cpp_extension import is_ninja_available

    cxx = settings.env("CXX") or "c++"
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} not on PATH)"
    if not is_ninja_available():
        return "ninja (needed by torch.utils.cpp_extension) not found"
    return None


def load() -> Any:
    """The compiled module (built on first use, then cached); raises when it cannot be built."""
    global _module, _error
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            missing = toolchain_missing()
            if missing:
                raise RuntimeError(missing)
            from torch.utils.cpp_extension import load as cpp_load

            d = build_dir()
            # a built .so found there is loaded: the directories must be ours alone (private_dirs.py)
            make_private_dir(d, up_to=cache_root())
            t0 = time.perf_counter()
            _module = cpp_load(name=d.name, sources=[str(_SOURCE)], build_directory=str(d),
                               extra_cflags=list(_CFLAGS), extra_ldflags=["-fopenmp"],
                               verbose=False)
            log.info("cpu paged-attention op ready", build_dir=str(d), seconds=round(time.perf_counter() - t0, 2))
    return _module


def available() -> bool:
    """True when the op is enabled and built (the first call builds it, or logs once why not)."""
    global _error
    if not _enabled:
        return False
    if _module is not None:
        return True
    if _error is not None:
        return False
    try:
        load()
        return True
    except Exception as e:  # noqa: BLE001 - any build failure means: keep the previous path
        _error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        log.warning("cpu paged-attention op unavailable: decode attention copies blocks per layer", error=_error)
        return False


def set_enabled(flag: bool) -> bool:
    """Turn the op on or off for this process (tests, benchmarks); returns the previous setting."""
    global _enabled
    prev, _enabled = _enabled, bool(flag)
    return prev


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                 lengths: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """One-token attention of ``rows`` queries over their paged context, read in place.

    ``q``: ``[rows, Hq, D]`` (any float dtype; computed in fp32); ``k_pool`` / ``v_pool``: one
    layer's pool tensors ``[blocks, block_size, Hkv, D]`` (float32 or bfloat16; query head ``i``
    reads K/V head ``i // (Hq // Hkv)``); ``block_tables``: ``[rows, max_blocks]`` block ids (int32;
    entries past a row's length are not read); ``lengths``: ``[rows]`` tokens of context per row
    (int32, >= 1, the new token's K/V already in the pool). Returns ``[rows, Hq, Dv]`` in ``q``'s
    dtype: ``softmax(q·Kᵀ·scale)·V`` over each row's first ``length`` tokens."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    out = load().paged_decode(q.float(), k_pool, v_pool, block_tables, lengths, float(scale))
    return out if q.dtype == torch.float32 else out.to(q.dtype)


__all__ = ["available", "build_dir", "build_key", "load", "paged_decode", "set_enabled", "toolchain_missing"]
