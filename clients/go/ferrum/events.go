package ferrum

import (
	"context"
	"errors"
	"iter"
	"strconv"

	pb "github.com/ferrum-service/ferrum-service/clients/go/gen/ferrum/executor/v1"
)

// EventOption adjusts SubscribeKvEvents.
type EventOption func(*pb.SubscribeKvEventsRequest)

// FromSeq replays events with seq >= n before the live ones. When n has left the server's replay
// buffer the first message is ResyncRequired (take a ListCaches snapshot).
func FromSeq(n uint64) EventOption { return func(r *pb.SubscribeKvEventsRequest) { r.FromSeq = &n } }

// WithBlockEvents adds the prefix cache's block events (KvBlockEvent: stored, removed, cleared);
// they share the sequence numbers of cache events.
func WithBlockEvents() EventOption {
	return func(r *pb.SubscribeKvEventsRequest) { r.IncludeBlockEvents = true }
}

// SubscribeKvEvents yields a model's cache events (every model's when modelID is ""): created,
// extended, truncated, released, forked, ... each with a server-wide sequence number. Break out of
// the loop (or cancel ctx) to stop. A subscriber that falls behind is dropped with
// RESOURCE_EXHAUSTED; ResumeFromSeq(err) says where to resume.
func (c *Client) SubscribeKvEvents(ctx context.Context, modelID string, opts ...EventOption) iter.Seq2[*pb.SubscribeKvEventsResponse, error] {
	req := &pb.SubscribeKvEventsRequest{ModelId: modelID}
	for _, o := range opts {
		o(req)
	}
	return serverStream(c.ctx(ctx), func(ctx context.Context) (receiver[*pb.SubscribeKvEventsResponse], error) {
		return c.rpc.SubscribeKvEvents(ctx, req)
	})
}

// EventSeq is the sequence number of an event message (0 for ResyncRequired).
func EventSeq(m *pb.SubscribeKvEventsResponse) uint64 {
	switch x := m.GetMessage().(type) {
	case *pb.SubscribeKvEventsResponse_Event:
		return x.Event.GetSeq()
	case *pb.SubscribeKvEventsResponse_BlockEvent:
		return x.BlockEvent.GetSeq()
	}
	return 0
}

// ResumeFromSeq is where a dropped subscriber resumes (the "resume_from_seq" of its
// RESOURCE_EXHAUSTED error), and false when err says nothing of it.
func ResumeFromSeq(err error) (uint64, bool) {
	var fe *Error
	if !errors.As(err, &fe) {
		return 0, false
	}
	v, ok := fe.Metadata["resume_from_seq"]
	if !ok {
		return 0, false
	}
	n, perr := strconv.ParseUint(v, 10, 64)
	return n, perr == nil
}

// EventsUpTo collects the event messages (block events included, every model) with seq >= from up
// to the server's current sequence number, read first from ListCaches. resync is true when the
// server no longer holds from in its replay buffer. For catching up (tests, a snapshot's
// replay); a long-lived follower is FollowBlockEvents.
func (c *Client) EventsUpTo(ctx context.Context, from uint64) (msgs []*pb.SubscribeKvEventsResponse, resync bool, err error) {
	snap, err := c.ListCaches(ctx, "")
	if err != nil {
		return nil, false, err
	}
	last := snap.GetAsOfSeq()
	if last < from {
		return nil, false, nil
	}
	for m, err := range c.SubscribeKvEvents(ctx, "", FromSeq(from), WithBlockEvents()) {
		if err != nil {
			return msgs, resync, err
		}
		if m.GetResyncRequired() != nil {
			return msgs, true, nil
		}
		msgs = append(msgs, m)
		if EventSeq(m) >= last {
			break
		}
	}
	return msgs, false, nil
}
