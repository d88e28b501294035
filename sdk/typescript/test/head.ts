/**
 * A real `kvmesh head` (demo-tiny model) for the end-to-end tests: vitest's global
 * setup starts one unless `KVMESH_URL` names a running head (the pytest wrapper
 * starts its own and passes `KVMESH_URL` and `KVMESH_API_KEY`). Python is
 * `KVMESH_PYTHON`, else `python3`, with kvmesh importable (PYTHONPATH or installed).
 */

import { spawn, type ChildProcess } from "node:child_process";
import { mkdtempSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createInterface } from "node:readline";
import type {} from "vitest";
import type { TestProject } from "vitest/node";

export const TEST_KEY = "sdk-test-key-0123456789";

export interface RunningHead {
  url: string;
  proc: ChildProcess;
}

/** Starts `kvmesh head` on a free loopback port; resolves with its URL once it listens. */
export function startHead(args: string[] = [], timeoutMs = 120_000): Promise<RunningHead> {
  const dir = mkdtempSync(join(tmpdir(), "kvmesh-sdk-"));
  const keys = join(dir, "api-keys");
  writeFileSync(keys, `${TEST_KEY}\n`);
  const python = process.env.KVMESH_PYTHON ?? "python3";
  const proc = spawn(
    python,
    ["-m", "kvmesh.cli", "head", "--model", "demo-tiny", "--listen", "127.0.0.1:0", "--admin-key-file", keys, "--alias", "sdk-head", ...args],
    { stdio: ["ignore", "pipe", "inherit"] },
  );
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => {
      proc.kill("SIGKILL");
      reject(new Error("kvmesh head did not start in time"));
    }, timeoutMs);
    proc.once("exit", (code) => {
      clearTimeout(timer);
      reject(new Error(`kvmesh head exited (${code}) before it listened`));
    });
    createInterface({ input: proc.stdout! }).once("line", (line) => {
      clearTimeout(timer);
      const m = /(https?:\/\/\S+) grpc/.exec(line);
      if (!m) {
        proc.kill("SIGKILL");
        reject(new Error(`kvmesh head did not start: ${line}`));
      } else resolve({ url: m[1]!, proc });
    });
  });
}

export default async function setup(project: TestProject): Promise<() => Promise<void>> {
  let head: RunningHead | undefined;
  let url = process.env.KVMESH_URL;
  let key = process.env.KVMESH_API_KEY;
  if (!url) {
    head = await startHead();
    url = head.url;
    key = TEST_KEY;
  }
  project.provide("kvmeshUrl", url);
  project.provide("kvmeshKey", key ?? "");
  return async () => {
    if (head && head.proc.exitCode === null) {
      const exited = new Promise((r) => head!.proc.once("exit", r));
      head.proc.kill("SIGTERM");
      const t = setTimeout(() => head!.proc.kill("SIGKILL"), 15_000);
      await exited;
      clearTimeout(t);
    }
  };
}

declare module "vitest" {
  export interface ProvidedContext {
    kvmeshUrl: string;
    kvmeshKey: string;
  }
}
