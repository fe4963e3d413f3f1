// Command example-scheduler is a small continuous-batching scheduler driving a remote
// ModelExecutor: requests arrive over time, each is prefilled when it arrives and then joins the
// running batch, every step is one BatchDecode over all running sequences, and a sequence leaves
// the batch (its cache released) as soon as it hits its token budget or an EOS token.
//
//	go run ./cmd/example-scheduler                     # starts a fresh server with the tiny test model
//	go run ./cmd/example-scheduler -target host:50051 -model smollm2
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/ferrum-service/ferrum-service/clients/go/ferrum"
	pb "github.com/ferrum-service/ferrum-service/clients/go/gen/ferrum/executor/v1"
	"github.com/ferrum-service/ferrum-service/clients/go/internal/testserver"
)

type request struct {
	id        int
	prompt    string
	maxTokens int
	arrival   int // scheduler step at which it arrives

	cacheID string
	tokens  []int32 // generated so far; the last one is not in the cache yet
	done    string  // finish reason once finished
}

func main() {
	target := flag.String("target", "", "server host:port (empty: start a fresh local server with the tiny test model)")
	model := flag.String("model", "tiny", "model id")
	flag.Parse()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	if *target == "" {
		tiny, err := testserver.TinyModelDir(ctx)
		if err != nil {
			log.Fatal(err)
		}
		srv, err := testserver.Start(ctx, []string{"hf-causal-lm,id=" + *model + ",path=" + tiny})
		if err != nil {
			log.Fatal(err)
		}
		defer srv.Stop()
		*target = srv.Target
		fmt.Printf("started a fresh server on %s\n", srv.Target)
	}
	c, err := ferrum.Dial(*target)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	if err := run(ctx, c, *model); err != nil {
		log.Print(err)
		os.Exit(1)
	}
}

func run(ctx context.Context, c *ferrum.Client, model string) error {
	info, err := c.Info(ctx, model)
	if err != nil {
		return err
	}
	eos := info.GetModels()[0].GetEosTokenIds()
	queue := []*request{
		{id: 0, prompt: "The quick brown fox", maxTokens: 8, arrival: 0},
		{id: 1, prompt: "A KV cache stores", maxTokens: 5, arrival: 0},
		{id: 2, prompt: "Hello world! How are", maxTokens: 6, arrival: 2},
		{id: 3, prompt: "Speculative decoding verifies", maxTokens: 4, arrival: 4},
	}
	all := slices.Clone(queue)
	var running []*request
	finish := func(r *request, reason string) error {
		r.done = reason
		_, err := c.ReleaseCache(ctx, model, r.cacheID)
		return err
	}
	for step := 0; len(queue) > 0 || len(running) > 0; step++ {
		// Admit arrivals: prefill each, which yields its first token.
		for len(queue) > 0 && queue[0].arrival <= step {
			r := queue[0]
			queue = queue[1:]
			ids, err := c.Tokenize(ctx, model, r.prompt, false)
			if err != nil {
				return err
			}
			out, err := c.Prefill(ctx, model, ids, ferrum.Reserve(uint64(len(ids)+r.maxTokens)), ferrum.RequestID(fmt.Sprint("req-", r.id)))
			if err != nil {
				return err
			}
			r.cacheID = out.GetCache().GetCacheId()
			r.tokens = append(r.tokens, ferrum.Token(out.GetOutput()))
			fmt.Printf("step %d: admit req-%d (%d prompt tokens) -> first token %d\n", step, r.id, len(ids), r.tokens[0])
			if slices.Contains(eos, r.tokens[0]) || len(r.tokens) >= r.maxTokens {
				if err := finish(r, "eos/length at prefill"); err != nil {
					return err
				}
				continue
			}
			running = append(running, r)
		}
		if len(running) == 0 {
			continue
		}
		// One forward for the whole batch.
		inputs := make([]*pb.DecodeInput, len(running))
		names := make([]string, len(running))
		for i, r := range running {
			inputs[i] = ferrum.DecodeInput(r.cacheID, r.tokens[len(r.tokens)-1])
			names[i] = fmt.Sprint("req-", r.id)
		}
		outs, err := c.BatchDecode(ctx, model, inputs)
		if err != nil {
			return err
		}
		next := running[:0]
		var left []string
		for i, r := range running {
			tok := ferrum.Token(outs[i].GetOutput())
			r.tokens = append(r.tokens, tok)
			switch {
			case slices.Contains(eos, tok):
				err = finish(r, "eos")
			case len(r.tokens) >= r.maxTokens:
				err = finish(r, "length")
			default:
				next = append(next, r)
				continue
			}
			if err != nil {
				return err
			}
			left = append(left, fmt.Sprintf("req-%d (%s)", r.id, r.done))
		}
		running = next
		line := fmt.Sprintf("step %d: batch_decode %d seqs [%s]", step, len(inputs), strings.Join(names, " "))
		if len(left) > 0 {
			line += " -> finished " + strings.Join(left, ", ")
		}
		fmt.Println(line)
	}
	fmt.Println()
	for _, r := range all {
		text, err := c.Detokenize(ctx, model, r.tokens, false)
		if err != nil {
			return err
		}
		fmt.Printf("req-%d %q -> %d tokens %v (%s): %q\n", r.id, r.prompt, len(r.tokens), r.tokens, r.done, text)
	}
	loads, err := c.Raw().Loads(ctx, &pb.LoadsRequest{ModelId: model})
	if err == nil && len(loads.GetLoads()) > 0 {
		fmt.Printf("live caches on the server afterwards: %d\n", loads.GetLoads()[0].GetActiveCaches())
	}
	return nil
}
