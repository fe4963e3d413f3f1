//! A thin typed client over the generated stub: a default model, per-call deadlines, ergonomic
//! shortcuts for the step RPCs, `Generate` as a `Stream`, and `Session` as a [`Session`].
//!
//! Errors are `tonic::Status` (use [`crate::error::status_to_ferrum`] for ferrum's kinds, or
//! [`crate::error::error_reason`] for the ErrorInfo reason).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

pub use crate::migration::{Connector, GenerateStream, MAX_MIGRATION_HOPS};
use crate::proto;
use crate::proto::model_executor_client::ModelExecutorClient;
use crate::session::Session;

/// Logits-policy shortcuts.
pub mod policy {
    use crate::proto::{DataType, LogitsPolicy, OutputMode, SamplingParams};

    /// A greedy token (temperature 0), the contract's default.
    pub fn greedy() -> LogitsPolicy {
        LogitsPolicy { mode: OutputMode::SampledToken as i32, ..Default::default() }
    }
    /// A token sampled with `sampling`.
    pub fn sampled(sampling: SamplingParams) -> LogitsPolicy {
        LogitsPolicy { mode: OutputMode::SampledToken as i32, sampling: Some(sampling), ..Default::default() }
    }
    /// The whole FP32 row (ferrum's `LogitsReturnPolicy::FullLogits`).
    pub fn full_logits() -> LogitsPolicy {
        LogitsPolicy {
            mode: OutputMode::FullLogits as i32,
            logits_dtype: DataType::Fp32 as i32,
            ..Default::default()
        }
    }
    /// Nothing back (fill the cache only).
    pub fn none() -> LogitsPolicy {
        LogitsPolicy { mode: OutputMode::None as i32, ..Default::default() }
    }
}

/// Structured-output constraints for `SamplingParams.constraint` (masks computed on the server).
pub mod constraint {
    use crate::proto::{output_constraint::Kind, ChoiceList, OutputConstraint};

    /// One JSON value valid under the JSON Schema `schema` (its text).
    pub fn json_schema(schema: impl Into<String>) -> OutputConstraint {
        OutputConstraint { kind: Some(Kind::JsonSchema(schema.into())) }
    }
    /// Text the whole of which matches `pattern`.
    pub fn regex(pattern: impl Into<String>) -> OutputConstraint {
        OutputConstraint { kind: Some(Kind::Regex(pattern.into())) }
    }
    /// Text of a GBNF grammar (`root ::= ...`).
    pub fn ebnf(grammar: impl Into<String>) -> OutputConstraint {
        OutputConstraint { kind: Some(Kind::EbnfGrammar(grammar.into())) }
    }
    /// Exactly one of `choices`.
    pub fn choice<S: Into<String>>(choices: impl IntoIterator<Item = S>) -> OutputConstraint {
        OutputConstraint { kind: Some(Kind::Choice(ChoiceList { choices: choices.into_iter().map(Into::into).collect() })) }
    }
}

/// Options of a generation ([`Client::generate_with`]); everything else of `GenerateRequest` via
/// [`Client::generate`].
#[derive(Clone, Debug, Default)]
pub struct GenerateOptions {
    pub max_tokens: u32,
    pub stop_token_ids: Vec<i32>,
    pub stop_sequences: Vec<String>,
    pub ignore_eos: bool,
    pub sampling: Option<proto::SamplingParams>,
    /// Continue this cache (with `last_token_id` and no prompt: that token is fed first).
    pub cache_id: String,
    pub last_token_id: Option<i32>,
    /// Samples from the one prompt (its cache forked per sample; events carry `sample_index`).
    pub n: u32,
    pub top_logprobs: u32,
    pub keep_cache: bool,
    pub request_id: String,
    pub stream_text: bool,
    pub cache_salt: String,
    pub bypass_prefix_cache: bool,
    pub adapter: String,
}

/// A whole generation ([`Client::generate_all`]): per sample, its tokens and finished event.
#[derive(Clone, Debug, Default)]
pub struct GenerateResult {
    pub started: Option<proto::GenerateStarted>,
    /// Tokens per `sample_index`.
    pub samples: Vec<Vec<i32>>,
    /// The finished event per `sample_index`.
    pub finished: Vec<Option<proto::GenerateFinished>>,
    /// With `with_follow_migrations(false)`: the `migrated` event that ended the stream (resume
    /// it with `Generate` and `resume_token` on `target`). None when the stream was followed.
    pub migrated: Option<proto::GenerateMigrated>,
    /// The servers the stream moved to and was followed to, in order.
    pub migrations: Vec<String>,
}

impl GenerateResult {
    /// Sample 0's tokens (all of them for a single sample).
    pub fn tokens(&self) -> &[i32] {
        self.samples.first().map(Vec::as_slice).unwrap_or(&[])
    }
}

/// A cache range exported by [`Client::export_kv_all`]: the transfer header and its chunks.
#[derive(Clone, Debug, Default)]
pub struct ExportedKv {
    pub header: proto::KvTransferHeader,
    pub chunks: Vec<proto::KvChunk>,
}

/// Options of an `ImportKv` (push or pull).
#[derive(Clone, Debug, Default)]
pub struct ImportOptions {
    /// Total tokens the new cache may grow to (0 = the imported ones).
    pub reserve_tokens: u64,
    pub cache_salt: String,
    pub request_id: String,
}

/// A stream over the messages of a Vec (what a client-streaming call sends).
struct VecStream<T>(std::vec::IntoIter<T>);

impl<T: Unpin> futures_core::Stream for VecStream<T> {
    type Item = T;
    fn poll_next(mut self: std::pin::Pin<&mut Self>, _cx: &mut std::task::Context<'_>) -> std::task::Poll<Option<T>> {
        std::task::Poll::Ready(self.0.next())
    }
}

/// Typed client for one server. Cheap to clone (the channel is shared).
#[derive(Clone, Debug)]
pub struct Client {
    stub: ModelExecutorClient<Channel>,
    health: HealthClient<Channel>,
    model_id: String,
    timeout: Option<Duration>,
    stream_timeout: Option<Duration>,
    /// "authorization: Bearer <token>" on every call.
    authorization: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
    target: String,
    /// Opens a channel of the same kind to the server a stream moved to.
    connector: Option<Connector>,
    follow_migrations: bool,
    /// Clients of the servers streams moved to, by `host:port`: shared by this client's clones,
    /// closed when the last of them is dropped.
    followers: Arc<Mutex<HashMap<String, Client>>>,
}

impl Client {
    /// Connect to `endpoint` (e.g. `http://127.0.0.1:50051`). Unary calls get a 30 s deadline
    /// by default ([`Client::with_timeout`]); streams none ([`Client::with_stream_timeout`]).
    pub async fn connect(endpoint: impl Into<String>) -> Result<Self, tonic::transport::Error> {
        let endpoint = endpoint.into();
        let channel = dial(endpoint.clone()).await?;
        let target = endpoint_target(&endpoint);
        // a stream that moves is followed with a channel like this one: the same scheme and settings
        let scheme = endpoint.split_once("://").map_or("http", |(s, _)| s).to_string();
        let connector = Connector::new(move |t: String| dial(format!("{scheme}://{t}")));
        Ok(Self::from_channel(channel).with_target(target).with_connector(connector))
    }

    /// Connect over TLS (feature `tls`) to `endpoint` (`https://host:port`) with `tls` (the CA to
    /// trust, the server name, a client identity for mutual TLS); a stream that moves to another
    /// server is followed over TLS with the same settings.
    #[cfg(feature = "tls")]
    pub async fn connect_tls(
        endpoint: impl Into<String>,
        tls: tonic::transport::ClientTlsConfig,
    ) -> Result<Self, tonic::transport::Error> {
        let endpoint = endpoint.into();
        let channel = dial_tls(endpoint.clone(), tls.clone()).await?;
        let target = endpoint_target(&endpoint);
        let connector = Connector::new(move |t: String| dial_tls(format!("https://{t}"), tls.clone()));
        Ok(Self::from_channel(channel).with_target(target).with_connector(connector))
    }

    /// Over an existing channel (TLS, interceptors and such are the caller's business).
    pub fn from_channel(channel: Channel) -> Self {
        Self {
            stub: ModelExecutorClient::new(channel.clone())
                .max_decoding_message_size(256 << 20)
                .max_encoding_message_size(256 << 20),
            health: HealthClient::new(channel),
            model_id: String::new(),
            timeout: Some(Duration::from_secs(30)),
            stream_timeout: None,
            authorization: None,
            target: String::new(),
            connector: None,
            follow_migrations: true,
            followers: Arc::default(),
        }
    }

    /// How to open a channel to another server (`host:port`) when a `Generate` stream moves
    /// there: [`Client::connect`] sets one; a client over a TLS or intercepted channel
    /// ([`Client::from_channel`]) passes one that builds the same kind of channel.
    pub fn with_connector(mut self, connector: Connector) -> Self {
        self.connector = Some(connector);
        self
    }

    /// Whether `Generate` streams follow `migrated` events (default true); false passes the event
    /// on as the stream's last one (the caller resumes it with `resume_token` on `target`).
    pub fn with_follow_migrations(mut self, follow: bool) -> Self {
        self.follow_migrations = follow;
        self
    }

    /// Send "authorization: Bearer `token`" with every call (the server's `--auth-token-file`).
    /// TLS: [`Client::connect_tls`] (feature `tls`), or a `Channel` of your own through
    /// [`Client::from_channel`].
    pub fn with_token(mut self, token: &str) -> Result<Self, Status> {
        let v = format!("Bearer {token}").parse().map_err(|_| Status::invalid_argument("token is not valid ASCII metadata"))?;
        self.authorization = Some(v);
        Ok(self)
    }

    /// The server's `host:port` as this client reached it (empty for [`Client::from_channel`]
    /// unless set with [`Client::with_target`]): what another server pulls from in a handoff.
    pub fn target(&self) -> &str {
        &self.target
    }
    /// Set the `host:port` [`Client::target`] reports.
    pub fn with_target(mut self, target: impl Into<String>) -> Self {
        self.target = target.into();
        self
    }

    /// The model requests name (empty = the server's only model).
    pub fn with_model(mut self, model_id: impl Into<String>) -> Self {
        self.model_id = model_id.into();
        self
    }
    /// A clone of this client bound to another model.
    pub fn model(&self, model_id: impl Into<String>) -> Self {
        self.clone().with_model(model_id)
    }
    /// The model requests name.
    pub fn model_id(&self) -> &str {
        &self.model_id
    }
    /// Deadline of each unary call (None = no deadline).
    pub fn with_timeout(mut self, t: Option<Duration>) -> Self {
        self.timeout = t;
        self
    }
    /// Deadline of a whole `Generate` or `Session` stream (None = no deadline).
    pub fn with_stream_timeout(mut self, t: Option<Duration>) -> Self {
        self.stream_timeout = t;
        self
    }
    /// The generated stub, for RPCs without a shortcut here (SubscribeKvEvents, ListCaches, ...).
    pub fn stub(&self) -> ModelExecutorClient<Channel> {
        self.stub.clone()
    }

    fn req<T>(&self, msg: T) -> Request<T> {
        let mut r = self.stream_req(msg);
        if let Some(t) = self.timeout {
            r.set_timeout(t);
        }
        r
    }

    /// A request with the credentials and the stream deadline (if any).
    fn stream_req<T>(&self, msg: T) -> Request<T> {
        let mut r = Request::new(msg);
        if let Some(a) = &self.authorization {
            r.metadata_mut().insert("authorization", a.clone());
        }
        r
    }

    /// Poll `grpc.health.v1` (service "") until SERVING or `timeout` passes.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<(), Status> {
        let deadline = Instant::now() + timeout;
        let mut last = Status::unavailable("not checked yet");
        while Instant::now() < deadline {
            let mut h = self.health.clone();
            let mut r = Request::new(HealthCheckRequest { service: String::new() });
            r.set_timeout(Duration::from_secs(2));
            match h.check(r).await {
                Ok(resp) if resp.get_ref().status == ServingStatus::Serving as i32 => return Ok(()),
                Ok(resp) => last = Status::unavailable(format!("health status {}", resp.get_ref().status)),
                Err(e) => last = e,
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(last)
    }

    // ---- metadata ----

    pub async fn info(&self) -> Result<proto::InfoResponse, Status> {
        let m = proto::InfoRequest { model_id: self.model_id.clone() };
        Ok(self.stub.clone().info(self.req(m)).await?.into_inner())
    }
    /// This client's model's `ModelInfo` (the only one when no model is set).
    pub async fn model_info(&self) -> Result<proto::ModelInfo, Status> {
        let resp = self.info().await?;
        resp.models
            .into_iter()
            .find(|m| self.model_id.is_empty() || m.model_id == self.model_id)
            .ok_or_else(|| Status::not_found(format!("model {:?} not hosted", self.model_id)))
    }
    pub async fn capabilities(&self) -> Result<proto::ExecutorCapabilities, Status> {
        let m = proto::CapabilitiesRequest { model_id: self.model_id.clone() };
        Ok(self.stub.clone().capabilities(self.req(m)).await?.into_inner().capabilities.unwrap_or_default())
    }
    pub async fn status(&self) -> Result<proto::StatusResponse, Status> {
        let m = proto::StatusRequest { model_id: self.model_id.clone() };
        Ok(self.stub.clone().status(self.req(m)).await?.into_inner())
    }
    pub async fn kv_capacity(&self) -> Result<proto::KvCapacity, Status> {
        let m = proto::KvCapacityRequest { model_id: self.model_id.clone() };
        Ok(self.stub.clone().kv_capacity(self.req(m)).await?.into_inner().capacity.unwrap_or_default())
    }
    pub async fn admission_limits(&self) -> Result<Option<proto::ExecutorAdmissionLimits>, Status> {
        let m = proto::AdmissionLimitsRequest { model_id: self.model_id.clone() };
        Ok(self.stub.clone().admission_limits(self.req(m)).await?.into_inner().limits)
    }

    // ---- steps ----

    /// Prefill a new cache with `tokens`; `policy` None = a greedy token.
    pub async fn prefill(&self, tokens: &[i32], policy: Option<proto::LogitsPolicy>) -> Result<proto::PrefillOutput, Status> {
        self.prefill_input(proto::PrefillInput { token_ids: tokens.to_vec(), logits: policy, ..Default::default() })
            .await
    }
    pub async fn prefill_input(&self, input: proto::PrefillInput) -> Result<proto::PrefillOutput, Status> {
        let m = proto::PrefillRequest { model_id: self.model_id.clone(), input: Some(input), ..Default::default() };
        output(self.stub.clone().prefill(self.req(m)).await?.into_inner().output)
    }
    pub async fn batch_prefill(&self, inputs: Vec<proto::PrefillInput>) -> Result<Vec<proto::PrefillOutput>, Status> {
        let m = proto::BatchPrefillRequest { model_id: self.model_id.clone(), inputs, ..Default::default() };
        Ok(self.stub.clone().batch_prefill(self.req(m)).await?.into_inner().outputs)
    }
    /// Feed `token` into `cache_id`; `policy` None = a greedy token.
    pub async fn decode(&self, cache_id: &str, token: i32, policy: Option<proto::LogitsPolicy>) -> Result<proto::DecodeOutput, Status> {
        self.decode_input(decode_input(cache_id, token, policy)).await
    }
    pub async fn decode_input(&self, input: proto::DecodeInput) -> Result<proto::DecodeOutput, Status> {
        let m = proto::DecodeRequest { model_id: self.model_id.clone(), input: Some(input), ..Default::default() };
        output(self.stub.clone().decode(self.req(m)).await?.into_inner().output)
    }
    /// One decode step for each input, in one forward; outputs in input order.
    pub async fn batch_decode(&self, inputs: Vec<proto::DecodeInput>) -> Result<Vec<proto::DecodeOutput>, Status> {
        let m = proto::BatchDecodeRequest { model_id: self.model_id.clone(), inputs, ..Default::default() };
        Ok(self.stub.clone().batch_decode(self.req(m)).await?.into_inner().outputs)
    }
    pub async fn unified_decode(&self, items: Vec<proto::UnifiedBatchItem>) -> Result<Vec<proto::UnifiedItemResult>, Status> {
        Ok(self.unified_decode_response(items).await?.results)
    }
    /// `UnifiedDecode`, the whole response (results and the server's `StepTimings`).
    pub async fn unified_decode_response(&self, items: Vec<proto::UnifiedBatchItem>) -> Result<proto::UnifiedDecodeResponse, Status> {
        let m = proto::UnifiedDecodeRequest { model_id: self.model_id.clone(), items, ..Default::default() };
        Ok(self.stub.clone().unified_decode(self.req(m)).await?.into_inner())
    }
    /// Speculative verification of `tokens` = [last accepted, draft...] on `cache_id`.
    pub async fn forward_verify(
        &self,
        cache_id: &str,
        tokens: &[i32],
        policy: Option<proto::LogitsPolicy>,
        accept_greedy_prefix: bool,
    ) -> Result<proto::ForwardVerifyResponse, Status> {
        let m = proto::ForwardVerifyRequest {
            model_id: self.model_id.clone(),
            cache_id: cache_id.to_string(),
            token_ids: tokens.to_vec(),
            logits: policy,
            accept_greedy_prefix,
            ..Default::default()
        };
        Ok(self.stub.clone().forward_verify(self.req(m)).await?.into_inner())
    }
    pub async fn forward(&self, input: proto::Tensor, logits_dtype: proto::DataType) -> Result<proto::Tensor, Status> {
        let m = proto::ForwardRequest { model_id: self.model_id.clone(), input: Some(input), logits_dtype: logits_dtype as i32 };
        output(self.stub.clone().forward(self.req(m)).await?.into_inner().output)
    }
    pub async fn truncate_kv(&self, cache_id: &str, new_len: i64) -> Result<proto::TruncateKvResponse, Status> {
        let m = proto::TruncateKvRequest {
            model_id: self.model_id.clone(),
            cache_id: cache_id.to_string(),
            new_len,
            ..Default::default()
        };
        Ok(self.stub.clone().truncate_kv(self.req(m)).await?.into_inner())
    }
    pub async fn release_cache(&self, cache_id: &str) -> Result<proto::ReleaseCacheResponse, Status> {
        let m = proto::ReleaseCacheRequest { model_id: self.model_id.clone(), cache_id: cache_id.to_string(), ..Default::default() };
        Ok(self.stub.clone().release_cache(self.req(m)).await?.into_inner())
    }
    pub async fn reserve_kv_slots(&self, requests: Vec<proto::KvSlotRequest>) -> Result<Option<proto::KvSlotReservation>, Status> {
        let m = proto::ReserveKvSlotsRequest { model_id: self.model_id.clone(), requests };
        Ok(self.stub.clone().reserve_kv_slots(self.req(m)).await?.into_inner().reservation)
    }
    pub async fn kv_slot_capacity(&self) -> Result<Option<proto::KvSlotCapacitySnapshot>, Status> {
        let m = proto::KvSlotCapacityRequest { model_id: self.model_id.clone() };
        Ok(self.stub.clone().kv_slot_capacity(self.req(m)).await?.into_inner().snapshot)
    }
    pub async fn cache_metrics(&self) -> Result<Option<prost_types::Struct>, Status> {
        let m = proto::CacheMetricsRequest { model_id: self.model_id.clone() };
        Ok(self.stub.clone().cache_metrics(self.req(m)).await?.into_inner().metrics)
    }
    pub async fn lora_metrics(&self) -> Result<Option<prost_types::Struct>, Status> {
        let m = proto::LoraMetricsRequest { model_id: self.model_id.clone() };
        Ok(self.stub.clone().lora_metrics(self.req(m)).await?.into_inner().metrics)
    }
    /// `ListCaches`: the live caches of the client's model (all models when it has none).
    pub async fn list_caches(&self) -> Result<proto::ListCachesResponse, Status> {
        let m = proto::ListCachesRequest { model_id: self.model_id.clone() };
        Ok(self.stub.clone().list_caches(self.req(m)).await?.into_inner())
    }
    /// `LoadAdapter`: register the LoRA adapter in the PEFT directory `path` (on the server's
    /// filesystem) under `name` on the client's model; requests then name it in their `adapter`
    /// field. The same name and path again is a no-op (`loaded` false). An admin RPC.
    pub async fn load_adapter(&self, name: &str, path: &str) -> Result<proto::LoadAdapterResponse, Status> {
        let m = proto::LoadAdapterRequest { model_id: self.model_id.clone(), name: name.to_string(), path: path.to_string() };
        Ok(self.stub.clone().load_adapter(self.req(m)).await?.into_inner())
    }
    /// `UnloadAdapter`: forget a LoRA adapter (FAILED_PRECONDITION while a live cache is bound to
    /// it; `unloaded` false when it was not loaded). An admin RPC.
    pub async fn unload_adapter(&self, name: &str) -> Result<proto::UnloadAdapterResponse, Status> {
        let m = proto::UnloadAdapterRequest { model_id: self.model_id.clone(), name: name.to_string() };
        Ok(self.stub.clone().unload_adapter(self.req(m)).await?.into_inner())
    }
    /// `ListAdapters`: the LoRA adapters registered on the client's model (every model's when it
    /// has none).
    pub async fn list_adapters(&self) -> Result<Vec<proto::AdapterInfo>, Status> {
        let m = proto::ListAdaptersRequest { model_id: self.model_id.clone() };
        Ok(self.stub.clone().list_adapters(self.req(m)).await?.into_inner().adapters)
    }
    pub async fn warmup(&self) -> Result<proto::WarmupResponse, Status> {
        let m = proto::WarmupRequest { model_id: self.model_id.clone() };
        Ok(self.stub.clone().warmup(self.req(m)).await?.into_inner())
    }
    pub async fn shutdown(&self) -> Result<proto::ShutdownResponse, Status> {
        let m = proto::ShutdownRequest { model_id: self.model_id.clone() };
        Ok(self.stub.clone().shutdown(self.req(m)).await?.into_inner())
    }

    // ---- tokenizer ----

    pub async fn tokenize(&self, text: &str, add_special_tokens: bool) -> Result<Vec<i32>, Status> {
        let m = proto::TokenizeRequest { model_id: self.model_id.clone(), text: text.to_string(), add_special_tokens };
        Ok(self.stub.clone().tokenize(self.req(m)).await?.into_inner().token_ids)
    }
    pub async fn detokenize(&self, tokens: &[i32], skip_special_tokens: bool) -> Result<String, Status> {
        let m = proto::DetokenizeRequest { model_id: self.model_id.clone(), token_ids: tokens.to_vec(), skip_special_tokens };
        Ok(self.stub.clone().detokenize(self.req(m)).await?.into_inner().text)
    }

    // ---- generate ----

    /// Start a server-side generation; the result is a `Stream` of events (see [`GenerateStream`]).
    /// `request.model_id` is filled from the client when empty. A stream moved to another server
    /// is followed there (see [`Client::with_follow_migrations`], [`Client::with_connector`]).
    pub async fn generate(&self, mut request: proto::GenerateRequest) -> Result<GenerateStream, Status> {
        if request.model_id.is_empty() {
            request.model_id = self.model_id.clone();
        }
        let model_id = request.model_id.clone();
        let call = self.generate_call(request).await?;
        Ok(GenerateStream::new(call, self.follow_migrations.then(|| (self.clone(), model_id))))
    }

    async fn generate_call(&self, request: proto::GenerateRequest) -> Result<tonic::Streaming<proto::GenerateResponse>, Status> {
        let mut r = self.stream_req(request);
        if let Some(t) = self.stream_timeout {
            r.set_timeout(t);
        }
        Ok(self.stub.clone().generate(r).await?.into_inner())
    }

    /// The `Generate` call that resumes a moved stream on its target, through a client like this
    /// one (same connector, token and deadlines), kept among this client's followers.
    pub(crate) async fn resume_moved(&self, moved: &proto::GenerateMigrated, model_id: String) -> Result<tonic::Streaming<proto::GenerateResponse>, Status> {
        let peer = self.follower(&moved.target).await?;
        peer.generate_call(proto::GenerateRequest { model_id, resume_token: moved.resume_token.clone(), ..Default::default() })
            .await
    }

    async fn follower(&self, target: &str) -> Result<Client, Status> {
        if let Some(c) = self.followers.lock().unwrap_or_else(|e| e.into_inner()).get(target) {
            return Ok(c.clone());
        }
        let connector = self.connector.clone().ok_or_else(|| {
            Status::failed_precondition(format!(
                "the stream moved to {target}: this client has no connector to reach it (Client::with_connector)"
            ))
        })?;
        let channel = connector
            .open(target.to_string())
            .await
            .map_err(|e| Status::unavailable(format!("following the stream to {target}: {e}")))?;
        let mut c = Client::from_channel(channel).with_target(target);
        c.model_id = self.model_id.clone();
        c.timeout = self.timeout;
        c.stream_timeout = self.stream_timeout;
        c.authorization = self.authorization.clone();
        c.connector = self.connector.clone();
        // c keeps followers of its own (empty): the stream's root client follows every hop itself
        let mut map = self.followers.lock().unwrap_or_else(|e| e.into_inner());
        Ok(map.entry(target.to_string()).or_insert(c).clone())
    }

    /// `MigrateStreams`: move the running `Generate` streams of this client's model (every model's
    /// when it has none), or only those with `request_id` (empty = all), to `target` (`host:port`,
    /// one of the server's KV peers) without losing or repeating a token: each ends here with a
    /// `migrated` event its caller follows ([`GenerateStream`] does). One `StreamMigration` per
    /// stream, moved or refused (a refused one goes on here). `drain` also stops new work. An
    /// admin RPC.
    pub async fn migrate_streams(&self, target: &str, request_id: &str, drain: bool) -> Result<proto::MigrateStreamsResponse, Status> {
        let m = proto::MigrateStreamsRequest {
            model_id: self.model_id.clone(),
            request_id: request_id.to_string(),
            target: target.to_string(),
            drain,
        };
        Ok(self.stub.clone().migrate_streams(self.req(m)).await?.into_inner())
    }

    /// A generation from a prompt (`prompt` None = continue `opts.cache_id`).
    pub async fn generate_with(&self, prompt: Option<proto::generate_request::Prompt>, opts: GenerateOptions) -> Result<GenerateStream, Status> {
        self.generate(proto::GenerateRequest {
            prompt,
            cache_id: opts.cache_id,
            last_token_id: opts.last_token_id,
            sampling: opts.sampling,
            stop: Some(proto::StopConditions {
                max_tokens: if opts.max_tokens == 0 { 16 } else { opts.max_tokens },
                stop_token_ids: opts.stop_token_ids,
                ignore_eos: opts.ignore_eos,
                stop_sequences: opts.stop_sequences,
            }),
            top_logprobs: opts.top_logprobs,
            keep_cache: opts.keep_cache,
            request_id: opts.request_id,
            stream_text: opts.stream_text,
            cache_salt: opts.cache_salt,
            bypass_prefix_cache: opts.bypass_prefix_cache,
            n: opts.n,
            adapter: opts.adapter,
            ..Default::default()
        })
        .await
    }

    /// Run a generation to its end: the started event, each sample's tokens and finished event.
    pub async fn generate_all(&self, prompt: Option<proto::generate_request::Prompt>, opts: GenerateOptions) -> Result<GenerateResult, Status> {
        let mut stream = self.generate_with(prompt, opts).await?;
        let mut out = GenerateResult::default();
        while let Some(ev) = stream.message().await? {
            match ev.event {
                Some(proto::generate_response::Event::Started(s)) => out.started = Some(s),
                Some(proto::generate_response::Event::Token(t)) => {
                    let i = t.sample_index as usize;
                    if out.samples.len() <= i {
                        out.samples.resize(i + 1, Vec::new());
                    }
                    out.samples[i].push(t.token_id);
                }
                Some(proto::generate_response::Event::Finished(f)) => {
                    let i = f.sample_index as usize;
                    if out.finished.len() <= i {
                        out.finished.resize(i + 1, None);
                    }
                    out.finished[i] = Some(f);
                }
                Some(proto::generate_response::Event::Migrated(m)) => out.migrated = Some(m),
                None => {}
            }
        }
        out.migrations = stream.migrations().to_vec();
        Ok(out)
    }

    // ---- scheduler-facing operations ----

    /// `ForkCache`: a new cache sharing the first `keep_tokens` tokens of `cache_id` (all when
    /// None), copy-on-write; `reserve_tokens` as a prefill's.
    pub async fn fork_cache(&self, cache_id: &str, keep_tokens: Option<u64>, reserve_tokens: u64) -> Result<proto::ForkCacheResponse, Status> {
        let m = proto::ForkCacheRequest {
            model_id: self.model_id.clone(),
            cache_id: cache_id.to_string(),
            keep_tokens,
            reserve_tokens,
            ..Default::default()
        };
        Ok(self.stub.clone().fork_cache(self.req(m)).await?.into_inner())
    }
    /// `Loads`: per-model load (caches, free KV, running and queued steps, prefix hits) and the
    /// KV-event sequence number; cheap enough before every placement.
    pub async fn loads(&self) -> Result<proto::LoadsResponse, Status> {
        let m = proto::LoadsRequest { model_id: self.model_id.clone() };
        Ok(self.stub.clone().loads(self.req(m)).await?.into_inner())
    }
    /// This client's model's `ModelLoad` (the first one when no model is set).
    pub async fn model_load(&self) -> Result<proto::ModelLoad, Status> {
        let r = self.loads().await?;
        r.loads
            .into_iter()
            .find(|l| self.model_id.is_empty() || l.model_id == self.model_id)
            .ok_or_else(|| Status::not_found(format!("no load for model {:?}", self.model_id)))
    }
    /// `Abort` of a `Generate` by its `request_id`.
    pub async fn abort_request(&self, request_id: &str) -> Result<proto::AbortResponse, Status> {
        let m = proto::AbortRequest {
            model_id: self.model_id.clone(),
            target: Some(proto::abort_request::Target::RequestId(request_id.to_string())),
        };
        Ok(self.stub.clone().abort(self.req(m)).await?.into_inner())
    }
    /// `Abort` of a cache (it is released, ending any stream using it).
    pub async fn abort_cache(&self, cache_id: &str) -> Result<proto::AbortResponse, Status> {
        let m = proto::AbortRequest {
            model_id: self.model_id.clone(),
            target: Some(proto::abort_request::Target::CacheId(cache_id.to_string())),
        };
        Ok(self.stub.clone().abort(self.req(m)).await?.into_inner())
    }
    /// `SubscribeKvEvents`: cache events (and with `include_block_events` prefix-cache block
    /// events) of the client's model (every model when it has none); `from_seq` replays the
    /// server's buffer from that sequence number. Dropping the stream ends the subscription.
    pub async fn subscribe_kv_events(
        &self,
        from_seq: Option<u64>,
        include_block_events: bool,
    ) -> Result<tonic::Streaming<proto::SubscribeKvEventsResponse>, Status> {
        let m = proto::SubscribeKvEventsRequest { model_id: self.model_id.clone(), from_seq, include_block_events };
        Ok(self.stub.clone().subscribe_kv_events(self.stream_req(m)).await?.into_inner())
    }
    /// `ExportKv`: the transfer header, then the chunks, of `cache_id`'s tokens
    /// `[from_token, to_token)` (`to_token` 0 = the end).
    pub async fn export_kv(
        &self,
        cache_id: &str,
        from_token: u64,
        to_token: u64,
        max_chunk_bytes: u32,
    ) -> Result<tonic::Streaming<proto::ExportKvResponse>, Status> {
        let m = proto::ExportKvRequest {
            model_id: self.model_id.clone(),
            cache_id: cache_id.to_string(),
            from_token,
            to_token,
            max_chunk_bytes,
        };
        let mut r = self.stream_req(m);
        if let Some(t) = self.stream_timeout.or(self.timeout) {
            r.set_timeout(t);
        }
        Ok(self.stub.clone().export_kv(r).await?.into_inner())
    }
    /// [`Client::export_kv`] of the whole cache, collected.
    pub async fn export_kv_all(&self, cache_id: &str) -> Result<ExportedKv, Status> {
        let mut s = self.export_kv(cache_id, 0, 0, 0).await?;
        let mut header = None;
        let mut chunks = Vec::new();
        while let Some(m) = next_message(&mut s).await? {
            match m.message {
                Some(proto::export_kv_response::Message::Header(h)) => header = Some(h),
                Some(proto::export_kv_response::Message::Chunk(c)) => chunks.push(c),
                None => {}
            }
        }
        let header = header.ok_or_else(|| Status::internal("ExportKv: the stream had no header"))?;
        Ok(ExportedKv { header, chunks })
    }
    /// `ImportKv` (push): a new cache on this server from exported K/V.
    pub async fn import_kv(&self, kv: ExportedKv, opts: ImportOptions) -> Result<proto::ImportKvResponse, Status> {
        let mut msgs = Vec::with_capacity(kv.chunks.len() + 1);
        msgs.push(proto::ImportKvRequest {
            model_id: self.model_id.clone(),
            reserve_tokens: opts.reserve_tokens,
            cache_salt: opts.cache_salt,
            request_id: opts.request_id,
            data: Some(proto::import_kv_request::Data::Header(kv.header)),
            ..Default::default()
        });
        msgs.extend(kv.chunks.into_iter().map(|c| proto::ImportKvRequest {
            data: Some(proto::import_kv_request::Data::Chunk(c)),
            ..Default::default()
        }));
        let r = self.req(VecStream(msgs.into_iter()));
        Ok(self.stub.clone().import_kv(r).await?.into_inner())
    }
    /// `ImportKv` (pull): this server fetches `cache_id` from the server at `source_target`
    /// (`host:port` as it reaches it) itself, with this client's credentials.
    pub async fn pull_kv(&self, source_target: &str, cache_id: &str, opts: ImportOptions) -> Result<proto::ImportKvResponse, Status> {
        let m = proto::ImportKvRequest {
            model_id: self.model_id.clone(),
            reserve_tokens: opts.reserve_tokens,
            cache_salt: opts.cache_salt,
            request_id: opts.request_id,
            source: Some(proto::KvSource {
                target: source_target.to_string(),
                cache_id: cache_id.to_string(),
                ..Default::default()
            }),
            ..Default::default()
        };
        let r = self.req(VecStream(vec![m].into_iter()));
        Ok(self.stub.clone().import_kv(r).await?.into_inner())
    }
    /// `ApplyChatTemplate`: the model's chat template over `(role, content)` messages.
    pub async fn apply_chat_template(&self, messages: &[(&str, &str)], add_generation_prompt: bool) -> Result<proto::ApplyChatTemplateResponse, Status> {
        let m = proto::ApplyChatTemplateRequest {
            model_id: self.model_id.clone(),
            messages: messages.iter().map(|(r, c)| proto::ChatMessage { role: r.to_string(), content: c.to_string() }).collect(),
            add_generation_prompt,
        };
        Ok(self.stub.clone().apply_chat_template(self.req(m)).await?.into_inner())
    }

    /// A generation from token ids with `max_tokens` and greedy sampling unless `sampling`.
    pub async fn generate_tokens(
        &self,
        tokens: &[i32],
        max_tokens: u32,
        sampling: Option<proto::SamplingParams>,
    ) -> Result<GenerateStream, Status> {
        self.generate(proto::GenerateRequest {
            prompt: Some(proto::generate_request::Prompt::TokenIds(proto::TokenIds { token_ids: tokens.to_vec() })),
            sampling,
            stop: Some(proto::StopConditions { max_tokens, ..Default::default() }),
            ..Default::default()
        })
        .await
    }

    // ---- session ----

    /// Open a `Session` stream on this client's model: steps in, results back in order, and every
    /// cache created on it freed when it ends (see [`Session`]). Returns without waiting for the
    /// server; an error of the call itself (UNAUTHENTICATED, UNAVAILABLE, ...) comes back from the
    /// first [`Session::recv`] / [`Session::step`]. Must run within a tokio runtime.
    pub async fn session(&self) -> Result<Session, Status> {
        Ok(Session::start(self.stub(), self.model_id.clone(), self.stream_timeout, self.authorization.clone()))
    }
}

/// The next message of a server stream (None at its end).
pub async fn next_message<T>(s: &mut tonic::Streaming<T>) -> Result<Option<T>, Status> {
    s.message().await
}

/// A channel to `endpoint` with the client's connect settings.
async fn dial(endpoint: String) -> Result<Channel, tonic::transport::Error> {
    Endpoint::from_shared(endpoint)?.connect_timeout(Duration::from_secs(10)).tcp_nodelay(true).connect().await
}

#[cfg(feature = "tls")]
async fn dial_tls(endpoint: String, tls: tonic::transport::ClientTlsConfig) -> Result<Channel, tonic::transport::Error> {
    Endpoint::from_shared(endpoint)?
        .tls_config(tls)?
        .connect_timeout(Duration::from_secs(10))
        .tcp_nodelay(true)
        .connect()
        .await
}

/// `host:port` of an endpoint URL (`http://127.0.0.1:50051` → `127.0.0.1:50051`).
fn endpoint_target(endpoint: &str) -> String {
    let rest = endpoint.split_once("://").map_or(endpoint, |(_, r)| r);
    rest.trim_end_matches('/').to_string()
}

fn output<T>(o: Option<T>) -> Result<T, Status> {
    o.ok_or_else(|| Status::internal("server response has no output"))
}

/// The `DecodeInput` that feeds `token` into `cache_id` (`policy` None = the server's default, a
/// greedy token); shared by [`Client::decode`] and the session's `decode`.
pub(crate) fn decode_input(cache_id: &str, token: i32, policy: Option<proto::LogitsPolicy>) -> proto::DecodeInput {
    proto::DecodeInput { cache_id: cache_id.to_string(), token_id: token, logits: policy, ..Default::default() }
}
