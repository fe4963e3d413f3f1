//! The bidirectional `Session` RPC as a step-by-step API: steps go in, their results come back in
//! order, and every cache created on the stream is freed when it ends.
//!
//! ```no_run
//! # async fn demo() -> Result<(), tonic::Status> {
//! # let c = ferrum_remote_executor::Client::connect("http://127.0.0.1:50051").await.unwrap().with_model("tiny");
//! use ferrum_remote_executor::proto;
//! let mut s = c.session().await?;                               // steps take the client's model
//! let pre = s.prefill(&[1, 100, 200], None).await?;             // a cache owned by the stream
//! let (cache, mut tok) = (pre.cache.unwrap().cache_id, pre.output.unwrap().token_id.unwrap());
//! for _ in 0..8 {
//!     tok = s.decode(&cache, tok, None).await?.output.unwrap().token_id.unwrap();
//! }
//! let e = s.decode("no-such-cache", tok, None).await.unwrap_err(); // a failed step; the session goes on
//! assert_eq!(e.code(), tonic::Code::NotFound);                  // the same Status as the unary call
//! let a = s.send(proto::TruncateKvRequest { cache_id: cache.clone(), new_len: 3, ..Default::default() })?;
//! let b = s.send(proto::ReleaseCacheRequest { cache_id: cache.clone(), ..Default::default() })?;
//! let (id, result) = s.recv().await?;                           // outer Err: the stream failed
//! assert_eq!(id, a);                                            // results come back in send order
//! let truncated = result?.into_truncate_kv().unwrap();          // inner Err: that step failed
//! let (id, _released) = s.recv().await?;
//! assert_eq!(id, b);
//! s.close().await?;                                             // the server frees the stream's caches
//! # let _ = truncated;
//! # Ok(()) }
//! ```
//!
//! Errors are [`tonic::Status`], as for [`Client`]'s unary calls: a step's in-band `StepError` is
//! turned back into the status the unary RPC would have failed with (code, message, ErrorInfo,
//! BadRequest, RetryInfo; see [`crate::error::step_error_to_status`]), so
//! [`crate::error::error_reason`] and [`crate::error::status_to_ferrum`] apply unchanged.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tonic::codec::Streaming;
use tonic::transport::Channel;
use tonic::{Request, Status};

#[cfg(doc)]
use crate::client::Client;
use crate::error::step_error_to_status;
use crate::proto;
use crate::proto::model_executor_client::ModelExecutorClient;
use crate::proto::session_response::Result as ResultProto;

/// One step of a session: the `oneof step` of `SessionRequest`. Every step request converts into
/// it (`proto::DecodeRequest` → `Step::Decode`, ...), so [`Session::send`] and [`Session::step`]
/// take the request itself.
pub use crate::proto::session_request::Step;

macro_rules! session_steps {
    ($($variant:ident($req:ident, $resp:ident) => $into:ident, $name:literal;)*) => {
        $(
            impl From<proto::$req> for Step {
                fn from(r: proto::$req) -> Self {
                    Step::$variant(r)
                }
            }
        )*

        /// The successful result of one step: the `oneof result` of `SessionResponse` without its
        /// `error` (a failed step is an `Err`).
        #[derive(Clone, Debug, PartialEq)]
        pub enum StepResult {
            $(
                #[doc = concat!("The result of a `", stringify!($req), "`.")]
                $variant(proto::$resp),
            )*
        }

        impl StepResult {
            $(
                #[doc = concat!("The `", stringify!($resp), "`; None when the result is another kind.")]
                pub fn $into(self) -> Option<proto::$resp> {
                    match self {
                        StepResult::$variant(r) => Some(r),
                        _ => None,
                    }
                }
            )*

            /// The step kind, as the oneof field names it (`"decode"`, `"batch_prefill"`, ...).
            pub fn name(&self) -> &'static str {
                match self {
                    $(StepResult::$variant(_) => $name,)*
                }
            }

            /// A response's result: `Ok` for a step that succeeded, the step's status for a
            /// `StepError`, INTERNAL for an empty result.
            pub fn from_response(result: Option<ResultProto>) -> Result<Self, Status> {
                match result {
                    $(Some(ResultProto::$variant(r)) => Ok(StepResult::$variant(r)),)*
                    Some(ResultProto::Error(e)) => Err(step_error_to_status(&e)),
                    None => Err(Status::internal("the server answered a Session step with an empty result")),
                }
            }
        }

        /// The step kind, as the oneof field names it.
        fn step_name(step: &Step) -> &'static str {
            match step {
                $(Step::$variant(_) => $name,)*
            }
        }

        /// Fill the request's `model_id` with `model` when it is empty.
        fn default_model(step: &mut Step, model: &str) {
            let m = match step {
                $(Step::$variant(r) => &mut r.model_id,)*
            };
            if m.is_empty() {
                *m = model.to_string();
            }
        }
    };
}

session_steps! {
    Prefill(PrefillRequest, PrefillResponse) => into_prefill, "prefill";
    BatchPrefill(BatchPrefillRequest, BatchPrefillResponse) => into_batch_prefill, "batch_prefill";
    Decode(DecodeRequest, DecodeResponse) => into_decode, "decode";
    BatchDecode(BatchDecodeRequest, BatchDecodeResponse) => into_batch_decode, "batch_decode";
    UnifiedDecode(UnifiedDecodeRequest, UnifiedDecodeResponse) => into_unified_decode, "unified_decode";
    ForwardVerify(ForwardVerifyRequest, ForwardVerifyResponse) => into_forward_verify, "forward_verify";
    TruncateKv(TruncateKvRequest, TruncateKvResponse) => into_truncate_kv, "truncate_kv";
    ReleaseCache(ReleaseCacheRequest, ReleaseCacheResponse) => into_release_cache, "release_cache";
    ForkCache(ForkCacheRequest, ForkCacheResponse) => into_fork_cache, "fork_cache";
}

/// The request half of the stream: what [`Session::send`] queues.
struct Outgoing(mpsc::UnboundedReceiver<proto::SessionRequest>);

impl futures_core::Stream for Outgoing {
    type Item = proto::SessionRequest;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx)
    }
}

type Opened = Result<Streaming<proto::SessionResponse>, Status>;

/// The response half of the stream.
enum Responses {
    /// The call is under way; it resolves once the server sends its response headers, which a
    /// server may hold back until it answers the first step, so it runs on its own task.
    Opening(JoinHandle<Opened>),
    Open(Box<Streaming<proto::SessionResponse>>),
    /// The stream is over: with its error status, or None after a clean end.
    Ended(Option<Status>),
}

/// One `Session` stream (from [`Client::session`]).
///
/// * [`Session::step`] sends one step and waits for its result; the typed shortcuts
///   ([`Session::prefill`], [`Session::decode`], [`Session::batch_decode`], ...) do the same and
///   return the output, as [`Client`]'s unary shortcuts do.
/// * [`Session::send`] queues a step without waiting and returns its step id; [`Session::recv`]
///   returns the next result in order. Pipelined steps are answered in the order they were sent.
/// * A failed step is an `Err(Status)` (the status its unary RPC would give) and the session goes
///   on.
/// * Caches created on the stream belong to it: [`Session::close`] ends the stream and the server
///   frees them. Dropping a `Session` without closing it cancels the stream, which frees them too.
///
/// The stream's deadline is the client's stream timeout ([`Client::with_stream_timeout`], none
/// by default); steps have no deadline of their own (wrap a call in `tokio::time::timeout`).
pub struct Session {
    tx: Option<mpsc::UnboundedSender<proto::SessionRequest>>,
    responses: Responses,
    model_id: String,
    next_id: u64,
    in_flight: usize,
    /// A send found the request half closed: the call is over, its status is on the response half.
    broken: bool,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.responses {
            Responses::Opening(_) => "opening",
            Responses::Open(_) => "open",
            Responses::Ended(_) => "ended",
        };
        f.debug_struct("Session")
            .field("model_id", &self.model_id)
            .field("next_step_id", &(self.next_id + 1))
            .field("in_flight", &self.in_flight)
            .field("state", &state)
            .finish()
    }
}

impl Session {
    /// Start the call on `stub` (see [`Client::session`]).
    /// with "authorization" metadata when given.
    pub(crate) fn start(
        mut stub: ModelExecutorClient<Channel>,
        model_id: String,
        timeout: Option<Duration>,
        authorization: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
    ) -> Session {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut request = Request::new(Outgoing(rx));
        if let Some(a) = authorization {
            request.metadata_mut().insert("authorization", a);
        }
        if let Some(t) = timeout {
            request.set_timeout(t);
        }
        let call = tokio::spawn(async move { Ok(stub.session(request).await?.into_inner()) });
        Session { tx: Some(tx), responses: Responses::Opening(call), model_id, next_id: 0, in_flight: 0, broken: false }
    }

    /// The model requests with an empty `model_id` are sent to.
    pub fn model_id(&self) -> &str {
        &self.model_id
    }

    /// Steps sent whose results have not been received yet.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Whether the stream is over (failed, cancelled or ended): every later call fails.
    pub fn is_over(&self) -> bool {
        self.broken || matches!(self.responses, Responses::Ended(_))
    }

    /// Queue a step without waiting; returns its step id (1, 2, 3, ...). Its result comes from
    /// [`Session::recv`], after the results of the steps sent before it. Fails only when the
    /// stream is over (failed, cancelled or past its deadline); [`Session::recv`] then returns the
    /// stream's status.
    pub fn send(&mut self, step: impl Into<Step>) -> Result<u64, Status> {
        if let Responses::Ended(status) = &self.responses {
            return Err(status.clone().unwrap_or_else(|| Status::cancelled("the Session stream has ended")));
        }
        let tx = self.tx.as_ref().ok_or_else(|| Status::cancelled("the Session is closed"))?;
        let mut step = step.into();
        default_model(&mut step, &self.model_id);
        let step_id = self.next_id + 1;
        if tx.send(proto::SessionRequest { step_id, step: Some(step) }).is_err() {
            self.broken = true;
            return Err(Status::cancelled("the Session stream has ended (recv() returns its status)"));
        }
        self.next_id = step_id;
        self.in_flight += 1;
        Ok(step_id)
    }

    /// The next result, in send order: `(step_id, Ok(result))` for a step that succeeded,
    /// `(step_id, Err(status))` for one that failed (the session goes on). The outer `Err` is the
    /// stream's own failure (then the session is over and every later call returns it), or
    /// FAILED_PRECONDITION when no step is in flight (instead of waiting forever).
    pub async fn recv(&mut self) -> Result<(u64, Result<StepResult, Status>), Status> {
        if let Responses::Ended(status) = &self.responses {
            return Err(status.clone().unwrap_or_else(|| Status::cancelled("the Session stream has ended")));
        }
        if self.in_flight == 0 && self.broken {
            let st = self.final_status().await;
            return self.end(st);
        }
        if self.in_flight == 0 {
            return Err(Status::failed_precondition("Session::recv: no step in flight"));
        }
        let stream = self.open().await?;
        match stream.message().await {
            Ok(Some(resp)) => {
                self.in_flight -= 1;
                Ok((resp.step_id, StepResult::from_response(resp.result)))
            }
            Ok(None) => {
                let st =
                    Status::unavailable(format!("the Session stream ended with {} step(s) unanswered", self.in_flight));
                self.end(st)
            }
            Err(st) => self.end(st),
        }
    }

    /// Send one step and wait for its result. A failed step is `Err` with the status the unary
    /// RPC would give; the session goes on. Refused with FAILED_PRECONDITION while steps sent
    /// with [`Session::send`] are still unanswered (receive them first).
    pub async fn step(&mut self, step: impl Into<Step>) -> Result<StepResult, Status> {
        if self.in_flight > 0 {
            return Err(Status::failed_precondition(format!(
                "Session::step: {} step(s) sent with send() are unanswered; recv() them first",
                self.in_flight
            )));
        }
        let step = step.into();
        let name = step_name(&step);
        let id = match self.send(step) {
            Ok(id) => id,
            Err(_) if self.broken => {
                let st = self.final_status().await;
                return self.end(st);
            }
            Err(st) => return Err(st),
        };
        let (got, result) = self.recv().await?;
        if got != id {
            return Err(Status::internal(format!("the session answered step {got} to {name} step {id}")));
        }
        result
    }

    /// End the stream: no more steps go in, the server answers those in flight (their results are
    /// discarded), ends the stream and frees every cache created on it. `Err` when the stream
    /// failed. The server frees the caches as the stream ends; a `ListCaches` issued at that
    /// instant may still list them for a moment.
    pub async fn close(mut self) -> Result<(), Status> {
        self.tx = None;
        if matches!(self.responses, Responses::Ended(None)) {
            return Ok(());
        }
        let stream = self.open().await?;
        while stream.message().await?.is_some() {}
        Ok(())
    }

    /// The stream failed: no step in flight will be answered; later calls get `status`.
    fn end<T>(&mut self, status: Status) -> Result<T, Status> {
        self.in_flight = 0;
        self.responses = Responses::Ended(Some(status.clone()));
        Err(status)
    }

    /// The status a finished call ended with: its response half read to the end.
    async fn final_status(&mut self) -> Status {
        let stream = match self.open().await {
            Ok(s) => s,
            Err(st) => return st,
        };
        loop {
            match stream.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => return Status::cancelled("the Session stream has ended"),
                Err(st) => return st,
            }
        }
    }

    /// The response stream, once the call has opened.
    async fn open(&mut self) -> Result<&mut Streaming<proto::SessionResponse>, Status> {
        if let Responses::Opening(call) = &mut self.responses {
            let opened = match call.await {
                Ok(r) => r,
                Err(e) => Err(Status::cancelled(format!("the Session call's task ended: {e}"))),
            };
            self.responses = match opened {
                Ok(s) => Responses::Open(Box::new(s)),
                Err(st) => Responses::Ended(Some(st)),
            };
        }
        match &mut self.responses {
            Responses::Open(s) => Ok(&mut **s),
            Responses::Ended(Some(st)) => Err(st.clone()),
            Responses::Ended(None) => Err(Status::cancelled("the Session stream has ended")),
            Responses::Opening(_) => unreachable!("resolved above"),
        }
    }

    async fn step_as<T>(&mut self, step: Step, into: fn(StepResult) -> Option<T>) -> Result<T, Status> {
        let name = step_name(&step);
        let result = self.step(step).await?;
        let got = result.name();
        into(result).ok_or_else(|| Status::internal(format!("the session answered a {got} result to a {name} step")))
    }

    // ---- typed shortcuts (as the unary ones on `Client`) ----

    /// Prefill a new cache (owned by the stream) with `tokens`; `policy` None = a greedy token.
    pub async fn prefill(
        &mut self,
        tokens: &[i32],
        policy: Option<proto::LogitsPolicy>,
    ) -> Result<proto::PrefillOutput, Status> {
        self.prefill_input(proto::PrefillInput { token_ids: tokens.to_vec(), logits: policy, ..Default::default() })
            .await
    }
    pub async fn prefill_input(&mut self, input: proto::PrefillInput) -> Result<proto::PrefillOutput, Status> {
        let m = proto::PrefillRequest { input: Some(input), ..Default::default() };
        output(self.step_as(m.into(), StepResult::into_prefill).await?.output)
    }
    pub async fn batch_prefill(
        &mut self,
        inputs: Vec<proto::PrefillInput>,
    ) -> Result<Vec<proto::PrefillOutput>, Status> {
        let m = proto::BatchPrefillRequest { inputs, ..Default::default() };
        Ok(self.step_as(m.into(), StepResult::into_batch_prefill).await?.outputs)
    }
    /// Feed `token` into `cache_id`; `policy` None = a greedy token.
    pub async fn decode(
        &mut self,
        cache_id: &str,
        token: i32,
        policy: Option<proto::LogitsPolicy>,
    ) -> Result<proto::DecodeOutput, Status> {
        self.decode_input(crate::client::decode_input(cache_id, token, policy)).await
    }
    pub async fn decode_input(&mut self, input: proto::DecodeInput) -> Result<proto::DecodeOutput, Status> {
        let m = proto::DecodeRequest { input: Some(input), ..Default::default() };
        output(self.step_as(m.into(), StepResult::into_decode).await?.output)
    }
    /// One decode step for each input, in one forward; outputs in input order.
    pub async fn batch_decode(&mut self, inputs: Vec<proto::DecodeInput>) -> Result<Vec<proto::DecodeOutput>, Status> {
        let m = proto::BatchDecodeRequest { inputs, ..Default::default() };
        Ok(self.step_as(m.into(), StepResult::into_batch_decode).await?.outputs)
    }
    pub async fn unified_decode(
        &mut self,
        items: Vec<proto::UnifiedBatchItem>,
    ) -> Result<Vec<proto::UnifiedItemResult>, Status> {
        let m = proto::UnifiedDecodeRequest { items, ..Default::default() };
        Ok(self.step_as(m.into(), StepResult::into_unified_decode).await?.results)
    }
    /// Speculative verification of `tokens` = [last accepted, draft...] on `cache_id`.
    pub async fn forward_verify(
        &mut self,
        cache_id: &str,
        tokens: &[i32],
        policy: Option<proto::LogitsPolicy>,
        accept_greedy_prefix: bool,
    ) -> Result<proto::ForwardVerifyResponse, Status> {
        let m = proto::ForwardVerifyRequest {
            cache_id: cache_id.to_string(),
            token_ids: tokens.to_vec(),
            logits: policy,
            accept_greedy_prefix,
            ..Default::default()
        };
        self.step_as(m.into(), StepResult::into_forward_verify).await
    }
    pub async fn truncate_kv(&mut self, cache_id: &str, new_len: i64) -> Result<proto::TruncateKvResponse, Status> {
        let m = proto::TruncateKvRequest { cache_id: cache_id.to_string(), new_len, ..Default::default() };
        self.step_as(m.into(), StepResult::into_truncate_kv).await
    }
    /// Free a cache before the stream ends.
    pub async fn release_cache(&mut self, cache_id: &str) -> Result<proto::ReleaseCacheResponse, Status> {
        let m = proto::ReleaseCacheRequest { cache_id: cache_id.to_string(), ..Default::default() };
        self.step_as(m.into(), StepResult::into_release_cache).await
    }
    /// A copy-on-write fork of a cache (the first `keep_tokens` tokens; all when None), owned by
    /// this stream like the caches it prefills.
    pub async fn fork_cache(&mut self, cache_id: &str, keep_tokens: Option<u64>) -> Result<proto::ForkCacheResponse, Status> {
        let m = proto::ForkCacheRequest { cache_id: cache_id.to_string(), keep_tokens, ..Default::default() };
        self.step_as(m.into(), StepResult::into_fork_cache).await
    }
}

impl Drop for Session {
    /// A session dropped before its call opened cancels the call; an open one is cancelled by
    /// dropping its response stream. Either way the server frees the session's caches.
    fn drop(&mut self) {
        if let Responses::Opening(call) = &self.responses {
            call.abort();
        }
    }
}

fn output<T>(o: Option<T>) -> Result<T, Status> {
    o.ok_or_else(|| Status::internal("server response has no output"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_results_and_errors() {
        let ok = StepResult::from_response(Some(ResultProto::Decode(proto::DecodeResponse::default()))).unwrap();
        assert_eq!(ok.name(), "decode");
        assert_eq!(ok.clone().into_prefill(), None);
        assert_eq!(ok.into_decode(), Some(proto::DecodeResponse::default()));

        let e = proto::StepError {
            code: tonic::Code::NotFound as i32,
            message: "unknown cache".into(),
            kind: proto::ErrorKind::NotFound as i32,
            ..Default::default()
        };
        let st = StepResult::from_response(Some(ResultProto::Error(e))).unwrap_err();
        assert_eq!(st.code(), tonic::Code::NotFound);
        assert_eq!(crate::error::error_reason(&st).as_deref(), Some("NOT_FOUND"));
        assert_eq!(StepResult::from_response(None).unwrap_err().code(), tonic::Code::Internal);
    }

    #[test]
    fn steps_take_the_session_model() {
        let mut s: Step = proto::DecodeRequest::default().into();
        default_model(&mut s, "tiny");
        assert!(matches!(&s, Step::Decode(r) if r.model_id == "tiny"));
        let mut s: Step = proto::ReleaseCacheRequest { model_id: "other".into(), ..Default::default() }.into();
        default_model(&mut s, "tiny");
        assert!(matches!(&s, Step::ReleaseCache(r) if r.model_id == "other"));
        assert_eq!(step_name(&s), "release_cache");
    }
}
