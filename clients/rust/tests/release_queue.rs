//! Issue 15, point 2: releases reach the server even when the runtime that called
//! `release_cache` shuts down at once (ferrum's engine calls it synchronously from its loop).

use ferrum_interfaces::model_executor::{ModelExecutor, PrefillInput};
use ferrum_remote_executor::testing::ServerProcess;
use ferrum_remote_executor::{HostTensor, RemoteExecutorOptions, RemoteModelExecutor};

const N: usize = 24;

#[test]
fn releases_survive_the_callers_runtime_shutting_down() {
    let check = tokio::runtime::Runtime::new().unwrap();
    let server = check.block_on(ServerProcess::start_mock()).expect("start the server");
    let endpoint = server.endpoint.clone();

    // The caller's runtime: prefill N caches, release them all synchronously, then shut the
    // runtime down without awaiting anything.
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let exec = rt.block_on(async {
        let opts = RemoteExecutorOptions { model_id: "mock".into(), ..Default::default() };
        let exec = RemoteModelExecutor::connect(endpoint, opts).await.expect("connect");
        let mut ids = Vec::new();
        for i in 0..N {
            let out = exec.prefill(&PrefillInput::new(HostTensor::token_ids_ref(&[1, i as u32 + 2]))).await.unwrap();
            ids.push(out.kv_cache.cache_id());
        }
        for id in &ids {
            exec.release_cache(id);
        }
        exec
    });
    rt.shutdown_background();
    // Waiting needs no runtime of the caller's: the queue's thread sends on its own.
    check.block_on(exec.flush_releases());
    let (sent, largest) = exec.release_queue_stats();
    assert_eq!(sent, N as u64, "one ReleaseCache per cache, sent by the queue");
    assert_eq!(exec.release_failures(), 0);
    eprintln!("largest group of releases sent at once: {largest}");
    drop(exec); // joins the queue's thread

    let live = check.block_on(async {
        let c = server.client().await.model("mock");
        c.status().await.unwrap().status.unwrap().active_caches
    });
    assert_eq!(live, 0, "every release reached the server");
}
