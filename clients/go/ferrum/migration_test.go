package ferrum_test

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferrum-service/ferrum-service/clients/go/ferrum"
	pb "github.com/ferrum-service/ferrum-service/clients/go/gen/ferrum/executor/v1"
	"github.com/ferrum-service/ferrum-service/clients/go/internal/testserver"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

const userToken = "tok-user"

// migrationPair starts two servers that authenticate callers (userToken) and count each other as
// KV peers (--kv-peer 127.0.0.1:1024-65535, one peer token), with the admin RPCs open: streams move from
// the first to the second with MigrateStreams.
func migrationPair(t *testing.T, ctx context.Context) (a, b *testserver.Server) {
	t.Helper()
	client(t) // skips (or fails in CI) without a server
	tiny, err := testserver.TinyModelDir(ctx)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	users, peers := filepath.Join(dir, "users"), filepath.Join(dir, "peers")
	for p, tok := range map[string]string{users: userToken, peers: "tok-peer"} {
		if err := os.WriteFile(p, []byte(tok+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	models := []string{"hf-causal-lm,id=tiny,path=" + tiny}
	args := []string{"--auth-token-file", users, "--kv-peer", "127.0.0.1:1024-65535", "--kv-peer-token-file", peers, "--open-admin-rpcs"}
	opts := []ferrum.Option{ferrum.WithToken(userToken)}
	if b, err = testserver.StartDialing(ctx, models, opts, args...); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Stop)
	if a, err = testserver.StartDialing(ctx, models, opts, args...); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Stop)
	return a, b
}

func migPrompt() []int32 {
	p := make([]int32, 24)
	for i := range p {
		p[i] = int32(1 + (i*37)%499)
	}
	return p
}

// movedRun is one Generate on ca that MigrateStreams moves to target once `at` tokens arrived.
type movedRun struct {
	tokens, indexes []uint32
	finished        *pb.GenerateFinished
	migrated        *pb.GenerateMigrated // the passed-on event (FollowMigrations(false))
	followed        []string
	moveResult      *pb.MigrateStreamsResponse
	err             error
}

func runMoved(ctx context.Context, ca *ferrum.Client, target, requestID string, at int, opts ...ferrum.StreamOption) movedRun {
	var r movedRun
	var wg sync.WaitGroup
	var moveErr error
	req := ferrum.GenerateTokens("tiny", migPrompt(), ferrum.GenMaxTokens(64), ferrum.GenIgnoreEOS(), ferrum.GenRequestID(requestID))
	opts = append(opts, ferrum.OnMigrated(func(m *pb.GenerateMigrated) { r.followed = append(r.followed, m.GetTarget()) }))
	for ev, err := range ca.Generate(ctx, req, opts...) {
		if err != nil {
			r.err = err
			break
		}
		switch e := ev.GetEvent().(type) {
		case *pb.GenerateResponse_Token:
			r.tokens = append(r.tokens, uint32(e.Token.GetTokenId()))
			r.indexes = append(r.indexes, e.Token.GetIndex())
			if len(r.tokens) == at {
				wg.Add(1)
				go func() {
					defer wg.Done()
					r.moveResult, moveErr = ca.MigrateStreams(ctx, target, ferrum.MigrateRequestID(requestID))
				}()
			}
		case *pb.GenerateResponse_Finished:
			r.finished = e.Finished
		case *pb.GenerateResponse_Migrated:
			r.migrated = e.Migrated
		}
	}
	wg.Wait()
	if r.err == nil {
		r.err = moveErr
	}
	return r
}

// moveAttempts runs runMoved until MigrateStreams moved the stream (the tiny model may finish all
// 64 tokens before the move reaches a step boundary on a loaded machine: then it is tried again).
func moveAttempts(t *testing.T, ctx context.Context, ca *ferrum.Client, target string, opts ...ferrum.StreamOption) movedRun {
	t.Helper()
	for i := range 3 {
		r := runMoved(ctx, ca, target, "mv-"+string(rune('a'+i)), 2, opts...)
		if r.err != nil {
			t.Fatalf("attempt %d: %v", i, r.err)
		}
		if r.moveResult.GetMigrated() == 1 {
			return r
		}
		t.Logf("attempt %d: not moved (%v): the stream ended first", i, r.moveResult.GetStreams())
	}
	t.Fatal("MigrateStreams never moved the stream in 3 attempts")
	return movedRun{}
}

func u32s(ids []int32) []uint32 {
	out := make([]uint32, len(ids))
	for i, v := range ids {
		out[i] = uint32(v)
	}
	return out
}

// A greedy 64-token stream moved from A to B after 2 tokens: Generate follows it (with the
// caller's token, which B checks) and yields exactly the unmoved run's tokens, indexes 0..63 once
// each, one Finished; B computed no prompt token.
func TestGenerateFollowsMigratedStream(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	sa, sb := migrationPair(t, ctx)
	ca := must(ferrum.Dial(sa.Target, ferrum.WithToken(userToken)))
	defer ca.Close()
	ref := must(ca.GenerateAll(ctx, ferrum.GenerateTokens("tiny", migPrompt(), ferrum.GenMaxTokens(64), ferrum.GenIgnoreEOS())))
	if len(ref.Tokens) != 64 || len(ref.Migrations) != 0 {
		t.Fatalf("unmoved run: %d tokens, migrations %v", len(ref.Tokens), ref.Migrations)
	}

	r := moveAttempts(t, ctx, ca, sb.Target)
	if !slices.Equal(r.followed, []string{sb.Target}) || r.migrated != nil {
		t.Fatalf("followed %v (passed on %v), want [%s]", r.followed, r.migrated, sb.Target)
	}
	if !slices.Equal(r.tokens, u32s(ref.Tokens)) {
		t.Fatalf("moved run's tokens differ:\n got %v\nwant %v", r.tokens, ref.Tokens)
	}
	want := make([]uint32, 64)
	for i := range want {
		want[i] = uint32(i)
	}
	if !slices.Equal(r.indexes, want) {
		t.Fatalf("token indexes %v: a duplicate or a gap", r.indexes)
	}
	if r.finished.GetGeneratedTokens() != 64 || r.finished.GetFinishReason() != pb.FinishReason_FINISH_REASON_LENGTH {
		t.Fatalf("finished %v", r.finished)
	}
	// the stream ended on B: B decoded its tail and prefilled nothing (the KV came from A)
	cb := must(ferrum.Dial(sb.Target, ferrum.WithToken(userToken)))
	defer cb.Close()
	st := must(cb.Status(ctx, "tiny")).GetMetrics()
	if st.GetPrefillOperations() != 0 || st.GetDecodeOperations() == 0 {
		t.Fatalf("B's metrics: %d prefills, %d decodes", st.GetPrefillOperations(), st.GetDecodeOperations())
	}
	// a request id nothing runs under moves nothing
	res := must(ca.MigrateStreams(ctx, sb.Target, ferrum.MigrateRequestID("nothing-runs")))
	if res.GetMigrated() != 0 || len(res.GetStreams()) != 0 {
		t.Fatalf("MigrateStreams with no matching stream: %v", res)
	}
}

// FollowMigrations(false): the Migrated event is the stream's last event (no Finished); the
// caller resumes it on the target with its token and gets the rest.
func TestGeneratePassesMigratedOnWhenNotFollowing(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	sa, sb := migrationPair(t, ctx)
	ca := must(ferrum.Dial(sa.Target, ferrum.WithToken(userToken)))
	defer ca.Close()
	cb := must(ferrum.Dial(sb.Target, ferrum.WithToken(userToken)))
	defer cb.Close()
	ref := must(ca.GenerateAll(ctx, ferrum.GenerateTokens("tiny", migPrompt(), ferrum.GenMaxTokens(64), ferrum.GenIgnoreEOS())))

	r := moveAttempts(t, ctx, ca, sb.Target, ferrum.FollowMigrations(false))
	if r.migrated == nil || r.finished != nil || len(r.followed) != 0 {
		t.Fatalf("passed on %v, finished %v, followed %v", r.migrated, r.finished, r.followed)
	}
	if r.migrated.GetTarget() != sb.Target || int(r.migrated.GetGeneratedTokens()) != len(r.tokens) || r.migrated.GetResumeToken() == "" {
		t.Fatalf("migrated event %v after %d tokens", r.migrated, len(r.tokens))
	}
	rest := must(cb.GenerateAll(ctx, &pb.GenerateRequest{ModelId: "tiny", ResumeToken: r.migrated.GetResumeToken()}))
	if got := append(r.tokens, u32s(rest.Tokens)...); !slices.Equal(got, u32s(ref.Tokens)) {
		t.Fatalf("tokens before + after the resume:\n got %v\nwant %v", got, ref.Tokens)
	}
	// the token is single use
	if _, err := cb.GenerateAll(ctx, &pb.GenerateRequest{ModelId: "tiny", ResumeToken: r.migrated.GetResumeToken()}); ferrum.Code(err) != codes.NotFound {
		t.Fatalf("second resume: %v, want NOT_FOUND", err)
	}
}

// loopingServer answers every Generate with a Migrated event pointing back at itself: a stream
// that never settles. It records each call's resume token and bearer token.
type loopingServer struct {
	pb.UnimplementedModelExecutorServer
	target string
	calls  atomic.Int32
	mu     sync.Mutex
	seen   []string // "<authorization>|<resume token>" per call
}

func (s *loopingServer) Generate(req *pb.GenerateRequest, stream grpc.ServerStreamingServer[pb.GenerateResponse]) error {
	n := s.calls.Add(1)
	md, _ := metadata.FromIncomingContext(stream.Context())
	s.mu.Lock()
	s.seen = append(s.seen, firstOr(md.Get("authorization"))+"|"+req.GetResumeToken())
	s.mu.Unlock()
	if n == 1 {
		if err := stream.Send(&pb.GenerateResponse{Event: &pb.GenerateResponse_Started{Started: &pb.GenerateStarted{PromptTokens: 3}}}); err != nil {
			return err
		}
	} else if err := stream.Send(&pb.GenerateResponse{Event: &pb.GenerateResponse_Started{Started: &pb.GenerateStarted{ResumedTokens: uint32(n - 1)}}}); err != nil {
		return err
	}
	if err := stream.Send(&pb.GenerateResponse{Event: &pb.GenerateResponse_Token{Token: &pb.TokenEvent{TokenId: 5, Index: uint32(n - 1)}}}); err != nil {
		return err
	}
	return stream.Send(&pb.GenerateResponse{Event: &pb.GenerateResponse_Migrated{Migrated: &pb.GenerateMigrated{
		Target: s.target, ResumeToken: "rt-" + string(rune('a'+n-1)), GeneratedTokens: uint32(n)}}})
}

func firstOr(v []string) string {
	if len(v) == 0 {
		return ""
	}
	return v[0]
}

// A stream that keeps moving is followed MaxMigrationHops times, then ends with ABORTED; every
// resume carries the event's resume token and the caller's bearer token; the resumed calls'
// Started events are not passed on.
func TestGenerateStopsFollowingPastTheHopLimit(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	fake := &loopingServer{target: lis.Addr().String()}
	pb.RegisterModelExecutorServer(srv, fake)
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()

	c, err := ferrum.Dial(fake.target, ferrum.WithToken("tok-x"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	starts, tokens := 0, 0
	var last error
	for ev, err := range c.Generate(ctx, ferrum.GenerateTokens("m", []int32{1, 2, 3})) {
		if err != nil {
			last = err
			break
		}
		switch ev.GetEvent().(type) {
		case *pb.GenerateResponse_Started:
			starts++
		case *pb.GenerateResponse_Token:
			tokens++
		case *pb.GenerateResponse_Migrated:
			t.Fatal("a followed Migrated event was passed on")
		}
	}
	if status.Code(last) != codes.Aborted || ferrum.Code(last) != codes.Aborted {
		t.Fatalf("ended with %v, want ABORTED", last)
	}
	if n := fake.calls.Load(); n != ferrum.MaxMigrationHops+1 || starts != 1 || tokens != int(n) {
		t.Fatalf("%d calls, %d Started, %d tokens; want %d calls, 1 Started, one token each", n, starts, tokens, ferrum.MaxMigrationHops+1)
	}
	for i, s := range fake.seen {
		want := "Bearer tok-x|"
		if i > 0 {
			want += "rt-" + string(rune('a'+i-1))
		}
		if s != want {
			t.Fatalf("call %d carried %q, want %q", i, s, want)
		}
	}
	// FollowMigrations(false) passes the first Migrated event on and stops there
	var got []*pb.GenerateResponse
	for ev, err := range c.Generate(ctx, ferrum.GenerateTokens("m", []int32{1}), ferrum.FollowMigrations(false)) {
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, ev)
	}
	if len(got) != 3 || got[2].GetMigrated() == nil {
		t.Fatalf("events without following: %v", got)
	}
}
