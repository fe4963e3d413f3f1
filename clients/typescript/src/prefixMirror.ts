/**
 * A router's copy of which prefix-cache blocks a replica holds, kept from its block events
 * (`SubscribeKvEvents` with `includeBlockEvents`): `stored` adds keys, `removed` deletes them,
 * `cleared` empties the model's set, `resyncRequired` empties everything. It is a routing hint:
 * it may under-report after a resync, and never lists a block the replica was not seen to store.
 */
import { FerrumClient } from "./client";
import * as pb from "./gen/ferrum/executor/v1/executor";
import * as types from "./gen/ferrum/executor/v1/types";
import { blockKeys, longestCachedPrefix, recipeUsable, SEED } from "./prefixKeys";

export class PrefixMirror {
  private readonly blocks = new Map<string, Set<string>>();
  /** The replica's recipe per model (from `Info`), used by `promptKeys`. */
  recipes = new Map<string, types.PrefixCacheRecipe>();
  lastSeq = 0;
  resyncs = 0;
  eventsApplied = 0;

  /** Apply one stream message; true when the mirror changed (or was resynchronised). */
  apply(msg: pb.SubscribeKvEventsResponse | pb.KvBlockEvent): boolean {
    let ev: pb.KvBlockEvent;
    if ("message" in msg) {
      const m = msg.message;
      if (m?.$case === "resyncRequired") {
        this.clear();
        this.resyncs++;
        return true;
      }
      if (m?.$case === "event") {
        this.lastSeq = Math.max(this.lastSeq, m.event.seq);
        return false;
      }
      if (m?.$case !== "blockEvent") return false;
      ev = m.blockEvent;
    } else {
      ev = msg;
    }
    this.lastSeq = Math.max(this.lastSeq, ev.seq);
    this.eventsApplied++;
    const d = ev.data;
    if (d?.$case === "stored") {
      let set = this.blocks.get(ev.modelId);
      if (!set) this.blocks.set(ev.modelId, (set = new Set()));
      for (const h of d.stored.blockHashes) set.add(Buffer.from(h).toString("hex"));
    } else if (d?.$case === "removed") {
      const set = this.blocks.get(ev.modelId);
      for (const h of d.removed.blockHashes) set?.delete(Buffer.from(h).toString("hex"));
    } else if (d?.$case === "cleared") {
      this.blocks.delete(ev.modelId);
    } else {
      return false;
    }
    return true;
  }

  /** Forget every block (of `modelId` only, when given). */
  clear(modelId?: string): void {
    if (modelId === undefined) {
      this.blocks.clear();
      this.lastSeq = 0;
    } else {
      this.blocks.delete(modelId);
    }
  }

  /** The hex keys held for `modelId` (a copy). */
  keys(modelId: string): Set<string> {
    return new Set(this.blocks.get(modelId) ?? []);
  }

  /** Blocks held, over every model. */
  get size(): number {
    let n = 0;
    for (const s of this.blocks.values()) n += s.size;
    return n;
  }

  /** How many leading `keys` (a prompt's block keys in chain order) the replica holds. */
  cachedBlocks(modelId: string, keys: Buffer[]): number {
    return longestCachedPrefix(keys, this.blocks.get(modelId) ?? new Set());
  }

  /** The block keys of `tokens` under this replica's recipe for `modelId` ([] when it has none usable). */
  promptKeys(modelId: string, tokens: number[], cacheSalt = "", adapter = ""): Buffer[] {
    const r = this.recipes.get(modelId);
    if (!recipeUsable(r, adapter)) return [];
    return blockKeys(tokens, r.blockSize, modelId, { cacheSalt, adapter, seed: r.seed || SEED });
  }

  /** Leading tokens of `tokens` whose blocks the replica holds (a multiple of its block size). */
  cachedTokens(modelId: string, tokens: number[], cacheSalt = "", adapter = ""): number {
    const keys = this.promptKeys(modelId, tokens, cacheSalt, adapter);
    return keys.length ? this.cachedBlocks(modelId, keys) * this.recipes.get(modelId)!.blockSize : 0;
  }

  /** Take each model's recipe from an `Info` response. */
  setRecipes(info: pb.InfoResponse): void {
    this.recipes = new Map(info.models.filter((m) => m.prefixCache).map((m) => [m.modelId, m.prefixCache!]));
  }
}

/**
 * Keeps a PrefixMirror current from one replica: `Info` (the recipes), then
 * `SubscribeKvEvents(includeBlockEvents, fromSeq = 1)` (the replay buffer, then live events). When
 * seq 1 has left the buffer it reconnects from the oldest event still there; when the stream breaks
 * it empties the mirror and starts over after `retryMs`. `stop()` ends it.
 */
export class BlockEventFollower {
  readonly mirror: PrefixMirror;
  connections = 0;
  connected = false;
  private ac = new AbortController();
  private loop?: Promise<void>;
  private waiters: (() => void)[] = [];

  constructor(private readonly client: FerrumClient,
    o: { mirror?: PrefixMirror; modelId?: string; retryMs?: number; onError?: (e: unknown) => void } = {}) {
    this.mirror = o.mirror ?? new PrefixMirror();
    this.modelId = o.modelId ?? "";
    this.retryMs = o.retryMs ?? 500;
    this.onError = o.onError;
  }

  private readonly modelId: string;
  private readonly retryMs: number;
  private readonly onError?: (e: unknown) => void;

  start(): this {
    this.loop ??= this.run();
    return this;
  }

  private async run(): Promise<void> {
    let fromSeq = 1;
    const signal = this.ac.signal;
    while (!signal.aborted) {
      let window: number | undefined;
      try {
        this.mirror.setRecipes(await this.client.info("", { timeoutMs: 5000, signal }));
        this.mirror.clear();
        // The call starts here; replaying from seq 1 means nothing before it is missed.
        const stream = this.client.subscribeKvEvents(this.modelId, { fromSeq, includeBlockEvents: true, signal });
        this.connections++;
        this.setConnected(true);
        let first = true;
        for await (const msg of stream) {
          this.mirror.apply(msg);
          if (first && fromSeq === 1 && msg.message?.$case === "resyncRequired") {
            window = msg.message.resyncRequired.oldestAvailableSeq;
            break;
          }
          first = false;
        }
      } catch (e) {
        if (signal.aborted) break;
        if (window === undefined) this.onError?.(e);
      }
      this.setConnected(false);
      if (signal.aborted) break;
      this.mirror.clear();
      if (window !== undefined) {
        fromSeq = window;
        continue;
      }
      fromSeq = 1;
      await new Promise((r) => setTimeout(r, this.retryMs));
    }
    this.setConnected(false);
  }

  private setConnected(v: boolean): void {
    this.connected = v;
    if (v) for (const w of this.waiters.splice(0)) w();
  }

  /** Resolves true once the event subscription is open, false after `timeoutMs`. */
  waitConnected(timeoutMs = 10_000): Promise<boolean> {
    if (this.connected) return Promise.resolve(true);
    return new Promise((resolve) => {
      const t = setTimeout(() => resolve(false), timeoutMs);
      this.waiters.push(() => {
        clearTimeout(t);
        resolve(true);
      });
    });
  }

  async stop(): Promise<void> {
    this.ac.abort();
    await this.loop;
  }
}

/** Poll `predicate` until true (true) or `timeoutMs` passes (false). */
export async function waitUntil(predicate: () => boolean, timeoutMs = 10_000, pollMs = 20): Promise<boolean> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    if (predicate()) return true;
    if (Date.now() >= deadline) return false;
    await new Promise((r) => setTimeout(r, pollMs));
  }
}
