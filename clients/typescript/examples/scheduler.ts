// A scheduler's-eye tour of the contract (the TypeScript twin of clients/rust/examples/scheduler.rs):
//  1. continuous batching: requests arrive at different steps; each step prefills the arrivals and
//     advances every running sequence with one BatchDecode; finished ones leave (ReleaseCache);
//  2. a fork: one prompt prefilled once, two ForkCache branches (its KV blocks shared copy-on-write)
//     decoded together with the source in one BatchDecode, each fed another token;
//  3. a handoff: one branch's cache pulled by a second, decode-only server (--role decode) with
//     ImportKv, and continued there: the same tokens as on the first server.
// Run 1 is checked against the server's own greedy Generate, run 3 against the first server.
//   node dist/examples/scheduler.js [host:port decode-host:port]   (none: starts both servers)
import { FerrumClient, handoff, tokenOf, tokenPrompt } from "../src";
import { startScenarioServer, startServer, TestServer } from "../src/testserver";

const TINY = "hf-causal-lm,id=tiny,path=${TINY_MODEL_DIR}";

async function batching(c: FerrumClient): Promise<boolean> {
  const eos = (await c.info("tiny")).models[0].eosTokenIds;
  const reqs = [
    { prompt: "The quick brown fox", max: 6, at: 0 }, { prompt: "A KV cache stores", max: 4, at: 0 },
    { prompt: "Hello world!", max: 5, at: 2 },
  ].map((r, id) => ({ ...r, id, cacheId: "", ids: [] as number[], tokens: [] as number[] }));
  let running: typeof reqs = [];
  for (let step = 0; reqs.some((r) => r.tokens.length === 0) || running.length; step++) {
    const arrivals = reqs.filter((r) => r.at === step);
    for (const r of arrivals) r.ids = await c.tokenize("tiny", r.prompt, { addSpecialTokens: true });
    if (arrivals.length) {
      const outs = await c.batchPrefill("tiny", arrivals.map((r) => ({ tokenIds: r.ids })));
      outs.forEach((o, i) => {
        arrivals[i].cacheId = o.cache!.cacheId;
        arrivals[i].tokens.push(tokenOf(o.output));
      });
      running.push(...arrivals);
    }
    if (!running.length) continue;
    const outs = await c.batchDecode("tiny", running.map((r) => ({ cacheId: r.cacheId, tokenId: r.tokens.at(-1)! })));
    outs.forEach((o, i) => running[i].tokens.push(tokenOf(o.output)));
    console.log(`step ${step}: batch_decode [${running.map((r) => `req-${r.id}`).join(" ")}]`);
    const done = running.filter((r) => r.tokens.length >= r.max || eos.includes(r.tokens.at(-1)!));
    for (const r of done) await c.releaseCache("tiny", r.cacheId);
    running = running.filter((r) => !done.includes(r));
  }
  let same = true;
  for (const r of reqs) {
    const ref = await c.generateAll({ modelId: "tiny", prompt: tokenPrompt(r.ids), stop: { maxTokens: r.tokens.length } });
    same &&= JSON.stringify(ref.tokens) === JSON.stringify(r.tokens);
    console.log(`req-${r.id} ${JSON.stringify(r.prompt)} -> [${r.tokens}] ${JSON.stringify(await c.detokenize("tiny", r.tokens))}` +
      ` (Generate: [${ref.tokens}])`);
  }
  return same;
}

async function forkAndHandoff(c: FerrumClient, d: FerrumClient): Promise<boolean> {
  const prompt = Array.from({ length: 40 }, (_, i) => 1 + ((i * 37) % 500));
  const pre = await c.prefill("tiny", prompt);
  const root = pre.cache!.cacheId;
  const first = tokenOf(pre.output);
  const branches = [root];
  for (let i = 0; i < 2; i++) {
    const f = await c.forkCache("tiny", root, { reserveTokens: 64 });
    console.log(`fork: ${f.cache!.cacheId} shares ${f.sharedBlocks} blocks with ${root}`);
    branches.push(f.cache!.cacheId);
  }
  const last = [first, (first + 1) % 500, (first + 2) % 500];
  for (let step = 0; step < 4; step++) {
    const outs = await c.batchDecode("tiny", branches.map((cacheId, i) => ({ cacheId, tokenId: last[i] })));
    outs.forEach((o, i) => (last[i] = tokenOf(o.output)));
    console.log(`branch step ${step}: batch_decode of ${branches.length} branches -> [${last}]`);
  }
  const h = await handoff(c, d, "tiny", branches[1], { mode: "pull", reserveTokens: 64, releaseSource: false });
  console.log(`handoff: ${branches[1]} -> ${h.cache.cacheId} (${h.imported.importedTokens} tokens, ${h.imported.bytes} bytes, ${h.handoffMs} ms)`);
  let here = last[1];
  let there = last[1];
  const a: number[] = [];
  const b: number[] = [];
  for (let i = 0; i < 4; i++) {
    here = tokenOf((await c.decode("tiny", branches[1], here)).output);
    there = tokenOf((await d.decode("tiny", h.cache.cacheId, there)).output);
    a.push(here);
    b.push(there);
  }
  console.log(`branch 1 continued here [${a}], on the decode server [${b}]`);
  await d.releaseCache("tiny", h.cache.cacheId);
  for (const br of branches) await c.releaseCache("tiny", br);
  return JSON.stringify(a) === JSON.stringify(b);
}

async function main(): Promise<void> {
  let [target, decodeTarget] = process.argv.slice(2);
  const servers: TestServer[] = [];
  try {
    if (!target) {
      // the decode server: the conformance scenario's peer (its models, --role decode)
      const [m, dsrv] = await Promise.all([startServer([TINY]), startScenarioServer("", true)]);
      servers.push(m, dsrv);
      target = m.target;
      decodeTarget = dsrv.target;
    }
    const c = new FerrumClient(target);
    const d = new FerrumClient(decodeTarget);
    try {
      const ok1 = await batching(c);
      const ok3 = await forkAndHandoff(c, d);
      if (!ok1) throw new Error("continuous batching differs from the server's greedy Generate");
      if (!ok3) throw new Error("the handed-off branch continued differently on the decode server");
    } finally {
      c.close();
      d.close();
    }
  } finally {
    await Promise.all(servers.map((s) => s.stop()));
  }
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
