package ferrum

import (
	"context"
	"fmt"
	"sync"
	"time"

	pb "github.com/ferrum-service/ferrum-service/clients/go/gen/ferrum/executor/v1"
)

// Replica is one server of a PrefixRouter: its client, a mirror of its prefix cache and the
// follower that keeps the mirror current.
type Replica struct {
	Target   string
	Client   *Client
	Mirror   *PrefixMirror
	follower *Follower
	owned    bool
}

// PrefixRouter places new prompts over several servers of the same models: the replica holding
// the longest cached prefix of the prompt (from its mirrored block events) wins, and among equals
// the least loaded (Loads: fewest running+queued steps, then fewest live caches, then most free
// KV). Safe for concurrent use.
type PrefixRouter struct {
	mu       sync.RWMutex
	replicas []*Replica
	cancel   context.CancelFunc
	ctx      context.Context
}

// NewPrefixRouter dials every target (with opts) and starts following its block events.
func NewPrefixRouter(targets []string, opts ...Option) (*PrefixRouter, error) {
	r := newRouter()
	for _, t := range targets {
		c, err := Dial(t, opts...)
		if err != nil {
			r.Close()
			return nil, err
		}
		r.add(t, c, true)
	}
	return r, nil
}

// NewPrefixRouterOf routes over clients the caller owns (target -> client); Close does not close them.
func NewPrefixRouterOf(clients map[string]*Client) *PrefixRouter {
	r := newRouter()
	for t, c := range clients {
		r.add(t, c, false)
	}
	return r
}

func newRouter() *PrefixRouter {
	ctx, cancel := context.WithCancel(context.Background())
	return &PrefixRouter{ctx: ctx, cancel: cancel}
}

func (r *PrefixRouter) add(target string, c *Client, owned bool) {
	m := NewPrefixMirror()
	rep := &Replica{Target: target, Client: c, Mirror: m, owned: owned,
		follower: FollowBlockEvents(r.ctx, c, m, "", 500*time.Millisecond)}
	r.mu.Lock()
	r.replicas = append(r.replicas, rep)
	r.mu.Unlock()
}

// Replicas are the router's servers, in the order given.
func (r *PrefixRouter) Replicas() []*Replica {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return append([]*Replica(nil), r.replicas...)
}

// Sync waits until every mirror has applied its replica's events up to now (Loads' KvEventSeq),
// so that the next Pick sees every block stored before the call.
func (r *PrefixRouter) Sync(ctx context.Context) error {
	for _, rep := range r.Replicas() {
		l, err := rep.Client.Loads(ctx, "")
		if err != nil {
			return fmt.Errorf("ferrum: router sync %s: %w", rep.Target, err)
		}
		if !rep.follower.WaitSeq(ctx, l.GetKvEventSeq()) {
			return fmt.Errorf("ferrum: router sync %s: %w", rep.Target, ctx.Err())
		}
	}
	return nil
}

// Placement is where Pick put a prompt: the replica and how many leading tokens its mirror says it
// has cached.
type Placement struct {
	Replica      *Replica
	CachedTokens int
	Load         *pb.ModelLoad
}

// Pick chooses the replica for a new prompt of modelID (keyed under cacheSalt and adapter): the
// longest cached prefix, then the least loaded. Replicas whose Loads fails are skipped (a
// replica that does not answer gets no new work); an error only when none answers.
func (r *PrefixRouter) Pick(ctx context.Context, modelID string, tokens []int32, cacheSalt, adapter string) (*Placement, error) {
	var best *Placement
	var lastErr error
	for _, rep := range r.Replicas() {
		l, err := rep.Client.Loads(ctx, modelID)
		if err != nil {
			lastErr = err
			continue
		}
		p := &Placement{Replica: rep, CachedTokens: rep.Mirror.CachedTokens(modelID, tokens, cacheSalt, adapter),
			Load: ModelLoad(l, modelID)}
		if best == nil || better(p, best) {
			best = p
		}
	}
	if best == nil {
		if lastErr == nil {
			lastErr = fmt.Errorf("ferrum: the router has no replicas")
		}
		return nil, lastErr
	}
	return best, nil
}

// better: more cached tokens, then fewer running+queued steps, fewer caches, more free tokens.
func better(a, b *Placement) bool {
	if a.CachedTokens != b.CachedTokens {
		return a.CachedTokens > b.CachedTokens
	}
	la, lb := a.Load, b.Load
	if wa, wb := la.GetRunningSteps()+la.GetQueuedSteps(), lb.GetRunningSteps()+lb.GetQueuedSteps(); wa != wb {
		return wa < wb
	}
	if la.GetActiveCaches() != lb.GetActiveCaches() {
		return la.GetActiveCaches() < lb.GetActiveCaches()
	}
	return la.GetFreeTokens() > lb.GetFreeTokens()
}

// Close stops the followers and closes the clients the router dialled.
func (r *PrefixRouter) Close() {
	r.cancel()
	for _, rep := range r.Replicas() {
		rep.follower.Stop()
		if rep.owned {
			_ = rep.Client.Close()
		}
	}
}
