//! What a [`crate::RemoteModelExecutor`] keeps for prefix caching: the prefix-hit counters the
//! server reports per new cache (`PrefillOutput.cached_tokens`, `UnifiedItemResult.cached_tokens`),
//! and the prompt tokens of the caches it created, so that a clone of a sequence made by ferrum's
//! engine (its whole-prompt prefix cache hands out `GenericKvCacheHandle::clone_handle()`s named
//! `<cache id>-clone-<n>`) becomes a real server cache: a `ForkCache` of the source while it is
//! live, else a prefill of the remembered tokens (mostly served from the server's prefix cache).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Prompts remembered (server cache id → tokens), oldest dropped first.
const MAX_PROMPTS: usize = 4096;

/// Prefix counters of one executor (a snapshot: [`crate::RemoteModelExecutor::prefix_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Prompt tokens of new caches the server took from its prefix cache.
    pub hit_tokens: u64,
    /// Prompt tokens of new caches (hit rate = hit_tokens / queried_tokens).
    pub queried_tokens: u64,
    /// New caches with at least one cached token.
    pub hits: u64,
    /// Engine clones mapped to a `ForkCache` of a live source.
    pub clone_forks: u64,
    /// Engine clones whose source was gone, rebuilt by a prefill of its remembered tokens.
    pub clone_prefills: u64,
}

#[derive(Debug, Default)]
pub(crate) struct PrefixState {
    hit_tokens: AtomicU64,
    queried_tokens: AtomicU64,
    hits: AtomicU64,
    pub(crate) clone_forks: AtomicU64,
    pub(crate) clone_prefills: AtomicU64,
    prompts: Mutex<(HashMap<String, Vec<i32>>, VecDeque<String>)>,
    /// Engine names of caches (an alias: the engine's `seq_id` / handle id) → server id, kept
    /// after the release that drops the alias: the engine clones a stored handle by that name.
    names: Mutex<(HashMap<String, String>, VecDeque<String>)>,
}

impl PrefixState {
    /// A new cache of `prompt_len` tokens, `cached` of them from the prefix cache.
    pub(crate) fn note_new_cache(&self, prompt_len: usize, cached: u64) {
        self.queried_tokens.fetch_add(prompt_len as u64, Ordering::Relaxed);
        self.hit_tokens.fetch_add(cached, Ordering::Relaxed);
        if cached > 0 {
            self.hits.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// `tokens` written into server cache `id` (a new cache's prompt, or a further chunk).
    pub(crate) fn note_tokens(&self, id: &str, tokens: &[i32], new_cache: bool) {
        if id.is_empty() {
            return;
        }
        let mut g = self.prompts.lock().unwrap();
        let (map, order) = &mut *g;
        if new_cache || !map.contains_key(id) {
            if !new_cache {
                return; // a continuation of a cache whose start we never saw: nothing to rebuild from
            }
            if map.len() >= MAX_PROMPTS {
                if let Some(old) = order.pop_front() {
                    map.remove(&old);
                }
            }
            order.push_back(id.to_string());
            map.insert(id.to_string(), tokens.to_vec());
        } else if let Some(v) = map.get_mut(id) {
            v.extend_from_slice(tokens);
        }
    }

    /// `name` (an engine's name for a cache) is server cache `id`.
    pub(crate) fn note_name(&self, name: &str, id: &str) {
        let mut g = self.names.lock().unwrap();
        let (map, order) = &mut *g;
        if map.len() >= MAX_PROMPTS {
            if let Some(old) = order.pop_front() {
                map.remove(&old);
            }
        }
        if map.insert(name.to_string(), id.to_string()).is_none() {
            order.push_back(name.to_string());
        }
    }

    /// The server id an engine name stood for.
    pub(crate) fn server_id_of(&self, name: &str) -> Option<String> {
        self.names.lock().unwrap().0.get(name).cloned()
    }

    /// The first `n` tokens written into `id`, when remembered.
    pub(crate) fn prompt_prefix(&self, id: &str, n: usize) -> Option<Vec<i32>> {
        let g = self.prompts.lock().unwrap();
        g.0.get(id).filter(|t| t.len() >= n).map(|t| t[..n].to_vec())
    }

    pub(crate) fn snapshot(&self) -> PrefixStats {
        PrefixStats {
            hit_tokens: self.hit_tokens.load(Ordering::Relaxed),
            queried_tokens: self.queried_tokens.load(Ordering::Relaxed),
            hits: self.hits.load(Ordering::Relaxed),
            clone_forks: self.clone_forks.load(Ordering::Relaxed),
            clone_prefills: self.clone_prefills.load(Ordering::Relaxed),
        }
    }
}

/// `(source id, n)` when `id` names an engine clone `<source>-clone-<n>`.
pub(crate) fn clone_source(id: &str) -> Option<&str> {
    let (base, n) = id.rsplit_once("-clone-")?;
    (!base.is_empty() && !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())).then_some(base)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clone_names() {
        assert_eq!(clone_source("abc-clone-3"), Some("abc"));
        assert_eq!(clone_source("abc-clone-3-clone-12"), Some("abc-clone-3"));
        assert_eq!(clone_source("abc-clone-"), None);
        assert_eq!(clone_source("abc-clone-x"), None);
        assert_eq!(clone_source("abc"), None);
    }

    #[test]
    fn prompts_are_kept_per_cache_and_extended() {
        let s = PrefixState::default();
        s.note_tokens("a", &[1, 2, 3], true);
        s.note_tokens("a", &[4], false);
        s.note_tokens("b", &[9], false); // never saw its start
        assert_eq!(s.prompt_prefix("a", 4), Some(vec![1, 2, 3, 4]));
        assert_eq!(s.prompt_prefix("a", 5), None);
        assert_eq!(s.prompt_prefix("b", 1), None);
        s.note_new_cache(10, 8);
        s.note_new_cache(10, 0);
        assert_eq!((s.snapshot().hit_tokens, s.snapshot().queried_tokens, s.snapshot().hits), (8, 20, 1));
    }
}
