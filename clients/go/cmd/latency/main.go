// Command latency measures Decode round trips against a running server from a Go client: n unary
// Decode calls, then n Decode steps over one Session stream, each on a cache made by a Prefill
// (a fresh cache every perCache steps, so no sequence outgrows the model's limit). It prints one
// JSON object with p50/p99 in milliseconds; the benchmark suite (benchmarks/remote.py) runs it
// next to the Python client's measurement so the server's share of a round trip is visible.
//
//	go run ./cmd/latency -target 127.0.0.1:50051 -model stub -n 2000
package main

import (
	"context"
	"encoding/json"
	"flag"
	"log"
	"os"
	"slices"
	"time"

	"github.com/ferrum-service/ferrum-service/clients/go/ferrum"
	pb "github.com/ferrum-service/ferrum-service/clients/go/gen/ferrum/executor/v1"
)

func pct(xs []time.Duration, q float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	k := int(q/100*float64(len(s)-1) + 0.5)
	return float64(s[k].Nanoseconds()) / 1e6
}

func main() {
	target := flag.String("target", "127.0.0.1:50051", "server host:port")
	model := flag.String("model", "stub", "model id")
	n := flag.Int("n", 2000, "timed steps per mode (after 100 untimed)")
	perCache := flag.Int("per-cache", 500, "steps per cache")
	flag.Parse()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	c, err := ferrum.Dial(*target)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	prompt := []int32{1, 2, 3}

	unary := make([]time.Duration, 0, *n+100)
	var cacheID string
	for k := 0; k < *n+100; k++ {
		if k%*perCache == 0 {
			if cacheID != "" {
				if _, err := c.ReleaseCache(ctx, *model, cacheID); err != nil {
					log.Fatal(err)
				}
			}
			out, err := c.Prefill(ctx, *model, prompt)
			if err != nil {
				log.Fatal(err)
			}
			cacheID = out.GetCache().GetCacheId()
		}
		t := time.Now()
		if _, err := c.Decode(ctx, *model, cacheID, 5); err != nil {
			log.Fatal(err)
		}
		unary = append(unary, time.Since(t))
	}
	if _, err := c.ReleaseCache(ctx, *model, cacheID); err != nil {
		log.Fatal(err)
	}

	s, err := c.Session(ctx)
	if err != nil {
		log.Fatal(err)
	}
	session := make([]time.Duration, 0, *n+100)
	for k := 0; k < *n+100; k++ {
		if k%*perCache == 0 {
			msg, err := s.Do(ferrum.PrefillRequest(*model, prompt))
			if err != nil {
				log.Fatal(err)
			}
			cacheID = msg.(*pb.PrefillResponse).GetOutput().GetCache().GetCacheId()
		}
		req := ferrum.DecodeRequest(*model, cacheID, 5)
		t := time.Now()
		if _, err := s.Do(req); err != nil {
			log.Fatal(err)
		}
		session = append(session, time.Since(t))
	}
	if err := s.Close(); err != nil { // frees the session's caches
		log.Fatal(err)
	}
	unary, session = unary[100:], session[100:]
	_ = json.NewEncoder(os.Stdout).Encode(map[string]any{
		"client": "go", "n": *n,
		"unary_p50_ms": pct(unary, 50), "unary_p99_ms": pct(unary, 99),
		"session_p50_ms": pct(session, 50), "session_p99_ms": pct(session, 99),
	})
}
