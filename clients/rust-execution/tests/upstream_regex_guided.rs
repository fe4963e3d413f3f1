//! ferrum-engine 0.18.4's `tests/regex_guided_test.rs`, unchanged, with its executors served by a live
//! `ferrum-service` through `RemoteTokenExecutor` (see `common/upstream_shim.rs`).

#[path = "common/upstream_shim.rs"]
#[macro_use]
mod shim;

upstream_test!("regex_guided_test.rs");
