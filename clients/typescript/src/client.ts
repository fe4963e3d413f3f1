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
  credentials as grpcCredentials,
  Metadata,
  ServiceError,
} from "@grpc/grpc-js";
import { BinaryReader, BinaryWriter } from "@bufbuild/protobuf/wire";
import * as pb from "./gen/ferrum/executor/v1/executor";
import * as types from "./gen/ferrum/executor/v1/types";
import { FerrumError } from "./errors";

export interface ClientOptions {
  /** Default: insecure (plaintext). `credentials.createSsl(...)` for TLS / mutual TLS. */
  credentials?: ChannelCredentials;
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
  private readonly token?: string;
  private readonly defaultTimeoutMs: number;

  constructor(target: string, opts: ClientOptions = {}) {
    this.raw = new pb.ModelExecutorClient(target, opts.credentials ?? grpcCredentials.createInsecure(), {
      "grpc.max_receive_message_length": 64 << 20,
      "grpc.max_send_message_length": 64 << 20,
      ...opts.channelOptions,
    });
    this.token = opts.token;
    this.defaultTimeoutMs = opts.defaultTimeoutMs ?? 60_000;
  }

  close(): void {
    this.raw.close();
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
  truncateKv(modelId: string, cacheId: string, newLen: number, o?: CallOpts): Promise<pb.TruncateKvResponse> {
    return this.unary(this.raw.truncateKv, pb.TruncateKvRequest.fromPartial({ modelId, cacheId, newLen }), o);
  }

  /** Free a cache (idempotent: `released` is false when it was already gone). */
  releaseCache(modelId: string, cacheId: string, o?: CallOpts): Promise<pb.ReleaseCacheResponse> {
    return this.unary(this.raw.releaseCache, pb.ReleaseCacheRequest.fromPartial({ modelId, cacheId }), o);
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
   */
  async *generate(req: GenerateArgs, o: CallOpts = {}): AsyncGenerator<pb.GenerateResponse> {
    const opts: Partial<CallOptions> = o.timeoutMs ? { deadline: Date.now() + o.timeoutMs } : {};
    const call = this.raw.generate(pb.GenerateRequest.fromPartial(req as pb.GenerateRequest), this.metadata(), opts);
    const onAbort = () => call.cancel();
    o.signal?.addEventListener("abort", onAbort, { once: true });
    try {
      for await (const ev of call as AsyncIterable<pb.GenerateResponse>) yield ev;
    } catch (e) {
      throw FerrumError.fromServiceError(e as ServiceError);
    } finally {
      o.signal?.removeEventListener("abort", onAbort);
      call.cancel();
    }
  }

  /** Run a generation to the end: the started event, the tokens and the finished event. */
  async generateAll(req: GenerateArgs, o: CallOpts = {}):
    Promise<{ started?: pb.GenerateStarted; tokens: number[]; finished?: pb.GenerateFinished }> {
    const res: { started?: pb.GenerateStarted; tokens: number[]; finished?: pb.GenerateFinished } = { tokens: [] };
    for await (const ev of this.generate(req, o)) {
      if (ev.event?.$case === "started") res.started = ev.event.started;
      else if (ev.event?.$case === "token") res.tokens.push(ev.event.token.tokenId);
      else if (ev.event?.$case === "finished") res.finished = ev.event.finished;
    }
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
