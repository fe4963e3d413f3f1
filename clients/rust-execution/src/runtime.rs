//! The executor's own tokio runtime. Every RPC runs on it, so the executor works from any caller:
//! a current-thread test runtime, ferrum's engine tasks, or `ExecutorOwner`'s close thread (which
//! has no runtime at all). Dropping it never blocks (a runtime may not be dropped inside async code).

use std::future::Future;

use ferrum_types::{FerrumError, Result};
use tokio::runtime::{Handle, Runtime};

/// A small multi-thread runtime owned by one executor.
pub struct BackgroundRuntime {
    runtime: Option<Runtime>,
    handle: Handle,
}

impl BackgroundRuntime {
    /// Two worker threads named `ferrum-remote-exec`.
    pub fn new() -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("ferrum-remote-exec")
            .enable_all()
            .build()
            .map_err(|e| FerrumError::internal(format!("executor runtime: {e}")))?;
        let handle = runtime.handle().clone();
        Ok(Self { runtime: Some(runtime), handle })
    }

    /// The runtime's handle (for spawning work that must outlive its caller).
    pub fn handle(&self) -> &Handle {
        &self.handle
    }

    /// Run `fut` on this runtime and wait for it from any async context.
    pub async fn run<T: Send + 'static>(&self, fut: impl Future<Output = T> + Send + 'static) -> Result<T> {
        self.handle.spawn(fut).await.map_err(|e| FerrumError::internal(format!("executor task: {e}")))
    }

    /// Run `fut` on this runtime from synchronous code: on a thread of its own, so that it also works
    /// inside a caller's runtime (where `block_on` would panic).
    pub fn block<T: Send + 'static>(&self, fut: impl Future<Output = T> + Send + 'static) -> Result<T> {
        let handle = self.handle.clone();
        std::thread::spawn(move || handle.block_on(fut))
            .join()
            .map_err(|_| FerrumError::internal("executor blocking call panicked"))
    }
}

impl Drop for BackgroundRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}
