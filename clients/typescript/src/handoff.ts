/**
 * Disaggregated prefill and decode: a prompt is computed on a prefill server, its KV cache is
 * handed to a decode server (ImportKv: by server pull, or pushed through this client from an
 * ExportKv stream), the prefill server's cache is released, and decoding goes on at the decode
 * server.
 *
 *   const h = await prefillAndHandoff(prefillClient, decodeClient, "tiny", prompt, { reserveTokens: 64 });
 *   let tok = tokenOf(h.output);
 *   const step = await decodeClient.decode("tiny", h.cache.cacheId, tok);
 */
import { FerrumClient, StepOpts } from "./client";
import { FerrumError } from "./errors";
import * as pb from "./gen/ferrum/executor/v1/executor";
import * as types from "./gen/ferrum/executor/v1/types";

export interface HandoffOpts {
  /** "pull" (default): the decode server fetches the K/V itself (this client never sees the bytes);
   * "push": this client streams ExportKv from the prefill server into ImportKv on the decode server. */
  mode?: "pull" | "push";
  /** Pull: the prefill server's address as the decode server reaches it (default: `prefill.target`). */
  sourceTarget?: string;
  /** Total tokens the imported cache may grow to (0 = the imported ones). */
  reserveTokens?: number;
  cacheSalt?: string;
  requestId?: string;
  /** Release the source cache after the handoff (default true). */
  releaseSource?: boolean;
  timeoutMs?: number;
  maxChunkBytes?: number;
}

/** A cache handed from one server to another. */
export interface Handoff {
  /** The new cache, on the decode server. */
  cache: types.KvCacheHandle;
  imported: pb.ImportKvResponse;
  /** The cache it was copied from, on the source server (released there unless `releaseSource` was false). */
  sourceCacheId: string;
  /** The prefill's last-position output (with `prefillAndHandoff`). */
  output?: types.LogitsOutput;
  /** Prompt tokens the prefill server took from its prefix cache (with `prefillAndHandoff`). */
  cachedTokens: number;
  prefillMs: number;
  handoffMs: number;
}

/** Move `cacheId` of `modelId` from `from` to `to` (a new cache there); by default the source is released. */
export async function handoff(from: FerrumClient, to: FerrumClient, modelId: string, cacheId: string,
  o: HandoffOpts = {}): Promise<Handoff> {
  const t0 = Date.now();
  const imp = { reserveTokens: o.reserveTokens ?? 0, cacheSalt: o.cacheSalt ?? "", requestId: o.requestId ?? "",
    timeoutMs: o.timeoutMs };
  let imported: pb.ImportKvResponse;
  try {
    if ((o.mode ?? "pull") === "pull") {
      imported = await to.pullKv(modelId, { target: o.sourceTarget ?? from.target, cacheId,
        maxChunkBytes: o.maxChunkBytes ?? 0 }, imp);
    } else {
      imported = await to.importKv(modelId, from.exportKv(modelId, cacheId,
        { maxChunkBytes: o.maxChunkBytes ?? 0, timeoutMs: o.timeoutMs }), imp);
    }
  } finally {
    if (o.releaseSource ?? true) await from.releaseCache(modelId, cacheId).catch(() => undefined);
  }
  if (!imported.cache) throw new FerrumError(13, "ImportKv answered without a cache");
  return { cache: imported.cache, imported, sourceCacheId: cacheId, cachedTokens: 0, prefillMs: 0, handoffMs: Date.now() - t0 };
}

/** Prefill `tokens` on `prefill`, hand the cache to `decode`, release it on `prefill`. */
export async function prefillAndHandoff(prefill: FerrumClient, decode: FerrumClient, modelId: string, tokens: number[],
  o: HandoffOpts & Pick<StepOpts, "policy" | "sampling" | "adapter" | "bypassPrefixCache"> = {}): Promise<Handoff> {
  const t0 = Date.now();
  const pre = await prefill.prefill(modelId, tokens, { policy: o.policy, sampling: o.sampling, adapter: o.adapter,
    cacheSalt: o.cacheSalt, bypassPrefixCache: o.bypassPrefixCache, timeoutMs: o.timeoutMs });
  const prefillMs = Date.now() - t0;
  const h = await handoff(prefill, decode, modelId, pre.cache!.cacheId,
    { ...o, reserveTokens: Math.max(o.reserveTokens ?? 0, tokens.length) });
  return { ...h, output: pre.output, cachedTokens: pre.cachedTokens, prefillMs };
}

/**
 * Prefill servers and decode servers: `prefill()` computes a prompt on the least loaded prefill
 * server and hands its cache to the least loaded decode server; every later step of that sequence
 * goes to the returned `decode` client. `fromRoles` sorts servers by the role their Info advertises.
 */
export class DisaggregatedRouter {
  readonly prefillClients: FerrumClient[];
  readonly decodeClients: FerrumClient[];
  private rr = 0;

  constructor(prefillTargets: string[], decodeTargets: string[], private readonly o: HandoffOpts = {}) {
    const clients = new Map<string, FerrumClient>();
    const get = (t: string) => clients.get(t) ?? clients.set(t, new FerrumClient(t)).get(t)!;
    this.prefillClients = prefillTargets.map(get);
    this.decodeClients = decodeTargets.map(get);
  }

  /** Sort `targets` by `Info.role` (both / unspecified: in both sets). */
  static async fromRoles(targets: string[], o: HandoffOpts = {}): Promise<DisaggregatedRouter> {
    const pre: string[] = [];
    const dec: string[] = [];
    for (const t of targets) {
      const c = new FerrumClient(t);
      try {
        const role = (await c.info()).role;
        if (role !== pb.ServerRole.SERVER_ROLE_DECODE) pre.push(t);
        if (role !== pb.ServerRole.SERVER_ROLE_PREFILL) dec.push(t);
      } finally {
        c.close();
      }
    }
    return new DisaggregatedRouter(pre, dec, o);
  }

  private async leastLoaded(clients: FerrumClient[], modelId: string): Promise<FerrumClient> {
    if (!clients.length) throw new FerrumError(14, "no server of that role");
    const loads = await Promise.all(clients.map((c) => c.loads(modelId, { timeoutMs: 2000 })
      .then((r) => r.loads[0]).catch(() => undefined)));
    const busy = loads.map((l) => (l ? l.queuedSteps + l.runningSteps + l.activeCaches : Infinity));
    const least = Math.min(...busy);
    const tied = clients.filter((_, i) => busy[i] === least);
    if (least === Infinity) throw new FerrumError(14, "no server of that role answers Loads");
    return tied[this.rr++ % tied.length];
  }

  /** Prefill on a prefill server, hand off to a decode server; decode the sequence on `decode`. */
  async prefill(modelId: string, tokens: number[], o: HandoffOpts & Pick<StepOpts, "policy" | "sampling" | "adapter"> = {}):
    Promise<Handoff & { decode: FerrumClient; prefill: FerrumClient }> {
    const [p, d] = await Promise.all([this.leastLoaded(this.prefillClients, modelId), this.leastLoaded(this.decodeClients, modelId)]);
    const h = await prefillAndHandoff(p, d, modelId, tokens, { ...this.o, ...o });
    return { ...h, decode: d, prefill: p };
  }

  close(): void {
    for (const c of new Set([...this.prefillClients, ...this.decodeClients])) c.close();
  }
}
