//! [`RemoteTokenExecutor`]: ferrum-execution 0.18's `ModelExecutor` (the token-execution protocol)
//! over the `ferrum.executor.v1` contract. Admission and closing live here; one step
//! (`execute_tokens`) is in `steps.rs`.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use ferrum_execution::executor_lifecycle::{ExecutorShutdownObserver, ExecutorShutdownPermit};
use ferrum_execution::model_executor::{ExecutorCapabilities, ExecutorStatus, KvSlotCapacitySnapshot};
use ferrum_execution::token_execution::{
    ExecutionAdmission, ExecutionBatchOutcome, ExecutionCloseOutcome, ExecutionEndReason, ExecutionFrontier,
    ExecutionTerminalOutcome, ExecutionWork, ExecutorSequence, ExecutorSequenceIssuer, TokenAdmissionCapacityDeferral,
    TokenAdmissionOutcome,
};
use ferrum_execution::ModelExecutor;
use ferrum_interfaces::adapter::AdapterExecutionSupport;
use ferrum_remote_executor::{proto, Client};
use ferrum_types::{AllocatorCapacityDomain, FerrumError, MemoryObservation, MemoryUsage, ModelInfo, RequestId, Result, TokenId};
use tonic::Code;

use crate::convert;
use crate::runtime::BackgroundRuntime;

/// How to reach the model.
#[derive(Debug, Clone)]
pub struct RemoteTokenOptions {
    /// The hosted model; empty = the server's only model.
    pub model_id: String,
    /// Per-RPC deadline.
    pub timeout: Option<Duration>,
    /// `UnifiedDecode` steps on one `Session` stream (default) instead of unary calls
    /// (`ferrum_remote_executor::session_steps`).
    pub session_steps: bool,
}

impl Default for RemoteTokenOptions {
    fn default() -> Self {
        Self { model_id: String::new(), timeout: Some(Duration::from_secs(60)), session_steps: true }
    }
}

/// RPCs and rows this executor has sent (tests and benchmarks read them).
#[derive(Debug, Default)]
pub struct TokenCounters {
    pub reserve_kv_slots: AtomicU64,
    pub unified_decode: AtomicU64,
    pub batch_prefill: AtomicU64,
    pub batch_decode: AtomicU64,
    pub release_cache: AtomicU64,
    /// Completed prefill chunks and decode rows.
    pub prefill_rows: AtomicU64,
    pub decode_rows: AtomicU64,
    /// `execute_tokens` calls answered `NotSubmitted(UnsupportedShape)` without an RPC.
    pub unsupported_shape: AtomicU64,
    /// `ListCaches` reads after a failed step whose status carried no `StepProgress` detail.
    pub list_caches: AtomicU64,
}

/// Completed prefill chunks and decode rows, read after the executor is gone.
#[derive(Debug, Clone)]
pub struct TokenObservation {
    counters: Arc<TokenCounters>,
}

impl TokenObservation {
    /// Completed prefill chunks.
    pub fn prefill_count(&self) -> u64 {
        self.counters.prefill_rows.load(Ordering::Relaxed)
    }
    /// Completed decode rows.
    pub fn decode_count(&self) -> u64 {
        self.counters.decode_rows.load(Ordering::Relaxed)
    }
}

/// One admitted incarnation: what it was admitted with, how far it is, and its server cache.
pub(crate) struct Entry {
    pub request: RequestId,
    pub prompt: Arc<[TokenId]>,
    pub maximum: usize,
    pub product_prompt: usize,
    pub replayed: usize,
    pub frontier: ExecutionFrontier,
    /// None until a reservation or the first step creates it on the server.
    pub cache_id: Option<String>,
    /// The LoRA adapter (a name registered on the server) the first step binds the cache to.
    pub adapter: Option<String>,
}

/// ferrum-execution 0.18.4's `ModelExecutor` implemented over the service's RPCs.
///
/// `ExecutorSequence` is a process-local identity; this executor issues them and keeps the map
/// sequence → server `cache_id` (plus the frontier it expects next). See the crate docs for the
/// method → RPC table.
pub struct RemoteTokenExecutor {
    pub(crate) rt: BackgroundRuntime,
    pub(crate) client: Client,
    info: ModelInfo,
    capabilities: ExecutorCapabilities,
    pub(crate) remote_caps: proto::ExecutorCapabilities,
    kv_capacity: Option<usize>,
    status: ExecutorStatus,
    pub(crate) issuer: ExecutorSequenceIssuer,
    pub(crate) entries: Mutex<HashMap<ExecutorSequence, Entry>>,
    pub(crate) counters: Arc<TokenCounters>,
    /// The `Session` stream unified steps go on (None: `session_steps` off).
    pub(crate) session: Option<Arc<ferrum_remote_executor::session_steps::SessionSteps>>,
    pub(crate) timeout: Option<Duration>,
    /// `Some(false)` once the server answered "no paged admission": later admissions skip the RPC.
    paged: Mutex<Option<bool>>,
    pub(crate) domain: AllocatorCapacityDomain,
    adapters: Mutex<HashSet<String>>,
    memory: Mutex<Option<(Instant, MemoryObservation)>>,
    /// Every cache id this executor created (tests check none is left on the server).
    pub(crate) created: Arc<Mutex<Vec<String>>>,
    next_name: AtomicU64,
}

impl std::fmt::Debug for RemoteTokenExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteTokenExecutor").field("model_id", &self.client.model_id()).finish()
    }
}

pub(crate) fn st(e: tonic::Status) -> FerrumError {
    convert::error(&e)
}

/// What `connect` reads once (the trait's synchronous getters answer from it).
struct Described {
    client: Client,
    info: proto::ModelInfo,
    caps: proto::ExecutorCapabilities,
    status: proto::StatusResponse,
    kv: proto::KvCapacity,
    session_steps: bool,
    timeout: Option<Duration>,
}

async fn describe(endpoint: String, opts: RemoteTokenOptions) -> Result<Described> {
    let client = Client::connect(endpoint.clone())
        .await
        .map_err(|e| FerrumError::network(format!("connect {endpoint}: {e}")))?
        .with_timeout(opts.timeout);
    let all = client.model("").info().await.map_err(st)?;
    let info = match (opts.model_id.as_str(), all.models.as_slice()) {
        ("", [one]) => one.clone(),
        ("", many) => {
            return Err(FerrumError::invalid_parameter(format!(
                "the server hosts {} models; name one in RemoteTokenOptions.model_id",
                many.len()
            )))
        }
        (id, models) => models
            .iter()
            .find(|m| m.model_id == id)
            .cloned()
            .ok_or_else(|| FerrumError::not_found(format!("model {id:?} is not hosted")))?,
    };
    let client = client.with_model(info.model_id.clone());
    let caps = client.capabilities().await.map_err(st)?;
    let status = client.status().await.map_err(st)?;
    let kv = client.kv_capacity().await.map_err(st)?;
    Ok(Described { client, info, caps, status, kv, session_steps: opts.session_steps, timeout: opts.timeout })
}

impl RemoteTokenExecutor {
    /// Connect to `endpoint` and read the model's info, capabilities, status and KV capacity.
    pub async fn connect(endpoint: impl Into<String>, opts: RemoteTokenOptions) -> Result<Self> {
        let rt = BackgroundRuntime::new()?;
        let d = rt.run(describe(endpoint.into(), opts)).await??;
        Self::from_described(rt, d)
    }

    /// [`RemoteTokenExecutor::connect`] from synchronous code (also inside a caller's runtime).
    pub fn connect_blocking(endpoint: impl Into<String>, opts: RemoteTokenOptions) -> Result<Self> {
        let rt = BackgroundRuntime::new()?;
        let d = rt.block(describe(endpoint.into(), opts))??;
        Self::from_described(rt, d)
    }

    fn from_described(rt: BackgroundRuntime, d: Described) -> Result<Self> {
        Ok(Self {
            info: convert::model_info(&d.info)?,
            capabilities: convert::capabilities(&d.caps)?,
            status: convert::status(&d.status.status.unwrap_or_default()),
            kv_capacity: d.kv.per_request_tokens.map(|t| t as usize),
            remote_caps: d.caps,
            client: d.client,
            rt,
            issuer: ExecutorSequenceIssuer::new(),
            entries: Mutex::new(HashMap::new()),
            counters: Arc::default(),
            session: d.session_steps.then(Arc::default),
            timeout: d.timeout,
            paged: Mutex::new(None),
            domain: AllocatorCapacityDomain::new(),
            adapters: Mutex::new(HashSet::new()),
            memory: Mutex::new(None),
            created: Arc::default(),
            next_name: AtomicU64::new(1),
        })
    }

    /// The `Session` stream's steps (`sent()`: `UnifiedDecode`s that went on it, the rest of
    /// `TokenCounters::unified_decode` went unary); None with `session_steps` off. Shared: it
    /// outlives the executor.
    pub fn session(&self) -> Option<Arc<ferrum_remote_executor::session_steps::SessionSteps>> {
        self.session.clone()
    }

    /// The RPC / row counters (shared: they outlive the executor).
    pub fn counters(&self) -> Arc<TokenCounters> {
        self.counters.clone()
    }

    /// Live incarnations (admitted, not yet finished or cancelled).
    pub fn live_sequences(&self) -> usize {
        self.entries.lock().unwrap().len()
    }

    /// Every cache id this executor has created on the server (released ones included).
    pub fn created_caches(&self) -> Arc<Mutex<Vec<String>>> {
        self.created.clone()
    }

    /// A typed client on the same model (same channel).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The server cache of a live incarnation (None before its first step or when unknown).
    pub fn cache_of(&self, sequence: &ExecutorSequence) -> Option<String> {
        self.entries.lock().unwrap().get(sequence).and_then(|e| e.cache_id.clone())
    }

    fn max_tokens(&self) -> usize {
        self.kv_capacity.unwrap_or(self.info.max_sequence_length).min(self.info.max_sequence_length.max(1))
    }

    /// The block pool as ferrum's allocator snapshot (None when the executor does not page its KV).
    pub(crate) async fn slot_snapshot(&self) -> Option<KvSlotCapacitySnapshot> {
        let client = self.client.clone();
        let s = self.rt.run(async move { client.kv_slot_capacity().await }).await.ok()?.ok()??;
        Some(KvSlotCapacitySnapshot {
            block_size: s.block_size as usize,
            total_blocks: s.total_blocks as usize,
            free_blocks: s.free_blocks as usize,
        })
    }

    /// A typed block shortfall for `tokens` more tokens, when the pool really is short of them
    /// but could hold them (ferrum's `CapacityDeferred` / `AllocatorCapacity` evidence).
    pub(crate) async fn capacity_deferral(&self, tokens: usize) -> Option<TokenAdmissionCapacityDeferral> {
        let snapshot = self.slot_snapshot().await?;
        let required = tokens.div_ceil(snapshot.block_size.max(1));
        TokenAdmissionCapacityDeferral::new(self.domain.clone(), required, snapshot).ok()
    }

    /// `LoadAdapter(name, path)` once per name (an already registered name is fine).
    async fn ensure_adapter(&self, name: &str, path: &str) -> Result<()> {
        if self.adapters.lock().unwrap().contains(name) {
            return Ok(());
        }
        let (client, n, p) = (self.client.clone(), name.to_string(), path.to_string());
        match self.rt.run(async move { client.load_adapter(&n, &p).await }).await? {
            Ok(_) => {}
            Err(e) if e.code() == Code::AlreadyExists => {}
            Err(e) => return Err(st(e)),
        }
        self.adapters.lock().unwrap().insert(name.to_string());
        Ok(())
    }

    /// `ReserveKvSlots` with `new_sequence`: an empty server cache holding the prompt's slots,
    /// checked against the sequence's whole extent. Ok(None): no paged admission on this model.
    async fn reserve_new(&self, prompt_len: usize, maximum: usize) -> Result<std::result::Result<Option<String>, TokenAdmissionOutcome>> {
        if *self.paged.lock().unwrap() == Some(false) {
            return Ok(Ok(None));
        }
        let name = format!("ferrum18-seq-{}", self.next_name.fetch_add(1, Ordering::Relaxed));
        let request = proto::KvSlotRequest {
            cache_id: name,
            target_len: prompt_len as u64,
            admission_target_len: Some(maximum as u64),
            new_sequence: true,
        };
        self.counters.reserve_kv_slots.fetch_add(1, Ordering::Relaxed);
        let client = self.client.clone();
        match self.rt.run(async move { client.reserve_kv_slots(vec![request]).await }).await? {
            Ok(None) => {
                *self.paged.lock().unwrap() = Some(false);
                Ok(Ok(None))
            }
            Ok(Some(r)) => {
                *self.paged.lock().unwrap() = Some(true);
                let id = r.allocations.first().map(|a| a.created_cache_id.clone()).unwrap_or_default();
                if id.is_empty() {
                    return Err(FerrumError::backend("ReserveKvSlots created no cache for a new sequence"));
                }
                self.created.lock().unwrap().push(id.clone());
                Ok(Ok(Some(id)))
            }
            Err(e) if e.code() == Code::ResourceExhausted => match self.capacity_deferral(maximum).await {
                Some(d) => Ok(Err(TokenAdmissionOutcome::CapacityDeferred(d))),
                // Beyond the whole pool, or refused for another bound (admission limits): no typed
                // deferral can be built from the wire (see README, "What the wire lacks").
                None => Err(st(e)),
            },
            Err(e) => Err(st(e)),
        }
    }

    /// `ReleaseCache` on this executor's runtime (idempotent on the server).
    pub(crate) fn spawn_release(&self, cache_id: String) -> tokio::task::JoinHandle<Result<()>> {
        let client = self.client.clone();
        self.counters.release_cache.fetch_add(1, Ordering::Relaxed);
        self.rt.handle().spawn(async move { client.release_cache(&cache_id).await.map(|_| ()).map_err(st) })
    }

    /// Forget `sequence` and hand back its entry (None: not live here).
    fn take(&self, sequence: &ExecutorSequence) -> Result<Option<Entry>> {
        self.issuer.frontier(sequence, 0)?; // a sequence another executor issued is refused
        Ok(self.entries.lock().unwrap().remove(sequence))
    }

    fn check_usage(entry: &Entry, reason: ExecutionEndReason) -> Result<()> {
        if let ExecutionEndReason::Completed { input_tokens, output_tokens } = reason {
            let end = input_tokens.checked_add(output_tokens.saturating_sub(1));
            if input_tokens != entry.product_prompt || output_tokens < entry.replayed || end.is_none_or(|e| e > entry.maximum) {
                return Err(FerrumError::request_validation(format!(
                    "completion usage {input_tokens} + {output_tokens} does not match the admission ({} prompt tokens, at most {})",
                    entry.product_prompt, entry.maximum
                )));
            }
        }
        Ok(())
    }

    /// The whole-executor close once the caller's permit is checked (`begin_shutdown`; a wrapper
    /// that owns this executor checks its own permit and calls this): a thread of its own (the
    /// caller may hold no runtime) releases every live incarnation's cache, ends them, and then
    /// reports `Retired` (with the first release error, if any).
    pub fn close_service(self: Arc<Self>) -> ExecutorShutdownObserver {
        let (reporter, observer) = ExecutorShutdownObserver::channel(Arc::new(self.clone()));
        let handle = self.rt.handle().clone();
        let me = self.clone();
        let started = std::thread::Builder::new().name("ferrum-remote-close".into()).spawn(move || {
            let error = handle.block_on(me.close_all());
            reporter.retired(error);
        });
        match started {
            Ok(_) => observer,
            Err(e) => ExecutorShutdownObserver::retained(Arc::new(self), FerrumError::internal(format!("close thread: {e}"))),
        }
    }

    /// Counts that outlive the executor (ferrum-testkit's `observer()` shape).
    pub fn observer(&self) -> TokenObservation {
        TokenObservation { counters: self.counters.clone() }
    }

    /// Close every live incarnation (shutdown): release their caches, then mark them ended.
    async fn close_all(self: Arc<Self>) -> Option<FerrumError> {
        let entries: Vec<(ExecutorSequence, Entry)> = self.entries.lock().unwrap().drain().collect();
        let mut error = None;
        for (sequence, entry) in entries {
            if let Some(id) = entry.cache_id {
                if let Err(e) = self.spawn_release(id).await.unwrap_or_else(|e| Err(FerrumError::internal(e.to_string()))) {
                    error.get_or_insert(e);
                }
            }
            if let Err(e) = self.issuer.ended(&sequence) {
                error.get_or_insert(e);
            }
        }
        error
    }
}

#[async_trait]
impl ModelExecutor for RemoteTokenExecutor {
    async fn admit_tokens(&self, input: ExecutionAdmission<'_>) -> Result<TokenAdmissionOutcome> {
        input.validate()?;
        let ctx = input.context;
        if ctx.maximum_sequence_tokens > self.max_tokens() {
            return Err(FerrumError::request_validation(format!(
                "maximum_sequence_tokens {} exceeds the model's {} tokens per sequence",
                ctx.maximum_sequence_tokens,
                self.max_tokens()
            )));
        }
        if let Some(t) = ctx.input_tokens.iter().find(|t| t.get() as usize >= self.info.vocab_size) {
            return Err(FerrumError::request_validation(format!(
                "input token {} is outside the vocabulary ({})",
                t.get(),
                self.info.vocab_size
            )));
        }
        let adapter = match input.adapter {
            None => None,
            Some(_) if !self.remote_caps.supports_lora => {
                return Err(FerrumError::unsupported("the remote model has no LoRA support (Capabilities.supports_lora)"))
            }
            Some(a) => {
                self.ensure_adapter(a.name, a.path).await?;
                Some(a.name.to_string())
            }
        };
        {
            let entries = self.entries.lock().unwrap();
            if let Some(entry) = entries.values().find(|e| &e.request == ctx.request_id) {
                let same = entry.frontier.consumed_tokens() == 0
                    && entry.prompt.as_ref() == ctx.input_tokens
                    && entry.maximum == ctx.maximum_sequence_tokens
                    && entry.adapter == adapter;
                return if same {
                    Ok(TokenAdmissionOutcome::Admitted(entry.frontier.clone()))
                } else {
                    Err(FerrumError::request_validation("request already has a different live admission"))
                };
            }
        }
        let cache_id = match self.reserve_new(ctx.input_tokens.len(), ctx.maximum_sequence_tokens).await? {
            Ok(id) => id,
            Err(deferred) => return Ok(deferred),
        };
        let sequence = self.issuer.issue_sequence()?;
        let frontier = self.issuer.frontier(&sequence, 0)?;
        self.entries.lock().unwrap().insert(
            sequence,
            Entry {
                request: ctx.request_id.clone(),
                prompt: ctx.input_tokens.into(),
                maximum: ctx.maximum_sequence_tokens,
                product_prompt: ctx.product_prompt_tokens,
                replayed: ctx.replayed_output_tokens,
                frontier: frontier.clone(),
                cache_id,
                adapter,
            },
        );
        Ok(TokenAdmissionOutcome::Admitted(frontier))
    }

    async fn execute_tokens(&self, work: &[ExecutionWork<'_>]) -> Result<ExecutionBatchOutcome> {
        self.execute(work).await
    }

    async fn finish_tokens(&self, sequence: &ExecutorSequence, reason: ExecutionEndReason) -> Result<ExecutionCloseOutcome> {
        let Some(entry) = self.take(sequence)? else {
            return sequence
                .observed_end()
                .map(ExecutionCloseOutcome::ended)
                .ok_or_else(|| FerrumError::request_validation("finish_tokens: not a live incarnation of this executor"));
        };
        let usage = Self::check_usage(&entry, reason);
        let released = match entry.cache_id {
            Some(id) => self.spawn_release(id).await.unwrap_or_else(|e| Err(FerrumError::internal(e.to_string()))),
            None => Ok(()),
        };
        let mut outcome = ExecutionCloseOutcome::ended(self.issuer.ended(sequence)?);
        if let Err(e) = usage.and(released) {
            outcome = outcome.with_error(e);
        }
        Ok(outcome)
    }

    fn cancel_tokens(&self, sequence: &ExecutorSequence) -> Result<ExecutionCloseOutcome> {
        let Some(entry) = self.take(sequence)? else {
            return sequence
                .observed_end()
                .map(ExecutionCloseOutcome::ended)
                .ok_or_else(|| FerrumError::request_validation("cancel_tokens: not a live incarnation of this executor"));
        };
        let Some(cache_id) = entry.cache_id else {
            return Ok(ExecutionCloseOutcome::ended(self.issuer.ended(sequence)?));
        };
        // Synchronous: the release runs on the executor's runtime whether or not anyone waits;
        // the Held observer ends the incarnation once the server has freed the cache.
        let release = self.spawn_release(cache_id);
        let (issuer, seq) = (self.issuer.clone(), sequence.clone());
        let held = self.issuer.held(self.issuer.recovery_key(sequence)?, async move {
            let released = release.await.unwrap_or_else(|e| Err(FerrumError::internal(e.to_string())));
            let outcome = ExecutionTerminalOutcome::ended(issuer.ended(&seq)?);
            Ok(match released {
                Ok(()) => outcome,
                Err(e) => outcome.with_error(e),
            })
        })?;
        Ok(ExecutionCloseOutcome::held(held))
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn memory_observation(&self) -> Result<MemoryObservation> {
        if let Some((at, m)) = self.memory.lock().unwrap().as_ref() {
            if at.elapsed() < Duration::from_secs(1) {
                return Ok(m.clone());
            }
        }
        let client = self.client.clone();
        let observed = match self.rt.block(async move { client.kv_capacity().await })? {
            Ok(kv) if kv.total_bytes > 0 => {
                let mut usage = MemoryUsage {
                    total_bytes: kv.total_bytes as usize,
                    used_bytes: kv.used_bytes as usize,
                    free_bytes: kv.total_bytes.saturating_sub(kv.used_bytes) as usize,
                    gpu_memory_bytes: self.info.device.is_gpu().then_some(kv.used_bytes as usize),
                    cpu_memory_bytes: (!self.info.device.is_gpu()).then_some(kv.used_bytes as usize),
                    cache_memory_bytes: kv.used_bytes as usize,
                    utilization_percent: 0.0,
                };
                usage.calculate_utilization();
                MemoryObservation::Known(usage)
            }
            // No real tensors (budget 0 bytes) or an optional measurement that failed: Unknown.
            _ => MemoryObservation::Unknown,
        };
        *self.memory.lock().unwrap() = Some((Instant::now(), observed.clone()));
        Ok(observed)
    }

    fn kv_capacity(&self) -> Option<usize> {
        self.kv_capacity
    }

    fn kv_slot_capacity_snapshot(&self) -> Option<KvSlotCapacitySnapshot> {
        if *self.paged.lock().unwrap() != Some(true) {
            return None;
        }
        let client = self.client.clone();
        let s = self.rt.block(async move { client.kv_slot_capacity().await }).ok()?.ok()??;
        Some(KvSlotCapacitySnapshot {
            block_size: s.block_size as usize,
            total_blocks: s.total_blocks as usize,
            free_blocks: s.free_blocks as usize,
        })
    }

    fn capabilities(&self) -> ExecutorCapabilities {
        self.capabilities.clone()
    }

    fn adapter_execution_support(&self) -> AdapterExecutionSupport {
        if self.remote_caps.supports_lora {
            AdapterExecutionSupport::PerSequenceLora
        } else {
            AdapterExecutionSupport::Unsupported
        }
    }

    fn status(&self) -> ExecutorStatus {
        let mut s = self.status.clone();
        s.prefill_operations = self.counters.prefill_rows.load(Ordering::Relaxed);
        s.decode_operations = self.counters.decode_rows.load(Ordering::Relaxed);
        s
    }

    fn begin_shutdown(self: Arc<Self>, permit: &ExecutorShutdownPermit) -> ExecutorShutdownObserver {
        if let Err(e) = permit.check(self.as_ref()) {
            return ExecutorShutdownObserver::retained(Arc::new(self), e);
        }
        self.close_service()
    }
}
