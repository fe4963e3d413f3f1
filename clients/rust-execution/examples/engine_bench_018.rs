//! ferrum's own engine of the 0.18 line (`ContinuousBatchEngine`, ferrum-engine 0.18.4) driving a
//! remote model through [`RemoteTokenExecutor`]: `B` concurrent greedy requests of the same prompt,
//! each `max_tokens` long (the tokenizer declares no EOS, so every request runs to the end). Prints
//! one JSON line per run: tokens, wall time, end-to-end tok/s (prefills included) and the RPCs sent
//! by kind — the same line as `clients/rust/examples/engine_bench.rs` (the 0.8.8 line), which
//! `benchmarks/engine_rows.py` reads for both.
//!
//! ```text
//! cargo run --example engine_bench_018 -- --endpoint http://127.0.0.1:50051 --model smollm2 \
//!     --prompt 1,9690,198 --concurrency 8 --max-tokens 32 [--runs 1]
//! ```
//!
//! The engine is built as ferrum-engine 0.18.4's own integration tests build it
//! (`tests/common/engine_rig.rs`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

#[path = "../tests/common/engine_rig.rs"]
mod rig;

use ferrum_engine::LlmInferenceEngine;
use ferrum_execution::ModelExecutor;
use ferrum_remote_execution::id_tokenizer::IdTokenizer;
use ferrum_remote_execution::testing::EngineBenchArgs;
use ferrum_remote_execution::{RemoteTokenExecutor, RemoteTokenOptions, TokenCounters};

/// The counters' RPC fields, read once.
fn rpcs(c: &TokenCounters) -> [u64; 5] {
    [&c.reserve_kv_slots, &c.unified_decode, &c.batch_prefill, &c.batch_decode, &c.release_cache]
        .map(|a| a.load(Ordering::Relaxed))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let EngineBenchArgs { endpoint, model, prompt, concurrency: b, max_tokens, runs, unary, .. } = EngineBenchArgs::from_env();

    let exec = RemoteTokenExecutor::connect(endpoint, RemoteTokenOptions { model_id: model, session_steps: !unary, ..Default::default() })
        .await
        .expect("connect");
    let model = exec.info().model_id.to_string();
    let counters = exec.counters();
    let session = exec.session();
    let on_stream = || session.as_ref().map_or(0, |s| s.sent());
    let engine = Arc::new(rig::engine(exec));
    let text = IdTokenizer::text(&prompt);
    // Warm-up: one short request (connections, the engine's loop, the server's first step).
    engine.infer(rig::greedy_request(&text, &model, 2)).await.expect("warm-up");

    for _ in 0..runs {
        let before = rpcs(&counters);
        let on_stream0 = on_stream();
        let t0 = Instant::now();
        let tasks: Vec<_> = (0..b)
            .map(|_| {
                let engine = engine.clone();
                let req = rig::greedy_request(&text, &model, max_tokens);
                tokio::spawn(async move { engine.infer(req).await })
            })
            .collect();
        let mut tokens = Vec::new();
        for t in tasks {
            let r = t.await.expect("task").expect("infer");
            tokens.push(r.response().tokens.iter().map(|t| t.get()).collect::<Vec<u32>>());
        }
        let wall = t0.elapsed().as_secs_f64();
        let after = rpcs(&counters);
        let [reserve, unified, batch_prefill, batch_decode, release] =
            std::array::from_fn::<u64, 5, _>(|i| after[i] - before[i]);
        let total_rpc = reserve + unified + batch_prefill + batch_decode + release;
        let total: usize = tokens.iter().map(|t| t.len()).sum();
        println!(
            "{}",
            serde_json::json!({
                "line": "0.18.4", "b": b, "max_tokens": max_tokens, "total_tokens": total, "wall_s": wall,
                "e2e_tok_s": total as f64 / wall,
                "rpc": {
                    "reserve_kv_slots": reserve, "unified_decode": unified, "batch_prefill": batch_prefill,
                    "batch_decode": batch_decode, "release_cache": release, "total": total_rpc,
                },
                "rpc_per_token": total_rpc as f64 / total as f64,
                "same_tokens": tokens.iter().all(|t| t == &tokens[0]),
                "tokens0": tokens[0],
                "session_steps": on_stream() - on_stream0,
            })
        );
    }
}
