//! Prefix-cache block keys, computed exactly as a ferrum-service replica computes them (the
//! `PrefixCacheRecipe` a model advertises in `ModelInfo.prefix_cache`, "sha256-chain-v1"):
//!
//! ```text
//! root   = SHA-256(seed || 0x00 || model_id || 0x00 || cache_salt [|| 0x00 || adapter])
//! key[i] = SHA-256(key[i-1] || block i's token ids as little-endian uint32)   (key[-1] = root)
//! ```
//!
//! Only full blocks are keyed; an empty adapter (the base model) is left out with its separator.

use sha2::{Digest, Sha256};

use crate::proto;

/// A block key (32 bytes).
pub type BlockKey = [u8; 32];

pub const ALGORITHM: &str = "sha256-chain-v1";
pub const SEED: &str = "ferrum-prefix-v1";
pub const EXTRA_KEYS: [&str; 3] = ["model_id", "cache_salt", "adapter"];

/// The key every chain of `model_id` (under `cache_salt`, computed with LoRA `adapter`) starts from.
pub fn chain_root(model_id: &str, cache_salt: &str, adapter: &str, seed: &str) -> BlockKey {
    let mut h = Sha256::new();
    h.update(seed.as_bytes());
    h.update([0u8]);
    h.update(model_id.as_bytes());
    h.update([0u8]);
    h.update(cache_salt.as_bytes());
    if !adapter.is_empty() {
        h.update([0u8]);
        h.update(adapter.as_bytes());
    }
    h.finalize().into()
}

/// The key of one full block given its parent's key (or the chain root).
pub fn block_key(parent: &BlockKey, tokens: &[u32]) -> BlockKey {
    let mut h = Sha256::new();
    h.update(parent);
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    h.finalize().into()
}

/// Keys of the full blocks of `tokens`, continuing from `parent` (a trailing partial block has none).
pub fn block_keys_from(parent: BlockKey, tokens: &[u32], block_size: usize) -> Vec<BlockKey> {
    assert!(block_size > 0, "block size must be positive");
    let mut key = parent;
    tokens
        .chunks_exact(block_size)
        .map(|b| {
            key = block_key(&key, b);
            key
        })
        .collect()
}

/// Keys of the full blocks of `tokens` from the chain root of (`model_id`, `cache_salt`, `adapter`).
pub fn block_keys(tokens: &[u32], block_size: usize, model_id: &str, cache_salt: &str, adapter: &str) -> Vec<BlockKey> {
    block_keys_from(chain_root(model_id, cache_salt, adapter, SEED), tokens, block_size)
}

/// How many leading `keys` are in `cached`.
pub fn longest_cached_prefix(keys: &[BlockKey], cached: &std::collections::HashSet<BlockKey>) -> usize {
    keys.iter().take_while(|k| cached.contains(*k)).count()
}

/// True when `recipe` is one this client computes (and caching is on) for a sequence with LoRA
/// `adapter` ("" = the base model): a recipe without the "adapter" key keys base-model sequences only.
pub fn recipe_usable(recipe: &proto::PrefixCacheRecipe, adapter: &str) -> bool {
    if !recipe.enabled || recipe.block_size == 0 || recipe.algorithm != ALGORITHM {
        return false;
    }
    let ek: Vec<&str> = recipe.extra_keys.iter().map(String::as_str).collect();
    let known = ek.is_empty() || ek == ["model_id", "cache_salt"] || ek == EXTRA_KEYS;
    known && (adapter.is_empty() || ek.contains(&"adapter"))
}

/// Lower-case hex of a key.
pub fn hex(k: &[u8]) -> String {
    k.iter().map(|b| format!("{b:02x}")).collect()
}
