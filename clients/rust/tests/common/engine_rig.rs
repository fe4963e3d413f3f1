//! ferrum's own engine (`ContinuousBatchEngine`, ferrum-engine 0.8.8) around a `ModelExecutor`,
//! built the way ferrum-engine's integration tests build it (`tests/continuous_batch_test.rs`):
//! default `EngineConfig`, `ContinuousBatchScheduler`, ferrum-testkit's `MockKvCacheManager`
//! (the engine's own KV bookkeeping; the model KV lives in the executor) and `MockSampler` (not
//! used on the engine's sampling path). Shared by `tests/engine.rs` and `examples/engine_bench.rs`.
#![allow(dead_code)]

use std::sync::Arc;

use ferrum_engine::ContinuousBatchEngine;
use ferrum_interfaces::model_executor::ModelExecutor;
use ferrum_interfaces::{TensorFactory, Tokenizer};
use ferrum_scheduler::implementations::ContinuousBatchScheduler;
use ferrum_testkit::{MockKvCacheManager, MockSampler};
use ferrum_types::{EngineConfig, InferenceRequest, SchedulerConfig};

/// The engine over `executor` (and, for speculative decoding, a draft executor).
pub fn engine(
    executor: Arc<dyn ModelExecutor + Send + Sync>,
    tokenizer: Arc<dyn Tokenizer + Send + Sync>,
    tensors: Arc<dyn TensorFactory>,
) -> ContinuousBatchEngine {
    engine_with(EngineConfig::default(), executor, tokenizer, tensors)
}

/// [`engine`] with another `EngineConfig` (e.g. `runtime.prefix_cache_enabled`).
pub fn engine_with(
    config: EngineConfig,
    executor: Arc<dyn ModelExecutor + Send + Sync>,
    tokenizer: Arc<dyn Tokenizer + Send + Sync>,
    tensors: Arc<dyn TensorFactory>,
) -> ContinuousBatchEngine {
    ContinuousBatchEngine::new(
        config,
        Arc::new(ContinuousBatchScheduler::new(SchedulerConfig::default())),
        tokenizer,
        Arc::new(MockSampler),
        Arc::new(MockKvCacheManager::new(4096)),
        executor,
        tensors,
    )
    .expect("legacy engine composition")
}

/// The engine in speculative mode: `draft` proposes `n` tokens per step, `executor` verifies.
pub fn speculative_engine(
    executor: Arc<dyn ModelExecutor + Send + Sync>,
    draft: Arc<dyn ModelExecutor + Send + Sync>,
    n: usize,
    tokenizer: Arc<dyn Tokenizer + Send + Sync>,
    tensors: Arc<dyn TensorFactory>,
) -> ContinuousBatchEngine {
    ContinuousBatchEngine::new_with_speculation(
        EngineConfig::default(),
        Arc::new(ContinuousBatchScheduler::new(SchedulerConfig::default())),
        tokenizer,
        Arc::new(MockSampler),
        Arc::new(MockKvCacheManager::new(4096)),
        executor,
        tensors,
        Some(draft),
        Some(ferrum_engine::speculative::SpeculativeDecodingConfig { num_speculative_tokens: n, temperature: 0.0 }),
    )
    .expect("speculative engine composition")
}

/// A greedy request for `prompt` (text for the engine's tokenizer) of `max_tokens` tokens.
pub fn greedy_request(prompt: &str, model_id: &str, max_tokens: usize) -> InferenceRequest {
    let mut req = InferenceRequest::new(prompt, model_id);
    req.sampling_params.max_tokens = max_tokens;
    req.sampling_params.temperature = 0.0;
    req
}
