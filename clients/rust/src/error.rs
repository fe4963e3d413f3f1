//! gRPC status → `ferrum_types::FerrumError`.
//!
//! Every error the server returns carries a `google.rpc.ErrorInfo` whose `reason` is the ferrum
//! error kind (`ErrorKind` in types.proto without its prefix). The kind decides the variant; the
//! gRPC code is the fallback when a status has no ErrorInfo (e.g. errors from the transport or a
//! proxy). The server's message is kept verbatim, so text ferrum's engine parses (the paged-KV
//! admission message of RESOURCE_EXHAUSTED) survives the trip.
//!
//! A failed step on a `Session` stream comes back in band as a `StepError` with the same content;
//! [`step_error_to_status`] rebuilds the status a unary call would have failed with, so both paths
//! share one error type ([`tonic::Status`]) and one mapping.

use std::collections::HashMap;
use std::time::Duration;

use ferrum_types::FerrumError;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::proto;

/// The `google.rpc.ErrorInfo` domain of the contract's errors.
pub const ERROR_DOMAIN: &str = "ferrum.executor.v1";

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

/// The status a unary call fails with, rebuilt from a `Session` step's in-band `StepError`: the
/// same code and message, a `google.rpc.ErrorInfo` (reason = the kind without its `ERROR_KIND_`
/// prefix, metadata plus `field`), a `google.rpc.BadRequest` naming the field (INVALID_ARGUMENT,
/// OUT_OF_RANGE, FAILED_PRECONDITION) and a `google.rpc.RetryInfo` when `retry_after_ms` is set,
/// as the server builds them for unary RPCs. [`error_reason`], [`error_metadata`] and
/// [`status_to_ferrum`] then read it as they read a unary error.
pub fn step_error_to_status(e: &proto::StepError) -> Status {
    let code = Code::from(e.code);
    let mut details = ErrorDetails::new();
    let kind = proto::ErrorKind::try_from(e.kind).unwrap_or(proto::ErrorKind::Unspecified);
    if kind != proto::ErrorKind::Unspecified {
        let reason = kind.as_str_name().trim_start_matches("ERROR_KIND_");
        let mut metadata: HashMap<String, String> = e.metadata.clone();
        if !e.field.is_empty() {
            metadata.insert("field".into(), e.field.clone());
        }
        details.set_error_info(reason, ERROR_DOMAIN, metadata);
    }
    if !e.field.is_empty() && matches!(code, Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition) {
        details.add_bad_request_violation(e.field.clone(), e.message.clone());
    }
    if e.retry_after_ms > 0 {
        details.set_retry_info(Some(Duration::from_millis(e.retry_after_ms)));
    }
    let status = Status::with_error_details(code, e.message.clone(), details);
    match &e.progress {
        Some(progress) => with_step_progress(status, progress),
        None => status,
    }
}

/// `google.rpc.Status.details`' type URL of the `StepProgress` detail.
const STEP_PROGRESS_TYPE: &str = "type.googleapis.com/ferrum.executor.v1.StepProgress";

/// The `StepProgress` detail of a failed step's status (which items ran, which did not and why;
/// types.proto), when the server sent one: every forward step of this server does.
pub fn step_progress(status: &Status) -> Option<proto::StepProgress> {
    use prost::Message;
    let rpc = tonic_types::pb::Status::decode(status.details()).ok()?;
    let any = rpc.details.iter().find(|a| a.type_url.rsplit('/').next() == STEP_PROGRESS_TYPE.rsplit('/').next())?;
    proto::StepProgress::decode(any.value.as_slice()).ok()
}

/// `status` with `progress` added to its details (as a unary call carries it).
fn with_step_progress(status: Status, progress: &proto::StepProgress) -> Status {
    use prost::Message;
    let mut rpc = tonic_types::pb::Status::decode(status.details()).unwrap_or_default();
    rpc.code = status.code() as i32;
    rpc.message = status.message().to_string();
    rpc.details.push(prost_types::Any { type_url: STEP_PROGRESS_TYPE.into(), value: progress.encode_to_vec() });
    Status::with_details(status.code(), status.message(), rpc.encode_to_vec().into())
}

/// ferrum's error for a `Session` step's `StepError` (as [`status_to_ferrum`] of its status).
pub fn step_error_to_ferrum(e: &proto::StepError) -> FerrumError {
    status_to_ferrum(&step_error_to_status(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_progress_survives_the_in_band_step_error() {
        let progress = proto::StepProgress {
            items: vec![
                proto::ItemProgress { index: 0, state: proto::ItemState::NotRun as i32, tokens_ran: 0, reason: "STEP_FAILED".into() },
                proto::ItemProgress { index: 1, state: proto::ItemState::NotRun as i32, tokens_ran: 0, reason: "NOT_FOUND".into() },
            ],
        };
        let e = proto::StepError {
            code: Code::NotFound as i32,
            message: "cache gone".into(),
            kind: proto::ErrorKind::NotFound as i32,
            progress: Some(progress.clone()),
            ..Default::default()
        };
        let status = step_error_to_status(&e);
        assert_eq!(status.code(), Code::NotFound);
        assert_eq!(error_reason(&status).as_deref(), Some("NOT_FOUND"), "ErrorInfo kept beside the progress");
        assert_eq!(step_progress(&status), Some(progress));
        let bare = step_error_to_status(&proto::StepError { progress: None, ..e });
        assert_eq!(step_progress(&bare), None);
    }

    #[test]
    fn step_error_becomes_the_unary_status() {
        let e = proto::StepError {
            code: Code::NotFound as i32,
            message: "unknown cache_id 'x'".into(),
            kind: proto::ErrorKind::NotFound as i32,
            field: "input.cache_id".into(),
            metadata: [("cache_id".to_string(), "x".to_string())].into(),
            retry_after_ms: 0,
            ..Default::default()
        };
        let s = step_error_to_status(&e);
        assert_eq!(s.code(), Code::NotFound);
        assert_eq!(s.message(), "unknown cache_id 'x'");
        assert_eq!(error_reason(&s).as_deref(), Some("NOT_FOUND"));
        let md = error_metadata(&s);
        assert_eq!((md["cache_id"].as_str(), md["field"].as_str()), ("x", "input.cache_id"));
        assert_eq!(s.get_details_error_info().unwrap().domain, ERROR_DOMAIN);
        assert!(s.get_details_bad_request().is_none(), "NOT_FOUND carries no BadRequest");
        assert!(matches!(step_error_to_ferrum(&e), FerrumError::NotFound { .. }));

        let e = proto::StepError {
            code: Code::ResourceExhausted as i32,
            message: "no KV".into(),
            kind: proto::ErrorKind::ResourceExhausted as i32,
            retry_after_ms: 1500,
            ..Default::default()
        };
        let s = step_error_to_status(&e);
        assert_eq!(s.get_details_retry_info().unwrap().retry_delay, Some(Duration::from_millis(1500)));
        assert!(matches!(status_to_ferrum(&s), FerrumError::ResourceExhausted { .. }));

        let e = proto::StepError {
            code: Code::InvalidArgument as i32,
            message: "token_ids[0] out of vocab".into(),
            kind: proto::ErrorKind::InvalidParameter as i32,
            field: "input.token_ids[0]".into(),
            ..Default::default()
        };
        let s = step_error_to_status(&e);
        let br = s.get_details_bad_request().unwrap();
        assert_eq!(br.field_violations[0].field, "input.token_ids[0]");
        assert!(matches!(status_to_ferrum(&s), FerrumError::InvalidParameter { .. }), "the kind wins over the code");

        // No kind: no ErrorInfo, the code decides.
        let s = step_error_to_status(&proto::StepError { code: Code::Unavailable as i32, message: "m".into(), ..Default::default() });
        assert_eq!(error_reason(&s), None);
        assert!(matches!(status_to_ferrum(&s), FerrumError::Network { .. }));
    }

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
