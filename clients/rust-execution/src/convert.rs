//! Wire ↔ ferrum 0.18 types: the model description (through the 0.8.8 crate's conversions, whose
//! `ModelInfo` / `ExecutorCapabilities` have the same serde shape in 0.18.4), logits policies,
//! sampling products and gRPC errors.

use ferrum_execution::model_executor::{
    ExecutorCapabilities, ExecutorMemoryUsage, ExecutorSamplingOutput, ExecutorState, ExecutorStatus,
    LogitsReturnPolicy,
};
use ferrum_remote_executor::{client::policy, convert as wire, error_reason, proto, HostTensor};
use ferrum_types::{FerrumError, ModelInfo, Result, TokenId};
use serde::{de::DeserializeOwned, Serialize};
use tonic::{Code, Status};

/// Re-read a 0.8.8 value as its 0.18.4 twin (same field names; new 0.18 fields take defaults).
fn same_shape<A: Serialize, B: DeserializeOwned>(value: &A, what: &str) -> Result<B> {
    let json = serde_json::to_value(value).map_err(|e| FerrumError::internal(format!("{what}: {e}")))?;
    serde_json::from_value(json).map_err(|e| FerrumError::internal(format!("{what} (0.8.8 → 0.18.4 shape): {e}")))
}

/// ferrum 0.18's `ModelInfo` from the contract's (the `ferrum_remote_*` metadata keys included).
pub fn model_info(m: &proto::ModelInfo) -> Result<ModelInfo> {
    same_shape(&wire::model_info_from_proto(m), "ModelInfo")
}

/// ferrum 0.18's `ExecutorCapabilities` (memory requirements without a typed sequence state).
pub fn capabilities(c: &proto::ExecutorCapabilities) -> Result<ExecutorCapabilities> {
    same_shape(&wire::capabilities_from_proto(c), "ExecutorCapabilities")
}

/// ferrum 0.18's `ExecutorStatus` from the contract's.
pub fn status(s: &proto::ExecutorStatus) -> ExecutorStatus {
    let old = wire::status_from_proto(s);
    use ferrum_remote_executor::ferrum_interfaces::model_executor::ExecutorState as Old;
    ExecutorStatus {
        state: match old.state {
            Old::Initializing => ExecutorState::Initializing,
            Old::Ready => ExecutorState::Ready,
            Old::Busy => ExecutorState::Busy,
            Old::Error => ExecutorState::Error,
            Old::Shutdown => ExecutorState::Shutdown,
        },
        is_ready: old.is_ready,
        current_batch_size: old.current_batch_size,
        prefill_operations: old.prefill_operations,
        decode_operations: old.decode_operations,
        avg_prefill_time_ms: old.avg_prefill_time_ms,
        avg_decode_time_ms: old.avg_decode_time_ms,
        memory_usage: ExecutorMemoryUsage {
            allocated_bytes: old.memory_usage.allocated_bytes,
            used_bytes: old.memory_usage.used_bytes,
            peak_bytes: old.memory_usage.peak_bytes,
            utilization_percent: old.memory_usage.utilization_percent,
        },
        last_operation: old.last_operation,
    }
}

/// ferrum 0.18's `LogitsReturnPolicy` as the contract's `LogitsPolicy`: `FullLogits` →
/// OUTPUT_MODE_FULL_LOGITS (FP32); `GreedyArgmax{token_mask, repetition_penalty}` →
/// OUTPUT_MODE_SAMPLED_TOKEN, temperature 0, the mask one byte per id, the penalty with its ids (an
/// empty penalty is not sent: empty `penalty_token_ids` means "every token in the cache").
pub fn logits_policy(p: &LogitsReturnPolicy) -> proto::LogitsPolicy {
    match p {
        LogitsReturnPolicy::FullLogits => policy::full_logits(),
        LogitsReturnPolicy::GreedyArgmax { token_mask, repetition_penalty } => {
            let mut s = proto::SamplingParams::default();
            // ferrum's engine builds a mask for every greedy request; one that allows every id is
            // sent as none (49 KB a row a step for SmolLM2 otherwise, and a masked argmax).
            if let Some(m) = token_mask.as_ref().filter(|m| m.valid_token_mask.iter().any(|&v| v == 0)) {
                s.token_mask = m.valid_token_mask.iter().map(|&v| u8::from(v != 0)).collect();
            }
            if let Some(r) = repetition_penalty.as_ref().filter(|r| !r.is_empty()) {
                s.repetition_penalty = Some(r.penalty());
                s.penalty_token_ids = r.token_ids().iter().map(|&t| t.min(i32::MAX as u32) as i32).collect();
            }
            policy::sampled(s)
        }
    }
}

/// The sampling product of a final row: the full logits row, or the greedy token.
pub fn sampling_output(p: &LogitsReturnPolicy, out: Option<&proto::LogitsOutput>) -> Result<ExecutorSamplingOutput> {
    let out = out.ok_or_else(|| FerrumError::backend("server returned no output for a final row"))?;
    match p {
        LogitsReturnPolicy::FullLogits => {
            let row = out.logits.as_ref().ok_or_else(|| FerrumError::backend("server returned no logits row"))?;
            let row = HostTensor::from_proto(row).map_err(|e| FerrumError::backend(e.to_string()))?;
            ExecutorSamplingOutput::full_logits(row.data().to_vec())
        }
        LogitsReturnPolicy::GreedyArgmax { .. } => {
            // the row's mask left no finite logit: ferrum's own answer, not an error (issue 40)
            if out.no_selectable_finite_logit {
                return Ok(ExecutorSamplingOutput::NoSelectableFiniteLogit);
            }
            let token = out.token_id.ok_or_else(|| FerrumError::backend("server returned no greedy token"))?;
            let token = u32::try_from(token).map_err(|_| FerrumError::backend(format!("negative greedy token {token}")))?;
            Ok(ExecutorSamplingOutput::greedy_token(TokenId::new(token)))
        }
    }
}

/// ferrum 0.18's error for a gRPC status: by the `google.rpc.ErrorInfo` reason (the ferrum kind the
/// server names), else by code. The server's message is kept verbatim.
pub fn error(status: &Status) -> FerrumError {
    let msg = status.message().to_string();
    let kind = error_reason(status).unwrap_or_default();
    match (kind.as_str(), status.code()) {
        ("RESOURCE_EXHAUSTED", _) | ("", Code::ResourceExhausted) => FerrumError::resource_exhausted(msg),
        ("NOT_FOUND", _) | ("", Code::NotFound) => FerrumError::not_found(msg),
        ("UNSUPPORTED", _) | ("", Code::Unimplemented) => FerrumError::unsupported(msg),
        ("REQUEST_VALIDATION", _) | ("", Code::InvalidArgument | Code::FailedPrecondition | Code::Aborted) => {
            FerrumError::request_validation(msg)
        }
        ("INVALID_PARAMETER", _) | ("", Code::OutOfRange) => FerrumError::invalid_parameter(msg),
        ("TIMEOUT", _) | ("", Code::DeadlineExceeded) => FerrumError::timeout(msg),
        ("CANCELLED", _) | ("", Code::Cancelled) => FerrumError::cancelled(msg),
        ("NETWORK" | "UNAVAILABLE", _) | ("", Code::Unavailable) => FerrumError::network(msg),
        ("PERMISSION_DENIED", _) | ("", Code::PermissionDenied) => FerrumError::permission_denied(msg),
        ("AUTH", _) | ("", Code::Unauthenticated) => FerrumError::auth(msg),
        ("MODEL", _) => FerrumError::model(msg),
        ("BACKEND", _) => FerrumError::backend(msg),
        ("DEVICE", _) => FerrumError::device(msg),
        ("CONFIG", _) => FerrumError::config(msg),
        _ => FerrumError::internal(msg),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrum_execution::model_executor::TokenSelectionMask;

    fn mask_sent(mask: Vec<i8>) -> Vec<u8> {
        let p = LogitsReturnPolicy::GreedyArgmax { token_mask: Some(TokenSelectionMask::new(mask)), repetition_penalty: None };
        logits_policy(&p).sampling.expect("sampled-token policy").token_mask
    }

    #[test]
    fn an_all_allowed_mask_is_sent_as_none_and_a_real_one_as_bytes() {
        assert!(mask_sent(vec![1; 1000]).is_empty(), "every id allowed: no mask on the wire");
        let mut m = vec![1i8; 1000];
        m[7] = 0;
        let sent = mask_sent(m);
        assert_eq!(sent.len(), 1000);
        assert_eq!((sent[6], sent[7]), (1, 0));
    }
}
