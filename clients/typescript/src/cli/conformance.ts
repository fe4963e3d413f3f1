/**
 * The conformance scenario as a command:
 *   node dist/src/cli/conformance.js [--profile P]                       # starts fresh servers itself
 *   node dist/src/cli/conformance.js --target h:p --peer h:p [--profile P] # against FRESH servers you started
 */
import { FerrumClient } from "../client";
import { loadScenario, runScenario, withProfile } from "../conformance";
import { scenarioPath, scenarioVars, startScenarioServer, TestServer } from "../testserver";

function arg(name: string): string {
  const i = process.argv.indexOf(name);
  return i >= 0 ? process.argv[i + 1] ?? "" : "";
}

async function main(): Promise<number> {
  const profile = arg("--profile");
  let target = arg("--target");
  let peerTarget = arg("--peer");
  const started: TestServer[] = [];
  try {
    if (!target) {
      const [m, p] = await Promise.all([startScenarioServer(profile), startScenarioServer(profile, true)]);
      started.push(m, p);
      target = m.target;
      peerTarget = p.target;
    }
    const main = new FerrumClient(target);
    const peer = peerTarget ? new FerrumClient(peerTarget) : undefined;
    try {
      const sum = await runScenario({ main, mainTarget: target, peer, peerTarget }, withProfile(loadScenario(scenarioPath()), profile),
        console.log, scenarioVars(profile));
      return sum.failed ? 1 : 0;
    } finally {
      main.close();
      peer?.close();
    }
  } finally {
    await Promise.all(started.map((s) => s.stop()));
  }
}

main().then((rc) => process.exit(rc), (e) => {
  console.error(e);
  process.exit(2);
});
