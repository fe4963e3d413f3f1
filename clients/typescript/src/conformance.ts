/**
 * Runner of the language-neutral scenario tests/conformance/scenario.json (format:
 * tests/conformance/README.md) through the TypeScript client.
 */
import { readFileSync } from "node:fs";
import { DecodeItem, FerrumClient, GenerateArgs, tokenOf, tokenPrompt, textPrompt } from "./client";
import { handoff } from "./handoff";
import { PrefixMirror } from "./prefixMirror";
import { FerrumError } from "./errors";
import * as pb from "./gen/ferrum/executor/v1/executor";
import * as types from "./gen/ferrum/executor/v1/types";

type Json = null | boolean | number | string | Json[] | { [k: string]: Json };
type Obj = { [k: string]: Json };

export interface Profile {
  description?: string;
  server_models?: string[];
  vars?: Obj;
}

export interface Scenario {
  version: number;
  server_models: string[];
  /** Seeded into the variables before the first step (steps read them as "$name"). */
  vars?: Obj;
  /** Other server models for the same steps, with the variables that differ. */
  profiles?: { [name: string]: Profile };
  steps: Obj[];
}

export interface StepResult {
  id: string;
  op: string;
  status: "PASS" | "FAIL" | "XFAIL" | "SKIP";
  error?: string;
  ms: number;
}

export interface Summary {
  passed: number;
  failed: number;
  xfailed: number;
  skipped: number;
  steps: StepResult[];
}

export function loadScenario(file: string): Scenario {
  return JSON.parse(readFileSync(file, "utf8")) as Scenario;
}

/** The scenario as profile `name` runs it: its server models, its vars over the top-level ones ("" = as is). */
export function withProfile(sc: Scenario, name: string): Scenario {
  if (!name) return sc;
  const p = sc.profiles?.[name];
  if (!p) throw new Error(`no profile ${JSON.stringify(name)} in the scenario`);
  return { ...sc, server_models: p.server_models ?? sc.server_models, vars: { ...(sc.vars ?? {}), ...(p.vars ?? {}) } };
}

class StepFailure extends Error {}

const REF = /^\$([A-Za-z_][A-Za-z0-9_]*)(?:\[(-?\d+)\])?$/;

function resolve(v: Json, env: Map<string, Json>): Json {
  if (typeof v === "string") {
    const m = REF.exec(v);
    if (!m) return v;
    if (!env.has(m[1])) throw new StepFailure(`undefined variable $${m[1]} (the step that saves it failed?)`);
    let val: Json = env.get(m[1])!;
    if (m[2] !== undefined) {
      let i = Number(m[2]);
      if (!Array.isArray(val)) throw new StepFailure(`${v}: $${m[1]} is not a list`);
      if (i < 0) i += val.length;
      if (i < 0 || i >= val.length) throw new StepFailure(`${v}: no such element in ${JSON.stringify(val)}`);
      val = val[i];
    }
    return val;
  }
  if (Array.isArray(v)) return v.map((e) => resolve(e, env));
  if (v !== null && typeof v === "object") {
    return Object.fromEntries(Object.entries(v).map(([k, e]) => [k, resolve(e, env)]));
  }
  return v;
}

/** Objects are subsets, lists exact (same length, null = anything), scalars strictly equal. */
function mismatches(exp: Json | undefined, act: Json | undefined, p = ""): string[] {
  if (exp === null || exp === undefined) return [];
  const show = (x: unknown) => JSON.stringify(x);
  if (Array.isArray(exp)) {
    if (!Array.isArray(act) || act.length !== exp.length || exp.some((e, i) => mismatches(e, act[i]).length > 0)) {
      return [`${p}: expected ${show(exp)}, got ${show(act)}`];
    }
    return [];
  }
  if (typeof exp === "object") {
    if (act === null || typeof act !== "object" || Array.isArray(act)) return [`${p || "result"}: expected an object, got ${show(act)}`];
    const out: string[] = [];
    for (const [k, e] of Object.entries(exp)) {
      const q = p ? `${p}.${k}` : k;
      if (!(k in act)) out.push(`${q}: missing`);
      else out.push(...mismatches(e, act[k], q));
    }
    return out;
  }
  return exp === act ? [] : [`${p}: expected ${show(exp)}, got ${show(act)}`];
}

const FLOAT_FIELDS: Record<string, string> = {
  temperature: "temperature", top_p: "topP", min_p: "minP", repetition_penalty: "repetitionPenalty",
};
const INT_FIELDS: Record<string, string> = { top_k: "topK", seed: "seed" };

/** An OutputConstraint in proto JSON ({"json_schema": ...}, {"choice": {"choices": [...]}}, ...). */
function constraint(v: Json): types.OutputConstraint {
  const o = (v ?? {}) as Obj;
  if (typeof o.json_schema === "string") return { kind: { $case: "jsonSchema", jsonSchema: o.json_schema } };
  if (typeof o.regex === "string") return { kind: { $case: "regex", regex: o.regex } };
  if (typeof o.ebnf_grammar === "string") return { kind: { $case: "ebnfGrammar", ebnfGrammar: o.ebnf_grammar } };
  if (o.choice && typeof o.choice === "object") {
    return { kind: { $case: "choice", choice: { choices: (((o.choice as Obj).choices as Json[]) ?? []).map(String) } } };
  }
  throw new StepFailure(`unknown constraint ${JSON.stringify(v)}`);
}

function sampling(v: Json | undefined): Partial<types.SamplingParams> | undefined {
  if (!v || typeof v !== "object" || Array.isArray(v) || Object.keys(v).length === 0) return undefined;
  const out: Record<string, unknown> = {};
  for (const [k, val] of Object.entries(v)) {
    if (k in FLOAT_FIELDS) out[FLOAT_FIELDS[k]] = Number(val); // "NaN" / "Infinity" strings too
    else if (k in INT_FIELDS) out[INT_FIELDS[k]] = Number(val);
    else if (k === "constraint") out.constraint = constraint(val);
  }
  return out as Partial<types.SamplingParams>;
}

/** The servers of a run: "main" (every step's default) and "peer" (the KV handoff destination). */
export interface Servers {
  main: FerrumClient;
  mainTarget: string;
  peer?: FerrumClient;
  peerTarget?: string;
}

function server(sv: Servers, name: Json | undefined): FerrumClient {
  const n = typeof name === "string" && name ? name : "main";
  const c = n === "main" ? sv.main : n === "peer" ? sv.peer : undefined;
  if (!c) throw new StepFailure(`no server ${JSON.stringify(n)} in this run (the peer needs a second server)`);
  return c;
}

const enumName = (s: string, prefix: string) => s.replace(new RegExp(`^${prefix}`), "");

/** Every event message (all models, block events too) with seq > afterSeq up to the server's
 * current sequence number (read first from ListCaches), and whether the server said resync. */
async function collectEvents(c: FerrumClient, afterSeq: number): Promise<{ msgs: pb.SubscribeKvEventsResponse[]; resync: boolean }> {
  const last = (await c.listCaches("")).asOfSeq;
  if (last <= afterSeq) return { msgs: [], resync: false };
  const msgs: pb.SubscribeKvEventsResponse[] = [];
  const ac = new AbortController();
  const timer = setTimeout(() => ac.abort(), 15_000);
  try {
    for await (const m of c.subscribeKvEvents("", { fromSeq: afterSeq + 1, includeBlockEvents: true, signal: ac.signal })) {
      if (m.message?.$case === "resyncRequired") return { msgs, resync: true };
      msgs.push(m);
      const seq = m.message?.$case === "event" ? m.message.event.seq : m.message?.$case === "blockEvent" ? m.message.blockEvent.seq : 0;
      if (seq >= last) break;
    }
  } finally {
    clearTimeout(timer);
  }
  return { msgs, resync: false };
}

function ids(v: Json | undefined): number[] {
  if (!Array.isArray(v)) throw new StepFailure(`expected a list of token ids, got ${JSON.stringify(v)}`);
  return v.map(Number);
}

const tok = (o: types.LogitsOutput | undefined): Json => (o?.tokenId === undefined ? null : o.tokenId);
const handle = (h: types.KvCacheHandle | undefined): Obj => ({
  cache: h?.cacheId ?? "", num_tokens: h?.numTokens ?? 0, model_id: h?.modelId ?? "",
});

async function execute(sv: Servers, s: Obj): Promise<Obj> {
  const c = server(sv, s.server);
  const model = (s.model as string) ?? "";
  const str = (k: string) => (typeof s[k] === "string" ? (s[k] as string) : "");
  const position = typeof s.position === "number" ? s.position : undefined;
  switch (s.op) {
    case "info": {
      const r = await c.info(model);
      const models: Obj = {};
      for (const m of r.models) {
        models[m.modelId] = { vocab_size: m.vocabSize, executor: m.executor, has_tokenizer: m.hasTokenizer,
          max_sequence_length: m.maxSequenceLength, eos_token_ids: m.eosTokenIds };
      }
      return { contract_version: r.contractVersion, server_version: r.serverVersion, models };
    }
    case "tokenize":
      return { tokens: await c.tokenize(model, str("text"), { addSpecialTokens: s.add_special_tokens === true }) };
    case "detokenize":
      return { text: await c.detokenize(model, ids(s.tokens), { skipSpecialTokens: s.skip_special_tokens === true }) };
    case "prefill": {
      const out = await c.prefill(model, ids(s.tokens), { cacheId: str("cache"), sampling: sampling(s.sampling),
        cacheSalt: str("cache_salt"), bypassPrefixCache: s.bypass_prefix_cache === true, adapter: str("adapter") });
      return { ...handle(out.cache), token: tok(out.output), cached_tokens: out.cachedTokens };
    }
    case "decode": {
      const out = await c.decode(model, str("cache"), Number(s.token), { position, sampling: sampling(s.sampling) });
      return { ...handle(out.cache), token: tok(out.output) };
    }
    case "batch_decode": {
      const items: DecodeItem[] = (s.inputs as Obj[]).map((i) => ({
        cacheId: i.cache as string, tokenId: Number(i.token),
        position: typeof i.position === "number" ? i.position : undefined, sampling: sampling(i.sampling),
      }));
      const outs = await c.batchDecode(model, items);
      return { tokens: outs.map((o) => tok(o.output)), num_tokens: outs.map((o) => o.cache?.numTokens ?? 0),
        caches: outs.map((o) => o.cache?.cacheId ?? "") };
    }
    case "forward_verify": {
      const r = await c.forwardVerify(model, str("cache"), ids(s.tokens),
        { acceptGreedyPrefix: s.accept_greedy_prefix === true, sampling: sampling(s.sampling) });
      return { tokens: r.outputs.map(tok), base_len: r.baseLen, num_tokens: r.cache?.numTokens ?? 0,
        accepted_drafts: r.acceptedDrafts, accepted_tokens: r.acceptedTokens };
    }
    case "truncate": {
      const r = await c.truncateKv(model, str("cache"), Number(s.new_len));
      return { num_tokens: r.cache?.numTokens ?? 0, removed_tokens: r.removedTokens };
    }
    case "release": {
      const r = await c.releaseCache(model, str("cache"));
      return { released: r.released, freed_tokens: r.freedTokens };
    }
    case "generate": {
      const req: GenerateArgs = {
        modelId: model, sampling: sampling(s.sampling),
        stop: pb.StopConditions.fromPartial({
          maxTokens: typeof s.max_tokens === "number" ? s.max_tokens : 16, ignoreEos: s.ignore_eos === true,
          stopTokenIds: s.stop_token_ids ? ids(s.stop_token_ids) : [],
        }),
        prompt: s.tokens !== undefined ? tokenPrompt(ids(s.tokens)) : typeof s.text === "string" ? textPrompt(s.text) : undefined,
        n: typeof s.n === "number" ? s.n : 0, cacheSalt: str("cache_salt"), bypassPrefixCache: s.bypass_prefix_cache === true,
        adapter: str("adapter"), requestId: str("request_id"),
      };
      const cancelAfter = typeof s.cancel_after === "number" ? s.cancel_after : -1;
      const abortAfter = typeof s.abort_after === "number" ? s.abort_after : -1;
      const n = Math.max(1, typeof s.n === "number" ? s.n : 1);
      const samples: number[][] = Array.from({ length: n }, () => []);
      const reasons: Json[] = Array.from({ length: n }, () => null);
      const res: Obj = { cancelled: false, finish_reason: null };
      let count = 0;
      try {
        for await (const ev of c.generate(req, { timeoutMs: 60_000 })) {
          const e = ev.event;
          if (e?.$case === "started") {
            res.cache = e.started.cache?.cacheId ?? "";
            res.prompt_tokens = e.started.promptTokens;
            res.cached_tokens = e.started.cachedTokens;
          } else if (e?.$case === "token") {
            (samples[e.token.sampleIndex] ??= []).push(e.token.tokenId);
            count++;
            if (cancelAfter >= 0 && count >= cancelAfter) {
              res.cancelled = true;
              break; // leaving the loop cancels the call
            }
            if (abortAfter >= 0 && count === abortAfter) {
              res.aborted_streams = (await c.abort(model, { requestId: str("request_id") })).abortedStreams;
            }
          } else if (e?.$case === "finished") {
            const f = e.finished;
            reasons[f.sampleIndex] = enumName(pb.finishReasonToJSON(f.finishReason), "FINISH_REASON_");
            if (f.sampleIndex === 0) {
              res.finish_reason = reasons[0];
              res.prompt_tokens = f.promptTokens;
              res.generated_tokens = f.generatedTokens;
              res.text = f.text;
            }
          }
        }
        res.end_code = "OK";
      } catch (e) {
        if (abortAfter < 0 || !(e instanceof FerrumError)) throw e;
        res.end_code = e.codeName;
      }
      res.tokens = samples[0];
      res.samples = samples;
      res.finish_reasons = reasons;
      return res;
    }
    case "fork": {
      const r = await c.forkCache(model, str("cache"), { keepTokens: typeof s.keep_tokens === "number" ? s.keep_tokens : undefined,
        reserveTokens: typeof s.reserve_tokens === "number" ? s.reserve_tokens : 0 });
      return { ...handle(r.cache), shared_blocks: r.sharedBlocks };
    }
    case "loads": {
      const r = await c.loads(model);
      const l = r.loads.find((x) => x.modelId === model);
      if (!l) throw new StepFailure(`Loads has no entry for model ${JSON.stringify(model)}`);
      return { kv_event_seq: r.kvEventSeq, active_caches: l.activeCaches, cached_blocks: l.cachedBlocks, block_size: l.blockSize,
        prefix_hit_tokens: l.prefixHitTokens, prefix_queried_tokens: l.prefixQueriedTokens, resident_tokens: l.residentTokens };
    }
    case "list_caches": {
      const r = await c.listCaches(model);
      return { caches: r.caches.map((h) => h.cacheId).sort(), as_of_seq: r.asOfSeq };
    }
    case "kv_events": {
      const { msgs, resync } = await collectEvents(c, Number(s.after_seq ?? 0));
      const evs = msgs.flatMap((m) => (m.message?.$case === "event" && m.message.event.modelId === model ? [m.message.event] : []));
      let stored = 0;
      for (const m of msgs) {
        if (m.message?.$case === "blockEvent" && m.message.blockEvent.modelId === model && m.message.blockEvent.data?.$case === "stored") {
          stored += m.message.blockEvent.data.stored.blockHashes.length;
        }
      }
      return { kinds: evs.map((e) => enumName(pb.kvEventKindToJSON(e.kind), "KV_EVENT_KIND_")), caches: evs.map((e) => e.cacheId),
        num_tokens: evs.map((e) => e.numTokens), blocks_stored: stored, resync_required: resync };
    }
    case "mirror": {
      const mirror = new PrefixMirror();
      mirror.setRecipes(await c.info(""));
      const { msgs, resync } = await collectEvents(c, 0);
      if (resync) throw new StepFailure("the server's replay buffer no longer starts at seq 1 (resync_required)");
      for (const m of msgs) mirror.apply(m);
      return { blocks: mirror.keys(model).size,
        cached_tokens: mirror.cachedTokens(model, s.tokens ? ids(s.tokens) : [], str("cache_salt"), str("adapter")) };
    }
    case "abort": {
      const r = await c.abort(model, typeof s.request_id === "string" ? { requestId: s.request_id } : { cacheId: str("cache") });
      return { aborted_streams: r.abortedStreams, released_cache: r.releasedCache };
    }
    case "handoff": {
      const srcName = typeof s.server === "string" && s.server ? s.server : "main";
      const to = server(sv, s.to);
      const h = await handoff(c, to, model, str("cache"), { mode: s.mode === "pull" ? "pull" : "push",
        sourceTarget: srcName === "peer" ? sv.peerTarget : sv.mainTarget,
        reserveTokens: typeof s.reserve_tokens === "number" ? s.reserve_tokens : 0, releaseSource: false, timeoutMs: 60_000 });
      const r = h.imported;
      return { ...handle(r.cache), imported_tokens: r.importedTokens, chunks: r.chunks, bytes: r.bytes, cached_blocks: r.cachedBlocks };
    }
    case "load_adapter": {
      const r = await c.loadAdapter(model, str("name"), str("path"));
      return { name: r.adapter?.name ?? "", loaded: r.loaded, rank: r.adapter?.rank ?? 0 };
    }
    case "unload_adapter": {
      const r = await c.unloadAdapter(model, str("name"));
      return { unloaded: r.unloaded, dropped_blocks: r.droppedBlocks };
    }
    default:
      throw new StepFailure(`unknown op ${JSON.stringify(s.op)}`);
  }
}

const NOT_ARGS = new Set(["expect", "save", "id", "note", "known_issue", "requires"]);

async function runStep(c: Servers, raw: Obj, env: Map<string, Json>): Promise<void> {
  const step: Obj = {};
  for (const [k, v] of Object.entries(raw)) if (!NOT_ARGS.has(k)) step[k] = resolve(v, env);
  const wantCode = raw.expect_code as string | undefined;
  const wantReason = raw.expect_reason as string | undefined;
  let result: Obj;
  try {
    result = await execute(c, step);
  } catch (e) {
    if (e instanceof StepFailure) throw e;
    if (!(e instanceof FerrumError)) throw new StepFailure(`unexpected error: ${e}`);
    if (!wantCode) throw new StepFailure(`unexpected error ${e.codeName} (${e.kind}): ${e.details}`);
    if (e.codeName !== wantCode) throw new StepFailure(`expected ${wantCode}, got ${e.codeName} (${e.kind}): ${e.details}`);
    if (wantReason && e.kind !== wantReason) {
      throw new StepFailure(`expected ErrorInfo reason ${wantReason}, got ${JSON.stringify(e.kind)}: ${e.details}`);
    }
    return;
  }
  if (wantCode) throw new StepFailure(`expected ${wantCode}, got success: ${JSON.stringify(result)}`);
  const diffs = mismatches(resolve(raw.expect ?? {}, env), result);
  if (diffs.length) throw new StepFailure(diffs.join("; "));
  for (const [field, v] of Object.entries((raw.save as Obj) ?? {})) {
    if (!(field in result)) throw new StepFailure(`save: no field ${field} in the result`);
    env.set(v as string, result[field]);
  }
}

/**
 * Run every step in order; one line per step and a final "N passed, N failed" line via `out`.
 * `servers`: a client (steps on the main server only) or the main and peer servers of the run;
 * `vars` seed the variables (default: the scenario's, placeholders unfilled).
 */
export async function runScenario(servers: FerrumClient | Servers, sc: Scenario, out: (line: string) => void = console.log,
  vars?: Record<string, unknown>): Promise<Summary> {
  const sv: Servers = servers instanceof FerrumClient ? { main: servers, mainTarget: servers.target } : servers;
  const c = sv;
  const env = new Map<string, Json>(Object.entries((vars ?? sc.vars ?? {}) as Obj));
  env.set("main_target", sv.mainTarget);
  env.set("peer_target", sv.peerTarget ?? "");
  const sum: Summary = { passed: 0, failed: 0, xfailed: 0, skipped: 0, steps: [] };
  for (const raw of sc.steps) {
    if (typeof raw.requires === "string" && !env.get(raw.requires)) {
      sum.skipped++;
      out(`SKIP ${raw.id} (${raw.op}): requires ${raw.requires}`);
      sum.steps.push({ id: raw.id as string, op: raw.op as string, status: "SKIP", ms: 0 });
      continue;
    }
    const t0 = Date.now();
    const deadline = t0 + (typeof raw.eventually_ms === "number" ? raw.eventually_ms : 0);
    let err: string | undefined;
    for (;;) {
      try {
        await runStep(c, raw, env);
        err = undefined;
      } catch (e) {
        err = e instanceof Error ? e.message : String(e);
      }
      if (err === undefined || Date.now() >= deadline) break;
      await new Promise((r) => setTimeout(r, 100));
    }
    const known = typeof raw.known_issue === "string" ? raw.known_issue : "";
    const status = err === undefined ? "PASS" : known ? "XFAIL" : "FAIL";
    if (status === "PASS") sum.passed++;
    else if (status === "XFAIL") sum.xfailed++;
    else sum.failed++;
    const ms = Date.now() - t0;
    let line = `${status} ${raw.id} (${raw.op}, ${ms} ms)`;
    if (err) line += `: ${err}`;
    if (known && status !== "PASS") line += ` [known issue: ${known}]`;
    out(line);
    sum.steps.push({ id: raw.id as string, op: raw.op as string, status, error: err, ms });
  }
  if (sum.xfailed) out(`${sum.xfailed} known issue(s) (XFAIL)`);
  if (sum.skipped) out(`${sum.skipped} skipped (SKIP: not supported by this profile)`);
  out(`${sum.passed} passed, ${sum.failed} failed`);
  return sum;
}
