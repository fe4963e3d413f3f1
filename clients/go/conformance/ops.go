package conformance

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/ferrum-service/ferrum-service/clients/go/ferrum"
	pb "github.com/ferrum-service/ferrum-service/clients/go/gen/ferrum/executor/v1"
)

// executeMore runs the scheduler-facing ops (README.md: fork, loads, list_caches, kv_events,
// mirror, abort, handoff, load_adapter, unload_adapter) through the client's helpers.
func executeMore(ctx context.Context, srv *Servers, c *ferrum.Client, model string, s map[string]any) (map[string]any, error) {
	switch op := str(s, "op"); op {
	case "fork":
		var opts []ferrum.ForkOption
		if v, ok := s["keep_tokens"]; ok && v != nil {
			opts = append(opts, ferrum.KeepTokens(uint64(num(v))))
		}
		if v, ok := s["reserve_tokens"]; ok {
			opts = append(opts, ferrum.ForkReserve(uint64(num(v))))
		}
		r, err := c.ForkCache(ctx, model, str(s, "cache"), opts...)
		if err != nil {
			return nil, err
		}
		out := handle(r.GetCache())
		out["shared_blocks"] = r.GetSharedBlocks()
		return out, nil
	case "loads":
		r, err := c.Loads(ctx, model)
		if err != nil {
			return nil, err
		}
		l := ferrum.ModelLoad(r, model)
		if l == nil {
			return nil, fmt.Errorf("Loads has no entry for model %q", model)
		}
		return map[string]any{"kv_event_seq": r.GetKvEventSeq(), "active_caches": l.GetActiveCaches(),
			"cached_blocks": l.GetCachedBlocks(), "block_size": l.GetBlockSize(), "prefix_hit_tokens": l.GetPrefixHitTokens(),
			"prefix_queried_tokens": l.GetPrefixQueriedTokens(), "resident_tokens": l.GetResidentTokens()}, nil
	case "list_caches":
		r, err := c.ListCaches(ctx, model)
		if err != nil {
			return nil, err
		}
		ids := []string{}
		for _, h := range r.GetCaches() {
			ids = append(ids, h.GetCacheId())
		}
		sort.Strings(ids)
		return map[string]any{"caches": ids, "as_of_seq": r.GetAsOfSeq()}, nil
	case "kv_events":
		msgs, resync, err := events(ctx, c, uint64(num(s["after_seq"]))+1)
		if err != nil {
			return nil, err
		}
		kinds, caches, lens := []string{}, []string{}, []uint64{}
		stored := 0
		for _, m := range msgs {
			if e := m.GetEvent(); e != nil && e.GetModelId() == model {
				kinds = append(kinds, strings.TrimPrefix(e.GetKind().String(), "KV_EVENT_KIND_"))
				caches = append(caches, e.GetCacheId())
				lens = append(lens, e.GetNumTokens())
			}
			if b := m.GetBlockEvent(); b != nil && b.GetModelId() == model && b.GetStored() != nil {
				stored += len(b.GetStored().GetBlockHashes())
			}
		}
		return map[string]any{"kinds": kinds, "caches": caches, "num_tokens": lens, "blocks_stored": stored,
			"resync_required": resync}, nil
	case "mirror":
		info, err := c.Info(ctx, "")
		if err != nil {
			return nil, err
		}
		m := ferrum.NewPrefixMirror()
		m.SetRecipes(info)
		msgs, resync, err := events(ctx, c, 1)
		if err != nil {
			return nil, err
		}
		if resync {
			return nil, fmt.Errorf("the server's replay buffer no longer starts at seq 1 (resync_required)")
		}
		for _, msg := range msgs {
			m.Apply(msg)
		}
		var toks []int32
		if v, ok := s["tokens"]; ok {
			if toks, err = ints(v); err != nil {
				return nil, err
			}
		}
		return map[string]any{"blocks": m.Len(model),
			"cached_tokens": m.CachedTokens(model, toks, str(s, "cache_salt"), str(s, "adapter"))}, nil
	case "abort":
		var r *pb.AbortResponse
		var err error
		if rid, ok := s["request_id"].(string); ok {
			r, err = c.AbortRequest(ctx, model, rid)
		} else {
			r, err = c.AbortCache(ctx, model, str(s, "cache"))
		}
		if err != nil {
			return nil, err
		}
		return map[string]any{"aborted_streams": r.GetAbortedStreams(), "released_cache": r.GetReleasedCache()}, nil
	case "handoff":
		return handoff(ctx, srv, c, model, s)
	case "load_adapter":
		r, err := c.LoadAdapter(ctx, model, str(s, "name"), str(s, "path"))
		if err != nil {
			return nil, err
		}
		return map[string]any{"name": r.GetAdapter().GetName(), "loaded": r.GetLoaded(), "rank": r.GetAdapter().GetRank()}, nil
	case "unload_adapter":
		r, err := c.UnloadAdapter(ctx, model, str(s, "name"))
		if err != nil {
			return nil, err
		}
		return map[string]any{"unloaded": r.GetUnloaded(), "dropped_blocks": r.GetDroppedBlocks()}, nil
	default:
		return nil, fmt.Errorf("unknown op %q", op)
	}
}

func events(ctx context.Context, c *ferrum.Client, from uint64) ([]*pb.SubscribeKvEventsResponse, bool, error) {
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	return c.EventsUpTo(ctx, from)
}

// handoff moves the step's cache from its server to "to": push (ExportKv relayed into ImportKv by
// this client) or pull (the destination fetches it from the source's target itself).
func handoff(ctx context.Context, srv *Servers, src *ferrum.Client, model string, s map[string]any) (map[string]any, error) {
	_, srcTarget, err := srv.get(str(s, "server"))
	if err != nil {
		return nil, err
	}
	dst, _, err := srv.get(str(s, "to"))
	if err != nil {
		return nil, err
	}
	var opts []ferrum.ImportOption
	if v, ok := s["reserve_tokens"]; ok {
		opts = append(opts, ferrum.ImportReserve(uint64(num(v))))
	}
	var r *pb.ImportKvResponse
	switch mode := str(s, "mode"); mode {
	case "", "push":
		r, err = ferrum.PushKv(ctx, src, dst, model, str(s, "cache"), opts...)
	case "pull":
		r, err = dst.PullKv(ctx, model, ferrum.KvSourceOf(srcTarget, str(s, "cache")), opts...)
	default:
		return nil, fmt.Errorf("unknown handoff mode %q", mode)
	}
	if err != nil {
		return nil, err
	}
	out := handle(r.GetCache())
	out["imported_tokens"], out["chunks"], out["bytes"], out["cached_blocks"] = r.GetImportedTokens(), r.GetChunks(), r.GetBytes(), r.GetCachedBlocks()
	return out, nil
}
