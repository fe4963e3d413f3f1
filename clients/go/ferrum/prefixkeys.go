package ferrum

import (
	"crypto/sha256"
	"encoding/binary"
)

// The prefix-cache key recipe (PrefixCacheRecipe in the contract, advertised in
// ModelInfo.PrefixCache):
//
//	root   = SHA-256(seed || 0x00 || model_id || 0x00 || cache_salt [|| 0x00 || adapter])
//	key[i] = SHA-256(key[i-1] || block i's token ids as little-endian uint32)   (key[-1] = root)
//
// An empty adapter (the base model) is left out together with its 0x00. Only full blocks are
// keyed. A router that mirrors a replica's block events (PrefixMirror) keys a new prompt this way
// and looks the keys up, longest chain first.
const (
	PrefixAlgorithm = "sha256-chain-v1"
	PrefixSeed      = "ferrum-prefix-v1"
)

// BlockHash is one 32-byte prefix-cache block key.
type BlockHash = [32]byte

// ChainRoot is the key every chain of modelID starts from, under cacheSalt, computed with LoRA
// adapter ("" = the base model). seed "" means PrefixSeed.
func ChainRoot(seed, modelID, cacheSalt, adapter string) BlockHash {
	if seed == "" {
		seed = PrefixSeed
	}
	h := sha256.New()
	h.Write([]byte(seed))
	h.Write([]byte{0})
	h.Write([]byte(modelID))
	h.Write([]byte{0})
	h.Write([]byte(cacheSalt))
	if adapter != "" {
		h.Write([]byte{0})
		h.Write([]byte(adapter))
	}
	var out BlockHash
	h.Sum(out[:0])
	return out
}

// BlockKey is the key of one full block given its parent's key (or the chain root).
func BlockKey(parent BlockHash, tokens []int32) BlockHash {
	buf := make([]byte, 0, 32+4*len(tokens))
	buf = append(buf, parent[:]...)
	for _, t := range tokens {
		buf = binary.LittleEndian.AppendUint32(buf, uint32(t))
	}
	return sha256.Sum256(buf)
}

// BlockKeys are the keys of the full blocks of tokens, chained from parent (ChainRoot for a new
// sequence); a trailing partial block has none.
func BlockKeys(parent BlockHash, tokens []int32, blockSize int) []BlockHash {
	if blockSize <= 0 {
		return nil
	}
	keys := make([]BlockHash, 0, len(tokens)/blockSize)
	for start := 0; start+blockSize <= len(tokens); start += blockSize {
		parent = BlockKey(parent, tokens[start:start+blockSize])
		keys = append(keys, parent)
	}
	return keys
}

// PromptBlockKeys are the block keys of a new prompt of modelID under the default seed.
func PromptBlockKeys(modelID, cacheSalt, adapter string, tokens []int32, blockSize int) []BlockHash {
	return BlockKeys(ChainRoot("", modelID, cacheSalt, adapter), tokens, blockSize)
}

// LongestCachedPrefix is how many leading keys has reports cached.
func LongestCachedPrefix(keys []BlockHash, has func(BlockHash) bool) int {
	n := 0
	for _, k := range keys {
		if !has(k) {
			break
		}
		n++
	}
	return n
}
