// Live stream migration through FerrumClient: two servers that authenticate callers and count each
// other as KV peers; a greedy 64-token Generate on A is moved to B (migrateStreams) after 2 tokens.
// `generate` follows the move with the caller's token (B checks it) and yields exactly the unmoved
// run's tokens; with followMigrations false the `migrated` event is passed on and the caller
// resumes by hand. The hop limit is checked against a fake server whose stream never settles.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import * as path from "node:path";
import { connectivityState, Server, ServerCredentials, ServerWritableStream, status } from "@grpc/grpc-js";
import { FerrumClient, FerrumError, GenerateCallOpts, generateArgs, MAX_MIGRATION_HOPS, pb } from "../src";
import { noServerReason, startServer, TestServer } from "../src/testserver";

const skip = noServerReason();
const opts = { skip: skip ? `skipping: ${skip}` : false, timeout: 240_000 };
const TOKEN = "tok-user";
const prompt = Array.from({ length: 24 }, (_, i) => 1 + ((i * 37) % 499));
let dir = "";
let a: TestServer | undefined;
let b: TestServer | undefined;
let ca: FerrumClient;
let cb: FerrumClient;

before(async () => {
  if (skip) return;
  dir = mkdtempSync(path.join(tmpdir(), "ferrum-ts-mig-"));
  writeFileSync(path.join(dir, "users"), `${TOKEN}\n`);
  writeFileSync(path.join(dir, "peers"), "tok-peer\n");
  const args = ["--auth-token-file", path.join(dir, "users"), "--kv-peer", "127.0.0.1:1024-65535",
    "--kv-peer-token-file", path.join(dir, "peers"), "--open-admin-rpcs"];
  const models = ["hf-causal-lm,id=tiny,path=${TINY_MODEL_DIR}"];
  b = await startServer(models, 180_000, args);
  a = await startServer(models, 180_000, args);
  ca = new FerrumClient(a.target, { token: TOKEN });
  cb = new FerrumClient(b.target, { token: TOKEN });
});

after(async () => {
  ca?.close();
  cb?.close();
  await Promise.all([a?.stop(), b?.stop()]);
  if (dir) rmSync(dir, { recursive: true, force: true });
});

interface MovedRun {
  tokens: number[];
  indexes: number[];
  finished?: pb.GenerateFinished;
  migrated?: pb.GenerateMigrated;
  followed: string[];
  move?: pb.MigrateStreamsResponse;
}

/** One Generate on A that migrateStreams moves to B once `at` tokens arrived. */
async function runMoved(requestId: string, at: number, o: GenerateCallOpts = {}): Promise<MovedRun> {
  const r: MovedRun = { tokens: [], indexes: [], followed: [] };
  let moving: Promise<pb.MigrateStreamsResponse> | undefined;
  const req = generateArgs("tiny", prompt, { maxTokens: 64, ignoreEos: true, requestId });
  for await (const ev of ca.generate(req, { ...o, onMigrated: (m) => r.followed.push(m.target) })) {
    const e = ev.event;
    if (e?.$case === "token") {
      r.tokens.push(e.token.tokenId);
      r.indexes.push(e.token.index);
      if (r.tokens.length === at) moving = ca.migrateStreams(b!.target, { requestId });
    } else if (e?.$case === "finished") r.finished = e.finished;
    else if (e?.$case === "migrated") r.migrated = e.migrated;
  }
  r.move = await moving;
  return r;
}

/** runMoved until the move landed (on a loaded machine the tiny model may finish all 64 tokens
 * before the move reaches a step boundary: then it is tried again, at most 3 times). */
async function moved(o: GenerateCallOpts = {}): Promise<MovedRun> {
  for (let i = 0; i < 3; i++) {
    const r = await runMoved(`mv-${i}`, 2, o);
    if (r.move?.migrated === 1) return r;
    console.log(`attempt ${i}: not moved (${JSON.stringify(r.move?.streams)}): the stream ended first`);
  }
  assert.fail("migrateStreams never moved the stream in 3 attempts");
}

async function reference(): Promise<number[]> {
  const ref = await ca.generateAll(generateArgs("tiny", prompt, { maxTokens: 64, ignoreEos: true }));
  assert.equal(ref.tokens.length, 64);
  assert.deepEqual(ref.migrations, []);
  return ref.tokens;
}

test("generate follows a migrated stream: the unmoved run's tokens, once each, ending on B", opts, async () => {
  const ref = await reference();
  const r = await moved();
  assert.deepEqual(r.followed, [b!.target]);
  assert.equal(r.migrated, undefined, "a followed migrated event was passed on");
  assert.deepEqual(r.tokens, ref);
  assert.deepEqual(r.indexes, Array.from({ length: 64 }, (_, i) => i), "a duplicate or a gap");
  assert.equal(r.finished?.generatedTokens, 64);
  assert.equal(r.finished?.finishReason, pb.FinishReason.FINISH_REASON_LENGTH);
  // the stream ended on B: B decoded its tail and prefilled nothing (its KV came from A)
  const m = (await cb.status("tiny")).metrics!;
  assert.equal(Number(m.prefillOperations), 0);
  assert.ok(Number(m.decodeOperations) > 0);
  // a request id nothing runs under moves nothing
  const none = await ca.migrateStreams(b!.target, { requestId: "nothing-runs" });
  assert.equal(none.migrated, 0);
  assert.deepEqual(none.streams, []);
});

test("followMigrations false passes the migrated event on; the caller resumes on B", opts, async () => {
  const ref = await reference();
  const r = await moved({ followMigrations: false });
  assert.ok(r.migrated, "no migrated event");
  assert.equal(r.finished, undefined);
  assert.deepEqual(r.followed, []);
  assert.equal(r.migrated.target, b!.target);
  assert.equal(r.migrated.generatedTokens, r.tokens.length);
  const rest = await cb.generateAll({ modelId: "tiny", resumeToken: r.migrated.resumeToken });
  assert.deepEqual([...r.tokens, ...rest.tokens], ref);
  await assert.rejects(cb.generateAll({ modelId: "tiny", resumeToken: r.migrated.resumeToken }),
    (e: unknown) => e instanceof FerrumError && e.code === status.NOT_FOUND, "a resume token is single use");
});

test("a stream that keeps moving is followed 16 times, then ABORTED, with the caller's token", async () => {
  const seen: string[] = [];
  const server = new Server();
  let self = "";
  server.addService(pb.ModelExecutorService, {
    generate(call: ServerWritableStream<pb.GenerateRequest, pb.GenerateResponse>) {
      const n = seen.push(`${call.metadata.get("authorization")[0] ?? ""}|${call.request.resumeToken}`);
      call.write(pb.GenerateResponse.fromPartial({ event: { $case: "started",
        started: { promptTokens: 3, resumedTokens: n - 1 } } }));
      call.write(pb.GenerateResponse.fromPartial({ event: { $case: "token", token: { tokenId: 5, index: n - 1 } } }));
      call.write(pb.GenerateResponse.fromPartial({ event: { $case: "migrated",
        migrated: { target: self, resumeToken: `rt-${n}`, generatedTokens: n } } }));
      call.end();
    },
  });
  const port = await new Promise<number>((resolve, reject) =>
    server.bindAsync("127.0.0.1:0", ServerCredentials.createInsecure(), (e, p) => (e ? reject(e) : resolve(p))));
  self = `127.0.0.1:${port}`;
  const c = new FerrumClient(self, { token: "tok-x" });
  try {
    const kinds: string[] = [];
    await assert.rejects((async () => {
      for await (const ev of c.generate(generateArgs("m", [1, 2, 3]))) kinds.push(ev.event!.$case);
    })(), (e: unknown) => e instanceof FerrumError && e.code === status.ABORTED);
    assert.equal(seen.length, MAX_MIGRATION_HOPS + 1);
    assert.deepEqual(kinds, ["started", ...Array(MAX_MIGRATION_HOPS + 1).fill("token")]);
    assert.deepEqual(seen, seen.map((_, i) => `Bearer tok-x|${i ? `rt-${i}` : ""}`));
    // without following, the first migrated event is the last one passed on
    const res = await c.generateAll(generateArgs("m", [1]), { followMigrations: false });
    assert.equal(res.migrated?.target, self);
    assert.deepEqual(res.migrations, []);
    // the connection opened to follow the stream is the client's own: close() closes it
    const siblings = (c as unknown as { siblings: Map<string, FerrumClient> }).siblings;
    const followed = siblings.get(self)!.raw.getChannel();
    c.close();
    assert.equal(siblings.size, 0);
    assert.equal(followed.getConnectivityState(false), connectivityState.SHUTDOWN);
  } finally {
    c.close();
    server.forceShutdown();
  }
});
