"""Prefix-cache block keys, computed exactly as a ferrum-service replica computes them.

The recipe (``PrefixCacheRecipe`` in the contract, advertised in ``ModelInfo.prefix_cache``)::

    root   = SHA-256(seed || 0x00 || model_id || 0x00 || cache_salt [|| 0x00 || adapter])
    key[i] = SHA-256(key[i-1] || block i's token ids as little-endian uint32)   (key[-1] = root)

Only full blocks are keyed. A router that mirrors the replicas' ``KvBlockStored`` events computes
a new prompt's keys with :func:`block_keys` and looks them up, longest chain first.

Key spaces under per-caller identity: when a server authenticates callers (bearer tokens or client
certificates), the ``cache_salt`` in the recipe is the request's salt with the caller's identity
folded in (:func:`caller_salt`), so every caller has its own key space by default; a salt that
starts with :data:`SHARED_SALT_PREFIX` opts into a space shared by everyone who sends that salt.
A router that acts as one caller computes its keys with ``cache_salt=caller_salt(
token_caller(token), salt)``. Servers without authentication use the salt as sent.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Iterable, Sequence

ALGORITHM = "sha256-chain-v1"
SEED = "ferrum-prefix-v1"
EXTRA_KEYS = ("model_id", "cache_salt", "adapter")
#: A ``cache_salt`` starting with this opts into a key space shared by every caller that sends the
#: same salt (under per-caller identity; without authentication every salt is shared anyway).
SHARED_SALT_PREFIX = "shared:"


def token_caller(token: str) -> str:
    """The identity a server gives the caller of bearer ``token`` (``token:`` + 32 hex digits of
    its SHA-256; the token itself is never kept)."""
    return "token:" + hashlib.sha256(token.strip().encode()).hexdigest()[:32]


def caller_salt(caller: str, cache_salt: str = "", *, shared_allowed: bool = True) -> str:
    """The salt a server keys blocks with for ``caller``'s request salt ``cache_salt``.

    No caller (a server without authentication), or a salt starting with
    :data:`SHARED_SALT_PREFIX` (when ``shared_allowed``): the salt as sent. Otherwise
    ``"\\0caller:" + len(caller) + ":" + caller + "\\0" + cache_salt``: servers refuse NUL and
    other control characters in request salts, and the identity is length-prefixed, so this
    can equal neither a plain salt nor another caller's."""
    if not caller or (shared_allowed and cache_salt.startswith(SHARED_SALT_PREFIX)):
        return cache_salt
    return f"\0caller:{len(caller)}:{caller}\0{cache_salt}"


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


__all__ = ["ALGORITHM", "SEED", "EXTRA_KEYS", "SHARED_SALT_PREFIX", "caller_salt", "token_caller", "chain_root",
           "block_key", "block_keys", "longest_cached_prefix"]
