package ferrum

import (
	"context"
	"errors"
	"fmt"
	"io"
	"iter"

	pb "github.com/ferrum-service/ferrum-service/clients/go/gen/ferrum/executor/v1"
	"google.golang.org/grpc/codes"
)

// MaxMigrationHops is how many servers Generate follows one stream through at most (Migrated
// events); one more move ends the stream with an ABORTED error.
const MaxMigrationHops = 16

// StreamOption adjusts Generate and GenerateAll.
type StreamOption func(*streamConfig)

type streamConfig struct {
	follow     bool
	onMigrated []func(*pb.GenerateMigrated)
}

// FollowMigrations(false) passes a Migrated event on as the stream's last event instead of
// following it (the caller resumes it: GenerateRequest.ResumeToken on Migrated.Target). Default true.
func FollowMigrations(follow bool) StreamOption {
	return func(s *streamConfig) { s.follow = follow }
}

// OnMigrated calls fn with each Migrated event Generate follows, before it resumes the stream on
// the event's target (e.g. to log or count the moves).
func OnMigrated(fn func(*pb.GenerateMigrated)) StreamOption {
	return func(s *streamConfig) { s.onMigrated = append(s.onMigrated, fn) }
}

// followGenerate is Generate that follows Migrated events: it resumes the stream on the target
// with a client of the same kind (sibling) and goes on yielding, as one stream.
func (c *Client) followGenerate(ctx context.Context, req *pb.GenerateRequest, cfg streamConfig) iter.Seq2[*pb.GenerateResponse, error] {
	return func(yield func(*pb.GenerateResponse, error) bool) {
		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		cur, r := c, req
		for hops := 0; ; hops++ {
			moved, ok := cur.generateLeg(ctx, r, hops > 0, yield)
			if moved == nil || !ok {
				return
			}
			if hops >= MaxMigrationHops {
				yield(nil, &Error{Code: codes.Aborted, Message: fmt.Sprintf("the stream moved more than %d times", MaxMigrationHops)})
				return
			}
			for _, fn := range cfg.onMigrated {
				fn(moved)
			}
			next, err := c.sibling(moved.GetTarget())
			if err != nil {
				yield(nil, &Error{Code: codes.Unavailable, Message: fmt.Sprintf("following the stream to %s: %v", moved.GetTarget(), err)})
				return
			}
			cur, r = next, &pb.GenerateRequest{ModelId: req.GetModelId(), ResumeToken: moved.GetResumeToken()}
		}
	}
}

// generateLeg runs one Generate call of a followed stream and yields its events but a resumed
// call's Started (the caller saw the first one). It returns the Migrated event that ended the
// call (nil when the stream ended or failed) and false once the caller stopped or an error was
// yielded.
func (c *Client) generateLeg(ctx context.Context, req *pb.GenerateRequest, resumed bool, yield func(*pb.GenerateResponse, error) bool) (*pb.GenerateMigrated, bool) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // ends this server's call once the stream moved on
	stream, err := c.rpc.Generate(c.ctx(ctx), req)
	if err != nil {
		yield(nil, wrapErr(err))
		return nil, false
	}
	for {
		m, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil, true
		}
		if err != nil {
			yield(nil, wrapErr(err))
			return nil, false
		}
		if mv := m.GetMigrated(); mv != nil {
			return mv, true
		}
		if resumed && m.GetStarted() != nil {
			continue
		}
		if !yield(m, nil) {
			return nil, false
		}
	}
}

// sibling is a client like c (the same dial options: TLS, token, deadlines) to target, kept open
// until c closes.
func (c *Client) sibling(target string) (*Client, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if s := c.siblings[target]; s != nil {
		return s, nil
	}
	s, err := Dial(target, c.opts...)
	if err != nil {
		return nil, err
	}
	if c.siblings == nil {
		c.siblings = map[string]*Client{}
	}
	c.siblings[target] = s
	return s, nil
}

// MigrateOption adjusts MigrateStreams.
type MigrateOption func(*pb.MigrateStreamsRequest)

// MigrateModel moves only the streams of modelID.
func MigrateModel(modelID string) MigrateOption {
	return func(r *pb.MigrateStreamsRequest) { r.ModelId = modelID }
}

// MigrateRequestID moves only the streams with this GenerateRequest.RequestId (of any caller).
func MigrateRequestID(id string) MigrateOption {
	return func(r *pb.MigrateStreamsRequest) { r.RequestId = id }
}

// MigrateDrain also stops the server taking new work (health NOT_SERVING, Loads draining).
func MigrateDrain() MigrateOption { return func(r *pb.MigrateStreamsRequest) { r.Drain = true } }

// MigrateStreams moves running Generate streams (every one, or those the options select) to
// target ("host:port", one of the server's KV peers) without losing or repeating a token: each
// ends here with a Migrated event its caller follows (Generate does). One StreamMigration per
// stream: moved, or refused with the reason (the stream then goes on here). An admin RPC.
func (c *Client) MigrateStreams(ctx context.Context, target string, opts ...MigrateOption) (*pb.MigrateStreamsResponse, error) {
	req := &pb.MigrateStreamsRequest{Target: target}
	for _, o := range opts {
		o(req)
	}
	return unary(c, ctx, c.rpc.MigrateStreams, req)
}
