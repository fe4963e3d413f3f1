/**
 * Fresh ferrum-service servers for tests and examples, started through
 * tests/conformance/harness.py `serve` (which uses $FERRUM_SERVER_CMD, else <repo>/.venv/bin/ferrum-service).
 * The harness stops its server when our end of its stdin closes, so even a killed test process
 * leaves no server behind.
 */
import { ChildProcess, execFileSync, spawn } from "node:child_process";
import { existsSync } from "node:fs";
import * as path from "node:path";
import { createInterface } from "node:readline";

/** The ferrum-service checkout (the directory holding protos/ferrum). */
export function repoRoot(from = __dirname): string {
  let dir = path.resolve(from);
  for (;;) {
    if (existsSync(path.join(dir, "protos", "ferrum"))) return dir;
    const parent = path.dirname(dir);
    if (parent === dir) throw new Error("not inside a ferrum-service checkout (no protos/ferrum above " + from + ")");
    dir = parent;
  }
}

/** Why no server can be started, or undefined when one can. */
export function noServerReason(): string | undefined {
  const cmd = process.env.FERRUM_SERVER_CMD?.trim();
  if (cmd) {
    const exe = cmd.split(/\s+/)[0];
    return exe.includes("/") && !existsSync(exe) ? `FERRUM_SERVER_CMD=${cmd}: ${exe} does not exist` : undefined;
  }
  return existsSync(path.join(repoRoot(), ".venv", "bin", "ferrum-service"))
    ? undefined
    : "no ferrum-service command: set FERRUM_SERVER_CMD or create the venv (<repo>/.venv)";
}

/** The Python that has ferrum_service installed (next to the server command, or the venv's). */
export function python(): string {
  if (process.env.FERRUM_PYTHON) return process.env.FERRUM_PYTHON;
  const exe = process.env.FERRUM_SERVER_CMD?.trim().split(/\s+/)[0];
  if (exe && exe.includes("/")) {
    const py = path.join(path.dirname(exe), "python");
    if (existsSync(py)) return py;
  }
  const venv = path.join(repoRoot(), ".venv", "bin", "python");
  return existsSync(venv) ? venv : "python3";
}

export function scenarioPath(): string {
  return path.join(repoRoot(), "tests", "conformance", "scenario.json");
}

export interface TestServer {
  target: string;
  stop(): Promise<void>;
}

/**
 * Start a fresh server hosting `models` (--model specs; "${TINY_MODEL_DIR}" is the tiny random
 * llama). No models = the conformance scenario's. Resolves once health says SERVING.
 */
export function startServer(models: string[] = [], readyTimeoutMs = 180_000, extraArgs: string[] = []): Promise<TestServer> {
  const args: string[] = [];
  for (const m of models) args.push("--model", m);
  // harness.py serve hands --server-arg values to the server as they are
  return serve([...args, ...extraArgs.map((a) => `--server-arg=${a}`)], readyTimeoutMs);
}

/** A fresh scenario server of `profile` ("" = the top-level models) with the scenario's server
 * arguments; `peer`: the second server of the KV handoff steps (its peer arguments). */
export function startScenarioServer(profile = "", peer = false, readyTimeoutMs = 180_000): Promise<TestServer> {
  return serve([...(profile ? ["--profile", profile] : []), ...(peer ? ["--peer"] : [])], readyTimeoutMs);
}

/** The variables a profile seeds (placeholders filled in by the harness). */
export function scenarioVars(profile = ""): Record<string, unknown> {
  const root = repoRoot();
  const out = execFileSync(python(), [path.join(root, "tests", "conformance", "harness.py"), "vars",
    ...(profile ? ["--profile", profile] : [])], { cwd: root, env: { ...process.env, HF_HUB_OFFLINE: "1" }, encoding: "utf8" });
  return JSON.parse(out) as Record<string, unknown>;
}

function serve(extra: string[], readyTimeoutMs: number): Promise<TestServer> {
  const root = repoRoot();
  const args = [path.join(root, "tests", "conformance", "harness.py"), "serve", ...extra];
  const child: ChildProcess = spawn(python(), args, {
    cwd: root, stdio: ["pipe", "pipe", "inherit"], env: { ...process.env, HF_HUB_OFFLINE: "1" },
  });
  const exited = new Promise<void>((resolve) => child.once("exit", () => resolve()));
  const stop = async () => {
    child.stdin?.end();
    const t = setTimeout(() => child.kill("SIGTERM"), 20_000);
    await exited;
    clearTimeout(t);
  };
  return new Promise<TestServer>((resolve, reject) => {
    const timer = setTimeout(() => {
      void stop();
      reject(new Error(`server not ready after ${readyTimeoutMs} ms`));
    }, readyTimeoutMs);
    const lines = createInterface({ input: child.stdout! });
    lines.on("line", (line) => {
      const m = /^READY (\S+)$/.exec(line.trim());
      if (m) {
        clearTimeout(timer);
        resolve({ target: m[1], stop });
      }
    });
    child.once("exit", (code) => {
      clearTimeout(timer);
      reject(new Error(`server harness exited with ${code} before READY`));
    });
  });
}
