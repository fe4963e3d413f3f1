package ferrum

import (
	"errors"
	"fmt"
	"time"

	pb "github.com/ferrum-service/ferrum-service/clients/go/gen/ferrum/executor/v1"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// ErrorDomain is the google.rpc.ErrorInfo domain of every error the server returns.
const ErrorDomain = "ferrum.executor.v1"

// Error is a failed call: its gRPC code, ferrum's error kind (the ErrorInfo reason, e.g.
// "UNSUPPORTED", "RESOURCE_EXHAUSTED", "REQUEST_VALIDATION", "NOT_FOUND"), the offending field and
// the server's extra facts. Branch on Kind the way ferrum's engine does: fall back on UNSUPPORTED,
// defer on RESOURCE_EXHAUSTED (after RetryAfter).
//
// Every error the client methods return for a failed call is an *Error; status.Code(err) and
// status.FromError(err) work on it too.
type Error struct {
	Code       codes.Code
	Message    string
	Kind       string
	Field      string
	Metadata   map[string]string
	RetryAfter time.Duration
	// Progress is a failed step's StepProgress detail: which items ran, which did not and why
	// (nil for other calls).
	Progress *pb.StepProgress
	st       *status.Status
}

// UnsupportedShape reports an UNIMPLEMENTED whose ErrorInfo metadata reason is
// UNSUPPORTED_SHAPE: this mix of rows cannot run as one step; run them as BatchPrefill + BatchDecode.
func (e *Error) UnsupportedShape() bool {
	return e.Kind == "UNSUPPORTED" && e.Metadata["reason"] == "UNSUPPORTED_SHAPE"
}

func (e *Error) Error() string {
	if e.Kind != "" {
		return fmt.Sprintf("ferrum: %s (%s): %s", e.Code, e.Kind, e.Message)
	}
	return fmt.Sprintf("ferrum: %s: %s", e.Code, e.Message)
}

// GRPCStatus lets status.FromError and status.Code see through the wrapper.
func (e *Error) GRPCStatus() *status.Status {
	if e.st != nil {
		return e.st
	}
	return status.New(e.Code, e.Message)
}

// Code is the gRPC code of err (codes.OK for nil, codes.Unknown for a non-gRPC error).
func Code(err error) codes.Code {
	var fe *Error
	if errors.As(err, &fe) {
		return fe.Code
	}
	return status.Code(err)
}

// Kind is ferrum's error kind of err ("" when the error carries none).
func Kind(err error) string {
	var fe *Error
	if errors.As(err, &fe) {
		return fe.Kind
	}
	return ""
}

// wrapErr turns a gRPC error into an *Error, reading the ErrorInfo and RetryInfo details.
func wrapErr(err error) error {
	if err == nil {
		return nil
	}
	var fe *Error
	if errors.As(err, &fe) {
		return err
	}
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	e := &Error{Code: st.Code(), Message: st.Message(), st: st}
	for _, d := range st.Details() {
		switch v := d.(type) {
		case *errdetails.ErrorInfo:
			e.Kind = v.GetReason()
			e.Metadata = v.GetMetadata()
			e.Field = v.GetMetadata()["field"]
		case *pb.StepProgress:
			e.Progress = v
		case *errdetails.RetryInfo:
			e.RetryAfter = v.GetRetryDelay().AsDuration()
		case *errdetails.BadRequest:
			if e.Field == "" && len(v.GetFieldViolations()) > 0 {
				e.Field = v.GetFieldViolations()[0].GetField()
			}
		}
	}
	return e
}

// stepErr is the *Error of a failed Session step.
func stepErr(se *pb.StepError) error {
	kind := ""
	if se.GetKind() != pb.ErrorKind_ERROR_KIND_UNSPECIFIED {
		kind = trimPrefix(se.GetKind().String(), "ERROR_KIND_")
	}
	return &Error{
		Code:       codes.Code(se.GetCode()),
		Message:    se.GetMessage(),
		Kind:       kind,
		Field:      se.GetField(),
		Metadata:   se.GetMetadata(),
		RetryAfter: time.Duration(se.GetRetryAfterMs()) * time.Millisecond,
		Progress:   se.GetProgress(),
	}
}

func trimPrefix(s, p string) string {
	if len(s) >= len(p) && s[:len(p)] == p {
		return s[len(p):]
	}
	return s
}
