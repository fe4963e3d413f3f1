// FerrumClient against a live server: a per-sequence scripted model ("seq") and the tiny llama.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { status } from "@grpc/grpc-js";
import { FerrumClient, FerrumError, tokenOf, tokenPrompt, types } from "../src";
import { noServerReason, startServer, TestServer } from "../src/testserver";

const skip = noServerReason();
const opts = { skip: skip ? `skipping: ${skip}` : false, timeout: 120_000 };
const prompt = [1, 100, 200, 300];
let srv: TestServer | undefined;
let c: FerrumClient;

before(async () => {
  if (skip) return;
  srv = await startServer([
    "configurable,id=seq,vocab_size=1000,token_sequence=10:20:30,counter=per_sequence",
    "hf-causal-lm,id=tiny,path=${TINY_MODEL_DIR}",
  ]);
  c = new FerrumClient(srv.target);
});

after(async () => {
  c?.close();
  await srv?.stop();
});

async function rejectsWith(p: Promise<unknown>, code: status, kind?: string): Promise<FerrumError> {
  try {
    await p;
  } catch (e) {
    assert.ok(e instanceof FerrumError, `not a FerrumError: ${e}`);
    assert.equal(e.code, code, e.message);
    if (kind) assert.equal(e.kind, kind);
    return e;
  }
  assert.fail("expected a failure");
}

async function eventuallyGone(model: string, cacheId: string): Promise<void> {
  const deadline = Date.now() + 5000;
  for (;;) {
    try {
      await c.truncateKv(model, cacheId, 0);
    } catch (e) {
      if (e instanceof FerrumError && e.code === status.NOT_FOUND) return;
    }
    assert.ok(Date.now() < deadline, `cache ${cacheId} still there after 5 s`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

async function greedy(n: number): Promise<number[]> {
  const pre = await c.prefill("tiny", prompt);
  const toks = [tokenOf(pre.output)];
  while (toks.length < n) toks.push(tokenOf((await c.decode("tiny", pre.cache!.cacheId, toks.at(-1)!)).output));
  await c.releaseCache("tiny", pre.cache!.cacheId);
  return toks;
}

test("health and info", opts, async () => {
  assert.equal(await c.health(), "SERVING");
  const info = await c.info();
  assert.equal(info.contractVersion, "ferrum.executor.v1");
  assert.deepEqual(info.models.map((m) => m.modelId).sort(), ["seq", "tiny"]);
});

test("scripted tokens, truncate, forward verify, release", opts, async () => {
  const pre = await c.prefill("seq", [1, 2, 3]);
  const id = pre.cache!.cacheId;
  const toks = [tokenOf(pre.output)];
  for (let i = 0; i < 4; i++) toks.push(tokenOf((await c.decode("seq", id, toks.at(-1)!, { position: 3 + i })).output));
  assert.deepEqual(toks, [10, 10, 20, 30, 10]);
  const fv = await c.forwardVerify("seq", id, [10, 20, 99], { acceptGreedyPrefix: true });
  assert.equal(fv.baseLen, 7);
  assert.equal(fv.acceptedDrafts, 1);
  assert.deepEqual(fv.acceptedTokens, [20, 30]);
  assert.equal(fv.cache!.numTokens, 9);
  const tr = await c.truncateKv("seq", id, 4);
  assert.equal(tr.removedTokens, 5);
  const rel = await c.releaseCache("seq", id);
  assert.equal(rel.released, true);
  assert.equal((await c.releaseCache("seq", id)).released, false);
});

test("batch decode equals single decodes", opts, async () => {
  const want = await greedy(2);
  const a = await c.prefill("tiny", prompt);
  const b = await c.prefill("tiny", prompt);
  const outs = await c.batchDecode("tiny", [
    { cacheId: a.cache!.cacheId, tokenId: tokenOf(a.output) },
    { cacheId: b.cache!.cacheId, tokenId: tokenOf(b.output) },
  ]);
  assert.deepEqual(outs.map((o) => tokenOf(o.output)), [want[1], want[1]]);
  assert.deepEqual(outs.map((o) => o.cache!.numTokens), [5, 5]);
  await c.releaseCache("tiny", a.cache!.cacheId);
  await c.releaseCache("tiny", b.cache!.cacheId);
});

test("errors carry code, kind and field", opts, async () => {
  const e = await rejectsWith(c.prefill("tiny", [512]), status.INVALID_ARGUMENT, "REQUEST_VALIDATION");
  assert.equal(e.field, "input.token_ids[0]");
  assert.equal(e.codeName, "INVALID_ARGUMENT");
  await rejectsWith(c.decode("tiny", "no-such-cache", 1), status.NOT_FOUND, "NOT_FOUND");
  await rejectsWith(c.truncateKv("nope", "x", 0), status.NOT_FOUND);
});

test("a failed step says which items ran (StepProgress)", opts, async () => {
  // one live cache and one unknown id in one BatchDecode: no row runs, each item says why
  const pre = await c.prefill("tiny", [5, 6, 7, 8, 9]);
  const cid = pre.cache!.cacheId;
  const e = await rejectsWith(c.batchDecode("tiny", [{ cacheId: cid, tokenId: 5 }, { cacheId: "hf-no-such-cache", tokenId: 5 }]),
    status.NOT_FOUND, "NOT_FOUND");
  assert.deepEqual(e.progress?.items.map((i) => [i.index, i.state, i.tokensRan, i.reason]), [
    [0, types.ItemState.ITEM_STATE_NOT_RUN, 0, "STEP_FAILED"],
    [1, types.ItemState.ITEM_STATE_NOT_RUN, 0, "NOT_FOUND"],
  ]);
  assert.equal(e.unsupportedShape, false);
  // truthful: the live cache did not grow
  const out = await c.batchDecode("tiny", [{ cacheId: cid, tokenId: 5 }]);
  assert.equal(out[0].cache!.numTokens, 6);
  await c.releaseCache("tiny", cid);
});

test("deadlines and abort signals", opts, async () => {
  // A deadline far shorter than the work: 200 decode steps cannot finish in 20 ms. (A 1 µs deadline
  // on Info raced a sub-millisecond loopback answer and once lost.)
  const long = { modelId: "tiny", prompt: tokenPrompt(prompt), stop: { maxTokens: 200, ignoreEos: true } };
  await rejectsWith(c.generateAll(long, { timeoutMs: 20 }), status.DEADLINE_EXCEEDED);
  const ac = new AbortController();
  const p = c.prefill("tiny", prompt, { signal: ac.signal });
  ac.abort();
  await rejectsWith(p, status.CANCELLED);
});

test("generate streams the decode tokens; breaking out cancels", opts, async () => {
  const want = await greedy(5);
  const res = await c.generateAll({ modelId: "tiny", prompt: tokenPrompt(prompt), stop: { maxTokens: 5, ignoreEos: true } });
  assert.deepEqual(res.tokens, want);
  assert.equal(res.finished?.generatedTokens, 5);
  await eventuallyGone("tiny", res.started!.cache!.cacheId);

  let cacheId = "";
  let n = 0;
  for await (const ev of c.generate({ modelId: "tiny", prompt: tokenPrompt(prompt), stop: { maxTokens: 500, ignoreEos: true } })) {
    if (ev.event?.$case === "started") cacheId = ev.event.started.cache!.cacheId;
    if (ev.event?.$case === "finished") assert.fail("finished before the break");
    if (ev.event?.$case === "token" && ++n === 2) break;
  }
  assert.equal(n, 2);
  await eventuallyGone("tiny", cacheId);

  await rejectsWith(c.generateAll({ modelId: "tiny", prompt: tokenPrompt([1]), sampling: { topP: 1.5 } }), status.INVALID_ARGUMENT);
});

test("session: steps in order, failed step goes on, close frees caches", opts, async () => {
  const want = await greedy(2);
  const s = c.session();
  const pre = await s.prefill("tiny", prompt);
  const id = pre.output!.cache!.cacheId;
  await rejectsWith(s.decode("tiny", id, 512), status.INVALID_ARGUMENT);
  // Two steps in flight at once; results come back in order.
  const [d, t] = await Promise.all([s.decode("tiny", id, tokenOf(pre.output!.output)), s.truncateKv("tiny", id, 4)]);
  assert.deepEqual([tokenOf(pre.output!.output), tokenOf(d.output!.output)], want);
  assert.equal(t.cache!.numTokens, 4);
  await s.close();
  await eventuallyGone("tiny", id);
});
