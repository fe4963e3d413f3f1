"""llama.cpp itself: the bindings, the one-time backend set-up (its log into ours), GGUF metadata,
and the default KV budget sized from the memory available at load."""

from __future__ import annotations

import ctypes

import structlog

from .cpu_variants import load_cpu_variant

log = structlog.get_logger(__name__)

#: The least KV cells (tokens over all sequences) a default budget gives.
DEFAULT_N_CTX = 8192
#: The default KV budget: this fraction of the memory available at load (``MemAvailable``), at
#: most what ``n_seq`` sequences of the model's training context need.
DEFAULT_KV_MEMORY_FRACTION = 0.10
#: Sequence ids (live caches) when none is configured.
DEFAULT_N_SEQ = 64
#: The KV layout when none is configured (``kv=``; :mod:`.sequences`).
DEFAULT_LAYOUT = "unified"

#: GGUF ``general.architecture`` -> the contract's model type.
ARCH_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen", "qwen3": "qwen", "phi3": "phi",
              "gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma"}


def lib():
    """llama-cpp-python's low-level bindings (imported on first use: the server runs without them)."""
    import llama_cpp.llama_cpp as L

    return L


_backend_ready = False


_log_cb = None


def init_backend(L) -> None:
    """Initialise llama.cpp once; its log goes to structlog, errors only (it logs every tensor). A build
    with per-CPU backend variants gets the best one loaded first (:mod:`.cpu_variants`)."""
    global _backend_ready, _log_cb
    if _backend_ready:
        return

    def on_log(level: int, text: bytes, _user: object) -> None:
        # ggml_log_level: 3 = WARN, 4 = ERROR (5 = CONT continues the previous line: dropped).
        if level not in (3, 4):
            return
        message = text.decode("utf-8", errors="replace").rstrip()
        if "possible training context overflow" in message:
            # n_ctx is the budget over all sequences of the unified buffer; each sequence is held
            # to the training context by the registry (max_sequence_length), so this cannot happen.
            return
        (log.error if level == 4 else log.warning)("llama.cpp", message=message)

    _log_cb = L.llama_log_callback(on_log)  # kept referenced: llama.cpp holds the pointer
    L.llama_log_set(_log_cb, None)
    load_cpu_variant()  # a build for any x86-64 CPU: its best CPU backend, before llama_backend_init
    L.llama_backend_init()
    _backend_ready = True


def available_memory_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def default_kv_tokens(bytes_per_token: int, n_seq: int, train_ctx: int) -> int:
    """The default KV budget in tokens: :data:`DEFAULT_KV_MEMORY_FRACTION` of the available
    memory, at most ``n_seq`` sequences of ``train_ctx`` tokens, at least :data:`DEFAULT_N_CTX`
    (or one training context, if smaller)."""
    avail = available_memory_bytes()
    ceiling = n_seq * train_ctx
    floor = min(DEFAULT_N_CTX, ceiling)
    if avail is None:
        return floor
    return max(floor, min(ceiling, int(avail * DEFAULT_KV_MEMORY_FRACTION) // bytes_per_token))


def meta(L, model, key: str) -> str:
    """A GGUF metadata value of a loaded model, as text ("" when absent)."""
    buf = ctypes.create_string_buffer(1024)
    n = L.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", errors="replace") if n >= 0 else ""


__all__ = ["ARCH_TYPES", "DEFAULT_LAYOUT", "DEFAULT_KV_MEMORY_FRACTION", "DEFAULT_N_CTX", "DEFAULT_N_SEQ", "available_memory_bytes",
           "default_kv_tokens", "init_backend", "lib", "meta"]
