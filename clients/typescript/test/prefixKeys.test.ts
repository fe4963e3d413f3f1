// The shared prefix-key vectors (tests/conformance/prefix_key_vectors.json): every language's recipe
// must reproduce each case's root and block keys exactly. No server needed.
import { test } from "node:test";
import assert from "node:assert/strict";
import { existsSync, readFileSync } from "node:fs";
import * as path from "node:path";
import { ALGORITHM, blockKeys, chainRoot, EXTRA_KEYS, PrefixMirror, recipeUsable, SEED } from "../src";
import { repoRoot } from "../src/testserver";

interface Case {
  name: string; model_id: string; cache_salt: string; adapter: string; block_size: number;
  token_ids: number[]; root: string; block_keys: string[];
}
const file = path.join(repoRoot(), "tests", "conformance", "prefix_key_vectors.json");

test("prefix key vectors: roots and block keys match", async () => {
  assert.ok(existsSync(file), `${file} is missing`);
  const v = JSON.parse(readFileSync(file, "utf8")) as { algorithm: string; seed: string; extra_keys: string[]; cases: Case[] };
  assert.equal(v.algorithm, ALGORITHM);
  assert.equal(v.seed, SEED);
  assert.deepEqual(v.extra_keys, [...EXTRA_KEYS]);
  assert.ok(v.cases.length > 0);
  for (const c of v.cases) {
    assert.equal(chainRoot(c.model_id, c.cache_salt, c.adapter).toString("hex"), c.root, `${c.name}: root`);
    const keys = blockKeys(c.token_ids, c.block_size, c.model_id, { cacheSalt: c.cache_salt, adapter: c.adapter });
    assert.deepEqual(keys.map((k) => k.toString("hex")), c.block_keys, `${c.name}: block keys`);
  }
});

test("a chain continued from a parent equals the whole chain", () => {
  const toks = Array.from({ length: 12 }, (_, i) => i * 7);
  const all = blockKeys(toks, 4, "m", { cacheSalt: "s" });
  const tail = blockKeys(toks.slice(4), 4, "m", { parent: all[0] });
  assert.deepEqual(tail, all.slice(1));
  assert.throws(() => blockKeys(toks, 0, "m"), RangeError);
});

test("mirror: stored, removed, cleared and resync", () => {
  const m = new PrefixMirror();
  const recipe = { enabled: true, algorithm: ALGORITHM, blockSize: 4, seed: SEED, extraKeys: [...EXTRA_KEYS] };
  m.recipes.set("tiny", recipe);
  const toks = [1, 2, 3, 4, 5, 6, 7, 8, 9];
  const keys = blockKeys(toks, 4, "tiny");
  const stored = (seq: number, hashes: Buffer[]) => ({ message: { $case: "blockEvent" as const, blockEvent: {
    seq, modelId: "tiny", timeUnixNs: 0, data: { $case: "stored" as const, stored: { blockHashes: hashes,
      parentBlockHash: Buffer.alloc(0), tokenIds: [], blockSize: 4, adapter: "" } } } } });
  assert.equal(m.apply(stored(1, keys)), true);
  assert.equal(m.cachedTokens("tiny", toks), 8);
  assert.equal(m.cachedTokens("tiny", toks, "other-salt"), 0);
  m.apply({ seq: 2, modelId: "tiny", timeUnixNs: 0, data: { $case: "removed", removed: { blockHashes: [keys[1]] } } });
  assert.equal(m.cachedTokens("tiny", toks), 4);
  m.apply({ seq: 3, modelId: "tiny", timeUnixNs: 0, data: { $case: "cleared", cleared: {} } });
  assert.equal(m.size, 0);
  m.apply(stored(4, keys));
  assert.equal(m.lastSeq, 4);
  m.apply({ message: { $case: "resyncRequired", resyncRequired: { requestedSeq: 1, oldestAvailableSeq: 5, nextSeq: 9 } } });
  assert.equal(m.size, 0);
  assert.equal(m.resyncs, 1);
  // recipes this client does not compute key nothing
  assert.equal(recipeUsable({ ...recipe, algorithm: "other" }), false);
  assert.equal(recipeUsable({ ...recipe, extraKeys: ["model_id", "cache_salt"] }, "sql"), false);
  assert.equal(recipeUsable({ ...recipe, enabled: false }), false);
});
