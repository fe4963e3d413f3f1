export * from "./client";
export * from "./errors";
export * as pb from "./gen/ferrum/executor/v1/executor";
export * as types from "./gen/ferrum/executor/v1/types";
