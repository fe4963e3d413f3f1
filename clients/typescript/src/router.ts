/**
 * Prefix-aware routing over several ferrum-service replicas: a new request goes to the replica
 * holding the longest cached prefix of its prompt (from each replica's mirrored block events, keys
 * computed with that replica's advertised recipe), then to the least loaded of those (its `Loads`:
 * queued + running steps, then open streams, then live caches), then round-robin. A cache lives on
 * the replica that created it: every later step of that sequence must go to the same client.
 *
 *   const router = new PrefixRouter(["10.0.0.5:50051", "10.0.0.6:50051"]);
 *   await router.start();
 *   const { client, cachedTokens } = await router.pick("tiny", promptTokens);
 *   const pre = await client.prefill("tiny", promptTokens);   // every step of it on `client`
 */
import { ClientOptions, FerrumClient } from "./client";
import { FerrumError } from "./errors";
import * as pb from "./gen/ferrum/executor/v1/executor";
import { BlockEventFollower, PrefixMirror } from "./prefixMirror";

/** One replica of a router. */
export interface Replica {
  target: string;
  client: FerrumClient;
  mirror: PrefixMirror;
  follower?: BlockEventFollower;
  /** False once a call found it UNAVAILABLE (or `markDown`): it gets no new requests. */
  up: boolean;
  lastError: string;
}

/** Where `pick` sends a request, and why. */
export interface RouteChoice {
  replica: Replica;
  client: FerrumClient;
  target: string;
  /** Leading prompt tokens the replica's prefix cache holds, per its mirror (a hint). */
  cachedTokens: number;
  /** The replica's load when it was compared with others (undefined: no tie to break). */
  load?: pb.ModelLoad;
}

export interface PickOpts {
  cacheSalt?: string;
  adapter?: string;
}

/** A load's rank: smaller = less loaded. */
export function loadRank(l: pb.ModelLoad | undefined): number[] {
  if (!l) return [Infinity];
  return [l.queuedSteps + l.runningSteps, l.activeStreams, l.activeCaches, -l.freeBlocks];
}

function compareRanks(a: number[], b: number[]): number {
  for (let i = 0; i < Math.max(a.length, b.length); i++) {
    const d = (a[i] ?? 0) - (b[i] ?? 0);
    if (d !== 0) return d;
  }
  return 0;
}

export class PrefixRouter {
  private readonly replicas: Replica[];
  private rr = 0;

  /** `prefixAware` false: least loaded only (no event subscriptions). */
  constructor(targets: string[], private readonly o: { clientOptions?: ClientOptions; prefixAware?: boolean } = {}) {
    this.replicas = targets.map((target) => ({ target, client: new FerrumClient(target, o.clientOptions),
      mirror: new PrefixMirror(), up: true, lastError: "" }));
  }

  /** Start following every replica's block events; resolves when each subscription is open. */
  async start(timeoutMs = 10_000): Promise<boolean> {
    if (this.o.prefixAware === false) return true;
    for (const r of this.replicas) {
      r.follower ??= new BlockEventFollower(r.client, { mirror: r.mirror, onError: (e) => { r.lastError = String(e); } }).start();
    }
    const ok = await Promise.all(this.replicas.map((r) => r.follower!.waitConnected(timeoutMs)));
    return ok.every(Boolean);
  }

  list(): Replica[] {
    return [...this.replicas];
  }

  replica(target: string): Replica | undefined {
    return this.replicas.find((r) => r.target === target);
  }

  markDown(target: string, why = "marked down"): void {
    const r = this.replica(target);
    if (r && r.up) {
      r.up = false;
      r.lastError = why;
      void r.follower?.stop();
      r.follower = undefined;
      r.mirror.clear();
    }
  }

  /** Per live replica, the leading tokens of `tokens` its mirrored prefix cache holds. */
  prefixMatches(modelId: string, tokens: number[], o: PickOpts = {}): Map<string, number> {
    return new Map(this.replicas.filter((r) => r.up)
      .map((r) => [r.target, r.mirror.cachedTokens(modelId, tokens, o.cacheSalt ?? "", o.adapter ?? "")]));
  }

  /** The replica for a new request of `modelId` with prompt `tokens` (none: least loaded only). */
  async pick(modelId: string, tokens: number[] = [], o: PickOpts = {}): Promise<RouteChoice> {
    let live = this.replicas.filter((r) => r.up);
    if (!live.length) throw new FerrumError(14, "no replica is available");
    const scores = this.prefixMatches(modelId, tokens, o);
    const best = Math.max(...live.map((r) => scores.get(r.target) ?? 0));
    live = live.filter((r) => (scores.get(r.target) ?? 0) === best);
    let loads = new Map<string, pb.ModelLoad | undefined>();
    if (live.length > 1) {
      const got = await Promise.all(live.map(async (r) => {
        try {
          const resp = await r.client.loads(modelId, { timeoutMs: 2000 });
          return [r.target, resp.loads.find((l) => l.modelId === modelId) ?? resp.loads[0]] as const;
        } catch (e) {
          if (e instanceof FerrumError && e.code === 14) this.markDown(r.target, `Loads: ${e.message}`);
          return [r.target, undefined] as const;
        }
      }));
      loads = new Map(got);
      live = live.filter((r) => r.up);
      if (!live.length) throw new FerrumError(14, "no replica is available");
      const least = live.map((r) => loadRank(loads.get(r.target))).reduce((a, b) => (compareRanks(a, b) <= 0 ? a : b));
      live = live.filter((r) => compareRanks(loadRank(loads.get(r.target)), least) === 0);
    }
    const r = live[this.rr++ % live.length];
    return { replica: r, client: r.client, target: r.target, cachedTokens: best, load: loads.get(r.target) };
  }

  /** Stop following and close every client. */
  async close(): Promise<void> {
    await Promise.all(this.replicas.map((r) => r.follower?.stop()));
    for (const r of this.replicas) r.client.close();
  }
}
