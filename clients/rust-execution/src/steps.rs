//! `execute_tokens`: one call, one RPC.
//!
//! * A model with native unified decode: one `UnifiedDecode` (prompt chunks and decode tokens
//!   mixed), a step of the executor's `Session` stream when every row has a cache (the default,
//!   `RemoteTokenOptions::session_steps`), else unary.
//! * Otherwise: all prompt chunks → one `BatchPrefill`, all decode tokens → one `BatchDecode`; a
//!   mixed batch is `NotSubmitted(UnsupportedShape)` without an RPC (ferrum's engine splits it).
//!
//! A failed step's status carries the server's `StepProgress` detail (per row: `NOT_RUN`, `RAN`,
//! `RAN_PARTIAL` with the tokens that ran): a row that did not run stays retryable at its frontier;
//! a row that ran (wholly or partly) has no product to report, so its incarnation is closed through
//! a `Held` observer that releases its cache, with the executed range it is known to have run.
//! Without the detail (an older server, a malformed reply, a transport failure) the executor reads
//! the server's caches instead (`ListCaches`): a row whose cache still holds the expected frontier
//! did not run; any other row's progress is unknown.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use ferrum_execution::model_executor::ExecutorExecutionDeferral;
use ferrum_execution::token_execution::{
    ContinuationDisposition, ExecutedTokenWork, ExecutionBatch, ExecutionBatchOutcome, ExecutionCompletion,
    ExecutionFrontier, ExecutionInterruptionCause, ExecutionProduct, ExecutionProgress, ExecutionTerminalOutcome,
    ExecutionRange, ExecutionWork, LastKnownExecutionStage, NoSubmissionReason, NoSubmissionStage, TokenWork,
};
use ferrum_remote_executor::proto;
use ferrum_types::{FerrumError, Result};
use tonic::{Code, Status};

use crate::convert;
use crate::executor::{st, RemoteTokenExecutor};

/// One row as sent: its cache (None = a new cache), tokens, position and finality.
struct Row {
    cache_id: Option<String>,
    tokens: Vec<i32>,
    position: usize,
    is_final: bool,
    adapter: Option<String>,
    maximum: usize,
    request_id: String,
}

/// What came back for one row: its cache and, for a final row, the output.
struct RowResult {
    cache: proto::KvCacheHandle,
    output: Option<proto::LogitsOutput>,
}

/// One step's RPC, run on the executor's runtime.
type RowCall = std::pin::Pin<Box<dyn std::future::Future<Output = std::result::Result<Vec<RowResult>, Status>> + Send>>;

/// What a failed step did to one row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RowRan {
    /// Nothing: its cache (if any) is as before the call.
    Not,
    /// Its first `n` tokens are in its cache (n ≥ 1).
    Tokens(usize),
    /// Unknown.
    Unknown,
}

/// Each row's share of the failure from the status's `StepProgress` detail; None when there is
/// none or it does not describe exactly these rows (then the caches are read instead).
fn from_detail(status: &Status, rows: usize) -> Option<Vec<RowRan>> {
    let progress = ferrum_remote_executor::step_progress(status)?;
    let mut ran = vec![None; rows];
    for item in progress.items {
        let slot = ran.get_mut(item.index as usize)?;
        *slot = Some(match proto::ItemState::try_from(item.state).ok()? {
            proto::ItemState::NotRun => RowRan::Not,
            proto::ItemState::Ran | proto::ItemState::RanPartial if item.tokens_ran > 0 => RowRan::Tokens(item.tokens_ran as usize),
            _ => RowRan::Unknown,
        });
    }
    ran.into_iter().collect()
}

fn is_prefill(w: &ExecutionWork<'_>) -> bool {
    matches!(w.work(), TokenWork::Prefill(_))
}

impl RemoteTokenExecutor {
    /// Check every row against this executor's books and build what the RPC sends. A bare error
    /// here is allowed: nothing was submitted.
    fn rows(&self, work: &[ExecutionWork<'_>]) -> Result<Vec<Row>> {
        let entries = self.entries.lock().unwrap();
        work.iter()
            .map(|w| {
                let e = entries
                    .get(w.sequence())
                    .ok_or_else(|| FerrumError::request_validation("execute_tokens: not a live incarnation of this executor"))?;
                let range = w.work().range()?;
                if &e.frontier != w.expected_frontier() {
                    return Err(FerrumError::request_validation(format!(
                        "stale frontier: the sequence is at {} tokens, the work expects {}",
                        e.frontier.consumed_tokens(),
                        w.expected_frontier().consumed_tokens()
                    )));
                }
                if range.end() > e.maximum {
                    return Err(FerrumError::request_validation("work runs past the admitted maximum_sequence_tokens"));
                }
                let (tokens, is_final) = match w.work() {
                    TokenWork::Prefill(c) if c.total_prompt_tokens() == e.prompt.len() => {
                        (e.prompt[c.range()].iter().map(|t| t.get() as i32).collect(), c.is_final())
                    }
                    TokenWork::Decode { token, position } if position >= e.prompt.len() => (vec![token.get() as i32], true),
                    _ => return Err(FerrumError::request_validation("work does not match the admitted prompt")),
                };
                Ok(Row {
                    cache_id: e.cache_id.clone(),
                    tokens,
                    position: range.start(),
                    is_final,
                    adapter: e.adapter.clone().filter(|_| e.cache_id.is_none()),
                    maximum: e.maximum,
                    request_id: e.request.to_string(),
                })
            })
            .collect()
    }

    /// Send prompt chunks (or, on a unified model, any rows) in one RPC; one result per row, in order.
    async fn send(&self, rows: &[Row], policies: Vec<proto::LogitsPolicy>, unified: bool) -> Result<std::result::Result<Vec<RowResult>, Status>> {
        let client = self.client.clone();
        let call: RowCall = if unified {
            self.counters.unified_decode.fetch_add(1, Ordering::Relaxed);
            let items = rows
                .iter()
                .zip(policies)
                .enumerate()
                .map(|(i, (r, p))| proto::UnifiedBatchItem {
                    seq_id: i.to_string(),
                    q_tokens: r.tokens.clone(),
                    cache_id: r.cache_id.clone().unwrap_or_default(),
                    pos_offset: r.position as u64,
                    is_final_chunk: r.is_final,
                    logits: Some(p),
                    adapter: r.adapter.clone().unwrap_or_default(),
                    ..Default::default()
                })
                .collect();
            let (session, timeout) = (self.session.clone(), self.timeout);
            Box::pin(async move {
                let out = match session {
                    Some(s) => s.unified(&client, items, timeout).await?.results,
                    None => client.unified_decode(items).await?,
                };
                Ok(out.into_iter().map(|r| RowResult { cache: r.cache.unwrap_or_default(), output: r.output }).collect())
            })
        } else {
            self.counters.batch_prefill.fetch_add(1, Ordering::Relaxed);
            let inputs = rows
                .iter()
                .zip(policies)
                .map(|(r, p)| proto::PrefillInput {
                    token_ids: r.tokens.clone(),
                    cache_id: r.cache_id.clone().unwrap_or_default(),
                    // A non-final chunk's output is thrown away: ask for the cheapest one.
                    logits: Some(if r.is_final { p } else { ferrum_remote_executor::client::policy::greedy() }),
                    reserve_tokens: if r.cache_id.is_none() { r.maximum as u64 } else { 0 },
                    request_id: r.request_id.clone(),
                    adapter: r.adapter.clone().unwrap_or_default(),
                    ..Default::default()
                })
                .collect();
            Box::pin(async move {
                let out = client.batch_prefill(inputs).await?;
                Ok(out.into_iter().map(|o| RowResult { cache: o.cache.unwrap_or_default(), output: o.output }).collect())
            })
        };
        self.rt.run(call).await
    }

    async fn send_decode(&self, rows: &[Row], policies: Vec<proto::LogitsPolicy>) -> Result<std::result::Result<Vec<RowResult>, Status>> {
        self.counters.batch_decode.fetch_add(1, Ordering::Relaxed);
        let client = self.client.clone();
        let inputs: Vec<proto::DecodeInput> = rows
            .iter()
            .zip(policies)
            .map(|(r, p)| proto::DecodeInput {
                cache_id: r.cache_id.clone().unwrap_or_default(),
                token_id: r.tokens[0],
                logits: Some(p),
                position: Some(r.position as u64),
                ..Default::default()
            })
            .collect();
        self.rt
            .run(async move {
                let out = client.batch_decode(inputs).await?;
                Ok(out.into_iter().map(|o| RowResult { cache: o.cache.unwrap_or_default(), output: o.output }).collect())
            })
            .await
    }

    pub(crate) async fn execute(&self, work: &[ExecutionWork<'_>]) -> Result<ExecutionBatchOutcome> {
        let batch = self.issuer.batch(work, self.info_vocab())?;
        let rows = self.rows(work)?;
        let unified = self.remote_caps.supports_native_unified_decode;
        let prefills = work.iter().filter(|w| is_prefill(w)).count();
        if !unified && prefills != 0 && prefills != work.len() {
            self.counters.unsupported_shape.fetch_add(1, Ordering::Relaxed);
            return Ok(batch.not_submitted(NoSubmissionReason::UnsupportedShape));
        }
        let policies: Vec<proto::LogitsPolicy> = work.iter().map(|w| convert::logits_policy(w.logits_policy())).collect();
        let sent = if unified || prefills == work.len() {
            self.send(&rows, policies, unified).await?
        } else {
            self.send_decode(&rows, policies).await?
        };
        match sent {
            Ok(results) if results.len() == work.len() => self.completed(&batch, work, &rows, results).await,
            Ok(results) => {
                let e = FerrumError::backend(format!("server returned {} results for {} rows", results.len(), work.len()));
                self.failed(&batch, work, &rows, e, None).await
            }
            Err(status) => self.failed(&batch, work, &rows, st(status.clone()), Some(status)).await,
        }
    }

    fn info_vocab(&self) -> usize {
        ferrum_execution::ModelExecutor::info(self).vocab_size
    }

    /// Every row ran: its product, the caches and frontiers advanced in the books.
    async fn completed(
        &self,
        batch: &ExecutionBatch<'_>,
        work: &[ExecutionWork<'_>],
        rows: &[Row],
        results: Vec<RowResult>,
    ) -> Result<ExecutionBatchOutcome> {
        let mut completions: Vec<ExecutionCompletion> = Vec::with_capacity(work.len());
        for (i, (w, res)) in work.iter().zip(results).enumerate() {
            let range = w.work().range()?;
            if res.cache.num_tokens as usize != range.end() || res.cache.cache_id.is_empty() {
                let e = FerrumError::backend(format!(
                    "row {i}: the server's cache holds {} tokens, the step should have left {}",
                    res.cache.num_tokens,
                    range.end()
                ));
                return self.failed(batch, work, rows, e, None).await;
            }
            let (executed, product) = match w.work() {
                TokenWork::Prefill(chunk) if !chunk.is_final() => {
                    (ExecutedTokenWork::Prefill { chunk, capacity_probe_count: 0 }, ExecutionProduct::Intermediate)
                }
                TokenWork::Prefill(chunk) => (
                    ExecutedTokenWork::Prefill { chunk, capacity_probe_count: 0 },
                    ExecutionProduct::Sampling(convert::sampling_output(w.logits_policy(), res.output.as_ref())?),
                ),
                TokenWork::Decode { position, .. } => (
                    ExecutedTokenWork::Decode { position },
                    ExecutionProduct::Sampling(convert::sampling_output(w.logits_policy(), res.output.as_ref())?),
                ),
            };
            if rows[i].cache_id.is_none() {
                self.created.lock().unwrap().push(res.cache.cache_id.clone());
            }
            match batch.completion(i, executed, product) {
                Ok(c) => {
                    let mut entries = self.entries.lock().unwrap();
                    if let Some(e) = entries.get_mut(w.sequence()) {
                        e.frontier = c.next_frontier().clone();
                        e.cache_id = Some(res.cache.cache_id.clone());
                    }
                    completions.push(c);
                }
                Err(rejected) => return Ok(rejected.into_outcome((completions, Vec::new(), Vec::new()))),
            }
            let counter = if is_prefill(w) { &self.counters.prefill_rows } else { &self.counters.decode_rows };
            counter.fetch_add(1, Ordering::Relaxed);
        }
        Ok(batch.completed(completions).unwrap_or_else(|rejected| rejected.into_outcome()))
    }

    /// What each row did, read from the server's caches (the failure carried no `StepProgress`).
    async fn from_probe(&self, rows: &[Row], status: Option<&Status>) -> Vec<RowRan> {
        // A status the server produced (it carries ErrorInfo) for a row without a cache yet:
        // BatchPrefill / UnifiedDecode create no cache when they fail.
        let answered = status.is_some_and(|s| ferrum_remote_executor::error_reason(s).is_some());
        let lengths = self.probe(rows).await;
        rows.iter()
            .zip(&lengths)
            .map(|(r, len)| match (len, &r.cache_id) {
                (Some(n), _) if *n == r.position as u64 => RowRan::Not,
                (None, None) if answered => RowRan::Not,
                _ => RowRan::Unknown,
            })
            .collect()
    }

    /// The cache length of each row's cache on the server now (None: unknown).
    async fn probe(&self, rows: &[Row]) -> Vec<Option<u64>> {
        self.counters.list_caches.fetch_add(1, Ordering::Relaxed);
        let client = self.client.clone();
        let listed = self.rt.run(async move { client.list_caches().await }).await;
        let lengths: Option<HashMap<String, u64>> = match listed {
            Ok(Ok(l)) => Some(l.caches.into_iter().map(|c| (c.cache_id, c.num_tokens)).collect()),
            _ => None,
        };
        rows.iter()
            .map(|r| {
                let (lengths, id) = (lengths.as_ref()?, r.cache_id.as_ref()?);
                // A cache no longer listed was dropped by the server: not at its frontier.
                Some(lengths.get(id).copied().unwrap_or(u64::MAX))
            })
            .collect()
    }

    /// The step failed (or came back malformed). Rows that provably did not run stay retryable at
    /// their frontier; the others are closed.
    async fn failed(
        &self,
        batch: &ExecutionBatch<'_>,
        work: &[ExecutionWork<'_>],
        rows: &[Row],
        error: FerrumError,
        status: Option<Status>,
    ) -> Result<ExecutionBatchOutcome> {
        let ran: Vec<RowRan> = match status.as_ref().and_then(|s| from_detail(s, rows.len())) {
            Some(ran) => ran,
            None => self.from_probe(rows, status.as_ref()).await,
        };
        let untouched: Vec<bool> = ran.iter().map(|r| matches!(r, RowRan::Not)).collect();
        if status.is_some() && untouched.iter().all(|&u| u) {
            return Ok(batch.not_submitted(self.no_submission(status.as_ref().unwrap(), rows, error).await));
        }
        let mut remaining = Vec::with_capacity(work.len());
        for (i, w) in work.iter().enumerate() {
            let participant = if untouched[i] {
                let progress = ExecutionProgress::NotSubmitted { stage: NoSubmissionStage::DefinitelyNotEnqueued };
                batch.participant(i, progress, ContinuationDisposition::Retryable(w.expected_frontier().clone()), 0)
            } else {
                let known = match ran[i] {
                    // Within the planned range only (a longer claim is not trusted).
                    RowRan::Tokens(n) if n <= rows[i].tokens.len() => ExecutionRange::new(rows[i].position, n).ok(),
                    _ => None,
                };
                let last_known = if known.is_some() { LastKnownExecutionStage::ModelTerminal } else { LastKnownExecutionStage::Submitted };
                let progress = ExecutionProgress::Unknown { last_known, known_executed_range: known };
                batch.participant(i, progress, ContinuationDisposition::Held(self.close_unknown(w.expected_frontier())?), 0)
            };
            match participant {
                Ok(p) => remaining.push(p),
                Err(rejected) => return Ok(rejected.into_outcome((Vec::new(), remaining, vec![error.into()]))),
            }
        }
        Ok(batch
            .interrupted(Vec::new(), remaining, vec![ExecutionInterruptionCause::Error(error)])
            .unwrap_or_else(|rejected| rejected.into_outcome()))
    }

    /// Why nothing ran: a real block shortfall is a deferral; anything else a rejection.
    async fn no_submission(&self, status: &Status, rows: &[Row], error: FerrumError) -> NoSubmissionReason {
        if status.code() == Code::ResourceExhausted {
            let tokens: usize = rows.iter().map(|r| r.tokens.len()).sum();
            if let Some(d) = self.capacity_deferral(tokens).await {
                return NoSubmissionReason::Deferred(ExecutorExecutionDeferral::AllocatorCapacity(d));
            }
        }
        NoSubmissionReason::Rejected(error)
    }

    /// An incarnation whose step may or may not have run: forget it, release its cache, and end it
    /// once the server has freed the cache.
    fn close_unknown(&self, frontier: &ExecutionFrontier) -> Result<ferrum_execution::token_execution::ExecutionHeld> {
        let sequence = frontier.sequence().clone();
        let entry = self.entries.lock().unwrap().remove(&sequence);
        let release = entry.and_then(|e| e.cache_id).map(|id| self.spawn_release(id));
        let issuer = self.issuer.clone();
        let seq = sequence.clone();
        self.issuer.held(self.issuer.recovery_key(&sequence)?, async move {
            let released = match release {
                Some(r) => r.await.unwrap_or_else(|e| Err(FerrumError::internal(e.to_string()))),
                None => Ok(()),
            };
            let outcome = ExecutionTerminalOutcome::ended(issuer.ended(&seq)?);
            Ok(match released {
                Ok(()) => outcome,
                Err(e) => outcome.with_error(e),
            })
        })
    }
}
