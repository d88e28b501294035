/**
 * A real `kvmesh head` (demo-tiny) as the edge's origin. Python is `KVMESH_PYTHON`,
 * else `python3`, with kvmesh importable (PYTHONPATH or installed).
 */

import { spawn } from "node:child_process";
import { mkdtempSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createInterface } from "node:readline";

export const KEY = "edge-test-key-0123456789";

/**
 * Starts a head on `listen` (a free port by default) with `KEY` as its API key.
 * @param {string} listen
 * @returns {Promise<{url: string, proc: import("node:child_process").ChildProcess}>}
 */
export function startHead(listen = "127.0.0.1:0", timeoutMs = 120_000) {
  const keys = join(mkdtempSync(join(tmpdir(), "kvmesh-edge-")), "api-keys");
  writeFileSync(keys, `${KEY}\n`);
  const args = ["-m", "kvmesh.cli", "head", "--model", "demo-tiny", "--listen", listen, "--admin-key-file", keys, "--alias", "edge-head"];
  const proc = spawn(process.env.KVMESH_PYTHON ?? "python3", args, { stdio: ["ignore", "pipe", "inherit"] });
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => {
      proc.kill("SIGKILL");
      reject(new Error("kvmesh head did not start in time"));
    }, timeoutMs);
    proc.once("exit", (code) => {
      clearTimeout(timer);
      reject(new Error(`kvmesh head exited (${code}) before it listened`));
    });
    createInterface({ input: /** @type {import("node:stream").Readable} */ (proc.stdout) }).once("line", (line) => {
      clearTimeout(timer);
      const m = /(https?:\/\/\S+) grpc/.exec(line);
      if (m) resolve({ url: /** @type {string} */ (m[1]), proc });
      else {
        proc.kill("SIGKILL");
        reject(new Error(`kvmesh head did not start: ${line}`));
      }
    });
  });
}

/** Stops a head (SIGTERM, then SIGKILL after 15 s); resolves once it exited. */
export async function stopHead(/** @type {import("node:child_process").ChildProcess} */ proc, signal = "SIGTERM") {
  if (proc.exitCode !== null || proc.signalCode !== null) return;
  const exited = new Promise((r) => proc.once("exit", r));
  proc.kill(/** @type {NodeJS.Signals} */ (signal));
  const t = setTimeout(() => proc.kill("SIGKILL"), 15_000);
  await exited;
  clearTimeout(t);
}
