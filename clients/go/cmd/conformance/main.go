// Command conformance runs tests/conformance/scenario.json through the Go client.
//
//	go run ./cmd/conformance                       # starts a fresh server itself
//	go run ./cmd/conformance -target host:port     # against a FRESH server you started
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
	if *target == "" {
		models, err := testserver.ScenarioModels(ctx)
		if err != nil {
			log.Fatal(err)
		}
		srv, err := testserver.Start(ctx, models)
		if err != nil {
			log.Fatal(err)
		}
		defer srv.Stop()
		*target = srv.Target
	}
	c, err := ferrum.Dial(*target)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	sum := conformance.Run(ctx, c, sc, os.Stdout)
	if sum.Failed > 0 {
		c.Close()
		os.Exit(1)
	}
}
