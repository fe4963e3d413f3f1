package ferrum_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/ferrum-service/ferrum-service/clients/go/ferrum"
	pb "github.com/ferrum-service/ferrum-service/clients/go/gen/ferrum/executor/v1"
	"github.com/ferrum-service/ferrum-service/clients/go/internal/testserver"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// One live server for the package: a per-sequence scripted model ("seq": every cache sees
// 10, 20, 30, 10, ... whatever else runs) and the tiny random-weight llama.
var (
	target  string
	skipMsg string
)

func TestMain(m *testing.M) {
	os.Exit(func() int {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		if _, err := testserver.ServerCommand(); errors.Is(err, testserver.ErrNoServer) {
			skipMsg = err.Error()
			return m.Run()
		}
		tiny, err := testserver.TinyModelDir(ctx)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		srv, err := testserver.Start(ctx, []string{
			"configurable,id=seq,vocab_size=1000,token_sequence=10:20:30,counter=per_sequence",
			"hf-causal-lm,id=tiny,path=" + tiny,
		})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer srv.Stop()
		target = srv.Target
		return m.Run()
	}())
}

func client(t *testing.T) (*ferrum.Client, context.Context) {
	t.Helper()
	curT = t
	if skipMsg != "" {
		if os.Getenv("CI") == "true" || os.Getenv("FERRUM_SERVER_CMD") != "" {
			t.Fatalf("no server in CI: %s", skipMsg) // in CI a missing server fails, never skips
		}
		t.Skipf("skipping: %s", skipMsg)
	}
	c, err := ferrum.Dial(target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return c, ctx
}

// curT is the running test (the tests are not parallel), so that must can fail it.
var curT *testing.T

// must returns v, or fails the running test with err.
func must[T any](v T, err error) T {
	curT.Helper()
	if err != nil {
		curT.Fatal(err)
	}
	return v
}

// eventuallyGone waits until the cache is unknown to the server.
func eventuallyGone(t *testing.T, ctx context.Context, c *ferrum.Client, model, cacheID string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		_, err := c.TruncateKv(ctx, model, cacheID, 0)
		if ferrum.Code(err) == codes.NotFound {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("cache %s still there after 5 s (last: %v)", cacheID, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

var prompt = []int32{1, 100, 200, 300}

func TestPrefillDecodeTruncateRelease(t *testing.T) {
	c, ctx := client(t)
	pre := must(c.Prefill(ctx, "tiny", prompt))
	cid := pre.GetCache().GetCacheId()
	if pre.GetCache().GetNumTokens() != 4 || pre.GetCache().GetModelId() != "tiny" {
		t.Fatalf("prefill cache: %v", pre.GetCache())
	}
	toks := []int32{ferrum.Token(pre.GetOutput())}
	for i := 0; i < 3; i++ {
		out := must(c.Decode(ctx, "tiny", cid, toks[len(toks)-1], ferrum.AtPosition(uint64(4+i))))
		toks = append(toks, ferrum.Token(out.GetOutput()))
	}
	tr := must(c.TruncateKv(ctx, "tiny", cid, 5))
	if tr.GetCache().GetNumTokens() != 5 || tr.GetRemovedTokens() != 2 {
		t.Fatalf("truncate: %v", tr)
	}
	again := must(c.Decode(ctx, "tiny", cid, toks[1]))
	if got := ferrum.Token(again.GetOutput()); got != toks[2] {
		t.Fatalf("decode after truncate: got %d, want %d (tokens %v)", got, toks[2], toks)
	}
	rel := must(c.ReleaseCache(ctx, "tiny", cid))
	if !rel.GetReleased() || rel.GetFreedTokens() != 6 {
		t.Fatalf("release: %v", rel)
	}
	rel = must(c.ReleaseCache(ctx, "tiny", cid))
	if rel.GetReleased() {
		t.Fatal("second release says released")
	}
}

func TestBatchDecodeMatchesSingleDecodes(t *testing.T) {
	c, ctx := client(t)
	a := must(c.Prefill(ctx, "tiny", prompt))
	b := must(c.Prefill(ctx, "tiny", []int32{1, 7, 8}))
	defer c.ReleaseCache(ctx, "tiny", a.GetCache().GetCacheId())
	defer c.ReleaseCache(ctx, "tiny", b.GetCache().GetCacheId())
	outs := must(c.BatchDecode(ctx, "tiny", []*pb.DecodeInput{
		ferrum.DecodeInput(a.GetCache().GetCacheId(), ferrum.Token(a.GetOutput())),
		ferrum.DecodeInput(b.GetCache().GetCacheId(), ferrum.Token(b.GetOutput())),
	}))
	if len(outs) != 2 || outs[0].GetCache().GetNumTokens() != 5 || outs[1].GetCache().GetNumTokens() != 4 {
		t.Fatalf("batch decode: %v", outs)
	}
	// The same steps one by one on fresh caches give the same tokens.
	for i, p := range [][]int32{prompt, {1, 7, 8}} {
		pre := must(c.Prefill(ctx, "tiny", p))
		one := must(c.Decode(ctx, "tiny", pre.GetCache().GetCacheId(), ferrum.Token(pre.GetOutput())))
		c.ReleaseCache(ctx, "tiny", pre.GetCache().GetCacheId())
		if ferrum.Token(one.GetOutput()) != ferrum.Token(outs[i].GetOutput()) {
			t.Errorf("input %d: batch token %d, single token %d", i, ferrum.Token(outs[i].GetOutput()), ferrum.Token(one.GetOutput()))
		}
	}
}

func TestScriptedModelExactTokens(t *testing.T) {
	c, ctx := client(t)
	pre := must(c.Prefill(ctx, "seq", []int32{1, 2, 3}))
	cid := pre.GetCache().GetCacheId()
	defer c.ReleaseCache(ctx, "seq", cid)
	got := []int32{ferrum.Token(pre.GetOutput())}
	for i := 0; i < 4; i++ {
		out := must(c.Decode(ctx, "seq", cid, got[len(got)-1]))
		got = append(got, ferrum.Token(out.GetOutput()))
	}
	want := []int32{10, 10, 20, 30, 10}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("tokens %v, want %v", got, want)
	}
	fv := must(c.ForwardVerify(ctx, "seq", cid, []int32{10, 20, 99}, true))
	if fv.GetBaseLen() != 7 || fv.GetAcceptedDrafts() != 1 || fmt.Sprint(fv.GetAcceptedTokens()) != "[20 30]" ||
		fv.GetCache().GetNumTokens() != 9 {
		t.Fatalf("forward verify: %v", fv)
	}
}

func TestErrorsCarryKindAndField(t *testing.T) {
	c, ctx := client(t)
	_, err := c.Prefill(ctx, "tiny", []int32{512})
	var fe *ferrum.Error
	if !errors.As(err, &fe) {
		t.Fatalf("want *ferrum.Error, got %T %v", err, err)
	}
	if fe.Code != codes.InvalidArgument || fe.Kind != "REQUEST_VALIDATION" || fe.Field != "input.token_ids[0]" {
		t.Fatalf("error: code %v kind %q field %q (%v)", fe.Code, fe.Kind, fe.Field, fe)
	}
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("status.Code sees %v", status.Code(err))
	}
	_, err = c.Decode(ctx, "tiny", "no-such-cache", 1)
	if ferrum.Code(err) != codes.NotFound || ferrum.Kind(err) != "NOT_FOUND" {
		t.Fatalf("unknown cache: %v", err)
	}
	_, err = c.TruncateKv(ctx, "nope", "x", 0)
	if ferrum.Code(err) != codes.NotFound {
		t.Fatalf("unknown model: %v", err)
	}
}

func TestDeadlineAndCancellation(t *testing.T) {
	c, ctx := client(t)
	dctx, cancel := context.WithTimeout(ctx, time.Nanosecond)
	defer cancel()
	time.Sleep(time.Millisecond)
	if _, err := c.Info(dctx, ""); ferrum.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("expired deadline: %v", err)
	}
	cctx, cancel2 := context.WithCancel(ctx)
	cancel2()
	if _, err := c.Prefill(cctx, "tiny", prompt); ferrum.Code(err) != codes.Canceled {
		t.Fatalf("cancelled context: %v", err)
	}
}

func TestGenerateStreamsTheDecodeTokens(t *testing.T) {
	c, ctx := client(t)
	// Greedy tokens step by step ...
	pre := must(c.Prefill(ctx, "tiny", prompt))
	want := []int32{ferrum.Token(pre.GetOutput())}
	for len(want) < 5 {
		out := must(c.Decode(ctx, "tiny", pre.GetCache().GetCacheId(), want[len(want)-1]))
		want = append(want, ferrum.Token(out.GetOutput()))
	}
	c.ReleaseCache(ctx, "tiny", pre.GetCache().GetCacheId())
	// ... equal the server-side loop's.
	res := must(c.GenerateAll(ctx, &pb.GenerateRequest{ModelId: "tiny", Prompt: ferrum.TokenPrompt(prompt...),
		Stop: &pb.StopConditions{MaxTokens: 5, IgnoreEos: true}}))
	if fmt.Sprint(res.Tokens) != fmt.Sprint(want) {
		t.Fatalf("generate %v, decode %v", res.Tokens, want)
	}
	if res.Started == nil || res.Finished.GetFinishReason() != pb.FinishReason_FINISH_REASON_LENGTH || res.Finished.GetGeneratedTokens() != 5 {
		t.Fatalf("events: %v / %v", res.Started, res.Finished)
	}
	eventuallyGone(t, ctx, c, "tiny", res.Started.GetCache().GetCacheId())
}

func TestGenerateBreakCancels(t *testing.T) {
	c, ctx := client(t)
	req := &pb.GenerateRequest{ModelId: "tiny", Prompt: ferrum.TokenPrompt(prompt...),
		Stop: &pb.StopConditions{MaxTokens: 500, IgnoreEos: true}}
	var cacheID string
	n := 0
	for ev, err := range c.Generate(ctx, req) {
		if err != nil {
			t.Fatal(err)
		}
		if s := ev.GetStarted(); s != nil {
			cacheID = s.GetCache().GetCacheId()
		}
		if ev.GetToken() != nil {
			n++
			if n == 2 {
				break
			}
		}
		if ev.GetFinished() != nil {
			t.Fatal("finished before the break")
		}
	}
	if cacheID == "" || n != 2 {
		t.Fatalf("cache %q, %d tokens", cacheID, n)
	}
	eventuallyGone(t, ctx, c, "tiny", cacheID)

	// An invalid request fails in the iterator.
	bad := &pb.GenerateRequest{ModelId: "tiny", Prompt: ferrum.TokenPrompt(1), Sampling: &pb.SamplingParams{TopP: ptr(float32(1.5))}}
	if _, err := c.GenerateAll(ctx, bad); ferrum.Code(err) != codes.InvalidArgument {
		t.Fatalf("top_p 1.5: %v", err)
	}
}

func ptr[T any](v T) *T { return &v }

func TestSession(t *testing.T) {
	c, ctx := client(t)
	// Unary reference tokens.
	pre := must(c.Prefill(ctx, "tiny", prompt))
	want := []int32{ferrum.Token(pre.GetOutput())}
	d := must(c.Decode(ctx, "tiny", pre.GetCache().GetCacheId(), want[0]))
	want = append(want, ferrum.Token(d.GetOutput()))
	c.ReleaseCache(ctx, "tiny", pre.GetCache().GetCacheId())

	s := must(c.Session(ctx))
	r := must(s.Do(ferrum.PrefillRequest("tiny", prompt))).(*pb.PrefillResponse)
	cid := r.GetOutput().GetCache().GetCacheId()
	got := []int32{ferrum.Token(r.GetOutput().GetOutput())}
	// A failed step answers with an error and the session goes on.
	if _, err := s.Do(ferrum.DecodeRequest("tiny", cid, 512)); ferrum.Code(err) != codes.InvalidArgument {
		t.Fatalf("bad step: %v", err)
	}
	dr := must(s.Do(ferrum.DecodeRequest("tiny", cid, got[0]))).(*pb.DecodeResponse)
	got = append(got, ferrum.Token(dr.GetOutput().GetOutput()))
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("session tokens %v, unary %v", got, want)
	}
	// Pipelined: two steps sent before reading; results come back in order.
	id1 := must(s.Send(&pb.TruncateKvRequest{ModelId: "tiny", CacheId: cid, NewLen: 4}))
	id2 := must(s.Send(ferrum.DecodeRequest("tiny", cid, got[0])))
	g1, m1, err := s.Recv()
	if err != nil || g1 != id1 || m1.(*pb.TruncateKvResponse).GetCache().GetNumTokens() != 4 {
		t.Fatalf("pipelined 1: %d %v %v", g1, m1, err)
	}
	g2, m2, err := s.Recv()
	if err != nil || g2 != id2 || ferrum.Token(m2.(*pb.DecodeResponse).GetOutput().GetOutput()) != want[1] {
		t.Fatalf("pipelined 2: %d %v %v", g2, m2, err)
	}
	// A fork on the session: it shares the prompt and decodes what the source decoded.
	fr := must(s.Do(ferrum.ForkCacheRequest("tiny", cid, ferrum.KeepTokens(4)))).(*pb.ForkCacheResponse)
	fid := fr.GetCache().GetCacheId()
	if fr.GetCache().GetNumTokens() != 4 || fid == cid {
		t.Fatalf("session fork: %v", fr)
	}
	fd := must(s.Do(ferrum.DecodeRequest("tiny", fid, got[0]))).(*pb.DecodeResponse)
	if ferrum.Token(fd.GetOutput().GetOutput()) != want[1] {
		t.Fatalf("the fork decoded %d, the source %d", ferrum.Token(fd.GetOutput().GetOutput()), want[1])
	}
	// Closing the session frees the caches it created (the fork too).
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	eventuallyGone(t, ctx, c, "tiny", cid)
	eventuallyGone(t, ctx, c, "tiny", fid)
}

// A failed step says which items ran (issue 40): a BatchDecode over one live cache and one unknown
// id runs no row, and Error.Progress names each item's state and why; the live cache is as before.
func TestFailedStepCarriesProgress(t *testing.T) {
	c, ctx := client(t)
	pre := must(c.Prefill(ctx, "tiny", []int32{5, 6, 7, 8, 9}))
	cid := pre.GetCache().GetCacheId()
	defer c.ReleaseCache(ctx, "tiny", cid)
	_, err := c.BatchDecode(ctx, "tiny", []*pb.DecodeInput{ferrum.DecodeInput(cid, 5), ferrum.DecodeInput("hf-no-such-cache", 5)})
	var fe *ferrum.Error
	if !errors.As(err, &fe) || fe.Code != codes.NotFound || fe.Progress == nil {
		t.Fatalf("want NOT_FOUND with StepProgress, got %v", err)
	}
	var got []string
	for _, it := range fe.Progress.GetItems() {
		got = append(got, fmt.Sprintf("%d:%s:%d:%s", it.GetIndex(), it.GetState(), it.GetTokensRan(), it.GetReason()))
	}
	want := []string{"0:ITEM_STATE_NOT_RUN:0:STEP_FAILED", "1:ITEM_STATE_NOT_RUN:0:NOT_FOUND"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("progress %v, want %v", got, want)
	}
	if fe.UnsupportedShape() {
		t.Fatal("a NOT_FOUND is no unsupported shape")
	}
	// truthful: the live cache did not grow
	out := must(c.BatchDecode(ctx, "tiny", []*pb.DecodeInput{ferrum.DecodeInput(cid, 5)}))
	if n := out[0].GetCache().GetNumTokens(); n != 6 {
		t.Fatalf("the cache holds %d tokens after the failed step, want 6", n)
	}
}
