//! The release queue behind `RemoteModelExecutor::release_cache` (issue 15, point 2).
//!
//! ferrum's `release_cache` is synchronous and infallible, and ferrum's engine calls it from its
//! own runtime. A release spawned on that runtime is cancelled when the runtime shuts down, and
//! the cache then lives on the server until the idle TTL. This queue owns a thread with its own
//! current-thread runtime and its own channel to the server, so releases reach the server
//! whatever happens to the caller's runtime. Pending releases are sent together (concurrently)
//! when several are queued; dropping the queue sends everything still queued and joins the thread.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::watch;

use crate::client::Client;

enum Cmd {
    Release(String, watch::Sender<bool>),
}

/// Called on the queue's thread when a release has been answered: (server cache id, ok).
pub(crate) type OnDone = Arc<dyn Fn(&str, bool) + Send + Sync>;

/// Counters of the queue.
#[derive(Default)]
pub(crate) struct ReleaseStats {
    /// RPCs sent by the queue.
    pub sent: AtomicU64,
    /// The largest group of releases sent at once.
    pub largest_group: AtomicU64,
}

/// A thread that sends `ReleaseCache` RPCs on its own runtime.
pub(crate) struct ReleaseQueue {
    tx: Option<mpsc::Sender<Cmd>>,
    thread: Option<JoinHandle<()>>,
    pub stats: Arc<ReleaseStats>,
}

impl ReleaseQueue {
    /// Start the thread; it connects its own channel to `endpoint` for `model_id`.
    pub fn start(endpoint: String, model_id: String, timeout: Option<Duration>, on_done: OnDone) -> std::io::Result<Self> {
        let stats = Arc::new(ReleaseStats::default());
        let (tx, rx) = mpsc::channel::<Cmd>();
        let st = stats.clone();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let thread = std::thread::Builder::new()
            .name("ferrum-release-queue".into())
            .spawn(move || rt.block_on(run(endpoint, model_id, timeout, rx, st, on_done)))?;
        Ok(Self { tx: Some(tx), thread: Some(thread), stats })
    }

    /// Queue the release of a server cache id (returns at once); `done` is set when answered.
    /// False if the thread is gone (nothing was queued).
    pub fn release(&self, id: String, done: watch::Sender<bool>) -> bool {
        self.tx.as_ref().is_some_and(|tx| tx.send(Cmd::Release(id, done)).is_ok())
    }
}

impl Drop for ReleaseQueue {
    /// Send what is still queued, then stop the thread.
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn run(endpoint: String, model_id: String, timeout: Option<Duration>, rx: mpsc::Receiver<Cmd>,
    st: Arc<ReleaseStats>, on_done: OnDone) {
    let mut client: Option<Client> = None;
    // Blocking receive is fine: this runtime runs nothing but this loop and the RPCs below.
    while let Ok(first) = rx.recv() {
        let mut cmds = vec![first];
        cmds.extend(rx.try_iter());
        let releases: Vec<_> = cmds.into_iter().map(|Cmd::Release(id, done)| (id, done)).collect();
        if !releases.is_empty() {
            if client.is_none() {
                client = Client::connect(endpoint.clone())
                    .await
                    .ok()
                    .map(|c| c.with_model(model_id.clone()).with_timeout(timeout));
            }
            st.largest_group.fetch_max(releases.len() as u64, Ordering::Relaxed);
            let mut set = tokio::task::JoinSet::new();
            for (id, done) in releases {
                let c = client.clone();
                let st = st.clone();
                let on_done = on_done.clone();
                set.spawn(async move {
                    let ok = match &c {
                        Some(c) => c.release_cache(&id).await.is_ok(),
                        None => false,
                    };
                    st.sent.fetch_add(1, Ordering::Relaxed);
                    let _ = done.send(true);
                    on_done(&id, ok);
                });
            }
            while set.join_next().await.is_some() {}
        }
    }
}
