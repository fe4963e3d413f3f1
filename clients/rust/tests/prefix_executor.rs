//! `RemoteModelExecutor` and prefix caching, through ferrum's trait on a live tiny-llama server:
//! the prefix hits the server reports are counted (and shown by `cache_metrics_snapshot`), a salt
//! in the metadata keeps tenants apart, and an engine clone of a sequence (ferrum's engine hands
//! out `GenericKvCacheHandle::clone_handle()`s named `<id>-clone-<n>` from its prefix cache) is
//! mapped to a ForkCache of the source, or rebuilt by a prefill once the source is released.

use std::sync::Arc;
use std::time::Instant;

use ferrum_interfaces::kv_cache::{BlockTable, CacheHandleStats};
use ferrum_interfaces::model_executor::{DecodeInput, LogitsReturnPolicy, ModelExecutor, PrefillInput};
use ferrum_interfaces::{KvCacheHandle, TensorRef};
use ferrum_remote_executor::testing::{tiny_model_dir, ServerProcess};
use ferrum_remote_executor::{HostTensor, RemoteExecutorOptions, RemoteModelExecutor};
use ferrum_types::Device;

/// A handle the engine made (not this crate's): an id and a length, as `GenericKvCacheHandle`.
#[derive(Debug, Clone)]
struct EngineHandle {
    id: String,
    table: BlockTable,
}

impl EngineHandle {
    fn new(id: String, len: usize) -> Arc<dyn KvCacheHandle> {
        let mut table = BlockTable::new(16);
        table.sequence_length = len;
        Arc::new(Self { id, table })
    }
}

impl KvCacheHandle for EngineHandle {
    fn block_table(&self) -> &BlockTable {
        &self.table
    }
    fn block_table_mut(&mut self) -> &mut BlockTable {
        &mut self.table
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn device(&self) -> Device {
        Device::CPU
    }
    fn num_layers(&self) -> usize {
        2
    }
    fn num_heads(&self) -> usize {
        2
    }
    fn head_dim(&self) -> usize {
        16
    }
    fn key_cache(&self, _layer: usize) -> ferrum_types::Result<Option<TensorRef>> {
        Ok(None)
    }
    fn value_cache(&self, _layer: usize) -> ferrum_types::Result<Option<TensorRef>> {
        Ok(None)
    }
    fn clone_handle(&self) -> ferrum_types::Result<Arc<dyn KvCacheHandle>> {
        Ok(Arc::new(self.clone()))
    }
    fn stats(&self) -> CacheHandleStats {
        CacheHandleStats { memory_bytes: 0, blocks_allocated: 0, tokens_stored: self.table.sequence_length, utilization: 0.0, last_access: Instant::now() }
    }
    fn is_valid(&self) -> bool {
        true
    }
    fn cache_id(&self) -> String {
        self.id.clone()
    }
}

fn greedy() -> LogitsReturnPolicy {
    LogitsReturnPolicy::GreedyArgmax { token_mask: None, repetition_penalty: None }
}

async fn next_token(exec: &RemoteModelExecutor, h: Arc<dyn KvCacheHandle>, token: u32) -> u32 {
    let input = DecodeInput::new(HostTensor::token_ids_ref(&[token]), h).with_logits_policy(greedy());
    exec.decode(&input).await.expect("decode").logits.to_vec_f32().unwrap()[0] as u32
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_hits_salts_and_engine_clones() {
    let spec = format!("hf-causal-lm,id=tiny,path={}", tiny_model_dir().unwrap().display());
    let server = ServerProcess::start(&[spec]).await.expect("server");
    let exec = RemoteModelExecutor::connect(server.endpoint.clone(), RemoteExecutorOptions { model_id: "tiny".into(), ..Default::default() })
        .await
        .expect("connect");
    let prompt: Vec<u32> = (0..40).map(|i| 1 + (i * 37) % 500).collect();

    let first = exec.prefill(&PrefillInput::new(HostTensor::token_ids_ref(&prompt))).await.unwrap();
    let again = exec.prefill(&PrefillInput::new(HostTensor::token_ids_ref(&prompt))).await.unwrap();
    let s = exec.prefix_stats();
    assert_eq!((s.hit_tokens, s.queried_tokens, s.hits), (32, 80, 1));
    let mut salted = PrefillInput::new(HostTensor::token_ids_ref(&prompt));
    salted.metadata.insert("ferrum_cache_salt".into(), "tenant-b".into());
    let salted = exec.prefill(&salted).await.unwrap();
    assert_eq!(exec.prefix_stats().hit_tokens, 32, "a salted prompt must not hit the shared space");
    let m = exec.cache_metrics_snapshot().expect("metrics");
    assert_eq!(m["remote_prefix"]["hit_tokens"], 32);

    // the first token after the prompt, from the prefill's full row; then the reference continuation
    let row = first.logits.to_vec_f32().unwrap();
    let t0 = row.iter().enumerate().max_by(|a, b| a.1.partial_cmp(b.1).unwrap()).unwrap().0 as u32;
    let want = next_token(&exec, again.kv_cache.clone(), t0).await;

    // an engine clone of the first cache: a fork of its 40 prompt tokens, continuing the same way
    let src = first.kv_cache.cache_id();
    let clone = EngineHandle::new(format!("{src}-clone-1"), 40);
    assert_eq!(next_token(&exec, clone.clone(), t0).await, want);
    assert_eq!(exec.prefix_stats().clone_forks, 1);
    // the source is untouched by the clone's step: it takes the same token at position 40
    assert_eq!(next_token(&exec, first.kv_cache.clone(), t0).await, want);
    // the clone is its own cache now: a second step continues it (41 tokens)
    let _ = next_token(&exec, clone.clone(), want).await;

    // once the source is released, a new clone is rebuilt from the remembered prompt
    exec.release_cache_async(&src).await.unwrap();
    let late = EngineHandle::new(format!("{src}-clone-2"), 40);
    assert_eq!(next_token(&exec, late, t0).await, want);
    let s = exec.prefix_stats();
    assert_eq!((s.clone_forks, s.clone_prefills), (1, 1));
    // a clone of an id this executor never created is not invented: the server says NOT_FOUND
    let stranger = EngineHandle::new("someone-else-clone-1".into(), 40);
    let input = DecodeInput::new(HostTensor::token_ids_ref(&[t0]), stranger).with_logits_policy(greedy());
    let e = exec.decode(&input).await.expect_err("an unknown clone must fail");
    assert!(e.to_string().contains("someone-else-clone-1") && e.to_string().contains("unknown"), "{e}");
    for h in [&again.kv_cache, &salted.kv_cache] {
        exec.release_cache_async(&h.cache_id()).await.unwrap();
    }
}
