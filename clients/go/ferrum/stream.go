package ferrum

import (
	"context"
	"errors"
	"fmt"
	"io"
	"iter"
	"sync"

	pb "github.com/ferrum-service/ferrum-service/clients/go/gen/ferrum/executor/v1"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
)

// TokenPrompt is a GenerateRequest prompt of token ids.
func TokenPrompt(ids ...int32) *pb.GenerateRequest_TokenIds {
	return &pb.GenerateRequest_TokenIds{TokenIds: &pb.TokenIds{TokenIds: ids}}
}

// TextPrompt is a GenerateRequest prompt of text (tokenized on the server).
func TextPrompt(text string) *pb.GenerateRequest_Text { return &pb.GenerateRequest_Text{Text: text} }

// Generate runs a generation with the decode loop on the server and yields its events: one
// Started, one Token per generated token, then one Finished. Breaking out of the loop, or
// cancelling ctx, cancels the call, and the server stops before its next step and frees the cache.
// A failure ends the sequence with a non-nil error (an *Error).
//
// A stream the server moves to a peer (a Migrated event: MigrateStreams, or a drain) is followed
// there with this client's credentials and resumed by its token: the events go on as one stream,
// without the Migrated event and the peer's Started event (see FollowMigrations, OnMigrated).
//
//	for ev, err := range c.Generate(ctx, req) { ... }
func (c *Client) Generate(ctx context.Context, req *pb.GenerateRequest, opts ...StreamOption) iter.Seq2[*pb.GenerateResponse, error] {
	cfg := streamConfig{follow: true}
	for _, o := range opts {
		o(&cfg)
	}
	if !cfg.follow {
		return serverStream(c.ctx(ctx), func(ctx context.Context) (receiver[*pb.GenerateResponse], error) {
			return c.rpc.Generate(ctx, req)
		})
	}
	return c.followGenerate(ctx, req, cfg)
}

// receiver is what a server-streaming call returns: one message per Recv, io.EOF at the end.
type receiver[T any] interface {
	Recv() (T, error)
}

// serverStream turns a server-streaming call into an iterator: each message, until the stream
// ends (io.EOF: nothing more) or fails (one non-nil *Error). Breaking out of the loop cancels the
// call (open gets a context cancelled when the iterator returns).
func serverStream[T any](ctx context.Context, open func(context.Context) (receiver[T], error)) iter.Seq2[T, error] {
	return func(yield func(T, error) bool) {
		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		var zero T
		stream, err := open(ctx)
		if err != nil {
			yield(zero, wrapErr(err))
			return
		}
		for {
			m, err := stream.Recv()
			if errors.Is(err, io.EOF) {
				return
			}
			if err != nil {
				yield(zero, wrapErr(err))
				return
			}
			if !yield(m, nil) {
				return
			}
		}
	}
}

// GenerateResult is a whole generation, collected by GenerateAll. Tokens and Finished are sample
// 0's; Samples and FinishedBy hold every sample's (GenN), by sample index.
type GenerateResult struct {
	Started    *pb.GenerateStarted
	Tokens     []int32
	Finished   *pb.GenerateFinished
	Samples    [][]int32
	FinishedBy []*pb.GenerateFinished
	// Migrations are the servers the stream moved to and was followed to, in order.
	Migrations []string
	// Migrated is the Migrated event of a stream that moved while FollowMigrations(false) was
	// given (the stream ended there; resume it with its token), else nil.
	Migrated *pb.GenerateMigrated
}

func (r *GenerateResult) sample(i uint32) {
	for uint32(len(r.Samples)) <= i {
		r.Samples = append(r.Samples, nil)
		r.FinishedBy = append(r.FinishedBy, nil)
	}
}

// GenerateAll runs Generate to the end and collects its events.
func (c *Client) GenerateAll(ctx context.Context, req *pb.GenerateRequest, opts ...StreamOption) (*GenerateResult, error) {
	res := &GenerateResult{}
	opts = append(opts, OnMigrated(func(m *pb.GenerateMigrated) { res.Migrations = append(res.Migrations, m.GetTarget()) }))
	for ev, err := range c.Generate(ctx, req, opts...) {
		if err != nil {
			return res, err
		}
		switch e := ev.GetEvent().(type) {
		case *pb.GenerateResponse_Started:
			res.Started = e.Started
		case *pb.GenerateResponse_Token:
			i := e.Token.GetSampleIndex()
			res.sample(i)
			res.Samples[i] = append(res.Samples[i], e.Token.GetTokenId())
			if i == 0 {
				res.Tokens = append(res.Tokens, e.Token.GetTokenId())
			}
		case *pb.GenerateResponse_Finished:
			i := e.Finished.GetSampleIndex()
			res.sample(i)
			res.FinishedBy[i] = e.Finished
			if i == 0 {
				res.Finished = e.Finished
			}
		case *pb.GenerateResponse_Migrated:
			res.Migrated = e.Migrated
		}
	}
	return res, nil
}

// Session is one bidirectional Session stream: steps go in, their results come back in order. A
// failed step returns an *Error and the session goes on. Caches created on the stream belong to
// it: Close (or cancelling the context the session was opened with) frees them.
//
// Do is safe for concurrent use (each call waits for its own result); Send and Recv pipeline
// several steps and must not be mixed with Do.
type Session struct {
	stream grpc.BidiStreamingClient[pb.SessionRequest, pb.SessionResponse]
	cancel context.CancelFunc
	mu     sync.Mutex
	nextID uint64
}

// Session opens a Session stream. Its lifetime is ctx's: cancelling ctx ends it.
func (c *Client) Session(ctx context.Context) (*Session, error) {
	ctx, cancel := context.WithCancel(c.ctx(ctx))
	stream, err := c.rpc.Session(ctx)
	if err != nil {
		cancel()
		return nil, wrapErr(err)
	}
	return &Session{stream: stream, cancel: cancel}, nil
}

// SessionStep wraps a step request (*pb.PrefillRequest, *pb.DecodeRequest, *pb.BatchDecodeRequest,
// *pb.BatchPrefillRequest, *pb.UnifiedDecodeRequest, *pb.ForwardVerifyRequest,
// *pb.TruncateKvRequest, *pb.ReleaseCacheRequest) in a SessionRequest.
func SessionStep(stepID uint64, step proto.Message) (*pb.SessionRequest, error) {
	r := &pb.SessionRequest{StepId: stepID}
	switch s := step.(type) {
	case *pb.PrefillRequest:
		r.Step = &pb.SessionRequest_Prefill{Prefill: s}
	case *pb.BatchPrefillRequest:
		r.Step = &pb.SessionRequest_BatchPrefill{BatchPrefill: s}
	case *pb.DecodeRequest:
		r.Step = &pb.SessionRequest_Decode{Decode: s}
	case *pb.BatchDecodeRequest:
		r.Step = &pb.SessionRequest_BatchDecode{BatchDecode: s}
	case *pb.UnifiedDecodeRequest:
		r.Step = &pb.SessionRequest_UnifiedDecode{UnifiedDecode: s}
	case *pb.ForwardVerifyRequest:
		r.Step = &pb.SessionRequest_ForwardVerify{ForwardVerify: s}
	case *pb.TruncateKvRequest:
		r.Step = &pb.SessionRequest_TruncateKv{TruncateKv: s}
	case *pb.ReleaseCacheRequest:
		r.Step = &pb.SessionRequest_ReleaseCache{ReleaseCache: s}
	case *pb.ForkCacheRequest:
		r.Step = &pb.SessionRequest_ForkCache{ForkCache: s}
	default:
		return nil, fmt.Errorf("ferrum: %T is not a Session step", step)
	}
	return r, nil
}

// Send queues a step without waiting and returns its step id.
func (s *Session) Send(step proto.Message) (uint64, error) {
	s.nextID++
	req, err := SessionStep(s.nextID, step)
	if err != nil {
		return 0, err
	}
	if err := s.stream.Send(req); err != nil {
		return 0, s.streamErr(err)
	}
	return s.nextID, nil
}

// Recv returns the next result in order: the step's response message (*pb.PrefillResponse,
// *pb.DecodeResponse, ...) or the step's *Error.
func (s *Session) Recv() (uint64, proto.Message, error) {
	resp, err := s.stream.Recv()
	if err != nil {
		return 0, nil, s.streamErr(err)
	}
	switch r := resp.GetResult().(type) {
	case *pb.SessionResponse_Error:
		return resp.GetStepId(), nil, stepErr(r.Error)
	case *pb.SessionResponse_Prefill:
		return resp.GetStepId(), r.Prefill, nil
	case *pb.SessionResponse_BatchPrefill:
		return resp.GetStepId(), r.BatchPrefill, nil
	case *pb.SessionResponse_Decode:
		return resp.GetStepId(), r.Decode, nil
	case *pb.SessionResponse_BatchDecode:
		return resp.GetStepId(), r.BatchDecode, nil
	case *pb.SessionResponse_UnifiedDecode:
		return resp.GetStepId(), r.UnifiedDecode, nil
	case *pb.SessionResponse_ForwardVerify:
		return resp.GetStepId(), r.ForwardVerify, nil
	case *pb.SessionResponse_TruncateKv:
		return resp.GetStepId(), r.TruncateKv, nil
	case *pb.SessionResponse_ReleaseCache:
		return resp.GetStepId(), r.ReleaseCache, nil
	case *pb.SessionResponse_ForkCache:
		return resp.GetStepId(), r.ForkCache, nil
	}
	return resp.GetStepId(), nil, fmt.Errorf("ferrum: session step %d: empty result", resp.GetStepId())
}

// Do sends one step and waits for its result.
func (s *Session) Do(step proto.Message) (proto.Message, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	id, err := s.Send(step)
	if err != nil {
		return nil, err
	}
	got, msg, err := s.Recv()
	if err == nil && got != id {
		return nil, fmt.Errorf("ferrum: session answered step %d, expected %d", got, id)
	}
	return msg, err
}

// Close ends the stream (the server frees the session's caches) and waits for it to finish.
func (s *Session) Close() error {
	defer s.cancel()
	if err := s.stream.CloseSend(); err != nil {
		return s.streamErr(err)
	}
	for {
		if _, err := s.stream.Recv(); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return s.streamErr(err)
		}
	}
}

func (s *Session) streamErr(err error) error {
	if errors.Is(err, io.EOF) {
		// Send reports io.EOF when the stream broke; the real status comes from Recv.
		if _, rerr := s.stream.Recv(); rerr != nil && !errors.Is(rerr, io.EOF) {
			return wrapErr(rerr)
		}
		return io.EOF
	}
	return wrapErr(err)
}
