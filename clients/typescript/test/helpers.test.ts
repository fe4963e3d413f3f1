// The scheduler-facing helpers against live servers (the tiny llama on hf-causal-lm): prefix hits,
// salts and bypass, ForkCache, Generate n, constraints, Loads / ListCaches, KV events with replay,
// Abort, KV handoff (push and pull) between two servers, the prefix mirror and the prefix-aware router.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { status } from "@grpc/grpc-js";
import {
  BlockEventFollower, constraints, DisaggregatedRouter, FerrumClient, FerrumError, generateArgs, handoff, pb,
  prefillAndHandoff, PrefixRouter, tokenOf, waitUntil,
} from "../src";
import { noServerReason, startServer, TestServer } from "../src/testserver";

const skip = noServerReason();
const opts = { skip: skip ? `skipping: ${skip}` : false, timeout: 180_000 };
const TINY = "hf-causal-lm,id=tiny,path=${TINY_MODEL_DIR}";
let a: TestServer | undefined;
let b: TestServer | undefined;
let ca: FerrumClient;
let cb: FerrumClient;

// 40 tokens: two full blocks of 16 and a partial one.
const prompt = (seed: number) => Array.from({ length: 40 }, (_, i) => 1 + ((i * 37 + seed * 101) % 500));

before(async () => {
  if (skip) return;
  // b pulls KV from a in the handoff test: a server pulls only from its --kv-peer list
  [a, b] = await Promise.all([startServer([TINY]), startServer([TINY], 180_000, ["--kv-peer", "127.0.0.1:1024-65535"])]);
  ca = new FerrumClient(a.target);
  cb = new FerrumClient(b.target);
});

after(async () => {
  ca?.close();
  cb?.close();
  await Promise.all([a?.stop(), b?.stop()]);
});

async function rejectsWith(p: Promise<unknown>, code: status): Promise<FerrumError> {
  try {
    await p;
  } catch (e) {
    assert.ok(e instanceof FerrumError, `not a FerrumError: ${e}`);
    assert.equal(e.code, code, e.message);
    return e;
  }
  assert.fail("expected a failure");
}

/** Greedy continuation of a cache: `n` tokens after `first`, on `c`. */
async function continueGreedy(c: FerrumClient, cacheId: string, first: number, n: number): Promise<number[]> {
  const out = [first];
  while (out.length <= n) out.push(tokenOf((await c.decode("tiny", cacheId, out.at(-1)!)).output));
  return out;
}

test("capabilities and the advertised recipe", opts, async () => {
  const caps = (await ca.capabilities("tiny"))!;
  assert.equal(caps.supportsPrefixCaching, true);
  assert.equal(caps.supportsFork, true);
  assert.equal(caps.supportsKvTransfer, true);
  const info = await ca.info("tiny");
  const r = info.models[0].prefixCache!;
  assert.equal(r.algorithm, "sha256-chain-v1");
  assert.equal(r.blockSize, 16);
});

test("prefix hit on a repeated prompt, none with bypass or another salt", opts, async () => {
  const p = prompt(1);
  const first = await ca.prefill("tiny", p);
  assert.equal(first.cachedTokens, 0);
  const again = await ca.prefill("tiny", p);
  assert.equal(again.cachedTokens, 32);
  assert.equal(tokenOf(again.output), tokenOf(first.output));
  assert.equal((await ca.prefill("tiny", p, { bypassPrefixCache: true })).cachedTokens, 0);
  const salted = await ca.prefill("tiny", p, { cacheSalt: "tenant-b" });
  assert.equal(salted.cachedTokens, 0);
  assert.equal(tokenOf(salted.output), tokenOf(first.output));
  const gen = await ca.generateAll(generateArgs("tiny", p, { maxTokens: 3, ignoreEos: true }));
  assert.equal(gen.started?.cachedTokens, 32);
  assert.deepEqual(gen.tokens, await continueGreedy(ca, again.cache!.cacheId, tokenOf(again.output), 2));
  const loads = await ca.loads("tiny");
  assert.ok(loads.loads[0].prefixHitTokens >= 64, JSON.stringify(loads.loads[0]));
  const caches = await ca.listCaches("tiny");
  const ids = caches.caches.map((h) => h.cacheId);
  for (const o of [first, again, salted]) assert.ok(ids.includes(o.cache!.cacheId));
  for (const o of [first, again, salted]) await ca.releaseCache("tiny", o.cache!.cacheId);
});

test("fork shares blocks, then diverges", opts, async () => {
  const p = prompt(2);
  const pre = await ca.prefill("tiny", p);
  const src = pre.cache!.cacheId;
  const fork = await ca.forkCache("tiny", src, { keepTokens: 32 });
  assert.equal(fork.cache!.numTokens, 32);
  assert.equal(fork.sharedBlocks, 2);
  // the fork re-fed the rest of the prompt continues exactly as the source
  const refed = await ca.prefill("tiny", p.slice(32), { cacheId: fork.cache!.cacheId });
  assert.equal(tokenOf(refed.output), tokenOf(pre.output));
  const want = await continueGreedy(ca, src, tokenOf(pre.output), 3);
  assert.deepEqual(await continueGreedy(ca, fork.cache!.cacheId, tokenOf(refed.output), 3), want);
  // a whole-cache fork fed another token diverges without touching the source
  const f2 = await ca.forkCache("tiny", src);
  assert.equal(f2.cache!.numTokens, 43);
  const other = (want[1] + 1) % 500;
  await ca.decode("tiny", f2.cache!.cacheId, other);
  assert.equal((await ca.decode("tiny", src, want.at(-1)!)).cache!.numTokens, 44);
  await rejectsWith(ca.forkCache("tiny", src, { keepTokens: 1000 }), status.OUT_OF_RANGE).catch(async () =>
    rejectsWith(ca.forkCache("tiny", src, { keepTokens: 1000 }), status.INVALID_ARGUMENT));
  await rejectsWith(ca.forkCache("tiny", "no-such-cache"), status.NOT_FOUND);
  for (const id of [src, fork.cache!.cacheId, f2.cache!.cacheId]) await ca.releaseCache("tiny", id);
});

test("generate n samples, each with its sample index and finished event", opts, async () => {
  const res = await ca.generateAll(generateArgs("tiny", prompt(3), { n: 3, maxTokens: 4, ignoreEos: true,
    sampling: { temperature: 1.0, seed: 7 } }));
  assert.equal(res.samples.length, 3);
  for (let i = 0; i < 3; i++) {
    assert.equal(res.samples[i].length, 4);
    assert.equal(res.finishedSamples[i]?.sampleIndex, i);
    assert.equal(res.finishedSamples[i]?.generatedTokens, 4);
  }
  // the same seed gives the same samples
  const again = await ca.generateAll(generateArgs("tiny", prompt(3), { n: 3, maxTokens: 4, ignoreEos: true,
    sampling: { temperature: 1.0, seed: 7 } }));
  assert.deepEqual(again.samples, res.samples);
  await rejectsWith(ca.generateAll(generateArgs("tiny", prompt(3), { n: 65 })), status.INVALID_ARGUMENT);
});

test("a constrained generate spells one of the choices", opts, async () => {
  const choices = ["yes", "no", "maybe"];
  const res = await ca.generateAll(generateArgs("tiny", prompt(4), { maxTokens: 8,
    sampling: { constraint: constraints.choice(choices) } }));
  const text = await ca.detokenize("tiny", res.tokens.filter((t) => !(res.finished?.finishReason === pb.FinishReason.FINISH_REASON_EOS && t === res.tokens.at(-1))), { skipSpecialTokens: true });
  assert.ok(choices.includes(text), `constrained output ${JSON.stringify(text)} (tokens ${res.tokens})`);
  await rejectsWith(ca.generateAll(generateArgs("tiny", prompt(4), { maxTokens: 4,
    sampling: { constraint: constraints.jsonSchema("{not json") } })), status.INVALID_ARGUMENT);
});

test("kv events: replay from a sequence number, block events", opts, async () => {
  const seq0 = (await ca.loads("tiny")).kvEventSeq;
  const pre = await ca.prefill("tiny", prompt(5));
  const id = pre.cache!.cacheId;
  await ca.releaseCache("tiny", id);
  const seen: pb.SubscribeKvEventsResponse[] = [];
  const ac = new AbortController();
  for await (const m of ca.subscribeKvEvents("tiny", { fromSeq: seq0 + 1, includeBlockEvents: true, signal: ac.signal })) {
    seen.push(m);
    if (m.message?.$case === "event" && m.message.event.cacheId === id && m.message.event.kind === pb.KvEventKind.KV_EVENT_KIND_RELEASED) break;
  }
  const kinds = seen.flatMap((m) => (m.message?.$case === "event" && m.message.event.cacheId === id ? [m.message.event.kind] : []));
  assert.deepEqual(kinds, [pb.KvEventKind.KV_EVENT_KIND_CREATED, pb.KvEventKind.KV_EVENT_KIND_RELEASED]);
  const stored = seen.filter((m) => m.message?.$case === "blockEvent" && m.message.blockEvent.data?.$case === "stored");
  assert.ok(stored.length >= 1, "no block stored event");
  const seqs = seen.map((m) => (m.message?.$case === "event" ? m.message.event.seq : m.message?.$case === "blockEvent" ? m.message.blockEvent.seq : 0));
  assert.deepEqual([...seqs].sort((x, y) => x - y), seqs, "events out of order");
  assert.equal(seqs[0], seq0 + 1);
  // from the start: the first event the server ever had (seq 1), or a resync when it is gone
  const sub = ca.subscribeKvEvents("tiny", { fromSeq: 1 });
  const m = (await sub.next()).value?.message;
  await sub.return(undefined);
  assert.ok(m?.$case === "event" ? m.event.seq === 1 : m?.$case === "resyncRequired", JSON.stringify(m));
});

test("abort a generate by request id, a cache by id", opts, async () => {
  const it = ca.generate(generateArgs("tiny", prompt(6), { maxTokens: 400, ignoreEos: true, requestId: "req-abort-1" }));
  const firstEv = await it.next();
  assert.equal(firstEv.value?.event?.$case, "started");
  const ab = await ca.abort("tiny", { requestId: "req-abort-1" });
  assert.equal(ab.abortedStreams, 1);
  await assert.rejects((async () => { for await (const _ of it) { /* drain */ } })(), (e) => e instanceof FerrumError && e.code === status.CANCELLED);
  const pre = await ca.prefill("tiny", [1, 2, 3]);
  assert.equal((await ca.abort("tiny", { cacheId: pre.cache!.cacheId })).releasedCache, true);
  assert.equal((await ca.abort("tiny", { cacheId: pre.cache!.cacheId })).releasedCache, false);
  assert.equal((await ca.abort("tiny", { requestId: "never-was" })).abortedStreams, 0);
});

test("kv handoff push and pull: the continuation is identical", opts, async () => {
  const p = prompt(7);
  const pre = await ca.prefill("tiny", p);
  const want = await continueGreedy(ca, pre.cache!.cacheId, tokenOf(pre.output), 4);
  await ca.releaseCache("tiny", pre.cache!.cacheId);
  for (const mode of ["push", "pull"] as const) {
    const h = await prefillAndHandoff(ca, cb, "tiny", p, { mode, reserveTokens: 64 });
    assert.equal(h.cache.numTokens, 40);
    assert.equal(h.imported.importedTokens, 40);
    assert.equal(tokenOf(h.output), want[0]);
    assert.deepEqual(await continueGreedy(cb, h.cache.cacheId, tokenOf(h.output), 4), want, mode);
    await cb.releaseCache("tiny", h.cache.cacheId);
    // the source was released on the prefill server
    assert.ok(!(await ca.listCaches("tiny")).caches.some((c) => c.cacheId === h.sourceCacheId), mode);
  }
  // the header of an export says what it carries
  const pre2 = await ca.prefill("tiny", p);
  const ex = await ca.exportKvAll("tiny", pre2.cache!.cacheId, { maxChunkBytes: 4096 });
  assert.deepEqual(ex.header.tokenIds, p);
  assert.equal(ex.header.numChunks, ex.chunks.length);
  assert.equal(ex.header.checksumAlgorithm, "crc32");
  // a corrupted chunk is refused and leaves no cache
  const bad = { header: ex.header, chunks: ex.chunks.map((c, i) => (i === 0 ? { ...c, checksum: (c.checksum ^ 1) >>> 0 } : c)) };
  const before = (await cb.listCaches("tiny")).caches.length;
  await rejectsWith(cb.importKv("tiny", bad), status.DATA_LOSS);
  assert.equal((await cb.listCaches("tiny")).caches.length, before);
  await rejectsWith(handoff(ca, cb, "tiny", "no-such-cache"), status.NOT_FOUND);
  await ca.releaseCache("tiny", pre2.cache!.cacheId);
});

test("disaggregated router: prefill on one, decode on the other", opts, async () => {
  const r = new DisaggregatedRouter([a!.target], [b!.target]);
  try {
    const p = prompt(8);
    const h = await r.prefill("tiny", p, { reserveTokens: 48 });
    assert.equal(h.decode.target, b!.target);
    const ref = await ca.prefill("tiny", p);
    const want = await continueGreedy(ca, ref.cache!.cacheId, tokenOf(ref.output), 3);
    await ca.releaseCache("tiny", ref.cache!.cacheId);
    assert.deepEqual(await continueGreedy(h.decode, h.cache.cacheId, tokenOf(h.output), 3), want);
    await h.decode.releaseCache("tiny", h.cache.cacheId);
  } finally {
    r.close();
  }
});

test("prefix mirror follows the server; the router picks the replica holding the prefix", opts, async () => {
  const follower = new BlockEventFollower(cb).start();
  const router = new PrefixRouter([a!.target, b!.target]);
  try {
    assert.equal(await follower.waitConnected(10_000), true);
    assert.equal(await router.start(), true);
    const p = prompt(9);
    const pre = await cb.prefill("tiny", p);
    // the mirror's count is what the server then reports as a hit
    assert.ok(await waitUntil(() => follower.mirror.cachedTokens("tiny", p) === 32), "mirror never saw the blocks");
    const again = await cb.prefill("tiny", p);
    assert.equal(again.cachedTokens, follower.mirror.cachedTokens("tiny", p));
    assert.ok(await waitUntil(() => router.prefixMatches("tiny", p).get(b!.target) === 32));
    const pick = await router.pick("tiny", p);
    assert.equal(pick.target, b!.target);
    assert.equal(pick.cachedTokens, 32);
    assert.equal(router.prefixMatches("tiny", p).get(a!.target), 0);
    // a salted prompt has no hit anywhere: least loaded decides (b holds two live caches)
    const cold = await router.pick("tiny", p, { cacheSalt: "x" });
    assert.equal(cold.cachedTokens, 0);
    assert.equal(cold.target, a!.target);
    for (const o of [pre, again]) await cb.releaseCache("tiny", o.cache!.cacheId);
  } finally {
    await follower.stop();
    await router.close();
  }
});

test("step RPCs of the whole contract answer", opts, async () => {
  assert.ok((await ca.status("tiny")).status);
  await ca.admissionLimits("tiny");
  await ca.kvSlotCapacity("tiny");
  await ca.cacheMetrics("tiny");
  await ca.loraMetrics("tiny");
  // admin RPCs: refused without an admin token on a server that has none configured
  await rejectsWith(ca.warmup("tiny"), status.PERMISSION_DENIED);
  await rejectsWith(ca.shutdown("tiny"), status.PERMISSION_DENIED);
  const chat = await ca.applyChatTemplate("tiny", [{ role: "user", content: "hi" }]);
  assert.ok(chat.tokenIds.length > 0);
  const caps = (await ca.capabilities("tiny"))!;
  const uni = ca.unifiedDecode("tiny", [{ seqId: "s0", tokens: [1, 2, 3] }]);
  if (caps.supportsNativeUnifiedDecode) {
    const r = await uni;
    assert.equal(r.results[0].cache!.numTokens, 3);
    await ca.releaseCache("tiny", r.results[0].cache!.cacheId);
  } else {
    await rejectsWith(uni, status.UNIMPLEMENTED);
  }
  const fwd = ca.forward("tiny", [[1, 2, 3]]);
  if (caps.supportsForward) assert.deepEqual((await fwd).output!.shape.slice(0, 2), [1, 3]);
  else await rejectsWith(fwd, status.UNIMPLEMENTED);
  const s = ca.session();
  const pre = await s.prefill("tiny", prompt(10));
  const id = pre.output!.cache!.cacheId;
  const fk = await s.forkCache("tiny", id, { keepTokens: 16 });
  assert.equal(fk.cache!.numTokens, 16);
  const fv = await s.forwardVerify("tiny", id, [tokenOf(pre.output!.output), 5]);
  assert.equal(fv.outputs.length, 2);
  await s.close();
});
