//! A router's copy of which prefix-cache blocks a replica holds, kept from its block events
//! (`SubscribeKvEvents` with `include_block_events`): `stored` adds keys, `removed` deletes them,
//! `cleared` empties the model's set, `resync_required` empties everything. A routing hint: it may
//! under-report after a resync and never lists a block the replica was not seen to store.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::client::Client;
use crate::prefix_keys::{self, BlockKey};
use crate::proto;
use crate::proto::kv_block_event::Data;
use crate::proto::subscribe_kv_events_response::Message;

/// The block keys one replica holds, per model, and its recipes (from `Info`).
#[derive(Debug, Default, Clone)]
pub struct PrefixMirror {
    blocks: HashMap<String, HashSet<BlockKey>>,
    /// The replica's `PrefixCacheRecipe` per model.
    pub recipes: HashMap<String, proto::PrefixCacheRecipe>,
    pub last_seq: u64,
    pub resyncs: u64,
    pub events_applied: u64,
}

fn key_of(b: &[u8]) -> Option<BlockKey> {
    b.try_into().ok()
}

impl PrefixMirror {
    pub fn new() -> Self {
        Self::default()
    }

    /// Apply one stream message; true when the mirror changed (or was resynchronised).
    pub fn apply(&mut self, msg: &proto::SubscribeKvEventsResponse) -> bool {
        match &msg.message {
            Some(Message::ResyncRequired(_)) => {
                self.clear();
                self.resyncs += 1;
                true
            }
            Some(Message::Event(e)) => {
                self.last_seq = self.last_seq.max(e.seq);
                false
            }
            Some(Message::BlockEvent(b)) => self.apply_block_event(b),
            None => false,
        }
    }

    /// Apply one block event.
    pub fn apply_block_event(&mut self, ev: &proto::KvBlockEvent) -> bool {
        self.last_seq = self.last_seq.max(ev.seq);
        self.events_applied += 1;
        match &ev.data {
            Some(Data::Stored(s)) => {
                let set = self.blocks.entry(ev.model_id.clone()).or_default();
                set.extend(s.block_hashes.iter().filter_map(|h| key_of(h)));
            }
            Some(Data::Removed(r)) => {
                if let Some(set) = self.blocks.get_mut(&ev.model_id) {
                    for h in r.block_hashes.iter().filter_map(|h| key_of(h)) {
                        set.remove(&h);
                    }
                }
            }
            Some(Data::Cleared(_)) => {
                self.blocks.remove(&ev.model_id);
            }
            None => return false,
        }
        true
    }

    /// Forget every block (and the sequence number).
    pub fn clear(&mut self) {
        self.blocks.clear();
        self.last_seq = 0;
    }

    /// The keys held for `model_id`.
    pub fn keys(&self, model_id: &str) -> HashSet<BlockKey> {
        self.blocks.get(model_id).cloned().unwrap_or_default()
    }

    /// Blocks held for `model_id`.
    pub fn len(&self, model_id: &str) -> usize {
        self.blocks.get(model_id).map_or(0, HashSet::len)
    }

    /// How many leading `keys` (a prompt's block keys, in chain order) the replica holds.
    pub fn cached_blocks(&self, model_id: &str, keys: &[BlockKey]) -> usize {
        match self.blocks.get(model_id) {
            Some(set) => prefix_keys::longest_cached_prefix(keys, set),
            None => 0,
        }
    }

    /// The block keys of `tokens` under the replica's recipe for `model_id` (empty without a usable one).
    pub fn prompt_keys(&self, model_id: &str, tokens: &[u32], cache_salt: &str, adapter: &str) -> Vec<BlockKey> {
        let Some(r) = self.recipes.get(model_id) else { return Vec::new() };
        if !prefix_keys::recipe_usable(r, adapter) {
            return Vec::new();
        }
        let seed = if r.seed.is_empty() { prefix_keys::SEED } else { r.seed.as_str() };
        prefix_keys::block_keys_from(prefix_keys::chain_root(model_id, cache_salt, adapter, seed), tokens, r.block_size as usize)
    }

    /// Leading tokens of `tokens` whose blocks the replica holds (a multiple of its block size).
    pub fn cached_tokens(&self, model_id: &str, tokens: &[u32], cache_salt: &str, adapter: &str) -> usize {
        let keys = self.prompt_keys(model_id, tokens, cache_salt, adapter);
        if keys.is_empty() {
            return 0;
        }
        self.cached_blocks(model_id, &keys) * self.recipes[model_id].block_size as usize
    }

    /// Take each model's recipe from an `Info` response.
    pub fn set_recipes(&mut self, info: &proto::InfoResponse) {
        self.recipes = info.models.iter().filter_map(|m| m.prefix_cache.clone().map(|r| (m.model_id.clone(), r))).collect();
    }
}

/// Keeps a [`PrefixMirror`] current from one replica on a tokio task: `Info` (the recipes), then
/// `SubscribeKvEvents(include_block_events, from_seq = 1)` (the replay buffer, then live events).
/// When seq 1 has left the buffer it reconnects from the oldest event still there; when the stream
/// breaks it empties the mirror and starts over after `retry`. Dropping it (or `stop`) ends the task.
pub struct BlockEventFollower {
    pub mirror: Arc<Mutex<PrefixMirror>>,
    connected: tokio::sync::watch::Receiver<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl BlockEventFollower {
    /// Follow `client`'s server (every model of it; the client's model is ignored).
    pub fn start(client: Client, retry: Duration) -> Self {
        let mirror = Arc::new(Mutex::new(PrefixMirror::new()));
        let (tx, connected) = tokio::sync::watch::channel(false);
        let m = mirror.clone();
        let client = client.model("");
        let task = tokio::spawn(async move {
            let mut from_seq = 1u64;
            loop {
                let mut window = None;
                if let Ok(info) = client.info().await {
                    m.lock().unwrap().set_recipes(&info);
                    if let Ok(mut stream) = client.subscribe_kv_events(Some(from_seq), true).await {
                        m.lock().unwrap().clear();
                        let _ = tx.send(true);
                        let mut first = true;
                        while let Ok(Some(msg)) = stream.message().await {
                            m.lock().unwrap().apply(&msg);
                            if let (true, 1, Some(Message::ResyncRequired(r))) = (first, from_seq, &msg.message) {
                                window = Some(r.oldest_available_seq);
                                break;
                            }
                            first = false;
                        }
                    }
                }
                let _ = tx.send(false);
                m.lock().unwrap().clear();
                match window {
                    Some(w) => from_seq = w,
                    None => {
                        from_seq = 1;
                        tokio::time::sleep(retry).await;
                    }
                }
            }
        });
        Self { mirror, connected, task }
    }

    /// Wait until the subscription is open (true) or `timeout` passes (false).
    pub async fn wait_connected(&mut self, timeout: Duration) -> bool {
        tokio::time::timeout(timeout, self.connected.wait_for(|c| *c)).await.is_ok_and(|r| r.is_ok())
    }

    /// Leading tokens of `tokens` the replica holds, per the mirror.
    pub fn cached_tokens(&self, model_id: &str, tokens: &[u32], cache_salt: &str, adapter: &str) -> usize {
        self.mirror.lock().unwrap().cached_tokens(model_id, tokens, cache_salt, adapter)
    }

    pub fn stop(&self) {
        self.task.abort();
    }
}

impl Drop for BlockEventFollower {
    fn drop(&mut self) {
        self.task.abort();
    }
}
