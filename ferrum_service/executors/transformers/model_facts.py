"""What the executor reads off a loaded transformers causal LM: its KV shape (probed with one token
through the model's own cache), context length, vocabulary, pad and end-of-sequence ids, and the
fingerprint of its weights that KV transfer compares."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch

from ...core import errors
from .paged_kv import raw_bytes

#: transformers ``model_type`` -> the contract's model type.
MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "mixtral": "mistral",
    "qwen2": "qwen",
    "qwen3": "qwen",
    "qwen2_moe": "qwen",
    "qwen3_moe": "qwen",
    "phi": "phi",
    "phi3": "phi",
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3_text": "gemma",
}


@dataclass
class KvShape:
    """The model's K/V as its own cache stores them."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    sliding: bool  # some layers use sliding-window attention


@torch.inference_mode()
def probe_kv_shape(model: Any, device: torch.device) -> KvShape:
    """Layers, kv heads, K and V head dims, as the model's own cache stores them (one token).
    CONFIG error for linear-attention (recurrent) layers or layers of different KV shapes."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    kinds = {type(layer).__name__ for layer in cache.layers}
    if any("Linear" in k for k in kinds):
        raise errors.FerrumError(
            errors.ErrorKind.CONFIG,
            f"{type(model).__name__} has linear-attention (recurrent) layers; the paged KV executor "
            "serves attention-only models",
        )
    keys, values = cache.layers[0].keys, cache.layers[0].values
    for layer in cache.layers:
        if layer.keys.shape != keys.shape or layer.values.shape != values.shape:
            raise errors.FerrumError(
                errors.ErrorKind.CONFIG, "layers with different KV shapes are not supported by the paged pool"
            )
    sliding = any("Sliding" in k for k in kinds)
    return KvShape(len(cache.layers), keys.shape[1], keys.shape[-1], values.shape[-1], sliding)


def max_sequence_length(config: Any, tokenizer: Any, sliding: bool) -> int:
    """The config's context (else the tokenizer's, else 2048), capped at the sliding window when
    sliding layers are served with the full-attention mask."""
    n = getattr(config, "max_position_embeddings", None) or 0
    tok_max = getattr(tokenizer, "model_max_length", 0) or 0
    if not n and 0 < tok_max < 10**7:
        n = tok_max
    n = n or 2048
    window = getattr(config, "sliding_window", None)
    if sliding and window:
        n = min(n, int(window))
    return int(n)


def vocab_size(model: Any) -> int:
    """Rows of the LM head (the config's vocabulary when the head does not say)."""
    head = model.get_output_embeddings()
    if head is not None and hasattr(head, "out_features"):
        return int(head.out_features)
    return int(model.config.vocab_size)


def pad_id(config: Any, tokenizer: Any, vocab: int) -> int:
    """A token id to feed where one is needed (warm-up): the pad token when valid, else 0."""
    for v in (getattr(config, "pad_token_id", None), getattr(tokenizer, "pad_token_id", None)):
        if isinstance(v, int) and 0 <= v < vocab:
            return v
    return 0


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """End-of-sequence ids from the generation config, the model config and the tokenizer."""
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    for v in (getattr(gen, "eos_token_id", None), getattr(model.config, "eos_token_id", None)):
        for x in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(x, int) and x not in ids:
                ids.append(x)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int) and tok_eos not in ids:
        ids.append(tok_eos)
    return ids


@torch.inference_mode()
def weights_fingerprint(kind: str, model: Any) -> str:
    """Hex SHA-256 over the executor kind, the config (less its path, library version and dtype
    keys) and every weight's name, shape, dtype and bytes, in name order."""
    h = hashlib.sha256()
    h.update(f"{kind}\n".encode())
    # Where the files were and which library version wrote them do not change the K/V.
    cfg = {k: v for k, v in model.config.to_dict().items()
           if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype")}
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    for name in sorted(tensors):
        t = tensors[name].detach()
        h.update(f"\n{name}:{tuple(t.shape)}:{t.dtype}\n".encode())
        if t.numel():
            h.update(raw_bytes(t))
    return h.hexdigest()


__all__ = ["KvShape", "MODEL_TYPES", "eos_token_ids", "max_sequence_length", "pad_id", "probe_kv_shape",
           "vocab_size", "weights_fingerprint"]
