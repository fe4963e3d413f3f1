//! ferrum-engine 0.18.4's own `ContinuousBatchEngine` driving a real model (a tiny random-weight
//! llama, transformers executor) through `RemoteTokenExecutor`: concurrent greedy requests with
//! different prompts give exactly the server's own `Generate` tokens, the engine's steps are
//! `UnifiedDecode`s that mix rows (fewer steps than rows), on the executor's `Session` stream, and
//! no cache is left on the server.
//! The same path, on SmolLM2, is `benchmarks/engine_rows.py`'s 0.18 row.

#[path = "common/engine_rig.rs"]
mod rig;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use ferrum_engine::LlmInferenceEngine;
use ferrum_remote_execution::id_tokenizer::IdTokenizer;
use ferrum_remote_execution::testing::{generate_ids, tiny_model_dir, ServerProcess};
use ferrum_remote_execution::{RemoteTokenExecutor, RemoteTokenOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_018_concurrent_greedy_requests_equal_generate_and_leave_no_cache() {
    let dir = tiny_model_dir().expect("tiny model");
    let server = ServerProcess::start(&[format!("hf-causal-lm,id=tiny,path={}", dir.display())]).await.expect("server");
    let opts = RemoteTokenOptions { model_id: "tiny".into(), ..Default::default() };
    let exec = RemoteTokenExecutor::connect(server.endpoint.clone(), opts).await.expect("connect");
    let client = exec.client().clone();
    let counters = exec.counters();
    let session = exec.session().expect("Session steps are the default");
    let engine = Arc::new(rig::engine(exec));
    let prompts: [&[u32]; 3] = [&[1, 100, 200, 300], &[5, 6, 7, 8, 9, 10, 11], &[42, 43]];
    let max_tokens = 8;
    let tasks: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (engine, req) = (engine.clone(), rig::greedy_request(&IdTokenizer::text(p), "tiny", max_tokens));
            tokio::spawn(async move { engine.infer(req).await })
        })
        .collect();
    let mut got = Vec::new();
    for t in tasks {
        let r = t.await.expect("task").expect("infer");
        got.push(r.response().tokens.iter().map(|t| t.get()).collect::<Vec<u32>>());
    }
    for (p, tokens) in prompts.iter().zip(&got) {
        assert_eq!(tokens.len(), max_tokens, "runs to max_tokens (no EOS declared)");
        assert_eq!(tokens, &generate_ids(&client, p, max_tokens as u32).await.unwrap(), "prompt {p:?}: engine vs Generate");
    }
    let steps = counters.unified_decode.load(Ordering::Relaxed);
    let rows = counters.prefill_rows.load(Ordering::Relaxed) + counters.decode_rows.load(Ordering::Relaxed);
    assert_eq!(counters.batch_prefill.load(Ordering::Relaxed) + counters.batch_decode.load(Ordering::Relaxed), 0);
    assert!(steps > 0 && steps < rows, "rows batched into shared steps: {steps} steps for {rows} rows");
    assert_eq!(counters.reserve_kv_slots.load(Ordering::Relaxed), 3, "one admission per request");
    assert!(session.sent() > 0 && session.sent() <= steps, "steps on the Session stream: {} of {steps}", session.sent());
    let mut left = usize::MAX;
    for _ in 0..50 {
        left = client.list_caches().await.expect("ListCaches").caches.len();
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(left, 0, "caches left on the server after the engine finished");
}
