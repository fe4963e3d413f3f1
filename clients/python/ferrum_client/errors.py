"""Errors of the ferrum executor contract as Python exceptions."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status


class FerrumRpcError(Exception):
    """A failed call: gRPC ``code``, ferrum ``kind`` (ErrorInfo reason), offending ``field``.

    ``kind`` is the name of ferrum's error kind ("UNSUPPORTED", "RESOURCE_EXHAUSTED",
    "NOT_FOUND", "REQUEST_VALIDATION", ...): branch on it the way ferrum's engine does (fall back
    on UNSUPPORTED, defer on RESOURCE_EXHAUSTED).
    """

    def __init__(self, code: grpc.StatusCode, message: str, kind: str = "", field: str = "",
                 metadata: dict[str, str] | None = None, retry_after_s: float | None = None,
                 progress=None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.kind = kind
        self.field = field
        self.metadata = metadata or {}
        self.retry_after_s = retry_after_s
        #: A failed step's ``StepProgress`` detail (which items ran), or None.
        self.progress = progress

    @property
    def unsupported_shape(self) -> bool:
        """UNIMPLEMENTED because the model cannot run this mix of rows as one step (ErrorInfo
        metadata ``reason=UNSUPPORTED_SHAPE``): run the rows as BatchPrefill + BatchDecode."""
        return self.kind == "UNSUPPORTED" and self.metadata.get("reason") == "UNSUPPORTED_SHAPE"

    @classmethod
    def from_rpc_error(cls, e: grpc.RpcError) -> "FerrumRpcError":
        code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
        message = e.details() if hasattr(e, "details") else str(e)
        kind, field, meta, retry = "", "", {}, None
        try:
            st = rpc_status.from_call(e)  # type: ignore[arg-type]
        except Exception:  # noqa: BLE001 - not every error carries details
            st = None
        if st is not None:
            for d in st.details:
                if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    d.Unpack(info)
                    kind = info.reason
                    meta = dict(info.metadata)
                    field = meta.get("field", "")
                elif d.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                    ri = error_details_pb2.RetryInfo()
                    d.Unpack(ri)
                    retry = ri.retry_delay.seconds + ri.retry_delay.nanos / 1e9
        return cls(code, message or "", kind, field, meta, retry, step_progress(e))

    @classmethod
    def from_step_error(cls, err) -> "FerrumRpcError":
        """From a ``StepError`` (a failed step on a Session stream)."""
        from ._proto.ferrum.executor.v1 import types_pb2

        code = next((c for c in grpc.StatusCode if c.value[0] == err.code), grpc.StatusCode.UNKNOWN)
        kind = types_pb2.ErrorKind.Name(err.kind).removeprefix("ERROR_KIND_") if err.kind else ""
        return cls(code, err.message, kind, err.field, dict(err.metadata),
                   err.retry_after_ms / 1000 if err.retry_after_ms else None,
                   err.progress if err.HasField("progress") else None)


def step_progress(e: grpc.RpcError):
    """The ``StepProgress`` detail of a failed step call (which items ran, which did not and why),
    or None when the status carries none (not a step, or a server older than the detail)."""
    from ._proto.ferrum.executor.v1 import types_pb2

    try:
        st = rpc_status.from_call(e)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - not every error carries details
        return None
    for d in st.details if st is not None else ():
        if d.Is(types_pb2.StepProgress.DESCRIPTOR):
            progress = types_pb2.StepProgress()
            d.Unpack(progress)
            return progress
    return None
