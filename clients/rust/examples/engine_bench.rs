//! ferrum's own engine (`ContinuousBatchEngine`, ferrum-engine 0.8.8) driving a remote model
//! through `RemoteModelExecutor`: `B` concurrent greedy requests of the same prompt, each
//! `max_tokens` long (the engine knows no EOS, so every request runs to the end). Prints one JSON
//! line per run: tokens, wall time, end-to-end tok/s (prefills included), and the step RPCs sent by
//! kind. Used by `benchmarks/engine_rows.py`.
//!
//! ```text
//! cargo run --example engine_bench -- --endpoint http://127.0.0.1:50051 --model smollm2 \
//!     --prompt 1,9690,198 --concurrency 8 --max-tokens 32 [--runs 1] [--unary]
//! ```

#[path = "../tests/common/engine_rig.rs"]
mod rig;

use std::sync::Arc;
use std::time::Instant;

use ferrum_engine::LlmInferenceEngine;
use ferrum_interfaces::model_executor::ModelExecutor;
use ferrum_remote_executor::testing::{EngineBenchArgs, IdTokenizer};
use ferrum_remote_executor::{HostTensorFactory, RemoteExecutorOptions, RemoteModelExecutor, RpcCounts};

fn delta(a: RpcCounts, b: RpcCounts) -> RpcCounts {
    RpcCounts {
        prefill: b.prefill - a.prefill,
        batch_prefill: b.batch_prefill - a.batch_prefill,
        decode: b.decode - a.decode,
        batch_decode: b.batch_decode - a.batch_decode,
        unified_decode: b.unified_decode - a.unified_decode,
        forward_verify: b.forward_verify - a.forward_verify,
        truncate_kv: b.truncate_kv - a.truncate_kv,
        reserve_kv_slots: b.reserve_kv_slots - a.reserve_kv_slots,
        release_cache: b.release_cache - a.release_cache,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let EngineBenchArgs { endpoint, model, prompt, concurrency: b, max_tokens, runs, unary, raw } = EngineBenchArgs::from_env();
    let exec = Arc::new(
        RemoteModelExecutor::connect(
            endpoint,
            RemoteExecutorOptions { model_id: model.clone(), session_steps: !unary, ..Default::default() },
        )
            .await
            .expect("connect"),
    );
    // --raw MASK: no engine, the same greedy unified steps sent straight through the executor
    // (MASK = none | ones: GreedyArgmax without / with an all-allowed token mask), to split the
    // engine's own cost from the round trips'.
    if let Some(mask) = raw {
        raw_steps(&exec, &prompt, max_tokens, runs, mask == "ones").await;
        return;
    }
    let model = exec.info().model_id.to_string();
    let vocab = exec.info().vocab_size;
    let dyn_exec: Arc<dyn ModelExecutor + Send + Sync> = exec.clone();
    let engine =
        Arc::new(rig::engine(dyn_exec, Arc::new(IdTokenizer::new(vocab, None)), Arc::new(HostTensorFactory::new())));
    let text = IdTokenizer::text(&prompt);
    // Warm-up: one short request (connections, the engine's loop, the server's first step).
    engine.infer(rig::greedy_request(&text, &model, 2)).await.expect("warm-up");
    exec.flush_releases().await;

    for _ in 0..runs {
        let before = exec.rpc_counts();
        let clock0 = exec.step_clock();
        let on_stream0 = exec.session_unified_steps();
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
            tokens.push(r.tokens.iter().map(|t| t.get()).collect::<Vec<u32>>());
        }
        let wall = t0.elapsed().as_secs_f64();
        exec.flush_releases().await;
        let n = delta(before, exec.rpc_counts());
        let clock = exec.step_clock().since(&clock0);
        let total: usize = tokens.iter().map(|t| t.len()).sum();
        println!(
            "{}",
            serde_json::json!({
                "b": b, "max_tokens": max_tokens, "total_tokens": total, "wall_s": wall,
                "e2e_tok_s": total as f64 / wall,
                "rpc": {
                    "reserve_kv_slots": n.reserve_kv_slots, "unified_decode": n.unified_decode,
                    "prefill": n.prefill, "batch_prefill": n.batch_prefill, "decode": n.decode,
                    "batch_decode": n.batch_decode, "release_cache": n.release_cache, "total": n.total(),
                },
                "rpc_per_token": n.total() as f64 / total as f64,
                "same_tokens": tokens.iter().all(|t| t == &tokens[0]),
                "tokens0": tokens[0],
                "step_ms": clock.per_step_ms(),
                "session_steps": exec.session_unified_steps() - on_stream0,
            })
        );
    }
}

async fn raw_steps(exec: &RemoteModelExecutor, prompt: &[u32], max_tokens: usize, runs: usize, mask: bool) {
    use ferrum_interfaces::model_executor::{LogitsReturnPolicy, TokenSelectionMask, UnifiedBatch, UnifiedBatchItem};
    let vocab = exec.info().vocab_size;
    let policy = LogitsReturnPolicy::GreedyArgmax {
        token_mask: mask.then(|| TokenSelectionMask::new(vec![1i8; vocab])),
        repetition_penalty: None,
    };
    for run in 0..runs + 1 {
        // A handle the server has never seen, as the engine's KV manager makes.
        let handle: Arc<dyn ferrum_interfaces::KvCacheHandle> =
            Arc::new(ferrum_testkit::MockKvCacheHandle::new(ferrum_types::RequestId::new(), 1, 0));
        let name = handle.cache_id();
        let t0 = Instant::now();
        let mut pos = 0;
        let mut q: Vec<u32> = prompt.to_vec();
        let mut n = 0;
        while n < max_tokens {
            let item = UnifiedBatchItem {
                seq_id: name.clone(),
                q_tokens: q.clone(),
                kv_cache: handle.clone(),
                recurrent_state: None,
                pos_offset: pos,
                is_final_chunk: true,
                metadata: Default::default(),
                logits_policy: policy.clone(),
            };
            let mut batch = UnifiedBatch::new();
            batch.items.push(item);
            let out = ferrum_interfaces::model_executor::ModelExecutor::unified_decode(exec, &batch).await.expect("unified");
            pos += q.len();
            q = vec![out[0].as_ref().unwrap()[0] as u32];
            n += 1;
        }
        let wall = t0.elapsed().as_secs_f64();
        ferrum_interfaces::model_executor::ModelExecutor::release_cache(exec, &name);
        exec.flush_releases().await;
        if run > 0 {
            println!("{}", serde_json::json!({"raw": true, "mask": mask, "max_tokens": max_tokens, "wall_s": wall, "e2e_tok_s": max_tokens as f64 / wall}));
        }
    }
}
