/**
 * A thin TypeScript client for the ferrum executor contract (ferrum.executor.v1 ModelExecutor).
 *
 *   const c = new FerrumClient("127.0.0.1:50051");
 *   const pre = await c.prefill("tiny", [1, 2, 3]);
 *   const step = await c.decode("tiny", pre.cache!.cacheId, tokenOf(pre.output));
 *   for await (const ev of c.generate({ modelId: "tiny", prompt: tokenPrompt([1, 2, 3]) })) { ... }
 *
 * Every call takes `timeoutMs` (its deadline; a default applies) and `signal` (an AbortSignal that
 * cancels it). Failures reject with a FerrumError.
 */
import {
  CallOptions,
  ChannelCredentials,
  ChannelOptions,
  ClientDuplexStream,
  ClientReadableStream,
  credentials as grpcCredentials,
  Metadata,
  ServiceError,
  status as grpcStatus,
} from "@grpc/grpc-js";
import { BinaryReader, BinaryWriter } from "@bufbuild/protobuf/wire";
import * as pb from "./gen/ferrum/executor/v1/executor";
import * as types from "./gen/ferrum/executor/v1/types";
import { FerrumError } from "./errors";

export interface ClientOptions {
  /** Default: insecure (plaintext), or TLS when `tls` is given. `credentials.createSsl(...)` for full control. */
  credentials?: ChannelCredentials;
  /** TLS: the CA certificate(s) to trust (PEM; `{}` = the system's roots), and for mutual TLS the
   * client's key and certificate chain. Ignored when `credentials` is set. */
  tls?: { rootCerts?: Buffer; privateKey?: Buffer; certChain?: Buffer };
  /** Sent as "authorization: Bearer <token>" with every call. */
  token?: string;
  /** Deadline of unary calls that pass no timeoutMs (default 60 s; 0 = none). */
  defaultTimeoutMs?: number;
  /** Extra channel options ("grpc.max_receive_message_length" defaults to 64 MiB). */
  channelOptions?: ChannelOptions;
}

export interface CallOpts {
  /** The call's deadline, in ms from now. */
  timeoutMs?: number;
  /** Aborting it cancels the call. */
  signal?: AbortSignal;
}

/** Servers `generate` follows one stream through at most (`migrated` events); one more move
 * ends it with ABORTED. */
export const MAX_MIGRATION_HOPS = 16;

/** Options of `generate` / `generateAll`. */
export interface GenerateCallOpts extends CallOpts {
  /** Follow a `migrated` event to its target and resume there, as one stream (default true);
   * false passes the event on as the stream's last one. */
  followMigrations?: boolean;
  /** Called with each `migrated` event that is followed, before the stream resumes on its target. */
  onMigrated?: (m: pb.GenerateMigrated) => void;
}

/** Options of a step request; those that do not apply to a step are ignored. */
export interface StepOpts extends CallOpts {
  /** Prefill: append to this cache (chunked prefill) instead of creating one. */
  cacheId?: string;
  /** What the step returns per logits row (default: a greedy token). */
  policy?: Partial<types.LogitsPolicy>;
  /** Shortcut for policy.sampling. */
  sampling?: Partial<types.SamplingParams>;
  /** Decode: the position the token must be written at (the cache's length). */
  position?: number;
  /** Prefill: KV to promise for the whole sequence (prompt + new tokens). */
  reserveTokens?: number;
  /** Prefill: also return the output of every prompt position. */
  allPositions?: boolean;
  /** Safe retries: a step id is applied at most once. */
  clientStepId?: string;
  /** Prefill: the caller's request id (logs, KV events). */
  requestId?: string;
  /** Prefill: the LoRA adapter (registered with loadAdapter) a new cache is computed with and bound
   * to; unset = the base model, or, continuing `cacheId`, the cache's own adapter. */
  adapter?: string;
  /** Prefill of a new cache: the prefix-cache tenant salt (caches of other salts never share blocks). */
  cacheSalt?: string;
  /** Prefill of a new cache: compute every token, take nothing from the prefix cache. */
  bypassPrefixCache?: boolean;
}

/** One decode input of a batch. */
export interface DecodeItem {
  cacheId: string;
  tokenId: number;
  position?: number;
  sampling?: Partial<types.SamplingParams>;
  policy?: Partial<types.LogitsPolicy>;
}

/** The sampled token of an output (-1 when it has none, e.g. in full-logits mode). */
export function tokenOf(o: types.LogitsOutput | undefined): number {
  return o?.tokenId ?? -1;
}

/** A Generate prompt of token ids. */
export function tokenPrompt(tokenIds: number[]): pb.GenerateRequest["prompt"] {
  return { $case: "tokenIds", tokenIds: { tokenIds } };
}

/** A Generate prompt of text (tokenized on the server). */
export function textPrompt(text: string): pb.GenerateRequest["prompt"] {
  return { $case: "text", text };
}

/** A Generate prompt of a conversation, rendered with the model's chat template on the server. */
export function chatPrompt(messages: { role: string; content: string }[]): pb.GenerateRequest["prompt"] {
  return { $case: "chat", chat: { messages } };
}

/** Structured-output constraints for `SamplingParams.constraint` (masks computed on the server). */
export const constraints = {
  /** One JSON value valid under the schema (a JSON Schema object or its text). */
  jsonSchema(schema: string | object): types.OutputConstraint {
    return { kind: { $case: "jsonSchema", jsonSchema: typeof schema === "string" ? schema : JSON.stringify(schema) } };
  },
  /** Text the whole of which matches the regular expression. */
  regex(pattern: string): types.OutputConstraint {
    return { kind: { $case: "regex", regex: pattern } };
  },
  /** Text of a GBNF grammar (`root ::= ...`). */
  ebnf(grammar: string): types.OutputConstraint {
    return { kind: { $case: "ebnfGrammar", ebnfGrammar: grammar } };
  },
  /** Exactly one of these strings. */
  choice(choices: string[]): types.OutputConstraint {
    return { kind: { $case: "choice", choice: { choices } } };
  },
};

/** Options of a generation (`generateArgs`); everything else of `GenerateRequest` via `GenerateArgs`. */
export interface GenerateOpts {
  maxTokens?: number;
  stopTokenIds?: number[];
  stopSequences?: string[];
  ignoreEos?: boolean;
  sampling?: Partial<types.SamplingParams>;
  /** Continue this cache (with `lastTokenId` and no prompt: feed that token first). */
  cacheId?: string;
  lastTokenId?: number;
  /** Samples from the one prompt (its cache forked per sample; events carry `sampleIndex`). */
  n?: number;
  topLogprobs?: number;
  keepCache?: boolean;
  requestId?: string;
  streamText?: boolean;
  cacheSalt?: string;
  bypassPrefixCache?: boolean;
  adapter?: string;
}

/** A GenerateRequest from a prompt (token ids, text, chat messages, or none to continue `cacheId`). */
export function generateArgs(modelId: string, prompt: number[] | string | { role: string; content: string }[] | undefined,
  o: GenerateOpts = {}): GenerateArgs {
  const p = prompt === undefined ? undefined
    : typeof prompt === "string" ? textPrompt(prompt)
    : prompt.length > 0 && typeof prompt[0] === "object" ? chatPrompt(prompt as { role: string; content: string }[])
    : tokenPrompt(prompt as number[]);
  return {
    modelId, prompt: p, cacheId: o.cacheId ?? "", lastTokenId: o.lastTokenId, sampling: o.sampling,
    stop: { maxTokens: o.maxTokens ?? 16, stopTokenIds: o.stopTokenIds ?? [], stopSequences: o.stopSequences ?? [],
      ignoreEos: o.ignoreEos ?? false },
    n: o.n ?? 0, topLogprobs: o.topLogprobs ?? 0, keepCache: o.keepCache ?? false, requestId: o.requestId ?? "",
    streamText: o.streamText ?? false, cacheSalt: o.cacheSalt ?? "", bypassPrefixCache: o.bypassPrefixCache ?? false,
    adapter: o.adapter ?? "",
  } as GenerateArgs;
}

/** What `generateAll` collects: per sample (`GenerateRequest.n`), its tokens and its finished event. */
export interface GenerateResult {
  started?: pb.GenerateStarted;
  /** Sample 0's tokens (all of them for a single sample). */
  tokens: number[];
  /** Sample 0's finished event. */
  finished?: pb.GenerateFinished;
  /** Tokens per sample index. */
  samples: number[][];
  /** Finished event per sample index. */
  finishedSamples: pb.GenerateFinished[];
  /** Text pieces per sample (with `streamText`). */
  texts: string[];
  /** The servers the stream moved to and was followed to, in order. */
  migrations: string[];
  /** With `followMigrations: false`: the `migrated` event that ended the stream (resume it with
   * `resumeToken` on `target`). */
  migrated?: pb.GenerateMigrated;
}

/** The request `forkCache` sends (also a Session step). */
export function forkCacheRequest(modelId: string, cacheId: string,
  o: { keepTokens?: number; reserveTokens?: number; clientStepId?: string } = {}): pb.ForkCacheRequest {
  return pb.ForkCacheRequest.fromPartial({ modelId, cacheId, keepTokens: o.keepTokens,
    reserveTokens: o.reserveTokens ?? 0, clientStepId: o.clientStepId ?? "" });
}

/** One item of a unified (mixed prefill / decode) step. */
export interface UnifiedItem {
  seqId: string;
  tokens: number[];
  /** Empty = a new sequence (then `posOffset` 0). */
  cacheId?: string;
  posOffset?: number;
  /** Default true: logits are computed for the item. False for a non-final prefill chunk. */
  isFinalChunk?: boolean;
  policy?: Partial<types.LogitsPolicy>;
  sampling?: Partial<types.SamplingParams>;
  cacheSalt?: string;
  bypassPrefixCache?: boolean;
  adapter?: string;
}

/** The request `unifiedDecode` sends (also a Session step). */
export function unifiedDecodeRequest(modelId: string, items: UnifiedItem[], clientStepId = ""): pb.UnifiedDecodeRequest {
  return pb.UnifiedDecodeRequest.fromPartial({ modelId, clientStepId, items: items.map((i) => ({
    seqId: i.seqId, qTokens: i.tokens, cacheId: i.cacheId ?? "", posOffset: i.posOffset ?? 0,
    isFinalChunk: i.isFinalChunk ?? true, logits: policyOf(i), cacheSalt: i.cacheSalt ?? "",
    bypassPrefixCache: i.bypassPrefixCache ?? false, adapter: i.adapter ?? "",
  })) });
}

/** Options of an ImportKv (push or pull). */
export interface ImportOpts extends CallOpts {
  /** Total tokens the new cache may grow to (0 = the imported ones). */
  reserveTokens?: number;
  cacheSalt?: string;
  requestId?: string;
}

/** Where `pullKv` fetches from. */
export interface PullSource {
  /** The exporting server, host:port as the importing server reaches it. */
  target: string;
  cacheId: string;
  /** Its model id there ("" = the same). */
  modelId?: string;
  fromToken?: number;
  toToken?: number;
  tls?: boolean;
  maxChunkBytes?: number;
}

/** An exported cache range: the transfer header and its chunks, ready for `importKv`. */
export interface ExportedKv {
  header: pb.KvTransferHeader;
  chunks: pb.KvChunk[];
}

function policyOf(o: { policy?: Partial<types.LogitsPolicy>; sampling?: Partial<types.SamplingParams> }):
  types.LogitsPolicy | undefined {
  if (!o.policy && !o.sampling) return undefined;
  return types.LogitsPolicy.fromPartial({ ...o.policy, ...(o.sampling ? { sampling: o.sampling } : {}) });
}

/** The request `prefill` sends (also a Session step). */
export function prefillRequest(modelId: string, tokenIds: number[], o: StepOpts = {}): pb.PrefillRequest {
  return pb.PrefillRequest.fromPartial({
    modelId, clientStepId: o.clientStepId ?? "",
    input: {
      tokenIds, cacheId: o.cacheId ?? "", logits: policyOf(o), reserveTokens: o.reserveTokens ?? 0,
      allPositions: o.allPositions ?? false, requestId: o.requestId ?? "", adapter: o.adapter ?? "",
      cacheSalt: o.cacheSalt ?? "", bypassPrefixCache: o.bypassPrefixCache ?? false,
    },
  });
}

export function decodeInput(item: DecodeItem): pb.DecodeInput {
  return pb.DecodeInput.fromPartial({ cacheId: item.cacheId, tokenId: item.tokenId, logits: policyOf(item),
    position: item.position });
}

/** The request `decode` sends (also a Session step). */
export function decodeRequest(modelId: string, cacheId: string, tokenId: number, o: StepOpts = {}): pb.DecodeRequest {
  return pb.DecodeRequest.fromPartial({ modelId, clientStepId: o.clientStepId ?? "",
    input: decodeInput({ cacheId, tokenId, position: o.position, policy: o.policy, sampling: o.sampling }) });
}

/** `T` with every field, nested ones too, optional (oneof members keep their `$case`). */
export type DeepPartial<T> = T extends Buffer | Uint8Array ? T
  : T extends Array<infer U> ? Array<DeepPartial<U>>
  : T extends { $case: string } ? { [K in keyof T]?: DeepPartial<T[K]> } & { $case: T["$case"] }
  : T extends object ? { [K in keyof T]?: DeepPartial<T[K]> }
  : T;

/** A GenerateRequest where every field, nested ones too, may be left out. */
export type GenerateArgs = DeepPartial<pb.GenerateRequest>;

type Unary<Req, Resp> = (req: Req, md: Metadata, opts: Partial<CallOptions>,
  cb: (err: ServiceError | null, resp?: Resp) => void) => { cancel(): void };

export class FerrumClient {
  /** The generated grpc-js stub, for RPCs and fields this class does not wrap. */
  readonly raw: pb.ModelExecutorClient;
  /** The address this client connects to (host:port). */
  readonly target: string;
  private readonly token?: string;
  private readonly defaultTimeoutMs: number;
  /** Kept to open the same kind of connection to another server (a migrated stream's new home). */
  private readonly options: ClientOptions;
  private readonly siblings = new Map<string, FerrumClient>();

  constructor(target: string, opts: ClientOptions = {}) {
    this.options = opts;
    const creds = opts.credentials
      ?? (opts.tls ? grpcCredentials.createSsl(opts.tls.rootCerts ?? null, opts.tls.privateKey ?? null, opts.tls.certChain ?? null)
        : grpcCredentials.createInsecure());
    this.target = target;
    this.raw = new pb.ModelExecutorClient(target, creds, {
      "grpc.max_receive_message_length": 64 << 20,
      "grpc.max_send_message_length": 64 << 20,
      ...opts.channelOptions,
    });
    this.token = opts.token;
    this.defaultTimeoutMs = opts.defaultTimeoutMs ?? 60_000;
  }

  /** Close the channel (and those opened to follow migrated streams). */
  close(): void {
    for (const s of this.siblings.values()) s.close();
    this.siblings.clear();
    this.raw.close();
  }

  /** A client like this one (same credentials and options) to `target`, kept until this one closes. */
  private sibling(target: string): FerrumClient {
    let s = this.siblings.get(target);
    if (!s) {
      s = new FerrumClient(target, this.options);
      this.siblings.set(target, s);
    }
    return s;
  }

  private metadata(): Metadata {
    const md = new Metadata();
    if (this.token) md.set("authorization", `Bearer ${this.token}`);
    return md;
  }

  private unary<Req, Resp>(method: Unary<Req, Resp>, req: Req, o: CallOpts = {}): Promise<Resp> {
    const timeout = o.timeoutMs ?? this.defaultTimeoutMs;
    const callOpts: Partial<CallOptions> = timeout > 0 ? { deadline: Date.now() + timeout } : {};
    return new Promise<Resp>((resolve, reject) => {
      if (o.signal?.aborted) {
        reject(new FerrumError(1, "cancelled before the call"));
        return;
      }
      const call = method.call(this.raw, req, this.metadata(), callOpts, (err, resp) => {
        o.signal?.removeEventListener("abort", onAbort);
        if (err) reject(FerrumError.fromServiceError(err));
        else resolve(resp as Resp);
      });
      const onAbort = () => call.cancel();
      o.signal?.addEventListener("abort", onAbort, { once: true });
    });
  }

  /** grpc.health.v1 status of `service` ("" = the whole server): "SERVING", "NOT_SERVING", ... */
  health(service = "", o: CallOpts = {}): Promise<string> {
    const names = ["UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"];
    const timeout = o.timeoutMs ?? 5000;
    return new Promise((resolve, reject) => {
      this.raw.makeUnaryRequest<string, number>(
        "/grpc.health.v1.Health/Check",
        (s) => Buffer.from(new BinaryWriter().uint32(10).string(s).finish()),
        (buf) => {
          const r = new BinaryReader(buf);
          let st = 0;
          while (r.pos < r.len) {
            const [f, w] = r.tag();
            if (f === 1 && w === 0) st = r.int32();
            else r.skip(w);
          }
          return st;
        },
        service, this.metadata(), { deadline: Date.now() + timeout },
        (err, st) => (err ? reject(FerrumError.fromServiceError(err)) : resolve(names[st ?? 0] ?? String(st))),
      );
    });
  }

  /** Poll health until SERVING (rejects after timeoutMs). */
  async waitReady(timeoutMs = 60_000): Promise<void> {
    const deadline = Date.now() + timeoutMs;
    let last: unknown;
    for (;;) {
      try {
        if ((await this.health("", { timeoutMs: 2000 })) === "SERVING") return;
      } catch (e) {
        last = e;
      }
      if (Date.now() > deadline) throw new Error(`server not SERVING after ${timeoutMs} ms (${last})`);
      await new Promise((r) => setTimeout(r, 100));
    }
  }

  info(modelId = "", o?: CallOpts): Promise<pb.InfoResponse> {
    return this.unary(this.raw.info, pb.InfoRequest.fromPartial({ modelId }), o);
  }

  async capabilities(modelId = "", o?: CallOpts): Promise<types.ExecutorCapabilities | undefined> {
    return (await this.unary(this.raw.capabilities, pb.CapabilitiesRequest.fromPartial({ modelId }), o)).capabilities;
  }

  async kvCapacity(modelId = "", o?: CallOpts): Promise<types.KvCapacity | undefined> {
    return (await this.unary(this.raw.kvCapacity, pb.KvCapacityRequest.fromPartial({ modelId }), o)).capacity;
  }

  async tokenize(modelId: string, text: string, o: CallOpts & { addSpecialTokens?: boolean } = {}): Promise<number[]> {
    const r = await this.unary(this.raw.tokenize,
      pb.TokenizeRequest.fromPartial({ modelId, text, addSpecialTokens: o.addSpecialTokens ?? false }), o);
    return r.tokenIds;
  }

  async detokenize(modelId: string, tokenIds: number[], o: CallOpts & { skipSpecialTokens?: boolean } = {}): Promise<string> {
    const r = await this.unary(this.raw.detokenize,
      pb.DetokenizeRequest.fromPartial({ modelId, tokenIds, skipSpecialTokens: o.skipSpecialTokens ?? false }), o);
    return r.text;
  }

  /** Run a prompt (or, with `cacheId`, a further chunk of one): the cache and the last position's output. */
  async prefill(modelId: string, tokenIds: number[], o: StepOpts = {}): Promise<pb.PrefillOutput> {
    return (await this.unary(this.raw.prefill, prefillRequest(modelId, tokenIds, o), o)).output!;
  }

  /** Several prompts in one forward (all or nothing). */
  async batchPrefill(modelId: string, inputs: Partial<pb.PrefillInput>[], o?: CallOpts): Promise<pb.PrefillOutput[]> {
    return (await this.unary(this.raw.batchPrefill, pb.BatchPrefillRequest.fromPartial({ modelId, inputs }), o)).outputs;
  }

  /** Feed one token into a cache; the next output. */
  async decode(modelId: string, cacheId: string, tokenId: number, o: StepOpts = {}): Promise<pb.DecodeOutput> {
    return (await this.unary(this.raw.decode, decodeRequest(modelId, cacheId, tokenId, o), o)).output!;
  }

  /** One token into each of several caches in one forward; outputs in input order (all or nothing). */
  async batchDecode(modelId: string, items: DecodeItem[], o: CallOpts & { clientStepId?: string } = {}): Promise<pb.DecodeOutput[]> {
    const req = pb.BatchDecodeRequest.fromPartial({ modelId, inputs: items.map(decodeInput), clientStepId: o.clientStepId ?? "" });
    return (await this.unary(this.raw.batchDecode, req, o)).outputs;
  }

  /** The last accepted token then the drafts, in one forward; one output per token. With
   * `acceptGreedyPrefix` the server accepts the drafts matching its greedy tokens and truncates. */
  forwardVerify(modelId: string, cacheId: string, tokenIds: number[],
    o: StepOpts & { acceptGreedyPrefix?: boolean } = {}): Promise<pb.ForwardVerifyResponse> {
    return this.unary(this.raw.forwardVerify, pb.ForwardVerifyRequest.fromPartial({ modelId, cacheId, tokenIds,
      acceptGreedyPrefix: o.acceptGreedyPrefix ?? false, logits: policyOf(o), clientStepId: o.clientStepId ?? "" }), o);
  }

  /** Roll a cache back to `newLen` tokens. */
  truncateKv(modelId: string, cacheId: string, newLen: number, o: CallOpts & { clientStepId?: string } = {}):
    Promise<pb.TruncateKvResponse> {
    return this.unary(this.raw.truncateKv, pb.TruncateKvRequest.fromPartial({ modelId, cacheId, newLen,
      clientStepId: o.clientStepId ?? "" }), o);
  }

  /** Free a cache (idempotent: `released` is false when it was already gone). */
  releaseCache(modelId: string, cacheId: string, o: CallOpts & { clientStepId?: string } = {}):
    Promise<pb.ReleaseCacheResponse> {
    return this.unary(this.raw.releaseCache, pb.ReleaseCacheRequest.fromPartial({ modelId, cacheId,
      clientStepId: o.clientStepId ?? "" }), o);
  }

  /** A new cache sharing the first `keepTokens` tokens of `cacheId` (all when unset), copy-on-write. */
  forkCache(modelId: string, cacheId: string,
    o: CallOpts & { keepTokens?: number; reserveTokens?: number; clientStepId?: string } = {}): Promise<pb.ForkCacheResponse> {
    return this.unary(this.raw.forkCache, forkCacheRequest(modelId, cacheId, o), o);
  }

  /** Prefill chunks and decode steps in one forward (UNIMPLEMENTED without native unified decode). */
  async unifiedDecode(modelId: string, items: UnifiedItem[], o: CallOpts & { clientStepId?: string } = {}):
    Promise<pb.UnifiedDecodeResponse> {
    return this.unary(this.raw.unifiedDecode, unifiedDecodeRequest(modelId, items, o.clientStepId), o);
  }

  /** A cache-less full forward over token ids `[batch][seq]`: logits `[batch, seq, vocab]` (or hidden states). */
  async forward(modelId: string, tokenIds: number[][], o: CallOpts & { logitsDtype?: types.DataType } = {}):
    Promise<pb.ForwardResponse> {
    const rows = tokenIds.length;
    const cols = rows ? tokenIds[0].length : 0;
    const data = Buffer.alloc(rows * cols * 4);
    tokenIds.forEach((row, i) => {
      if (row.length !== cols) throw new Error("forward: every row needs the same length");
      row.forEach((t, j) => data.writeInt32LE(t, (i * cols + j) * 4));
    });
    const input = types.Tensor.fromPartial({ dtype: types.DataType.DATA_TYPE_INT32, shape: [rows, cols], data });
    return this.unary(this.raw.forward, pb.ForwardRequest.fromPartial({ modelId, input,
      logitsDtype: o.logitsDtype ?? types.DataType.DATA_TYPE_FP32 }), o);
  }

  /** The model's state, operation counts and metrics. */
  status(modelId = "", o?: CallOpts): Promise<pb.StatusResponse> {
    return this.unary(this.raw.status, pb.StatusRequest.fromPartial({ modelId }), o);
  }

  /** The model's admission limits (absent where the executor has none). */
  admissionLimits(modelId = "", o?: CallOpts): Promise<pb.AdmissionLimitsResponse> {
    return this.unary(this.raw.admissionLimits, pb.AdmissionLimitsRequest.fromPartial({ modelId }), o);
  }

  /** Paged-KV admission at a batch boundary (RESOURCE_EXHAUSTED = defer). */
  reserveKvSlots(modelId: string, requests: Partial<types.KvSlotRequest>[], o?: CallOpts): Promise<pb.ReserveKvSlotsResponse> {
    return this.unary(this.raw.reserveKvSlots, pb.ReserveKvSlotsRequest.fromPartial({ modelId, requests }), o);
  }

  /** The paged-KV snapshot (absent where the executor does not page). */
  kvSlotCapacity(modelId = "", o?: CallOpts): Promise<pb.KvSlotCapacityResponse> {
    return this.unary(this.raw.kvSlotCapacity, pb.KvSlotCapacityRequest.fromPartial({ modelId }), o);
  }

  /** The executor's cache metrics (a JSON object; undefined = none). */
  async cacheMetrics(modelId = "", o?: CallOpts): Promise<{ [k: string]: unknown } | undefined> {
    return (await this.unary(this.raw.cacheMetrics, pb.CacheMetricsRequest.fromPartial({ modelId }), o)).metrics;
  }

  /** The executor's LoRA metrics (undefined = no LoRA runtime). */
  async loraMetrics(modelId = "", o?: CallOpts): Promise<{ [k: string]: unknown } | undefined> {
    return (await this.unary(this.raw.loraMetrics, pb.LoraMetricsRequest.fromPartial({ modelId }), o)).metrics;
  }

  /** Warm the model (every model when "") up. Admin RPC. */
  warmup(modelId = "", o?: CallOpts): Promise<pb.WarmupResponse> {
    return this.unary(this.raw.warmup, pb.WarmupRequest.fromPartial({ modelId }), o);
  }

  /** Stop serving the model (every model when ""), freeing its caches. Admin RPC. */
  shutdown(modelId = "", o?: CallOpts): Promise<pb.ShutdownResponse> {
    return this.unary(this.raw.shutdown, pb.ShutdownRequest.fromPartial({ modelId }), o);
  }

  /** The model's chat template applied to messages: text and token ids. */
  applyChatTemplate(modelId: string, messages: { role: string; content: string }[],
    o: CallOpts & { addGenerationPrompt?: boolean } = {}): Promise<pb.ApplyChatTemplateResponse> {
    return this.unary(this.raw.applyChatTemplate, pb.ApplyChatTemplateRequest.fromPartial({ modelId, messages,
      addGenerationPrompt: o.addGenerationPrompt ?? true }), o);
  }

  /** Per-model load (caches, free KV, running and queued steps, latencies, prefix hits): cheap. */
  loads(modelId = "", o?: CallOpts): Promise<pb.LoadsResponse> {
    return this.unary(this.raw.loads, pb.LoadsRequest.fromPartial({ modelId }), o);
  }

  /** Every live cache, with the KV-event sequence number the snapshot is consistent with. */
  listCaches(modelId = "", o?: CallOpts): Promise<pb.ListCachesResponse> {
    return this.unary(this.raw.listCaches, pb.ListCachesRequest.fromPartial({ modelId }), o);
  }

  /** Stop a Generate by its `requestId`, or release a cache by `cacheId` (idempotent). */
  abort(modelId: string, target: { requestId: string } | { cacheId: string }, o?: CallOpts): Promise<pb.AbortResponse> {
    const t: pb.AbortRequest["target"] = "requestId" in target
      ? { $case: "requestId", requestId: target.requestId } : { $case: "cacheId", cacheId: target.cacheId };
    return this.unary(this.raw.abort, pb.AbortRequest.fromPartial({ modelId, target: t }), o);
  }

  /**
   * Cache events (and with `includeBlockEvents` prefix-cache block events) as an async iterator;
   * `fromSeq` replays the server's buffer from that sequence number (a `resyncRequired` message
   * first when it is gone). Leaving the loop or aborting `signal` ends the subscription.
   */
  subscribeKvEvents(modelId = "", o: { fromSeq?: number; includeBlockEvents?: boolean; signal?: AbortSignal } = {}):
    AsyncGenerator<pb.SubscribeKvEventsResponse> {
    const req = pb.SubscribeKvEventsRequest.fromPartial({ modelId, fromSeq: o.fromSeq,
      includeBlockEvents: o.includeBlockEvents ?? false });
    return this.stream(this.raw.subscribeKvEvents(req, this.metadata(), {}), o);
  }

  /** A cache's K/V for a token range: the transfer header, then the chunks, as an async iterator. */
  exportKv(modelId: string, cacheId: string,
    o: CallOpts & { fromToken?: number; toToken?: number; maxChunkBytes?: number } = {}): AsyncGenerator<pb.ExportKvResponse> {
    const req = pb.ExportKvRequest.fromPartial({ modelId, cacheId, fromToken: o.fromToken ?? 0, toToken: o.toToken ?? 0,
      maxChunkBytes: o.maxChunkBytes ?? 0 });
    const opts: Partial<CallOptions> = o.timeoutMs ? { deadline: Date.now() + o.timeoutMs } : {};
    return this.stream(this.raw.exportKv(req, this.metadata(), opts), o);
  }

  /** `exportKv` collected: the header and every chunk (checked for order). */
  async exportKvAll(modelId: string, cacheId: string,
    o: CallOpts & { fromToken?: number; toToken?: number; maxChunkBytes?: number } = {}): Promise<ExportedKv> {
    let header: pb.KvTransferHeader | undefined;
    const chunks: pb.KvChunk[] = [];
    for await (const m of this.exportKv(modelId, cacheId, o)) {
      if (m.message?.$case === "header") header = m.message.header;
      else if (m.message?.$case === "chunk") chunks.push(m.message.chunk);
    }
    if (!header) throw new FerrumError(13, "ExportKv: the stream had no header");
    return { header, chunks };
  }

  /** Push K/V (from `exportKvAll`, or an `exportKv` stream of another server) into a new cache here. */
  async importKv(modelId: string, kv: ExportedKv | AsyncIterable<pb.ExportKvResponse>, o: ImportOpts = {}):
    Promise<pb.ImportKvResponse> {
    const first = { modelId, reserveTokens: o.reserveTokens ?? 0, cacheSalt: o.cacheSalt ?? "", requestId: o.requestId ?? "" };
    async function* messages(): AsyncGenerator<pb.ImportKvRequest> {
      if ("header" in kv && "chunks" in kv) {
        yield pb.ImportKvRequest.fromPartial({ ...first, data: { $case: "header", header: kv.header } });
        for (const chunk of kv.chunks) yield pb.ImportKvRequest.fromPartial({ data: { $case: "chunk", chunk } });
        return;
      }
      let n = 0;
      for await (const m of kv as AsyncIterable<pb.ExportKvResponse>) {
        if (m.message?.$case === "header") yield pb.ImportKvRequest.fromPartial({ ...(n === 0 ? first : {}), data: m.message });
        else if (m.message?.$case === "chunk") yield pb.ImportKvRequest.fromPartial({ data: m.message });
        n++;
      }
    }
    return this.clientStream(messages(), o);
  }

  /** KV handoff by server pull: this server fetches the cache from `source.target` itself (ExportKv
   * there, with this client's credentials); the new cache here is the caller's. */
  pullKv(modelId: string, source: PullSource, o: ImportOpts = {}): Promise<pb.ImportKvResponse> {
    const req = pb.ImportKvRequest.fromPartial({ modelId, reserveTokens: o.reserveTokens ?? 0, cacheSalt: o.cacheSalt ?? "",
      requestId: o.requestId ?? "", source: { target: source.target, cacheId: source.cacheId, modelId: source.modelId ?? "",
        fromToken: source.fromToken ?? 0, toToken: source.toToken ?? 0, tls: source.tls ?? false,
        maxChunkBytes: source.maxChunkBytes ?? 0 } });
    return this.clientStream((async function* () { yield req; })(), o);
  }

  private async *stream<T>(call: ClientReadableStream<T>, o: { signal?: AbortSignal }): AsyncGenerator<T> {
    const onAbort = () => call.cancel();
    if (o.signal?.aborted) call.cancel();
    o.signal?.addEventListener("abort", onAbort, { once: true });
    try {
      for await (const m of call as AsyncIterable<T>) yield m;
    } catch (e) {
      throw FerrumError.fromServiceError(e as ServiceError);
    } finally {
      o.signal?.removeEventListener("abort", onAbort);
      call.cancel();
    }
  }

  private clientStream(messages: AsyncIterable<pb.ImportKvRequest>, o: CallOpts): Promise<pb.ImportKvResponse> {
    const timeout = o.timeoutMs ?? this.defaultTimeoutMs;
    const opts: Partial<CallOptions> = timeout > 0 ? { deadline: Date.now() + timeout } : {};
    return new Promise<pb.ImportKvResponse>((resolve, reject) => {
      let done = false;
      const call = this.raw.importKv(this.metadata(), opts, (err, resp) => {
        done = true;
        o.signal?.removeEventListener("abort", onAbort);
        if (err) reject(FerrumError.fromServiceError(err));
        else resolve(resp);
      });
      const onAbort = () => call.cancel();
      o.signal?.addEventListener("abort", onAbort, { once: true });
      (async () => {
        for await (const m of messages) {
          if (done) return;
          if (!call.write(m)) await new Promise<void>((r) => call.once("drain", () => r()));
        }
        call.end();
      })().catch((e) => {
        call.cancel();
        if (!done) reject(e instanceof FerrumError ? e : new FerrumError(2, `ImportKv source: ${e}`));
      });
    });
  }

  /** Register the LoRA adapter in the PEFT directory `path` (on the server's filesystem) under `name`;
   * requests then name it (`adapter`). The same name and path again is a no-op (`loaded` false). Admin RPC. */
  loadAdapter(modelId: string, name: string, path: string, o?: CallOpts): Promise<pb.LoadAdapterResponse> {
    return this.unary(this.raw.loadAdapter, pb.LoadAdapterRequest.fromPartial({ modelId, name, path }), o);
  }

  /** Forget a LoRA adapter (FAILED_PRECONDITION while a live cache is bound to it; `unloaded` is false
   * when it was not loaded). Admin RPC. */
  unloadAdapter(modelId: string, name: string, o?: CallOpts): Promise<pb.UnloadAdapterResponse> {
    return this.unary(this.raw.unloadAdapter, pb.UnloadAdapterRequest.fromPartial({ modelId, name }), o);
  }

  /** The LoRA adapters registered on a model (every model's when `modelId` is ""). */
  async listAdapters(modelId = "", o?: CallOpts): Promise<pb.AdapterInfo[]> {
    return (await this.unary(this.raw.listAdapters, pb.ListAdaptersRequest.fromPartial({ modelId }), o)).adapters;
  }

  /**
   * A generation with the decode loop on the server, as an async iterator of events (started,
   * one token event per token, finished). Leaving the `for await` loop early (break, throw) or
   * aborting `signal` cancels the call; the server then stops and frees the cache.
   *
   * A stream the server moves to a peer (a `migrated` event: `migrateStreams`, or a drain) is
   * followed there with this client's credentials and resumed by its token: the events go on as
   * one stream, without the `migrated` event and the peer's `started` event (`followMigrations:
   * false` passes `migrated` on instead; `onMigrated` sees each move). `timeoutMs` bounds the
   * whole stream, moves included.
   */
  async *generate(req: GenerateArgs, o: GenerateCallOpts = {}): AsyncGenerator<pb.GenerateResponse> {
    const opts: Partial<CallOptions> = o.timeoutMs ? { deadline: Date.now() + o.timeoutMs } : {};
    const follow = o.followMigrations ?? true;
    let request = pb.GenerateRequest.fromPartial(req as pb.GenerateRequest);
    const modelId = request.modelId;
    let client: FerrumClient = this;
    for (let hops = 0; ; hops++) {
      const call = client.raw.generate(request, client.metadata(), opts);
      const onAbort = () => call.cancel();
      if (o.signal?.aborted) call.cancel();
      o.signal?.addEventListener("abort", onAbort, { once: true });
      let moved: pb.GenerateMigrated | undefined;
      try {
        for await (const ev of call as AsyncIterable<pb.GenerateResponse>) {
          if (follow && ev.event?.$case === "migrated") {
            moved = ev.event.migrated;
            break;
          }
          if (hops > 0 && ev.event?.$case === "started") continue; // the caller saw the first one
          yield ev;
        }
      } catch (e) {
        throw e instanceof FerrumError ? e : FerrumError.fromServiceError(e as ServiceError);
      } finally {
        o.signal?.removeEventListener("abort", onAbort);
        call.cancel();
      }
      if (!moved) return;
      if (hops >= MAX_MIGRATION_HOPS) {
        throw new FerrumError(grpcStatus.ABORTED, `the stream moved more than ${MAX_MIGRATION_HOPS} times`);
      }
      o.onMigrated?.(moved);
      client = this.sibling(moved.target);
      request = pb.GenerateRequest.fromPartial({ modelId, resumeToken: moved.resumeToken });
    }
  }

  /** Move running Generate streams (every one, or those of `modelId` / `requestId`) to `target`
   * (host:port, one of this server's KV peers) without losing or repeating a token: each ends
   * here with a `migrated` event its caller follows (`generate` does). One `StreamMigration` per
   * stream, moved or refused (a refused one goes on here). `drain` also stops new work. Admin RPC. */
  migrateStreams(target: string, o: CallOpts & { modelId?: string; requestId?: string; drain?: boolean } = {}):
    Promise<pb.MigrateStreamsResponse> {
    return this.unary(this.raw.migrateStreams, pb.MigrateStreamsRequest.fromPartial({ target, modelId: o.modelId ?? "",
      requestId: o.requestId ?? "", drain: o.drain ?? false }), o);
  }

  /** Run a generation to the end: the started event, each sample's tokens and finished event. */
  async generateAll(req: GenerateArgs, o: GenerateCallOpts = {}): Promise<GenerateResult> {
    const res: GenerateResult = { tokens: [], samples: [], finishedSamples: [], texts: [], migrations: [] };
    const onMigrated = (m: pb.GenerateMigrated) => {
      res.migrations.push(m.target);
      o.onMigrated?.(m);
    };
    for await (const ev of this.generate(req, { ...o, onMigrated })) {
      const e = ev.event;
      if (e?.$case === "started") res.started = e.started;
      else if (e?.$case === "token") {
        const i = e.token.sampleIndex;
        while (res.samples.length <= i) { res.samples.push([]); res.texts.push(""); }
        res.samples[i].push(e.token.tokenId);
        res.texts[i] += e.token.text;
      } else if (e?.$case === "finished") res.finishedSamples[e.finished.sampleIndex] = e.finished;
      else if (e?.$case === "migrated") res.migrated = e.migrated;
    }
    res.tokens = res.samples[0] ?? [];
    res.finished = res.finishedSamples[0];
    return res;
  }

  /** Open a Session stream (steps in, results out in order; its caches die with it). */
  session(o: { signal?: AbortSignal } = {}): Session {
    return new Session(this.raw.session(this.metadata()), o.signal);
  }
}

/** The `step` oneof of a SessionRequest. */
export type SessionStep = NonNullable<pb.SessionRequest["step"]>;
type StepResult = Exclude<NonNullable<pb.SessionResponse["result"]>, { $case: "error" }>;

/**
 * One Session stream. `step` sends one step and resolves with its result (steps may be issued
 * concurrently: results come back in order); a failed step rejects with a FerrumError and the
 * session goes on. `close()` ends the stream, which frees the caches created on it.
 */
export class Session {
  private nextId = 0;
  private readonly waiting = new Map<number, { resolve: (r: StepResult) => void; reject: (e: Error) => void }>();
  private failure?: Error;
  private readonly ended: Promise<void>;

  constructor(private readonly call: ClientDuplexStream<pb.SessionRequest, pb.SessionResponse>, signal?: AbortSignal) {
    call.on("data", (resp: pb.SessionResponse) => {
      const w = this.waiting.get(resp.stepId);
      if (!w) return;
      this.waiting.delete(resp.stepId);
      if (!resp.result) w.reject(new Error(`session step ${resp.stepId}: empty result`));
      else if (resp.result.$case === "error") w.reject(FerrumError.fromStepError(resp.result.error));
      else w.resolve(resp.result);
    });
    this.ended = new Promise<void>((resolve) => {
      const fail = (e: Error) => {
        this.failure = e;
        for (const w of this.waiting.values()) w.reject(e);
        this.waiting.clear();
        resolve();
      };
      call.on("error", (e: ServiceError) => fail(FerrumError.fromServiceError(e)));
      call.on("end", () => fail(new Error("session stream ended")));
    });
    signal?.addEventListener("abort", () => call.cancel(), { once: true });
  }

  /** Send a raw step; resolves with the result oneof. */
  step(step: SessionStep): Promise<StepResult> {
    if (this.failure) return Promise.reject(this.failure);
    const stepId = ++this.nextId;
    return new Promise<StepResult>((resolve, reject) => {
      this.waiting.set(stepId, { resolve, reject });
      this.call.write(pb.SessionRequest.fromPartial({ stepId, step }));
    });
  }

  async prefill(modelId: string, tokenIds: number[], o: StepOpts = {}): Promise<pb.PrefillResponse> {
    const r = await this.step({ $case: "prefill", prefill: prefillRequest(modelId, tokenIds, o) });
    return (r as Extract<StepResult, { $case: "prefill" }>).prefill;
  }

  async decode(modelId: string, cacheId: string, tokenId: number, o: StepOpts = {}): Promise<pb.DecodeResponse> {
    const r = await this.step({ $case: "decode", decode: decodeRequest(modelId, cacheId, tokenId, o) });
    return (r as Extract<StepResult, { $case: "decode" }>).decode;
  }

  async batchDecode(modelId: string, items: DecodeItem[]): Promise<pb.BatchDecodeResponse> {
    const r = await this.step({ $case: "batchDecode",
      batchDecode: pb.BatchDecodeRequest.fromPartial({ modelId, inputs: items.map(decodeInput) }) });
    return (r as Extract<StepResult, { $case: "batchDecode" }>).batchDecode;
  }

  async batchPrefill(modelId: string, inputs: Partial<pb.PrefillInput>[]): Promise<pb.BatchPrefillResponse> {
    const r = await this.step({ $case: "batchPrefill", batchPrefill: pb.BatchPrefillRequest.fromPartial({ modelId, inputs }) });
    return (r as Extract<StepResult, { $case: "batchPrefill" }>).batchPrefill;
  }

  async unifiedDecode(modelId: string, items: UnifiedItem[]): Promise<pb.UnifiedDecodeResponse> {
    const r = await this.step({ $case: "unifiedDecode", unifiedDecode: unifiedDecodeRequest(modelId, items) });
    return (r as Extract<StepResult, { $case: "unifiedDecode" }>).unifiedDecode;
  }

  async forwardVerify(modelId: string, cacheId: string, tokenIds: number[],
    o: StepOpts & { acceptGreedyPrefix?: boolean } = {}): Promise<pb.ForwardVerifyResponse> {
    const r = await this.step({ $case: "forwardVerify", forwardVerify: pb.ForwardVerifyRequest.fromPartial({ modelId,
      cacheId, tokenIds, acceptGreedyPrefix: o.acceptGreedyPrefix ?? false, logits: policyOf(o) }) });
    return (r as Extract<StepResult, { $case: "forwardVerify" }>).forwardVerify;
  }

  async forkCache(modelId: string, cacheId: string, o: { keepTokens?: number; reserveTokens?: number } = {}):
    Promise<pb.ForkCacheResponse> {
    const r = await this.step({ $case: "forkCache", forkCache: forkCacheRequest(modelId, cacheId, o) });
    return (r as Extract<StepResult, { $case: "forkCache" }>).forkCache;
  }

  async truncateKv(modelId: string, cacheId: string, newLen: number): Promise<pb.TruncateKvResponse> {
    const r = await this.step({ $case: "truncateKv", truncateKv: pb.TruncateKvRequest.fromPartial({ modelId, cacheId, newLen }) });
    return (r as Extract<StepResult, { $case: "truncateKv" }>).truncateKv;
  }

  async releaseCache(modelId: string, cacheId: string): Promise<pb.ReleaseCacheResponse> {
    const r = await this.step({ $case: "releaseCache", releaseCache: pb.ReleaseCacheRequest.fromPartial({ modelId, cacheId }) });
    return (r as Extract<StepResult, { $case: "releaseCache" }>).releaseCache;
  }

  /** End the stream and wait until the server closed it. */
  async close(): Promise<void> {
    this.call.end();
    await this.ended;
  }

  /** Abort the stream. */
  cancel(): void {
    this.call.cancel();
  }
}
