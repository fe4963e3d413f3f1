//! `RemoteExecutorOptions::session_steps` (issue 30): `unified_decode` steps on caches the server
//! holds go on one `Session` stream instead of one unary `UnifiedDecode` each, with the same
//! results, the unary call's errors, and nothing owned (or freed) by the stream. Real server on
//! loopback, the tiny llama (native unified decode).

use std::sync::Arc;

use ferrum_interfaces::model_executor::{KvSlotRequest, LogitsReturnPolicy, ModelExecutor, UnifiedBatch, UnifiedBatchItem};
use ferrum_interfaces::KvCacheHandle;
use ferrum_remote_executor::testing::{tiny_model_dir, ServerProcess};
use ferrum_remote_executor::{Client, RemoteExecutorOptions, RemoteKvCacheHandle, RemoteModelExecutor};
use ferrum_types::FerrumError;

const PROMPT: [u32; 5] = [1, 100, 200, 300, 17];

async fn tiny_server(extra: &[String]) -> ServerProcess {
    let dir = tiny_model_dir().expect("tiny model");
    ServerProcess::start_with_args(&[format!("hf-causal-lm,id=tiny,path={}", dir.display())], extra).await.expect("server")
}

fn opts(session_steps: bool) -> RemoteExecutorOptions {
    RemoteExecutorOptions { model_id: "tiny".into(), session_steps, ..Default::default() }
}

/// A handle the server has never seen, named as ferrum's engine names a new sequence.
fn engine_handle() -> Arc<dyn KvCacheHandle> {
    Arc::new(ferrum_testkit::MockKvCacheHandle::new(ferrum_types::RequestId::new(), 1, 0))
}

fn item(h: &Arc<dyn KvCacheHandle>, q: &[u32], pos: usize) -> UnifiedBatchItem {
    UnifiedBatchItem {
        seq_id: h.cache_id(),
        q_tokens: q.to_vec(),
        kv_cache: h.clone(),
        recurrent_state: None,
        pos_offset: pos,
        is_final_chunk: true,
        metadata: Default::default(),
        logits_policy: LogitsReturnPolicy::GreedyArgmax { token_mask: None, repetition_penalty: None },
    }
}

async fn step(exec: &RemoteModelExecutor, items: Vec<UnifiedBatchItem>) -> Result<Vec<u32>, FerrumError> {
    let mut b = UnifiedBatch::new();
    b.items = items;
    let out = exec.unified_decode(&b).await?;
    Ok(out.iter().map(|r| r.as_ref().expect("final item")[0] as u32).collect())
}

/// Reserve (as the engine does before a sequence's first step), prompt, then `n - 1` decodes.
async fn sequence(exec: &RemoteModelExecutor, h: &Arc<dyn KvCacheHandle>, n: usize) -> Vec<u32> {
    let req = KvSlotRequest { cache_id: h.cache_id(), target_len: PROMPT.len() + n, admission_target_len: None };
    exec.reserve_kv_slots(&[req]).expect("reserve");
    let mut toks = step(exec, vec![item(h, &PROMPT, 0)]).await.expect("prompt");
    for i in 1..n {
        let t = *toks.last().unwrap();
        toks.extend(step(exec, vec![item(h, &[t], PROMPT.len() + i - 1)]).await.expect("decode"));
    }
    toks
}

async fn live_caches(c: &Client) -> usize {
    c.list_caches().await.unwrap().caches.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unified_steps_go_on_one_stream_with_the_unary_results() {
    let server = tiny_server(&[]).await;
    let client = server.client().await.with_model("tiny");
    let on_stream = RemoteModelExecutor::connect(server.endpoint.clone(), opts(true)).await.unwrap();
    let unary = RemoteModelExecutor::connect(server.endpoint.clone(), opts(false)).await.unwrap();
    let (a, b) = (engine_handle(), engine_handle());
    let got = sequence(&on_stream, &a, 8).await;
    let want = sequence(&unary, &b, 8).await;
    assert_eq!(got, want, "greedy tokens on the stream == unary");
    assert_eq!(on_stream.session_unified_steps(), on_stream.rpc_counts().unified_decode);
    assert_eq!(on_stream.session_unified_steps(), 8);
    assert_eq!(unary.session_unified_steps(), 0);
    let t = on_stream.step_clock();
    assert_eq!((t.steps, t.rows), (8, 8));
    assert!(t.rpc_ns > 0 && t.server_total_ns > 0 && t.server_forward_ns > 0 && t.rpc_ns >= t.server_total_ns);
    // Both sequences' caches live on, owned by the caller (not the stream): released by name.
    assert_eq!(live_caches(&client).await, 2);
    on_stream.release_cache(&a.cache_id());
    unary.release_cache(&b.cache_id());
    on_stream.flush_releases().await;
    unary.flush_releases().await;
    assert_eq!(live_caches(&client).await, 0);
    // A step naming a cache the server does not hold yet (no reservation) goes unary (the
    // stream must own no cache), and still works.
    let c = engine_handle();
    let before = on_stream.session_unified_steps();
    let first = step(&on_stream, vec![item(&c, &PROMPT, 0)]).await.unwrap();
    assert_eq!(first[0], got[0]);
    assert_eq!(on_stream.session_unified_steps(), before, "a new cache is made by a unary call");
    let next = step(&on_stream, vec![item(&c, &first, PROMPT.len())]).await.unwrap();
    assert_eq!(next[0], got[1]);
    assert_eq!(on_stream.session_unified_steps(), before + 1);
    drop(on_stream); // release_on_drop frees it; the stream's end frees nothing else
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(live_caches(&client).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_step_on_the_stream_is_the_unary_error_and_the_stream_goes_on() {
    let server = tiny_server(&[]).await;
    let client = server.client().await.with_model("tiny");
    let exec = RemoteModelExecutor::connect(server.endpoint.clone(), opts(true)).await.unwrap();
    let a = engine_handle();
    let want = sequence(&exec, &a, 3).await;
    // A cache freed behind the executor's back: NOT_FOUND, as the unary call answers.
    let b = engine_handle();
    exec.reserve_kv_slots(&[KvSlotRequest { cache_id: b.cache_id(), target_len: 16, admission_target_len: None }]).unwrap();
    let ids: Vec<String> = client.list_caches().await.unwrap().caches.into_iter().filter(|c| c.num_tokens == 0).map(|c| c.cache_id).collect();
    assert_eq!(ids.len(), 1);
    assert!(client.release_cache(&ids[0]).await.unwrap().released);
    let n = exec.session_unified_steps();
    assert!(matches!(step(&exec, vec![item(&b, &PROMPT, 0)]).await, Err(FerrumError::NotFound { .. })));
    // A bad item (position not the cache's length): INVALID / FAILED_PRECONDITION, in band.
    let t = *want.last().unwrap();
    let e = step(&exec, vec![item(&a, &[t], 99)]).await.unwrap_err();
    assert!(!matches!(e, FerrumError::Network { .. }), "{e:?}");
    // A token outside the vocabulary: refused, in band.
    assert!(step(&exec, vec![item(&a, &[1_000_000], PROMPT.len() + 2)]).await.is_err());
    assert_eq!(exec.session_unified_steps(), n + 3, "the failed steps went on the stream");
    // The stream goes on: the sequence continues where it was.
    let more = step(&exec, vec![item(&a, &[t], PROMPT.len() + 2)]).await.unwrap();
    assert_eq!(exec.session_unified_steps(), n + 4);
    let unary = RemoteModelExecutor::connect(server.endpoint.clone(), opts(false)).await.unwrap();
    let r = engine_handle();
    assert_eq!(sequence(&unary, &r, 4).await[3], more[0]);
    unary.release_cache(&r.cache_id());
    exec.release_cache(&a.cache_id());
    exec.release_cache(&b.cache_id());
    exec.flush_releases().await;
    unary.flush_releases().await;
    assert_eq!(live_caches(&client).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_steps_share_the_stream_or_go_unary_with_the_same_tokens() {
    let server = tiny_server(&[]).await;
    let client = server.client().await.with_model("tiny");
    let exec = Arc::new(RemoteModelExecutor::connect(server.endpoint.clone(), opts(true)).await.unwrap());
    let want = sequence(&exec, &engine_handle(), 6).await;
    // A flood: 16 sequences stepping at once, each step its own call.
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let exec = exec.clone();
            tokio::spawn(async move {
                let h = engine_handle();
                let toks = sequence(&exec, &h, 6).await;
                exec.release_cache(&h.cache_id());
                toks
            })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap(), want);
    }
    let n = exec.rpc_counts().unified_decode;
    assert_eq!(n, 17 * 6);
    assert!(exec.session_unified_steps() >= 6 && exec.session_unified_steps() <= n);
    println!("{} of {n} steps on the stream, {} unary", exec.session_unified_steps(), n - exec.session_unified_steps());
    exec.flush_releases().await;
    drop(exec);
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(live_caches(&client).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_dropped_mid_flight_does_not_hand_its_answer_to_the_next() {
    let server = tiny_server(&[]).await;
    let client = server.client().await.with_model("tiny");
    let exec = RemoteModelExecutor::connect(server.endpoint.clone(), opts(true)).await.unwrap();
    let want = sequence(&exec, &engine_handle(), 3).await;
    let a = engine_handle();
    exec.reserve_kv_slots(&[KvSlotRequest { cache_id: a.cache_id(), target_len: 16, admission_target_len: None }]).unwrap();
    // The caller gives up while the step is on the stream (sent, not answered): its answer stays
    // on the stream, and the next steps (another sequence) must still get their own answers. A zero
    // timeout polls the step once (tokio polls the future before its deadline): the step is sent on
    // that poll and cannot be answered within it, so the drop is mid-flight whatever the timing.
    let n = exec.session_unified_steps();
    let gave_up = tokio::time::timeout(std::time::Duration::ZERO, step(&exec, vec![item(&a, &PROMPT, 0)])).await;
    assert!(gave_up.is_err(), "the step was answered on its first poll");
    assert_eq!(exec.session_unified_steps(), n + 1, "the step went on the stream before its caller gave up");
    let n = n + 1;
    let b = engine_handle();
    assert_eq!(sequence(&exec, &b, 3).await, want);
    assert_eq!(exec.session_unified_steps(), n + 3, "on the same kind of path");
    for h in [&a, &b] {
        exec.release_cache(&h.cache_id());
    }
    drop(exec);
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(live_caches(&client).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_callers_cache_is_not_found_on_the_stream() {
    let dir = std::env::temp_dir().join(format!("ferrum-rust-session-steps-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tokens");
    std::fs::write(&file, "alice-token\nbob-token\n").unwrap();
    let server = tiny_server(&["--auth-token-file".into(), file.display().to_string()]).await;
    let connect = |token: &'static str| {
        let endpoint = server.endpoint.clone();
        async move {
            let c = Client::connect(endpoint).await.unwrap().with_token(token).unwrap();
            RemoteModelExecutor::with_client(c, opts(true)).await.unwrap()
        }
    };
    let (alice, bob) = (connect("alice-token").await, connect("bob-token").await);
    let a = engine_handle();
    let toks = sequence(&alice, &a, 2).await;
    let alice_client = Client::connect(server.endpoint.clone()).await.unwrap().with_token("alice-token").unwrap().with_model("tiny");
    let caches = alice_client.list_caches().await.unwrap().caches;
    assert_eq!(caches.len(), 1);
    // Bob names Alice's server cache id (a handle carrying it): NOT_FOUND on Bob's stream, and
    // Alice's cache is untouched.
    let stolen: Arc<dyn KvCacheHandle> =
        Arc::new(RemoteKvCacheHandle::from_proto(&caches[0], ferrum_types::Device::CPU));
    let n = bob.session_unified_steps();
    let e = step(&bob, vec![item(&stolen, &[toks[1]], PROMPT.len() + 1)]).await.unwrap_err();
    assert!(matches!(e, FerrumError::NotFound { .. }), "{e:?}");
    assert_eq!(bob.session_unified_steps(), n + 1, "sent on Bob's stream");
    let after = alice_client.list_caches().await.unwrap().caches;
    assert_eq!(after[0].num_tokens, caches[0].num_tokens);
    // Alice's own stream continues it.
    assert_eq!(step(&alice, vec![item(&a, &[toks[1]], PROMPT.len() + 1)]).await.unwrap().len(), 1);
    let _ = alice.release_cache_async(&a.cache_id()).await;
    assert!(alice_client.list_caches().await.unwrap().caches.is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}
