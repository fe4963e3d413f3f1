package ferrum_test

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ferrum-service/ferrum-service/clients/go/ferrum"
	pb "github.com/ferrum-service/ferrum-service/clients/go/gen/ferrum/executor/v1"
	"github.com/ferrum-service/ferrum-service/clients/go/internal/testserver"
)

// TestSchedulerExample runs the README's scheduler example (schedulerExample) against a
// prefill-role and a decode-role server and checks what it prints.
func TestSchedulerExample(t *testing.T) {
	client(t) // skips (or fails in CI) without a server
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	tiny, err := testserver.TinyModelDir(ctx)
	if err != nil {
		t.Fatal(err)
	}
	models := []string{"hf-causal-lm,id=tiny,path=" + tiny}
	p, err := testserver.Start(ctx, models, "--role", "prefill")
	if err != nil {
		t.Fatal(err)
	}
	defer p.Stop()
	d, err := testserver.Start(ctx, models, "--role", "decode", "--kv-peer", "127.0.0.1:1024-65535")
	if err != nil {
		t.Fatal(err)
	}
	defer d.Stop()
	var out strings.Builder
	if err := schedulerExample(ctx, p.Target, d.Target, &out); err != nil {
		t.Fatal(err)
	}
	want := `fork of a: 4 tokens
a: 6 tokens
b: 6 tokens
c: 6 tokens
a/2: 6 tokens
5 batch steps, 0 caches left
`
	if out.String() != want {
		t.Fatalf("the example printed\n%s\nwant\n%s", out.String(), want)
	}
}

// TestReadmeShowsTheTestedExample: the code in README.md is schedulerExample's body, verbatim.
func TestReadmeShowsTheTestedExample(t *testing.T) {
	readme, err := os.ReadFile(filepath.Join("..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	src, err := os.ReadFile("example_scheduler_test.go")
	if err != nil {
		t.Fatal(err)
	}
	body := between(string(src), "\t// README:begin\n", "\t// README:end\n")
	shown := between(string(readme), "<!-- example:scheduler -->\n```go\n", "```\n<!-- /example:scheduler -->")
	if body == "" || shown == "" {
		t.Fatal("README.md or example_scheduler_test.go lost its markers")
	}
	var lines []string
	for _, l := range strings.Split(strings.TrimRight(body, "\n"), "\n") {
		lines = append(lines, strings.TrimPrefix(l, "\t"))
	}
	if strings.Join(lines, "\n")+"\n" != shown {
		t.Fatal("README.md's scheduler example differs from schedulerExample in example_scheduler_test.go: copy it over")
	}
}

func between(s, begin, end string) string {
	i := strings.Index(s, begin)
	if i < 0 {
		return ""
	}
	s = s[i+len(begin):]
	j := strings.Index(s, end)
	if j < 0 {
		return ""
	}
	return s[:j]
}

// schedulerExample is a scheduler's-eye loop over two servers: prompts are prefilled on a prefill
// server and handed to a decode server (the decode server pulls their KV), one request is forked
// into two samples there, and every step is one BatchDecode over all running sequences; a sequence
// leaves the batch (its cache released) when it has its tokens.
func schedulerExample(ctx context.Context, prefillTarget, decodeTarget string, out io.Writer) error {
	// README:begin
	pre, err := ferrum.Dial(prefillTarget) // ferrum.WithToken(..), ferrum.WithTLS(..) in production
	if err != nil {
		return err
	}
	defer pre.Close()
	dec, err := ferrum.Dial(decodeTarget)
	if err != nil {
		return err
	}
	defer dec.Close()
	d := &ferrum.Disaggregated{Prefill: pre, Decode: dec, PrefillTarget: prefillTarget}

	type seq struct {
		name   string
		cache  string
		last   int32 // the last sampled token: fed to the next step
		tokens []int32
		want   int
		policy []ferrum.StepOption
	}
	var running []*seq
	prompts := map[string][]int32{"a": {1, 100, 200, 300}, "b": {1, 7, 8, 9, 10}, "c": {1, 42}}
	for _, name := range []string{"a", "b", "c"} {
		// prefill on the prefill server, KV pulled by the decode server, prefill cache released
		h, err := d.Run(ctx, "tiny", prompts[name], uint64(len(prompts[name])+8))
		if err != nil {
			return err
		}
		running = append(running, &seq{name: name, cache: h.Cache.GetCacheId(), last: h.Token,
			tokens: []int32{h.Token}, want: 6})
	}
	// request "a" wants a second sample: fork its cache (copy-on-write, nothing recomputed) and
	// let both draw with their own seeds
	f, err := dec.ForkCache(ctx, "tiny", running[0].cache, ferrum.ForkReserve(16))
	if err != nil {
		return err
	}
	fork := *running[0]
	fork.name, fork.cache, fork.tokens = "a/2", f.GetCache().GetCacheId(), []int32{running[0].last}
	running[0].policy = []ferrum.StepOption{ferrum.WithSampling(ferrum.Sampling(0.8, ferrum.Seed(1)))}
	fork.policy = []ferrum.StepOption{ferrum.WithSampling(ferrum.Sampling(0.8, ferrum.Seed(2)))}
	running = append(running, &fork)
	fmt.Fprintf(out, "fork of a: %d tokens\n", f.GetCache().GetNumTokens())

	steps := 0
	for len(running) > 0 {
		inputs := make([]*pb.DecodeInput, len(running))
		for i, s := range running {
			inputs[i] = ferrum.DecodeInput(s.cache, s.last, s.policy...)
		}
		outs, err := dec.BatchDecode(ctx, "tiny", inputs) // one forward for the whole batch
		if err != nil {
			return err
		}
		steps++
		next := running[:0]
		for i, s := range running {
			s.last = ferrum.Token(outs[i].GetOutput())
			s.tokens = append(s.tokens, s.last)
			if len(s.tokens) < s.want {
				next = append(next, s)
				continue
			}
			if _, err := dec.ReleaseCache(ctx, "tiny", s.cache); err != nil {
				return err
			}
			fmt.Fprintf(out, "%s: %d tokens\n", s.name, len(s.tokens))
		}
		running = next
	}
	left, err := dec.ListCaches(ctx, "tiny")
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "%d batch steps, %d caches left\n", steps, len(left.GetCaches()))
	// README:end
	return nil
}
