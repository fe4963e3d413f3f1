import { Metadata, ServiceError, status } from "@grpc/grpc-js";
import { BinaryReader } from "@bufbuild/protobuf/wire";
import { ErrorKind, errorKindToJSON, StepError, StepProgress } from "./gen/ferrum/executor/v1/types";

/** The google.rpc.ErrorInfo domain of every error the server returns. */
export const ERROR_DOMAIN = "ferrum.executor.v1";

/** Canonical gRPC code names ("NOT_FOUND"), indexed by code. */
export const CODE_NAMES = [
  "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
  "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED",
  "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED",
] as const;

export function codeName(code: number): string {
  return CODE_NAMES[code] ?? `CODE_${code}`;
}

/**
 * A failed call: the gRPC `code` (`status.NOT_FOUND`, ...), ferrum's error `kind` (the ErrorInfo
 * reason: "UNSUPPORTED", "RESOURCE_EXHAUSTED", "REQUEST_VALIDATION", ...), the offending `field`
 * and the server's extra facts. Branch on `kind` the way ferrum's engine does: fall back on
 * UNSUPPORTED, defer on RESOURCE_EXHAUSTED (after `retryAfterMs`).
 */
export class FerrumError extends Error {
  constructor(
    readonly code: status,
    readonly details: string,
    readonly kind: string = "",
    readonly field: string = "",
    readonly metadata: Record<string, string> = {},
    readonly retryAfterMs: number | undefined = undefined,
    /** A failed step's `StepProgress` detail: which items ran, which did not and why. */
    readonly progress: StepProgress | undefined = undefined,
  ) {
    super(`${codeName(code)}${kind ? ` (${kind})` : ""}: ${details}`);
    this.name = "FerrumError";
  }

  /** "NOT_FOUND", "INVALID_ARGUMENT", ... */
  get codeName(): string {
    return codeName(this.code);
  }

  /** UNIMPLEMENTED because this mix of rows cannot run as one step (metadata reason UNSUPPORTED_SHAPE). */
  get unsupportedShape(): boolean {
    return this.kind === "UNSUPPORTED" && this.metadata["reason"] === "UNSUPPORTED_SHAPE";
  }

  static fromServiceError(e: ServiceError | Error): FerrumError {
    if (e instanceof FerrumError) return e;
    const se = e as Partial<ServiceError>;
    if (typeof se.code !== "number") return new FerrumError(status.UNKNOWN, e.message);
    let kind = "", field = "", retry: number | undefined;
    let meta: Record<string, string> = {};
    let progress: StepProgress | undefined;
    const bin = se.metadata instanceof Metadata ? se.metadata.get("grpc-status-details-bin")[0] : undefined;
    if (bin instanceof Buffer) {
      try {
        for (const d of decodeStatusDetails(bin)) {
          if (d.typeUrl.endsWith("/google.rpc.ErrorInfo")) {
            const info = decodeErrorInfo(d.value);
            kind = info.reason;
            meta = info.metadata;
            field = meta["field"] ?? "";
          } else if (d.typeUrl.endsWith("/google.rpc.RetryInfo")) {
            retry = decodeRetryDelayMs(d.value);
          } else if (d.typeUrl.endsWith("/ferrum.executor.v1.StepProgress")) {
            progress = StepProgress.decode(d.value);
          } else if (d.typeUrl.endsWith("/google.rpc.BadRequest") && !field) {
            field = decodeBadRequestField(d.value);
          }
        }
      } catch {
        // Malformed details: keep the code and message.
      }
    }
    return new FerrumError(se.code, se.details ?? e.message, kind, field, meta, retry, progress);
  }

  /** The error of a failed Session step. */
  static fromStepError(e: StepError): FerrumError {
    const kind = e.kind === ErrorKind.ERROR_KIND_UNSPECIFIED ? "" : errorKindToJSON(e.kind).replace(/^ERROR_KIND_/, "");
    return new FerrumError(e.code as status, e.message, kind, e.field, { ...e.metadata },
      e.retryAfterMs ? e.retryAfterMs : undefined, e.progress);
  }
}

// google.rpc.Status / ErrorInfo / RetryInfo / BadRequest are not part of the contract's protos;
// their few fields are decoded by hand.

interface AnyMsg { typeUrl: string; value: Uint8Array }

function decodeStatusDetails(buf: Uint8Array): AnyMsg[] {
  const r = new BinaryReader(buf);
  const out: AnyMsg[] = [];
  while (r.pos < r.len) {
    const [field, wt] = r.tag();
    if (field === 3 && wt === 2) out.push(decodeAny(r.bytes()));
    else r.skip(wt);
  }
  return out;
}

function decodeAny(buf: Uint8Array): AnyMsg {
  const r = new BinaryReader(buf);
  const m: AnyMsg = { typeUrl: "", value: new Uint8Array() };
  while (r.pos < r.len) {
    const [field, wt] = r.tag();
    if (field === 1 && wt === 2) m.typeUrl = r.string();
    else if (field === 2 && wt === 2) m.value = r.bytes();
    else r.skip(wt);
  }
  return m;
}

function decodeErrorInfo(buf: Uint8Array): { reason: string; domain: string; metadata: Record<string, string> } {
  const r = new BinaryReader(buf);
  const m = { reason: "", domain: "", metadata: {} as Record<string, string> };
  while (r.pos < r.len) {
    const [field, wt] = r.tag();
    if (field === 1 && wt === 2) m.reason = r.string();
    else if (field === 2 && wt === 2) m.domain = r.string();
    else if (field === 3 && wt === 2) {
      const e = new BinaryReader(r.bytes());
      let k = "", v = "";
      while (e.pos < e.len) {
        const [f, w] = e.tag();
        if (f === 1 && w === 2) k = e.string();
        else if (f === 2 && w === 2) v = e.string();
        else e.skip(w);
      }
      m.metadata[k] = v;
    } else r.skip(wt);
  }
  return m;
}

function decodeRetryDelayMs(buf: Uint8Array): number {
  const r = new BinaryReader(buf);
  let ms = 0;
  while (r.pos < r.len) {
    const [field, wt] = r.tag();
    if (field === 1 && wt === 2) {
      const d = new BinaryReader(r.bytes());
      while (d.pos < d.len) {
        const [f, w] = d.tag();
        if (f === 1 && w === 0) ms += Number(d.int64()) * 1000;
        else if (f === 2 && w === 0) ms += d.int32() / 1e6;
        else d.skip(w);
      }
    } else r.skip(wt);
  }
  return ms;
}

function decodeBadRequestField(buf: Uint8Array): string {
  const r = new BinaryReader(buf);
  while (r.pos < r.len) {
    const [field, wt] = r.tag();
    if (field === 1 && wt === 2) {
      const v = new BinaryReader(r.bytes());
      while (v.pos < v.len) {
        const [f, w] = v.tag();
        if (f === 1 && w === 2) return v.string();
        v.skip(w);
      }
    } else r.skip(wt);
  }
  return "";
}
