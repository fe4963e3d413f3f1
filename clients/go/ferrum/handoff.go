package ferrum

import (
	"context"
	"fmt"

	pb "github.com/ferrum-service/ferrum-service/clients/go/gen/ferrum/executor/v1"
)

// Disaggregated runs prompts on a prefill server and decodes them on a decode server: Prefill
// computes the prompt on Prefill, moves its KV to Decode (a server pull, or a push through this
// client) and releases the prefill cache. The servers may run with --role prefill / --role decode.
type Disaggregated struct {
	Prefill *Client
	Decode  *Client
	// PrefillTarget is the prefill server's HOST:PORT as the decode server reaches it; with it the
	// decode server pulls the KV itself, without it this client relays the bytes (push).
	PrefillTarget string
	// PrefillTLS: the decode server connects to PrefillTarget with TLS.
	PrefillTLS bool
	// KeepPrefillCache keeps the cache on the prefill server after the handoff (default: released).
	KeepPrefillCache bool
}

// Handoff is a prompt ready to decode on the decode server.
type Handoff struct {
	// Cache is the new cache on the decode server (it holds the prompt).
	Cache *pb.KvCacheHandle
	// Token is the first generated token (sampled by the prefill): feed it to the first decode step.
	Token int32
	// CachedTokens of the prompt came from the prefill server's prefix cache.
	CachedTokens uint64
	// Import is the decode server's ImportKv answer (tokens, bytes, chunks, transfer time).
	Import *pb.ImportKvResponse
}

// Run prefills tokens on the prefill server (step options as for Prefill; reserve is the decode
// cache's total reservation: prompt + tokens to decode) and hands the cache to the decode server.
func (d *Disaggregated) Run(ctx context.Context, modelID string, tokens []int32, reserve uint64, opts ...StepOption) (*Handoff, error) {
	out, err := d.Prefill.Prefill(ctx, modelID, tokens, opts...)
	if err != nil {
		return nil, fmt.Errorf("ferrum: disaggregated prefill: %w", err)
	}
	src := out.GetCache().GetCacheId()
	imp, err := d.Move(ctx, modelID, src, ImportReserve(reserve))
	if !d.KeepPrefillCache {
		if _, rerr := d.Prefill.ReleaseCache(context.WithoutCancel(ctx), modelID, src); rerr != nil && err == nil {
			err = rerr
		}
	}
	if err != nil {
		return nil, err
	}
	return &Handoff{Cache: imp.GetCache(), Token: Token(out.GetOutput()), CachedTokens: out.GetCachedTokens(), Import: imp}, nil
}

// Move copies cacheID from the prefill server to the decode server (pull when PrefillTarget is
// set, else push); the prefill cache is left as it was.
func (d *Disaggregated) Move(ctx context.Context, modelID, cacheID string, opts ...ImportOption) (*pb.ImportKvResponse, error) {
	if d.PrefillTarget != "" {
		src := KvSourceOf(d.PrefillTarget, cacheID)
		src.Tls = d.PrefillTLS
		imp, err := d.Decode.PullKv(ctx, modelID, src, opts...)
		if err != nil {
			return nil, fmt.Errorf("ferrum: KV pull from %s: %w", d.PrefillTarget, err)
		}
		return imp, nil
	}
	imp, err := PushKv(ctx, d.Prefill, d.Decode, modelID, cacheID, opts...)
	if err != nil {
		return nil, fmt.Errorf("ferrum: KV push: %w", err)
	}
	return imp, nil
}
