"""The llama.cpp executor: GGUF models run by llama.cpp (llama-cpp-python's low-level API).

- :mod:`.backend`: the bindings, the one-time backend set-up, GGUF metadata, the default KV budget.
- :mod:`.executor`: :class:`LlamaCppExecutor` (one ``llama_decode`` per step over llama.cpp's
  unified KV buffer, one sequence id per cache); :mod:`.batch`: that ``llama_decode`` (the
  ``llama_batch`` filled from a step's rows, logits rows read back).
- :mod:`.prefix`: prefix reuse over llama.cpp sequences (the contract's block keys; retired
  sequences kept, LRU).
- :mod:`.tokenizer`: the GGUF file's tokenizer and chat template, through llama.cpp.

llama-cpp-python itself is imported only when a model is loaded.
"""

from .executor import LlamaCppExecutor

__all__ = ["LlamaCppExecutor"]
