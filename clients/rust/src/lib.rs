//! # ferrum-remote-executor
//!
//! Rust client for the `ferrum.executor.v1` gRPC contract (`protos/ferrum/executor/v1/`):
//!
//! * [`Client`]: a thin typed client over the generated stub (default model, per-call
//!   deadlines, `Generate` as a `Stream`).
//! * [`Session`] ([`Client::session`]): the bidirectional `Session` RPC step by step:
//!   `step()` / typed shortcuts that send and wait, `send()` / `recv()` to pipeline, `close()`
//!   frees every cache created on the stream. A failed step is the same `tonic::Status` the unary
//!   call gives, and the session goes on.
//! * [`RemoteModelExecutor`]: **ferrum's own `ModelExecutor` trait** (crate `ferrum-interfaces`
//!   0.8.8) implemented over the RPCs, so ferrum's engine, or any code written against the trait,
//!   can drive a remote executor as if it were local.
//! * [`HostTensor`] / [`HostTensorFactory`]: `TensorLike` / `TensorFactory` over the bytes the
//!   contract carries; [`RemoteKvCacheHandle`]: `KvCacheHandle` carrying the remote `cache_id`
//!   and length.
//! * [`conformance`]: the runner of the language-neutral scenario; [`testing`]: a live server on
//!   loopback for tests.
//!
//! ## Drive it from Rust
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use ferrum_interfaces::model_executor::{DecodeInput, LogitsReturnPolicy, ModelExecutor, PrefillInput};
//! use ferrum_remote_executor::{HostTensor, RemoteExecutorOptions, RemoteModelExecutor};
//!
//! let opts = RemoteExecutorOptions { model_id: "mock".into(), ..Default::default() };
//! let exec: Box<dyn ModelExecutor> = Box::new(RemoteModelExecutor::connect("http://127.0.0.1:50051", opts).await?);
//! let out = exec.prefill(&PrefillInput::new(HostTensor::token_ids_ref(&[1, 2, 3]))).await?;
//! let greedy = LogitsReturnPolicy::GreedyArgmax { token_mask: None, repetition_penalty: None };
//! let step = DecodeInput::new(HostTensor::token_ids_ref(&[10]), out.kv_cache.clone()).with_logits_policy(greedy);
//! let next = exec.decode(&step).await?;          // logits = [1, 1] greedy sentinel: the token id
//! println!("next token {}", next.logits.to_vec_f32()?[0]);
//! exec.release_cache(&next.kv_cache.cache_id());  // sync: spawned on the runtime
//! # Ok(()) }
//! ```
//!
//! The typed client, with `Generate` as a `Stream`:
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let c = ferrum_remote_executor::Client::connect("http://127.0.0.1:50051").await?.with_model("tiny");
//! let mut events = c.generate_tokens(&[1, 100, 200], 16, None).await?;   // a Stream of events
//! while let Some(ev) = futures_util::StreamExt::next(&mut events).await { println!("{:?}", ev?.event); }
//! # Ok(()) }
//! ```
//!
//! One `Session` stream (the lowest per-step overhead; its caches are freed when it ends):
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let c = ferrum_remote_executor::Client::connect("http://127.0.0.1:50051").await?.with_model("tiny");
//! let mut s = c.session().await?;
//! let pre = s.prefill(&[1, 100, 200], None).await?;                 // greedy token, a stream-owned cache
//! let (cache, mut tok) = (pre.cache.unwrap().cache_id, pre.output.unwrap().token_id.unwrap());
//! for _ in 0..8 { tok = s.decode(&cache, tok, None).await?.output.unwrap().token_id.unwrap(); }
//! s.close().await?;                                                // the server frees `cache`
//! # Ok(()) }
//! ```
//!
//! ## Which ferrum-interfaces
//!
//! `ferrum-interfaces = "=0.8.8"`, the newest release of the 0.8 line. Its `ModelExecutor` is the
//! 43-method trait the contract mirrors (the legacy 21 methods of ferrum 0.7.7 plus the plan-runtime
//! hooks and `admission_limits`). 0.12.x adds prefix-capture methods the contract has no RPC for.
//! From 0.14 on the trait lives in the crate `ferrum-execution` and speaks a token-execution
//! protocol (`admit_tokens` / `execute_tokens` / `finish_tokens`); its 0.18.4 version is served by
//! the sibling crate `clients/rust-execution` (`RemoteTokenExecutor`). 0.8.8 builds here with lean
//! dependencies (serde, tokio, async-trait, rand; no candle, no GPU crate).
//!
//! ## Mapping
//!
//! | trait method | RPC | notes |
//! |---|---|---|
//! | `info()` | `Info` at connect | the trait returns `&ModelInfo`, so it is read once; contract-only fields go to `metadata["ferrum_remote_*"]` |
//! | `capabilities()` | `Capabilities` at connect | static while a server runs |
//! | `status()` | `Status` | the last snapshot; refreshed in the background when older than `status_refresh` (sync method) |
//! | `kv_capacity()` | `KvCapacity.per_request_tokens` at connect | |
//! | `admission_limits()` | `AdmissionLimits` at connect | |
//! | `supports_native_unified_decode()` | `Capabilities.supports_native_unified_decode` | |
//! | `reserve_kv_slots()` | `ReserveKvSlots` | sync in the trait: a blocking call (`block_in_place`) on a multi-thread runtime; `Ok(None)` on a current-thread runtime |
//! | `kv_slot_capacity_snapshot()` | `KvSlotCapacity` | snapshot from connect / the last refresh |
//! | `prefill()` | `Prefill` (FULL_LOGITS) | `[1, len]` f32 ids in; logits `[1, 1, vocab]` out (last position, as ferrum's LLM executor); a handle this crate minted is continued (chunked prefill), any other handle means a new cache; `maximum_sequence_tokens` / `ferrum_kv_capacity_hint` → `reserve_tokens`; metadata `ferrum_lora_adapter` → `adapter` (an adapter registered on the server; `ferrum_lora_path` alone is refused, as ferrum refuses it) |
//! | `batch_prefill()` | `BatchPrefill` | one call, all or nothing |
//! | `decode()` | `Decode` | `FullLogits` → FULL_LOGITS, `[1, vocab]`; `GreedyArgmax{token_mask, repetition_penalty}` → SAMPLED_TOKEN with temperature 0, the mask and the penalty, returned as ferrum's 1-element greedy sentinel `[1, 1]`; metadata `ferrum_require_full_logits` forces full rows |
//! | `batch_decode()` | `BatchDecode` | one output per input, in order, same cache ids |
//! | `unified_decode()` | `UnifiedDecode` | `Unsupported` answered locally when `Capabilities.supports_native_unified_decode` (read at connect) is false, so ferrum's engine's per-step try costs no RPC; UNIMPLEMENTED → `Unsupported` (the engine falls back); new sequences' server ids are remembered under the item's `seq_id`; metadata `ferrum_lora_adapter` → the item's `adapter` |
//! | `forward()` | `Forward` | f32 ids → INT32 on the wire |
//! | `forward_verify()` | `ForwardVerify` (no server-side acceptance) | all inputs on one cache: one call, N+1 rows, handle i at `base_len + i + 1`; mixed caches: serial decodes (the trait default) |
//! | `truncate_kv()` | `TruncateKv` | a real rollback (ferrum's default is a no-op) |
//! | `release_cache()` | `ReleaseCache` | sync and infallible in the trait: queued to the executor's release thread (its own runtime and channel, so a caller's runtime shutting down loses nothing; queued releases are sent together; dropping the executor sends what is queued; `shutdown()` waits for them). Built with `with_client` (no endpoint): spawned on the runtime the executor was connected on; later calls on that cache wait for it; `flush_releases()` / `release_cache_async()` |
//! | `cache_metrics_snapshot()` / `lora_metrics_snapshot()` | `CacheMetrics` / `LoraMetrics` | blocking call as for `reserve_kv_slots`; None on failure |
//! | `warmup()` / `shutdown()` | `Warmup` / `Shutdown` | admin RPCs |
//! | `recurrent_state_spec()`, plan-runtime hooks, `complete_cache()` | — | trait defaults (`Ok(None)`, `Unsupported`, release); the contract has no recurrent state or plan runtime |
//!
//! gRPC errors become `FerrumError` by the `google.rpc.ErrorInfo` reason (the ferrum kind the
//! server names), else by code: UNIMPLEMENTED → `Unsupported`, RESOURCE_EXHAUSTED →
//! `ResourceExhausted`, NOT_FOUND → `NotFound`, INVALID_ARGUMENT / FAILED_PRECONDITION / ABORTED →
//! `RequestValidation`, OUT_OF_RANGE → `InvalidParameter`, DEADLINE_EXCEEDED → `Timeout`,
//! UNAVAILABLE → `Network`, ... The server's message is kept verbatim. A failed `Session` step's
//! in-band `StepError` is turned back into that same status first (`step_error_to_status`).
//!
//! ## Where the trait and the contract do not meet exactly
//!
//! * **Synchronous methods.** `info`, `capabilities`, `status`, `kv_capacity`,
//!   `kv_slot_capacity_snapshot`, `admission_limits` answer from connect-time (or background
//!   refreshed) snapshots; `status()` may be up to `status_refresh` old. `reserve_kv_slots` and the
//!   metrics snapshots block a worker thread; on a current-thread runtime they cannot block and
//!   return `Ok(None)` / `None`.
//! * **`release_cache` is fire-and-forget.** Its RPC error cannot be returned (counted in
//!   `release_failures()`). Ordering is kept only for calls made through the same executor.
//! * **`truncate_kv` cannot return the new handle.** The caller's handle keeps its old
//!   `num_tokens`; the server's length is the truth, so decode does not send a position guard
//!   unless `guard_positions` is set. ferrum's engine rebuilds handles after truncation anyway.
//! * **Handle identity.** `clone_handle()` keeps the remote `cache_id` (ferrum's
//!   `GenericKvCacheHandle` renames clones, which a server would not know). Handles carry no K/V
//!   tensors (`key_cache` → `Ok(None)`), as ferrum's `GenericKvCacheHandle`.
//! * **Prefill logits** are the last position only (`[1, 1, vocab]`), as ferrum's `LlmExecutor`,
//!   not `[batch, seq, vocab]` as the trait's doc says; `PrefillInput` with batch > 1 is refused
//!   (use `batch_prefill`). Encoders return their pooled embedding as `[1, hidden]`, as ferrum's
//!   `BertModelExecutor` does.
//! * **Greedy ties.** Server-side greedy (the sentinel path) breaks ties to the lowest id; ferrum's
//!   `GreedySampler` on full rows takes the last max. Identical unless logits tie exactly.
//! * **`attention_mask` / `position_ids`** are not sent: positions follow from the server's cache
//!   (the contract's rule), masks are the server's business.
//! * **`forward_verify`** maps ferrum's N+1 `DecodeInput`s (one cache) to one request; the policy of
//!   the first input applies to every row (full rows if any input needs them).
//! * **Recurrent state** (`RecurrentStateHandle`) and the plan-runtime (vNext) API have no RPC; the
//!   trait's defaults answer.

pub mod client;
pub mod conformance;
pub mod convert;
pub mod error;
pub mod executor;
pub mod handoff;
mod id_tokenizer;
pub mod kv;
pub mod migration;
pub mod prefix_keys;
pub mod prefix_mirror;
pub mod prefix_state;
pub mod router;
pub mod session;
pub mod session_steps;
pub mod step_clock;
pub mod tensor;
pub mod testing;

/// Code generated from `protos/ferrum/executor/v1/*.proto` by `build.rs` (client stubs only).
mod release_queue;
pub mod proto {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("ferrum.executor.v1");
}

pub use client::{constraint, policy, Client, ExportedKv, GenerateOptions, GenerateResult, GenerateStream, ImportOptions};
pub use migration::{Connector, MAX_MIGRATION_HOPS};
pub use handoff::{handoff, prefill_and_handoff, Handoff, HandoffMode};
pub use prefix_mirror::{BlockEventFollower, PrefixMirror};
pub use prefix_state::PrefixStats;
pub use router::{PrefixRouter, Route};
pub use error::{error_reason, status_to_ferrum, step_error_to_status, step_progress};
pub use executor::{logits_policy_to_proto, RemoteExecutorOptions, RemoteModelExecutor, RpcCounts};
pub use kv::RemoteKvCacheHandle;
pub use session::{Session, Step, StepResult};
pub use step_clock::StepTimes;
pub use tensor::{HostTensor, HostTensorFactory};

pub use ferrum_interfaces;
pub use ferrum_types;
