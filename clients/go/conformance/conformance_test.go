package conformance_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ferrum-service/ferrum-service/clients/go/conformance"
	"github.com/ferrum-service/ferrum-service/clients/go/ferrum"
	"github.com/ferrum-service/ferrum-service/clients/go/internal/testserver"
)

// TestScenario runs tests/conformance/scenario.json against a fresh server (the configurable
// executor's decode counter is per server, so every run needs its own).
func TestScenario(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	path, err := testserver.ScenarioPath()
	if err != nil {
		t.Fatal(err)
	}
	sc, err := conformance.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := testserver.ServerCommand(); errors.Is(err, testserver.ErrNoServer) {
		t.Skipf("skipping: %v", err)
	}
	models, err := testserver.ScenarioModels(ctx)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := testserver.Start(ctx, models)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Stop()
	c, err := ferrum.Dial(srv.Target)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var out strings.Builder
	sum := conformance.Run(ctx, c, sc, &out)
	os.Stdout.WriteString(out.String())
	for _, s := range sum.Steps {
		if s.Status == "FAIL" {
			t.Errorf("step %s (%s): %s", s.ID, s.Op, s.Error)
		}
	}
	if sum.Passed < 40 {
		t.Errorf("only %d steps passed", sum.Passed)
	}
}
