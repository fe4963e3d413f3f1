//! gRPC status → `ferrum_types::FerrumError`.
//!
//! Every error the server returns carries a `google.rpc.ErrorInfo` whose `reason` is the ferrum
//! error kind (`ErrorKind` in types.proto without its prefix). The kind decides the variant; the
//! gRPC code is the fallback when a status has no ErrorInfo (e.g. errors from the transport or a
//! proxy). The server's message is kept verbatim, so text ferrum's engine parses (the paged-KV
//! admission message of RESOURCE_EXHAUSTED) survives the trip.

use ferrum_types::FerrumError;
use tonic::{Code, Status};
use tonic_types::StatusExt;

/// The `google.rpc.ErrorInfo` reason of a status (`"NOT_FOUND"`, `"REQUEST_VALIDATION"`, ...).
pub fn error_reason(status: &Status) -> Option<String> {
    status.get_details_error_info().map(|i| i.reason)
}

/// The `google.rpc.ErrorInfo` metadata of a status (e.g. `cache_id`, `vocab_size`).
pub fn error_metadata(status: &Status) -> std::collections::HashMap<String, String> {
    status.get_details_error_info().map(|i| i.metadata).unwrap_or_default()
}

/// Map a ferrum kind name (ErrorInfo reason) to the variant.
fn from_kind(kind: &str, msg: String) -> Option<FerrumError> {
    Some(match kind {
        "CONFIG" => FerrumError::config(msg),
        "MODEL" => FerrumError::model(msg),
        "TOKENIZER" => FerrumError::tokenizer(msg),
        "BACKEND" => FerrumError::backend(msg),
        "DEVICE" => FerrumError::device(msg),
        "SCHEDULER" => FerrumError::scheduler(msg),
        "REQUEST_VALIDATION" => FerrumError::request_validation(msg),
        "RESOURCE_EXHAUSTED" => FerrumError::resource_exhausted(msg),
        "TIMEOUT" => FerrumError::timeout(msg),
        "AUTH" => FerrumError::auth(msg),
        "RATE_LIMIT" => FerrumError::rate_limit(msg),
        "IO" => FerrumError::io(msg),
        "SERIALIZATION" => FerrumError::serialization(msg),
        "NETWORK" | "UNAVAILABLE" => FerrumError::network(msg),
        "INTERNAL" => FerrumError::internal(msg),
        "CANCELLED" => FerrumError::cancelled(msg),
        "NOT_FOUND" => FerrumError::not_found(msg),
        "ALREADY_EXISTS" => FerrumError::already_exists(msg),
        "PERMISSION_DENIED" => FerrumError::permission_denied(msg),
        "UNSUPPORTED" => FerrumError::unsupported(msg),
        "INVALID_FORMAT" => FerrumError::invalid_format(msg),
        "INVALID_PARAMETER" => FerrumError::invalid_parameter(msg),
        _ => return None,
    })
}

/// The variant a bare gRPC code stands for (no ErrorInfo).
fn from_code(code: Code, msg: String) -> FerrumError {
    match code {
        Code::Unimplemented => FerrumError::unsupported(msg),
        Code::ResourceExhausted => FerrumError::resource_exhausted(msg),
        Code::NotFound => FerrumError::not_found(msg),
        Code::InvalidArgument | Code::FailedPrecondition | Code::Aborted => FerrumError::request_validation(msg),
        Code::OutOfRange => FerrumError::invalid_parameter(msg),
        Code::DeadlineExceeded => FerrumError::timeout(msg),
        Code::Unauthenticated => FerrumError::auth(msg),
        Code::PermissionDenied => FerrumError::permission_denied(msg),
        Code::AlreadyExists => FerrumError::already_exists(msg),
        Code::Cancelled => FerrumError::cancelled(msg),
        Code::Unavailable => FerrumError::network(msg),
        Code::Ok | Code::Unknown | Code::Internal | Code::DataLoss => FerrumError::internal(msg),
    }
}

/// Map a gRPC status to ferrum's error: by ErrorInfo reason first, by code otherwise.
pub fn status_to_ferrum(status: &Status) -> FerrumError {
    let msg = status.message().to_string();
    if let Some(kind) = error_reason(status) {
        if let Some(e) = from_kind(&kind, msg.clone()) {
            return e;
        }
    }
    from_code(status.code(), msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_map_without_details() {
        let k = |c| match status_to_ferrum(&Status::new(c, "m")) {
            FerrumError::Unsupported { .. } => "Unsupported",
            FerrumError::ResourceExhausted { .. } => "ResourceExhausted",
            FerrumError::NotFound { .. } => "NotFound",
            FerrumError::RequestValidation { .. } => "RequestValidation",
            FerrumError::InvalidParameter { .. } => "InvalidParameter",
            FerrumError::Network { .. } => "Network",
            _ => "other",
        };
        assert_eq!(k(Code::Unimplemented), "Unsupported");
        assert_eq!(k(Code::ResourceExhausted), "ResourceExhausted");
        assert_eq!(k(Code::NotFound), "NotFound");
        assert_eq!(k(Code::InvalidArgument), "RequestValidation");
        assert_eq!(k(Code::OutOfRange), "InvalidParameter");
        assert_eq!(k(Code::Unavailable), "Network");
    }

    #[test]
    fn reason_wins_over_code() {
        let s = Status::with_error_details(
            Code::InvalidArgument,
            "bad position",
            tonic_types::ErrorDetails::with_error_info("INVALID_PARAMETER", "ferrum.executor.v1", []),
        );
        assert!(matches!(status_to_ferrum(&s), FerrumError::InvalidParameter { .. }));
        assert_eq!(error_reason(&s).as_deref(), Some("INVALID_PARAMETER"));
    }
}
