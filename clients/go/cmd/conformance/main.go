// Command conformance runs tests/conformance/scenario.json through the Go client.
//
//	go run ./cmd/conformance                       # starts two fresh servers itself (main, peer)
//	go run ./cmd/conformance -profile llama-cpp    # the same for a profile
//	go run ./cmd/conformance -target host:port -peer host:port   # against FRESH servers you started
package main

import (
	"context"
	"flag"
	"log"
	"os"
	"time"

	"github.com/ferrum-service/ferrum-service/clients/go/conformance"
	"github.com/ferrum-service/ferrum-service/clients/go/ferrum"
	"github.com/ferrum-service/ferrum-service/clients/go/internal/testserver"
)

func main() {
	target := flag.String("target", "", "host:port of a fresh server hosting the scenario's models (empty: start one)")
	peerTarget := flag.String("peer", "", "with -target: host:port of the fresh peer (harness.py serve --peer)")
	profile := flag.String("profile", "", "a profile of the scenario (its models and variables)")
	scenario := flag.String("scenario", "", "scenario file (default: tests/conformance/scenario.json of the checkout)")
	flag.Parse()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	path := *scenario
	if path == "" {
		p, err := testserver.ScenarioPath()
		if err != nil {
			log.Fatal(err)
		}
		path = p
	}
	sc, err := conformance.Load(path)
	if err != nil {
		log.Fatal(err)
	}
	if sc, err = sc.WithProfile(*profile); err != nil {
		log.Fatal(err)
	}
	if sc.Vars, err = testserver.ProfileVars(ctx, *profile); err != nil {
		log.Fatal(err)
	}
	if *target == "" {
		srv, peer, err := testserver.StartScenario(ctx, *profile)
		if err != nil {
			log.Fatal(err)
		}
		defer srv.Stop()
		defer peer.Stop()
		*target, *peerTarget = srv.Target, peer.Target
	}
	c, err := ferrum.Dial(*target)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	servers := &conformance.Servers{Main: c, MainTarget: *target, PeerTarget: *peerTarget}
	if *peerTarget != "" {
		if servers.Peer, err = ferrum.Dial(*peerTarget); err != nil {
			log.Fatal(err)
		}
		defer servers.Peer.Close()
	}
	sum := conformance.RunWith(ctx, servers, sc, os.Stdout)
	if sum.Failed > 0 {
		c.Close()
		os.Exit(1)
	}
}
