package ferrum

import (
	"context"
	"sync"
	"time"

	pb "github.com/ferrum-service/ferrum-service/clients/go/gen/ferrum/executor/v1"
)

// PrefixMirror is a router's copy of the prefix-cache blocks one replica holds, per model, kept
// from its block events (SubscribeKvEvents with WithBlockEvents): stored adds keys, removed deletes
// them, cleared empties the model. With the replica's recipes (SetRecipes, from Info) it says how
// much of a new prompt the replica has cached (CachedTokens). It is a routing hint: a replica that
// no longer holds a block computes it again. Safe for concurrent use.
type PrefixMirror struct {
	mu      sync.RWMutex
	blocks  map[string]map[BlockHash]struct{}
	recipes map[string]*pb.PrefixCacheRecipe
	lastSeq uint64
	resyncs int
}

// NewPrefixMirror is an empty mirror.
func NewPrefixMirror() *PrefixMirror {
	return &PrefixMirror{blocks: map[string]map[BlockHash]struct{}{}, recipes: map[string]*pb.PrefixCacheRecipe{}}
}

// Apply applies one stream message: block events change the mirror, ResyncRequired empties it,
// cache events only advance LastSeq. It reports whether the block set changed or was reset.
func (m *PrefixMirror) Apply(msg *pb.SubscribeKvEventsResponse) bool {
	switch x := msg.GetMessage().(type) {
	case *pb.SubscribeKvEventsResponse_ResyncRequired:
		m.mu.Lock()
		m.blocks, m.lastSeq = map[string]map[BlockHash]struct{}{}, 0
		m.resyncs++
		m.mu.Unlock()
		return true
	case *pb.SubscribeKvEventsResponse_Event:
		m.mu.Lock()
		m.lastSeq = max(m.lastSeq, x.Event.GetSeq())
		m.mu.Unlock()
		return false
	case *pb.SubscribeKvEventsResponse_BlockEvent:
		return m.ApplyBlockEvent(x.BlockEvent)
	}
	return false
}

// ApplyBlockEvent applies one KvBlockEvent.
func (m *PrefixMirror) ApplyBlockEvent(ev *pb.KvBlockEvent) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.lastSeq = max(m.lastSeq, ev.GetSeq())
	model := ev.GetModelId()
	switch d := ev.GetData().(type) {
	case *pb.KvBlockEvent_Stored:
		set := m.blocks[model]
		if set == nil {
			set = map[BlockHash]struct{}{}
			m.blocks[model] = set
		}
		for _, h := range d.Stored.GetBlockHashes() {
			if len(h) == 32 {
				set[BlockHash(h)] = struct{}{}
			}
		}
	case *pb.KvBlockEvent_Removed:
		for _, h := range d.Removed.GetBlockHashes() {
			if len(h) == 32 {
				delete(m.blocks[model], BlockHash(h))
			}
		}
	case *pb.KvBlockEvent_Cleared:
		delete(m.blocks, model)
	default:
		return false
	}
	return true
}

// Clear forgets every block (and LastSeq).
func (m *PrefixMirror) Clear() {
	m.mu.Lock()
	m.blocks, m.lastSeq = map[string]map[BlockHash]struct{}{}, 0
	m.mu.Unlock()
}

// Len is the number of blocks held for modelID.
func (m *PrefixMirror) Len(modelID string) int {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return len(m.blocks[modelID])
}

// Has reports whether modelID's block key is held.
func (m *PrefixMirror) Has(modelID string, key BlockHash) bool {
	m.mu.RLock()
	defer m.mu.RUnlock()
	_, ok := m.blocks[modelID][key]
	return ok
}

// LastSeq is the largest event sequence number applied (0 after a reset).
func (m *PrefixMirror) LastSeq() uint64 {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return m.lastSeq
}

// Resyncs counts the ResyncRequired messages applied.
func (m *PrefixMirror) Resyncs() int {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return m.resyncs
}

// SetRecipes takes each model's PrefixCacheRecipe from an Info response.
func (m *PrefixMirror) SetRecipes(info *pb.InfoResponse) {
	r := map[string]*pb.PrefixCacheRecipe{}
	for _, mi := range info.GetModels() {
		if mi.GetPrefixCache() != nil {
			r[mi.GetModelId()] = mi.GetPrefixCache()
		}
	}
	m.mu.Lock()
	m.recipes = r
	m.mu.Unlock()
}

// RecipeUsable reports whether a recipe is one this client computes, with caching on, for a
// sequence computed with adapter ("" = the base model).
func RecipeUsable(r *pb.PrefixCacheRecipe, adapter string) bool {
	if r == nil || !r.GetEnabled() || r.GetBlockSize() == 0 || r.GetAlgorithm() != PrefixAlgorithm {
		return false
	}
	keys := r.GetExtraKeys()
	known := len(keys) == 0 || (len(keys) >= 2 && keys[0] == "model_id" && keys[1] == "cache_salt" &&
		(len(keys) == 2 || (len(keys) == 3 && keys[2] == "adapter")))
	return known && (adapter == "" || len(keys) == 3)
}

// PromptKeys are the block keys of a new prompt of modelID under the replica's recipe (nil when it
// advertises none this client computes).
func (m *PrefixMirror) PromptKeys(modelID string, tokens []int32, cacheSalt, adapter string) []BlockHash {
	m.mu.RLock()
	r := m.recipes[modelID]
	m.mu.RUnlock()
	if !RecipeUsable(r, adapter) {
		return nil
	}
	return BlockKeys(ChainRoot(r.GetSeed(), modelID, cacheSalt, adapter), tokens, int(r.GetBlockSize()))
}

// CachedBlocks is how many leading keys the replica holds.
func (m *PrefixMirror) CachedBlocks(modelID string, keys []BlockHash) int {
	m.mu.RLock()
	defer m.mu.RUnlock()
	set := m.blocks[modelID]
	return LongestCachedPrefix(keys, func(k BlockHash) bool { _, ok := set[k]; return ok })
}

// CachedTokens is how many leading tokens of a new prompt the replica holds in its prefix cache
// (a multiple of its block size; 0 without a usable recipe).
func (m *PrefixMirror) CachedTokens(modelID string, tokens []int32, cacheSalt, adapter string) int {
	keys := m.PromptKeys(modelID, tokens, cacheSalt, adapter)
	if len(keys) == 0 {
		return 0
	}
	m.mu.RLock()
	bs := int(m.recipes[modelID].GetBlockSize())
	m.mu.RUnlock()
	return m.CachedBlocks(modelID, keys) * bs
}

// Follower keeps a PrefixMirror current from a live replica on a goroutine (FollowBlockEvents).
type Follower struct {
	mirror *PrefixMirror
	cancel context.CancelFunc
	done   chan struct{}
}

// FollowBlockEvents keeps m current from c: it takes the recipes from Info, replays the replica's
// event buffer from its start, then follows live events; when the stream breaks or the server says
// ResyncRequired it empties the mirror and starts over (after retry). Stop ends it.
func FollowBlockEvents(ctx context.Context, c *Client, m *PrefixMirror, modelID string, retry time.Duration) *Follower {
	ctx, cancel := context.WithCancel(ctx)
	f := &Follower{mirror: m, cancel: cancel, done: make(chan struct{})}
	if retry <= 0 {
		retry = 500 * time.Millisecond
	}
	go func() {
		defer close(f.done)
		for ctx.Err() == nil {
			if info, err := c.Info(ctx, ""); err == nil {
				m.SetRecipes(info)
				for msg, err := range c.SubscribeKvEvents(ctx, modelID, FromSeq(1), WithBlockEvents()) {
					if err != nil {
						break
					}
					m.Apply(msg)
				}
			}
			m.Clear()
			select {
			case <-ctx.Done():
			case <-time.After(retry):
			}
		}
	}()
	return f
}

// WaitSeq waits until the mirror has applied every event up to seq (e.g. Loads' KvEventSeq, read
// from the replica), or ctx ends (false).
func (f *Follower) WaitSeq(ctx context.Context, seq uint64) bool {
	for f.mirror.LastSeq() < seq {
		select {
		case <-ctx.Done():
			return false
		case <-time.After(10 * time.Millisecond):
		}
	}
	return true
}

// Stop ends the follower and waits for its goroutine.
func (f *Follower) Stop() {
	f.cancel()
	<-f.done
}
