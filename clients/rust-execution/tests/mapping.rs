//! The token-execution protocol against a live `ferrum-service serve`: admission, one step per
//! `execute_tokens`, closing, shutdown, and the refusals (stale frontier, another executor's
//! sequence, a closed sequence stepped again). Each test ends with no cache left on the server.

use std::sync::Arc;
use std::time::Duration;

use ferrum_execution::executor_lifecycle::{ExecutorOwner, ExecutorShutdownPhase};
use ferrum_execution::model_executor::{ExecutorPrefillAdmission, ExecutorSamplingOutput, LogitsReturnPolicy, PrefillChunk};
use ferrum_execution::token_execution::{
    ExecutionAdmission, ExecutionBatchOutcome, ExecutionCloseDisposition, ExecutionCompletion, ExecutionEndReason,
    ExecutionFrontier, ExecutionProduct, ExecutionWork, NoSubmissionReason, TokenAdmissionOutcome, TokenWork,
};
use ferrum_execution::ModelExecutor;
use ferrum_remote_execution::testing::{generate_ids, tiny_model_dir, ServerProcess};
use ferrum_remote_execution::{Client, RemoteTokenExecutor, RemoteTokenOptions};
use ferrum_types::{MemoryObservation, RequestId, TokenId};

const SCRIPTED: &str = "configurable,id=mock,vocab_size=1000,token_sequence=10:20:30,counter=per_sequence";

async fn connect(server: &ServerProcess, model: &str) -> RemoteTokenExecutor {
    let opts = RemoteTokenOptions { model_id: model.into(), ..Default::default() };
    RemoteTokenExecutor::connect(server.endpoint.clone(), opts).await.expect("connect")
}

fn ids(t: &[u32]) -> Vec<TokenId> {
    t.iter().map(|&t| TokenId::new(t)).collect()
}

async fn admit(exec: &RemoteTokenExecutor, request: &RequestId, prompt: &[TokenId], maximum: usize) -> ExecutionFrontier {
    let input = ExecutionAdmission { context: ExecutorPrefillAdmission::for_diagnostic(request, prompt, maximum), adapter: None };
    match exec.admit_tokens(input).await.expect("admit") {
        TokenAdmissionOutcome::Admitted(f) => f,
        other => panic!("not admitted: {other:?}"),
    }
}

fn completions(outcome: ExecutionBatchOutcome) -> Vec<ExecutionCompletion> {
    match outcome {
        ExecutionBatchOutcome::Completed(c) => c.into_completions(),
        other => panic!("not completed: {other:?}"),
    }
}

/// The product's token: the greedy token, or the argmax of a full row.
fn token(c: &ExecutionCompletion) -> u32 {
    match c.product() {
        ExecutionProduct::Sampling(ExecutorSamplingOutput::GreedyToken(t)) => t.get(),
        ExecutionProduct::Sampling(ExecutorSamplingOutput::FullLogits(row)) => {
            row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32
        }
        other => panic!("no sampling product: {other:?}"),
    }
}

async fn caches(client: &Client) -> usize {
    client.list_caches().await.expect("ListCaches").caches.len()
}

async fn assert_no_caches_left(exec: &RemoteTokenExecutor) {
    for _ in 0..50 {
        if caches(exec.client()).await == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(caches(exec.client()).await, 0, "caches left on the server");
    assert_eq!(exec.live_sequences(), 0, "incarnations still mapped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripted_model_prefill_chunks_decode_and_finish() {
    let server = ServerProcess::start(&[SCRIPTED.to_string()]).await.expect("server");
    let exec = connect(&server, "mock").await;
    let prompt = ids(&[1, 2, 3, 4, 5]);
    let f0 = admit(&exec, &RequestId::new(), &prompt, 16).await;
    assert_eq!(exec.cache_of(f0.sequence()), None, "no paged admission on the scripted model: no cache yet");
    let full = LogitsReturnPolicy::FullLogits;
    let greedy = LogitsReturnPolicy::GreedyArgmax { token_mask: None, repetition_penalty: None };

    // Two prompt chunks: the first is Intermediate, the last samples.
    let w = [ExecutionWork::new(&f0, TokenWork::Prefill(PrefillChunk::new(0, 3, 5).unwrap()), &full).unwrap()];
    let c = completions(exec.execute_tokens(&w).await.unwrap()).remove(0);
    assert!(matches!(c.product(), ExecutionProduct::Intermediate));
    let f1 = c.next_frontier().clone();
    assert_eq!(f1.consumed_tokens(), 3);
    let cache = exec.cache_of(f1.sequence()).expect("the first chunk created the cache");
    let w = [ExecutionWork::new(&f1, TokenWork::Prefill(PrefillChunk::new(3, 2, 5).unwrap()), &full).unwrap()];
    let c = completions(exec.execute_tokens(&w).await.unwrap()).remove(0);
    assert!(matches!(c.product(), ExecutionProduct::Sampling(ExecutorSamplingOutput::FullLogits(r)) if r.len() == 1000));
    let mut out = vec![token(&c)];
    let mut f = c.next_frontier().clone();
    assert_eq!(exec.cache_of(f.sequence()), Some(cache.clone()), "the chunk continued the same cache");
    // Greedy decode: the server's token comes back as GreedyToken; the script restarts per sequence.
    for _ in 0..4 {
        let w = [ExecutionWork::new(&f, TokenWork::Decode { token: TokenId::new(*out.last().unwrap()), position: f.consumed_tokens() }, &greedy).unwrap()];
        let c = completions(exec.execute_tokens(&w).await.unwrap()).remove(0);
        assert!(matches!(c.product(), ExecutionProduct::Sampling(ExecutorSamplingOutput::GreedyToken(_))));
        out.push(token(&c));
        f = c.next_frontier().clone();
    }
    assert_eq!(out, vec![10, 10, 20, 30, 10]);
    let server_len = exec.client().list_caches().await.unwrap().caches.iter().find(|c| c.cache_id == cache).unwrap().num_tokens;
    assert_eq!(server_len, f.consumed_tokens() as u64, "the server's cache is at the frontier");

    let closed = exec.finish_tokens(f.sequence(), ExecutionEndReason::Completed { input_tokens: 5, output_tokens: 5 }).await.unwrap();
    assert!(closed.error.is_none());
    assert!(matches!(closed.disposition, ExecutionCloseDisposition::Ended(_)));
    assert!(f.sequence().observed_end().is_some());
    let n = exec.counters();
    assert_eq!(n.batch_prefill.load(std::sync::atomic::Ordering::Relaxed), 2);
    assert_eq!(n.batch_decode.load(std::sync::atomic::Ordering::Relaxed), 4);
    assert_eq!(n.unified_decode.load(std::sync::atomic::Ordering::Relaxed), 0);
    assert_no_caches_left(&exec).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_stale_frontier_foreign_sequence_closed_sequence_and_mixed_shape() {
    let server = ServerProcess::start(&[SCRIPTED.to_string()]).await.expect("server");
    let exec = connect(&server, "mock").await;
    let other = connect(&server, "mock").await;
    let full = LogitsReturnPolicy::FullLogits;
    let prompt = ids(&[7, 8, 9]);
    let a0 = admit(&exec, &RequestId::new(), &prompt, 8).await;
    let w = [ExecutionWork::new(&a0, TokenWork::Prefill(PrefillChunk::new(0, 3, 3).unwrap()), &full).unwrap()];
    let a1 = completions(exec.execute_tokens(&w).await.unwrap()).remove(0).next_frontier().clone();
    let cache = exec.cache_of(a1.sequence()).unwrap();

    // A stale frontier (the prompt again at 0) is refused before any RPC; the cache does not move.
    let sent = exec.counters().batch_prefill.load(std::sync::atomic::Ordering::Relaxed);
    let err = exec.execute_tokens(&w).await.expect_err("stale frontier");
    assert!(err.to_string().contains("stale frontier"), "{err}");
    assert_eq!(exec.counters().batch_prefill.load(std::sync::atomic::Ordering::Relaxed), sent);

    // Another executor's sequence: refused by this executor (its issuer), nothing sent.
    let err = other.execute_tokens(&[ExecutionWork::new(&a1, TokenWork::Decode { token: TokenId::new(10), position: 3 }, &full).unwrap()]).await;
    assert!(err.is_err(), "another executor's sequence was accepted");
    assert!(other.cancel_tokens(a1.sequence()).is_err(), "another executor closed our sequence");
    assert_eq!(exec.client().list_caches().await.unwrap().caches.iter().find(|c| c.cache_id == cache).unwrap().num_tokens, 3);

    // A mixed prefill + decode batch on a model without unified decode: UnsupportedShape, no RPC.
    let b0 = admit(&exec, &RequestId::new(), &prompt, 8).await;
    let mixed = [
        ExecutionWork::new(&a1, TokenWork::Decode { token: TokenId::new(10), position: 3 }, &full).unwrap(),
        ExecutionWork::new(&b0, TokenWork::Prefill(PrefillChunk::new(0, 3, 3).unwrap()), &full).unwrap(),
    ];
    match exec.execute_tokens(&mixed).await.unwrap() {
        ExecutionBatchOutcome::NotSubmitted(n) => assert!(matches!(n.reason(), NoSubmissionReason::UnsupportedShape)),
        other => panic!("mixed batch: {other:?}"),
    }

    // Cancelled, then stepped again: refused; its cache is gone from the server.
    let closed = exec.cancel_tokens(a1.sequence()).unwrap();
    match closed.disposition {
        ExecutionCloseDisposition::Held(h) => assert!(h.wait().await.unwrap().error.is_none()),
        ExecutionCloseDisposition::Ended(_) => panic!("a remote cache cannot end synchronously"),
    }
    assert!(a1.sequence().observed_end().is_some());
    let again = [ExecutionWork::new(&a1, TokenWork::Decode { token: TokenId::new(10), position: 3 }, &full).unwrap()];
    assert!(exec.execute_tokens(&again).await.is_err(), "a cancelled sequence was stepped");
    assert!(!exec.client().list_caches().await.unwrap().caches.iter().any(|c| c.cache_id == cache));
    // Closing it twice reports the end it already has; a never-run sequence ends at once.
    assert!(matches!(exec.cancel_tokens(a1.sequence()).unwrap().disposition, ExecutionCloseDisposition::Ended(_)));
    assert!(matches!(exec.cancel_tokens(b0.sequence()).unwrap().disposition, ExecutionCloseDisposition::Ended(_)));
    // Usage that does not match the admission is reported with the close (which still ends it).
    let c0 = admit(&exec, &RequestId::new(), &prompt, 8).await;
    let closed = exec.finish_tokens(c0.sequence(), ExecutionEndReason::Completed { input_tokens: 2, output_tokens: 1 }).await.unwrap();
    assert!(closed.error.is_some(), "wrong usage accepted");
    assert_no_caches_left(&exec).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_llama_mixed_steps_in_one_unified_decode_equal_generate() {
    let dir = tiny_model_dir().expect("tiny model");
    let spec = format!("hf-causal-lm,id=tiny,path={}", dir.display());
    let server = ServerProcess::start(&[spec]).await.expect("server");
    let exec = connect(&server, "tiny").await;
    assert!(matches!(exec.memory_observation().unwrap(), MemoryObservation::Known(m) if m.total_bytes > 0));
    let greedy = LogitsReturnPolicy::GreedyArgmax { token_mask: None, repetition_penalty: None };
    let (pa, pb) = ([1u32, 100, 200, 300], [5u32, 6, 7, 8, 9, 10, 11]);
    let steps = 6;
    let fa = admit(&exec, &RequestId::new(), &ids(&pa), 32).await;
    assert!(exec.cache_of(fa.sequence()).is_some(), "paged admission: ReserveKvSlots created the cache");
    let w = [ExecutionWork::new(&fa, TokenWork::Prefill(PrefillChunk::new(0, 4, 4).unwrap()), &greedy).unwrap()];
    let c = completions(exec.execute_tokens(&w).await.unwrap()).remove(0);
    let (mut fa, mut ta) = (c.next_frontier().clone(), vec![token(&c)]);
    // B's prompt and A's decode in one step.
    let fb = admit(&exec, &RequestId::new(), &ids(&pb), 32).await;
    let w = [
        ExecutionWork::new(&fa, TokenWork::Decode { token: TokenId::new(ta[0]), position: 4 }, &greedy).unwrap(),
        ExecutionWork::new(&fb, TokenWork::Prefill(PrefillChunk::new(0, 7, 7).unwrap()), &greedy).unwrap(),
    ];
    let mut cs = completions(exec.execute_tokens(&w).await.unwrap());
    let cb = cs.pop().unwrap();
    let ca = cs.pop().unwrap();
    ta.push(token(&ca));
    fa = ca.next_frontier().clone();
    let (mut fb, mut tb) = (cb.next_frontier().clone(), vec![token(&cb)]);
    while ta.len() < steps {
        let w = [
            ExecutionWork::new(&fa, TokenWork::Decode { token: TokenId::new(*ta.last().unwrap()), position: fa.consumed_tokens() }, &greedy).unwrap(),
            ExecutionWork::new(&fb, TokenWork::Decode { token: TokenId::new(*tb.last().unwrap()), position: fb.consumed_tokens() }, &greedy).unwrap(),
        ];
        let mut cs = completions(exec.execute_tokens(&w).await.unwrap());
        let cb = cs.pop().unwrap();
        let ca = cs.pop().unwrap();
        ta.push(token(&ca));
        tb.push(token(&cb));
        fa = ca.next_frontier().clone();
        fb = cb.next_frontier().clone();
    }
    assert_eq!(ta, generate_ids(exec.client(), &pa, steps as u32).await.unwrap(), "A vs Generate");
    assert_eq!(tb, generate_ids(exec.client(), &pb, tb.len() as u32).await.unwrap(), "B vs Generate");
    let n = exec.counters();
    assert_eq!(n.batch_prefill.load(std::sync::atomic::Ordering::Relaxed) + n.batch_decode.load(std::sync::atomic::Ordering::Relaxed), 0);
    assert_eq!(n.reserve_kv_slots.load(std::sync::atomic::Ordering::Relaxed), 2);
    for f in [&fa, &fb] {
        let closed = exec.finish_tokens(f.sequence(), ExecutionEndReason::Cancelled).await.unwrap();
        assert!(closed.error.is_none());
    }
    assert_no_caches_left(&exec).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_shortfall_defers_admission_and_shutdown_releases_live_sequences() {
    let dir = tiny_model_dir().expect("tiny model");
    let spec = format!("hf-causal-lm,id=tiny,path={},kv_budget_tokens=64", dir.display());
    let server = ServerProcess::start(&[spec]).await.expect("server");
    let exec = Arc::new(connect(&server, "tiny").await);
    let fa = admit(&exec, &RequestId::new(), &ids(&[1, 2, 3, 4]), 48).await;
    // 48 of 64 tokens promised: another sequence of up to 48 tokens does not fit now, but would
    // fit the pool: a typed block shortfall, not an error.
    let req = RequestId::new();
    let prompt = ids(&[9, 9, 9]);
    let input = ExecutionAdmission { context: ExecutorPrefillAdmission::for_diagnostic(&req, &prompt, 48), adapter: None };
    match exec.admit_tokens(input).await.expect("admission") {
        TokenAdmissionOutcome::CapacityDeferred(d) => {
            assert!(d.required_blocks() > d.snapshot().free_blocks && d.required_blocks() <= d.snapshot().total_blocks, "{d:?}");
        }
        other => panic!("expected CapacityDeferred: {other:?}"),
    }
    // More than the whole pool: refused outright.
    let input = ExecutionAdmission { context: ExecutorPrefillAdmission::for_diagnostic(&req, &prompt, 100), adapter: None };
    assert!(exec.admit_tokens(input).await.is_err(), "a sequence larger than the pool was admitted");
    assert_eq!(caches(exec.client()).await, 1, "only the admitted sequence holds a cache");

    // Whole-executor close through ferrum's owner: the live sequence's cache is released.
    let owner = ExecutorOwner::new(Box::new(Arc::try_unwrap(exec).expect("sole owner")));
    let report = tokio::time::timeout(Duration::from_secs(30), owner.begin_shutdown().wait()).await.expect("shutdown in time");
    assert_eq!(report.phase(), ExecutorShutdownPhase::Retired);
    report.result().unwrap();
    assert!(fa.sequence().observed_end().is_some(), "shutdown ended the live incarnation");
    let client = server.client().await.with_model("tiny");
    assert_eq!(caches(&client).await, 0, "caches left after shutdown");
}

/// A step that fails on the server carries the `StepProgress` detail; the executor maps each row
/// from it (no `ListCaches` read): here another row's cache vanished under it, so neither row ran,
/// the batch is `NotSubmitted(Rejected)` and the live row steps again at the same frontier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_step_is_mapped_from_the_step_progress_detail() {
    let dir = tiny_model_dir().expect("tiny model");
    let server = ServerProcess::start(&[format!("hf-causal-lm,id=tiny,path={}", dir.display())]).await.expect("server");
    let exec = connect(&server, "tiny").await;
    let greedy = LogitsReturnPolicy::GreedyArgmax { token_mask: None, repetition_penalty: None };
    let (pa, pb) = (ids(&[1, 100, 200, 300]), ids(&[5, 6, 7]));
    let fa = admit(&exec, &RequestId::new(), &pa, 32).await;
    let fb = admit(&exec, &RequestId::new(), &pb, 32).await;
    let w = [
        ExecutionWork::new(&fa, TokenWork::Prefill(PrefillChunk::new(0, 4, 4).unwrap()), &greedy).unwrap(),
        ExecutionWork::new(&fb, TokenWork::Prefill(PrefillChunk::new(0, 3, 3).unwrap()), &greedy).unwrap(),
    ];
    let mut cs = completions(exec.execute_tokens(&w).await.unwrap());
    let (cb, ca) = (cs.pop().unwrap(), cs.pop().unwrap());
    let (fa, fb) = (ca.next_frontier().clone(), cb.next_frontier().clone());
    // B's cache is freed behind the executor's back (as an operator's ReleaseCache would).
    let gone = exec.cache_of(fb.sequence()).unwrap();
    assert!(exec.client().release_cache(&gone).await.unwrap().released);
    let step = [
        ExecutionWork::new(&fa, TokenWork::Decode { token: TokenId::new(token(&ca)), position: 4 }, &greedy).unwrap(),
        ExecutionWork::new(&fb, TokenWork::Decode { token: TokenId::new(token(&cb)), position: 3 }, &greedy).unwrap(),
    ];
    match exec.execute_tokens(&step).await.unwrap() {
        ExecutionBatchOutcome::NotSubmitted(n) => {
            assert!(matches!(n.reason(), NoSubmissionReason::Rejected(_)), "{:?}", n.reason())
        }
        other => panic!("a step with a vanished cache: {other:?}"),
    }
    assert_eq!(exec.counters().list_caches.load(std::sync::atomic::Ordering::Relaxed), 0, "read from the detail, no ListCaches");
    // A did not run: the same work at the same frontier runs now.
    let c = completions(exec.execute_tokens(&step[..1]).await.unwrap()).remove(0);
    assert_eq!(c.next_frontier().consumed_tokens(), 5);
    let fa = c.next_frontier().clone();
    assert!(exec.finish_tokens(fa.sequence(), ExecutionEndReason::Cancelled).await.unwrap().error.is_none());
    // B's cache is already gone: closing it still ends the incarnation.
    let _ = exec.finish_tokens(fb.sequence(), ExecutionEndReason::Cancelled).await.unwrap();
    assert_no_caches_left(&exec).await;
}
