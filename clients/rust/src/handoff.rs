//! Disaggregated prefill and decode: a prompt is computed on a prefill server, its KV cache is
//! handed to a decode server (`ImportKv`: by server pull, or pushed through this client from an
//! `ExportKv` stream), the source cache is released, and decoding goes on at the decode server.

use std::time::Instant;

use tonic::Status;

use crate::client::{Client, ImportOptions};
use crate::proto;

/// How the K/V travel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandoffMode {
    /// The decode server fetches them itself (`ImportKv` with a `source`); this client never sees the bytes.
    Pull,
    /// This client streams `ExportKv` from the source into `ImportKv` on the destination.
    Push,
}

/// A cache handed from one server to another.
#[derive(Clone, Debug)]
pub struct Handoff {
    /// The new cache, on the destination.
    pub cache: proto::KvCacheHandle,
    pub imported: proto::ImportKvResponse,
    /// The prefill's last-position output (with [`prefill_and_handoff`]).
    pub output: Option<proto::LogitsOutput>,
    /// Prompt tokens the prefill server took from its prefix cache (with [`prefill_and_handoff`]).
    pub cached_tokens: u64,
    pub handoff_ms: u128,
}

/// Move `cache_id` from `from` to `to` (both clients bound to the model), a new cache there.
/// `source_target` is `from`'s `host:port` as `to` reaches it (None = `from.target()`).
/// With `release_source` the source cache is released afterwards, whatever the outcome.
pub async fn handoff(
    from: &Client,
    to: &Client,
    cache_id: &str,
    mode: HandoffMode,
    opts: ImportOptions,
    source_target: Option<&str>,
    release_source: bool,
) -> Result<Handoff, Status> {
    let t0 = Instant::now();
    let result = match mode {
        HandoffMode::Pull => to.pull_kv(source_target.unwrap_or(from.target()), cache_id, opts).await,
        HandoffMode::Push => match from.export_kv_all(cache_id).await {
            Ok(kv) => to.import_kv(kv, opts).await,
            Err(e) => Err(e),
        },
    };
    if release_source {
        let _ = from.release_cache(cache_id).await;
    }
    let imported = result?;
    let cache = imported.cache.clone().ok_or_else(|| Status::internal("ImportKv answered without a cache"))?;
    Ok(Handoff { cache, imported, output: None, cached_tokens: 0, handoff_ms: t0.elapsed().as_millis() })
}

/// Prefill `tokens` on `prefill`, hand the cache to `decode`, release it on `prefill`.
/// `reserve_tokens`: what the sequence may grow to on the decode server.
pub async fn prefill_and_handoff(
    prefill: &Client,
    decode: &Client,
    tokens: &[i32],
    policy: Option<proto::LogitsPolicy>,
    reserve_tokens: u64,
    mode: HandoffMode,
) -> Result<Handoff, Status> {
    let out = prefill.prefill(tokens, policy).await?;
    let id = out.cache.as_ref().map(|c| c.cache_id.clone()).unwrap_or_default();
    let opts = ImportOptions { reserve_tokens: reserve_tokens.max(tokens.len() as u64), ..Default::default() };
    let mut h = handoff(prefill, decode, &id, mode, opts, None, true).await?;
    h.output = out.output;
    h.cached_tokens = out.cached_tokens;
    Ok(h)
}
