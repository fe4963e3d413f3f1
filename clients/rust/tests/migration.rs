//! Live stream migration through the typed client: two servers that authenticate callers and
//! count each other as KV peers; a greedy 64-token Generate on A is moved to B (`migrate_streams`)
//! after 2 tokens. The `GenerateStream` follows the move with the caller's token (B checks it) and
//! yields exactly the unmoved run's tokens; with following off the `migrated` event is passed on
//! and the caller resumes by hand. The hop limit is checked against a fake server (a few lines of
//! Python grpc) whose stream never settles.

use std::process::Stdio;
use std::time::Duration;

use ferrum_remote_executor::proto::{self, generate_response::Event};
use ferrum_remote_executor::testing::{python, repo_root, tiny_model_dir, ServerProcess};
use ferrum_remote_executor::{Client, GenerateOptions, MAX_MIGRATION_HOPS};
use futures_util::StreamExt;
use tokio::io::{AsyncBufReadExt, BufReader};
use tonic::Code;

const TOKEN: &str = "tok-user";

fn prompt() -> Vec<i32> {
    (0..24).map(|i| 1 + (i * 37) % 499).collect()
}

fn token_prompt() -> Option<proto::generate_request::Prompt> {
    Some(proto::generate_request::Prompt::TokenIds(proto::TokenIds { token_ids: prompt() }))
}

fn opts(request_id: &str) -> GenerateOptions {
    GenerateOptions { max_tokens: 64, ignore_eos: true, request_id: request_id.into(), ..Default::default() }
}

/// B, then A: both with `--auth-token-file`, `--kv-peer 127.0.0.1:1024-65535`, one peer token and the admin
/// RPCs open.
async fn pair(tag: &str) -> (ServerProcess, ServerProcess, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("ferrum-rust-mig-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("users"), format!("{TOKEN}\n")).unwrap();
    std::fs::write(dir.join("peers"), "tok-peer\n").unwrap();
    let tiny = format!("hf-causal-lm,id=tiny,path={}", tiny_model_dir().expect("tiny model").display());
    let args: Vec<String> = [
        "--auth-token-file",
        &dir.join("users").display().to_string(),
        "--kv-peer",
        "127.0.0.1:1024-65535",
        "--kv-peer-token-file",
        &dir.join("peers").display().to_string(),
        "--open-admin-rpcs",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let b = ServerProcess::start_with_args(std::slice::from_ref(&tiny), &args).await.expect("server B");
    let a = ServerProcess::start_with_args(&[tiny], &args).await.expect("server A");
    (a, b, dir)
}

async fn client(s: &ServerProcess) -> Client {
    Client::connect(s.endpoint.clone()).await.unwrap().with_token(TOKEN).unwrap().with_model("tiny")
}

#[derive(Default)]
struct MovedRun {
    tokens: Vec<i32>,
    indexes: Vec<u32>,
    finished: Option<proto::GenerateFinished>,
    migrated: Option<proto::GenerateMigrated>,
    followed: Vec<String>,
    moved: u32,
}

/// One Generate on `ca` that `migrate_streams` moves to `target` once 2 tokens arrived; tried
/// again (at most 3 times) when the tiny model finished all 64 tokens before the move reached a
/// step boundary (a loaded machine).
async fn moved_run(ca: &Client, target: &str) -> MovedRun {
    for attempt in 0..3 {
        let rid = format!("mv-{attempt}");
        let mut r = MovedRun::default();
        let mut s = ca.generate_with(token_prompt(), opts(&rid)).await.unwrap();
        let mut mover = None;
        while let Some(ev) = s.next().await {
            match ev.expect("stream event").event {
                Some(Event::Token(t)) => {
                    r.tokens.push(t.token_id);
                    r.indexes.push(t.index);
                    if r.tokens.len() == 2 {
                        let (c, t, rid) = (ca.clone(), target.to_string(), rid.clone());
                        mover = Some(tokio::spawn(async move { c.migrate_streams(&t, &rid, false).await }));
                    }
                }
                Some(Event::Finished(f)) => r.finished = Some(f),
                Some(Event::Migrated(m)) => r.migrated = Some(m),
                _ => {}
            }
        }
        r.followed = s.migrations().to_vec();
        let res = mover.expect("two tokens came").await.unwrap().expect("MigrateStreams");
        r.moved = res.migrated;
        if r.moved == 1 {
            return r;
        }
        println!("attempt {attempt}: not moved ({:?}): the stream ended first", res.streams);
    }
    panic!("MigrateStreams never moved the stream in 3 attempts");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_follows_a_migrated_stream() {
    let (a, b, dir) = pair("follow").await;
    let b_target = format!("127.0.0.1:{}", b.port);
    let (ca, cb) = (client(&a).await, client(&b).await);
    let reference = ca.generate_all(token_prompt(), opts("")).await.unwrap();
    assert_eq!(reference.tokens().len(), 64);
    assert!(reference.migrations.is_empty());

    let r = moved_run(&ca, &b_target).await;
    assert_eq!(r.followed, vec![b_target.clone()]);
    assert!(r.migrated.is_none(), "a followed migrated event was passed on");
    assert_eq!(r.tokens, reference.tokens());
    assert_eq!(r.indexes, (0..64).collect::<Vec<u32>>(), "a duplicate or a gap");
    let f = r.finished.expect("finished");
    assert_eq!((f.generated_tokens, f.finish_reason), (64, proto::FinishReason::Length as i32));
    // the stream ended on B: B decoded its tail and prefilled nothing (its KV came from A)
    let m = cb.status().await.unwrap().metrics.unwrap();
    assert_eq!(m.prefill_operations, 0);
    assert!(m.decode_operations > 0);
    // a request id nothing runs under moves nothing
    let none = ca.migrate_streams(&b_target, "nothing-runs", false).await.unwrap();
    assert_eq!((none.migrated, none.streams.len()), (0, 0));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_following_the_migrated_event_is_passed_on() {
    let (a, b, dir) = pair("nofollow").await;
    let b_target = format!("127.0.0.1:{}", b.port);
    let (ca, cb) = (client(&a).await, client(&b).await);
    let reference = ca.generate_all(token_prompt(), opts("")).await.unwrap();

    let r = moved_run(&ca.clone().with_follow_migrations(false), &b_target).await;
    let m = r.migrated.expect("the migrated event");
    assert!(r.finished.is_none() && r.followed.is_empty());
    assert_eq!((m.target.as_str(), m.generated_tokens as usize), (b_target.as_str(), r.tokens.len()));
    let resume = proto::GenerateRequest { resume_token: m.resume_token.clone(), ..Default::default() };
    let mut rest = cb.generate(resume.clone()).await.unwrap();
    let mut tokens = r.tokens.clone();
    while let Some(ev) = rest.message().await.unwrap() {
        if let Some(Event::Token(t)) = ev.event {
            tokens.push(t.token_id);
        }
    }
    assert_eq!(tokens, reference.tokens());
    // single use
    let again = match cb.generate(resume).await {
        Err(e) => e,
        Ok(mut s) => loop {
            match s.message().await {
                Err(e) => break e,
                Ok(None) => panic!("a resume token was used twice"),
                Ok(Some(_)) => {}
            }
        },
    };
    assert_eq!(again.code(), Code::NotFound);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Generate handler that answers every call with started, one token and a `migrated` event
/// pointing back at itself, and prints "CALL <authorization>|<resume token>" per call.
const LOOPING_SERVER: &str = r#"
import sys, grpc
from concurrent import futures
from ferrum_client._proto.ferrum.executor.v1 import executor_pb2 as pb, executor_pb2_grpc as g
class S(g.ModelExecutorServicer):
    n = 0
    def Generate(self, req, ctx):
        S.n += 1
        n = S.n
        auth = dict(ctx.invocation_metadata()).get("authorization", "")
        print(f"CALL {auth}|{req.resume_token}", flush=True)
        yield pb.GenerateResponse(started=pb.GenerateStarted(prompt_tokens=3, resumed_tokens=n - 1))
        yield pb.GenerateResponse(token=pb.TokenEvent(token_id=5, index=n - 1))
        yield pb.GenerateResponse(migrated=pb.GenerateMigrated(target=TARGET, resume_token=f"rt-{n}", generated_tokens=n))
srv = grpc.server(futures.ThreadPoolExecutor(4))
port = srv.add_insecure_port("127.0.0.1:0")
TARGET = f"127.0.0.1:{port}"
g.add_ModelExecutorServicer_to_server(S(), srv)
srv.start()
print(f"READY {port}", flush=True)
sys.stdin.read()
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_keeps_moving_is_followed_16_times_then_aborted() {
    let pypath = std::env::join_paths(
        std::iter::once(repo_root().join("clients/python")).chain(std::env::var_os("PYTHONPATH").iter().flat_map(std::env::split_paths)),
    )
    .unwrap();
    let mut child = tokio::process::Command::new(python())
        .args(["-c", LOOPING_SERVER])
        .env("PYTHONPATH", pypath)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = tokio::time::timeout(Duration::from_secs(60), lines.next_line()).await.unwrap().unwrap().unwrap();
    let port = ready.strip_prefix("READY ").expect("READY line").to_string();

    let c = Client::connect(format!("http://127.0.0.1:{port}")).await.unwrap().with_token("tok-x").unwrap().with_model("m");
    let mut s = c.generate_tokens(&[1, 2, 3], 8, None).await.unwrap();
    let (mut kinds, mut end) = (Vec::new(), None);
    while let Some(ev) = s.next().await {
        match ev {
            Ok(e) => kinds.push(match e.event {
                Some(Event::Started(_)) => "started",
                Some(Event::Token(_)) => "token",
                Some(Event::Migrated(_)) => "migrated",
                _ => "other",
            }),
            Err(e) => {
                end = Some(e);
                break;
            }
        }
    }
    let end = end.expect("the stream ends with an error");
    assert_eq!(end.code(), Code::Aborted, "{end:?}");
    let mut want = vec!["started"];
    want.extend(std::iter::repeat_n("token", MAX_MIGRATION_HOPS + 1));
    assert_eq!(kinds, want);
    assert_eq!(s.migrations().len(), MAX_MIGRATION_HOPS);
    // every call carried the caller's token, every resume the token of the event before it
    for i in 0..=MAX_MIGRATION_HOPS {
        let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line()).await.unwrap().unwrap().unwrap();
        let resume = if i == 0 { String::new() } else { format!("rt-{i}") };
        assert_eq!(line, format!("CALL Bearer tok-x|{resume}"), "call {i}");
    }
    // without following, the first migrated event is passed on and ends the stream
    let g = c
        .clone()
        .with_follow_migrations(false)
        .generate_all(Some(proto::generate_request::Prompt::TokenIds(proto::TokenIds { token_ids: vec![1] })), GenerateOptions::default())
        .await
        .unwrap();
    assert_eq!(g.migrated.as_ref().map(|m| m.target.clone()), Some(format!("127.0.0.1:{port}")));
    assert!(g.migrations.is_empty() && g.tokens().len() == 1);
    // a client over a channel of its own, without a connector, cannot follow: it says so
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}")).unwrap().connect().await.unwrap();
    let bare = Client::from_channel(channel).with_model("m");
    let e = bare.generate_all(None, GenerateOptions::default()).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    drop(child.stdin.take());
    let _ = child.kill().await;
}
