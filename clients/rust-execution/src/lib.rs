//! # ferrum-remote-execution
//!
//! ferrum-execution 0.18's `ModelExecutor` (the token-execution protocol: `admit_tokens`,
//! `execute_tokens`, `finish_tokens`, `cancel_tokens`, `begin_shutdown`) implemented over the
//! `ferrum.executor.v1` contract: [`RemoteTokenExecutor`]. The 0.8.8 line (`ferrum-interfaces`
//! 0.8.8's 43-method trait) is `ferrum-remote-executor` in `clients/rust`; this crate reuses its
//! typed client, generated stubs and test server. The mapping table is in `README.md`.

pub mod convert;
pub mod executor;
pub mod id_tokenizer;
pub mod runtime;
mod steps;

pub use executor::{RemoteTokenExecutor, RemoteTokenOptions, TokenCounters, TokenObservation};
pub use ferrum_execution;
pub use ferrum_remote_executor::{proto, testing, Client};
