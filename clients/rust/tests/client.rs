//! The thin typed client against a live server (one fresh server with the configurable "mock"
//! and the tiny llama "tiny"; the checks run in order because the mock's counter is per server).

use std::time::Duration;

use ferrum_remote_executor::proto::{self, generate_response::Event};
use ferrum_remote_executor::testing::{tiny_model_dir, ServerProcess};
use ferrum_remote_executor::{error_reason, policy, status_to_ferrum, Client};
use ferrum_types::FerrumError;
use futures_util::StreamExt;
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_client_against_live_server() {
    let tiny = format!("hf-causal-lm,id=tiny,path={}", tiny_model_dir().expect("tiny model").display());
    let server = ServerProcess::start(&[ServerProcess::MOCK.to_string(), tiny]).await.expect("server");
    let c = Client::connect(server.endpoint.clone()).await.unwrap();
    c.wait_ready(Duration::from_secs(5)).await.unwrap();

    let info = c.info().await.unwrap();
    assert_eq!(info.contract_version, "ferrum.executor.v1");
    let ids: Vec<&str> = info.models.iter().map(|m| m.model_id.as_str()).collect();
    assert!(ids.contains(&"mock") && ids.contains(&"tiny"), "{ids:?}");

    // Generate as a Stream on a fresh counter: started, [10, 10, 20, 30], finished(LENGTH).
    let mock = c.model("mock");
    let mut s = mock.generate_tokens(&[7, 8, 9], 4, None).await.unwrap();
    let mut events = Vec::new();
    while let Some(ev) = s.next().await {
        events.push(ev.unwrap().event.expect("an event"));
    }
    assert!(matches!(events.first(), Some(Event::Started(st)) if st.prompt_tokens == 3));
    let toks: Vec<i32> = events.iter().filter_map(|e| if let Event::Token(t) = e { Some(t.token_id) } else { None }).collect();
    assert_eq!(toks, vec![10, 10, 20, 30]);
    match events.last() {
        Some(Event::Finished(f)) => {
            assert_eq!(f.finish_reason, proto::FinishReason::Length as i32);
            assert_eq!(f.generated_tokens, 4);
        }
        other => panic!("last event {other:?}"),
    }

    // Step RPCs through the shortcuts; the counter continues at k3.
    let p = mock.prefill(&[1, 2], None).await.unwrap();
    let cache = p.cache.unwrap();
    assert_eq!((cache.num_tokens, p.output.unwrap().token_id), (2, Some(10)));
    let d = mock.decode(&cache.cache_id, 10, Some(policy::full_logits())).await.unwrap();
    let row = d.output.unwrap().logits.unwrap();
    assert_eq!(row.shape, vec![1000]);
    assert_eq!(row.data.len(), 4000, "FP32 row");
    let v = f32::from_le_bytes(row.data[4 * 10..4 * 11].try_into().unwrap());
    assert_eq!(v, 10.0, "k3 biases seq[0] = 10");
    let r = mock.release_cache(&cache.cache_id).await.unwrap();
    assert!(r.released);

    // Errors: the ErrorInfo reason and ferrum's kind.
    let e = mock.decode(&cache.cache_id, 10, None).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert_eq!(error_reason(&e).as_deref(), Some("NOT_FOUND"));
    assert!(matches!(status_to_ferrum(&e), FerrumError::NotFound { .. }));
    let e = c.model("no-such-model").prefill(&[1], None).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let e = mock.unified_decode(vec![]).await.unwrap_err();
    assert!(matches!(e.code(), Code::Unimplemented | Code::InvalidArgument), "{e:?}");

    // Tokenizer round trip on the tiny llama.
    let t = c.model("tiny");
    let ids = t.tokenize("Hello world", false).await.unwrap();
    assert!(!ids.is_empty());
    assert_eq!(t.detokenize(&ids, false).await.unwrap(), "Hello world");

    // A stream deadline: a long generation is cut with DEADLINE_EXCEEDED.
    let long = t.clone().with_stream_timeout(Some(Duration::from_millis(300)));
    let mut s = long
        .generate(proto::GenerateRequest {
            prompt: Some(proto::generate_request::Prompt::TokenIds(proto::TokenIds { token_ids: vec![1, 100] })),
            stop: Some(proto::StopConditions { max_tokens: 1000, ignore_eos: true, ..Default::default() }),
            ..Default::default()
        })
        .await
        .unwrap();
    let mut got = 0;
    let mut end = None;
    while let Some(ev) = s.next().await {
        match ev {
            Ok(e) => {
                if matches!(e.event, Some(Event::Token(_))) {
                    got += 1;
                }
            }
            Err(e) => {
                end = Some(e.code());
                break;
            }
        }
    }
    assert_eq!(end, Some(Code::DeadlineExceeded), "after {got} tokens");
    assert!(got < 1000);
    // The server frees the stream's cache: nothing stays live on "tiny".
    let mut live = u64::MAX;
    for _ in 0..50 {
        live = t.status().await.unwrap().status.unwrap().active_caches;
        if live == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(live, 0, "caches left on tiny after the deadline");
}
