//! [`RemoteModelExecutor`]: ferrum's `ModelExecutor` trait implemented over the contract.
//!
//! See the crate docs for the method-by-method mapping and where the trait and the contract
//! cannot meet exactly.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use ferrum_interfaces::model_executor::{
    DecodeInput, DecodeOutput, ExecutorCapabilities, ExecutorStatus, KvSlotCapacitySnapshot,
    KvSlotRequest, KvSlotReservation, LogitsReturnPolicy, ModelExecutor, PrefillInput, PrefillOutput,
    UnifiedBatch,
};
use ferrum_interfaces::{KvCacheHandle, TensorRef};
use ferrum_types::{Device, ExecutorAdmissionLimits, FerrumError, ModelInfo, Result};
use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::sync::watch;

use crate::client::{policy, Client};
use crate::convert;
use crate::error::status_to_ferrum;
use crate::kv::{as_remote, RemoteKvCacheHandle};
use crate::proto;
use crate::release_queue::{OnDone, ReleaseQueue};
use crate::tensor::{f32_to_token_id, tensor_token_ids, HostTensor};

/// Options of a [`RemoteModelExecutor`].
#[derive(Debug, Clone)]
pub struct RemoteExecutorOptions {
    /// The hosted model to drive. Empty = the server's only model (an error if it hosts several).
    pub model_id: String,
    /// Deadline of each RPC.
    pub timeout: Option<Duration>,
    /// Send `DecodeInput.position = handle.num_tokens()` for handles this crate minted, so the
    /// server refuses a step whose handle is stale (FAILED_PRECONDITION → `RequestValidation`).
    /// Off by default: ferrum's `truncate_kv` cannot hand back the new handle, so after a
    /// truncation the caller's handle is stale by design and the server's length is the truth.
    pub guard_positions: bool,
    /// Call `ReserveKvSlots` from the synchronous `reserve_kv_slots` (a blocking RPC on a
    /// multi-thread runtime). Off = the trait's default `Ok(None)`.
    pub admission_rpc: bool,
    /// Reserve this many tokens beyond each `KvSlotRequest.target_len`, and answer a later
    /// `reserve_kv_slots` whose requests are all already covered by what the server granted
    /// (`blocks_after × block_size`) locally, with no new blocks, as the server would. ferrum's
    /// engine reserves before every step (one token more per sequence each time), so this turns
    /// one `ReserveKvSlots` per step into one per `reserve_ahead_tokens` steps. A reservation the
    /// server refuses with the extra tokens is retried without them. 0 = exact reservations, one
    /// RPC per call.
    pub reserve_ahead_tokens: usize,
    /// Refresh the cached `status()` in the background when it is older than this.
    pub status_refresh: Duration,
    /// When the executor is dropped, release every server cache it handed out and nobody
    /// released, as dropping an in-process ferrum executor drops its model's KV. This is what
    /// frees the draft caches of ferrum's speculative engine, which never calls `release_cache`
    /// on its draft executor (see README, "How ferrum's engine uses this client").
    pub release_on_drop: bool,
    /// Send `unified_decode` steps as steps of one `Session` stream (opened at the first step,
    /// kept for the executor's life) instead of one unary `UnifiedDecode` each: no call set-up
    /// per step on either side. Only steps whose items all name a cache the server already holds
    /// go on the stream (ferrum's engine reserves every new sequence first), so no cache is ever
    /// owned by the stream and its end frees nothing. A step the stream could not take (it had
    /// ended) goes unary; one lost with the stream fails with the stream's status and the next
    /// step opens a new stream. A concurrent step while one is on the stream goes unary.
    pub session_steps: bool,
}

impl Default for RemoteExecutorOptions {
    fn default() -> Self {
        Self {
            model_id: String::new(),
            timeout: Some(Duration::from_secs(60)),
            guard_positions: false,
            admission_rpc: true,
            reserve_ahead_tokens: 16,
            status_refresh: Duration::from_secs(1),
            release_on_drop: true,
            session_steps: true,
        }
    }
}

struct Shared {
    status: RwLock<(ExecutorStatus, Instant)>,
    refreshing: std::sync::atomic::AtomicBool,
    slot_snapshot: RwLock<Option<KvSlotCapacitySnapshot>>,
    /// Engine-side cache ids (a `UnifiedBatchItem.seq_id` / a handle this crate did not mint)
    /// → the server's cache id.
    aliases: Mutex<HashMap<String, String>>,
    /// Releases in flight (release_cache is sync and spawns them); later calls on the same
    /// cache wait for them, so "release, then decode" is ordered.
    pending_releases: Mutex<HashMap<String, watch::Receiver<bool>>>,
    release_failures: AtomicU64,
    /// `unified_decode` calls answered `Unsupported` locally (no RPC sent).
    local_unsupported: AtomicU64,
    /// Server cache ids this executor has handed out and not released: a `KvSlotRequest` naming
    /// anything else (and no alias) is a new sequence.
    minted: Mutex<HashSet<String>>,
    /// Server cache id → tokens of KV the server has granted it (last `ReserveKvSlots`).
    covered: Mutex<HashMap<String, u64>>,
    /// The last reservation's pool figures (block size, total, free after), for local answers.
    last_pool: Mutex<Option<(u64, u64, u64)>>,
    /// `reserve_kv_slots` calls answered locally (every request already covered).
    local_reservations: AtomicU64,
    /// Token masks as sent, by `TokenSelectionMask.fingerprint` (ferrum's engine builds one per
    /// request and sends it every step): None = every id of the vocabulary allowed, sent as no
    /// mask at all.
    masks: Mutex<HashMap<u64, Option<Arc<Vec<u8>>>>>,
    /// The server answered a reservation with no reservation (or UNIMPLEMENTED): the executor
    /// does no paged admission, so every later call is ferrum's `Ok(None)` without an RPC.
    no_paged_admission: std::sync::atomic::AtomicBool,
    rpc: RpcCounters,
    /// Prefix-hit counters and the prompts of the caches created here (engine clones).
    prefix: crate::prefix_state::PrefixState,
    /// Where `unified_decode` steps spend their time (client, wire, server; see `step_clock`).
    clock: crate::step_clock::StepClock,
    /// The `Session` stream `unified_decode` steps go on (`session_steps`).
    session: crate::session_steps::SessionSteps,
}

/// Step RPCs sent by a [`RemoteModelExecutor`] (see [`RemoteModelExecutor::rpc_counts`]).
#[derive(Debug, Default)]
struct RpcCounters {
    prefill: AtomicU64,
    batch_prefill: AtomicU64,
    decode: AtomicU64,
    batch_decode: AtomicU64,
    unified_decode: AtomicU64,
    forward_verify: AtomicU64,
    truncate_kv: AtomicU64,
    reserve_kv_slots: AtomicU64,
    release_cache: AtomicU64,
}

/// How many step RPCs a [`RemoteModelExecutor`] has sent, by RPC (a snapshot).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RpcCounts {
    pub prefill: u64,
    pub batch_prefill: u64,
    pub decode: u64,
    pub batch_decode: u64,
    pub unified_decode: u64,
    pub forward_verify: u64,
    pub truncate_kv: u64,
    pub reserve_kv_slots: u64,
    /// `ReleaseCache` RPCs (queued, spawned or awaited).
    pub release_cache: u64,
}

impl RpcCounts {
    /// All of them.
    pub fn total(&self) -> u64 {
        self.prefill
            + self.batch_prefill
            + self.decode
            + self.batch_decode
            + self.unified_decode
            + self.forward_verify
            + self.truncate_kv
            + self.reserve_kv_slots
            + self.release_cache
    }
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// ferrum's `ModelExecutor` served by a remote `ferrum.executor.v1.ModelExecutor`.
pub struct RemoteModelExecutor {
    client: Client,
    opts: RemoteExecutorOptions,
    info: ModelInfo,
    remote_info: proto::ModelInfo,
    remote_caps: proto::ExecutorCapabilities,
    capabilities: ExecutorCapabilities,
    kv_capacity: Option<usize>,
    admission_limits: Option<ExecutorAdmissionLimits>,
    device: Device,
    runtime: Handle,
    shared: Arc<Shared>,
    /// The release queue's own thread (set by `connect`); None = releases spawned on `runtime`.
    releases: Option<ReleaseQueue>,
}

impl std::fmt::Debug for RemoteModelExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteModelExecutor").field("model_id", &self.opts.model_id).finish()
    }
}

fn st(e: tonic::Status) -> FerrumError {
    status_to_ferrum(&e)
}

/// Whether a ferrum metadata map forces full logits (`ferrum_require_full_logits`).
fn forces_full(metadata: &HashMap<String, serde_json::Value>) -> bool {
    metadata.get("ferrum_require_full_logits").and_then(|v| v.as_bool()).unwrap_or(false)
}

/// ferrum's `LogitsReturnPolicy` as the contract's `LogitsPolicy`.
///
/// `FullLogits` → OUTPUT_MODE_FULL_LOGITS (FP32). `GreedyArgmax { token_mask, repetition_penalty }`
/// → OUTPUT_MODE_SAMPLED_TOKEN with temperature 0, the mask as one byte per id, and the penalty
/// with its (de-duplicated, generated) ids. An empty penalty (no ids, or 1.0) is NOT sent: an
/// empty `penalty_token_ids` means "every token in the cache" on the wire.
pub fn logits_policy_to_proto(p: &LogitsReturnPolicy, force_full: bool) -> proto::LogitsPolicy {
    match p {
        _ if force_full => policy::full_logits(),
        LogitsReturnPolicy::FullLogits => policy::full_logits(),
        LogitsReturnPolicy::GreedyArgmax { token_mask, repetition_penalty } => {
            let mut s = proto::SamplingParams { temperature: 0.0, ..Default::default() };
            if let Some(m) = token_mask {
                s.token_mask = m.valid_token_mask.iter().map(|&v| u8::from(v != 0)).collect();
            }
            if let Some(r) = repetition_penalty.as_ref().filter(|r| !r.is_empty()) {
                s.repetition_penalty = Some(r.penalty());
                s.penalty_token_ids = r.token_ids().iter().map(|&t| t.min(i32::MAX as u32) as i32).collect();
            }
            policy::sampled(s)
        }
    }
}

fn is_full(p: &proto::LogitsPolicy) -> bool {
    p.mode == proto::OutputMode::FullLogits as i32
}

/// A logits row as ferrum expects it: the full row, or the 1-element greedy sentinel
/// (`[token as f32]`) for a sampled token.
fn output_row(o: Option<&proto::LogitsOutput>, full: bool) -> Result<Vec<f32>> {
    let o = o.ok_or_else(|| FerrumError::internal("server returned no logits output"))?;
    if full {
        let t = o.logits.as_ref().ok_or_else(|| FerrumError::internal("server returned no logits row"))?;
        Ok(HostTensor::from_proto(t)?.data().to_vec())
    } else {
        let tok = o.token_id.ok_or_else(|| FerrumError::internal("server returned no sampled token"))?;
        Ok(vec![tok as f32])
    }
}

fn tensor(data: Vec<f32>, shape: Vec<usize>) -> Result<TensorRef> {
    Ok(Arc::new(HostTensor::new(data, shape)?))
}

impl RemoteModelExecutor {
    /// Connect to `endpoint` and load the model's info, capabilities, status, KV capacity and
    /// admission limits (the trait's synchronous getters answer from these).
    pub async fn connect(endpoint: impl Into<String>, opts: RemoteExecutorOptions) -> Result<Self> {
        let endpoint = endpoint.into();
        let client = Client::connect(endpoint.clone())
            .await
            .map_err(|e| FerrumError::network(format!("connect {endpoint}: {e}")))?;
        let mut exec = Self::with_client(client, opts).await?;
        let shared = exec.shared.clone();
        let on_done: OnDone = Arc::new(move |id: &str, ok: bool| {
            if !ok {
                shared.release_failures.fetch_add(1, Ordering::Relaxed);
            }
            let mut p = shared.pending_releases.lock().unwrap();
            if p.get(id).is_some_and(|rx| *rx.borrow()) {
                p.remove(id);
            }
        });
        let queue = ReleaseQueue::start(endpoint, exec.client.model_id().to_string(), exec.opts.timeout, on_done)
            .map_err(|e| FerrumError::internal(format!("release queue thread: {e}")))?;
        exec.releases = Some(queue);
        Ok(exec)
    }

    /// Over an existing [`Client`] (its model id is replaced by `opts.model_id`).
    pub async fn with_client(client: Client, mut opts: RemoteExecutorOptions) -> Result<Self> {
        let client = client.with_timeout(opts.timeout);
        let all = client.model("").info().await.map_err(st)?;
        let remote_info = if opts.model_id.is_empty() {
            match all.models.as_slice() {
                [one] => one.clone(),
                many => {
                    return Err(FerrumError::invalid_parameter(format!(
                        "the server hosts {} models; name one in RemoteExecutorOptions.model_id",
                        many.len()
                    )))
                }
            }
        } else {
            all.models
                .iter()
                .find(|m| m.model_id == opts.model_id)
                .cloned()
                .ok_or_else(|| FerrumError::not_found(format!("model {:?} is not hosted", opts.model_id)))?
        };
        opts.model_id = remote_info.model_id.clone();
        let client = client.with_model(opts.model_id.clone());
        let remote_caps = client.capabilities().await.map_err(st)?;
        let status = client.status().await.map_err(st)?;
        let kv = client.kv_capacity().await.map_err(st)?;
        let admission_limits = match client.admission_limits().await {
            Ok(Some(l)) => Some(
                ExecutorAdmissionLimits::new(l.maximum_active_sequences, l.maximum_scheduled_tokens)
                    .map_err(FerrumError::invalid_format)?,
            ),
            Ok(None) => None,
            Err(e) if e.code() == tonic::Code::Unimplemented => None,
            Err(e) => return Err(st(e)),
        };
        let slot_snapshot = match client.kv_slot_capacity().await {
            Ok(s) => s.as_ref().map(convert::slot_snapshot_from_proto),
            Err(e) if e.code() == tonic::Code::Unimplemented => None,
            Err(e) => return Err(st(e)),
        };
        let info = convert::model_info_from_proto(&remote_info);
        let device = info.device.clone();
        let mut metadata_endpoint = info;
        metadata_endpoint
            .metadata
            .insert("ferrum_remote_server_version".into(), all.server_version.clone().into());
        Ok(Self {
            capabilities: convert::capabilities_from_proto(&remote_caps),
            kv_capacity: kv.per_request_tokens.map(|x| x as usize),
            admission_limits,
            device,
            info: metadata_endpoint,
            remote_info,
            remote_caps,
            runtime: Handle::current(),
            shared: Arc::new(Shared {
                status: RwLock::new((
                    convert::status_from_proto(&status.status.unwrap_or_default()),
                    Instant::now(),
                )),
                refreshing: false.into(),
                slot_snapshot: RwLock::new(slot_snapshot),
                aliases: Mutex::new(HashMap::new()),
                pending_releases: Mutex::new(HashMap::new()),
                release_failures: AtomicU64::new(0),
                local_unsupported: AtomicU64::new(0),
                minted: Mutex::new(HashSet::new()),
                covered: Mutex::new(HashMap::new()),
                last_pool: Mutex::new(None),
                local_reservations: AtomicU64::new(0),
                masks: Mutex::new(HashMap::new()),
                no_paged_admission: false.into(),
                rpc: RpcCounters::default(),
                prefix: Default::default(),
                clock: Default::default(),
                session: Default::default(),
            }),
            client,
            opts,
            releases: None,
        })
    }

    /// The typed client this executor calls through (bound to its model).
    pub fn client(&self) -> &Client {
        &self.client
    }
    /// The server's `ModelInfo` message (with the fields ferrum's `ModelInfo` lacks).
    pub fn remote_info(&self) -> &proto::ModelInfo {
        &self.remote_info
    }
    /// The server's capabilities message (with the contract's extra flags).
    pub fn remote_capabilities(&self) -> &proto::ExecutorCapabilities {
        &self.remote_caps
    }
    /// Releases spawned by `release_cache` that failed (other than "already gone").
    pub fn release_failures(&self) -> u64 {
        self.shared.release_failures.load(Ordering::Relaxed)
    }

    /// `unified_decode` calls answered `Unsupported` locally, from the capabilities read at
    /// connect, without an RPC.
    pub fn local_unsupported_unified(&self) -> u64 {
        self.shared.local_unsupported.load(Ordering::Relaxed)
    }

    /// The step RPCs sent so far (`unified_decode` answered locally is not one).
    pub fn rpc_counts(&self) -> RpcCounts {
        let r = &self.shared.rpc;
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        RpcCounts {
            prefill: g(&r.prefill),
            batch_prefill: g(&r.batch_prefill),
            decode: g(&r.decode),
            batch_decode: g(&r.batch_decode),
            unified_decode: g(&r.unified_decode),
            forward_verify: g(&r.forward_verify),
            truncate_kv: g(&r.truncate_kv),
            reserve_kv_slots: g(&r.reserve_kv_slots),
            release_cache: g(&r.release_cache) + self.release_queue_stats().0,
        }
    }

    /// Where the `unified_decode` steps sent so far spent their time: client work, the round
    /// trip, the server's `StepTimings`, and the caller's time between steps (sums).
    pub fn step_clock(&self) -> crate::StepTimes {
        self.shared.clock.snapshot()
    }

    /// `reserve_kv_slots` calls answered without an RPC: every request was already covered by
    /// what the server granted (see [`RemoteExecutorOptions::reserve_ahead_tokens`]).
    pub fn local_reservations(&self) -> u64 {
        self.shared.local_reservations.load(Ordering::Relaxed)
    }

    /// Engine-side names currently mapped to server caches (new sequences named by the caller,
    /// see `reserve_kv_slots` / `unified_decode`); 0 once every sequence has been released.
    pub fn aliases_len(&self) -> usize {
        self.shared.aliases.lock().unwrap().len()
    }

    /// `ReleaseCache` RPCs sent by the release queue, and the largest group sent at once.
    pub fn release_queue_stats(&self) -> (u64, u64) {
        self.releases.as_ref().map_or((0, 0), |q| {
            (q.stats.sent.load(Ordering::Relaxed), q.stats.largest_group.load(Ordering::Relaxed))
        })
    }

    /// Re-read status and the paged-KV snapshot now (the sync getters serve these).
    pub async fn refresh(&self) -> Result<()> {
        refresh_shared(&self.client, &self.shared).await
    }

    /// Prefix caching as this executor saw it: the tokens the server took from its prefix cache
    /// for the caches created here, and the engine clones it mapped (see [`crate::prefix_state`]).
    pub fn prefix_stats(&self) -> crate::PrefixStats {
        self.shared.prefix.snapshot()
    }

    /// Make the server cache behind an engine clone (`<id>-clone-<n>`, ferrum's
    /// `GenericKvCacheHandle::clone_handle`) of a cache this executor created: a `ForkCache` of
    /// its first `num_tokens` tokens while the source is live, else a prefill of the tokens it was
    /// given (the server's prefix cache serves their full blocks). The clone's id becomes an alias.
    async fn materialize_clones(&self, handles: Vec<Arc<dyn KvCacheHandle>>) -> Result<()> {
        for h in &handles {
            if self.known_cache(h).is_none() {
                self.materialize_clone(h.cache_id(), h.num_tokens()).await?;
            }
        }
        Ok(())
    }

    /// [`Self::materialize_clones`] for one name: `id` (`<source>-clone-<n>`) gets a server cache
    /// holding the source's first `keep` tokens. Names that are no clone of a cache created here
    /// are left alone.
    async fn materialize_clone(&self, id: String, keep: usize) -> Result<()> {
        let Some(base) = crate::prefix_state::clone_source(&id) else { return Ok(()) };
        if self.shared.aliases.lock().unwrap().contains_key(&id) {
            return Ok(());
        }
        let alias = self.shared.aliases.lock().unwrap().get(base).cloned();
        let src = alias.or_else(|| self.shared.prefix.server_id_of(base)).unwrap_or_else(|| base.to_string());
        let live = self.shared.minted.lock().unwrap().contains(&src);
        let mut made = None;
        if live && keep > 0 {
            self.wait_released(std::slice::from_ref(&src)).await;
            match self.client.fork_cache(&src, Some(keep as u64), 0).await {
                Ok(r) => {
                    self.shared.prefix.clone_forks.fetch_add(1, Ordering::Relaxed);
                    made = r.cache.map(|c| c.cache_id);
                }
                Err(e) if e.code() == tonic::Code::NotFound => {}
                Err(e) => return Err(st(e)),
            }
        }
        let tokens = self.shared.prefix.prompt_prefix(&src, keep);
        if made.is_none() {
            let Some(tokens) = tokens.clone().filter(|t| !t.is_empty()) else {
                return Ok(()); // not a clone of ours: the step names it as is (NOT_FOUND)
            };
            let out = self
                .client
                .prefill_input(proto::PrefillInput { token_ids: tokens.clone(), logits: Some(policy::none()), ..Default::default() })
                .await
                .map_err(st)?;
            self.shared.prefix.clone_prefills.fetch_add(1, Ordering::Relaxed);
            if out.cache.is_some() {
                self.shared.prefix.note_new_cache(tokens.len(), out.cached_tokens);
            }
            made = out.cache.map(|c| c.cache_id);
        }
        if let Some(m) = made {
            if let Some(t) = tokens {
                self.shared.prefix.note_tokens(&m, &t, true);
            }
            self.shared.prefix.note_name(&id, &m);
            self.note_minted(&m);
            self.shared.aliases.lock().unwrap().insert(id, m);
        }
        Ok(())
    }

    /// Wait until every release spawned by `release_cache` has been answered.
    pub async fn flush_releases(&self) {
        let rxs: Vec<_> = self.shared.pending_releases.lock().unwrap().values().cloned().collect();
        for mut rx in rxs {
            let _ = rx.wait_for(|done| *done).await;
        }
    }

    /// `release_cache`, awaited, with the server's answer (`released` false = already gone).
    pub async fn release_cache_async(&self, cache_id: &str) -> Result<proto::ReleaseCacheResponse> {
        let id = self.take_alias(cache_id);
        self.wait_released(std::slice::from_ref(&id)).await;
        bump(&self.shared.rpc.release_cache);
        self.client.release_cache(&id).await.map_err(st)
    }

    /// The server id for a released name (alias or own id), forgetting both.
    fn take_alias(&self, id: &str) -> String {
        let sid = self.shared.aliases.lock().unwrap().remove(id).unwrap_or_else(|| id.to_string());
        self.shared.minted.lock().unwrap().remove(&sid);
        self.shared.covered.lock().unwrap().remove(&sid);
        sid
    }

    /// The server's cache id for a handle, if the server knows it: ours, or an alias recorded by
    /// `unified_decode`.
    fn known_cache(&self, h: &Arc<dyn KvCacheHandle>) -> Option<String> {
        if let Some(r) = as_remote(h) {
            return Some(r.server_cache_id().to_string());
        }
        self.shared.aliases.lock().unwrap().get(&h.cache_id()).cloned()
    }

    /// The cache id a step on `h` must name: the known one, else the handle's own id (the
    /// server answers NOT_FOUND if it does not know it).
    fn step_cache(&self, h: &Arc<dyn KvCacheHandle>) -> String {
        self.known_cache(h).unwrap_or_else(|| h.cache_id())
    }

    /// [`logits_policy_to_proto`], with the token mask converted once per distinct mask (cached
    /// by fingerprint) and left out when it allows every id of the vocabulary (the contract's
    /// empty mask), so a step does not carry vocabulary-sized bytes for nothing.
    fn policy(&self, p: &LogitsReturnPolicy, force_full: bool) -> proto::LogitsPolicy {
        let LogitsReturnPolicy::GreedyArgmax { token_mask: Some(m), repetition_penalty } = p else {
            return logits_policy_to_proto(p, force_full);
        };
        if force_full {
            return policy::full_logits();
        }
        let bytes = {
            let mut masks = self.shared.masks.lock().unwrap();
            if masks.len() > 1024 {
                masks.clear();
            }
            masks
                .entry(m.fingerprint)
                .or_insert_with(|| {
                    let v = &m.valid_token_mask;
                    if v.len() >= self.info.vocab_size && v.iter().all(|&x| x != 0) {
                        None
                    } else {
                        Some(Arc::new(v.iter().map(|&x| u8::from(x != 0)).collect()))
                    }
                })
                .clone()
        };
        let mut out = logits_policy_to_proto(
            &LogitsReturnPolicy::GreedyArgmax { token_mask: None, repetition_penalty: repetition_penalty.clone() },
            false,
        );
        if let (Some(b), Some(s)) = (bytes, out.sampling.as_mut()) {
            s.token_mask = b.as_ref().clone();
        }
        out
    }

    fn note_minted(&self, id: &str) {
        if !id.is_empty() {
            let mut m = self.shared.minted.lock().unwrap();
            if !m.contains(id) {
                m.insert(id.to_string());
            }
        }
    }

    async fn wait_released(&self, ids: &[String]) {
        let rxs: Vec<_> = {
            let p = self.shared.pending_releases.lock().unwrap();
            ids.iter().filter_map(|i| p.get(i).cloned()).collect()
        };
        for mut rx in rxs {
            let _ = rx.wait_for(|done| *done).await;
        }
    }

    fn handle(&self, h: &proto::KvCacheHandle) -> Arc<dyn KvCacheHandle> {
        self.note_minted(&h.cache_id);
        Arc::new(RemoteKvCacheHandle::from_proto(h, self.device.clone()))
    }

    fn prefill_to_proto(&self, input: &PrefillInput) -> Result<proto::PrefillInput> {
        let shape = input.input_ids.shape();
        if shape.len() >= 2 && shape[0] != 1 {
            return Err(FerrumError::invalid_parameter(format!(
                "RemoteModelExecutor::prefill takes one sequence ([1, len]); got input_ids {shape:?} (use batch_prefill)"
            )));
        }
        let token_ids = tensor_token_ids(&input.input_ids)?;
        let cache_id = input.kv_cache.as_ref().and_then(|h| self.known_cache(h)).unwrap_or_default();
        let hint = input.maximum_sequence_tokens.map(|x| x as u64).or_else(|| {
            input.metadata.get("ferrum_kv_capacity_hint").and_then(|v| v.as_u64())
        });
        Ok(proto::PrefillInput {
            token_ids,
            cache_id,
            logits: Some(policy::full_logits()),
            reserve_tokens: hint.unwrap_or(0),
            all_positions: false,
            metadata: convert::json_map_to_struct(&input.metadata),
            request_id: input.request_id.as_ref().map(|r| r.0.to_string()).unwrap_or_default(),
            adapter: convert::lora_adapter_from_metadata(&input.metadata)?,
            cache_salt: input.metadata.get("ferrum_cache_salt").and_then(|v| v.as_str()).unwrap_or_default().to_string(),
            bypass_prefix_cache: input.metadata.get("ferrum_bypass_prefix_cache").and_then(|v| v.as_bool()).unwrap_or(false),
            ..Default::default()
        })
    }

    /// Count a prefill's prefix hit and remember its tokens (for engine clones of the cache).
    fn note_prefill(&self, sent: &proto::PrefillInput, o: &proto::PrefillOutput) {
        let new_cache = sent.cache_id.is_empty();
        if new_cache {
            self.shared.prefix.note_new_cache(sent.token_ids.len(), o.cached_tokens);
        }
        if let Some(c) = &o.cache {
            self.shared.prefix.note_tokens(&c.cache_id, &sent.token_ids, new_cache);
        }
    }

    fn prefill_from_proto(&self, o: &proto::PrefillOutput) -> Result<PrefillOutput> {
        let cache = o.cache.as_ref().ok_or_else(|| FerrumError::internal("prefill returned no cache"))?;
        let row = match o.output.as_ref().and_then(|x| x.logits.as_ref()) {
            Some(t) => HostTensor::from_proto(t)?.data().to_vec(),
            // Encoders (BERT) return the pooled embedding instead; ferrum's BertModelExecutor
            // returns it in `logits` too ([1, hidden]).
            None => match o.embedding.as_ref() {
                Some(e) => {
                    let v = HostTensor::from_proto(e)?.data().to_vec();
                    let n = v.len();
                    return Ok(PrefillOutput::new(tensor(v, vec![1, n])?, self.handle(cache)));
                }
                None => return Err(FerrumError::internal("prefill returned neither logits nor an embedding")),
            },
        };
        let v = row.len();
        Ok(PrefillOutput::new(tensor(row, vec![1, 1, v])?, self.handle(cache)))
    }

    fn decode_to_proto(&self, input: &DecodeInput) -> Result<proto::DecodeInput> {
        let ids = tensor_token_ids(&input.input_ids)?;
        let [token] = ids.as_slice() else {
            return Err(FerrumError::invalid_parameter(format!(
                "RemoteModelExecutor::decode takes one token ([1, 1]); got input_ids {:?} (use batch_decode)",
                input.input_ids.shape()
            )));
        };
        let position = match as_remote(&input.kv_cache) {
            Some(r) if self.opts.guard_positions => Some(r.sequence_length() as u64),
            _ => None,
        };
        Ok(proto::DecodeInput {
            cache_id: self.step_cache(&input.kv_cache),
            token_id: *token,
            logits: Some(self.policy(&input.logits_policy, forces_full(&input.metadata))),
            position,
            metadata: convert::json_map_to_struct(&input.metadata),
        })
    }

    /// The output keeps the input handle's name (ferrum's engine checks that a decode does not
    /// change a sequence's cache identity): an engine-made or aliased handle stays named as it was.
    fn decode_from_proto(&self, o: &proto::DecodeOutput, full: bool, input: &Arc<dyn KvCacheHandle>) -> Result<DecodeOutput> {
        let cache = o.cache.as_ref().ok_or_else(|| FerrumError::internal("decode returned no cache"))?;
        let row = output_row(o.output.as_ref(), full)?;
        let n = row.len();
        self.note_minted(&cache.cache_id);
        let h = RemoteKvCacheHandle::from_proto(cache, self.device.clone()).named(input.cache_id());
        Ok(DecodeOutput::new(tensor(row, vec![1, n])?, Arc::new(h)))
    }
}

async fn refresh_shared(client: &Client, shared: &Shared) -> Result<()> {
    let s = client.status().await.map_err(st)?;
    *shared.status.write().unwrap() = (convert::status_from_proto(&s.status.unwrap_or_default()), Instant::now());
    if let Ok(snap) = client.kv_slot_capacity().await {
        *shared.slot_snapshot.write().unwrap() = snap.as_ref().map(convert::slot_snapshot_from_proto);
    }
    Ok(())
}

impl RemoteModelExecutor {
    /// A reservation the server already covers: every request names a cache the server granted
    /// at least `max(target_len, admission_target_len)` tokens. The answer is the server's for
    /// that case (no new blocks; pool figures of the last reservation).
    fn covered_locally(&self, reqs: &[proto::KvSlotRequest], names: &[String]) -> Option<KvSlotReservation> {
        if self.opts.reserve_ahead_tokens == 0 {
            return None;
        }
        let (block_size, total, free) = (*self.shared.last_pool.lock().unwrap())?;
        if block_size == 0 {
            return None;
        }
        let covered = self.shared.covered.lock().unwrap();
        let mut allocations = Vec::with_capacity(reqs.len());
        for (p, name) in reqs.iter().zip(names) {
            let have = *covered.get(&p.cache_id)?;
            if p.new_sequence || p.target_len.max(p.admission_target_len.unwrap_or(0)) > have {
                return None;
            }
            let blocks = (have / block_size) as usize;
            allocations.push(ferrum_interfaces::model_executor::KvSlotAllocation {
                cache_id: name.clone(),
                blocks_before: blocks,
                blocks_after: blocks,
                new_blocks: 0,
            });
        }
        Some(KvSlotReservation {
            block_size: block_size as usize,
            total_blocks: total as usize,
            free_blocks_before: free as usize,
            free_blocks_after: free as usize,
            allocations,
        })
    }

    /// One `ReserveKvSlots`, each target `ahead` tokens further (None: cannot block here).
    fn reserve_rpc(
        &self,
        reqs: &[proto::KvSlotRequest],
        ahead: u64,
    ) -> Option<std::result::Result<Option<proto::KvSlotReservation>, tonic::Status>> {
        let mut reqs = reqs.to_vec();
        // Never ahead past what one sequence may hold (that would be INVALID_ARGUMENT).
        let mut limit = self.kv_capacity.map_or(u64::MAX, |c| c as u64);
        if self.info.max_sequence_length > 0 {
            limit = limit.min(self.info.max_sequence_length as u64);
        }
        for p in &mut reqs {
            p.target_len = (p.target_len + ahead).min(limit).max(p.target_len);
        }
        let client = self.client.clone();
        bump(&self.shared.rpc.reserve_kv_slots);
        self.block_on(async move { client.reserve_kv_slots(reqs).await })
    }

    /// Run an RPC from a synchronous trait method. On a multi-thread runtime this blocks the
    /// worker with `block_in_place`; outside any runtime it blocks on the connect-time runtime;
    /// on a current-thread runtime it cannot (the runtime would deadlock) and returns None.
    fn block_on<F: std::future::Future>(&self, fut: F) -> Option<F::Output> {
        match Handle::try_current() {
            Ok(h) => match h.runtime_flavor() {
                RuntimeFlavor::MultiThread => Some(tokio::task::block_in_place(|| h.block_on(fut))),
                _ => None,
            },
            Err(_) => Some(self.runtime.block_on(fut)),
        }
    }
}

impl RemoteModelExecutor {
    /// One `UnifiedDecode`: on the `Session` stream when [`RemoteExecutorOptions::session_steps`]
    /// allows it (see there and [`crate::session_steps`]), else unary.
    async fn send_unified(&self, items: Vec<proto::UnifiedBatchItem>) -> std::result::Result<proto::UnifiedDecodeResponse, tonic::Status> {
        if !self.opts.session_steps {
            return self.client.unified_decode_response(items).await;
        }
        self.shared.session.unified(&self.client, items, self.opts.timeout).await
    }

    /// `unified_decode` steps sent on the `Session` stream (see
    /// [`RemoteExecutorOptions::session_steps`]); the rest of [`RpcCounts::unified_decode`] went unary.
    pub fn session_unified_steps(&self) -> u64 {
        self.shared.session.sent()
    }

    /// The RPC half of `unified_decode` (`t0`: when the call started, for the step clock).
    async fn unified_decode_rpc(&self, batch: &UnifiedBatch, t0: Instant) -> Result<Vec<Option<Vec<f32>>>> {
        self.materialize_clones(batch.items.iter().map(|it| it.kv_cache.clone()).collect()).await?;
        let mut items = Vec::with_capacity(batch.items.len());
        let mut fulls = Vec::with_capacity(batch.items.len());
        for it in &batch.items {
            let known = self
                .known_cache(&it.kv_cache)
                .or_else(|| self.shared.aliases.lock().unwrap().get(&it.seq_id).cloned());
            let pol = self.policy(&it.logits_policy, forces_full(&it.metadata));
            fulls.push(is_full(&pol));
            items.push(proto::UnifiedBatchItem {
                seq_id: it.seq_id.clone(),
                q_tokens: it.q_tokens.iter().map(|&t| t.min(i32::MAX as u32) as i32).collect(),
                cache_id: known.unwrap_or_default(),
                pos_offset: it.pos_offset as u64,
                is_final_chunk: it.is_final_chunk,
                logits: Some(if it.is_final_chunk { pol } else { policy::none() }),
                metadata: convert::json_map_to_struct(&it.metadata),
                adapter: convert::lora_adapter_from_metadata(&it.metadata)?,
                cache_salt: it.metadata.get("ferrum_cache_salt").and_then(|v| v.as_str()).unwrap_or_default().to_string(),
                bypass_prefix_cache: it.metadata.get("ferrum_bypass_prefix_cache").and_then(|v| v.as_bool()).unwrap_or(false),
                ..Default::default()
            });
        }
        let ids: Vec<String> = items.iter().map(|i| i.cache_id.clone()).filter(|s| !s.is_empty()).collect();
        self.wait_released(&ids).await;
        bump(&self.shared.rpc.unified_decode);
        let sent = Instant::now();
        let resp = self.send_unified(items.clone()).await.map_err(st)?;
        let answered = Instant::now();
        let results = resp.results;
        if results.len() != batch.items.len() {
            return Err(FerrumError::internal(format!(
                "UnifiedDecode returned {} results for {} items",
                results.len(),
                batch.items.len()
            )));
        }
        let mut out = Vec::with_capacity(results.len());
        for ((it, sent), (r, full)) in batch.items.iter().zip(&items).zip(results.iter().zip(fulls)) {
            let server_id = r.cache.as_ref().map(|c| c.cache_id.as_str()).unwrap_or("");
            if sent.cache_id.is_empty() {
                self.shared.prefix.note_new_cache(sent.q_tokens.len(), r.cached_tokens);
            }
            self.shared.prefix.note_tokens(server_id, &sent.q_tokens, sent.cache_id.is_empty());
            if sent.cache_id.is_empty() {
                if let Some(c) = &r.cache {
                    self.note_minted(&c.cache_id);
                    let mut a = self.shared.aliases.lock().unwrap();
                    a.insert(it.seq_id.clone(), c.cache_id.clone());
                    self.shared.prefix.note_name(&it.seq_id, &c.cache_id);
                    if it.kv_cache.cache_id() != it.seq_id {
                        a.insert(it.kv_cache.cache_id(), c.cache_id.clone());
                        self.shared.prefix.note_name(&it.kv_cache.cache_id(), &c.cache_id);
                    }
                }
            }
            out.push(if it.is_final_chunk { Some(output_row(r.output.as_ref(), full)?) } else { None });
        }
        self.shared.clock.record(batch.items.len(), t0, sent, answered, resp.timings.as_ref());
        Ok(out)
    }
}

#[async_trait]
impl ModelExecutor for RemoteModelExecutor {
    /// Read from the server at connect time (`Info`); the trait returns a reference.
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn admission_limits(&self) -> Result<Option<ExecutorAdmissionLimits>> {
        Ok(self.admission_limits)
    }

    fn supports_native_unified_decode(&self) -> bool {
        self.remote_caps.supports_native_unified_decode
    }

    /// `KvCapacity.per_request_tokens`, read at connect time.
    fn kv_capacity(&self) -> Option<usize> {
        self.kv_capacity
    }

    /// `ReserveKvSlots`, as a blocking call (see [`RemoteExecutorOptions::admission_rpc`]).
    ///
    /// A request naming neither a cache this executor handed out nor a name it already maps is a
    /// sequence the server has never seen: ferrum's engine names a new sequence by its own KV
    /// allocation id and reserves before the first step. It goes out with `new_sequence`; the
    /// server creates an empty cache holding the reservation, and its id is remembered under the
    /// engine's name, so the next `unified_decode` item (or `prefill`) with that name fills it and
    /// `release_cache(name)` frees it. Requests naming one cache twice are merged (largest
    /// targets), as ferrum's own executors do.
    fn reserve_kv_slots(&self, requests: &[KvSlotRequest]) -> Result<Option<KvSlotReservation>> {
        if !self.opts.admission_rpc || requests.is_empty() {
            return Ok(None);
        }
        if self.shared.no_paged_admission.load(Ordering::Relaxed) {
            self.shared.local_reservations.fetch_add(1, Ordering::Relaxed);
            return Ok(None);
        }
        // An engine clone (`<id>-clone-<n>`, ferrum's prefix-cache hit) reserved before its first
        // step: make its server cache now (a fork of the source), or the reservation would create
        // an empty one. The engine reserves a decode-ready sequence's next token: `target_len - 1`
        // tokens are the clone's.
        let clones: Vec<(String, usize)> = {
            let aliases = self.shared.aliases.lock().unwrap();
            requests
                .iter()
                .filter(|r| !aliases.contains_key(&r.cache_id) && crate::prefix_state::clone_source(&r.cache_id).is_some())
                .map(|r| (r.cache_id.clone(), r.target_len.saturating_sub(1)))
                .collect()
        };
        for (id, keep) in clones {
            if let Some(r) = self.block_on(self.materialize_clone(id, keep)) {
                r?;
            }
        }
        let mut reqs: Vec<proto::KvSlotRequest> = Vec::with_capacity(requests.len());
        let mut names: Vec<String> = Vec::with_capacity(requests.len());
        {
            let aliases = self.shared.aliases.lock().unwrap();
            let minted = self.shared.minted.lock().unwrap();
            for r in requests {
                let mut p = convert::slot_request_to_proto(r);
                if let Some(i) = names.iter().position(|n| n == &r.cache_id) {
                    let q = &mut reqs[i];
                    q.target_len = q.target_len.max(p.target_len);
                    q.admission_target_len = match (q.admission_target_len, p.admission_target_len) {
                        (Some(a), Some(b)) => Some(a.max(b)),
                        (a, b) => a.or(b),
                    };
                    continue;
                }
                if let Some(id) = aliases.get(&p.cache_id) {
                    p.cache_id = id.clone();
                } else if !minted.contains(&p.cache_id) {
                    p.new_sequence = true;
                }
                names.push(r.cache_id.clone());
                reqs.push(p);
            }
        }
        if let Some(local) = self.covered_locally(&reqs, &names) {
            self.shared.local_reservations.fetch_add(1, Ordering::Relaxed);
            return Ok(Some(local));
        }
        let ahead = self.opts.reserve_ahead_tokens as u64;
        let mut answer = self.reserve_rpc(&reqs, ahead);
        if ahead > 0 && matches!(&answer, Some(Err(e)) if e.code() == tonic::Code::ResourceExhausted) {
            answer = self.reserve_rpc(&reqs, 0); // the extra tokens did not fit: exactly what was asked
        }
        match answer {
            None => Ok(None),
            Some(Ok(r)) => {
                let Some(r) = r else {
                    self.shared.no_paged_admission.store(true, Ordering::Relaxed);
                    return Ok(None);
                };
                let mut created = Vec::new();
                {
                    let mut covered = self.shared.covered.lock().unwrap();
                    for (a, p) in r.allocations.iter().zip(&reqs) {
                        let sid = if a.created_cache_id.is_empty() { p.cache_id.clone() } else { a.created_cache_id.clone() };
                        covered.insert(sid, a.blocks_after * r.block_size);
                        if !a.created_cache_id.is_empty() {
                            created.push((a.cache_id.clone(), a.created_cache_id.clone()));
                        }
                    }
                }
                *self.shared.last_pool.lock().unwrap() = Some((r.block_size, r.total_blocks, r.free_blocks_after));
                if !created.is_empty() {
                    let mut aliases = self.shared.aliases.lock().unwrap();
                    let mut minted = self.shared.minted.lock().unwrap();
                    for (name, id) in created {
                        // an empty cache: its first chunk is its prompt's start (engine clones)
                        self.shared.prefix.note_tokens(&id, &[], true);
                        self.shared.prefix.note_name(&name, &id);
                        minted.insert(id.clone());
                        aliases.insert(name, id);
                    }
                }
                let mut out = convert::reservation_from_proto(&r);
                // Allocations name the caller's caches as the caller did (server ids → names).
                for (a, name) in out.allocations.iter_mut().zip(&names) {
                    a.cache_id = name.clone();
                }
                Ok(Some(out))
            }
            Some(Err(e)) if e.code() == tonic::Code::Unimplemented => {
                self.shared.no_paged_admission.store(true, Ordering::Relaxed);
                Ok(None)
            }
            Some(Err(e)) => Err(st(e)),
        }
    }

    /// The last `KvSlotCapacity` snapshot (connect time, refreshed with `status()`/`refresh()`).
    fn kv_slot_capacity_snapshot(&self) -> Option<KvSlotCapacitySnapshot> {
        self.shared.slot_snapshot.read().unwrap().clone()
    }

    async fn prefill(&self, input: &PrefillInput) -> Result<PrefillOutput> {
        if let Some(h) = &input.kv_cache {
            self.materialize_clones(vec![h.clone()]).await?;
        }
        let p = self.prefill_to_proto(input)?;
        if !p.cache_id.is_empty() {
            self.wait_released(std::slice::from_ref(&p.cache_id)).await;
        }
        bump(&self.shared.rpc.prefill);
        let out = self.client.prefill_input(p.clone()).await.map_err(st)?;
        self.note_prefill(&p, &out);
        self.prefill_from_proto(&out)
    }

    /// One `BatchPrefill` (all or nothing).
    async fn batch_prefill(&self, inputs: &[PrefillInput]) -> Result<Vec<PrefillOutput>> {
        if inputs.is_empty() {
            return Ok(Vec::new());
        }
        self.materialize_clones(inputs.iter().filter_map(|i| i.kv_cache.clone()).collect()).await?;
        let ps = inputs.iter().map(|i| self.prefill_to_proto(i)).collect::<Result<Vec<_>>>()?;
        bump(&self.shared.rpc.batch_prefill);
        let outs = self.client.batch_prefill(ps.clone()).await.map_err(st)?;
        for (p, o) in ps.iter().zip(&outs) {
            self.note_prefill(p, o);
        }
        if outs.len() != inputs.len() {
            return Err(FerrumError::internal(format!(
                "BatchPrefill returned {} outputs for {} inputs",
                outs.len(),
                inputs.len()
            )));
        }
        outs.iter().map(|o| self.prefill_from_proto(o)).collect()
    }

    async fn decode(&self, input: &DecodeInput) -> Result<DecodeOutput> {
        self.materialize_clones(vec![input.kv_cache.clone()]).await?;
        let p = self.decode_to_proto(input)?;
        self.wait_released(std::slice::from_ref(&p.cache_id)).await;
        let full = p.logits.as_ref().is_some_and(is_full);
        bump(&self.shared.rpc.decode);
        let out = self.client.decode_input(p).await.map_err(st)?;
        self.decode_from_proto(&out, full, &input.kv_cache)
    }

    /// One `BatchDecode`: one output per input, in order, same caches (all or nothing).
    async fn batch_decode(&self, inputs: &[DecodeInput]) -> Result<Vec<DecodeOutput>> {
        if inputs.is_empty() {
            return Ok(Vec::new());
        }
        self.materialize_clones(inputs.iter().map(|i| i.kv_cache.clone()).collect()).await?;
        let ps = inputs.iter().map(|i| self.decode_to_proto(i)).collect::<Result<Vec<_>>>()?;
        let ids: Vec<String> = ps.iter().map(|p| p.cache_id.clone()).collect();
        self.wait_released(&ids).await;
        let fulls: Vec<bool> = ps.iter().map(|p| p.logits.as_ref().is_some_and(is_full)).collect();
        bump(&self.shared.rpc.batch_decode);
        let outs = self.client.batch_decode(ps).await.map_err(st)?;
        if outs.len() != inputs.len() {
            return Err(FerrumError::internal(format!(
                "BatchDecode returned {} outputs for {} inputs",
                outs.len(),
                inputs.len()
            )));
        }
        outs.iter().zip(fulls).zip(inputs).map(|((o, f), i)| self.decode_from_proto(o, f, &i.kv_cache)).collect()
    }

    /// `UnifiedDecode`. UNIMPLEMENTED (executors without a native unified forward, e.g. the
    /// configurable one) → `Unsupported`, which ferrum's engine treats as "use the split path".
    /// Items whose handle the server does not know are new sequences; their server cache id is
    /// remembered under the item's `seq_id` (and handle id) for later items and `release_cache`.
    ///
    /// When the capabilities read at connect say the executor has no native unified decode, the
    /// answer is `Unsupported` at once, without an RPC (ferrum's engine tries this every step).
    async fn unified_decode(&self, batch: &UnifiedBatch) -> Result<Vec<Option<Vec<f32>>>> {
        if !self.remote_caps.supports_native_unified_decode {
            self.shared.local_unsupported.fetch_add(1, Ordering::Relaxed);
            return Err(FerrumError::unsupported(
                "unified_decode: the remote executor has no native unified decode (capabilities at connect)",
            ));
        }
        if batch.items.is_empty() {
            return Ok(Vec::new());
        }
        let t0 = self.shared.clock.start();
        let out = self.unified_decode_rpc(batch, t0).await;
        if out.is_err() {
            self.shared.clock.forget_end();
        }
        out
    }

    /// `Forward`: token ids (f32 tensor) → INT32 on the wire; the output comes back as f32.
    async fn forward(&self, input: &TensorRef) -> Result<TensorRef> {
        let host = HostTensor::new(input.to_vec_f32()?, input.shape().to_vec())?;
        let out = self.client.forward(host.to_proto(true)?, proto::DataType::Fp32).await.map_err(st)?;
        Ok(Arc::new(HostTensor::from_proto(&out)?))
    }

    /// `TruncateKv` (a real rollback; ferrum's default is a no-op). The caller's handle is not
    /// updated (the trait returns `()`); the server's length is the truth for the next step.
    async fn truncate_kv(&self, kv_cache: &Arc<dyn KvCacheHandle>, new_len: usize) -> Result<()> {
        self.materialize_clones(vec![kv_cache.clone()]).await?;
        let id = self.step_cache(kv_cache);
        self.wait_released(std::slice::from_ref(&id)).await;
        let new_len = i64::try_from(new_len).map_err(|_| FerrumError::invalid_parameter("new_len too large"))?;
        bump(&self.shared.rpc.truncate_kv);
        self.client.truncate_kv(&id, new_len).await.map_err(st)?;
        Ok(())
    }

    /// `ForwardVerify` when every input names the same cache (ferrum's speculative runner does):
    /// N+1 tokens in one forward, N+1 rows out, the i-th handle at `base_len + i + 1`, the last
    /// one the server's. The cache keeps all N+1 tokens (no server-side acceptance), as in
    /// ferrum; the caller truncates. Inputs on different caches fall back to serial decodes
    /// (the trait's default).
    async fn forward_verify(&self, inputs: &[DecodeInput]) -> Result<Vec<DecodeOutput>> {
        if inputs.is_empty() {
            return Ok(Vec::new());
        }
        self.materialize_clones(inputs.iter().map(|i| i.kv_cache.clone()).collect()).await?;
        let ids: Vec<String> = inputs.iter().map(|i| self.step_cache(&i.kv_cache)).collect();
        if ids.iter().any(|i| i != &ids[0]) {
            let mut out = Vec::with_capacity(inputs.len());
            for i in inputs {
                out.push(self.decode(i).await?);
            }
            return Ok(out);
        }
        let mut tokens = Vec::with_capacity(inputs.len());
        for i in inputs {
            let t = tensor_token_ids(&i.input_ids)?;
            let [tok] = t.as_slice() else {
                return Err(FerrumError::invalid_parameter("forward_verify inputs carry one token each"));
            };
            tokens.push(*tok);
        }
        let full_forced = inputs.iter().any(|i| forces_full(&i.metadata) || i.logits_policy.requires_full_logits());
        let pol = self.policy(&inputs[0].logits_policy, full_forced);
        let full = is_full(&pol);
        self.wait_released(&ids[..1]).await;
        bump(&self.shared.rpc.forward_verify);
        let resp = self.client.forward_verify(&ids[0], &tokens, Some(pol), false).await.map_err(st)?;
        let cache = resp.cache.as_ref().ok_or_else(|| FerrumError::internal("ForwardVerify returned no cache"))?;
        if resp.outputs.len() != inputs.len() {
            return Err(FerrumError::internal(format!(
                "ForwardVerify returned {} rows for {} tokens",
                resp.outputs.len(),
                inputs.len()
            )));
        }
        let last = RemoteKvCacheHandle::from_proto(cache, self.device.clone()).named(inputs[0].kv_cache.cache_id());
        let n = resp.outputs.len();
        resp.outputs
            .iter()
            .enumerate()
            .map(|(i, o)| {
                let row = output_row(Some(o), full)?;
                let v = row.len();
                let h: Arc<dyn KvCacheHandle> = if i + 1 == n {
                    Arc::new(last.clone())
                } else {
                    Arc::new(last.with_sequence_length(resp.base_len as usize + i + 1))
                };
                Ok(DecodeOutput::new(tensor(row, vec![1, v])?, h))
            })
            .collect()
    }

    /// Read at connect time (`Capabilities`; they do not change while a server runs).
    fn capabilities(&self) -> ExecutorCapabilities {
        self.capabilities.clone()
    }

    /// The last `Status` read (connect time, then refreshed in the background when older than
    /// `status_refresh`; `refresh().await` forces it).
    fn status(&self) -> ExecutorStatus {
        let (s, at) = self.shared.status.read().unwrap().clone();
        if at.elapsed() >= self.opts.status_refresh && !self.shared.refreshing.swap(true, Ordering::AcqRel) {
            let client = self.client.clone();
            let shared = self.shared.clone();
            self.runtime.spawn(async move {
                let _ = refresh_shared(&client, &shared).await;
                shared.refreshing.store(false, Ordering::Release);
            });
        }
        s
    }

    /// `CacheMetrics` (blocking; none when it cannot block or the server has none), with this
    /// executor's prefix-cache counters under "remote_prefix" (what ferrum's trait offers for
    /// "model-level paged KV prefix reuse counters": hit and queried prompt tokens, hits, and the
    /// engine clones mapped to forks or prefills).
    fn cache_metrics_snapshot(&self) -> Option<serde_json::Value> {
        let client = self.client.clone();
        let server = self.block_on(async move { client.cache_metrics().await }).and_then(|r| r.ok()).flatten().map(|s| convert::struct_to_json(&s));
        let p = self.prefix_stats();
        let mut v = match server {
            Some(serde_json::Value::Object(m)) => m,
            _ => serde_json::Map::new(),
        };
        v.insert(
            "remote_prefix".into(),
            serde_json::json!({"hit_tokens": p.hit_tokens, "queried_tokens": p.queried_tokens, "hits": p.hits,
                               "clone_forks": p.clone_forks, "clone_prefills": p.clone_prefills}),
        );
        Some(serde_json::Value::Object(v))
    }

    /// `LoraMetrics` (blocking; None when it cannot block or the server has none).
    fn lora_metrics_snapshot(&self) -> Option<serde_json::Value> {
        let client = self.client.clone();
        self.block_on(async move { client.lora_metrics().await }).and_then(|r| r.ok()).flatten().map(|s| convert::struct_to_json(&s))
    }

    /// `Warmup` (an admin RPC on servers with auth).
    async fn warmup(&mut self) -> Result<()> {
        self.client.warmup().await.map_err(st)?;
        Ok(())
    }

    /// `Shutdown`: the remote executor frees its caches and refuses further work.
    async fn shutdown(&mut self) -> Result<()> {
        self.flush_releases().await;
        self.client.shutdown().await.map_err(st)?;
        Ok(())
    }

    /// `ReleaseCache`, fire-and-forget: the trait method is synchronous and infallible, so the
    /// RPC is spawned on the tokio runtime the executor was connected on and this returns at
    /// once. Later calls on the same cache wait for it (release → decode is ordered and answers
    /// NotFound); `flush_releases()` waits for all; `release_cache_async()` is the awaited form.
    fn release_cache(&self, cache_id: &str) {
        let id = self.take_alias(cache_id);
        if id.is_empty() {
            return;
        }
        let (tx, rx) = watch::channel(false);
        self.shared.pending_releases.lock().unwrap().insert(id.clone(), rx);
        if let Some(q) = &self.releases {
            if q.release(id.clone(), tx) {
                return;
            }
            self.shared.release_failures.fetch_add(1, Ordering::Relaxed);
            self.shared.pending_releases.lock().unwrap().remove(&id);
            return;
        }
        let client = self.client.clone();
        let shared = self.shared.clone();
        bump(&shared.rpc.release_cache);
        self.runtime.spawn(async move {
            if client.release_cache(&id).await.is_err() {
                shared.release_failures.fetch_add(1, Ordering::Relaxed);
            }
            let _ = tx.send(true);
            let mut p = shared.pending_releases.lock().unwrap();
            if p.get(&id).is_some_and(|rx| *rx.borrow()) {
                p.remove(&id);
            }
        });
    }
}

impl Drop for RemoteModelExecutor {
    /// With `release_on_drop`: queue the release of every cache still handed out; the release
    /// queue, dropped next, sends them before its thread ends. (`with_client` executors spawn the
    /// releases on the connect-time runtime, best effort.)
    fn drop(&mut self) {
        if !self.opts.release_on_drop {
            return;
        }
        let ids: Vec<String> = self.shared.minted.lock().unwrap().drain().collect();
        self.shared.aliases.lock().unwrap().clear();
        self.shared.covered.lock().unwrap().clear();
        if ids.is_empty() {
            return;
        }
        if let Some(q) = &self.releases {
            for id in ids {
                let (tx, _rx) = watch::channel(false);
                q.release(id, tx);
            }
        } else {
            let client = self.client.clone();
            self.runtime.spawn(async move {
                for id in ids {
                    let _ = client.release_cache(&id).await;
                }
            });
        }
    }
}

/// A token id from a ferrum token tensor value (for callers building inputs by hand).
pub fn token_from_f32(v: f32) -> Result<u32> {
    f32_to_token_id(v).map(|t| t as u32)
}
