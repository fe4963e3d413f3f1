// The language-neutral scenario (tests/conformance/scenario.json) against a fresh server of its own
// (the scripted model's decode counter is per server).
import { test } from "node:test";
import assert from "node:assert/strict";
import { FerrumClient } from "../src/client";
import { loadScenario, runScenario } from "../src/conformance";
import { noServerReason, scenarioPath, startServer } from "../src/testserver";

const skip = noServerReason();

test("conformance scenario", { skip: skip ? `skipping: ${skip}` : false, timeout: 300_000 }, async () => {
  const srv = await startServer();
  const c = new FerrumClient(srv.target);
  try {
    const sum = await runScenario(c, loadScenario(scenarioPath()), (line) => console.log(line));
    const bad = sum.steps.filter((s) => s.status === "FAIL").map((s) => `${s.id}: ${s.error}`);
    assert.deepEqual(bad, [], `${sum.failed} conformance step(s) failed`);
    assert.ok(sum.passed >= 40, `only ${sum.passed} steps passed`);
  } finally {
    c.close();
    await srv.stop();
  }
});
