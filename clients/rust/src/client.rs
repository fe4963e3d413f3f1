//! A thin typed client over the generated stub: a default model, per-call deadlines, ergonomic
//! shortcuts for the step RPCs, `Generate` as a `Stream`, and `Session` as a [`Session`].
//!
//! Errors are `tonic::Status` (use [`crate::error::status_to_ferrum`] for ferrum's kinds, or
//! [`crate::error::error_reason`] for the ErrorInfo reason).

use std::time::{Duration, Instant};

use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use crate::proto;
use crate::proto::model_executor_client::ModelExecutorClient;
use crate::session::Session;

/// The stream of a `Generate` call: `started`, one `token` per generated token, `finished`.
/// Dropping it cancels the call, which stops the server's loop and frees its cache.
pub type GenerateStream = tonic::Streaming<proto::GenerateResponse>;

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

/// Typed client for one server. Cheap to clone (the channel is shared).
#[derive(Clone, Debug)]
pub struct Client {
    stub: ModelExecutorClient<Channel>,
    health: HealthClient<Channel>,
    model_id: String,
    timeout: Option<Duration>,
    stream_timeout: Option<Duration>,
}

impl Client {
    /// Connect to `endpoint` (e.g. `http://127.0.0.1:50051`). Unary calls get a 30 s deadline
    /// by default ([`Client::with_timeout`]); streams none ([`Client::with_stream_timeout`]).
    pub async fn connect(endpoint: impl Into<String>) -> Result<Self, tonic::transport::Error> {
        let channel = Endpoint::from_shared(endpoint.into())?
            .connect_timeout(Duration::from_secs(10))
            .tcp_nodelay(true)
            .connect()
            .await?;
        Ok(Self::from_channel(channel))
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
        }
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
        let mut r = Request::new(msg);
        if let Some(t) = self.timeout {
            r.set_timeout(t);
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
        let m = proto::UnifiedDecodeRequest { model_id: self.model_id.clone(), items, ..Default::default() };
        Ok(self.stub.clone().unified_decode(self.req(m)).await?.into_inner().results)
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
    /// `request.model_id` is filled from the client when empty.
    pub async fn generate(&self, mut request: proto::GenerateRequest) -> Result<GenerateStream, Status> {
        if request.model_id.is_empty() {
            request.model_id = self.model_id.clone();
        }
        let mut r = Request::new(request);
        if let Some(t) = self.stream_timeout {
            r.set_timeout(t);
        }
        Ok(self.stub.clone().generate(r).await?.into_inner())
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
        Ok(Session::start(self.stub(), self.model_id.clone(), self.stream_timeout))
    }
}

fn output<T>(o: Option<T>) -> Result<T, Status> {
    o.ok_or_else(|| Status::internal("server response has no output"))
}

/// The `DecodeInput` that feeds `token` into `cache_id` (`policy` None = the server's default, a
/// greedy token); shared by [`Client::decode`] and the session's `decode`.
pub(crate) fn decode_input(cache_id: &str, token: i32, policy: Option<proto::LogitsPolicy>) -> proto::DecodeInput {
    proto::DecodeInput { cache_id: cache_id.to_string(), token_id: token, logits: policy, ..Default::default() }
}
