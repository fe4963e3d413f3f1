"""llama.cpp built for any x86-64 CPU: its CPU backend as one shared library per instruction-set
level (``libggml-cpu-haswell.so``, ``libggml-cpu-skylakex.so``, ...), the best one picked at run time.

Such a build (``GGML_BACKEND_DL`` + ``GGML_CPU_ALL_VARIANTS``, deploy/portable-llama-wheel.sh; the CPU
image ships it) links no CPU backend into ``libggml``: something must load one before the first model.
``llama_backend_init`` tries (``ggml_backend_load_all``), but it looks in the Python executable's
directory and the working directory, not beside ``libggml.so`` in the ``llama_cpp`` package, so it
finds none and every model load fails. :func:`load_cpu_variant` asks ggml to load the best variant
from the package's library directory instead (``ggml_backend_load_all_from_path``: each variant
scores the CPU it runs on, the highest loads). A build with the CPU backend linked in (the default,
and scripts/bootstrap.sh's native wheel) has no such files and is left alone.
"""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

import structlog

from ...core import settings

log = structlog.get_logger(__name__)

#: The per-variant CPU backends of a GGML_CPU_ALL_VARIANTS build.
VARIANT_GLOB = "libggml-cpu-*.so"
_MAPPED_VARIANT = re.compile(r"/libggml-cpu-([A-Za-z0-9_]+)\.so")


def llama_lib_dir() -> Path:
    """The directory llama-cpp-python loads its shared libraries from (``LLAMA_CPP_LIB_PATH``, as
    llama-cpp-python reads it, else ``llama_cpp/lib`` in the installed package)."""
    override = settings.env("LLAMA_CPP_LIB_PATH")
    if override:
        return Path(override)
    import llama_cpp

    return Path(llama_cpp.__file__).resolve().parent / "lib"


def variant_files(lib_dir: Path) -> list[Path]:
    """The per-variant CPU backends in ``lib_dir`` (empty: the CPU backend is linked in)."""
    return sorted(lib_dir.glob(VARIANT_GLOB))


def ggml_library(lib_dir: Path) -> Path:
    """The ``libggml`` file that ``libllama`` links (its soname, ``libggml.so.0``, found beside it
    through its ``$ORIGIN`` run path). A wheel stores ``libggml.so`` and ``libggml.so.0`` as two
    copies, not a link; opening the other copy would load a second ggml whose backend registry
    llama.cpp never sees."""
    soname = lib_dir / "libggml.so.0"
    return soname if soname.exists() else lib_dir / "libggml.so"


def mapped_variant(maps: str) -> str | None:
    """The CPU variant loaded into this process, read from ``/proc/self/maps`` text (ggml opens
    each candidate to score it and keeps only the one it picked)."""
    found = {m.group(1) for m in _MAPPED_VARIANT.finditer(maps)}
    return found.pop() if len(found) == 1 else None


_loaded: str | None = None


def load_cpu_variant(lib_dir: Path | None = None) -> str | None:
    """Load the best CPU variant of a dynamic-backend llama.cpp build, once per process, before the
    first model load. Returns the variant's name (``"haswell"``, ...), or None for a build with the
    CPU backend linked in (nothing to do). RuntimeError when the build has variants but none loads on
    this CPU (the model load would fail with a less clear message)."""
    global _loaded
    if _loaded is not None:
        return _loaded
    lib_dir = llama_lib_dir() if lib_dir is None else lib_dir
    variants = variant_files(lib_dir)
    if not variants:
        return None
    ggml = ctypes.CDLL(str(ggml_library(lib_dir)))  # the library libllama already opened
    ggml.ggml_backend_reg_count.restype = ctypes.c_size_t
    ggml.ggml_backend_reg_count.argtypes = []
    ggml.ggml_backend_load_all_from_path.restype = None
    ggml.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
    if ggml.ggml_backend_reg_count() == 0:
        ggml.ggml_backend_load_all_from_path(os.fsencode(lib_dir))
    if ggml.ggml_backend_reg_count() == 0:
        raise RuntimeError(
            f"llama.cpp: none of the {len(variants)} CPU backend variants in {lib_dir} "
            f"({', '.join(p.name for p in variants)}) loads on this CPU")
    try:
        name = mapped_variant(Path("/proc/self/maps").read_text())
    except OSError:
        name = None
    _loaded = name or "unknown"
    log.info("llama.cpp CPU backend variant loaded", variant=_loaded, lib_dir=str(lib_dir))
    return _loaded


__all__ = ["VARIANT_GLOB", "ggml_library", "llama_lib_dir", "load_cpu_variant", "mapped_variant", "variant_files"]
