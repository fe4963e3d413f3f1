"""The transformers executor: any ``AutoModelForCausalLM`` with real, paged KV caches.

Modules (the lines vLLM v1's core uses):

- :mod:`.loading`: checkpoint files, device and dtype, weights and tokenizer (shared with the
  BERT encoder); :mod:`.int8_weights`: ``--dtype int8``; :mod:`.model_facts`: what is read off
  a loaded model (KV shape, context, vocabulary, the weights' fingerprint).
- :mod:`.kv_manager`: plan / admit / allocate / copy-on-write / rollback / fork / reserve / import
  staging over :mod:`.prefix_cache` and the block pool (:mod:`.paged_kv`).
- :mod:`.forward`: one model call over a step's rows, fresh or packed
  (:mod:`.packed_attention`), with their LoRA adapters (:mod:`.lora`).
- :mod:`.executor`: :class:`HfCausalLmExecutor`, the contract's glue, with LoRA adapter admin.

What it does
------------
Loads a local checkpoint directory (safetensors + config + tokenizer) or a GGUF file, and serves
ferrum's ``ModelExecutor`` methods with per-sequence KV caches that the executor owns and the
:class:`~ferrum_service.core.kv_registry.CacheRegistry` names. Every batched method is **one forward**:
``batch_prefill``, ``batch_decode``, ``unified_decode`` (prefill chunks and decode steps mixed) and
``forward_verify`` (N+1 tokens of one sequence) each call the model once.

KV layout, and why
------------------
A paged block pool (:mod:`.paged_kv`): per layer one K and one V tensor
``[num_blocks + 1, block_size, kv_heads, head_dim]`` sized to the configured KV budget, and a block
table (list of block ids) per cache in the registry payload. No per-sequence tensor is ever
allocated or grown (``DynamicCache.update`` ``torch.cat``-s the whole cache on every step); no
caches are left-padded and merged into a batch cache; truncation and release are metadata
operations (blocks go back to the free list).

What one step reads and writes
------------------------------
A step is one forward over rows (each: a cache, its ``past`` tokens, ``n`` new tokens).

* **Packed step** (any mix: decodes, prompt chunks continuing a cache, verify rows, new prompts of
  different lengths). The rows' new tokens are concatenated into one ``[1, T]`` input, ``T`` =
  the step's real tokens (no padding), with per-token RoPE positions. Per layer:

  - written: the ``T`` new tokens' K and V, into their slots (``index_copy_``,
    :class:`~.paged_kv.PagedWriteCache`);
  - read: each row's own ``past + n`` tokens of K/V from the pool, in place (a strided view of
    its blocks when they form one contiguous run of ids, as a prompt's do; otherwise its own
    blocks are copied once per layer into a buffer of exactly those blocks; decodes of similar
    lengths, within 25 % padding, share one batched call over a copy of their own blocks). A fresh row reads
    nothing from the pool (its new K/V are its whole context). Nothing is padded to the longest
    row of the step, no ``[B, Q, KV]`` mask is built, grouped K/V heads are not expanded
    (:mod:`.packed_attention`: per-row SDPA, one-token rows fold the query heads of a K/V head
    into the query length, longer rows use ``enable_gqa``).

  Compute is the step's ``T`` tokens through the MLPs and projections, plus each row's own
  ``n x (past + n)`` attention: a prompt joining decodes costs its own length.
* **Fresh** (the fast path) (every row a fresh prompt of the same length, e.g. a single prefill): a
  ``[B, Q]`` batch through the model's own attention (``sdpa``: the plain causal kernel); writes
  the new K/V to the pool and reads nothing from it.

The attention function is registered in transformers' attention interface, and the model's
``config._attn_implementation`` points at it; outside the executor's packed steps it delegates to
the model's original implementation, so the model stays a plain transformers model (a plain
``model(...)`` or ``generate()`` behaves as before). On CUDA the same step layout (row starts =
``cu_seqlens``, block tables, context lengths, slots) is what paged varlen kernels take
(flash-attn ``block_table``, FlashInfer / vLLM paged attention); see :mod:`.packed_attention`.

Memory: the pool holds exactly ``2 · layers · kv_heads · head_dim · dtype_bytes`` per token slot
(K and V, nothing else), plus one zero null block; a cache holds ``ceil(max(tokens, reserved) /
block_size)`` blocks, so the waste is below one block per cache. On CPU the pool is allocated with
``torch.empty``: the OS commits its pages when a block is first used, so an unused budget costs
address space, not RAM; on CUDA the budget is committed up front (as vLLM does). Reservations
(``reserve_tokens``) take their blocks at prefill time, so a reserved sequence can never run out.

Measured with the earlier padded-gather steps (SmolLM2-135M fp32, 2 CPU cores,
``python -m ferrum_service.testing.bench_causal_lm``; packed-step figures: ``benchmarks/``):
45 KiB of KV per token (2 · 30 · 3 · 64 · 4 = 46 080 B, exactly the theoretical figure; 720 KiB per
16-token block); decode 13-14 tok/s at B=1 (the model alone with a ``DynamicCache`` step: ~9 tok/s)
and 67-73 tok/s at B=8 (prompts of 16..128 tokens, one forward per step); a 128-token prefill
340-370 ms, the same as a bare ``model(ids, logits_to_keep=1)`` on this machine (±30 % noise).

Admission (:mod:`.kv_manager`) happens before any work: a step that needs more blocks than are available (free, or
cached but evictable) is refused with RESOURCE_EXHAUSTED, and nothing is allocated. The pool is
the only KV budget: blocks shared by several caches count once.

Prefix caching (:mod:`.prefix_cache`): a new sequence takes the leading full blocks that an
earlier sequence with the same tokens (and model, and ``cache_salt``) left in the index, and
computes only the rest; forks share blocks; a write into a shared or cached block copies it first.

Models with sliding-window attention layers are served with the full-attention mask, so their
context is capped at the window; models with linear-attention (recurrent) layers are refused.
"""

from .executor import DEFAULT_KV_BUDGET_BYTES, HfCausalLmExecutor

__all__ = ["DEFAULT_KV_BUDGET_BYTES", "HfCausalLmExecutor"]
