// A tiny continuous-batching loop over BatchDecode (the TypeScript twin of clients/go/cmd/example-scheduler).
//   node dist/examples/scheduler.js [host:port]   (no target: starts a fresh tiny-model server)
import { FerrumClient, tokenOf } from "../src";
import { startServer, TestServer } from "../src/testserver";

async function main(): Promise<void> {
  let target = process.argv[2];
  let srv: TestServer | undefined;
  if (!target) {
    srv = await startServer(["hf-causal-lm,id=tiny,path=${TINY_MODEL_DIR}"]);
    target = srv.target;
  }
  const c = new FerrumClient(target);
  try {
    const eos = (await c.info("tiny")).models[0].eosTokenIds;
    const reqs = [
      { prompt: "The quick brown fox", max: 6, at: 0 }, { prompt: "A KV cache stores", max: 4, at: 0 },
      { prompt: "Hello world!", max: 5, at: 2 },
    ].map((r, id) => ({ ...r, id, cacheId: "", tokens: [] as number[] }));
    let running: typeof reqs = [];
    for (let step = 0; reqs.some((r) => r.tokens.length === 0) || running.length; step++) {
      for (const r of reqs.filter((r) => r.at === step)) {
        const out = await c.prefill("tiny", await c.tokenize("tiny", r.prompt));
        r.cacheId = out.cache!.cacheId;
        r.tokens.push(tokenOf(out.output));
        running.push(r);
      }
      if (!running.length) continue;
      const outs = await c.batchDecode("tiny", running.map((r) => ({ cacheId: r.cacheId, tokenId: r.tokens.at(-1)! })));
      outs.forEach((o, i) => running[i].tokens.push(tokenOf(o.output)));
      console.log(`step ${step}: batch_decode [${running.map((r) => `req-${r.id}`).join(" ")}]`);
      const done = running.filter((r) => r.tokens.length >= r.max || eos.includes(r.tokens.at(-1)!));
      for (const r of done) await c.releaseCache("tiny", r.cacheId);
      running = running.filter((r) => !done.includes(r));
    }
    for (const r of reqs) console.log(`req-${r.id} ${JSON.stringify(r.prompt)} -> [${r.tokens}] ${JSON.stringify(await c.detokenize("tiny", r.tokens))}`);
  } finally {
    c.close();
    await srv?.stop();
  }
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
