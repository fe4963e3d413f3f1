// Package ferrum is a thin Go client for the ferrum executor contract (ferrum.executor.v1): the
// ModelExecutor service of ferrum-service, driven step by step (Prefill, Decode, BatchDecode,
// ForwardVerify, TruncateKv, ReleaseCache), with the decode loop on the server (Generate), or on
// one bidirectional stream (Session).
//
//	c, err := ferrum.Dial("127.0.0.1:50051")
//	out, err := c.Prefill(ctx, "tiny", []int32{1, 2, 3})
//	step, err := c.Decode(ctx, "tiny", out.GetCache().GetCacheId(), ferrum.Token(out.GetOutput()))
//
// Every method takes a context: its deadline is the call's deadline (a default applies when it has
// none, see WithDefaultTimeout) and cancelling it cancels the call. Failed calls return an *Error.
// The generated messages and stubs are in package executorv1 (import path .../gen/ferrum/executor/v1).
package ferrum

import (
	"context"
	"crypto/tls"
	"fmt"
	"sync"
	"time"

	pb "github.com/ferrum-service/ferrum-service/clients/go/gen/ferrum/executor/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
)

// Client calls one ferrum-service server. It is safe for concurrent use.
type Client struct {
	conn           *grpc.ClientConn
	rpc            pb.ModelExecutorClient
	health         healthpb.HealthClient
	defaultTimeout time.Duration
	token          string
	// kept to open the same kind of connection to another server (a migrated stream's new home)
	opts     []Option
	mu       sync.Mutex
	siblings map[string]*Client
}

type dialConfig struct {
	tls            *tls.Config
	token          string
	defaultTimeout time.Duration
	maxMsgBytes    int
	extra          []grpc.DialOption
}

// Option configures Dial.
type Option func(*dialConfig)

// WithTLS connects with TLS (add client certificates to cfg for mutual TLS). Default: plaintext.
func WithTLS(cfg *tls.Config) Option { return func(d *dialConfig) { d.tls = cfg } }

// WithToken sends "authorization: Bearer <token>" with every call.
func WithToken(token string) Option { return func(d *dialConfig) { d.token = token } }

// WithDefaultTimeout is the deadline of unary calls whose context has none (default 60 s; 0 = none).
func WithDefaultTimeout(d time.Duration) Option {
	return func(c *dialConfig) { c.defaultTimeout = d }
}

// WithMaxMessageBytes bounds messages in both directions (default 64 MiB: full logits rows are big).
func WithMaxMessageBytes(n int) Option { return func(d *dialConfig) { d.maxMsgBytes = n } }

// WithDialOptions passes extra grpc.DialOptions (interceptors, keepalive, ...).
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(d *dialConfig) { d.extra = append(d.extra, opts...) }
}

// Dial creates a client for target ("host:port", or any gRPC target such as "dns:///svc:50051").
// It does not wait for the connection; see WaitReady.
func Dial(target string, opts ...Option) (*Client, error) {
	cfg := dialConfig{defaultTimeout: 60 * time.Second, maxMsgBytes: 64 << 20}
	for _, o := range opts {
		o(&cfg)
	}
	creds := insecure.NewCredentials()
	if cfg.tls != nil {
		creds = credentials.NewTLS(cfg.tls)
	}
	dopts := []grpc.DialOption{
		grpc.WithTransportCredentials(creds),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(cfg.maxMsgBytes), grpc.MaxCallSendMsgSize(cfg.maxMsgBytes)),
	}
	dopts = append(dopts, cfg.extra...)
	conn, err := grpc.NewClient(target, dopts...)
	if err != nil {
		return nil, fmt.Errorf("ferrum: dial %s: %w", target, err)
	}
	return &Client{conn: conn, rpc: pb.NewModelExecutorClient(conn), health: healthpb.NewHealthClient(conn),
		defaultTimeout: cfg.defaultTimeout, token: cfg.token, opts: append([]Option(nil), opts...)}, nil
}

// Close closes the connection (and those opened to follow migrated streams).
func (c *Client) Close() error {
	c.mu.Lock()
	sib := c.siblings
	c.siblings = nil
	c.mu.Unlock()
	for _, s := range sib {
		_ = s.Close()
	}
	return c.conn.Close()
}

// Raw is the generated stub, for RPCs and fields this package does not wrap. Calls made through it
// carry no bearer token and no default deadline.
func (c *Client) Raw() pb.ModelExecutorClient { return c.rpc }

func (c *Client) ctx(ctx context.Context) context.Context {
	if c.token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+c.token)
	}
	return ctx
}

// unary runs a unary call with the default deadline when ctx has none, wrapping errors.
func unary[Req, Resp any](c *Client, ctx context.Context, call func(context.Context, Req, ...grpc.CallOption) (Resp, error), req Req) (Resp, error) {
	ctx = c.ctx(ctx)
	if _, ok := ctx.Deadline(); !ok && c.defaultTimeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.defaultTimeout)
		defer cancel()
	}
	resp, err := call(ctx, req)
	return resp, wrapErr(err)
}

// Health is the grpc.health.v1 status of service ("" = the whole server): "SERVING", "NOT_SERVING", ...
func (c *Client) Health(ctx context.Context, service string) (string, error) {
	r, err := unary(c, ctx, c.health.Check, &healthpb.HealthCheckRequest{Service: service})
	if err != nil {
		return "", err
	}
	return r.GetStatus().String(), nil
}

// WaitReady polls Health until the server says SERVING or ctx ends.
func (c *Client) WaitReady(ctx context.Context) error {
	for {
		hctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		s, err := c.Health(hctx, "")
		cancel()
		if err == nil && s == "SERVING" {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("ferrum: server not ready: %w (last: %q, %v)", ctx.Err(), s, err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Info is the metadata of the hosted models (all of them when modelID is "").
func (c *Client) Info(ctx context.Context, modelID string) (*pb.InfoResponse, error) {
	return unary(c, ctx, c.rpc.Info, &pb.InfoRequest{ModelId: modelID})
}

// Capabilities of a model's executor.
func (c *Client) Capabilities(ctx context.Context, modelID string) (*pb.ExecutorCapabilities, error) {
	r, err := unary(c, ctx, c.rpc.Capabilities, &pb.CapabilitiesRequest{ModelId: modelID})
	return r.GetCapabilities(), err
}

// KvCapacity of a model's executor.
func (c *Client) KvCapacity(ctx context.Context, modelID string) (*pb.KvCapacity, error) {
	r, err := unary(c, ctx, c.rpc.KvCapacity, &pb.KvCapacityRequest{ModelId: modelID})
	return r.GetCapacity(), err
}

// Tokenize text with the model's tokenizer.
func (c *Client) Tokenize(ctx context.Context, modelID, text string, addSpecialTokens bool) ([]int32, error) {
	r, err := unary(c, ctx, c.rpc.Tokenize, &pb.TokenizeRequest{ModelId: modelID, Text: text, AddSpecialTokens: addSpecialTokens})
	return r.GetTokenIds(), err
}

// Detokenize token ids with the model's tokenizer.
func (c *Client) Detokenize(ctx context.Context, modelID string, ids []int32, skipSpecialTokens bool) (string, error) {
	r, err := unary(c, ctx, c.rpc.Detokenize, &pb.DetokenizeRequest{ModelId: modelID, TokenIds: ids, SkipSpecialTokens: skipSpecialTokens})
	return r.GetText(), err
}

// StepOption adjusts a step request. Options that do not apply to a step are ignored.
type StepOption func(*stepConfig)

type stepConfig struct {
	cacheID      string
	policy       *pb.LogitsPolicy
	position     *uint64
	reserve      uint64
	allPositions bool
	stepID       string
	requestID    string
	adapter      string
	cacheSalt    string
	bypassPrefix bool
}

// Continue (Prefill) appends the tokens to an existing cache instead of creating one (chunked prefill).
func Continue(cacheID string) StepOption { return func(s *stepConfig) { s.cacheID = cacheID } }

// WithPolicy sets what the step returns per logits row (default: a greedy token).
func WithPolicy(p *pb.LogitsPolicy) StepOption { return func(s *stepConfig) { s.policy = p } }

// WithSampling samples the returned token with p instead of greedily.
func WithSampling(p *pb.SamplingParams) StepOption {
	return func(s *stepConfig) {
		if s.policy == nil {
			s.policy = &pb.LogitsPolicy{}
		}
		s.policy.Sampling = p
	}
}

// AtPosition (Decode) makes the server check that the token is written at position pos.
func AtPosition(pos uint64) StepOption { return func(s *stepConfig) { s.position = &pos } }

// Reserve (Prefill) asks the executor to promise KV for n tokens in total (prompt + new tokens).
func Reserve(n uint64) StepOption { return func(s *stepConfig) { s.reserve = n } }

// AllPositions (Prefill) returns the policy's output for every prompt position.
func AllPositions() StepOption { return func(s *stepConfig) { s.allPositions = true } }

// StepID makes the step safe to retry: the server applies a step id at most once.
func StepID(id string) StepOption { return func(s *stepConfig) { s.stepID = id } }

// RequestID (Prefill) is the caller's id for the request, echoed in logs and KV events.
func RequestID(id string) StepOption { return func(s *stepConfig) { s.requestID = id } }

// Adapter (Prefill) computes a new cache with the LoRA adapter name (registered with LoadAdapter)
// and binds the cache to it; continuing a cache, the cache's own adapter applies when this is unset.
func Adapter(name string) StepOption { return func(s *stepConfig) { s.adapter = name } }

// CacheSalt (Prefill of a new cache) keys its prefix-cache blocks under salt: tenants with
// different salts never share KV blocks ("" = the shared space).
func CacheSalt(salt string) StepOption { return func(s *stepConfig) { s.cacheSalt = salt } }

// BypassPrefixCache (Prefill of a new cache) computes every token: nothing is taken from the
// prefix cache (its full blocks are still cached for later requests).
func BypassPrefixCache() StepOption { return func(s *stepConfig) { s.bypassPrefix = true } }

func steps(opts []StepOption) stepConfig {
	var s stepConfig
	for _, o := range opts {
		o(&s)
	}
	return s
}

// PrefillRequest builds the request Prefill sends (also usable as a Session step).
func PrefillRequest(modelID string, tokens []int32, opts ...StepOption) *pb.PrefillRequest {
	s := steps(opts)
	return &pb.PrefillRequest{ModelId: modelID, ClientStepId: s.stepID, Input: &pb.PrefillInput{
		TokenIds: tokens, CacheId: s.cacheID, Logits: s.policy, ReserveTokens: s.reserve,
		AllPositions: s.allPositions, RequestId: s.requestID, Adapter: s.adapter, CacheSalt: s.cacheSalt,
		BypassPrefixCache: s.bypassPrefix,
	}}
}

// DecodeInput builds one decode input (for BatchDecode).
func DecodeInput(cacheID string, token int32, opts ...StepOption) *pb.DecodeInput {
	s := steps(opts)
	return &pb.DecodeInput{CacheId: cacheID, TokenId: token, Logits: s.policy, Position: s.position}
}

// DecodeRequest builds the request Decode sends (also usable as a Session step).
func DecodeRequest(modelID, cacheID string, token int32, opts ...StepOption) *pb.DecodeRequest {
	return &pb.DecodeRequest{ModelId: modelID, Input: DecodeInput(cacheID, token, opts...), ClientStepId: steps(opts).stepID}
}

// PrefillInput builds one prompt of BatchPrefill (the options of PrefillRequest).
func PrefillInput(tokens []int32, opts ...StepOption) *pb.PrefillInput {
	return PrefillRequest("", tokens, opts...).GetInput()
}

// Prefill runs a prompt (or a chunk of one, with Continue) and returns the cache and the last
// position's output; CachedTokens says how many leading tokens came from the prefix cache.
func (c *Client) Prefill(ctx context.Context, modelID string, tokens []int32, opts ...StepOption) (*pb.PrefillOutput, error) {
	r, err := unary(c, ctx, c.rpc.Prefill, PrefillRequest(modelID, tokens, opts...))
	return r.GetOutput(), err
}

// BatchPrefill runs several prompts in one forward (all or nothing).
func (c *Client) BatchPrefill(ctx context.Context, modelID string, inputs []*pb.PrefillInput) ([]*pb.PrefillOutput, error) {
	r, err := unary(c, ctx, c.rpc.BatchPrefill, &pb.BatchPrefillRequest{ModelId: modelID, Inputs: inputs})
	return r.GetOutputs(), err
}

// Decode feeds one token into a cache and returns the next output.
func (c *Client) Decode(ctx context.Context, modelID, cacheID string, token int32, opts ...StepOption) (*pb.DecodeOutput, error) {
	r, err := unary(c, ctx, c.rpc.Decode, DecodeRequest(modelID, cacheID, token, opts...))
	return r.GetOutput(), err
}

// BatchDecode feeds one token into each of several caches in one forward; one output per input,
// in input order (all or nothing).
func (c *Client) BatchDecode(ctx context.Context, modelID string, inputs []*pb.DecodeInput) ([]*pb.DecodeOutput, error) {
	r, err := unary(c, ctx, c.rpc.BatchDecode, &pb.BatchDecodeRequest{ModelId: modelID, Inputs: inputs})
	return r.GetOutputs(), err
}

// ForwardVerify writes tokens (the last accepted token, then the drafts) into a cache in one
// forward and returns one output per token. With acceptGreedyPrefix the server accepts the drafts
// that match its greedy tokens and truncates the cache itself.
func (c *Client) ForwardVerify(ctx context.Context, modelID, cacheID string, tokens []int32, acceptGreedyPrefix bool, opts ...StepOption) (*pb.ForwardVerifyResponse, error) {
	s := steps(opts)
	return unary(c, ctx, c.rpc.ForwardVerify, &pb.ForwardVerifyRequest{ModelId: modelID, CacheId: cacheID, TokenIds: tokens,
		AcceptGreedyPrefix: acceptGreedyPrefix, Logits: s.policy, ClientStepId: s.stepID})
}

// TruncateKv rolls a cache back to newLen tokens.
func (c *Client) TruncateKv(ctx context.Context, modelID, cacheID string, newLen int64, opts ...StepOption) (*pb.TruncateKvResponse, error) {
	return unary(c, ctx, c.rpc.TruncateKv, &pb.TruncateKvRequest{ModelId: modelID, CacheId: cacheID, NewLen: newLen,
		ClientStepId: steps(opts).stepID})
}

// ReleaseCache frees a cache (idempotent: Released is false when it was already gone).
func (c *Client) ReleaseCache(ctx context.Context, modelID, cacheID string, opts ...StepOption) (*pb.ReleaseCacheResponse, error) {
	return unary(c, ctx, c.rpc.ReleaseCache, &pb.ReleaseCacheRequest{ModelId: modelID, CacheId: cacheID,
		ClientStepId: steps(opts).stepID})
}

// LoadAdapter registers the LoRA adapter in the PEFT directory path (on the server's filesystem)
// under name on a model; requests then name it (Adapter, GenerateRequest.Adapter). Loading the same
// name and path again is a no-op (Loaded false). An admin RPC.
func (c *Client) LoadAdapter(ctx context.Context, modelID, name, path string) (*pb.LoadAdapterResponse, error) {
	return unary(c, ctx, c.rpc.LoadAdapter, &pb.LoadAdapterRequest{ModelId: modelID, Name: name, Path: path})
}

// UnloadAdapter forgets a LoRA adapter (FAILED_PRECONDITION while a live cache is bound to it;
// Unloaded is false when it was not loaded). An admin RPC.
func (c *Client) UnloadAdapter(ctx context.Context, modelID, name string) (*pb.UnloadAdapterResponse, error) {
	return unary(c, ctx, c.rpc.UnloadAdapter, &pb.UnloadAdapterRequest{ModelId: modelID, Name: name})
}

// ListAdapters is the LoRA adapters registered on a model (every model's when modelID is "").
func (c *Client) ListAdapters(ctx context.Context, modelID string) ([]*pb.AdapterInfo, error) {
	r, err := unary(c, ctx, c.rpc.ListAdapters, &pb.ListAdaptersRequest{ModelId: modelID})
	return r.GetAdapters(), err
}

// Token is the sampled token of an output (-1 when the output has none, e.g. full-logits mode).
func Token(o *pb.LogitsOutput) int32 {
	if o == nil || o.TokenId == nil {
		return -1
	}
	return *o.TokenId
}
