//! [`SessionSteps`]: `UnifiedDecode` steps sent on one long-lived `Session` stream instead of one
//! unary call each (≈ 0.5 ms less per step on loopback: no per-call HTTP/2 stream set-up). Shared
//! by both ferrum lines' executors (`RemoteModelExecutor` here, `RemoteTokenExecutor` in
//! `clients/rust-execution`).
//!
//! One step at a time goes on the stream; a step that finds the stream busy (a concurrent caller)
//! or that would create a cache (a cache created on a `Session` belongs to it) is sent unary. A
//! stream that fails, times out or answers out of order is dropped (it owns no cache) and the next
//! step opens a new one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tonic::Status;

use crate::{proto, Client, Session};

/// The stream and how many steps went on it.
#[derive(Default)]
pub struct SessionSteps {
    /// None until the first step, and again after the stream failed.
    session: tokio::sync::Mutex<Option<Session>>,
    sent: AtomicU64,
}

impl SessionSteps {
    /// Steps sent on the stream so far (the rest went unary).
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// One `UnifiedDecode` of `items` for `client`'s model: on the stream when it is free and no
    /// item creates a cache, else unary. `timeout` bounds the wait for the stream's answer.
    pub async fn unified(
        &self,
        client: &Client,
        items: Vec<proto::UnifiedBatchItem>,
        timeout: Option<Duration>,
    ) -> Result<proto::UnifiedDecodeResponse, Status> {
        if items.iter().any(|i| i.cache_id.is_empty()) {
            return client.unified_decode_response(items).await;
        }
        let Ok(mut guard) = self.session.try_lock() else {
            return client.unified_decode_response(items).await;
        };
        // A step whose caller went away (its future dropped) left its answer on the stream: read
        // it first, so this step gets its own answer (a stream that cannot give it is replaced).
        if let Some(s) = guard.as_mut() {
            while s.in_flight() > 0 && !s.is_over() {
                let stale = match timeout {
                    Some(t) => tokio::time::timeout(t, s.recv()).await.ok(),
                    None => Some(s.recv().await),
                };
                if !matches!(stale, Some(Ok(_))) {
                    *guard = None;
                    break;
                }
            }
        }
        if guard.as_ref().is_none_or(|s| s.is_over()) {
            *guard = Some(client.session().await?);
        }
        let s = guard.as_mut().expect("opened above");
        let req = proto::UnifiedDecodeRequest { model_id: client.model_id().to_string(), items, ..Default::default() };
        let id = match s.send(req.clone()) {
            Ok(id) => id,
            Err(_) => {
                // the stream had ended before this step: it never reached the server
                *guard = None;
                drop(guard);
                return client.unified_decode_response(req.items).await;
            }
        };
        self.sent.fetch_add(1, Ordering::Relaxed);
        let answer = match timeout {
            Some(t) => tokio::time::timeout(t, s.recv()).await.map_err(|_| {
                Status::deadline_exceeded(format!("UnifiedDecode on the Session stream: no answer in {t:?}"))
            }),
            None => Ok(s.recv().await),
        };
        match answer {
            Ok(Ok((got, _))) if got != id => {
                *guard = None;
                Err(Status::internal(format!("the Session answered step {got} to step {id}")))
            }
            Ok(Ok((_, Ok(result)))) => result
                .into_unified_decode()
                .ok_or_else(|| Status::internal("the Session answered another kind of result to UnifiedDecode")),
            Ok(Ok((_, Err(step_failed)))) => Err(step_failed),
            Ok(Err(stream_failed)) => {
                *guard = None;
                Err(stream_failed)
            }
            Err(timed_out) => {
                *guard = None; // dropping the stream cancels it (it owns no cache)
                Err(timed_out)
            }
        }
    }
}
