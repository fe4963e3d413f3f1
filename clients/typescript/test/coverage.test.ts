// Every RPC of the ModelExecutor service (protos/) has a FerrumClient method: a new RPC without a
// helper fails here unless it is listed as a deliberate gap. No server needed.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import * as path from "node:path";
import { FerrumClient, Session } from "../src";
import { repoRoot } from "../src/testserver";

/** RPCs whose helper has another name (or several). */
const RENAMED: Record<string, string[]> = { ImportKv: ["importKv", "pullKv"], Session: ["session"] };
/** RPCs deliberately without a helper (the same list as tests/client_api_allowlist.json):
 * AcceptMigration is called by one server on another, never by a caller. */
const DELIBERATE_GAPS: string[] = ["AcceptMigration"];
/** Session step kinds (SessionRequest.step) each have a Session method. */
const SESSION_STEPS = ["prefill", "batchPrefill", "decode", "batchDecode", "unifiedDecode", "forwardVerify",
  "truncateKv", "releaseCache", "forkCache"];

test("every RPC of the service has a client method", () => {
  const proto = readFileSync(path.join(repoRoot(), "protos", "ferrum", "executor", "v1", "executor.proto"), "utf8");
  const rpcs = [...proto.matchAll(/^\s*rpc\s+(\w+)\s*\(/gm)].map((m) => m[1]);
  assert.ok(rpcs.length >= 35, `only ${rpcs.length} rpcs parsed`);
  const missing = rpcs.filter((r) => !DELIBERATE_GAPS.includes(r))
    .flatMap((r) => (RENAMED[r] ?? [r[0].toLowerCase() + r.slice(1)]).map((m) => [r, m] as const))
    .filter(([, m]) => typeof (FerrumClient.prototype as unknown as Record<string, unknown>)[m] !== "function")
    .map(([r, m]) => `${r} (${m})`);
  assert.deepEqual(missing, []);
  const noStep = SESSION_STEPS.filter((m) => typeof (Session.prototype as unknown as Record<string, unknown>)[m] !== "function");
  assert.deepEqual(noStep, []);
  const steps = proto.slice(proto.indexOf("message SessionRequest"), proto.indexOf("message SessionResponse"));
  const stepFields = [...steps.matchAll(/^\s+\w+Request\s+(\w+)\s*=/gm)].map((m) => m[1].replace(/_(\w)/g, (_, c) => c.toUpperCase()));
  assert.deepEqual(stepFields.sort(), [...SESSION_STEPS].sort());
});
