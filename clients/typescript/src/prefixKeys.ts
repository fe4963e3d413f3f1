/**
 * Prefix-cache block keys, computed exactly as a ferrum-service replica computes them (the
 * `PrefixCacheRecipe` a model advertises in `ModelInfo.prefixCache`, algorithm "sha256-chain-v1"):
 *
 *   root   = SHA-256(seed || 0x00 || model_id || 0x00 || cache_salt [|| 0x00 || adapter])
 *   key[i] = SHA-256(key[i-1] || block i's token ids as little-endian uint32)   (key[-1] = root)
 *
 * Only full blocks are keyed; an empty adapter (the base model) is left out with its separator.
 */
import { createHash } from "node:crypto";
import * as types from "./gen/ferrum/executor/v1/types";

export const ALGORITHM = "sha256-chain-v1";
export const SEED = "ferrum-prefix-v1";
export const EXTRA_KEYS = ["model_id", "cache_salt", "adapter"] as const;

/** The key every chain of `modelId` (under `cacheSalt`, computed with LoRA `adapter`) starts from. */
export function chainRoot(modelId: string, cacheSalt = "", adapter = "", seed = SEED): Buffer {
  const parts = [seed, modelId, cacheSalt, ...(adapter ? [adapter] : [])];
  return createHash("sha256").update(Buffer.from(parts.join("\0"), "utf8")).digest();
}

/** The key of one full block given its parent's key (or the chain root). */
export function blockKey(parent: Buffer, tokens: ArrayLike<number>): Buffer {
  const buf = Buffer.alloc(tokens.length * 4);
  for (let i = 0; i < tokens.length; i++) buf.writeUInt32LE(tokens[i] >>> 0, i * 4);
  return createHash("sha256").update(parent).update(buf).digest();
}

export interface KeyOpts {
  cacheSalt?: string;
  adapter?: string;
  seed?: string;
  /** Continue a chain whose earlier blocks were keyed already (default: the chain root). */
  parent?: Buffer;
}

/** Keys of the full blocks of `tokens` (a trailing partial block has none). */
export function blockKeys(tokens: ArrayLike<number>, blockSize: number, modelId: string, o: KeyOpts = {}): Buffer[] {
  if (!(blockSize > 0)) throw new RangeError(`block size must be positive, got ${blockSize}`);
  let key = o.parent ?? chainRoot(modelId, o.cacheSalt ?? "", o.adapter ?? "", o.seed ?? SEED);
  const out: Buffer[] = [];
  for (let start = 0; start + blockSize <= tokens.length; start += blockSize) {
    key = blockKey(key, Array.prototype.slice.call(tokens, start, start + blockSize) as number[]);
    out.push(key);
  }
  return out;
}

/** How many leading keys are in `cached` (hex strings or a set of hex keys). */
export function longestCachedPrefix(keys: Buffer[], cached: { has(k: string): boolean }): number {
  let n = 0;
  for (const k of keys) {
    if (!cached.has(k.toString("hex"))) break;
    n++;
  }
  return n;
}

const PRE_ADAPTER_KEYS = ["model_id", "cache_salt"];

/** True when `recipe` is one this client computes (and caching is on) for a sequence with LoRA
 * `adapter` ("" = the base model): a recipe without the "adapter" key keys base-model sequences only. */
export function recipeUsable(recipe: types.PrefixCacheRecipe | undefined, adapter = ""): recipe is types.PrefixCacheRecipe {
  if (!recipe || !recipe.enabled || recipe.blockSize <= 0 || recipe.algorithm !== ALGORITHM) return false;
  const ek = recipe.extraKeys.join("\0");
  const known = [[], PRE_ADAPTER_KEYS, [...EXTRA_KEYS]].some((k) => k.join("\0") === ek);
  return known && (!adapter || recipe.extraKeys.includes("adapter"));
}
