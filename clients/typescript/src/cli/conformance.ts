/**
 * The conformance scenario as a command:
 *   node dist/src/cli/conformance.js                  # starts a fresh server itself
 *   node dist/src/cli/conformance.js --target h:p     # against a FRESH server you started
 */
import { FerrumClient } from "../client";
import { loadScenario, runScenario } from "../conformance";
import { scenarioPath, startServer, TestServer } from "../testserver";

async function main(): Promise<number> {
  const i = process.argv.indexOf("--target");
  let target = i >= 0 ? process.argv[i + 1] : "";
  let srv: TestServer | undefined;
  if (!target) {
    srv = await startServer();
    target = srv.target;
  }
  const c = new FerrumClient(target);
  try {
    const sum = await runScenario(c, loadScenario(scenarioPath()));
    return sum.failed ? 1 : 0;
  } finally {
    c.close();
    await srv?.stop();
  }
}

main().then((rc) => process.exit(rc), (e) => {
  console.error(e);
  process.exit(2);
});
