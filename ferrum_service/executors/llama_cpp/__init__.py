"""The llama.cpp executor: GGUF models run by llama.cpp (llama-cpp-python's low-level API).

- :mod:`.backend`: the bindings, the one-time backend set-up, GGUF metadata, the default KV budget.
- :mod:`.executor`: :class:`LlamaCppExecutor` (one ``llama_decode`` per step over llama.cpp's
  KV, one sequence id per cache); :mod:`.batch`: that ``llama_decode`` (the ``llama_batch``
  filled from a step's rows in sequence-id order, logits rows read back).
- :mod:`.sequences`: the KV layout (``kv=unified`` or one stream per sequence), sequence ids
  (lowest first) and copies of a sequence's prefix legal in the layout.
- :mod:`.prefix`: prefix reuse over llama.cpp sequences (the contract's block keys; retired
  sequences kept, LRU).
- :mod:`.tokenizer`: the GGUF file's tokenizer and chat template, through llama.cpp.

llama-cpp-python itself is imported only when a model is loaded.
"""

from .executor import LlamaCppExecutor

__all__ = ["LlamaCppExecutor"]
