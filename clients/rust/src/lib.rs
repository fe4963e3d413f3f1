//! ferrum-remote-executor (docs are filled in below).

pub mod client;
pub mod convert;
pub mod error;
pub mod executor;
pub mod kv;
pub mod tensor;
pub mod testing;
pub mod conformance;

/// Code generated from `protos/ferrum/executor/v1/*.proto` (client stubs only).
pub mod proto {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("ferrum.executor.v1");
}

pub use client::{policy, Client, GenerateStream};
pub use error::{error_reason, status_to_ferrum};
pub use executor::{logits_policy_to_proto, RemoteExecutorOptions, RemoteModelExecutor};
pub use kv::RemoteKvCacheHandle;
pub use tensor::{HostTensor, HostTensorFactory};

pub use ferrum_interfaces;
pub use ferrum_types;
