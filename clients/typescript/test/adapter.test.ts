// The LoRA adapter in the requests the client builds (no server needed); the RPCs themselves run
// against a server with adapters in the Python suite (tests/test_lora*.py).
import { test } from "node:test";
import assert from "node:assert/strict";
import { prefillRequest } from "../src";

test("a prefill carries its adapter; a continuing one leaves it to the cache", () => {
  const req = prefillRequest("tiny", [1, 2, 3], { adapter: "sql", reserveTokens: 16 });
  assert.equal(req.input?.adapter, "sql");
  assert.equal(req.input?.reserveTokens, 16);
  assert.equal(prefillRequest("tiny", [4], { cacheId: "c1" }).input?.adapter, "");
});
