//! ferrum-engine 0.18.4's `ContinuousBatchEngine` around a remote executor, built as ferrum-engine
//! 0.18.4's own integration tests build it (`tests/continuous_batch_test.rs`): default
//! `EngineConfig` and `SchedulerConfig`, `ContinuousBatchScheduler`, ferrum-testkit's `MockSampler`
//! (greedy requests never reach it: the executor answers `GreedyToken`), the executor owned by an
//! `ExecutorOwner`. Shared by `tests/engine.rs` and `examples/engine_bench_018.rs`.
#![allow(dead_code)]

use std::sync::Arc;

use ferrum_engine::ContinuousBatchEngine;
use ferrum_execution::executor_lifecycle::ExecutorOwner;
use ferrum_execution::ModelExecutor;
use ferrum_remote_execution::id_tokenizer::IdTokenizer;
use ferrum_remote_execution::RemoteTokenExecutor;
use ferrum_scheduler::implementations::ContinuousBatchScheduler;
use ferrum_types::{EngineConfig, InferenceRequest, SchedulerConfig};

/// The engine over `exec`, with an [`IdTokenizer`] of the model's vocabulary.
pub fn engine(exec: RemoteTokenExecutor) -> ContinuousBatchEngine {
    let vocab = exec.info().vocab_size;
    ContinuousBatchEngine::new(
        EngineConfig::default(),
        Arc::new(ContinuousBatchScheduler::new(SchedulerConfig::default())),
        Arc::new(IdTokenizer::new(vocab, None)),
        Arc::new(real_ferrum_testkit::MockSampler),
        ExecutorOwner::new(Box::new(exec)),
    )
    .expect("engine composition")
}

/// A greedy request for `prompt` (text for the engine's tokenizer) of `max_tokens` tokens.
pub fn greedy_request(prompt: &str, model_id: &str, max_tokens: usize) -> InferenceRequest {
    let mut req = InferenceRequest::new(prompt, model_id);
    req.sampling_params.max_tokens = max_tokens;
    req.sampling_params.temperature = 0.0;
    req
}
