package ferrum_test

import (
	"testing"

	"github.com/ferrum-service/ferrum-service/clients/go/ferrum"
)

// The Adapter step option lands in the PrefillInput (no server needed); the LoRA RPCs themselves
// are exercised against a server with adapters by the Python suite (tests/test_lora*.py).
func TestPrefillRequestCarriesTheAdapter(t *testing.T) {
	req := ferrum.PrefillRequest("tiny", []int32{1, 2, 3}, ferrum.Adapter("sql"), ferrum.Reserve(16))
	if got := req.GetInput().GetAdapter(); got != "sql" {
		t.Fatalf("input.adapter = %q, want \"sql\"", got)
	}
	if req.GetInput().GetReserveTokens() != 16 {
		t.Fatalf("reserve_tokens = %d", req.GetInput().GetReserveTokens())
	}
	// continuing a cache without the option sends no adapter: the cache's own applies
	if got := ferrum.PrefillRequest("tiny", []int32{4}, ferrum.Continue("c1")).GetInput().GetAdapter(); got != "" {
		t.Fatalf("input.adapter = %q, want empty", got)
	}
}
