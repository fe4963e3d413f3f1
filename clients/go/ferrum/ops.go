package ferrum

import (
	"context"
	"encoding/binary"
	"fmt"

	pb "github.com/ferrum-service/ferrum-service/clients/go/gen/ferrum/executor/v1"
)

// Status is a model's executor state, operation counts and metrics.
func (c *Client) Status(ctx context.Context, modelID string) (*pb.StatusResponse, error) {
	return unary(c, ctx, c.rpc.Status, &pb.StatusRequest{ModelId: modelID})
}

// AdmissionLimits of a model's executor (Limits is nil where the executor has none).
func (c *Client) AdmissionLimits(ctx context.Context, modelID string) (*pb.AdmissionLimitsResponse, error) {
	return unary(c, ctx, c.rpc.AdmissionLimits, &pb.AdmissionLimitsRequest{ModelId: modelID})
}

// ApplyChatTemplate renders messages with the model's chat template (text and token ids);
// addGenerationPrompt appends the assistant turn's opening.
func (c *Client) ApplyChatTemplate(ctx context.Context, modelID string, messages []*pb.ChatMessage, addGenerationPrompt bool) (*pb.ApplyChatTemplateResponse, error) {
	return unary(c, ctx, c.rpc.ApplyChatTemplate, &pb.ApplyChatTemplateRequest{ModelId: modelID, Messages: messages,
		AddGenerationPrompt: addGenerationPrompt})
}

// ChatMessage is one message of a chat prompt ("system", "user", "assistant", "tool").
func ChatMessage(role, content string) *pb.ChatMessage {
	return &pb.ChatMessage{Role: role, Content: content}
}

// UnifiedItem builds one item of a UnifiedDecode batch: a prefill chunk (several tokens, cacheID ""
// for a new sequence; final marks its last chunk) or a decode step (one token). Step options give
// the logits policy and, for a new sequence, CacheSalt, BypassPrefixCache and Adapter.
func UnifiedItem(seqID, cacheID string, tokens []int32, posOffset uint64, final bool, opts ...StepOption) *pb.UnifiedBatchItem {
	s := steps(opts)
	return &pb.UnifiedBatchItem{SeqId: seqID, QTokens: tokens, CacheId: cacheID, PosOffset: posOffset,
		IsFinalChunk: final, Logits: s.policy, CacheSalt: s.cacheSalt, BypassPrefixCache: s.bypassPrefix, Adapter: s.adapter}
}

// UnifiedDecode runs prefill chunks and decode steps in one forward (UNIMPLEMENTED unless the
// executor supports native unified decode). One result per item, in item order.
func (c *Client) UnifiedDecode(ctx context.Context, modelID string, items []*pb.UnifiedBatchItem, opts ...StepOption) ([]*pb.UnifiedItemResult, error) {
	r, err := unary(c, ctx, c.rpc.UnifiedDecode, &pb.UnifiedDecodeRequest{ModelId: modelID, Items: items,
		ClientStepId: steps(opts).stepID})
	return r.GetResults(), err
}

// Int32Tensor is a [rows, cols] INT32 tensor of token ids (each row the same length), for Forward.
func Int32Tensor(rows [][]int32) (*pb.Tensor, error) {
	if len(rows) == 0 || len(rows[0]) == 0 {
		return nil, fmt.Errorf("ferrum: Int32Tensor needs at least one non-empty row")
	}
	cols := len(rows[0])
	data := make([]byte, 0, 4*cols*len(rows))
	for i, r := range rows {
		if len(r) != cols {
			return nil, fmt.Errorf("ferrum: Int32Tensor row %d has %d ids, row 0 has %d", i, len(r), cols)
		}
		for _, t := range r {
			data = binary.LittleEndian.AppendUint32(data, uint32(t))
		}
	}
	return &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_INT32, Shape: []int64{int64(len(rows)), int64(cols)}, Data: data}, nil
}

// Forward is a cache-less forward of a tensor (token ids [batch, seq] for causal LMs: logits in
// logitsDtype; hidden states for encoders). UNIMPLEMENTED unless the executor supports it.
func (c *Client) Forward(ctx context.Context, modelID string, input *pb.Tensor, logitsDtype pb.DataType) (*pb.ForwardResponse, error) {
	return unary(c, ctx, c.rpc.Forward, &pb.ForwardRequest{ModelId: modelID, Input: input, LogitsDtype: logitsDtype})
}

// ForkOption adjusts ForkCache.
type ForkOption func(*pb.ForkCacheRequest)

// KeepTokens makes the fork start with the source's first n tokens (default: all of them).
func KeepTokens(n uint64) ForkOption { return func(r *pb.ForkCacheRequest) { r.KeepTokens = &n } }

// ForkReserve is the fork's total token reservation (as Reserve for Prefill).
func ForkReserve(n uint64) ForkOption { return func(r *pb.ForkCacheRequest) { r.ReserveTokens = n } }

// ForkStepID makes the fork safe to retry (see StepID).
func ForkStepID(id string) ForkOption { return func(r *pb.ForkCacheRequest) { r.ClientStepId = id } }

// ForkCacheRequest builds the request ForkCache sends (also usable as a Session step).
func ForkCacheRequest(modelID, cacheID string, opts ...ForkOption) *pb.ForkCacheRequest {
	r := &pb.ForkCacheRequest{ModelId: modelID, CacheId: cacheID}
	for _, o := range opts {
		o(r)
	}
	return r
}

// ForkCache makes a new cache sharing cacheID's first tokens copy-on-write (parallel sampling,
// beam search, agent branches): neither cache ever sees the other's later tokens. SharedBlocks
// counts the blocks shared without new memory.
func (c *Client) ForkCache(ctx context.Context, modelID, cacheID string, opts ...ForkOption) (*pb.ForkCacheResponse, error) {
	return unary(c, ctx, c.rpc.ForkCache, ForkCacheRequest(modelID, cacheID, opts...))
}

// ReserveKvSlots is paged-KV admission at a batch boundary (RESOURCE_EXHAUSTED = defer).
func (c *Client) ReserveKvSlots(ctx context.Context, modelID string, requests []*pb.KvSlotRequest) (*pb.ReserveKvSlotsResponse, error) {
	return unary(c, ctx, c.rpc.ReserveKvSlots, &pb.ReserveKvSlotsRequest{ModelId: modelID, Requests: requests})
}

// KvSlotCapacity is the model's KV slot snapshot (Snapshot nil where the executor does not page).
func (c *Client) KvSlotCapacity(ctx context.Context, modelID string) (*pb.KvSlotCapacityResponse, error) {
	return unary(c, ctx, c.rpc.KvSlotCapacity, &pb.KvSlotCapacityRequest{ModelId: modelID})
}

// CacheMetrics is the executor's cache metrics (Metrics nil = none).
func (c *Client) CacheMetrics(ctx context.Context, modelID string) (*pb.CacheMetricsResponse, error) {
	return unary(c, ctx, c.rpc.CacheMetrics, &pb.CacheMetricsRequest{ModelId: modelID})
}

// LoraMetrics is the executor's LoRA metrics (Metrics nil = no LoRA runtime).
func (c *Client) LoraMetrics(ctx context.Context, modelID string) (*pb.LoraMetricsResponse, error) {
	return unary(c, ctx, c.rpc.LoraMetrics, &pb.LoraMetricsRequest{ModelId: modelID})
}

// Warmup warms a model up (every model when modelID is ""). An admin RPC.
func (c *Client) Warmup(ctx context.Context, modelID string) (*pb.WarmupResponse, error) {
	return unary(c, ctx, c.rpc.Warmup, &pb.WarmupRequest{ModelId: modelID})
}

// Shutdown stops serving a model (every model when modelID is ""), freeing its caches. An admin RPC.
func (c *Client) Shutdown(ctx context.Context, modelID string) (*pb.ShutdownResponse, error) {
	return unary(c, ctx, c.rpc.Shutdown, &pb.ShutdownRequest{ModelId: modelID})
}

// Loads is each hosted model's load (every model's when modelID is ""): caches, resident and free
// tokens, running and queued steps, latencies, prefix-cache counters, and the KV-event sequence
// number it was read at. Cheap: call it before placement decisions.
func (c *Client) Loads(ctx context.Context, modelID string) (*pb.LoadsResponse, error) {
	return unary(c, ctx, c.rpc.Loads, &pb.LoadsRequest{ModelId: modelID})
}

// ModelLoad picks modelID's entry from a Loads response (nil when absent).
func ModelLoad(r *pb.LoadsResponse, modelID string) *pb.ModelLoad {
	for _, l := range r.GetLoads() {
		if l.GetModelId() == modelID {
			return l
		}
	}
	return nil
}

// ListCaches is a snapshot of the caller's live caches (every model's when modelID is ""), with
// the KV-event sequence number it is consistent with (AsOfSeq): apply later events on top.
func (c *Client) ListCaches(ctx context.Context, modelID string) (*pb.ListCachesResponse, error) {
	return unary(c, ctx, c.rpc.ListCaches, &pb.ListCachesRequest{ModelId: modelID})
}

// AbortRequest stops an in-flight Generate by its request id: the stream ends with CANCELLED and
// its cache is freed. Idempotent (AbortedStreams 0 when nothing matched).
func (c *Client) AbortRequest(ctx context.Context, modelID, requestID string) (*pb.AbortResponse, error) {
	return unary(c, ctx, c.rpc.Abort, &pb.AbortRequest{ModelId: modelID, Target: &pb.AbortRequest_RequestId{RequestId: requestID}})
}

// AbortCache releases a cache, ending any stream using it. Idempotent (ReleasedCache false when it
// was already gone).
func (c *Client) AbortCache(ctx context.Context, modelID, cacheID string) (*pb.AbortResponse, error) {
	return unary(c, ctx, c.rpc.Abort, &pb.AbortRequest{ModelId: modelID, Target: &pb.AbortRequest_CacheId{CacheId: cacheID}})
}
