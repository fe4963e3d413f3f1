package ferrum

import (
	"context"
	"fmt"
	"iter"

	pb "github.com/ferrum-service/ferrum-service/clients/go/gen/ferrum/executor/v1"
)

// ExportOption adjusts ExportKv.
type ExportOption func(*pb.ExportKvRequest)

// ExportRange exports tokens [from, to) of the cache (to 0 = its end).
func ExportRange(from, to uint64) ExportOption {
	return func(r *pb.ExportKvRequest) { r.FromToken, r.ToToken = from, to }
}

// ExportChunkBytes caps the K+V bytes per chunk (0 = the server's default, 1 MiB).
func ExportChunkBytes(n uint32) ExportOption {
	return func(r *pb.ExportKvRequest) { r.MaxChunkBytes = n }
}

// ExportKv streams a cache's K/V out: one KvTransferHeader (model, weights fingerprint, KV dtype
// and shape, the tokens and positions, the state format), then checksummed KvChunks. The cache is
// held meanwhile and not changed. UNIMPLEMENTED when the executor cannot transfer KV.
func (c *Client) ExportKv(ctx context.Context, modelID, cacheID string, opts ...ExportOption) iter.Seq2[*pb.ExportKvResponse, error] {
	req := &pb.ExportKvRequest{ModelId: modelID, CacheId: cacheID}
	for _, o := range opts {
		o(req)
	}
	return serverStream(c.ctx(ctx), func(ctx context.Context) (receiver[*pb.ExportKvResponse], error) {
		return c.rpc.ExportKv(ctx, req)
	})
}

// KvExport is a whole export: its header and chunks (ExportKvAll), e.g. to store or relay later.
type KvExport struct {
	Header *pb.KvTransferHeader
	Chunks []*pb.KvChunk
}

// ExportKvAll runs ExportKv to the end and collects the header and chunks.
func (c *Client) ExportKvAll(ctx context.Context, modelID, cacheID string, opts ...ExportOption) (*KvExport, error) {
	out := &KvExport{}
	for m, err := range c.ExportKv(ctx, modelID, cacheID, opts...) {
		if err != nil {
			return nil, err
		}
		if h := m.GetHeader(); h != nil {
			out.Header = h
		} else if ch := m.GetChunk(); ch != nil {
			out.Chunks = append(out.Chunks, ch)
		}
	}
	if out.Header == nil {
		return nil, fmt.Errorf("ferrum: ExportKv of %q sent no header", cacheID)
	}
	return out, nil
}

// Messages yields the export as ExportKvResponse messages (for ImportKv).
func (e *KvExport) Messages() iter.Seq2[*pb.ExportKvResponse, error] {
	return func(yield func(*pb.ExportKvResponse, error) bool) {
		if !yield(&pb.ExportKvResponse{Message: &pb.ExportKvResponse_Header{Header: e.Header}}, nil) {
			return
		}
		for _, ch := range e.Chunks {
			if !yield(&pb.ExportKvResponse{Message: &pb.ExportKvResponse_Chunk{Chunk: ch}}, nil) {
				return
			}
		}
	}
}

// ImportOption adjusts the first message of ImportKv and PullKv.
type ImportOption func(*pb.ImportKvRequest)

// ImportReserve admits and reserves KV for n tokens in total (imported + to decode) up front.
func ImportReserve(n uint64) ImportOption { return func(r *pb.ImportKvRequest) { r.ReserveTokens = n } }

// ImportCacheSalt keys the imported blocks under salt (as CacheSalt for Prefill).
func ImportCacheSalt(salt string) ImportOption {
	return func(r *pb.ImportKvRequest) { r.CacheSalt = salt }
}

// ImportRequestID is the caller's id for the import, echoed in logs and KV events.
func ImportRequestID(id string) ImportOption { return func(r *pb.ImportKvRequest) { r.RequestId = id } }

func (c *Client) streamCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	ctx = c.ctx(ctx)
	if _, ok := ctx.Deadline(); !ok && c.defaultTimeout > 0 {
		return context.WithTimeout(ctx, c.defaultTimeout)
	}
	return context.WithCancel(ctx)
}

// ImportKv makes a new cache (the caller's) from exported K/V: the messages of another server's
// ExportKv (or a KvExport), relayed by this client. The first message is read before the import
// opens, so a source's refusal comes back as its own error; a source that fails later aborts the
// import (all or nothing: no cache, no block is left). Prefer PullKv between servers that reach
// each other: the bytes then do not pass through the client.
func (c *Client) ImportKv(ctx context.Context, modelID string, exported iter.Seq2[*pb.ExportKvResponse, error], opts ...ImportOption) (*pb.ImportKvResponse, error) {
	next, stop := iter.Pull2(exported)
	defer stop()
	first, err, ok := next()
	if !ok {
		return nil, fmt.Errorf("ferrum: ImportKv: the export sent nothing")
	}
	if err != nil {
		return nil, err
	}
	if first.GetHeader() == nil {
		return nil, fmt.Errorf("ferrum: ImportKv: the export's first message is not a header")
	}
	head := &pb.ImportKvRequest{ModelId: modelID, Data: &pb.ImportKvRequest_Header{Header: first.GetHeader()}}
	for _, o := range opts {
		o(head)
	}
	ctx, cancel := c.streamCtx(ctx)
	defer cancel()
	stream, err := c.rpc.ImportKv(ctx)
	if err != nil {
		return nil, wrapErr(err)
	}
	send := func(m *pb.ImportKvRequest) (stopped bool) {
		// io.EOF: the server ended the call (its status comes from CloseAndRecv)
		return stream.Send(m) != nil
	}
	if !send(head) {
		for {
			m, serr, ok := next()
			if !ok {
				break
			}
			if serr != nil {
				cancel() // the import must not commit a partial cache
				return nil, serr
			}
			if send(&pb.ImportKvRequest{Data: &pb.ImportKvRequest_Chunk{Chunk: m.GetChunk()}}) {
				break
			}
		}
	}
	resp, err := stream.CloseAndRecv()
	return resp, wrapErr(err)
}

// KvSourceOf names a cache on another server for PullKv: target is HOST:PORT as the importing
// server reaches it. Set TLS, ModelId (when it differs), the token range or MaxChunkBytes on it.
func KvSourceOf(target, cacheID string) *pb.KvSource {
	return &pb.KvSource{Target: target, CacheId: cacheID}
}

// PullKv makes a new cache on this server from a cache on another: this server calls ExportKv on
// source.Target itself (with this call's bearer token), so the bytes never pass through the client.
func (c *Client) PullKv(ctx context.Context, modelID string, source *pb.KvSource, opts ...ImportOption) (*pb.ImportKvResponse, error) {
	req := &pb.ImportKvRequest{ModelId: modelID, Source: source}
	for _, o := range opts {
		o(req)
	}
	ctx, cancel := c.streamCtx(ctx)
	defer cancel()
	stream, err := c.rpc.ImportKv(ctx)
	if err != nil {
		return nil, wrapErr(err)
	}
	_ = stream.Send(req) // a failure shows in CloseAndRecv's status
	resp, err := stream.CloseAndRecv()
	return resp, wrapErr(err)
}

// PushKv moves a cache from src to dst through this client (ExportKv on src relayed into ImportKv
// on dst). The source cache is left as it was.
func PushKv(ctx context.Context, src, dst *Client, modelID, cacheID string, opts ...ImportOption) (*pb.ImportKvResponse, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	return dst.ImportKv(ctx, modelID, src.ExportKv(ctx, modelID, cacheID), opts...)
}
