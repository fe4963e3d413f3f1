package ferrum_test

import (
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/ferrum-service/ferrum-service/clients/go/ferrum"
)

// The shared cross-language vectors (tests/conformance/prefix_key_vectors.json, written from the
// Python recipe): the Go recipe must reproduce every root and key exactly.
func TestPrefixKeyVectors(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("..", "..", "..", "tests", "conformance", "prefix_key_vectors.json"))
	if err != nil {
		t.Fatal(err)
	}
	var v struct {
		Algorithm string `json:"algorithm"`
		Seed      string `json:"seed"`
		Cases     []struct {
			Name      string   `json:"name"`
			ModelID   string   `json:"model_id"`
			CacheSalt string   `json:"cache_salt"`
			Adapter   string   `json:"adapter"`
			BlockSize int      `json:"block_size"`
			TokenIDs  []int32  `json:"token_ids"`
			Root      string   `json:"root"`
			BlockKeys []string `json:"block_keys"`
		} `json:"cases"`
	}
	if err := json.Unmarshal(raw, &v); err != nil {
		t.Fatal(err)
	}
	if v.Algorithm != ferrum.PrefixAlgorithm || v.Seed != ferrum.PrefixSeed {
		t.Fatalf("vectors are for %s/%s, the client computes %s/%s", v.Algorithm, v.Seed, ferrum.PrefixAlgorithm, ferrum.PrefixSeed)
	}
	if len(v.Cases) < 10 {
		t.Fatalf("only %d cases", len(v.Cases))
	}
	keys := 0
	for _, c := range v.Cases {
		root := ferrum.ChainRoot(v.Seed, c.ModelID, c.CacheSalt, c.Adapter)
		if got := hex.EncodeToString(root[:]); got != c.Root {
			t.Errorf("%s: root %s, want %s", c.Name, got, c.Root)
		}
		got := ferrum.PromptBlockKeys(c.ModelID, c.CacheSalt, c.Adapter, c.TokenIDs, c.BlockSize)
		if len(got) != len(c.BlockKeys) {
			t.Errorf("%s: %d keys, want %d", c.Name, len(got), len(c.BlockKeys))
			continue
		}
		for i := range got {
			if h := hex.EncodeToString(got[i][:]); h != c.BlockKeys[i] {
				t.Errorf("%s: key %d = %s, want %s", c.Name, i, h, c.BlockKeys[i])
			}
			keys++
		}
	}
	t.Logf("%d cases, %d keys match", len(v.Cases), keys)
}
