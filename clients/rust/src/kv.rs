//! `KvCacheHandle` over a server-held cache.
//!
//! The contract's executor owns every KV cache and hands out snapshots
//! (`ferrum.executor.v1.KvCacheHandle`): an opaque `cache_id` plus the length and block layout at
//! the time of the call. ferrum's own `GenericKvCacheHandle` is, in effect, the same pair
//! `(cache_id, sequence_length)`; [`RemoteKvCacheHandle`] is that pair plus the layout the server
//! reports. It holds no tensors: `key_cache`/`value_cache` return `Ok(None)`, as ferrum's
//! `GenericKvCacheHandle` does.

use std::sync::Arc;
use std::time::Instant;

use ferrum_interfaces::kv_cache::{BlockTable, CacheHandleStats, KvCacheHandle};
use ferrum_interfaces::TensorRef;
use ferrum_types::{Device, Result};

use crate::proto;

/// A snapshot of one remote KV cache.
#[derive(Debug, Clone)]
pub struct RemoteKvCacheHandle {
    cache_id: String,
    /// The caller's name for the cache when it is not the server's id (an engine-made handle
    /// or an engine clone the executor mapped): `cache_id()` keeps answering it.
    name: Option<String>,
    model_id: String,
    block_table: BlockTable,
    num_layers: usize,
    num_kv_heads: usize,
    head_dim: usize,
    memory_bytes: usize,
    device: Device,
}

impl RemoteKvCacheHandle {
    /// From the server's snapshot. `device` is where the model runs (from `ModelInfo.device`).
    pub fn from_proto(h: &proto::KvCacheHandle, device: Device) -> Self {
        let block_size = if h.block_size == 0 { 16 } else { h.block_size as usize };
        let mut block_table = BlockTable::new(block_size);
        block_table.add_blocks(&h.block_ids);
        block_table.sequence_length = h.num_tokens as usize;
        Self {
            cache_id: h.cache_id.clone(),
            name: None,
            model_id: h.model_id.clone(),
            block_table,
            num_layers: h.num_layers as usize,
            num_kv_heads: h.num_kv_heads as usize,
            head_dim: h.head_dim as usize,
            memory_bytes: h.memory_bytes as usize,
            device,
        }
    }

    /// The same cache under the caller's `name` (what `cache_id()` answers), when it differs
    /// from the server's id.
    pub fn named(mut self, name: String) -> Self {
        if name != self.cache_id {
            self.name = Some(name);
        }
        self
    }

    /// The server's id of the cache (what every RPC names).
    pub fn server_cache_id(&self) -> &str {
        &self.cache_id
    }

    /// The model the cache belongs to.
    pub fn model_id(&self) -> &str {
        &self.model_id
    }

    /// The same cache with another token count (ferrum's `GenericKvCacheHandle::with_sequence_length`),
    /// e.g. for the per-position handles of `forward_verify`.
    pub fn with_sequence_length(&self, n: usize) -> Self {
        let mut c = self.clone();
        c.block_table.sequence_length = n;
        c
    }

    /// Tokens the snapshot says the cache holds.
    pub fn sequence_length(&self) -> usize {
        self.block_table.sequence_length
    }

    /// Blocks in use according to the snapshot (`ceil(num_tokens / block_size)`).
    pub fn blocks_in_use(&self) -> usize {
        BlockTable::blocks_needed_for_length(self.block_table.sequence_length, self.block_table.block_size)
    }
}

/// The remote cache id of a handle if it is one of ours.
pub fn as_remote(h: &Arc<dyn KvCacheHandle>) -> Option<&RemoteKvCacheHandle> {
    h.as_any().downcast_ref::<RemoteKvCacheHandle>()
}

impl KvCacheHandle for RemoteKvCacheHandle {
    fn block_table(&self) -> &BlockTable {
        &self.block_table
    }
    fn block_table_mut(&mut self) -> &mut BlockTable {
        &mut self.block_table
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn device(&self) -> Device {
        self.device.clone()
    }
    fn num_layers(&self) -> usize {
        self.num_layers
    }
    fn num_heads(&self) -> usize {
        self.num_kv_heads
    }
    fn head_dim(&self) -> usize {
        self.head_dim
    }
    fn key_cache(&self, _layer: usize) -> Result<Option<TensorRef>> {
        Ok(None)
    }
    fn value_cache(&self, _layer: usize) -> Result<Option<TensorRef>> {
        Ok(None)
    }
    /// A new reference to the SAME remote cache (same `cache_id`). ferrum's
    /// `GenericKvCacheHandle` renames clones `<id>-clone-<n>`; a remote id must stay the name the
    /// server knows, so clones keep it.
    fn clone_handle(&self) -> Result<Arc<dyn KvCacheHandle>> {
        Ok(Arc::new(self.clone()))
    }
    fn stats(&self) -> CacheHandleStats {
        let blocks = self.blocks_in_use();
        let capacity = blocks * self.block_table.block_size;
        CacheHandleStats {
            memory_bytes: self.memory_bytes,
            blocks_allocated: blocks,
            tokens_stored: self.block_table.sequence_length,
            utilization: if capacity == 0 { 0.0 } else { self.block_table.sequence_length as f32 / capacity as f32 },
            last_access: Instant::now(),
        }
    }
    /// A snapshot cannot know whether the server still holds the cache; true until proven
    /// otherwise (a call naming a released cache answers NOT_FOUND → `FerrumError::NotFound`).
    fn is_valid(&self) -> bool {
        !self.cache_id.is_empty()
    }
    fn cache_id(&self) -> String {
        self.name.clone().unwrap_or_else(|| self.cache_id.clone())
    }
}
