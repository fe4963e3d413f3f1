//! Runs ferrum-engine 0.18.4's own integration tests (their source, read from the crate that cargo
//! fetched; see build.rs) with every executor they build replaced by a [`RemoteTokenExecutor`] on
//! a live `ferrum-service serve`.
//!
//! The test files name `ferrum_testkit::{MockModelExecutor, ConfigurableModelExecutor}`; the test
//! crate's own `ferrum_testkit` module maps both to [`ShimExecutor`], whose constructors keep
//! ferrum-testkit's signatures and pick a server model with the same script:
//!
//! | ferrum-testkit 0.18.4 | served as |
//! |---|---|
//! | `MockModelExecutor::instant(V)` / `new(V, prefill, decode)` | `configurable,vocab_size=V,token_sequence=42,counter=per_sequence` (the latencies are slept in the client before the step, as the mock sleeps before touching state) |
//! | `ConfigurableModelExecutor::with_token_sequence(V, seq)` | `configurable,vocab_size=V,token_sequence=seq,counter=per_sequence` |
//! | `ConfigurableModelExecutor::with_eos_after(V, n, eos)` | `configurable,vocab_size=V,eos_after=n,eos_token=eos,counter=per_sequence` |
//!
//! `counter=per_sequence` is ferrum 0.18's scripted semantics (a decode script restarts per
//! incarnation). One server per distinct script and test binary. When the binary exits, every
//! executor's caches are checked against the server (`ListCaches`): a test whose executor left a
//! cache makes the binary fail, naming the test.
#![allow(dead_code)]

/// One upstream test binary: `upstream_test!("correctness_test.rs")` at the test crate's root
/// gives it the `ferrum_testkit` the upstream file imports (the real crate, its two scripted
/// executors served remotely) and includes the file (prepared by build.rs).
macro_rules! upstream_test {
    ($file:literal) => {
        /// What the upstream file imports as `ferrum_testkit`.
        mod ferrum_testkit {
            #[allow(unused_imports)]
            pub use crate::shim::{ShimExecutor as ConfigurableModelExecutor, ShimExecutor as MockModelExecutor};
            pub use real_ferrum_testkit::*;
        }
        include!(concat!(env!("OUT_DIR"), "/upstream/", $file));
    };
}

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use ferrum_execution::executor_lifecycle::{ExecutorShutdownObserver, ExecutorShutdownPermit};
use ferrum_execution::model_executor::{ExecutorCapabilities, ExecutorStatus, KvSlotCapacitySnapshot};
use ferrum_execution::token_execution::{
    ExecutionAdmission, ExecutionBatchOutcome, ExecutionCloseOutcome, ExecutionEndReason, ExecutionWork,
    ExecutorSequence, TokenAdmissionOutcome, TokenWork,
};
use ferrum_execution::ModelExecutor;
use ferrum_remote_execution::testing::ServerProcess;
use ferrum_remote_execution::{Client, RemoteTokenExecutor, RemoteTokenOptions, TokenObservation};
use ferrum_types::{MemoryObservation, ModelInfo, Result};

/// A server hosting one scripted model, and the executors connected to it.
struct Served {
    server: ServerProcess,
    ledgers: Vec<(String, Arc<Mutex<Vec<String>>>)>,
}

fn servers() -> &'static Mutex<HashMap<String, Served>> {
    static SERVERS: OnceLock<Mutex<HashMap<String, Served>>> = OnceLock::new();
    SERVERS.get_or_init(|| {
        // SAFETY: registering a plain extern "C" function with the C runtime.
        unsafe { libc::atexit(check_and_stop_servers) };
        Mutex::new(HashMap::new())
    })
}

/// A runtime of its own for starting servers and the exit check (callers may hold none).
fn block<T: Send + 'static>(fut: impl std::future::Future<Output = T> + Send + 'static) -> T {
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime").block_on(fut)
    })
    .join()
    .expect("shim thread")
}

/// At exit: wait for the servers to free every cache, report leftovers per test, stop the servers.
extern "C" fn check_and_stop_servers() {
    let served: Vec<(String, Served)> = servers().lock().map(|mut m| m.drain().collect()).unwrap_or_default();
    let mut leftovers = Vec::new();
    let mut executors = 0;
    for (spec, s) in served {
        let endpoint = s.server.endpoint.clone();
        let live: Vec<String> = block(async move {
            let client = Client::connect(endpoint).await.expect("connect for the exit check");
            let mut live = Vec::new();
            for _ in 0..100 {
                live = client.list_caches().await.map(|l| l.caches.into_iter().map(|c| c.cache_id).collect()).unwrap_or_default();
                if live.is_empty() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            live
        });
        for (test, ledger) in &s.ledgers {
            executors += 1;
            let left: Vec<String> = ledger.lock().unwrap().iter().filter(|id| live.contains(id)).cloned().collect();
            if !left.is_empty() {
                leftovers.push(format!("{test} ({spec}): {} cache(s) left: {left:?}", left.len()));
            }
        }
        drop(s.server);
    }
    if leftovers.is_empty() {
        eprintln!("[upstream-shim] 0 caches left on the server by each of {executors} remote executors");
    } else {
        eprintln!("[upstream-shim] FAILED: caches left on the server:\n  {}", leftovers.join("\n  "));
        // SAFETY: ends the process with a failing status (the harness has already reported).
        unsafe { libc::_exit(101) };
    }
}

/// ferrum-testkit's scripted executors, served remotely (see the module docs).
pub struct ShimExecutor {
    inner: Arc<RemoteTokenExecutor>,
    prefill_latency: Duration,
    decode_latency: Duration,
}

impl ShimExecutor {
    fn serve(options: String, prefill_latency: Duration, decode_latency: Duration) -> Self {
        let spec = format!("configurable,id=scripted,{options},counter=per_sequence");
        let endpoint = {
            let mut map = servers().lock().unwrap();
            if !map.contains_key(&spec) {
                let s = spec.clone();
                let server = block(async move { ServerProcess::start(&[s]).await }).expect("start the server");
                map.insert(spec.clone(), Served { server, ledgers: Vec::new() });
            }
            map[&spec].server.endpoint.clone()
        };
        let opts = RemoteTokenOptions { model_id: "scripted".into(), ..Default::default() };
        let inner = RemoteTokenExecutor::connect_blocking(endpoint, opts).expect("connect the remote executor");
        let test = std::thread::current().name().unwrap_or("?").to_string();
        servers().lock().unwrap().get_mut(&spec).unwrap().ledgers.push((test, inner.created_caches()));
        Self { inner: Arc::new(inner), prefill_latency, decode_latency }
    }

    /// `MockModelExecutor::instant`: token 42 at every step.
    pub fn instant(vocab_size: usize) -> Self {
        Self::new(vocab_size, Duration::ZERO, Duration::ZERO)
    }

    /// `MockModelExecutor::new`: token 42, with a latency slept before each step.
    pub fn new(vocab_size: usize, prefill_latency: Duration, decode_latency: Duration) -> Self {
        Self::serve(format!("vocab_size={vocab_size},token_sequence=42"), prefill_latency, decode_latency)
    }

    /// `ConfigurableModelExecutor::with_token_sequence`.
    pub fn with_token_sequence(vocab_size: usize, tokens: Vec<u32>) -> Self {
        let seq = tokens.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(":");
        Self::serve(format!("vocab_size={vocab_size},token_sequence={seq}"), Duration::ZERO, Duration::ZERO)
    }

    /// `ConfigurableModelExecutor::with_eos_after`: token 42, then `eos_token` from decode step `n` on.
    pub fn with_eos_after(vocab_size: usize, n: usize, eos_token: u32) -> Self {
        Self::serve(format!("vocab_size={vocab_size},eos_after={n},eos_token={eos_token}"), Duration::ZERO, Duration::ZERO)
    }

    /// Completed prefill chunks / decode rows (ferrum-testkit's `observer()`).
    pub fn observer(&self) -> TokenObservation {
        self.inner.observer()
    }

    pub fn prefill_count(&self) -> u64 {
        self.inner.observer().prefill_count()
    }

    pub fn decode_count(&self) -> u64 {
        self.inner.observer().decode_count()
    }
}

#[async_trait]
impl ModelExecutor for ShimExecutor {
    async fn admit_tokens(&self, input: ExecutionAdmission<'_>) -> Result<TokenAdmissionOutcome> {
        self.inner.admit_tokens(input).await
    }

    async fn execute_tokens(&self, work: &[ExecutionWork<'_>]) -> Result<ExecutionBatchOutcome> {
        let prefill = work.iter().any(|w| matches!(w.work(), TokenWork::Prefill(_)));
        let latency = if prefill { self.prefill_latency } else { self.decode_latency };
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        self.inner.execute_tokens(work).await
    }

    async fn finish_tokens(&self, sequence: &ExecutorSequence, reason: ExecutionEndReason) -> Result<ExecutionCloseOutcome> {
        self.inner.finish_tokens(sequence, reason).await
    }

    fn cancel_tokens(&self, sequence: &ExecutorSequence) -> Result<ExecutionCloseOutcome> {
        self.inner.cancel_tokens(sequence)
    }

    fn info(&self) -> &ModelInfo {
        self.inner.info()
    }

    fn memory_observation(&self) -> Result<MemoryObservation> {
        self.inner.memory_observation()
    }

    fn kv_capacity(&self) -> Option<usize> {
        self.inner.kv_capacity()
    }

    fn kv_slot_capacity_snapshot(&self) -> Option<KvSlotCapacitySnapshot> {
        self.inner.kv_slot_capacity_snapshot()
    }

    fn capabilities(&self) -> ExecutorCapabilities {
        self.inner.capabilities()
    }

    fn status(&self) -> ExecutorStatus {
        self.inner.status()
    }

    fn begin_shutdown(self: Arc<Self>, permit: &ExecutorShutdownPermit) -> ExecutorShutdownObserver {
        if let Err(e) = permit.check(self.as_ref()) {
            return ExecutorShutdownObserver::retained(Arc::new(self), e);
        }
        self.inner.clone().close_service()
    }
}
