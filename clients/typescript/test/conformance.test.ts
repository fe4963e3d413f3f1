// The language-neutral scenario (tests/conformance/scenario.json) against a fresh server of its own
// (the scripted model's decode counter is per server).
import { test } from "node:test";
import assert from "node:assert/strict";
import { FerrumClient } from "../src/client";
import { loadScenario, runScenario, withProfile } from "../src/conformance";
import { noServerReason, scenarioPath, scenarioVars, startScenarioServer } from "../src/testserver";

const reason = noServerReason();
// In CI (CI=true, or FERRUM_SERVER_CMD set) a missing server fails the suite instead of skipping.
const strict = process.env.CI === "true" || !!process.env.FERRUM_SERVER_CMD?.trim();
const skip = strict ? undefined : reason;

test("a server is available in CI", { skip: strict ? false : "not in CI" }, () => {
  assert.equal(reason, undefined, `no server in CI: ${reason}`);
});

// Once with the scenario's own models, once per profile (llama-cpp: "tiny" on the llama.cpp executor).
for (const profile of ["", "llama-cpp"]) {
  const name = profile ? `conformance scenario (profile ${profile})` : "conformance scenario";
  test(name, { skip: skip ? `skipping: ${skip}` : false, timeout: 300_000 }, async () => {
    const sc = withProfile(loadScenario(scenarioPath()), profile);
    // the main server and the peer (the KV handoff destination, --role decode)
    const [srv, peerSrv] = await Promise.all([startScenarioServer(profile), startScenarioServer(profile, true)]);
    const c = new FerrumClient(srv.target);
    const peer = new FerrumClient(peerSrv.target);
    try {
      const sum = await runScenario({ main: c, mainTarget: srv.target, peer, peerTarget: peerSrv.target }, sc,
        (line) => console.log(line), scenarioVars(profile));
      const bad = sum.steps.filter((s) => s.status === "FAIL").map((s) => `${s.id}: ${s.error}`);
      assert.deepEqual(bad, [], `${sum.failed} conformance step(s) failed`);
      // every step runs and passes (an expected failure must be marked xfail in the scenario file)
      assert.equal(sum.failed, 0, `${sum.failed} conformance step(s) failed`);
      assert.equal(sum.steps.length, sc.steps.length, `${sum.steps.length} of ${sc.steps.length} steps ran`);
      assert.equal(sum.passed + sum.xfailed + sum.skipped, sc.steps.length, `${sum.passed} of ${sc.steps.length} steps passed`);
      assert.ok(sum.passed > sum.skipped, `${sum.skipped} steps skipped, only ${sum.passed} passed`);
    } finally {
      c.close();
      peer.close();
      await Promise.all([srv.stop(), peerSrv.stop()]);
    }
  });
}
