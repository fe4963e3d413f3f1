//! `Session` (the bidirectional step stream) against a live server hosting the configurable "mock"
//! and the tiny llama "tiny": the same greedy tokens as the unary path, a failed step is the same
//! error as its unary call and the session goes on, pipelined steps come back in order, and
//! closing (or dropping, or the stream's deadline) ends the session and frees every cache created
//! on it.

use std::collections::HashMap;
use std::time::Duration;

use ferrum_remote_executor::proto;
use ferrum_remote_executor::testing::{tiny_model_dir, ServerProcess};
use ferrum_remote_executor::{error_reason, policy, status_to_ferrum, Client, StepResult};
use ferrum_types::FerrumError;
use tonic::Code;
use tonic_types::StatusExt;

const PROMPT: &[i32] = &[1, 100, 200, 300];
/// Decode steps in lockstep with `step()`; one more is pipelined with `send()`.
const STEPS: usize = 5;

fn token(o: Option<proto::LogitsOutput>) -> i32 {
    o.expect("an output").token_id.expect("a sampled token")
}

fn decode_request(cache_id: &str, token_id: i32) -> proto::DecodeRequest {
    proto::DecodeRequest {
        input: Some(proto::DecodeInput {
            cache_id: cache_id.to_string(),
            token_id,
            logits: Some(policy::greedy()),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// ErrorInfo's reason, domain and metadata.
fn error_info(s: &tonic::Status) -> Option<(String, String, HashMap<String, String>)> {
    s.get_details_error_info().map(|i| (i.reason, i.domain, i.metadata))
}

/// BadRequest's (field, description) pairs.
fn violations(s: &tonic::Status) -> Vec<(String, String)> {
    s.get_details_bad_request()
        .map(|b| b.field_violations.into_iter().map(|v| (v.field, v.description)).collect())
        .unwrap_or_default()
}

async fn live_caches(c: &Client) -> Vec<String> {
    let r = c.stub().list_caches(proto::ListCachesRequest { model_id: c.model_id().to_string() }).await.unwrap();
    r.into_inner().caches.into_iter().map(|h| h.cache_id).collect()
}

/// The server frees a stream's caches as the stream ends: poll ListCaches until none is left.
async fn caches_after_close(c: &Client) -> Vec<String> {
    let mut live = Vec::new();
    for _ in 0..50 {
        live = live_caches(c).await;
        if live.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    live
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_against_live_server() {
    let tiny = format!("hf-causal-lm,id=tiny,path={}", tiny_model_dir().expect("tiny model").display());
    let server = ServerProcess::start(&[ServerProcess::MOCK.to_string(), tiny]).await.expect("server");
    let c = Client::connect(server.endpoint.clone()).await.unwrap();
    c.wait_ready(Duration::from_secs(5)).await.unwrap();
    // Two models are hosted, so every step must name "tiny": the session fills it in.
    let t = c.model("tiny");

    // The unary path: prefill, then STEPS + 1 greedy decodes.
    let pre = t.prefill(PROMPT, None).await.unwrap();
    let unary_cache = pre.cache.unwrap().cache_id;
    let mut unary = vec![token(pre.output)];
    for _ in 0..=STEPS {
        let d = t.decode(&unary_cache, *unary.last().unwrap(), None).await.unwrap();
        unary.push(token(d.output));
    }
    assert!(t.release_cache(&unary_cache).await.unwrap().released);
    assert!(live_caches(&t).await.is_empty(), "the unary cache is released");

    // The same over one session: the typed shortcut and the generic step() in turn.
    let mut s = t.session().await.unwrap();
    assert_eq!(s.model_id(), "tiny");
    let pre = s.prefill(PROMPT, None).await.unwrap();
    let cache = pre.cache.unwrap();
    assert_eq!(cache.num_tokens, PROMPT.len() as u64);
    let mut toks = vec![token(pre.output)];
    for i in 0..STEPS {
        let last = *toks.last().unwrap();
        let out = if i % 2 == 0 {
            s.decode(&cache.cache_id, last, None).await.unwrap()
        } else {
            let r = s.step(decode_request(&cache.cache_id, last)).await.unwrap();
            assert_eq!(r.name(), "decode");
            r.into_decode().unwrap().output.unwrap()
        };
        assert_eq!(out.cache.unwrap().num_tokens, (PROMPT.len() + i + 1) as u64);
        toks.push(token(out.output));

        if i == 1 {
            // A failed step: the same status as the unary call, and the session goes on.
            let e = s.decode("no-such-cache", last, None).await.unwrap_err();
            assert_eq!(e.code(), Code::NotFound, "{e:?}");
            assert_eq!(error_reason(&e).as_deref(), Some("NOT_FOUND"));
            assert!(matches!(status_to_ferrum(&e), FerrumError::NotFound { .. }));
            let u = t.decode("no-such-cache", last, None).await.unwrap_err();
            assert_eq!((e.code(), e.message()), (u.code(), u.message()));
            assert_eq!(error_info(&e), error_info(&u));
        }
        if i == 3 {
            // Out of vocabulary: INVALID_ARGUMENT naming the field, as the unary call says it.
            let vocab = t.model_info().await.unwrap().vocab_size as i32;
            let e = s.decode(&cache.cache_id, vocab, None).await.unwrap_err();
            let u = t.decode(&cache.cache_id, vocab, None).await.unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
            assert_eq!((e.code(), e.message()), (u.code(), u.message()));
            assert_eq!(error_reason(&e), error_reason(&u));
            assert_eq!(error_info(&e), error_info(&u));
            assert_eq!(violations(&e), violations(&u));
            assert!(!violations(&e).is_empty(), "BadRequest names the field");
        }
    }
    assert_eq!(toks[..], unary[..=STEPS], "session tokens = unary tokens");

    // Pipelining: three steps in flight, answered in order; a failure among them is that step's.
    let a = s.send(decode_request(&cache.cache_id, *toks.last().unwrap())).unwrap();
    let b = s.send(proto::ReleaseCacheRequest { cache_id: "no-such-cache".into(), ..Default::default() }).unwrap();
    let d = s.send(decode_request("no-such-cache", 1)).unwrap();
    assert_eq!((b, d), (a + 1, a + 2));
    assert_eq!(s.in_flight(), 3);
    let refused = s.step(decode_request(&cache.cache_id, 1)).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "step() while steps are in flight");
    let (id, r) = s.recv().await.unwrap();
    assert_eq!(id, a);
    let out = r.unwrap().into_decode().unwrap().output.unwrap();
    assert_eq!(out.cache.unwrap().num_tokens, (PROMPT.len() + STEPS + 1) as u64);
    toks.push(token(out.output));
    assert_eq!(toks, unary, "the pipelined decode continues the unary sequence");
    let (id, r) = s.recv().await.unwrap();
    assert_eq!(id, b);
    assert!(matches!(r, Ok(StepResult::ReleaseCache(ref rel)) if !rel.released), "{r:?}");
    let (id, r) = s.recv().await.unwrap();
    assert_eq!(id, d);
    assert_eq!(r.unwrap_err().code(), Code::NotFound);
    assert_eq!(s.recv().await.unwrap_err().code(), Code::FailedPrecondition, "recv() with nothing in flight");

    // A second cache on the stream; both are listed until the session closes.
    let second = s.prefill(&[1, 7, 8], None).await.unwrap().cache.unwrap().cache_id;
    let live = live_caches(&t).await;
    assert!(live.contains(&cache.cache_id) && live.contains(&second), "{live:?}");
    assert_eq!(live.len(), 2, "{live:?}");

    // Close: the server frees every cache the session created.
    s.close().await.unwrap();
    assert_eq!(caches_after_close(&t).await, Vec::<String>::new(), "caches left after close");
    for id in [&cache.cache_id, &second] {
        let e = t.decode(id, 1, None).await.unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{id} after close: {e:?}");
    }

    // Dropping a session without close() cancels the stream: its caches go too.
    let mut s = t.session().await.unwrap();
    let dropped = s.prefill(PROMPT, None).await.unwrap().cache.unwrap().cache_id;
    assert_eq!(live_caches(&t).await, vec![dropped.clone()]);
    drop(s);
    assert_eq!(caches_after_close(&t).await, Vec::<String>::new(), "caches left after drop");

    // A session with no step closes cleanly; a session on another model works alike.
    t.session().await.unwrap().close().await.unwrap();
    let mut m = c.model("mock").session().await.unwrap();
    let p = m.prefill(&[1, 2], None).await.unwrap();
    assert_eq!(p.cache.unwrap().model_id, "mock");
    m.close().await.unwrap();
    assert_eq!(caches_after_close(&c.model("mock")).await, Vec::<String>::new());

    // A stream past its deadline: DEADLINE_EXCEEDED, from then on from every call; its caches go.
    let start = tokio::time::Instant::now();
    let mut s = t.clone().with_stream_timeout(Some(Duration::from_millis(1500))).session().await.unwrap();
    let cut = s.prefill(PROMPT, None).await.unwrap().cache.unwrap().cache_id;
    tokio::time::sleep_until(start + Duration::from_millis(2000)).await;
    let e = s.decode(&cut, 1, None).await.unwrap_err();
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e:?}");
    assert_eq!(s.decode(&cut, 1, None).await.unwrap_err().code(), Code::DeadlineExceeded);
    assert_eq!(s.send(decode_request(&cut, 1)).unwrap_err().code(), Code::DeadlineExceeded);
    assert_eq!(s.recv().await.unwrap_err().code(), Code::DeadlineExceeded);
    assert_eq!(s.close().await.unwrap_err().code(), Code::DeadlineExceeded);
    assert_eq!(caches_after_close(&t).await, Vec::<String>::new(), "caches left after the deadline");
}
