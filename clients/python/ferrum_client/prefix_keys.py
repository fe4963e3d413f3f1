"""Prefix-cache block keys, computed exactly as a ferrum-service replica computes them.

The recipe (``PrefixCacheRecipe`` in the contract, advertised in ``ModelInfo.prefix_cache``)::

    root   = SHA-256(seed || 0x00 || model_id || 0x00 || cache_salt [|| 0x00 || adapter])
    key[i] = SHA-256(key[i-1] || block i's token ids as little-endian uint32)   (key[-1] = root)

Only full blocks are keyed. A router that mirrors the replicas' ``KvBlockStored`` events computes
a new prompt's keys with :func:`block_keys` and looks them up, longest chain first.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Iterable, Sequence

ALGORITHM = "sha256-chain-v1"
SEED = "ferrum-prefix-v1"
EXTRA_KEYS = ("model_id", "cache_salt", "adapter")


def chain_root(model_id: str, cache_salt: str = "", seed: str = SEED, adapter: str = "") -> bytes:
    """The key every chain of ``model_id`` (under ``cache_salt``, computed with LoRA ``adapter``)
    starts from. An empty adapter (the base model) is left out with its separator, so base-model
    keys are what they were before adapters existed."""
    parts = (seed, model_id, cache_salt) + ((adapter,) if adapter else ())
    return hashlib.sha256(b"\0".join(s.encode() for s in parts)).digest()


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of one full block given its parent's key (or the chain root)."""
    return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}I", *tokens)).digest()


def block_keys(tokens: Sequence[int], block_size: int, *, model_id: str, cache_salt: str = "",
               parent: bytes | None = None, seed: str = SEED, adapter: str = "") -> list[bytes]:
    """Keys of the full blocks of ``tokens`` (a trailing partial block has none). ``parent``
    continues a chain whose earlier blocks were keyed already (default: the chain root)."""
    key = parent if parent is not None else chain_root(model_id, cache_salt, seed, adapter)
    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        key = block_key(key, tokens[start:start + block_size])
        keys.append(key)
    return keys


def longest_cached_prefix(keys: Iterable[bytes], cached: set[bytes] | dict) -> int:
    """How many leading keys of ``keys`` are in ``cached`` (a replica's mirrored block set)."""
    n = 0
    for k in keys:
        if k not in cached:
            break
        n += 1
    return n


__all__ = ["ALGORITHM", "SEED", "EXTRA_KEYS", "chain_root", "block_key", "block_keys", "longest_cached_prefix"]
