//! The scheduler-facing helpers against two live servers (the tiny llama on hf-causal-lm):
//! prefix hits, ForkCache, Generate n, Abort, KV events replay, KV handoff push and pull, the
//! prefix mirror and the prefix-aware router, the executor's prefix-hit counters and clone mapping.

use std::time::{Duration, Instant};

use ferrum_remote_executor::testing::{tiny_model_dir, ServerProcess};
use ferrum_remote_executor::{constraint, handoff, prefill_and_handoff, proto, Client, GenerateOptions, HandoffMode, ImportOptions, PrefixRouter};
use tonic::Code;

fn prompt(seed: i32) -> Vec<i32> {
    (0..40).map(|i| 1 + (i * 37 + seed * 101) % 500).collect()
}

async fn tiny() -> ServerProcess {
    let spec = format!("hf-causal-lm,id=tiny,path={}", tiny_model_dir().expect("tiny model").display());
    // --kv-peer: the handoff below pulls KV between two servers of this machine
    ServerProcess::start_with_args(&[spec], &["--kv-peer".into(), "127.0.0.1:1024-65535".into()]).await.expect("server")
}

async fn greedy_after(c: &Client, cache: &str, first: i32, n: usize) -> Vec<i32> {
    let mut out = vec![first];
    while out.len() <= n {
        let o = c.decode(cache, *out.last().unwrap(), None).await.unwrap();
        out.push(o.output.unwrap().token_id.unwrap());
    }
    out
}

fn tok(o: &Option<proto::LogitsOutput>) -> i32 {
    o.as_ref().and_then(|x| x.token_id).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helpers_live() {
    let (a, b) = tokio::join!(tiny(), tiny());
    let ca = a.client().await.with_model("tiny");
    let cb = b.client().await.with_model("tiny");

    // prefix hit, salt and bypass
    let p = prompt(1);
    let first = ca.prefill(&p, None).await.unwrap();
    assert_eq!(first.cached_tokens, 0);
    let again = ca.prefill(&p, None).await.unwrap();
    assert_eq!(again.cached_tokens, 32);
    assert_eq!(tok(&again.output), tok(&first.output));
    let salted = ca.prefill_input(proto::PrefillInput { token_ids: p.clone(), cache_salt: "t".into(), ..Default::default() }).await.unwrap();
    assert_eq!(salted.cached_tokens, 0);

    // fork: shares the prompt's blocks, continues as the source
    let src = again.cache.unwrap().cache_id;
    let fork = ca.fork_cache(&src, Some(32), 0).await.unwrap();
    assert_eq!((fork.cache.as_ref().unwrap().num_tokens, fork.shared_blocks), (32, 2));
    let fid = fork.cache.unwrap().cache_id;
    let refed = ca.prefill_input(proto::PrefillInput { token_ids: p[32..].to_vec(), cache_id: fid.clone(), ..Default::default() }).await.unwrap();
    assert_eq!(tok(&refed.output), tok(&first.output));
    let want = greedy_after(&ca, &src, tok(&first.output), 3).await;
    assert_eq!(greedy_after(&ca, &fid, tok(&refed.output), 3).await, want);
    assert_eq!(ca.fork_cache("no-such-cache", None, 0).await.unwrap_err().code(), Code::NotFound);

    // generate n: three samples, each finished; the same seed again gives the same samples
    let opts = GenerateOptions { n: 3, max_tokens: 4, ignore_eos: true, sampling: Some(proto::SamplingParams { temperature: 1.0, seed: Some(7), ..Default::default() }), ..Default::default() };
    let tp = |t: &[i32]| Some(proto::generate_request::Prompt::TokenIds(proto::TokenIds { token_ids: t.to_vec() }));
    let g = ca.generate_all(tp(&prompt(3)), opts.clone()).await.unwrap();
    assert_eq!(g.samples.len(), 3);
    assert!(g.samples.iter().all(|s| s.len() == 4));
    assert!(g.finished.iter().enumerate().all(|(i, f)| f.as_ref().is_some_and(|f| f.sample_index as usize == i)));
    assert_eq!(ca.generate_all(tp(&prompt(3)), opts).await.unwrap().samples, g.samples);

    // a constrained generate spells the one choice
    let c = ca.generate_all(tp(&prompt(4)), GenerateOptions { max_tokens: 20, sampling: Some(proto::SamplingParams { constraint: Some(constraint::choice(["maybe"])), ..Default::default() }), ..Default::default() }).await.unwrap();
    assert_eq!(c.finished[0].as_ref().unwrap().text, "maybe");

    // KV events: replay from a sequence number sees the cache created then released
    let seq0 = ca.loads().await.unwrap().kv_event_seq;
    let pre = ca.prefill(&prompt(5), None).await.unwrap();
    let id = pre.cache.unwrap().cache_id;
    ca.release_cache(&id).await.unwrap();
    let mut s = ca.subscribe_kv_events(Some(seq0 + 1), true).await.unwrap();
    let mut kinds = Vec::new();
    while kinds.len() < 2 {
        let m = tokio::time::timeout(Duration::from_secs(10), s.message()).await.unwrap().unwrap().unwrap();
        if let Some(proto::subscribe_kv_events_response::Message::Event(e)) = m.message {
            if e.cache_id == id {
                kinds.push(e.kind);
            }
        }
    }
    assert_eq!(kinds, [proto::KvEventKind::Created as i32, proto::KvEventKind::Released as i32]);
    drop(s);

    // abort: a cache by id, idempotent
    let pre = ca.prefill(&[1, 2, 3], None).await.unwrap();
    let id = pre.cache.unwrap().cache_id;
    assert!(ca.abort_cache(&id).await.unwrap().released_cache);
    assert!(!ca.abort_cache(&id).await.unwrap().released_cache);
    assert_eq!(ca.abort_request("never-was").await.unwrap().aborted_streams, 0);

    // handoff push and pull: the continuation is identical to the source's
    let p7 = prompt(7);
    let refp = ca.prefill(&p7, None).await.unwrap();
    let want = greedy_after(&ca, &refp.cache.as_ref().unwrap().cache_id, tok(&refp.output), 3).await;
    for mode in [HandoffMode::Push, HandoffMode::Pull] {
        let h = prefill_and_handoff(&ca, &cb, &p7, None, 64, mode).await.unwrap();
        assert_eq!((h.cache.num_tokens, h.imported.imported_tokens), (40, 40));
        assert_eq!(greedy_after(&cb, &h.cache.cache_id, tok(&h.output), 3).await, want, "{mode:?}");
        cb.release_cache(&h.cache.cache_id).await.unwrap();
    }
    let e = handoff(&ca, &cb, "no-such-cache", HandoffMode::Pull, ImportOptions::default(), None, false).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);

    // the router follows both servers' block events and picks the one holding the prefix
    let mut router = PrefixRouter::connect(&[a.endpoint.clone(), b.endpoint.clone()]).await.unwrap();
    assert!(router.wait_following(Duration::from_secs(10)).await);
    let p9: Vec<i32> = prompt(9);
    let u9: Vec<u32> = p9.iter().map(|&t| t as u32).collect();
    let held = cb.prefill(&p9, None).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while router.prefix_matches("tiny", &u9, "", "")[1] != 32 {
        assert!(Instant::now() < deadline, "the mirror never saw the blocks");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = router.pick("tiny", &u9, "", "").await.unwrap();
    assert_eq!((r.index, r.cached_tokens), (1, 32));
    // the mirror's count is what the server then reports
    assert_eq!(cb.prefill(&p9, None).await.unwrap().cached_tokens, 32);
    assert_eq!(router.prefix_matches("tiny", &u9, "", "")[0], 0);
    let cold = router.pick("tiny", &u9, "x", "").await.unwrap();
    assert_eq!(cold.cached_tokens, 0);
    assert!(cold.load.is_some(), "a tie is broken by Loads");
    cb.release_cache(&held.cache.unwrap().cache_id).await.unwrap();
}
