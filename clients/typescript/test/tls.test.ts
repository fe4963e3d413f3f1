// TLS, mutual TLS and a bearer token through FerrumClient's options (`tls`, `token`) against a live
// server started with --tls-cert/--tls-key/--tls-client-ca/--auth-token-file (certificates made
// here with openssl): the right CA, client certificate and token work on unary and streaming calls;
// a missing token, a missing client certificate, another CA or plaintext are refused.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { ChildProcess, execFileSync, spawn } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import * as path from "node:path";
import { FerrumClient, FerrumError, generateArgs } from "../src";
import { noServerReason, repoRoot } from "../src/testserver";

const skip = noServerReason() ?? (hasOpenssl() ? undefined : "no openssl");
const opts = { skip: skip ? `skipping: ${skip}` : false, timeout: 120_000 };
let dir = "";
let proc: ChildProcess | undefined;
let target = "";
const pem = (n: string) => readFileSync(path.join(dir, n));

function hasOpenssl(): boolean {
  try {
    execFileSync("openssl", ["version"], { stdio: "ignore" });
    return true;
  } catch {
    return false;
  }
}

function ssl(...args: string[]): void {
  execFileSync("openssl", args, { cwd: dir, stdio: "ignore" });
}

/** A CA, a server certificate for 127.0.0.1 and a client certificate from it; another CA. */
function pki(): void {
  for (const ca of ["ca", "other"]) {
    ssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
      "-subj", `/CN=${ca}`, "-keyout", `${ca}.key`, "-out", `${ca}.crt`);
  }
  const issue = (name: string, ext: string) => {
    ssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", `/CN=${name}`,
      "-keyout", `${name}.key`, "-out", `${name}.csr`);
    writeFileSync(path.join(dir, `${name}.ext`), ext);
    ssl("x509", "-req", "-in", `${name}.csr`, "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1",
      "-extfile", `${name}.ext`, "-out", `${name}.crt`);
  };
  issue("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n");
  issue("client", "extendedKeyUsage=clientAuth\n");
  writeFileSync(path.join(dir, "tokens"), "tls-token\n");
}

function freePort(): Promise<number> {
  return new Promise((resolve) => {
    const s = createServer().listen(0, "127.0.0.1", () => {
      const p = (s.address() as { port: number }).port;
      s.close(() => resolve(p));
    });
  });
}

const good = () => new FerrumClient(target, { token: "tls-token", defaultTimeoutMs: 10_000,
  tls: { rootCerts: pem("ca.crt"), privateKey: pem("client.key"), certChain: pem("client.crt") } });

before(async () => {
  if (skip) return;
  dir = mkdtempSync(path.join(tmpdir(), "ferrum-ts-tls-"));
  pki();
  const port = await freePort();
  const cmd = (process.env.FERRUM_SERVER_CMD?.trim() || path.join(repoRoot(), ".venv", "bin", "ferrum-service")).split(/\s+/);
  proc = spawn(cmd[0], [...cmd.slice(1), "serve", "--host", "127.0.0.1", "--port", String(port), "--metrics-port", "0",
    "--model", "configurable,id=mock,vocab_size=1000,token_sequence=10:20:30",
    "--tls-cert", path.join(dir, "server.crt"), "--tls-key", path.join(dir, "server.key"),
    "--tls-client-ca", path.join(dir, "ca.crt"), "--auth-token-file", path.join(dir, "tokens")],
  { cwd: repoRoot(), stdio: ["ignore", "ignore", "inherit"], env: { ...process.env, HF_HUB_OFFLINE: "1" } });
  target = `127.0.0.1:${port}`;
  const c = good();
  try {
    await c.waitReady(90_000);
  } finally {
    c.close();
  }
});

after(() => {
  proc?.kill("SIGTERM");
  if (dir) rmSync(dir, { recursive: true, force: true });
});

async function refused(c: FerrumClient): Promise<number> {
  try {
    await c.prefill("mock", [1, 2]);
  } catch (e) {
    assert.ok(e instanceof FerrumError, String(e));
    return e.code;
  } finally {
    c.close();
  }
  assert.fail("expected a refusal");
}

test("mutual TLS and a token: unary, server stream and session calls work", opts, async () => {
  const c = good();
  try {
    const pre = await c.prefill("mock", [1, 2, 3]);
    assert.equal(pre.cache!.numTokens, 3);
    const gen = await c.generateAll(generateArgs("mock", [1, 2], { maxTokens: 3, ignoreEos: true }));
    assert.equal(gen.tokens.length, 3);
    const s = c.session();
    const d = await s.decode("mock", pre.cache!.cacheId, 10);
    assert.equal(d.output!.cache!.numTokens, 4);
    await s.close();
    assert.equal((await c.releaseCache("mock", pre.cache!.cacheId)).released, true);
  } finally {
    c.close();
  }
});

test("no token, no client certificate, another CA, plaintext: refused", opts, async () => {
  const tls = { rootCerts: pem("ca.crt"), privateKey: pem("client.key"), certChain: pem("client.crt") };
  assert.equal(await refused(new FerrumClient(target, { tls, defaultTimeoutMs: 5000 })), 16); // UNAUTHENTICATED
  assert.equal(await refused(new FerrumClient(target, { token: "wrong", tls, defaultTimeoutMs: 5000 })), 16);
  assert.equal(await refused(new FerrumClient(target, { token: "tls-token", tls: { rootCerts: pem("ca.crt") }, defaultTimeoutMs: 5000 })), 14);
  assert.equal(await refused(new FerrumClient(target, { token: "tls-token", tls: { ...tls, rootCerts: pem("other.crt") }, defaultTimeoutMs: 5000 })), 14);
  assert.equal(await refused(new FerrumClient(target, { token: "tls-token", defaultTimeoutMs: 5000 })), 14);
});
