//! `RemoteModelExecutor` driven through ferrum's own `ModelExecutor` trait object, against a real
//! server started on loopback for each test (fresh: the configurable executor's decode counter is
//! one per server).

use std::sync::Arc;

use ferrum_interfaces::model_executor::{
    DecodeInput, GreedyRepetitionPenalty, LogitsReturnPolicy, ModelExecutor, PrefillInput,
    TokenSelectionMask, UnifiedBatch, UnifiedBatchItem,
};
use ferrum_interfaces::KvCacheHandle;
use ferrum_remote_executor::testing::{tiny_model_dir, ServerProcess};
use ferrum_remote_executor::{HostTensor, RemoteExecutorOptions, RemoteModelExecutor};
use ferrum_types::FerrumError;

async fn mock_executor() -> (ServerProcess, Arc<dyn ModelExecutor>) {
    let server = ServerProcess::start_mock().await.expect("start the server");
    let exec = RemoteModelExecutor::connect(
        server.endpoint.clone(),
        RemoteExecutorOptions { model_id: "mock".into(), ..Default::default() },
    )
    .await
    .expect("connect");
    (server, Arc::new(exec))
}

fn greedy() -> LogitsReturnPolicy {
    LogitsReturnPolicy::GreedyArgmax { token_mask: None, repetition_penalty: None }
}

/// Sample as ferrum's engine does: a 1-element row is the model-side greedy sentinel, otherwise
/// argmax with ties to the last index (`GreedySampler`).
fn engine_sample(row: &[f32]) -> u32 {
    if row.len() == 1 {
        return row[0] as u32;
    }
    row.iter()
        .enumerate()
        .max_by(|a, b| a.1.partial_cmp(b.1).unwrap())
        .map(|(i, _)| i as u32)
        .unwrap()
}

fn decode_input(token: u32, kv: &Arc<dyn KvCacheHandle>, policy: LogitsReturnPolicy) -> DecodeInput {
    DecodeInput::new(HostTensor::token_ids_ref(&[token]), kv.clone()).with_logits_policy(policy)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_then_decode_gives_ferrums_configurable_sequence() {
    let (_server, exec) = mock_executor().await;
    let info = exec.info();
    assert_eq!(info.model_id.as_str(), "mock");
    assert_eq!(info.vocab_size, 1000);
    assert_eq!(info.max_sequence_length, 4096);
    assert!(exec.status().is_ready);
    assert_eq!(exec.capabilities().max_sequence_length, 4096);
    assert!(!exec.supports_native_unified_decode());

    // Prefill as the engine sends it: [1, len] f32 ids; the logits are 3-D, last position only.
    let out = exec.prefill(&PrefillInput::new(HostTensor::token_ids_ref(&[1, 2, 3]))).await.unwrap();
    assert_eq!(out.logits.shape(), &[1, 1, 1000]);
    let row = out.last_token_logits().unwrap().to_vec_f32().unwrap();
    assert_eq!(row.len(), 1000);
    assert_eq!(row[10], 10.0, "configurable bias is 10.0 on token_sequence[0]");
    assert_eq!(row.iter().filter(|&&v| v != 0.0).count(), 1);
    assert_eq!(out.kv_cache.num_tokens(), 3);

    let mut tokens = vec![engine_sample(&row)];
    let mut kv = out.kv_cache.clone();
    // Alternate FullLogits and the GreedyArgmax sentinel: both must give the same sequence.
    for step in 0..5 {
        let policy = if step % 2 == 0 { LogitsReturnPolicy::FullLogits } else { greedy() };
        let full = policy.requires_full_logits();
        let d = exec.decode(&decode_input(*tokens.last().unwrap(), &kv, policy)).await.unwrap();
        let row = d.logits.to_vec_f32().unwrap();
        if full {
            assert_eq!(d.logits.shape(), &[1, 1000]);
        } else {
            assert_eq!(row.len(), 1, "GreedyArgmax returns ferrum's 1-element sentinel");
        }
        assert_eq!(d.kv_cache.cache_id(), kv.cache_id(), "decode keeps the cache identity");
        assert_eq!(d.kv_cache.num_tokens(), kv.num_tokens() + 1);
        tokens.push(engine_sample(&row));
        kv = d.kv_cache;
    }
    // ferrum: prefill emits seq[0]; decode k (server-wide counter) emits seq[k % 3].
    assert_eq!(tokens, vec![10, 10, 20, 30, 10, 20]);
    assert_eq!(kv.num_tokens(), 8);
    exec.release_cache(&kv.cache_id());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncate_release_and_error_kinds() {
    let (_server, exec) = mock_executor().await;
    let out = exec.prefill(&PrefillInput::new(HostTensor::token_ids_ref(&[5, 6]))).await.unwrap();
    let kv = out.kv_cache.clone();
    let mut cur = kv.clone();
    for t in [10, 10, 20] {
        cur = exec.decode(&decode_input(t, &cur, greedy())).await.unwrap().kv_cache;
    }
    assert_eq!(cur.num_tokens(), 5);

    // truncate_kv is a real rollback: the next decode (even through the stale first handle)
    // writes at position 3.
    exec.truncate_kv(&cur, 3).await.unwrap();
    let d = exec.decode(&decode_input(30, &kv, greedy())).await.unwrap();
    assert_eq!(d.kv_cache.num_tokens(), 4);

    // Truncating past the end: OUT_OF_RANGE → InvalidParameter.
    match exec.truncate_kv(&cur, 100).await {
        Err(FerrumError::InvalidParameter { .. }) => {}
        other => panic!("expected InvalidParameter, got {other:?}"),
    }
    // A token outside the vocabulary: INVALID_ARGUMENT → RequestValidation.
    match exec.decode(&decode_input(1000, &cur, greedy())).await {
        Err(FerrumError::RequestValidation { .. }) => {}
        other => panic!("expected RequestValidation, got {other:?}"),
    }
    // A prefill with no token.
    match exec.prefill(&PrefillInput::new(HostTensor::token_ids_ref(&[]))).await {
        Err(FerrumError::RequestValidation { .. }) => {}
        other => panic!("expected RequestValidation, got {other:?}"),
    }

    // release_cache is sync (spawned); the next call on that cache waits for it → NotFound.
    exec.release_cache(&kv.cache_id());
    match exec.decode(&decode_input(10, &d.kv_cache, greedy())).await {
        Err(FerrumError::NotFound { message }) => assert!(message.contains(&kv.cache_id()), "{message}"),
        other => panic!("expected NotFound, got {other:?}"),
    }
    match exec.truncate_kv(&kv, 0).await {
        Err(FerrumError::NotFound { .. }) => {}
        other => panic!("expected NotFound, got {other:?}"),
    }
    // Releasing twice is harmless (ferrum's release_cache is infallible).
    exec.release_cache(&kv.cache_id());
}

/// A unified batch of one decode step (token 10) on a cache holding one token.
fn one_decode_batch(kv: &Arc<dyn KvCacheHandle>) -> UnifiedBatch {
    let mut batch = UnifiedBatch::new();
    batch.items.push(UnifiedBatchItem {
        seq_id: kv.cache_id(),
        q_tokens: vec![10],
        kv_cache: kv.clone(),
        recurrent_state: None,
        pos_offset: 1,
        is_final_chunk: true,
        metadata: Default::default(),
        logits_policy: greedy(),
    });
    batch
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unified_decode_on_configurable_is_unsupported() {
    let (_server, exec) = mock_executor().await;
    let out = exec.prefill(&PrefillInput::new(HostTensor::token_ids_ref(&[1]))).await.unwrap();
    let batch = one_decode_batch(&out.kv_cache);
    match exec.unified_decode(&batch).await {
        Err(FerrumError::Unsupported { .. }) => {}
        other => panic!("expected Unsupported (the engine's fall-back signal), got {other:?}"),
    }
    // The failed call did not step the cache or the counter: decode k0 still gives seq[0].
    let d = exec.decode(&decode_input(10, &out.kv_cache, greedy())).await.unwrap();
    assert_eq!(d.logits.to_vec_f32().unwrap(), vec![10.0]);
    assert_eq!(d.kv_cache.num_tokens(), 2);
    // Non-generation entry points the configurable executor lacks.
    assert!(matches!(
        exec.forward(&HostTensor::token_ids_ref(&[1, 2])).await,
        Err(FerrumError::Unsupported { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_decode_and_forward_verify_through_the_trait() {
    let (_server, exec) = mock_executor().await;
    let a = exec.prefill(&PrefillInput::new(HostTensor::token_ids_ref(&[1, 2, 3]))).await.unwrap();
    let b = exec.prefill(&PrefillInput::new(HostTensor::token_ids_ref(&[4, 5]))).await.unwrap();
    let outs = exec
        .batch_decode(&[
            decode_input(10, &a.kv_cache, greedy()),
            decode_input(10, &b.kv_cache, LogitsReturnPolicy::FullLogits),
        ])
        .await
        .unwrap();
    assert_eq!(outs.len(), 2);
    assert_eq!(outs[0].kv_cache.cache_id(), a.kv_cache.cache_id());
    assert_eq!(outs[1].kv_cache.cache_id(), b.kv_cache.cache_id());
    assert_eq!((outs[0].kv_cache.num_tokens(), outs[1].kv_cache.num_tokens()), (4, 3));
    // One server counter over the batch in input order: k0 → 10, k1 → 20.
    assert_eq!(engine_sample(&outs[0].logits.to_vec_f32().unwrap()), 10);
    assert_eq!(outs[1].logits.shape(), &[1, 1000]);
    assert_eq!(engine_sample(&outs[1].logits.to_vec_f32().unwrap()), 20);

    // Speculative verify as ferrum's runner calls it: N+1 inputs, all on the same handle.
    let kv = outs[0].kv_cache.clone();
    let inputs: Vec<DecodeInput> = [30u32, 10, 99].iter().map(|&t| decode_input(t, &kv, LogitsReturnPolicy::FullLogits)).collect();
    let v = exec.forward_verify(&inputs).await.unwrap();
    assert_eq!(v.len(), 3);
    let rows: Vec<u32> = v.iter().map(|o| engine_sample(&o.logits.to_vec_f32().unwrap())).collect();
    assert_eq!(rows, vec![30, 10, 20], "rows k2, k3, k4");
    let lens: Vec<usize> = v.iter().map(|o| o.kv_cache.num_tokens()).collect();
    assert_eq!(lens, vec![5, 6, 7], "the i-th handle is at base_len + i + 1");
    // Row 0 predicts 30, draft d0 = 10 differs: rejected at k = 0. ferrum's engine truncates the
    // target to entry_target + k + 1 = 4 + 0 + 1 and feeds the replacement (30) next round.
    exec.truncate_kv(&v[2].kv_cache, 5).await.unwrap();
    let d = exec.decode(&decode_input(30, &v[0].kv_cache, greedy())).await.unwrap();
    assert_eq!(d.kv_cache.num_tokens(), 6);
    assert_eq!(d.logits.to_vec_f32().unwrap(), vec![30.0], "k5 → seq[2]");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_policy_sends_mask_and_repetition_penalty() {
    let (_server, exec) = mock_executor().await;
    let p = exec.prefill(&PrefillInput::new(HostTensor::token_ids_ref(&[7]))).await.unwrap();
    // Decode k0 biases token 10. Mask it out: the server's greedy must pick another allowed id.
    let mut mask = vec![1i8; 1000];
    mask[10] = 0;
    let policy = LogitsReturnPolicy::GreedyArgmax { token_mask: Some(TokenSelectionMask::new(mask)), repetition_penalty: None };
    let d = exec.decode(&decode_input(10, &p.kv_cache, policy)).await.unwrap();
    let t = d.logits.to_vec_f32().unwrap();
    assert_eq!(t.len(), 1);
    assert_ne!(t[0] as u32, 10, "masked token was chosen");
    // A mask allowing only token 999 must yield it.
    let mut only = vec![0i8; 1000];
    only[999] = 1;
    let policy = LogitsReturnPolicy::GreedyArgmax { token_mask: Some(TokenSelectionMask::new(only)), repetition_penalty: None };
    let d = exec.decode(&decode_input(10, &d.kv_cache, policy)).await.unwrap();
    assert_eq!(d.logits.to_vec_f32().unwrap(), vec![999.0]);
    // A repetition penalty on the biased token (k2 → 30) pushes the logit 10.0 down to 10/1e6,
    // still the maximum; a mask-free penalty only changes values, so the token stays 30.
    let policy = LogitsReturnPolicy::GreedyArgmax {
        token_mask: None,
        repetition_penalty: Some(GreedyRepetitionPenalty::new(1.0e6, vec![30, 30])),
    };
    let d = exec.decode(&decode_input(10, &d.kv_cache, policy)).await.unwrap();
    assert_eq!(d.logits.to_vec_f32().unwrap(), vec![30.0]);
    // Metadata ferrum_require_full_logits forces full rows even under GreedyArgmax.
    let mut input = decode_input(30, &d.kv_cache, greedy());
    input.metadata.insert("ferrum_require_full_logits".into(), serde_json::Value::Bool(true));
    let d = exec.decode(&input).await.unwrap();
    assert_eq!(d.logits.shape(), &[1, 1000]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_llama_trait_greedy_equals_server_generate() {
    use futures_util::StreamExt;
    let dir = tiny_model_dir().expect("tiny model");
    let server = ServerProcess::start(&[format!("hf-causal-lm,id=tiny,path={}", dir.display())]).await.expect("server");
    let exec = RemoteModelExecutor::connect(server.endpoint.clone(), RemoteExecutorOptions::default()).await.unwrap();
    assert_eq!(exec.info().model_id.as_str(), "tiny", "the only hosted model is picked");
    assert_eq!(exec.info().vocab_size, 512);
    let exec: Arc<dyn ModelExecutor> = Arc::new(exec);

    let prompt = [1u32, 100, 200, 300];
    let out = exec.prefill(&PrefillInput::new(HostTensor::token_ids_ref(&prompt))).await.unwrap();
    let mut tokens = vec![engine_sample(&out.last_token_logits().unwrap().to_vec_f32().unwrap())];
    let mut kv = out.kv_cache;
    for i in 0..5 {
        let policy = if i % 2 == 0 { greedy() } else { LogitsReturnPolicy::FullLogits };
        let d = exec.decode(&decode_input(*tokens.last().unwrap(), &kv, policy)).await.unwrap();
        tokens.push(engine_sample(&d.logits.to_vec_f32().unwrap()));
        kv = d.kv_cache;
    }
    exec.release_cache(&kv.cache_id());

    // The server's own decode loop must produce the same greedy tokens.
    let client = server.client().await.with_model("tiny");
    let mut stream = client
        .generate(ferrum_remote_executor::proto::GenerateRequest {
            prompt: Some(ferrum_remote_executor::proto::generate_request::Prompt::TokenIds(
                ferrum_remote_executor::proto::TokenIds { token_ids: prompt.iter().map(|&t| t as i32).collect() },
            )),
            stop: Some(ferrum_remote_executor::proto::StopConditions { max_tokens: 6, ignore_eos: true, ..Default::default() }),
            ..Default::default()
        })
        .await
        .unwrap();
    let mut gen = Vec::new();
    while let Some(ev) = stream.next().await {
        if let Some(ferrum_remote_executor::proto::generate_response::Event::Token(t)) = ev.unwrap().event {
            gen.push(t.token_id as u32);
        }
    }
    assert_eq!(tokens, gen, "trait-level greedy (full rows and sentinels) == server Generate");

    // The same executor shared by concurrent tasks (as an engine's batch would): every sequence
    // gets the same greedy continuation.
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let exec = exec.clone();
        tasks.push(tokio::spawn(async move {
            let out = exec.prefill(&PrefillInput::new(HostTensor::token_ids_ref(&prompt))).await.unwrap();
            let mut toks = vec![engine_sample(&out.last_token_logits().unwrap().to_vec_f32().unwrap())];
            let mut kv = out.kv_cache;
            for _ in 0..5 {
                let d = exec.decode(&decode_input(*toks.last().unwrap(), &kv, greedy())).await.unwrap();
                toks.push(engine_sample(&d.logits.to_vec_f32().unwrap()));
                kv = d.kv_cache;
            }
            (toks, kv)
        }));
    }
    let mut kvs = Vec::new();
    for t in tasks {
        let (toks, kv) = t.await.unwrap();
        assert_eq!(toks, tokens);
        kvs.push(kv);
    }
    // Paged-KV admission hooks (sync in the trait; a blocking RPC on this multi-thread runtime).
    let snap = exec.kv_slot_capacity_snapshot();
    let req = ferrum_interfaces::model_executor::KvSlotRequest {
        cache_id: kvs[0].cache_id(),
        target_len: kvs[0].num_tokens() + 1,
        admission_target_len: None,
    };
    let reservation = exec.reserve_kv_slots(&[req]).unwrap();
    println!("slot snapshot {snap:?}, reservation {reservation:?}, cache metrics {:?}", exec.cache_metrics_snapshot());
    if let Some(r) = &reservation {
        assert_eq!(r.allocations.len(), 1);
        assert_eq!(r.allocations[0].cache_id, kvs[0].cache_id());
    }
    // release_cache from a thread outside the runtime: spawned on the connect-time runtime.
    let ids: Vec<String> = kvs.iter().map(|k| k.cache_id()).collect();
    let e2 = exec.clone();
    std::thread::spawn(move || ids.iter().for_each(|id| e2.release_cache(id))).join().unwrap();
    for kv in &kvs {
        match exec.decode(&decode_input(1, kv, greedy())).await {
            Err(FerrumError::NotFound { .. }) => {}
            other => panic!("expected NotFound after release, got {other:?}"),
        }
    }
}

/// Issue 15 (3): against an executor without native unified decode, `unified_decode` answers
/// `Unsupported` from the capabilities read at connect, without a round trip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_unified_decode_is_answered_locally() {
    let server = ServerProcess::start_mock().await.expect("start the server");
    let exec = RemoteModelExecutor::connect(
        server.endpoint.clone(),
        RemoteExecutorOptions { model_id: "mock".into(), ..Default::default() },
    )
    .await
    .expect("connect");
    assert!(!exec.remote_capabilities().supports_native_unified_decode);
    let out = exec.prefill(&PrefillInput::new(HostTensor::token_ids_ref(&[1]))).await.unwrap();
    let batch = one_decode_batch(&out.kv_cache);
    for _ in 0..3 {
        assert!(matches!(exec.unified_decode(&batch).await, Err(FerrumError::Unsupported { .. })));
    }
    assert_eq!(exec.local_unsupported_unified(), 3);
    // The server, asked directly, agrees: UNIMPLEMENTED for this executor.
    let c = exec.client().clone();
    let err = c.unified_decode(Vec::new()).await.err();
    assert!(err.is_none() || err.unwrap().code() == tonic::Code::Unimplemented);
    exec.release_cache(&out.kv_cache.cache_id());
    exec.flush_releases().await;
}

/// Issue 15: `reserve_kv_slots` for a name the server has never seen creates the cache
/// (`new_sequence`); reservations go `reserve_ahead_tokens` further, fall back to the exact target
/// when the extra tokens do not fit, and a later reservation already covered is answered locally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_create_new_sequences_reserve_ahead_and_answer_covered_ones_locally() {
    let dir = tiny_model_dir().expect("tiny model");
    let server = ServerProcess::start(&[format!("hf-causal-lm,id=tiny,path={},kv_budget_tokens=64", dir.display())])
        .await
        .expect("server");
    let exec = RemoteModelExecutor::connect(server.endpoint.clone(), RemoteExecutorOptions::default()).await.unwrap();
    let req = |t: usize| ferrum_interfaces::model_executor::KvSlotRequest {
        cache_id: "engine-seq-1".into(),
        target_len: t,
        admission_target_len: None,
    };
    // A sequence may hold 64 tokens here: 60 + 16 ahead are capped to 64 (4 blocks of 16).
    let r = exec.reserve_kv_slots(&[req(60)]).unwrap().expect("the transformers executor pages its KV");
    assert_eq!((r.allocations[0].cache_id.as_str(), r.allocations[0].blocks_after), ("engine-seq-1", 4));
    assert_eq!(exec.rpc_counts().reserve_kv_slots, 1);
    let client = server.client().await.with_model("tiny");
    let caches = client.list_caches().await.unwrap().caches;
    assert_eq!(caches.len(), 1);
    assert_eq!(caches[0].num_tokens, 0, "an empty cache holding the reservation");
    // Covered by the 64 tokens granted: no RPC, no new blocks.
    let r = exec.reserve_kv_slots(&[req(63)]).unwrap().unwrap();
    assert_eq!((r.allocations[0].new_blocks, r.allocations[0].blocks_after), (0, 4));
    assert_eq!((exec.rpc_counts().reserve_kv_slots, exec.local_reservations()), (1, 1));
    // The budget is full: a second sequence's 4 + 16 ahead are refused, then its exact 4 too.
    let other = ferrum_interfaces::model_executor::KvSlotRequest {
        cache_id: "engine-seq-2".into(),
        target_len: 4,
        admission_target_len: None,
    };
    assert!(matches!(exec.reserve_kv_slots(&[other.clone()]), Err(FerrumError::ResourceExhausted { .. })));
    assert_eq!(exec.rpc_counts().reserve_kv_slots, 3, "retried without the extra tokens");
    // The engine's name releases the server's cache; then the second one fits, 16 ahead.
    exec.release_cache("engine-seq-1");
    exec.flush_releases().await;
    assert!(client.list_caches().await.unwrap().caches.is_empty());
    let r = exec.reserve_kv_slots(&[other]).unwrap().unwrap();
    assert_eq!(r.allocations[0].blocks_after, 2, "4 + 16 tokens = 2 blocks");
    exec.release_cache("engine-seq-2");
    exec.flush_releases().await;
    assert!(client.list_caches().await.unwrap().caches.is_empty());
    assert_eq!(exec.aliases_len(), 0);
}
