export * from "./client";
export * from "./errors";
export * from "./prefixKeys";
export * from "./prefixMirror";
export * from "./router";
export * from "./handoff";
export * as pb from "./gen/ferrum/executor/v1/executor";
export * as types from "./gen/ferrum/executor/v1/types";
