//! ferrum-engine 0.18.4's `tests/chunked_prefill_test.rs`, unchanged, with its executors served by a live
//! `ferrum-service` through `RemoteTokenExecutor` (see `common/upstream_shim.rs`).

#[path = "common/upstream_shim.rs"]
mod shim;

/// What the upstream file imports as `ferrum_testkit`: the real crate, its executors remote.
mod ferrum_testkit {
    #[allow(unused_imports)]
    pub use crate::shim::{ShimExecutor as ConfigurableModelExecutor, ShimExecutor as MockModelExecutor};
    pub use real_ferrum_testkit::*;
}

include!(concat!(env!("OUT_DIR"), "/upstream/chunked_prefill_test.rs"));
