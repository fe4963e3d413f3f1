//! ferrum's own engine with its whole-prompt prefix cache on (`EngineConfig.runtime.prefix_cache_enabled`,
//! off by default in ferrum) over `RemoteModelExecutor`: a repeated prompt is served from the
//! engine's prefix cache, which hands the new request `clone_handle()` of the first request's KV
//! handle (`<id>-clone-<n>`). The executor maps that clone to a real server cache (a ForkCache of
//! the source while it is live, else a prefill of the remembered prompt, whose full blocks the
//! server's prefix cache serves), so every repetition gives the server's own greedy tokens. (Here
//! the first request has finished, and released its cache, before the next one starts: the clones
//! are rebuilt by prefill; `prefix_executor.rs` covers the fork of a live source.) (ferrum's engine documents that, in process, its clones
//! share the first request's mutated KV; here each clone is a copy-on-write fork.)

#[path = "common/engine_rig.rs"]
mod rig;

use std::sync::Arc;

use ferrum_engine::LlmInferenceEngine;
use ferrum_interfaces::model_executor::ModelExecutor;
use ferrum_remote_executor::testing::{tiny_model_dir, IdTokenizer, ServerProcess};
use ferrum_remote_executor::{proto, HostTensorFactory, RemoteExecutorOptions, RemoteModelExecutor};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_prefix_cache_clones_become_forks() {
    let dir = tiny_model_dir().expect("tiny model");
    let server = ServerProcess::start(&[format!("hf-causal-lm,id=tiny,path={}", dir.display())]).await.expect("server");
    let exec = Arc::new(RemoteModelExecutor::connect(server.endpoint.clone(), RemoteExecutorOptions::default()).await.expect("connect"));
    let vocab = exec.info().vocab_size;
    let dyn_exec: Arc<dyn ModelExecutor + Send + Sync> = exec.clone();
    let mut config = ferrum_types::EngineConfig::default();
    config.runtime.prefix_cache_enabled = true;
    let engine = rig::engine_with(config, dyn_exec, Arc::new(IdTokenizer::new(vocab, None)), Arc::new(HostTensorFactory::new()));
    let prompt: Vec<u32> = (0..24).map(|i| 1 + (i * 37) % 500).collect();
    let max_tokens = 6;

    let client = server.client().await.with_model("tiny");
    let want: Vec<u32> = client
        .generate_all(
            Some(proto::generate_request::Prompt::TokenIds(proto::TokenIds { token_ids: prompt.iter().map(|&t| t as i32).collect() })),
            ferrum_remote_executor::GenerateOptions { max_tokens: max_tokens as u32, ignore_eos: true, ..Default::default() },
        )
        .await
        .unwrap()
        .tokens()
        .iter()
        .map(|&t| t as u32)
        .collect();
    for i in 0..3 {
        let r = engine.infer(rig::greedy_request(&IdTokenizer::text(&prompt), "tiny", max_tokens)).await.expect("infer");
        let got: Vec<u32> = r.tokens.iter().map(|t| t.get()).collect();
        println!("request {i}: {got:?} stats {:?}", exec.prefix_stats());
        assert_eq!(got, want, "request {i}: engine tokens vs the server's Generate");
    }
    let s = exec.prefix_stats();
    println!("prefix stats: {s:?}, rpcs: {:?}", exec.rpc_counts());
    assert!(s.clone_forks + s.clone_prefills >= 2, "the engine's prefix cache did not hand out a clone per repetition: {s:?}");
    // every cache, the clones' included, is released on the server
    exec.flush_releases().await;
    let mut left = usize::MAX;
    for _ in 0..50 {
        left = client.list_caches().await.unwrap().caches.len();
        if left == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(left, 0, "caches left on the server");
}
