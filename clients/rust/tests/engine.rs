//! Issue 15: ferrum's own `ContinuousBatchEngine` (ferrum-engine 0.8.8) driving
//! `RemoteModelExecutor` against a live `ferrum-service serve`.
//!
//! * The configurable executor: the engine produces exactly the tokens it produces with ferrum's
//!   in-process `ConfigurableModelExecutor` (split path: the executor has no unified decode, which
//!   the client answers locally).
//! * The tiny transformers model (native unified decode): concurrent requests give the server's
//!   own greedy `Generate` tokens, every prefill goes through `UnifiedDecode` (the engine's
//!   `ReserveKvSlots` for a sequence it has just named creates the cache: issue 15 fix 1), and no
//!   cache is left on the server.
//! * Speculative mode: ferrum's engine never calls `release_cache` on its draft executor (in
//!   process too); the draft caches stay on the server until the draft `RemoteModelExecutor` is
//!   dropped (`release_on_drop`) or the server's lease reclaims them.

#[path = "common/engine_rig.rs"]
mod rig;

use std::sync::Arc;
use std::time::Duration;

use ferrum_engine::LlmInferenceEngine;
use ferrum_interfaces::model_executor::ModelExecutor;
use ferrum_remote_executor::testing::{tiny_model_dir, IdTokenizer, ServerProcess};
use ferrum_remote_executor::{proto, Client, HostTensorFactory, RemoteExecutorOptions, RemoteModelExecutor};
use ferrum_testkit::{ConfigurableModelExecutor, MockTensorFactory, MockTokenizer};
use futures_util::StreamExt;

async fn live_caches(client: &Client) -> usize {
    client.list_caches().await.expect("ListCaches").caches.len()
}

/// Releases are queued (ferrum's `release_cache` is sync): wait for them, then for the server.
async fn assert_no_caches_left(exec: &RemoteModelExecutor, client: &Client) {
    exec.flush_releases().await;
    for _ in 0..50 {
        if live_caches(client).await == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(live_caches(client).await, 0, "caches left on the server");
    assert_eq!(exec.aliases_len(), 0, "engine names still mapped");
    assert_eq!(exec.release_failures(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_over_remote_configurable_equals_in_process() {
    let prompts = ["Hello world", "the quick brown fox jumps", "a"];
    let run = |engine: ferrum_engine::ContinuousBatchEngine| async move {
        let mut out = Vec::new();
        for p in prompts {
            let r = engine.infer(rig::greedy_request(p, "mock", 6)).await.expect("infer");
            out.push(r.tokens.iter().map(|t| t.get()).collect::<Vec<u32>>());
        }
        out
    };
    let local = run(rig::engine(
        Arc::new(ConfigurableModelExecutor::with_token_sequence(1000, vec![10, 20, 30])),
        Arc::new(MockTokenizer::new(1000)),
        Arc::new(MockTensorFactory),
    ))
    .await;

    let server = ServerProcess::start_mock().await.expect("start the server");
    let exec = Arc::new(
        RemoteModelExecutor::connect(
            server.endpoint.clone(),
            RemoteExecutorOptions { model_id: "mock".into(), ..Default::default() },
        )
        .await
        .expect("connect"),
    );
    let dyn_exec: Arc<dyn ModelExecutor + Send + Sync> = exec.clone();
    let remote =
        run(rig::engine(dyn_exec, Arc::new(MockTokenizer::new(1000)), Arc::new(HostTensorFactory::new()))).await;
    assert_eq!(remote, local, "ferrum's engine: remote configurable == in-process ConfigurableModelExecutor");
    assert_eq!(local[0], vec![10, 10, 20, 30, 10, 20]);

    let n = exec.rpc_counts();
    println!("configurable: {n:?}, unified answered locally {}", exec.local_unsupported_unified());
    assert_eq!(n.unified_decode, 0, "no UnifiedDecode RPC against an executor without it");
    // Its first reservation answers "no paged admission"; later ones are ferrum's Ok(None) locally.
    assert_eq!(n.reserve_kv_slots, 1);
    assert!(n.batch_prefill + n.prefill >= prompts.len() as u64);
    assert_no_caches_left(&exec, &server.client().await.with_model("mock")).await;
}

async fn server_generate(client: &Client, prompt: &[u32], max_tokens: u32) -> Vec<u32> {
    let mut stream = client
        .generate(proto::GenerateRequest {
            prompt: Some(proto::generate_request::Prompt::TokenIds(proto::TokenIds {
                token_ids: prompt.iter().map(|&t| t as i32).collect(),
            })),
            stop: Some(proto::StopConditions { max_tokens, ignore_eos: true, ..Default::default() }),
            ..Default::default()
        })
        .await
        .expect("Generate");
    let mut out = Vec::new();
    while let Some(ev) = stream.next().await {
        if let Some(proto::generate_response::Event::Token(t)) = ev.expect("Generate event").event {
            out.push(t.token_id as u32);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_over_remote_tiny_llama_batches_prefills_through_unified_decode() {
    let dir = tiny_model_dir().expect("tiny model");
    let server =
        ServerProcess::start(&[format!("hf-causal-lm,id=tiny,path={}", dir.display())]).await.expect("server");
    let exec = Arc::new(
        RemoteModelExecutor::connect(server.endpoint.clone(), RemoteExecutorOptions::default()).await.expect("connect"),
    );
    assert!(exec.supports_native_unified_decode());
    let vocab = exec.info().vocab_size;
    let dyn_exec: Arc<dyn ModelExecutor + Send + Sync> = exec.clone();
    // No EOS known to the engine; the server's Generate ignores EOS too: both run max_tokens.
    let engine = Arc::new(rig::engine(dyn_exec, Arc::new(IdTokenizer::new(vocab, None)), Arc::new(HostTensorFactory::new())));

    let prompts: Vec<Vec<u32>> = vec![vec![1, 100, 200, 300], vec![5, 6, 7, 8, 9, 10, 11], vec![42, 43], vec![300; 20]];
    let max_tokens = 8;
    let tasks: Vec<_> = prompts
        .iter()
        .map(|p| {
            let engine = engine.clone();
            let text = IdTokenizer::text(p);
            tokio::spawn(async move { engine.infer(rig::greedy_request(&text, "tiny", max_tokens)).await })
        })
        .collect();
    let mut got = Vec::new();
    for t in tasks {
        let r = t.await.unwrap().expect("infer");
        got.push(r.tokens.iter().map(|t| t.get()).collect::<Vec<u32>>());
    }
    let client = server.client().await.with_model("tiny");
    for (p, g) in prompts.iter().zip(&got) {
        assert_eq!(g, &server_generate(&client, p, max_tokens as u32).await, "engine vs Generate for {p:?}");
    }

    let n = exec.rpc_counts();
    println!(
        "tiny llama, {} requests x {max_tokens} tokens: {n:?} ({} RPCs; {} reservations answered locally)",
        prompts.len(),
        n.total(),
        exec.local_reservations()
    );
    assert!(n.unified_decode > 0 && n.reserve_kv_slots > 0);
    // Reservations 16 tokens ahead (the default): later steps are covered without an RPC.
    assert!(exec.local_reservations() > 0 && n.reserve_kv_slots < n.unified_decode);
    assert_eq!((n.prefill, n.batch_prefill), (0, 0), "every prefill went through UnifiedDecode");
    // Every sequence is reserved before its first step: every step went on the Session stream.
    assert_eq!(exec.session_unified_steps(), n.unified_decode, "the engine's steps on one stream");
    assert_no_caches_left(&exec, &client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculative_engine_leaves_draft_caches_until_the_draft_executor_is_dropped() {
    let draft_spec = "configurable,id=draft,vocab_size=1000,token_sequence=10:20:30".to_string();
    let server = ServerProcess::start(&[ServerProcess::MOCK.to_string(), draft_spec]).await.expect("server");
    let connect = |model: &str| {
        let opts = RemoteExecutorOptions { model_id: model.into(), ..Default::default() };
        RemoteModelExecutor::connect(server.endpoint.clone(), opts)
    };
    let target = Arc::new(connect("mock").await.expect("target"));
    let draft = Arc::new(connect("draft").await.expect("draft"));
    let engine = rig::speculative_engine(
        target.clone(),
        draft.clone(),
        3,
        // No special tokens: ferrum speculates only when no token is masked for the request.
        Arc::new(IdTokenizer::new(1000, None)),
        Arc::new(HostTensorFactory::new()),
    );
    for p in [&[1u32, 2, 3][..], &[7, 8]] {
        let r = engine.infer(rig::greedy_request(&IdTokenizer::text(p), "mock", 8)).await.expect("infer");
        assert_eq!(r.tokens.len(), 8);
    }
    let n = target.rpc_counts();
    println!("speculative: target {n:?}, draft {:?}", draft.rpc_counts());
    assert!(n.forward_verify > 0, "the engine verified drafts on the target");
    let client = server.client().await;
    assert_no_caches_left(&target, &client.model("mock")).await;
    // ferrum's engine released the target's caches, never the draft's.
    draft.flush_releases().await;
    assert_eq!(live_caches(&client.model("draft")).await, 2, "one draft cache per request, never released");
    assert_eq!(draft.rpc_counts().release_cache, 0);
    // Dropping the draft executor (once the engine has stopped and let go of it) releases them.
    ferrum_engine::InferenceEngineInterface::shutdown(&engine).await.expect("engine shutdown");
    drop(engine);
    let mut draft = Some(draft);
    for _ in 0..100 {
        match Arc::try_unwrap(draft.take().unwrap()) {
            Ok(d) => {
                drop(d);
                break;
            }
            Err(d) => {
                draft = Some(d);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    assert!(draft.is_none(), "the engine still holds the draft executor");
    assert_eq!(live_caches(&client.model("draft")).await, 0, "release_on_drop freed the draft caches");
}
