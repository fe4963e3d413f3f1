//! Where a [`crate::RemoteModelExecutor`]'s `unified_decode` steps spend their time, on both
//! sides of the wire: the client's own work, the round trip, and the server's split of it (its
//! `StepTimings`), plus the caller's time between steps (ferrum's engine loop).
//!
//! Counters only (relaxed atomics, a few per step): always on, read with
//! [`crate::RemoteModelExecutor::step_clock`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use crate::proto;

/// Running sums over the `unified_decode` calls that sent an RPC.
#[derive(Debug, Default)]
pub(crate) struct StepClock {
    steps: AtomicU64,
    rows: AtomicU64,
    prep_ns: AtomicU64,
    rpc_ns: AtomicU64,
    post_ns: AtomicU64,
    between_ns: AtomicU64,
    server_total_ns: AtomicU64,
    server_queued_ns: AtomicU64,
    server_forward_ns: AtomicU64,
    server_sampling_ns: AtomicU64,
    /// When the last step returned to the caller (for `between_ns`).
    last_end: Mutex<Option<Instant>>,
}

/// A snapshot of [`StepClock`]: sums in nanoseconds over `steps` steps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepTimes {
    /// `unified_decode` calls that sent an RPC.
    pub steps: u64,
    /// Items (rows) they carried.
    pub rows: u64,
    /// Client work before the RPC (handles, policies, conversion to protobuf).
    pub prep_ns: u64,
    /// The RPC as the client saw it (send → response decoded).
    pub rpc_ns: u64,
    /// Client work after the RPC (aliases, rows back to ferrum's types).
    pub post_ns: u64,
    /// The caller's time between the end of one step and the start of the next (ferrum's engine:
    /// scheduling, sampling bookkeeping, KV reservations); summed over consecutive steps only.
    pub between_ns: u64,
    /// The server's `StepTimings.total_ns`: from the operation's start to its response built
    /// (validation, plan, admission, worker, response); `rpc_ns - server_total_ns` is the wire,
    /// gRPC and the server's message (de)serialisation.
    pub server_total_ns: u64,
    /// `StepTimings.queued_ns`: waiting for the model's worker.
    pub server_queued_ns: u64,
    /// `StepTimings.forward_ns`: the step on the worker (forward + sampling).
    pub server_forward_ns: u64,
    /// `StepTimings.sampling_ns` (part of the forward time).
    pub server_sampling_ns: u64,
}

impl StepTimes {
    /// What was added since `earlier` (a snapshot of the same clock).
    pub fn since(&self, earlier: &StepTimes) -> StepTimes {
        StepTimes {
            steps: self.steps - earlier.steps,
            rows: self.rows - earlier.rows,
            prep_ns: self.prep_ns - earlier.prep_ns,
            rpc_ns: self.rpc_ns - earlier.rpc_ns,
            post_ns: self.post_ns - earlier.post_ns,
            between_ns: self.between_ns - earlier.between_ns,
            server_total_ns: self.server_total_ns - earlier.server_total_ns,
            server_queued_ns: self.server_queued_ns - earlier.server_queued_ns,
            server_forward_ns: self.server_forward_ns - earlier.server_forward_ns,
            server_sampling_ns: self.server_sampling_ns - earlier.server_sampling_ns,
        }
    }

    /// Per-step means in milliseconds, as a JSON object (for benchmark output).
    pub fn per_step_ms(&self) -> serde_json::Value {
        let n = self.steps.max(1) as f64;
        let ms = |ns: u64| (ns as f64 / n / 1e6 * 1000.0).round() / 1000.0;
        let server_other = self.server_total_ns.saturating_sub(self.server_queued_ns + self.server_forward_ns);
        serde_json::json!({
            "steps": self.steps,
            "rows_per_step": (self.rows as f64 / n * 100.0).round() / 100.0,
            "client_prep_ms": ms(self.prep_ns),
            "rpc_ms": ms(self.rpc_ns),
            "client_post_ms": ms(self.post_ns),
            "between_steps_ms": ms(self.between_ns),
            "server_total_ms": ms(self.server_total_ns),
            "server_queued_ms": ms(self.server_queued_ns),
            "server_forward_ms": ms(self.server_forward_ns),
            "server_sampling_ms": ms(self.server_sampling_ns),
            "server_other_ms": ms(server_other),
            "wire_ms": ms(self.rpc_ns.saturating_sub(self.server_total_ns)),
        })
    }
}

fn add(c: &AtomicU64, v: u64) {
    c.fetch_add(v, Ordering::Relaxed);
}

fn ns(d: std::time::Duration) -> u64 {
    d.as_nanos().min(u64::MAX as u128) as u64
}

impl StepClock {
    /// A step starts now: counts the caller's time since the previous step ended.
    pub(crate) fn start(&self) -> Instant {
        let now = Instant::now();
        if let Some(prev) = self.last_end.lock().unwrap().take() {
            add(&self.between_ns, ns(now.saturating_duration_since(prev)));
        }
        now
    }

    /// A step's RPC: started at `t0`, RPC sent at `sent`, answered at `answered`, returned at `end`.
    pub(crate) fn record(&self, rows: usize, t0: Instant, sent: Instant, answered: Instant, timings: Option<&proto::StepTimings>) {
        let end = Instant::now();
        add(&self.steps, 1);
        add(&self.rows, rows as u64);
        add(&self.prep_ns, ns(sent - t0));
        add(&self.rpc_ns, ns(answered - sent));
        add(&self.post_ns, ns(end - answered));
        if let Some(t) = timings {
            add(&self.server_total_ns, t.total_ns);
            add(&self.server_queued_ns, t.queued_ns);
            add(&self.server_forward_ns, t.forward_ns);
            add(&self.server_sampling_ns, t.sampling_ns);
        }
        *self.last_end.lock().unwrap() = Some(end);
    }

    /// A step failed or sent nothing: the next one does not count the gap.
    pub(crate) fn forget_end(&self) {
        *self.last_end.lock().unwrap() = None;
    }

    pub(crate) fn snapshot(&self) -> StepTimes {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StepTimes {
            steps: g(&self.steps),
            rows: g(&self.rows),
            prep_ns: g(&self.prep_ns),
            rpc_ns: g(&self.rpc_ns),
            post_ns: g(&self.post_ns),
            between_ns: g(&self.between_ns),
            server_total_ns: g(&self.server_total_ns),
            server_queued_ns: g(&self.server_queued_ns),
            server_forward_ns: g(&self.server_forward_ns),
            server_sampling_ns: g(&self.server_sampling_ns),
        }
    }
}
