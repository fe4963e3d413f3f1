"""ferrum's error kinds, and how they travel as gRPC statuses.

Executors raise :class:`FerrumError` (or one of its helpers below); the gRPC layer turns it into a
status with a ``google.rpc.ErrorInfo`` detail (and ``RetryInfo`` / ``BadRequest`` where they
apply). The mapping is the table in ``protos/ferrum/executor/v1/types.proto`` (``ErrorKind``).
"""

from __future__ import annotations

import enum

import grpc


class ErrorKind(enum.Enum):
    """Mirrors ``ferrum_types::FerrumError``'s variants (plus UNAVAILABLE)."""

    CONFIG = 1
    MODEL = 2
    TOKENIZER = 3
    BACKEND = 4
    DEVICE = 5
    SCHEDULER = 6
    REQUEST_VALIDATION = 7
    RESOURCE_EXHAUSTED = 8
    TIMEOUT = 9
    AUTH = 10
    RATE_LIMIT = 11
    IO = 12
    SERIALIZATION = 13
    NETWORK = 14
    INTERNAL = 15
    CANCELLED = 16
    NOT_FOUND = 17
    ALREADY_EXISTS = 18
    PERMISSION_DENIED = 19
    UNSUPPORTED = 20
    INVALID_FORMAT = 21
    INVALID_PARAMETER = 22
    UNAVAILABLE = 23


_DEFAULT_CODE = {
    ErrorKind.CONFIG: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.MODEL: grpc.StatusCode.INTERNAL,
    ErrorKind.TOKENIZER: grpc.StatusCode.INTERNAL,
    ErrorKind.BACKEND: grpc.StatusCode.INTERNAL,
    ErrorKind.DEVICE: grpc.StatusCode.INTERNAL,
    ErrorKind.SCHEDULER: grpc.StatusCode.INTERNAL,
    ErrorKind.REQUEST_VALIDATION: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.AUTH: grpc.StatusCode.UNAUTHENTICATED,
    ErrorKind.RATE_LIMIT: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.IO: grpc.StatusCode.INTERNAL,
    ErrorKind.SERIALIZATION: grpc.StatusCode.INTERNAL,
    ErrorKind.NETWORK: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorKind.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorKind.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorKind.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorKind.INVALID_FORMAT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.INVALID_PARAMETER: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}

ERROR_DOMAIN = "ferrum.executor.v1"


class FerrumError(Exception):
    """An error with a ferrum kind, a gRPC code, and the field at fault.

    ``code`` defaults from ``kind`` (see the table in types.proto); pass it to refine, e.g.
    OUT_OF_RANGE for a length past a cache's end.
    """

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        code: grpc.StatusCode | None = None,
        field: str = "",
        metadata: dict[str, str] | None = None,
        retry_after_ms: int = 0,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.code = code or _DEFAULT_CODE[kind]
        self.field = field
        self.metadata = {k: str(v) for k, v in (metadata or {}).items()}
        self.retry_after_ms = retry_after_ms
        #: What a failed step did to each of its items (``core/progress.py``), when known.
        self.progress = None
        #: Raised after a step's forward committed its rows (their tokens are in their caches).
        self.committed = False

    def __repr__(self) -> str:
        return f"FerrumError({self.kind.name}, {self.code.name}, {self.message!r}, field={self.field!r})"


def invalid(message: str, field: str = "", **metadata: object) -> FerrumError:
    """A malformed request (INVALID_ARGUMENT)."""
    return FerrumError(ErrorKind.REQUEST_VALIDATION, message, field=field, metadata=metadata)


def out_of_range(message: str, field: str = "", **metadata: object) -> FerrumError:
    """A length or position past what a cache holds (OUT_OF_RANGE)."""
    return FerrumError(
        ErrorKind.INVALID_PARAMETER, message, code=grpc.StatusCode.OUT_OF_RANGE, field=field, metadata=metadata
    )


def failed_precondition(message: str, field: str = "", **metadata: object) -> FerrumError:
    """A well-formed request that the current state forbids (FAILED_PRECONDITION)."""
    return FerrumError(
        ErrorKind.REQUEST_VALIDATION,
        message,
        code=grpc.StatusCode.FAILED_PRECONDITION,
        field=field,
        metadata=metadata,
    )


def not_found(message: str, field: str = "", **metadata: object) -> FerrumError:
    return FerrumError(ErrorKind.NOT_FOUND, message, field=field, metadata=metadata)


def permission_denied(message: str, **metadata: object) -> FerrumError:
    """The caller may not do this (PERMISSION_DENIED)."""
    return FerrumError(ErrorKind.PERMISSION_DENIED, message, metadata=metadata)


def unsupported(message: str, field: str = "", **metadata: object) -> FerrumError:
    """ferrum's ``Unsupported``: the caller should fall back to another method (UNIMPLEMENTED)."""
    return FerrumError(ErrorKind.UNSUPPORTED, message, field=field, metadata=metadata)


def unsupported_shape(message: str, field: str = "", **metadata: object) -> FerrumError:
    """A step whose mix of rows the model cannot run as one forward: UNIMPLEMENTED, ErrorInfo
    reason ``UNSUPPORTED`` (so clients that fall back on it still do) refined by the metadata
    ``reason=UNSUPPORTED_SHAPE``; the same rows run as separate prefill / decode steps."""
    return FerrumError(ErrorKind.UNSUPPORTED, message, field=field, metadata={**metadata, "reason": "UNSUPPORTED_SHAPE"})


def exhausted(message: str, retry_after_ms: int = 100, field: str = "", **metadata: object) -> FerrumError:
    """ferrum's ``ResourceExhausted``: defer or preempt, don't fail (RESOURCE_EXHAUSTED)."""
    return FerrumError(
        ErrorKind.RESOURCE_EXHAUSTED, message, field=field, metadata=metadata, retry_after_ms=retry_after_ms
    )


def busy(message: str, field: str = "", **metadata: object) -> FerrumError:
    """Another step holds the cache (ABORTED: retry after it finishes)."""
    return FerrumError(
        ErrorKind.REQUEST_VALIDATION, message, code=grpc.StatusCode.ABORTED, field=field, metadata=metadata
    )


def unavailable(message: str, **metadata: object) -> FerrumError:
    """The executor is shut down or the server is draining (UNAVAILABLE)."""
    return FerrumError(ErrorKind.UNAVAILABLE, message, metadata=metadata, retry_after_ms=1000)
