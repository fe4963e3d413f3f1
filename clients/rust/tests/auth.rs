//! Bearer tokens (`Client::with_token`) on every kind of call, against a server started with
//! `--auth-token-file`: unary, server stream (Generate, SubscribeKvEvents), client stream
//! (ImportKv) and the bidirectional Session. No token, or a wrong one: UNAUTHENTICATED.

use ferrum_remote_executor::testing::ServerProcess;
use ferrum_remote_executor::{proto, Client, GenerateOptions, ImportOptions};
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bearer_token_on_every_call_kind() {
    let dir = std::env::temp_dir().join(format!("ferrum-rust-auth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tokens");
    std::fs::write(&file, "s3cret-token\n").unwrap();
    let server = ServerProcess::start_with_args(&[ServerProcess::MOCK.to_string()], &["--auth-token-file".into(), file.display().to_string()])
        .await
        .expect("server");
    let anon = Client::connect(server.endpoint.clone()).await.unwrap().with_model("mock");
    assert_eq!(anon.info().await.unwrap_err().code(), Code::Unauthenticated);
    let wrong = anon.clone().with_token("nope").unwrap();
    assert_eq!(wrong.prefill(&[1, 2], None).await.unwrap_err().code(), Code::Unauthenticated);
    let mut ws = wrong.session().await.unwrap();
    assert_eq!(ws.prefill(&[1, 2], None).await.unwrap_err().code(), Code::Unauthenticated);
    assert!(anon.clone().with_token("bad\ntoken").is_err(), "a token that is not valid metadata is refused locally");

    let c = anon.clone().with_token("s3cret-token").unwrap();
    assert_eq!(c.info().await.unwrap().models.len(), 1);
    let pre = c.prefill(&[1, 2, 3], None).await.unwrap();
    let id = pre.cache.unwrap().cache_id;
    // server stream
    let tp = Some(proto::generate_request::Prompt::TokenIds(proto::TokenIds { token_ids: vec![1, 2, 3] }));
    let g = c.generate_all(tp, GenerateOptions { max_tokens: 3, ignore_eos: true, ..Default::default() }).await.unwrap();
    assert_eq!(g.tokens().len(), 3);
    let mut ev = c.subscribe_kv_events(Some(1), false).await.unwrap();
    assert!(ev.message().await.unwrap().is_some());
    drop(ev);
    // client stream: the configurable executor has no KV transfer, so past auth it is UNIMPLEMENTED
    let e = c.import_kv(Default::default(), ImportOptions::default()).await.unwrap_err();
    assert_ne!(e.code(), Code::Unauthenticated, "{e:?}");
    let e = anon.import_kv(Default::default(), ImportOptions::default()).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    // bidirectional
    let mut s = c.session().await.unwrap();
    let out = s.decode(&id, 10, None).await.unwrap();
    assert_eq!(out.cache.unwrap().num_tokens, 4);
    s.close().await.unwrap();
    assert!(c.release_cache(&id).await.unwrap().released);
    let _ = std::fs::remove_dir_all(&dir);
}
