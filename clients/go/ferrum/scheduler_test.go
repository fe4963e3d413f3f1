package ferrum_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ferrum-service/ferrum-service/clients/go/ferrum"
	pb "github.com/ferrum-service/ferrum-service/clients/go/gen/ferrum/executor/v1"
	"github.com/ferrum-service/ferrum-service/clients/go/internal/testserver"
	"google.golang.org/grpc/codes"
)

// long is a 40-token prompt: two full prefix-cache blocks of 16 and 8 more tokens.
var long = func() []int32 {
	out := []int32{1}
	for i := int32(0); i < 39; i++ {
		out = append(out, 100+i)
	}
	return out
}()

// twoServers starts two more fresh servers hosting the tiny llama (the package server is shared by
// the other tests): a prefill-role and a decode-role one when roles is true, plain ones otherwise.
func twoServers(t *testing.T, ctx context.Context, roles bool) (a, b *testserver.Server) {
	t.Helper()
	client(t) // skips (or fails in CI) without a server
	tiny, err := testserver.TinyModelDir(ctx)
	if err != nil {
		t.Fatal(err)
	}
	models := []string{"hf-causal-lm,id=tiny,path=" + tiny}
	// B pulls KV from A: a server pulls only from peers its operator names (--kv-peer)
	argsA, argsB := []string{}, []string{"--kv-peer", "127.0.0.1:1024-65535"}
	if roles {
		argsA, argsB = []string{"--role", "prefill"}, []string{"--role", "decode", "--kv-peer", "127.0.0.1:1024-65535"}
	}
	if a, err = testserver.Start(ctx, models, argsA...); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Stop)
	if b, err = testserver.Start(ctx, models, argsB...); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Stop)
	return a, b
}

func dial(t *testing.T, target string) *ferrum.Client {
	t.Helper()
	c, err := ferrum.Dial(target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// The router sends a prompt to the replica that holds its prefix, whatever the load; a prompt
// nobody holds goes to the less loaded replica; salts and the followers' resets are honoured.
func TestPrefixRouterLongestPrefixThenLeastLoaded(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	sa, sb := twoServers(t, ctx, false)
	ca, cb := dial(t, sa.Target), dial(t, sb.Target)
	r := ferrum.NewPrefixRouterOf(map[string]*ferrum.Client{sa.Target: ca, sb.Target: cb})
	defer r.Close()

	// B holds the prompt's prefix (a live cache) and A is busier (two live caches)
	must(cb.Prefill(ctx, "tiny", long))
	for i := int32(0); i < 2; i++ {
		must(ca.Prefill(ctx, "tiny", []int32{7, 8, 9 + i}))
	}
	if err := r.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	p := must(r.Pick(ctx, "tiny", long, "", ""))
	if p.Replica.Target != sb.Target || p.CachedTokens != 32 {
		t.Fatalf("picked %s with %d cached tokens, want %s with 32", p.Replica.Target, p.CachedTokens, sb.Target)
	}
	// the replica really has them: its prefill reports the hit the mirror predicted
	out := must(p.Replica.Client.Prefill(ctx, "tiny", long))
	if out.GetCachedTokens() != uint64(p.CachedTokens) {
		t.Fatalf("mirror said %d cached tokens, the prefill took %d", p.CachedTokens, out.GetCachedTokens())
	}
	// under another salt nobody holds it: least loaded wins (B has 2 caches now, A 2: more free KV
	// decides; load A up so that B wins clearly)
	must(ca.Prefill(ctx, "tiny", []int32{7, 8, 20}))
	p = must(r.Pick(ctx, "tiny", long, "tenant-x", ""))
	if p.CachedTokens != 0 || p.Replica.Target != sb.Target {
		t.Fatalf("salted prompt: picked %s with %d cached, want %s with 0", p.Replica.Target, p.CachedTokens, sb.Target)
	}
	// a prompt A alone holds goes to A although A is busier
	must(ca.Prefill(ctx, "tiny", append([]int32{5}, long[1:]...)))
	if err := r.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	p = must(r.Pick(ctx, "tiny", append([]int32{5}, long[1:]...), "", ""))
	if p.Replica.Target != sa.Target || p.CachedTokens != 32 {
		t.Fatalf("picked %s with %d cached tokens, want %s with 32", p.Replica.Target, p.CachedTokens, sa.Target)
	}
	// a replica that stops answering (crashed) gets no new work
	sb.Kill()
	p = must(r.Pick(ctx, "tiny", long, "", ""))
	if p.Replica.Target != sa.Target {
		t.Fatalf("picked the stopped replica %s", p.Replica.Target)
	}
}

// Prefill on a prefill-role server, hand the cache to a decode-role server (pull and push), and
// decode there: the continuation equals the one decoded on a server that did everything.
func TestDisaggregatedPrefillThenDecode(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, _ := client(t)
	want := must(c.GenerateAll(ctx, ferrum.GenerateTokens("tiny", long, ferrum.GenMaxTokens(5), ferrum.GenIgnoreEOS())))
	sp, sd := twoServers(t, ctx, true)
	pre, dec := dial(t, sp.Target), dial(t, sd.Target)
	for _, pull := range []bool{true, false} {
		d := &ferrum.Disaggregated{Prefill: pre, Decode: dec}
		if pull {
			d.PrefillTarget = sp.Target
		}
		h := must(d.Run(ctx, "tiny", long, uint64(len(long)+8)))
		if h.Cache.GetNumTokens() != uint64(len(long)) || h.Import.GetImportedTokens() != uint64(len(long)) {
			t.Fatalf("pull=%v: handoff %v / %v", pull, h.Cache, h.Import)
		}
		got := []int32{h.Token}
		for len(got) < 5 {
			out := must(dec.Decode(ctx, "tiny", h.Cache.GetCacheId(), got[len(got)-1]))
			got = append(got, ferrum.Token(out.GetOutput()))
		}
		if !equal(got, want.Tokens) {
			t.Fatalf("pull=%v: decoded %v after the handoff, a single server %v", pull, got, want.Tokens)
		}
		// the prefill server's cache was released; the decode server refuses new prompts
		if caches := must(pre.ListCaches(ctx, "tiny")).GetCaches(); len(caches) != 0 {
			t.Fatalf("pull=%v: the prefill server still holds %v", pull, caches)
		}
		must(dec.ReleaseCache(ctx, "tiny", h.Cache.GetCacheId()))
	}
	if _, err := dec.Prefill(ctx, "tiny", long); ferrum.Code(err) != codes.FailedPrecondition {
		t.Fatalf("prefill on the decode server: %v", err)
	}
	// a source that refuses: its own code comes back, for push as for pull
	d := &ferrum.Disaggregated{Prefill: pre, Decode: dec}
	if _, err := d.Move(ctx, "tiny", "no-such-cache"); ferrum.Code(err) != codes.NotFound {
		t.Fatalf("push of an unknown cache: %v", err)
	}
	d.PrefillTarget = sp.Target
	if _, err := d.Move(ctx, "tiny", "no-such-cache"); ferrum.Code(err) != codes.NotFound {
		t.Fatalf("pull of an unknown cache: %v", err)
	}
	// nothing was left behind on the decode server
	if caches := must(dec.ListCaches(ctx, "tiny")).GetCaches(); len(caches) != 0 {
		t.Fatalf("the decode server holds %v after failed moves", caches)
	}
}

// A stored export can be imported later, twice (two independent caches); a truncated export
// (chunks missing) is refused as a whole.
func TestExportKvAllThenImport(t *testing.T) {
	c, ctx := client(t)
	src := must(c.Prefill(ctx, "tiny", long)).GetCache().GetCacheId()
	defer c.ReleaseCache(ctx, "tiny", src)
	exp := must(c.ExportKvAll(ctx, "tiny", src, ferrum.ExportChunkBytes(4096)))
	if exp.Header.GetFromToken() != 0 || exp.Header.GetToToken() != uint64(len(long)) || len(exp.Chunks) < 2 ||
		int(exp.Header.GetNumChunks()) != len(exp.Chunks) || !equal(exp.Header.GetTokenIds(), long) {
		t.Fatalf("export header %v with %d chunks", exp.Header, len(exp.Chunks))
	}
	for i := 0; i < 2; i++ {
		r := must(c.ImportKv(ctx, "tiny", exp.Messages(), ferrum.ImportReserve(64)))
		if r.GetImportedTokens() != uint64(len(long)) || r.GetChunks() != uint32(len(exp.Chunks)) {
			t.Fatalf("import %d: %v", i, r)
		}
		must(c.ReleaseCache(ctx, "tiny", r.GetCache().GetCacheId()))
	}
	short := &ferrum.KvExport{Header: exp.Header, Chunks: exp.Chunks[:len(exp.Chunks)-1]}
	if _, err := c.ImportKv(ctx, "tiny", short.Messages()); ferrum.Code(err) != codes.DataLoss {
		t.Fatalf("import with a chunk missing: %v", err)
	}
	// a source that breaks off after its first chunk: that error comes back, no cache is left
	broken := errors.New("source went away")
	breaking := func(yield func(*pb.ExportKvResponse, error) bool) {
		n := 0
		for m, err := range exp.Messages() {
			if n == 2 {
				yield(nil, broken)
				return
			}
			n++
			if !yield(m, err) {
				return
			}
		}
	}
	before := len(must(c.ListCaches(ctx, "tiny")).GetCaches())
	if _, err := c.ImportKv(ctx, "tiny", breaking); !errors.Is(err, broken) {
		t.Fatalf("import from a broken source: %v", err)
	}
	time.Sleep(200 * time.Millisecond) // the server sees the cancelled stream
	if after := len(must(c.ListCaches(ctx, "tiny")).GetCaches()); after != before {
		t.Fatalf("a broken import left a cache (%d -> %d)", before, after)
	}
	// an empty export and one without a header are refused before any call
	if _, err := c.ImportKv(ctx, "tiny", func(func(*pb.ExportKvResponse, error) bool) {}); err == nil {
		t.Fatal("an empty export was imported")
	}
	chunkFirst := &ferrum.KvExport{Header: exp.Header, Chunks: exp.Chunks}
	msgs := chunkFirst.Messages()
	if _, err := c.ImportKv(ctx, "tiny", func(yield func(*pb.ExportKvResponse, error) bool) {
		first := true
		for m, err := range msgs {
			if first { // drop the header
				first = false
				continue
			}
			if !yield(m, err) {
				return
			}
		}
	}); err == nil {
		t.Fatal("an export without its header was imported")
	}
}

// Generate n: one Started, a Finished per sample, sample 0 equals a single generation with the
// seed and sample 1 one with SampleSeed(seed, 1).
func TestGenerateNSampleSeeds(t *testing.T) {
	c, ctx := client(t)
	sp := ferrum.Sampling(1.5, ferrum.Seed(11))
	res := must(c.GenerateAll(ctx, ferrum.GenerateTokens("tiny", prompt, ferrum.GenN(3), ferrum.GenMaxTokens(6),
		ferrum.GenIgnoreEOS(), ferrum.GenSampling(sp))))
	if len(res.Samples) != 3 || len(res.FinishedBy) != 3 || !equal(res.Tokens, res.Samples[0]) {
		t.Fatalf("samples %v, finished %v", res.Samples, res.FinishedBy)
	}
	for i := uint32(0); i < 3; i++ {
		one := must(c.GenerateAll(ctx, ferrum.GenerateTokens("tiny", prompt, ferrum.GenMaxTokens(6), ferrum.GenIgnoreEOS(),
			ferrum.GenSampling(ferrum.Sampling(1.5, ferrum.Seed(ferrum.SampleSeed(11, i)))))))
		if !equal(one.Tokens, res.Samples[i]) {
			t.Fatalf("sample %d = %v, a single generation with its seed %v", i, res.Samples[i], one.Tokens)
		}
	}
	if _, err := c.GenerateAll(ctx, ferrum.GenerateTokens("tiny", prompt, ferrum.GenN(65))); ferrum.Code(err) != codes.InvalidArgument {
		t.Fatalf("n=65: %v", err)
	}
}

// A constrained generation parses; a constraint on a model without a tokenizer is refused.
func TestConstrainedGenerate(t *testing.T) {
	c, ctx := client(t)
	res := must(c.GenerateAll(ctx, ferrum.GenerateTokens("tiny", prompt, ferrum.GenMaxTokens(40),
		ferrum.GenSampling(ferrum.Sampling(0, ferrum.Constrain(ferrum.JSONSchema(`{"enum": ["red", "green"]}`)))))))
	if txt := res.Finished.GetText(); txt != `"red"` && txt != `"green"` {
		t.Fatalf("constrained text %q", txt)
	}
	res = must(c.GenerateAll(ctx, ferrum.GenerateTokens("tiny", prompt, ferrum.GenMaxTokens(40),
		ferrum.GenSampling(ferrum.Sampling(0.9, ferrum.Seed(3), ferrum.Constrain(ferrum.Regex(`[a-c]{3}`)))))))
	if txt := res.Finished.GetText(); len(txt) != 3 || txt[0] < 'a' || txt[0] > 'c' {
		t.Fatalf("regex-constrained text %q", txt)
	}
	_, err := c.GenerateAll(ctx, ferrum.GenerateTokens("seq", prompt, ferrum.GenSampling(ferrum.Sampling(0,
		ferrum.Constrain(ferrum.Choice("a", "b"))))))
	if ferrum.Code(err) != codes.FailedPrecondition {
		t.Fatalf("constraint without a tokenizer: %v", err)
	}
}

// Events: replay from a sequence number gives the step's events in order; the follower's mirror
// equals the server's cached block count; Abort ends a generation by request id.
func TestEventsMirrorAndAbort(t *testing.T) {
	c, ctx := client(t)
	mark := must(c.Loads(ctx, "")).GetKvEventSeq()
	cid := must(c.Prefill(ctx, "tiny", long, ferrum.CacheSalt("events-test"))).GetCache().GetCacheId()
	fork := must(c.ForkCache(ctx, "tiny", cid, ferrum.KeepTokens(16))).GetCache().GetCacheId()
	msgs, resync, err := c.EventsUpTo(ctx, mark+1)
	if err != nil || resync {
		t.Fatal(err, resync)
	}
	var kinds []pb.KvEventKind
	stored := 0
	for _, m := range msgs {
		// this test's caches only: a cache another test released may land after the mark
		if e := m.GetEvent(); e != nil && e.GetModelId() == "tiny" && (e.GetCacheId() == cid || e.GetCacheId() == fork) {
			kinds = append(kinds, e.GetKind())
		}
		if b := m.GetBlockEvent(); b != nil && b.GetStored() != nil {
			stored += len(b.GetStored().GetBlockHashes())
		}
	}
	if len(kinds) != 2 || kinds[0] != pb.KvEventKind_KV_EVENT_KIND_CREATED || kinds[1] != pb.KvEventKind_KV_EVENT_KIND_FORKED || stored != 2 {
		t.Fatalf("events since %d: kinds %v, %d blocks stored", mark, kinds, stored)
	}
	m := ferrum.NewPrefixMirror()
	f := ferrum.FollowBlockEvents(ctx, c, m, "", 100*time.Millisecond)
	defer f.Stop()
	loads := must(c.Loads(ctx, "tiny"))
	if !f.WaitSeq(ctx, loads.GetKvEventSeq()) {
		t.Fatal("the follower did not catch up")
	}
	if got, want := m.Len("tiny"), int(ferrum.ModelLoad(loads, "tiny").GetCachedBlocks()); got != want {
		t.Fatalf("mirror holds %d blocks, the server %d", got, want)
	}
	if got := m.CachedTokens("tiny", long, "events-test", ""); got != 32 {
		t.Fatalf("mirror: %d cached tokens under the salt, want 32", got)
	}
	if got := m.CachedTokens("tiny", long, "other-salt", ""); got != 0 {
		t.Fatalf("mirror: %d cached tokens under another salt, want 0", got)
	}
	// abort by request id while the generation runs
	n, aborted := 0, uint32(0)
	var endErr error
	for ev, err := range c.Generate(ctx, ferrum.GenerateTokens("tiny", prompt, ferrum.GenMaxTokens(400), ferrum.GenIgnoreEOS(),
		ferrum.GenRequestID("go-abort-test"))) {
		if err != nil {
			endErr = err
			break
		}
		if ev.GetToken() != nil {
			if n++; n == 2 {
				aborted = must(c.AbortRequest(ctx, "tiny", "go-abort-test")).GetAbortedStreams()
			}
		}
	}
	if aborted != 1 || ferrum.Code(endErr) != codes.Canceled || n >= 400 {
		t.Fatalf("abort: aborted %d, stream ended with %v after %d tokens", aborted, endErr, n)
	}
	r := must(c.AbortCache(ctx, "tiny", cid))
	if !r.GetReleasedCache() {
		t.Fatalf("abort cache: %v", r)
	}
	if r := must(c.AbortCache(ctx, "tiny", cid)); r.GetReleasedCache() {
		t.Fatalf("abort of a released cache: %v", r)
	}
}

// The mirror applies removed, cleared and resync messages (no server needed).
func TestPrefixMirrorApplies(t *testing.T) {
	m := ferrum.NewPrefixMirror()
	keys := ferrum.PromptBlockKeys("m", "", "", []int32{1, 2, 3, 4, 5, 6}, 2)
	raw := func(ks ...ferrum.BlockHash) [][]byte {
		out := [][]byte{}
		for _, k := range ks {
			out = append(out, append([]byte(nil), k[:]...))
		}
		return out
	}
	m.ApplyBlockEvent(&pb.KvBlockEvent{Seq: 3, ModelId: "m", Data: &pb.KvBlockEvent_Stored{Stored: &pb.KvBlockStored{
		BlockHashes: append(raw(keys...), []byte("short")), BlockSize: 2}}})
	m.SetRecipes(&pb.InfoResponse{Models: []*pb.ModelInfo{{ModelId: "m", PrefixCache: &pb.PrefixCacheRecipe{
		Enabled: true, Algorithm: ferrum.PrefixAlgorithm, BlockSize: 2, Seed: ferrum.PrefixSeed,
		ExtraKeys: []string{"model_id", "cache_salt", "adapter"}}}}})
	if m.Len("m") != 3 || m.LastSeq() != 3 || m.CachedTokens("m", []int32{1, 2, 3, 4, 5, 6, 7}, "", "") != 6 {
		t.Fatalf("after stored: %d blocks, seq %d", m.Len("m"), m.LastSeq())
	}
	m.Apply(&pb.SubscribeKvEventsResponse{Message: &pb.SubscribeKvEventsResponse_BlockEvent{BlockEvent: &pb.KvBlockEvent{
		Seq: 4, ModelId: "m", Data: &pb.KvBlockEvent_Removed{Removed: &pb.KvBlockRemoved{BlockHashes: raw(keys[1])}}}}})
	if got := m.CachedTokens("m", []int32{1, 2, 3, 4, 5, 6}, "", ""); got != 2 {
		t.Fatalf("a removed middle block ends the chain: %d cached tokens", got)
	}
	if m.CachedTokens("m", []int32{1, 2, 3, 4}, "salt", "") != 0 {
		t.Fatal("another salt matched")
	}
	m.Apply(&pb.SubscribeKvEventsResponse{Message: &pb.SubscribeKvEventsResponse_BlockEvent{BlockEvent: &pb.KvBlockEvent{
		Seq: 5, ModelId: "m", Data: &pb.KvBlockEvent_Cleared{Cleared: &pb.KvBlocksCleared{}}}}})
	if m.Len("m") != 0 {
		t.Fatal("cleared left blocks")
	}
	m.ApplyBlockEvent(&pb.KvBlockEvent{Seq: 6, ModelId: "m", Data: &pb.KvBlockEvent_Stored{Stored: &pb.KvBlockStored{BlockHashes: raw(keys[0])}}})
	m.Apply(&pb.SubscribeKvEventsResponse{Message: &pb.SubscribeKvEventsResponse_ResyncRequired{ResyncRequired: &pb.ResyncRequired{}}})
	if m.Len("m") != 0 || m.LastSeq() != 0 || m.Resyncs() != 1 {
		t.Fatal("resync did not reset the mirror")
	}
	// recipes this client cannot compute key nothing
	for _, r := range []*pb.PrefixCacheRecipe{nil, {Enabled: false, Algorithm: ferrum.PrefixAlgorithm, BlockSize: 2},
		{Enabled: true, Algorithm: "other", BlockSize: 2}, {Enabled: true, Algorithm: ferrum.PrefixAlgorithm, BlockSize: 2,
			ExtraKeys: []string{"model_id", "tenant"}}} {
		if ferrum.RecipeUsable(r, "") {
			t.Fatalf("recipe %v is usable", r)
		}
	}
	if ferrum.RecipeUsable(&pb.PrefixCacheRecipe{Enabled: true, Algorithm: ferrum.PrefixAlgorithm, BlockSize: 2,
		ExtraKeys: []string{"model_id", "cache_salt"}}, "lora") {
		t.Fatal("a recipe without the adapter key keys adapter sequences")
	}
}

// Small helpers: Int32Tensor refuses ragged rows; ResumeFromSeq reads the server's metadata.
func TestHelpersRefuseBadInput(t *testing.T) {
	if _, err := ferrum.Int32Tensor([][]int32{{1, 2}, {3}}); err == nil {
		t.Fatal("ragged rows accepted")
	}
	if _, err := ferrum.Int32Tensor(nil); err == nil {
		t.Fatal("no rows accepted")
	}
	tt, err := ferrum.Int32Tensor([][]int32{{1, 2}, {3, 256}})
	if err != nil || len(tt.GetData()) != 16 || tt.GetShape()[0] != 2 || tt.GetData()[13] != 1 {
		t.Fatalf("tensor %v, %v", tt, err)
	}
	if _, ok := ferrum.ResumeFromSeq(errors.New("x")); ok {
		t.Fatal("a plain error has no resume point")
	}
	if n, ok := ferrum.ResumeFromSeq(&ferrum.Error{Code: codes.ResourceExhausted, Metadata: map[string]string{"resume_from_seq": "42"}}); !ok || n != 42 {
		t.Fatalf("resume_from_seq: %d %v", n, ok)
	}
	if s := ferrum.SampleSeed(1<<63-1, 1); s != (1<<63-1+0x9E3779B9)%(1<<63) {
		t.Fatalf("SampleSeed wraps mod 2^63: %d", s)
	}
}

func equal(a, b []int32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
